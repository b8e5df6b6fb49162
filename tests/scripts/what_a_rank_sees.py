"""What a rank starts with, written to ZEROSTACK_SEEN/RANK.json: its arguments, the launchers'
variables it has, torch's thread count, and a first draw of Python's, NumPy's and torch's
random generators (tests/test_forked_ranks.py compares forked ranks with launched ones)."""

import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch

NAMES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "GROUP_RANK",
    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "CROSS_RANK",
    "CROSS_SIZE", "CUDA_VISIBLE_DEVICES", "PYTORCH_NVML_BASED_CUDA_CHECK", "OMP_NUM_THREADS",
)  # fmt: skip
seen = {
    "argv": sys.argv[1:],
    "env": {k: os.environ.get(k) for k in NAMES},
    "threads": torch.get_num_threads(),
    "draws": [random.random(), float(np.random.rand()), float(torch.rand(1))],
}
out = Path(os.environ["ZEROSTACK_SEEN"]) / f"{os.environ['RANK']}.json"
out.write_text(json.dumps(seen))
