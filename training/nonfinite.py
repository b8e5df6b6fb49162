"""Non-finite losses and gradients in bf16/fp32 (fp16 overflow is the loss scaler's business).

A step whose loss or gradient norm is not finite on any rank is skipped on every rank: the
engines make a non-finite loss give non-finite gradients (`poison`), and their optimizers skip
an update whose global gradient norm is not finite (the norm is already reduced across ranks,
so they all decide alike). The loop counts such steps with `Guard` and stops the run after
--max-bad-steps of them in a row, keeping the last good checkpoint.

Test-only hook: ZEROSTACK_TEST_NAN_STEPS=3,5,6 makes the input embeddings of rank
ZEROSTACK_TEST_NAN_RANK (default 1, or 0 in a world of one) NaN on those steps (1-based)."""

from __future__ import annotations

import math
import os

import torch

from training import exits


def poison(loss: torch.Tensor) -> torch.Tensor:
    """`loss`, or NaN with NaN gradients when it is not finite (an infinite loss can have finite
    gradients; the optimizers' skip rule looks at the gradient norm). No host sync."""
    nan_if_bad = torch.where(torch.isfinite(loss), 0.0, math.nan).detach()
    return loss * (1.0 + nan_if_bad)


class Guard:
    """Counts non-finite steps; `update` raises Diverged after `limit` in a row."""

    def __init__(self, limit: int, total: int = 0):
        self.limit = limit
        self.total = total  # over the whole run (kept in checkpoints)
        self.in_a_row = 0
        self.first_bad = 0

    def update(self, step: int, bad: bool, last_checkpoint: str | None) -> bool:
        """Record step `step`; True when it was bad."""
        if not bad:
            self.in_a_row = 0
            return False
        self.total += 1
        self.in_a_row += 1
        if self.in_a_row == 1:
            self.first_bad = step
        if self.in_a_row >= self.limit:
            steps = f"steps {self.first_bad}-{step}" if step > self.first_bad else f"step {step}"
            keep = (
                f"the last good checkpoint is {last_checkpoint}"
                if last_checkpoint
                else "no checkpoint was written"
            )
            raise exits.Diverged(
                f"{self.in_a_row} consecutive steps ({steps}) had a non-finite loss or gradient "
                f"norm, so the run stopped; {keep}. Lower --lr, raise --warmup or --grad-clip, or "
                "check the data; --max-bad-steps sets how many bad steps in a row are tolerated"
            )
        return True


class TestNaN:
    """The test hook: arms a forward hook on the input embeddings for the listed steps."""

    def __init__(self, module, rank: int, world: int):
        spec = os.environ.get("ZEROSTACK_TEST_NAN_STEPS", "")
        self.steps = {int(s) for s in spec.split(",") if s.strip()}
        self.armed = False
        nan_rank = int(os.environ.get("ZEROSTACK_TEST_NAN_RANK", "1" if world > 1 else "0"))
        if self.steps and rank == nan_rank:
            emb = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None
            (emb or module).register_forward_hook(self._hook)
        else:
            self.steps = set()

    def _hook(self, module, args, output):
        if self.armed and isinstance(output, torch.Tensor):
            return output * math.nan
        return None

    def arm(self, step: int) -> None:
        """Called before each step's micro-batches with the (1-based) step about to run."""
        self.armed = step in self.steps
