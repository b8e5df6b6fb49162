"""Runs training/train.py and records, per rank, what the model's first block is handed: the
shape of its input hidden states on the first training micro-batch, and the shape of every
parameter of that block. Written to ZEROSTACK_TEST_SHAPES_DIR/rank{R}.json. The engine the
trainer builds is observed through a forward hook; nothing is changed. Never used outside tests."""

import json
import os
from pathlib import Path

from training import train

build_engine = train.build_engine


def build_observed(*args, **kwargs):
    engine = build_engine(*args, **kwargs)
    block = engine.module.layers[0]
    out = Path(os.environ["ZEROSTACK_TEST_SHAPES_DIR"]) / f"rank{os.environ.get('RANK', '0')}.json"
    params = {name: list(p.shape) for name, p in block.named_parameters()}

    def hook(module, inputs):
        if module.training and not out.exists():
            out.write_text(json.dumps({"hidden": list(inputs[0].shape), "params": params}))

    block.register_forward_pre_hook(hook)
    return engine


train.build_engine = build_observed

if __name__ == "__main__":
    train.distributed.exit_process(train.main())
