"""Stale build locks of DeepSpeed's compiled ops. DeepSpeed builds its ops (the shared-memory
collectives, CPU Adam, async_io) on first use through torch's extension loader, which holds a
`lock` file in the op's build folder while it compiles. A process killed mid-build leaves the
file behind, and every later run that needs the op waits for it forever, printing nothing."""

from __future__ import annotations

import os
import time
from pathlib import Path

# The longest build seen: async_io, about 6 minutes on 2 cores; a lock older than this is not a
# build in progress.
STALE_AFTER_S = 20 * 60


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


def warnings(root: Path | None = None) -> list[str]:
    """One line for each stale lock: what it is and what to do."""
    return [
        f"{p} is {(time.time() - p.stat().st_mtime) / 60:.0f} min old: a build of DeepSpeed's "
        f"'{p.parent.name}' op was cut short, and a run that needs that op waits for this file "
        "forever; delete it unless a build is running now"
        for p in stale_locks(root)
    ]
