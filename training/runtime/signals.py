"""Preemption: SIGTERM and SIGUSR1 (what SLURM and most schedulers send before they kill a job)
and Ctrl-C ask the run to stop. The handler only records the request; the loop makes every rank
agree on it at the next step boundary, saves a checkpoint there and exits with
`errors.PREEMPTED`. A second Ctrl-C exits at once, without saving."""

from __future__ import annotations

import os
import signal
import threading

from training.errors import INTERRUPTED

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopRequest:
    """Install with `install()`; `signum` is the first stop signal received (0: none)."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.signum = 0
        self.honored = False  # the loop saved and stopped because of it
        self._interrupts = 0
        # Set by guard.run_guarded: called (in the handler) with the signal instead of saying
        # `announcement()` at once: a launcher also sends SIGTERM when a peer has died, and
        # then no checkpoint can be saved.
        self.on_request = None
        self.on_interrupt = None  # called before a second Ctrl-C exits: the run's last record

    def install(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        # os.write, not print: a handler may run while the main thread is inside print.
        if signum == signal.SIGINT:
            self._interrupts += 1
            if self._interrupts > 1:
                say(f"[rank {self.rank}] second Ctrl-C: stopping now, without saving\n")
                if self.on_interrupt is not None:
                    self.on_interrupt()
                os._exit(INTERRUPTED)
        if self.signum:
            return  # already stopping (launchers often forward what the terminal also sent)
        self.signum = signum
        if self.on_request is not None:
            self.on_request(signum)  # says it once it knows whether every rank is still there
        else:
            say(self.announcement())

    def announcement(self) -> str:
        """The line that acknowledges the request (when every rank is still there to save)."""
        again = " (Ctrl-C again to stop at once)" if self.signum == signal.SIGINT else ""
        return (
            f"[rank {self.rank}] {name(self.signum)}: saving a checkpoint at the next step "
            f"boundary, then exiting{again}\n"
        )

    @property
    def requested(self) -> bool:
        return self.signum != 0


def ignore_from_now() -> None:
    """For a process on its way out: a launcher's late SIGTERM (sent when the first rank exits)
    must not turn a clean exit code into a kill at interpreter shutdown."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_IGN)


def name(signum: int) -> str:
    return signal.Signals(int(signum)).name


def say(text: str) -> None:
    try:
        os.write(2, text.encode())
    except OSError:
        pass


_current: StopRequest | None = None


def install(rank: int = 0) -> StopRequest:
    """Catch the stop signals in this process (main thread only); returns the request."""
    global _current
    _current = StopRequest(rank).install()
    return _current


def current() -> StopRequest:
    """This process's request, or one that is never set when `install` was not called."""
    return _current or StopRequest()
