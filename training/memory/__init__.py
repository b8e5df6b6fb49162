"""Memory: what model states a rank holds (state_bytes.py), the peak it reached (peak.py), and the
plan of what it will hold for a model, config and world size (plan.py)."""
