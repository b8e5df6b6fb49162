"""Small file helpers the data and checkpoint writers share: streaming checksums, and telling a
partial folder of a writer that died from one still being written."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def pid_alive(pid: int) -> bool:
    """Whether process `pid` (on this host) still runs; a partial folder named after a dead one
    is left over from a crash and may go."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    try:  # a killed process whose parent died first stays a zombie until init reaps it
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (macOS): kill(0) is all we know
    return stat.rpartition(")")[2].split()[0] != "Z"
