"""How a run ends: `run_guarded` runs the training function with the stop signals caught and a
heartbeat beating, and turns how it ended into one of the exit codes of training/errors.py with
one line of explanation.

The rank that decides how the run ended (rank 0, or the lowest survivor when ranks are lost)
also writes it down, atomically, as `RUN/exit.json` (code, meaning, reason, step, the rank
blamed, time, and the launch it belongs to): a launcher exits with the code of its own ranks'
processes, which after a lost rank is the dead one's (-9 -> 247 under deepspeed), so the launch
scripts read the record instead. A refused launch (bad input, or a run folder in use) writes
only to the file its launch script named (ZEROSTACK_EXIT_RECORD), never into the run folder."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from training.checkpoints.layout import find_latest
from training.errors import (
    BAD_INPUT,
    CRASHED,
    DIVERGED,
    HUNG,
    INTERRUPTED,
    LOST_RANK,
    OK,
    PREEMPTED,
    SAVE_FAILED,
    CheckpointError,
    ConfigError,
    Diverged,
    LaunchError,
    SaveFailed,
)
from training.memory import oom
from training.runtime import distributed, hang, liveness, runlock, signals

EXIT_RECORD = "exit.json"
REFUSAL_GRACE_S = 3.0  # how long a refusing rank other than 0 waits before exiting
MEANINGS = {
    OK: "finished",
    CRASHED: "crashed",
    BAD_INPUT: "bad input",
    DIVERGED: "diverged",
    LOST_RANK: "lost a rank",
    SAVE_FAILED: "could not save a checkpoint",
    HUNG: "hung",
    PREEMPTED: "preempted",
    INTERRUPTED: "interrupted",
}


def run_guarded(train, *, rank: int, world: int, run_dir) -> int:
    """Run `train()` (sets up the process group, trains, tears down) with the stop signals
    caught and a heartbeat running, and turn how it ended into an exit code with one line of
    explanation, recorded in the run folder. A crash of this rank's own still raises (a
    traceback, exit 1). The run folder's lock (taken in `train()`) is given back at the end."""
    try:
        return _guarded(train, rank, world, run_dir)
    finally:
        runlock.release()


def _guarded(train, rank: int, world: int, run_dir) -> int:
    stop = signals.install(rank)
    live = liveness.start(rank, world)
    # The kernel's OOM-kill record as it stood when this run began (a dead peer is checked against it)
    oom_since = (oom.uptime_s(), oom.oom_kill_count())

    def say(line: str, everyone: bool = False) -> None:
        if rank == 0 or everyone:
            prefix = "" if rank == 0 else f"[rank {rank}] "
            print(prefix + line, file=sys.stderr, flush=True)

    def lost(gone: dict, code: int):
        """Another rank is gone: say which (the lowest survivor does), and exit at once."""
        latest = find_latest(Path(run_dir) / "checkpoints")
        gone = _explain_memory(gone, live, oom_since)
        alive = sorted(set(range(world)) - set(gone))
        resume = latest or "the start (no complete checkpoint yet)"
        speaker = bool(alive) and rank == alive[0]
        say(
            f"error: {liveness.describe(gone)}; rank {rank} stops too (at step {live.step})"
            + (f". Re-run the same command to resume from {resume}" if code == LOST_RANK else ""),
            everyone=speaker,
        )
        live.last_words(code, f"lost {liveness.describe(gone)}")
        if speaker:
            blamed = min((r for r in gone if r >= 0), default=None)
            record_ending(code, f"lost {liveness.describe(gone)}", rank=rank, blamed=blamed)
        _exit_now(code)

    if live:
        live.on_lost = lost  # the watchdog's way out of a collective that cannot fail
        stop.on_request = lambda signum: _check_peers_then_announce(stop, live)
    if rank == 0:
        stop.on_interrupt = lambda: record_ending(INTERRUPTED, "a second Ctrl-C", rank=rank)
    try:
        train()
    except (Diverged, CheckpointError, ConfigError) as e:  # every rank raised it alike
        signals.ignore_from_now()
        say(f"error: {e}")
        code = DIVERGED if isinstance(e, Diverged) else BAD_INPUT
        _end(code, str(e), rank)
        distributed.teardown()
        return code
    except LaunchError as e:  # this rank's launcher environment is wrong: it speaks for itself
        signals.ignore_from_now()
        say(f"error: rank {rank}: {e}", everyone=True)
        record_ending(BAD_INPUT, f"rank {rank}: {e}", rank=rank, blamed=rank)
        return BAD_INPUT
    except Exception as e:
        gone, code = live.roll_call() if live else ({}, LOST_RANK)
        if gone:
            lost(gone, code)
        if isinstance(e, SaveFailed):  # rank 0 says it, for itself or for the others
            say(f"error: {e}")
            if live:
                live.last_words(SAVE_FAILED, str(e))
            _end(SAVE_FAILED, str(e), rank)
            _exit_now(SAVE_FAILED)
        why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        if oom.is_oom(e):  # said as out of memory, with what this rank held and the plan's advice
            why = "out of memory: " + oom.describe(oom.what_failed(e), *liveness.rss_bytes())
            say(f"error: rank {rank}: {why}", everyone=True)
        if live:
            live.last_words(CRASHED, why)
        record_ending(CRASHED, f"rank {rank}: {why}", rank=rank, blamed=rank)
        raise
    finally:
        hang.stop()
        if live:
            live.close()
    code = PREEMPTED if stop.honored else OK
    if stop.honored:
        signals.ignore_from_now()
    _end(code, f"stopped by {signals.name(stop.signum)}" if stop.honored else "finished", rank)
    return code


