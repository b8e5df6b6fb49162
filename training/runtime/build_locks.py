"""Stale build locks of DeepSpeed's compiled ops. DeepSpeed builds its ops (the shared-memory
collectives, CPU Adam, async_io) on first use through torch's extension loader, which holds a
`lock` file in the op's build folder while it compiles. A process killed mid-build leaves the
file behind, and every later run that needs the op waits for it forever, printing nothing.
Such a lock is removed before any work: torch runs ninja in the op's folder for the whole
build, so a lock that no process works beside is a build that is over."""

from __future__ import annotations

import os
import time
from pathlib import Path

# The longest build seen: async_io, about 6 minutes on 2 cores; a lock older than this is not a
# build in progress.
STALE_AFTER_S = 20 * 60
# From taking the lock to starting ninja in the folder, torch writes build.ninja and hashes the
# sources: well under a second. Past this age a lock nobody builds beside is stale.
UNATTENDED_AFTER_S = 2 * 60


def build_root() -> Path:
    """Where torch's extension loader builds: TORCH_EXTENSIONS_DIR, else its default."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def stale_locks(root: Path | None = None, older_than_s: float = STALE_AFTER_S) -> list[Path]:
    """The build locks under `root` (torch's extension folder: one folder per op, one more level
    per Python and device) older than `older_than_s`."""
    root = build_root() if root is None else root
    now = time.time()
    found = [*root.glob("*/lock"), *root.glob("*/*/lock")]
    return sorted(p for p in found if now - p.stat().st_mtime > older_than_s)


def building_in(folder: Path) -> bool | None:
    """Whether a process works in `folder` (its current directory); None where the system does
    not say (no /proc)."""
    proc = Path("/proc")
    if not (proc / "self" / "cwd").exists():
        return None
    folder = folder.resolve()
    for cwd in proc.glob("[0-9]*/cwd"):
        try:
            if Path(os.readlink(cwd)) == folder:
                return True
        except OSError:  # a process that ended, or one we may not look into
            continue
    return False


def clear_stale(root: Path | None = None, after_s: float = STALE_AFTER_S) -> list[str]:
    """Removes the locks of builds that are over, a `note:` line each: a lock older than
    `after_s` that no process on this host builds beside. One younger than that (but past the
    start of any build) gets a `warning:` line instead: a host sharing the folder (a home on a
    network filesystem) may be building there, which this host cannot see. The trainer waits
    the longest build (STALE_AFTER_S); the test suite, on one host, UNATTENDED_AFTER_S."""
    lines = []
    for p in stale_locks(root, UNATTENDED_AFTER_S):
        age_s = time.time() - p.stat().st_mtime
        building = building_in(p.parent)
        if building or (building is None and age_s <= STALE_AFTER_S):
            continue
        what = f"{p}, {age_s / 60:.0f} min old: a build of DeepSpeed's '{p.parent.name}' op"
        if age_s <= after_s:
            lines.append(
                f"warning: {what} that no process on this host runs; unless another host "
                "builds it in this folder now, delete the file: runs needing the op wait on it"
            )
            continue
        p.unlink(missing_ok=True)  # every rank may find it: whoever is first removes it
        lines.append(
            f"note: removed {what} was cut short there, and every run that needs the op "
            "would have waited on it"
        )
    return lines
