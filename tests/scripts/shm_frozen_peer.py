"""Run under torchrun (2 ranks): rank 1 freezes itself (SIGSTOP) just before an all-reduce that
rank 0 waits for in DeepSpeed's shared-memory kernel, which has no timeout. The liveness
watchdog must name rank 1 and end rank 0 with exit code 4. argv: run folder, --dist-timeout."""

import os
import signal
import sys

import deepspeed.comm as ds
import torch

from training.run_exit import run_guarded
from training.runtime import distributed, shm


def train():
    info = distributed.setup(timeout_s=float(sys.argv[2]))
    assert shm.shared_memory_collectives()
    t = torch.ones(1000)
    ds.all_reduce(t)  # both ranks get through one
    print(f"rank {info.rank} pid {os.getpid()} ready", flush=True)
    if info.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    ds.all_reduce(t)
    print(f"rank {info.rank} got past the all-reduce", flush=True)


rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
distributed.exit_process(run_guarded(train, rank=rank, world=world, run_dir=sys.argv[1]))
