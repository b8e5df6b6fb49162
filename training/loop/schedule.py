"""Learning-rate schedule, a pure function of the step, so resuming needs nothing but the step
number. zerostack's own: linear warmup, then cosine decay to a floor, or warmup-stable-decay (the
peak held, then a short decay to the floor at the end). Or one of DeepSpeed's
(WarmupLR, WarmupDecayLR, WarmupCosineLR, from a ds_config `scheduler` section), computed as
DeepSpeed's class computes it, on every engine alike."""

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


def wsd_lr_at(
    step: int, *, lr: float, warmup: int, total: int, decay: int, shape: str, min_lr_ratio: float
) -> float:
    """Warmup-stable-decay for optimizer step `step` (0-based) of `total`: linear warmup, the
    peak until the last `decay` steps, then `shape` down to lr * min_lr_ratio at the last step.
    The stable phase does not depend on `total`: a checkpoint taken in it continues, with a
    new total, into that total's decay."""
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    start = total - decay
    if step < start:
        return lr
    progress = min(1.0, (step - start + 1) / decay)
    if shape == "linear":
        left = 1.0 - progress
    elif shape == "cosine":
        left = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:  # 1-sqrt
        left = 1.0 - math.sqrt(progress)
    floor = lr * min_lr_ratio
    return floor + (lr - floor) * left


def deepspeed_lr_at(step: int, s: Schedule) -> float:
    """What DeepSpeed's scheduler `s.kind` sets for optimizer step `step` (0-based). DeepSpeed
    steps its scheduler after each update, so update `step` runs at its iteration `step - 1`
    (-1: the value it sets when built)."""
    i = step - 1
    n = max(2, s.warmup)  # as DeepSpeed: a warmup of 1 step is taken as 2
    if i < n:
        if i < 0:
            ramp = 0.0
        elif s.warmup_type == "log":
            ramp = math.log(i + 1) / math.log(n)
        else:
            ramp = i / n
        if s.kind == "WarmupCosineLR":
            return 0.0 if i < 0 else s.lr * (s.start + ramp * (1.0 - s.start))
        return s.start + (s.lr - s.start) * ramp
    if s.kind == "WarmupLR":
        return s.lr
    if s.kind == "WarmupDecayLR":
        decay = max(0.0, (s.total - i) / max(1.0, s.total - n))
        return s.start + (s.lr - s.start) * decay
    progress = min(1.0, (i - n + 1) / max(1, s.total - n))
    cosine = (1 + math.cos(math.pi * progress)) / 2
    return s.lr * max(0.0, s.min_lr_ratio + (1.0 - s.min_lr_ratio) * cosine)


@dataclass(frozen=True)
class Schedule:
    """The learning rate as one value the loop asks per step. `kind` "cosine" and "wsd" are
    zerostack's (lr, warmup, total, min_lr_ratio; wsd's decay steps and shape); the others are
    DeepSpeed's, where `start` is warmup_min_lr (warmup_min_ratio for WarmupCosineLR) and
    min_lr_ratio is cos_min_ratio."""

    lr: float
    warmup: int
    total: int
    min_lr_ratio: float = 0.1
    kind: str = "cosine"
    start: float = 0.0
    warmup_type: str = "linear"
    decay: int = 0
    shape: str = "1-sqrt"

    def at(self, step: int) -> float:
        if self.kind == "wsd":
            return wsd_lr_at(
                step,
                lr=self.lr,
                warmup=self.warmup,
                total=self.total,
                decay=self.decay,
                shape=self.shape,
                min_lr_ratio=self.min_lr_ratio,
            )
        if self.kind != "cosine":
            return deepspeed_lr_at(step, self)
        return lr_at(
            step, lr=self.lr, warmup=self.warmup, total=self.total, min_lr_ratio=self.min_lr_ratio
        )
