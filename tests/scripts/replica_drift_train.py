"""Runs training/train.py with one rank's copy of one parameter moved by one ulp in one element
after a chosen step, so the replica check at the end of the run has a difference to find.

    ZEROSTACK_TEST_DRIFT_PARAM=final_norm.weight   the parameter, as the engine's module names it
    ZEROSTACK_TEST_DRIFT_STEP=3                    after this (1-based) step of the launch
    ZEROSTACK_TEST_DRIFT_RANK=1                    the rank whose copy moves (default 1)

The engine the trainer builds is wrapped: its step() runs, then the chosen rank's copy of the
parameter moves. Never used outside tests."""

import os

import torch

from training import train

NAME = os.environ.get("ZEROSTACK_TEST_DRIFT_PARAM", "")
STEP = int(os.environ.get("ZEROSTACK_TEST_DRIFT_STEP", "0"))
RANK = int(os.environ.get("ZEROSTACK_TEST_DRIFT_RANK", "1"))
build_engine = train.build_engine


def build_drifting(*args, **kwargs):
    engine = build_engine(*args, **kwargs)
    if int(os.environ.get("RANK", "0")) != RANK:
        return engine
    param = dict(engine.module.named_parameters())[NAME]
    step, done = engine.step, [0]

    def drifting_step():
        result = step()
        done[0] += 1
        if done[0] == STEP:
            with torch.no_grad():
                first = param.data.view(-1)[:1]
                first.copy_(torch.nextafter(first, torch.full_like(first, torch.inf)))
        return result

    engine.step = drifting_step
    return engine


train.build_engine = build_drifting
train.distributed.exit_process(train.main())
