"""How a training run ends: one exit code per kind of ending, so a restart loop (or a person)
can tell "resume me" from "fix something first".

    0   finished (or --stop-at reached)
    1   unexpected error (a Python traceback says where)
    2   bad input: config, flags, data, checkpoint or environment; nothing was changed
    3   diverged: --max-bad-steps consecutive steps had a non-finite loss or gradient norm
    4   lost a rank: another rank died or stopped answering; re-run to resume
    5   could not write a checkpoint (disk full, quota, permissions); the previous one is intact
    75  preempted: SIGTERM, SIGUSR1 or Ctrl-C; a checkpoint was saved, re-run to resume
    130 a second Ctrl-C: stopped at once, without saving

Restart loops (launch/local.sh) retry 1, 4 and 75 and stop on 0, 2, 3 and 5, which would only
fail the same way again.
"""

from __future__ import annotations

OK = 0
CRASHED = 1
BAD_INPUT = 2
DIVERGED = 3
LOST_RANK = 4
SAVE_FAILED = 5
PREEMPTED = 75  # EX_TEMPFAIL: try again later
INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


class Preempted(Exception):
    """Every rank agreed to stop on a signal and the checkpoint of this step is saved."""


class Diverged(Exception):
    """Too many consecutive steps with a non-finite loss or gradient norm."""


class SaveFailed(Exception):
    """A checkpoint could not be written; `latest` still names the previous complete one."""


def run_guarded(train, *, rank: int, world: int, run_dir) -> int:
    """Run `train()` (sets up the process group, trains, tears down) with the stop signals
    caught and a heartbeat running, and turn how it ended into an exit code with one line of
    explanation. A crash of this rank's own still raises (a traceback, exit 1)."""
    import os
    import sys
    from pathlib import Path

    from training import checkpoint, liveness, signals
    from training.cluster import LaunchError

    stop = signals.install(rank)
    live = liveness.start(rank, world)

    def say(line: str, everyone: bool = False) -> None:
        if rank == 0 or everyone:
            prefix = "" if rank == 0 else f"[rank {rank}] "
            print(prefix + line, file=sys.stderr, flush=True)

    def exit_now(code: int):
        # The process group may have a dead peer: its teardown could hang, so skip it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def lost(gone: dict, code: int):
        """Another rank is gone: say which (the lowest survivor does), and exit at once."""
        latest = checkpoint.find_latest(Path(run_dir) / "checkpoints")
        alive = sorted(set(range(world)) - set(gone))
        resume = latest or "the start (no complete checkpoint yet)"
        say(
            f"error: {liveness.describe(gone)}; rank {rank} stops too (at step {live.step})"
            + (f". Re-run the same command to resume from {resume}" if code == LOST_RANK else ""),
            everyone=bool(alive) and rank == alive[0],
        )
        live.last_words(code, f"lost {liveness.describe(gone)}")
        exit_now(code)

    if live:
        live.on_lost = lost  # the watchdog's way out of a collective that cannot fail
    try:
        train()
    except (Diverged, checkpoint.CheckpointError) as e:  # every rank raised it alike
        signals.ignore_from_now()
        say(f"error: {e}")
        _teardown()
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
            exit_now(SAVE_FAILED)
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


def _teardown() -> None:
    from training import distributed

    distributed.teardown()
