"""This process among its peers: the process group (distributed.py), DeepSpeed's shared-memory
all-reduce on one host (shm.py), who launched this process (launcher.py), where the ranks run (cluster.py), which rank is gone
(liveness.py), stop signals (signals.py), the matmul ceiling MFU is measured against
(flops.py), one run per run folder (runlock.py) and reading checkpoint and model files without
running code from them (safe_load.py)."""
