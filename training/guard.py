"""How a run ends: `run_guarded` runs the training function with the stop signals caught and a
heartbeat beating, and turns how it ended into one of the exit codes of training/errors.py with
one line of explanation."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from training.checkpoints.layout import find_latest
from training.errors import (
    BAD_INPUT,
    CRASHED,
    DIVERGED,
    LOST_RANK,
    OK,
    PREEMPTED,
    SAVE_FAILED,
    CheckpointError,
    Diverged,
    LaunchError,
    SaveFailed,
)
from training.runtime import distributed, liveness, signals


def run_guarded(train, *, rank: int, world: int, run_dir) -> int:
    """Run `train()` (sets up the process group, trains, tears down) with the stop signals
    caught and a heartbeat running, and turn how it ended into an exit code with one line of
    explanation. A crash of this rank's own still raises (a traceback, exit 1)."""
    stop = signals.install(rank)
    live = liveness.start(rank, world)

    def say(line: str, everyone: bool = False) -> None:
        if rank == 0 or everyone:
            prefix = "" if rank == 0 else f"[rank {rank}] "
            print(prefix + line, file=sys.stderr, flush=True)

    def lost(gone: dict, code: int):
        """Another rank is gone: say which (the lowest survivor does), and exit at once."""
        latest = find_latest(Path(run_dir) / "checkpoints")
        alive = sorted(set(range(world)) - set(gone))
        resume = latest or "the start (no complete checkpoint yet)"
        say(
            f"error: {liveness.describe(gone)}; rank {rank} stops too (at step {live.step})"
            + (f". Re-run the same command to resume from {resume}" if code == LOST_RANK else ""),
            everyone=bool(alive) and rank == alive[0],
        )
        live.last_words(code, f"lost {liveness.describe(gone)}")
        _exit_now(code)

    if live:
        live.on_lost = lost  # the watchdog's way out of a collective that cannot fail
    try:
        train()
    except (Diverged, CheckpointError) as e:  # every rank raised it alike
        signals.ignore_from_now()
        say(f"error: {e}")
        distributed.teardown()
        return DIVERGED if isinstance(e, Diverged) else BAD_INPUT
    except LaunchError as e:  # this rank's launcher environment is wrong: it speaks for itself
        signals.ignore_from_now()
        say(f"error: rank {rank}: {e}", everyone=True)
        return BAD_INPUT
    except Exception as e:
        gone, code = live.roll_call() if live else ({}, LOST_RANK)
        if gone:
            lost(gone, code)
        if isinstance(e, SaveFailed):  # rank 0 says it, for itself or for the others
            say(f"error: {e}")
            if live:
                live.last_words(SAVE_FAILED, str(e))
            _exit_now(SAVE_FAILED)
        if live:
            live.last_words(CRASHED, f"{type(e).__name__}: {e}".splitlines()[0][:300])
        raise
    finally:
        if live:
            live.close()
    if stop.honored:
        signals.ignore_from_now()
        return PREEMPTED
    return OK


def _exit_now(code: int):
    # The process group may have a dead peer: its teardown could hang, so skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
