"""A step far longer than the run's recent steps (a soft timeout, well before the collective
timeout): every rank writes its Python stacks, every thread, into RUN/hang/rank{R}.txt
(faulthandler, from a watchdog thread: no root, no py-spy, and it works while the main thread
waits in a collective or a read, since those release the GIL), and the run ends with exit code
HUNG (training/errors.py), which the launch scripts' restart loops retry.

The rule: once `warmup` steps are done, a step is hung when it has run longer than `factor`
times the median of the last `history` steps and at least `floor_s` seconds. Time the loop
spends in evaluations and saves (loop/timer.py's paused spans) does not count. Every rank
watches its own step: the stuck one and the peers waiting for it in a collective all pass the
limit, each writes its stacks, then each waits `grace_s` (so the others write theirs before a
collective fails under them) and exits."""

from __future__ import annotations

import faulthandler
import os
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path

from training.errors import HUNG
from training.runtime import liveness, signals

FOLDER = "hang"


class HangWatch:
    def __init__(
        self,
        run_dir: Path,
        rank: int,
        *,
        factor: float,
        floor_s: float,
        warmup: int = 3,
        history: int = 20,
        grace_s: float = 3.0,
        on_hang=None,
        last_step: int | None = None,
    ):
        """`on_hang(step, elapsed_s, limit_s)`: called once before the exit (the guard records
        the ending there); then the process exits with HUNG. The watch ends with `last_step`
        (what follows the last step, the final evaluation and save, is no step)."""
        self.folder, self.rank = Path(run_dir) / FOLDER, rank
        self.factor, self.floor_s, self.warmup, self.grace_s = factor, floor_s, warmup, grace_s
        self.recent: deque[float] = deque(maxlen=history)
        self.on_hang, self.last_step = on_hang, last_step
        self._start = time.monotonic()
        self._paused_since: float | None = None
        self._depth = 0  # nested pauses
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="zerostack-hang", daemon=True)
        self._thread.start()

    def step_done(self) -> None:
        """The loop finished a step (main thread)."""
        now = time.monotonic()
        self.recent.append(now - self._start)
        self._start = now
        if self.last_step is not None and liveness.last_step() >= self.last_step:
            self.close()

    def pause(self) -> None:
        self._depth += 1
        if self._depth == 1:
            self._paused_since = time.monotonic()

    def resume(self) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0 and self._paused_since is not None:
            self._start += time.monotonic() - self._paused_since
            self._paused_since = None

    def limit_s(self) -> float | None:
        """How long the step in progress may take; None in the warm-up."""
        if len(self.recent) < self.warmup:
            return None
        return max(self.floor_s, self.factor * statistics.median(self.recent))

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(0.25):
            limit = self.limit_s()
            # a stop signal's save (loop.py: _stop_here) is no step either
            if limit is None or self._paused_since is not None or signals.current().requested:
                continue
            elapsed = time.monotonic() - self._start
            if elapsed > limit:
                self._dump(elapsed, limit)
                return

    def _dump(self, elapsed: float, limit: float) -> None:
        step = liveness.last_step() + 1
        line = (
            f"step {step} has run {elapsed:.1f} s, past its limit of {limit:.1f} s "
            f"({self.factor:g} x the median of the last {len(self.recent)} steps, at least "
            f"{self.floor_s:g} s)"
        )
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(self.folder / f"rank{self.rank}.txt", "w") as f:
                f.write(f"rank {self.rank}, pid {os.getpid()}: {line}\n\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        print(
            f"[rank {self.rank}] error: {line}; every rank's Python stacks are in "
            f"{self.folder}/; stopping (exit {HUNG}, restartable)",
            file=sys.stderr,
            flush=True,
        )
        if self.on_hang is not None:
            try:
                self.on_hang(step, elapsed, limit)
            except Exception:  # the exit must happen whatever the record does
                pass
        time.sleep(self.grace_s)  # let every rank write its stacks before collectives fail
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(HUNG)


_current: HangWatch | None = None


def start(
    run_dir: Path, rank: int, factor: float, floor_s: float, on_hang=None, last_step=None
) -> None:
    """Watch this process's steps up to `last_step` (factor 0: no watch)."""
    global _current
    stop()
    if factor > 0:
        _current = HangWatch(
            run_dir, rank, factor=factor, floor_s=floor_s, on_hang=on_hang, last_step=last_step
        )


def step_done() -> None:
    if _current is not None:
        _current.step_done()


def pause() -> None:
    if _current is not None:
        _current.pause()


def resume() -> None:
    if _current is not None:
        _current.resume()


def stop() -> None:
    global _current
    if _current is not None:
        _current.close()
        _current = None
