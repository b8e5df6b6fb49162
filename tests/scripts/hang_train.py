"""Runs training/train.py with one rank hung in a collective on a chosen step.

    ZEROSTACK_TEST_HANG_STEP=6   the (1-based) step of this launch on which rank 1 hangs

Every rank makes a second process group at build time; on the step, rank 1 waits in a barrier
of that group, which rank 0 never joins, while rank 0 waits for rank 1 in the step's own
collective: both ranks are in a collective that cannot end until the collective timeout. Never
used outside tests."""

import os

import torch.distributed as dist

from training import train

STEP = int(os.environ.get("ZEROSTACK_TEST_HANG_STEP", "0"))
build_engine = train.build_engine


def wait_for_a_peer_that_never_comes(group) -> None:
    dist.barrier(group=group)


def build_hanging(*args, **kwargs):
    engine = build_engine(*args, **kwargs)
    side = dist.new_group(backend="gloo")  # every rank: new_group is collective
    step, done = engine.step, [0]

    def hanging_step():
        done[0] += 1
        if done[0] == STEP and dist.get_rank() == 1:
            wait_for_a_peer_that_never_comes(side)
        return step()

    engine.step = hanging_step
    return engine


train.build_engine = build_hanging
train.distributed.exit_process(train.main())
