"""A run's settings: its configuration, one typed tree declared once (run_config.py), read from
the command line (flags.py) over a run file (runfile.py); the rule that turns a DeepSpeed JSON and
the settings into the resolved config (ds_config.py, hparams.py); ZeRO-Infinity's swap paths
(nvme.py)."""
