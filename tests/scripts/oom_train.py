"""Runs training/train.py with one rank put under a small address-space limit (RLIMIT_AS) at a
chosen step, after which it grows past it: the allocation the kernel refuses is a real one.

    ZEROSTACK_TEST_OOM_RANK=1     the rank that runs out of memory (default 1)
    ZEROSTACK_TEST_OOM_STEP=2     after this step (default 2)
    ZEROSTACK_TEST_OOM_GROW_MB=1024  what it then tries to allocate (default 1024)
    ZEROSTACK_TEST_OOM_CGROUP=DIR    instead of RLIMIT_AS: move the rank into a new memory cgroup
                                     DIR (cgroup v1) limited to what it holds and 64 MiB more,
                                     so the kernel's OOM killer kills it (SIGKILL) as it grows

Never used outside tests."""

import os
import resource
from pathlib import Path

import psutil
import torch

from training import train
from training.runtime import liveness

RANK = int(os.environ.get("ZEROSTACK_TEST_OOM_RANK", "1"))
STEP = int(os.environ.get("ZEROSTACK_TEST_OOM_STEP", "2"))
GROW = int(os.environ.get("ZEROSTACK_TEST_OOM_GROW_MB", "1024")) * 2**20
note_step = liveness.note_step
held = []


def note_step_then_grow(step: int) -> None:
    note_step(step)
    if step != STEP or int(os.environ.get("RANK", "0")) != RANK:
        return
    cgroup = os.environ.get("ZEROSTACK_TEST_OOM_CGROUP")
    if cgroup:
        d = Path(cgroup)
        d.mkdir()
        limit = psutil.Process().memory_info().rss + 64 * 2**20
        (d / "memory.limit_in_bytes").write_text(str(limit))
        (d / "cgroup.procs").write_text(str(os.getpid()))
    else:
        # The limit: what the process maps now and 64 MiB more (room to report, not to grow).
        limit = psutil.Process().memory_info().vms + 64 * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    held.append(torch.ones(GROW // 4))  # the rank's memory grows past its limit


liveness.note_step = note_step_then_grow

if __name__ == "__main__":
    train.distributed.exit_process(train.main())