def _explain_memory(gone: dict, live: liveness.Liveness, since: tuple) -> dict:
    """A rank that stopped answering, said more exactly: killed by the kernel's OOM killer (the
    kernel log names its pid, or the memory cgroup counted a kill since we started), with what
    it held when last seen; otherwise what it held is added to the line."""
    out = dict(gone)
    for r, why in gone.items():
        seen = live.seen(r) if r >= 0 and why.startswith("is not responding") else None
        if seen is None:
            continue
        here = seen["host"] == socket.gethostname()
        if here and oom.killed_by_oom(seen["pid"], *since):
            how = "was killed by the kernel's OOM killer: out of memory"
            out[r] = oom.describe(how, seen["rss"], seen["peak"])
        else:
            out[r] = f"{why}; it held {oom.fmt(seen['rss'])} when last seen"
    return out


def _check_peers_then_announce(stop: signals.StopRequest, live: liveness.Liveness) -> None:
    """In a thread, off the signal handler: a launcher also sends SIGTERM when a rank has died,
    and then no checkpoint can be saved. Say that, or promise the save when every rank still
    beats. Only words: the failed collective or the watchdog decides how the run ends."""

    def check():
        gone, _ = live.roll_call(window_s=2.5, stuck=False)
        if stop.honored:
            return  # every rank agreed on the stop and saved meanwhile; the loop said so
        if gone:
            signals.say(
                f"[rank {live.rank}] {signals.name(stop.signum)} received while "
                f"{liveness.describe(gone)}: no checkpoint can be saved without it; stopping "
                "once that is confirmed\n"
            )
        else:
            signals.say(stop.announcement())

    threading.Thread(target=check, name="zerostack-stop-check", daemon=True).start()


def _end(code: int, reason: str, rank: int) -> None:
    """An ending every rank reached alike: rank 0 records it."""
    if rank == 0:
        record_ending(code, reason.splitlines()[0][:500], rank=rank)


def record_ending(code: int, reason: str, *, rank: int, blamed: int | None = None) -> None:
    """Write how the run ended: `RUN/exit.json` when this job holds the run folder (and was not
    refused), and the launch script's own record file (ZEROSTACK_EXIT_RECORD) when it named
    one. Never raises."""
    record = {
        "code": code,
        "meaning": MEANINGS.get(code, "unknown"),
        "reason": reason,
        "step": liveness.last_step(),
        "rank_blamed": blamed,
        "written_by_rank": rank,
        "host": socket.gethostname(),
        "time": time.time(),
        "launch_id": os.environ.get("ZEROSTACK_LAUNCH_ID"),
    }
    text = json.dumps(record, indent=1)
    held = runlock.job_holds()
    # A refused launch (2) changes nothing in the run folder, not even this record.
    targets = [held / EXIT_RECORD] if held is not None and code != BAD_INPUT else []
    if os.environ.get("ZEROSTACK_EXIT_RECORD"):
        targets.append(Path(os.environ["ZEROSTACK_EXIT_RECORD"]))
    for path in targets:
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            tmp.write_text(text)
            tmp.replace(path)
        except OSError:
            pass  # a record that cannot be written must not change how the run ends


def refused(error: Exception, rank: int, world: int) -> int:
    """A launch refused before any work (preflight): say it (rank 0 for all, a stray rank for
    itself), record it for the launch script, and return BAD_INPUT."""
    if rank == 0 or not 0 <= rank < world:
        print(f"error: {error}", file=sys.stderr, flush=True)
        record_ending(BAD_INPUT, str(error).splitlines()[0][:500], rank=rank)
    else:
        # Every rank refuses alike, but launchers stop the others as soon as one rank exits:
        # give rank 0 the moment it needs to print the line and write the record.
        time.sleep(REFUSAL_GRACE_S)
    return BAD_INPUT


def _exit_now(code: int):
    # The process group may have a dead peer: its teardown could hang, so skip it.
    runlock.release()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
