"""Learning-rate schedule: linear warmup, then cosine decay to a floor. A pure function of the
step, so resuming needs nothing but the step number."""

from __future__ import annotations

import math
from dataclasses import dataclass


def lr_at(step: int, *, lr: float, warmup: int, total: int, min_lr_ratio: float = 0.1) -> float:
    """Learning rate for optimizer step `step` (0-based) of `total`."""
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    if total <= warmup:
        return lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    floor = lr * min_lr_ratio
    return floor + 0.5 * (lr - floor) * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class Schedule:
    """--lr, --warmup, --steps and --min-lr-ratio, as one value the loop asks per step."""

    lr: float
    warmup: int
    total: int
    min_lr_ratio: float = 0.1

    def at(self, step: int) -> float:
        return lr_at(
            step, lr=self.lr, warmup=self.warmup, total=self.total, min_lr_ratio=self.min_lr_ratio
        )
