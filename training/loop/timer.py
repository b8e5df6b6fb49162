"""Tokens per second over the steps between two log lines, with the time spent on anything but
training (evaluation, checkpoints, counting model states) left out."""

from __future__ import annotations

import time
from contextlib import contextmanager

from training.runtime import hang


class StepTimer:
    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._paused = 0.0
        self.steps = 0

    def tick(self) -> None:
        """One optimizer step done (the hang watch, runtime/hang.py, times steps by it too)."""
        self.steps += 1
        hang.step_done()

    @contextmanager
    def paused(self):
        """Time spent inside does not count as training time, nor toward a hung step."""
        t0 = time.perf_counter()
        hang.pause()
        try:
            yield
        finally:
            hang.resume()
            self._paused += time.perf_counter() - t0

    def lap(self) -> tuple[int, float]:
        """(steps, training seconds) since the last lap, and start the next one."""
        now = time.perf_counter()
        out = (self.steps, now - self._start - self._paused)
        self._start, self._paused, self.steps = now, 0.0, 0
        return out
