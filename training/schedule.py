"""Learning-rate schedule: linear warmup, then cosine decay to a floor. A pure function of the
step, so resuming needs nothing but the step number."""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, warmup: int, total: int, min_lr_ratio: float = 0.1) -> float:
    """Learning rate for optimizer step `step` (0-based) of `total`."""
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    if total <= warmup:
        return lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    floor = lr * min_lr_ratio
    return floor + 0.5 * (lr - floor) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer, value: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = value
