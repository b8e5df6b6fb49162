"""Counting steps whose loss or gradient norm was not finite (each is skipped on every rank, see
engines/nonfinite.py), and stopping the run after --max-bad-steps of them in a row, keeping the
last good checkpoint."""

from __future__ import annotations

from training.errors import Diverged


class BadStepCounter:
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
            raise Diverged(
                f"{self.in_a_row} consecutive steps ({steps}) had a non-finite loss or gradient "
                f"norm, so the run stopped; {keep}. Lower --lr, raise --warmup or --grad-clip, or "
                "check the data; --max-bad-steps sets how many bad steps in a row are tolerated"
            )
        return True
