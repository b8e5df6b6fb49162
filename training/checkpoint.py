"""The checkpoint layout every engine shares, and the rule that makes a save safe to kill:

    RUN/checkpoints/
        step_00000100/           the engine's own files + trainer_state.pt + complete.json
        latest                   the tag of the newest *complete* checkpoint

An engine writes its files into the tag folder; then rank 0 writes the trainer state and a
`complete.json` listing every file with its size, and only then moves `latest` to the new tag
(an atomic rename). A kill at any moment before that leaves `latest` on the previous checkpoint,
and an incomplete folder is never loaded.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch

from training import distributed as D

LATEST = "latest"
COMPLETE = "complete.json"
STATE = "trainer_state.pt"


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or corrupt."""


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def rng_state() -> dict:
    import random

    import numpy as np

    return {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }


def set_rng_state(state: dict) -> None:
    import random

    import numpy as np

    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def save(engine, root: Path, step: int, trainer_state: dict, keep_last: int, is_main: bool) -> Path:
    """All ranks call. Returns the checkpoint folder once it is complete and `latest`."""
    tag = tag_for(step)
    folder = root / tag
    if is_main:
        root.mkdir(parents=True, exist_ok=True)
        if folder.exists():  # a partial save of this step from an earlier, killed run
            shutil.rmtree(folder)
    D.barrier()
    engine.save(root, tag, {"zerostack": {k: v for k, v in trainer_state.items()}})
    rngs = _gather_object(rng_state())
    D.barrier()
    if is_main:
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({**trainer_state, "rng": rngs}, folder / STATE)
        (folder / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1, default=str))
        hold = os.environ.get("ZEROSTACK_TEST_HOLD_SAVE")  # "STEP:SECONDS"
        if hold and int(hold.split(":")[0]) == step:  # test hook: lets a test kill a save
            print(f"[test hook] holding save of {tag} open", flush=True)
            time.sleep(float(hold.split(":")[1]))
        _write_atomic(folder / COMPLETE, json.dumps(_listing(folder), indent=1))
        _write_atomic(root / LATEST, tag)
        _prune(root, keep_last)
    D.barrier()
    return folder


def _gather_object(obj) -> list:
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _listing(folder: Path) -> dict:
    files = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != COMPLETE:
            files[str(p.relative_to(folder))] = p.stat().st_size
    return {"files": files}


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def is_complete(folder: Path) -> bool:
    """True when the folder's complete.json exists and every listed file has its size."""
    try:
        listing = json.loads((folder / COMPLETE).read_text())["files"]
    except (OSError, ValueError, KeyError):
        return False
    for name, size in listing.items():
        p = folder / name
        if not p.is_file() or p.stat().st_size != size:
            return False
    return True


def complete_tags(root: Path) -> list[str]:
    """Complete checkpoint tags under root, oldest first."""
    if not root.is_dir():
        return []
    return sorted(
        p.name
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith("step_") and is_complete(p)
    )


def find_latest(root: Path) -> str | None:
    """The tag to resume from: `latest` if it is complete, else the newest complete one."""
    latest = root / LATEST
    if latest.is_file():
        tag = latest.read_text().strip()
        if is_complete(root / tag):
            return tag
    tags = complete_tags(root)
    return tags[-1] if tags else None


def resolve_resume(arg: str, run_dir: Path) -> tuple[Path, str] | None:
    """`--resume auto` (latest complete checkpoint of this run, if any), `never`, or a path to a
    checkpoint folder or a run folder. Returns (root, tag) or None."""
    if arg == "never":
        return None
    if arg == "auto":
        root = run_dir / "checkpoints"
        tag = find_latest(root)
        return (root, tag) if tag else None
    p = Path(arg)
    if (p / "checkpoints").is_dir():
        p = p / "checkpoints"
    if p.is_dir() and p.name.startswith("step_"):
        if not is_complete(p):
            raise CheckpointError(f"--resume {arg}: checkpoint {p} is incomplete or corrupt")
        return p.parent, p.name
    if p.is_dir():
        tag = find_latest(p)
        if tag:
            return p, tag
    raise CheckpointError(f"--resume {arg}: no complete checkpoint found there")


def load_trainer_state(root: Path, tag: str) -> dict:
    return torch.load(root / tag / STATE, weights_only=False)


def _prune(root: Path, keep_last: int) -> None:
    if keep_last <= 0:
        return
    tags = complete_tags(root)
    for old in tags[:-keep_last]:
        shutil.rmtree(root / old, ignore_errors=True)
