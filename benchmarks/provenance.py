"""What a benchmark row was measured on and with, stored beside it when it is measured: the host
(its class, cores and load) and the code (the commit, and a fingerprint of the modules the row
describes). A table drawn later from the stored rows can then say which rows are older than
today's code and which ran on a loaded host, from the raw fields alone."""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The code a row describes, by part: what it measured (the trainer, the model, the configs) and
# what it planned (the memory planner and the configs it reads).
DESCRIBED = {
    "trainer": ("training", "models", "ds_configs"),
    "planner": ("training/memory", "ds_configs"),
}
ALL_DESCRIBED = sorted({top for tops in DESCRIBED.values() for top in tops})
# Other work on the host, in busy cores, above this share of its cores: the row's speed and its
# ceiling probe shared the machine, and its MFU is not shown.
BUSY_SHARE = 0.25


def fingerprint(tops: tuple[str, ...]) -> str:
    """A hash of every .py and .json file under `tops` (paths and contents, sorted)."""
    h = hashlib.sha256()
    for top in tops:
        for f in sorted((REPO / top).rglob("*")):
            if f.suffix in (".py", ".json") and f.is_file() and "__pycache__" not in f.parts:
                h.update(str(f.relative_to(REPO)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _git(*args: str) -> str:
    p = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    return p.stdout.strip() if p.returncode == 0 else ""


def code_record() -> dict:
    """{commit, dirty (uncommitted changes under the described folders), one fingerprint a
    part}: the code a row is measured with."""
    return {
        "commit": _git("rev-parse", "HEAD") or None,
        "dirty": bool(_git("status", "--porcelain", "--", *ALL_DESCRIBED)),
        **{part: fingerprint(tops) for part, tops in DESCRIBED.items()},
    }


def changed_files(stored: dict | None) -> list[str]:
    """The files under the described folders that differ now from the stored commit's (git),
    so that a reader can judge whether a change since could touch the row."""
    commit = (stored or {}).get("commit")
    return _git("diff", "--name-only", commit, "--", *ALL_DESCRIBED).split() if commit else []


def changed_parts(stored: dict | None) -> list[str] | None:
    """The described parts whose code changed since `stored` (a code_record()), [] when none;
    None when the row has no record (it predates them)."""
    if not stored:
        return None
    return [part for part, tops in DESCRIBED.items() if stored.get(part) != fingerprint(tops)]


def cores() -> int:
    """The cores this process may run on (the affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def today() -> str:
    """The day a result is measured (UTC), which every raw file records as `date`."""
    return time.strftime("%Y-%m-%d", time.gmtime())


def host_record() -> dict:
    """The host class, its cores and the load averages (1, 5, 15 min) now."""
    from benchmarks.host import host_class

    return {"class": host_class(), "cores": cores(), "loadavg": list(os.getloadavg())}


def busy_cpu_seconds() -> float:
    """CPU seconds the whole host has spent busy since boot (all cores, every process)."""
    import psutil

    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def mfu_distrust(train: dict) -> str | None:
    """Why a row's MFU cannot be trusted, from its stored raw fields, or None when it can: its
    end-of-run ceiling probe is missing or moved more than 10% from the start's, a step beat
    the start's ceiling, or other work kept more than BUSY_SHARE of the host's cores busy while
    it ran (CPU the job's short-lived children used between samples counts as other work)."""
    from training.runtime.flops import DRIFT_WARN

    ceiling = train.get("ceiling") or {}
    if ceiling.get("end_per_rank_flops") is None:
        return "no end-of-run ceiling probe stored"
    change = ceiling["end_per_rank_flops"] / ceiling["start_per_rank_flops"] - 1
    if abs(change) > DRIFT_WARN:
        return f"end-of-run ceiling probe {change:+.0%} from the start's"
    if ceiling.get("raised"):
        return "a step beat the start's ceiling (probed in a slow spell), which was raised"
    host = train.get("host") or {}
    other, n = host.get("other_cores_busy"), host.get("cores")
    if other is None or not n:
        return "no host load stored"
    if other > BUSY_SHARE * n:
        return f"loaded host ({other:.1f} of {n} cores busy with other work)"
    return None
