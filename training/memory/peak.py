"""The peak memory one rank reached: max allocated on an accelerator, peak RSS on a CPU."""

from __future__ import annotations

import resource

import torch

from training.runtime.distributed import accelerator


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: max allocated on an accelerator, peak RSS on CPU."""
    if device.type == "cpu":
        return host_peak_bytes()
    return int(accelerator().max_memory_allocated(device.index))


def host_peak_bytes() -> int:
    """The highest resident set this process has had (the kernel's count, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
