"""Which rank is gone? When a collective fails, the survivors name the rank that died or hangs
instead of printing a socket error.

Every rank runs a daemon thread that bumps a counter in the launcher's rendezvous store (the
TCPStore at MASTER_ADDR:MASTER_PORT) once a second, with the step it is on; collectives release
the GIL, so the thread keeps beating while the main thread waits in one. A rank that fails on
its own leaves one line of "last words" there. On an error, `roll_call` reads the counters, waits
a few seconds, and reads them again: a rank whose counter stood still is dead (or frozen, or cut
off), a rank that left words says why it stopped, and a live rank behind our step is stuck.

Under torchrun the store lives in the launcher's agent and outlives every rank; under the
deepspeed launcher rank 0 hosts it, so an unreachable store means rank 0 is gone.

Some collectives cannot fail: DeepSpeed's shared-memory kernel spins until every rank has
arrived, with no timeout. The main thread marks such a wait (`waiting()`), and a watchdog thread
holds the roll call while it lasts, as a failed collective would: a peer that stopped beating
is named and this rank exits, and a wait longer than the collective timeout ends the run like
a timed-out collective."""

from __future__ import annotations

import os
import resource
import socket
import threading
import time
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from training.errors import BAD_INPUT, DIVERGED, LOST_RANK, OK, PREEMPTED, SAVE_FAILED


class Liveness:
    def __init__(self, rank: int, world: int, interval: float = 1.0):
        env = os.environ
        self.rank, self.world, self.interval = rank, world, interval
        self.step = 0  # the main thread's current step; read by the heartbeat thread
        self.host, self.port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
        self.agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        # torchrun keeps its store across restarts: keys are per restart.
        run, attempt = (
            env.get("TORCHELASTIC_RUN_ID", ""),
            env.get("TORCHELASTIC_RESTART_COUNT", "0"),
        )
        self.prefix = f"zerostack/live/{run}/{attempt}/"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="zerostack-heartbeat", daemon=True)
        self._thread.start()
        # The watchdog over waits that cannot time out by themselves (see `waiting`).
        self.waiting_since: float | None = None
        self.timeout_s = 600.0  # the collective timeout; distributed.setup sets --dist-timeout
        self.on_lost = None  # (gone, code) -> never returns; guard.run_guarded sets it
        self._watchdog: threading.Thread | None = None

    def watch(self, grace_s: float = 3.0) -> None:
        """Start the watchdog (once): after `grace_s` in a marked wait, hold a roll call; repeat
        every `grace_s` until the wait ends, a peer is gone, or `timeout_s` has passed."""
        if self._watchdog is None:
            self._watchdog = threading.Thread(
                target=self._watch, args=(grace_s,), name="zerostack-watchdog", daemon=True
            )
            self._watchdog.start()

    def _watch(self, grace_s: float) -> None:
        while not self._stop.wait(0.5):
            since = self.waiting_since
            if since is None or time.monotonic() - since < grace_s:
                continue
            waited = time.monotonic() - since
            timed_out = waited > self.timeout_s
            # A live peer behind our step is only slow until the timeout has passed.
            gone, code = self.roll_call(stuck=timed_out)
            if self.waiting_since != since:
                continue  # the wait ended while we asked: nothing is wrong
            if not gone and timed_out:
                gone = {
                    -1: f"an all-reduce waited {waited:.0f}s (more than --dist-timeout) for a "
                    "rank that is alive but never joined it"
                }
            if gone and self.on_lost is not None:
                self.on_lost(gone, code)
            self._stop.wait(grace_s)

    def _key(self, kind: str, rank: int) -> str:
        return f"{self.prefix}{kind}/{rank}"

    def _connect(self, timeout_s: float):
        return dist.TCPStore(
            self.host,
            self.port,
            is_master=False,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )

    def _beat(self) -> None:
        store = None
        while not self._stop.is_set():
            try:
                if store is None:
                    store = self._connect(10)
                store.add(self._key("beat", self.rank), 1)
                store.set(self._key("step", self.rank), str(self.step))
                # What this rank holds, for a survivor to say if it dies (an OOM kill says nothing)
                store.set(self._key("mem", self.rank), _memory_note())
            except Exception:
                store = None  # not up yet (rank 0 starts it with the process group), or gone
            self._stop.wait(self.interval)

    def close(self) -> None:
        self._stop.set()

    def last_words(self, code: int, text: str) -> None:
        """Leave one line (and the exit code) for the other ranks' roll call."""
        try:
            self._connect(5).set(self._key("words", self.rank), f"{code}|{text}")
        except Exception:
            pass

    def seen(self, rank: int) -> dict | None:
        """What `rank` last said about itself: pid, host, resident and peak bytes (None if it
        never beat, or the store is gone)."""
        try:
            store = self._connect(5)
            key = self._key("mem", rank)
            if not store.check([key]):
                return None
            pid, host, rss, peak = store.get(key).decode().split("|")
            return {"pid": int(pid), "host": host, "rss": int(rss), "peak": int(peak)}
        except Exception:
            return None

    def roll_call(self, window_s: float = 3.0, stuck: bool = True) -> tuple[dict[int, str], int]:
        """({rank: why it is gone or stuck}, the exit code to use). Empty when every other rank
        is alive and at our step, i.e. the failure is this rank's own. `stuck=False` leaves out
        live ranks that are behind our step."""
        others = [r for r in range(self.world) if r != self.rank]
        try:
            store = self._connect(5)
            first = {r: store.add(self._key("beat", r), 0) for r in others}
            pending, end = set(others), time.monotonic() + window_s
            while pending and time.monotonic() < end:
                time.sleep(0.25)
                pending = {r for r in pending if store.add(self._key("beat", r), 0) == first[r]}
                pending -= {r for r in pending if store.check([self._key("words", r)])}
            gone, code = {}, LOST_RANK
            for r in others:
                if store.check([self._key("words", r)]):
                    c, _, text = store.get(self._key("words", r)).decode().partition("|")
                    if text.startswith("lost ") or int(c) in (OK, PREEMPTED):
                        continue  # a survivor like us, or a rank that finished: not the cause
                    gone[r] = f"stopped: {text}"
                    if int(c) in (BAD_INPUT, DIVERGED, SAVE_FAILED):
                        code = int(c)  # every rank then ends the same way
                elif r in pending:
                    gone[r] = "is not responding (killed, crashed, or its host is unreachable)"
            if not gone and stuck:
                for r in others:
                    key = self._key("step", r)
                    step = int(store.get(key)) if store.check([key]) else 0
                    if step < self.step:
                        gone[r] = f"is alive but stuck at step {step} (this rank is at {self.step})"
            return gone, code
        except Exception:
            where = f"the rendezvous store at {self.host}:{self.port} is unreachable"
            if self.agent_store:
                return {-1: f"{where}: the launcher's host is gone"}, LOST_RANK
            return {0: f"is gone ({where}, and rank 0 hosted it)"}, LOST_RANK


