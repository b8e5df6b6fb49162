"""Runs training/train.py with a poisoned sample: a micro-batch holding it gets a huge, finite
loss, as a corrupt document would give.

    ZEROSTACK_TEST_POISON=12,7,301,...   the first tokens of the poisoned sample (a row of x
                                         that starts with them is poisoned, wherever it is read)
    ZEROSTACK_TEST_POISON_GAIN=40        how much the output logits of its micro-batch are scaled

The poison follows the data, not the step: a run that skips the sample never meets it. The
engine the trainer builds is wrapped: a forward hook on the output embeddings scales the logits
while a poisoned micro-batch runs forward (not during evaluation). Never used outside tests."""

import os

import torch

from training import train

MARK = [int(t) for t in os.environ.get("ZEROSTACK_TEST_POISON", "").split(",") if t.strip()]
GAIN = float(os.environ.get("ZEROSTACK_TEST_POISON_GAIN", "40"))
build_engine = train.build_engine


def build_poisoned(*args, **kwargs):
    engine = build_engine(*args, **kwargs)
    armed = [False]
    engine.module.get_output_embeddings().register_forward_hook(
        lambda mod, inputs, output: output * GAIN if armed[0] else None
    )
    forward_backward = engine.forward_backward
    mark = torch.tensor(MARK)

    def poisoned_forward_backward(x, y, boundary, **kw):
        armed[0] = bool(MARK) and bool((x[:, : len(MARK)] == mark).all(dim=1).any())
        try:
            return forward_backward(x, y, boundary, **kw)
        finally:
            armed[0] = False

    engine.forward_backward = poisoned_forward_backward
    return engine


train.build_engine = build_poisoned
train.distributed.exit_process(train.main())
