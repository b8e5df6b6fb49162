"""Memory: what model states a rank holds (state_bytes.py), the peak it reached (peak.py), and the
plan of what it will hold for a model, config and world size (plan.py, on shape.py's count),
whether it fits this machine (capacity.py), the cheapest config that does (fit.py), the
trainer's check (verdict.py) and the command (plan_command.py)."""
