"""zerostack's trainer, in layers (docs/architecture.md): errors.py (a leaf), settings/,
runtime/, memory/, engines/, checkpoints/, loop/, and on top the entry points: train.py (with
preflight/, startup.py, record.py and run_exit.py), export.py, universal.py, memory_plan.py and
sample.py."""
