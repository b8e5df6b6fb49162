"""Runs training/train.py with the input embeddings of one rank made NaN on chosen steps.

    ZEROSTACK_TEST_NAN_STEPS=3,5,6   the (1-based) steps of this launch that go bad
    ZEROSTACK_TEST_NAN_RANK=1        the rank whose forward goes bad (default 1; 0 alone)
    ZEROSTACK_TEST_NAN_IN=grad       the loss stays finite, the gradients go NaN (default: the
                                     forward goes NaN, and the loss with it)

The engine the trainer builds is wrapped: a forward hook on its input embeddings returns NaN
(or makes their gradient NaN) while a listed step's micro-batches run (not during evaluation or the optimizer step). Never
used outside tests."""

import math
import os

import torch

from training import train

STEPS = {int(s) for s in os.environ.get("ZEROSTACK_TEST_NAN_STEPS", "").split(",") if s.strip()}
build_engine = train.build_engine


def build_with_nans(*args, **kwargs):
    engine = build_engine(*args, **kwargs)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    nan_rank = int(os.environ.get("ZEROSTACK_TEST_NAN_RANK", "1" if world > 1 else "0"))
    if int(os.environ.get("RANK", "0")) != nan_rank:
        return engine
    done, armed = [0], [False]
    module = engine.module
    emb = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None

    in_grad = os.environ.get("ZEROSTACK_TEST_NAN_IN") == "grad"

    def hook(mod, inputs, output):
        if not (armed[0] and isinstance(output, torch.Tensor)):
            return None
        if in_grad:  # the same output, whose gradient comes back NaN in backward
            output.register_hook(lambda grad: grad * math.nan)
            return None
        return output * math.nan

    (emb or module).register_forward_hook(hook)
    forward_backward, step = engine.forward_backward, engine.step

    def bad_forward_backward(x, y, boundary):
        armed[0] = done[0] + 1 in STEPS
        try:
            return forward_backward(x, y, boundary)
        finally:
            armed[0] = False

    def counted_step():
        done[0] += 1
        return step()

    engine.forward_backward, engine.step = bad_forward_backward, counted_step
    return engine


train.build_engine = build_with_nans
train.distributed.exit_process(train.main())
