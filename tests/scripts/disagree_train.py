"""Runs training/train.py with rank 1 deciding its precision differently from rank 0's, as a
GPU of another generation would (fp16 where the others take bf16). Never used outside tests."""

import os
from dataclasses import replace

from training import startup, train

settle = startup.settle


def settle_otherwise(config, prepared, dist):
    prepared, probed = settle(config, prepared, dist)
    if int(os.environ.get("RANK", "0")) == 1:
        other = "fp16" if prepared.precision != "fp16" else "bf16"
        prepared = replace(prepared, precision=other)
    return prepared, probed


startup.settle = settle_otherwise

if __name__ == "__main__":
    train.distributed.exit_process(train.main())
