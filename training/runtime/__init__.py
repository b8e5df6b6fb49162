"""This process among its peers: the process group (distributed.py), DeepSpeed's shared-memory
all-reduce on one host (shm.py), where the ranks run (cluster.py), which rank is gone
(liveness.py), stop signals (signals.py) and the matmul ceiling MFU is measured against
(flops.py)."""
