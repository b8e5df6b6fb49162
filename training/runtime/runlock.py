"""One run per run folder, and which folders a user owns.

The running job's rank 0 holds `RUN/run.lock` (host, pid, when) from before anything is written
into the run folder until it exits. A second launch on the same --out while the first runs is
refused in one line; a lock left by a process that died without releasing it (kill -9, power
loss) is taken over with a message when that process was on this host and is gone. A lock from
another host cannot be checked from here: it is refused with the way to clear it.

Folders a user owns and no zerostack command may replace: a run folder (what the trainer writes)
and a data folder (data.prepare's manifest.json). `owned_folder` names the kind."""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from data.files import pid_alive
from data.manifest import MANIFEST
from training.errors import ConfigError

LOCK = "run.lock"
# torchrun's job id (--rdzv-id), the same in every round of one elastic job: a lock that a rank
# 0 of an earlier round left on a lost host is taken over, not refused as another job's.
ELASTIC_JOB = "TORCHELASTIC_RUN_ID"
UNNAMED_JOB = "none"  # torchrun's id when --rdzv-id is not given: any job's, so no one's
RUN_MARKS = ("checkpoints", "resolved_config.json", "metrics.jsonl", LOCK)


def owned_folder(path: Path) -> str | None:
    """'a run folder' or 'a data folder' when `path` is one, else None."""
    if (path / MANIFEST).is_file():
        return "a data folder"
    if any((path / mark).exists() for mark in RUN_MARKS):
        return "a run folder"
    return None


def owned_near(path: Path, inside_ok: bool = False) -> str | None:
    """One line when `path` is, lies inside (unless `inside_ok`), or contains a run or data
    folder, else None."""
    path = Path(os.path.abspath(path))
    for p in [path, *path.parents][: 1 if inside_ok else None]:
        kind = owned_folder(p)
        if kind:
            return f"{path} is {kind}" if p == path else f"{path} lies inside {kind}, {p}"
    if path.is_dir():
        for top, dirs, _ in os.walk(path):
            for d in dirs:
                kind = owned_folder(Path(top) / d)
                if kind:
                    return f"{path} contains {kind}, {Path(top) / d}"
    return None


@dataclass
class RunLock:
    """A held lock; `release()` removes it (only if it is still ours)."""

    path: Path
    owner: dict
    made_folder: bool  # the run folder did not exist before: a refused run removes it again

    def release(self) -> None:
        try:
            if json.loads(self.path.read_text()) == self.owner:
                self.path.unlink()
        except (OSError, ValueError):
            return
        # A launch that made the folder and then wrote nothing but how it ended leaves nothing.
        folder = self.path.parent
        try:
            if self.made_folder and {p.name for p in folder.iterdir()} <= {"exit.json"}:
                (folder / "exit.json").unlink(missing_ok=True)
                folder.rmdir()
        except OSError:
            pass


def acquire(run_dir: Path, log) -> RunLock:
    """Take the run folder's lock for this process (creating the folder), or raise ConfigError
    in one line naming the job that holds it. `log(line)` says when a stale lock is taken over."""
    run_dir = Path(run_dir)
    kind = owned_folder(run_dir)
    if kind == "a data folder":
        raise ConfigError(f"--out {run_dir} is a data folder (it holds {MANIFEST}); pick another")
    made = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {run_dir}: cannot create it ({e.strerror})") from None
    owner = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
    if _elastic_job():
        owner["elastic_job"] = _elastic_job()
    path = run_dir / LOCK
    for _ in range(3):  # a race with another launch taking over the same stale lock
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            _take_over_if_stale(path, log)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(owner))
        return RunLock(path, owner, made)
    raise ConfigError(f"{path}: another launch is taking this run folder over at the same time")


def _elastic_job() -> str:
    job = os.environ.get(ELASTIC_JOB, "")
    return "" if job == UNNAMED_JOB else job


def _take_over_if_stale(path: Path, log) -> None:
    """Move a dead local process's lock, or one left by an earlier round of this elastic job,
    aside; raise ConfigError for a live or remote one."""
    try:
        held = json.loads(path.read_text())
        host, pid, since = held["host"], int(held["pid"]), float(held["since"])
    except FileNotFoundError:
        return  # released meanwhile: try again
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(
            f"{path}: unreadable run lock; if no run is using {path.parent}, delete it"
        ) from None
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since))
    local = host == socket.gethostname()
    job = _elastic_job()
    # torchrun starts a round only once the last round's ranks have stopped: a rank 0 of an
    # earlier round of this elastic job is gone, also when its host went with it
    earlier_round = bool(job) and held.get("elastic_job") == job and not local
    if local and not pid_alive(pid):
        stale = f"the stale lock {path} of pid {pid} (started {when}, no longer running)"
    elif earlier_round:
        stale = (
            f"the lock {path} of pid {pid} on {host} (started {when}), left by an earlier "
            f"round of this elastic job ({job})"
        )
    else:
        stale = None
    if stale:
        log(f"taking over {stale}")
        aside = path.with_name(f".{LOCK}.stale-{os.getpid()}")
        try:
            path.rename(aside)
            if json.loads(aside.read_text()) != held:  # another launch's fresh lock: give it back
                aside.rename(path)
            else:
                aside.unlink()
        except (OSError, ValueError):
            pass  # another launch took it over first; the O_EXCL create decides
        return
    if host == socket.gethostname():
        why = "is still running"
    else:
        why = f"cannot be checked from here; if that job is gone, delete {path}"
    raise ConfigError(
        f"--out {path.parent} is in use by another run (pid {pid} on {host}, since {when}, "
        f"{why}); wait for it to end or pick another --out"
    )


_held: RunLock | None = None
_job_holds: Path | None = None  # the run folder this job's rank 0 locked (known on every rank)


def hold(lock: RunLock | None, run_dir: Path | None) -> None:
    """Every rank: remember that this job holds `run_dir` (rank 0 also keeps the lock)."""
    global _held, _job_holds
    _held, _job_holds = lock, run_dir


def job_holds() -> Path | None:
    """The run folder this job holds, or None (refused, or not started yet)."""
    return _job_holds


def release() -> None:
    """At exit: give the lock back (rank 0; elsewhere only forget the folder)."""
    global _held, _job_holds
    if _held is not None:
        _held.release()
    _held, _job_holds = None, None
