"""Tokens per second over the steps between two log lines, with the time spent on anything but
training (evaluation, checkpoints, counting model states) left out."""

from __future__ import annotations

import time
from contextlib import contextmanager


class StepTimer:
    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._paused = 0.0
        self.steps = 0

    def tick(self) -> None:
        """One optimizer step done."""
        self.steps += 1

    @contextmanager
    def paused(self):
        """Time spent inside does not count as training time."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._paused += time.perf_counter() - t0

    def lap(self) -> tuple[int, float]:
        """(steps, training seconds) since the last lap, and start the next one."""
        now = time.perf_counter()
        out = (self.steps, now - self._start - self._paused)
        self._start, self._paused, self.steps = now, 0.0, 0
        return out