def rss_bytes() -> tuple[int, int]:
    """(resident set size now, peak resident set size) of this process, in bytes (Linux /proc;
    elsewhere the peak for both)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    try:
        with open("/proc/self/statm") as f:
            now = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        now = peak
    return now, max(now, peak)


def _memory_note() -> str:
    """'pid|host|rss|peak rss' of this process, in bytes."""
    rss, peak = rss_bytes()
    return f"{os.getpid()}|{socket.gethostname()}|{rss}|{peak}"


def describe(gone: dict[int, str]) -> str:
    return "; ".join(f"rank {r} {why}" if r >= 0 else why for r, why in sorted(gone.items()))


_current: Liveness | None = None


def start(rank: int, world: int) -> Liveness | None:
    """Start this process's heartbeat (nothing in a world of one or without a launcher)."""
    global _current
    if world > 1 and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        _current = Liveness(rank, world)
    return _current


_step = 0  # the last step noted, also in a world of one (the run's exit record names it)


def note_step(step: int) -> None:
    global _step
    _step = step
    if _current is not None:
        _current.step = step


def last_step() -> int:
    return _step


def set_timeout(seconds: float) -> None:
    if _current is not None:
        _current.timeout_s = seconds


@contextmanager
def waiting():
    """Mark a collective that cannot time out by itself, so the watchdog looks after it."""
    live = _current
    if live is None:
        yield
        return
    live.watch()
    live.waiting_since = time.monotonic()
    try:
        yield
    finally:
        live.waiting_since = None
