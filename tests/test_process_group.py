"""How the trainer's process group is started (training/runtime/distributed.py)."""

from __future__ import annotations

import torch

from training.runtime.distributed import bound_device


def test_an_nccl_group_is_bound_to_the_ranks_own_device():
    assert bound_device("nccl", torch.device("cuda", 3)) == {"device_id": torch.device("cuda", 3)}
    assert bound_device("gloo", torch.device("cpu")) == {}
    assert bound_device("nccl", torch.device("cuda")) == {}  # no index: nothing to bind
