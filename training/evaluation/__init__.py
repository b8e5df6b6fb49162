"""Evaluation with EleutherAI's lm-evaluation-harness: `harness.py` runs it on a model folder,
`local_tasks.py` makes the shipped offline tasks' data, `command.py` is `python -m
training.evaluate` (a run's checkpoint exported and scored, the scores recorded in the run)."""
