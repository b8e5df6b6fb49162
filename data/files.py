"""Small file helpers the data and checkpoint writers share: streaming checksums, and the hidden
folder a writer fills before publishing it, told apart from one a dead writer left."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
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


def why_unwritable(out: Path) -> str | None:
    """Why a folder cannot be written at `out` (one line), or None: a path on the way that is a
    file, or a folder this user cannot write in. Checked before any work."""
    out = Path(out).absolute()
    if out.exists() and not out.is_dir():
        return f"{out} is a file, not a folder"
    here = out if out.exists() else out.parent
    while not here.exists():
        here = here.parent
    if not here.is_dir():
        return f"cannot make {out}: {here} is a file, not a folder"
    if not os.access(here, os.W_OK | os.X_OK):
        return f"cannot make {out}: no permission to write in {here}"
    return None


def scratch_folder(out: Path) -> Path:
    """A fresh hidden folder beside `out` to write it in, `.NAME.partial-HOST-PID`, published by
    renaming it to `out` once complete. Folders left for the same `out` by writers on this host
    whose process is gone (killed, crashed) are deleted first; a live writer's, or another
    host's on a shared disk, are left alone."""
    mine = f".{out.name}.partial-{socket.gethostname()}-"
    for p in out.parent.glob(f"{mine}*"):
        pid = p.name.removeprefix(mine)
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)
    tmp = out.parent / f"{mine}{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp
