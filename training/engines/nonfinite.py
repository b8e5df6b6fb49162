"""A non-finite loss in bf16/fp32 must skip the step on every rank (fp16 overflow is the loss
scaler's business): the engines make such a loss give non-finite gradients, and their
optimizers skip an update whose global gradient norm is not finite (the norm is already reduced
across ranks, so they all decide alike). The loop counts such steps (loop/divergence.py)."""

from __future__ import annotations

import math

import torch


def poison(loss: torch.Tensor) -> torch.Tensor:
    """`loss`, or NaN with NaN gradients when it is not finite (an infinite loss can have finite
    gradients; the optimizers' skip rule looks at the gradient norm). No host sync."""
    nan_if_bad = torch.where(torch.isfinite(loss), 0.0, math.nan).detach()
    return loss * (1.0 + nan_if_bad)
