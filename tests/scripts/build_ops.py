"""Builds DeepSpeed's compiled ops that the suite's runs load, when the CPU would otherwise idle.

    python tests/scripts/build_ops.py CPUAdamBuilder AsyncIOBuilder ...

Started by tests/conftest.py at the start of a session that will need them: on a cold extension
cache each op is several CPU-minutes of g++ (async_io about 8), which the tests' waits (for a
timeout, a signal, a second host) leave room for. SCHED_IDLE, inherited by ninja and g++, gives
this process a core only when nothing else wants it; a run that needs an op before it is built
waits for it under torch's own lock, as it would for another rank building it."""

from __future__ import annotations

import os
import sys


def build(names: list[str]) -> None:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # before g++ starts: inherited
    from deepspeed.accelerator import get_accelerator

    for name in names:
        builder = get_accelerator().create_op_builder(name)
        if builder is not None and builder.is_compatible(verbose=False):
            builder.load(verbose=False)


if __name__ == "__main__":
    build(sys.argv[1:])
