"""A run's settings: the flags (declared once, flags.py), the rule that turns a DeepSpeed JSON and
the flags into the resolved config (ds_config.py), and ZeRO-Infinity's swap paths (nvme.py)."""
