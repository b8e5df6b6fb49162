"""The checkpoint layout every engine shares, and the rule that makes a save safe to kill:

    RUN/checkpoints/
        step_00000100/           the engine's own files + trainer_state.json + rng_state.json
                                 + complete.json
        latest                   the tag of the newest *complete* checkpoint

An engine writes its files into the tag folder and rank 0 the trainer state; every rank fsyncs
the files it sees (on several hosts each flushes its own writes); then rank 0 writes a
`complete.json` listing every file with its size and sha256 (integrity.py: the ranks share
the hashing), and only then moves `latest` to the new tag (an atomic rename). A kill at
any moment before that leaves `latest` on the previous checkpoint, and an incomplete folder is
never loaded. `verify` re-reads the files against the listing, so a truncated or corrupted file
is found before anything loads it. A save that cannot be written (disk full) raises SaveFailed
and leaves `latest` alone.

A universal copy of a checkpoint (universal.py) lives beside it as `step_N_universal`
and goes when its checkpoint goes.

What zerostack writes itself is JSON, so reading it back runs no code: the trainer state, and
each rank's RNG states (torch's generator bytes in base64, numpy's and Python's Mersenne
Twister words as integers, so they round-trip exactly). `load_trainer_state` first checks that
no file of the checkpoint names a class outside runtime/safe_load.py's allow-list.
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from training.checkpoints import integrity
from training.checkpoints.background import BackgroundWriter
from training.checkpoints.integrity import COMPLETE
from training.errors import CheckpointError, SaveFailed
from training.runtime import distributed, safe_load

LATEST = "latest"
STATE = "trainer_state.json"
RNG = "rng_state.json"
PICKLED_STATE = "trainer_state.pt"  # the whole trainer state, before it was JSON
UNIVERSAL_SUFFIX = "_universal"
_TAG = re.compile(r"step_\d+")


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def rng_state() -> dict:
    """This process's RNG states as plain JSON values (exact: integers and base64 bytes)."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    version, words, py_gauss = random.getstate()
    state = {
        "torch": _b64(torch.get_rng_state()),
        "numpy": {"keys": keys.tolist(), "pos": pos, "has_gauss": has_gauss, "gauss": gauss},
        "python": {"version": version, "words": list(words), "gauss": py_gauss},
    }
    if torch.accelerator.is_available():  # this rank's device only: others are other ranks'
        state["accelerator"] = _b64(_device_module().get_rng_state())
    return state


def set_rng_state(state: dict) -> None:
    """Restore `rng_state()`'s result (or a pickled trainer state's older form)."""
    if isinstance(state["numpy"], dict):
        n, p = state["numpy"], state["python"]
        keys = np.array(n["keys"], dtype=np.uint32)
        np.random.set_state(("MT19937", keys, n["pos"], n["has_gauss"], n["gauss"]))
        random.setstate((p["version"], tuple(p["words"]), p["gauss"]))
        torch.set_rng_state(_unb64(state["torch"]))
    else:  # trainer_state.pt: the objects themselves
        torch.set_rng_state(state["torch"])
        np.random.set_state(state["numpy"])
        random.setstate(state["python"])
    if state.get("accelerator") and torch.accelerator.is_available():
        _device_module().set_rng_state(_unb64(state["accelerator"]))


def _device_module():
    return torch.get_device_module(torch.accelerator.current_accelerator())


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def save(
    engine,
    root: Path,
    step: int,
    trainer_state: dict,
    keep_last: int,
    is_main: bool,
    busy: frozenset = frozenset(),
) -> Path:
    """All ranks call. Returns the checkpoint folder once it is complete and `latest`; older
    ones past `keep_last` are pruned, except those in `busy` (a background job reads them).
    Raises SaveFailed when a file cannot be written; the previous checkpoint stays `latest`."""
    try:
        _start(engine, root, step, trainer_state, is_main, writer=None)
        _seal(root, tag_for(step), keep_last, is_main, known=None, busy=busy)
    except Exception as e:
        raise _failed(root, step, e) from e
    distributed.barrier()
    return root / tag_for(step)


def save_async(engine, root: Path, step: int, trainer_state: dict, is_main: bool):
    """All ranks call (--async-save). Stages the engine's files into a BackgroundWriter, writes
    the small trainer state, and returns the writer while its thread writes the rest: the
    folder is not sealed and `latest` does not move until `seal` (all ranks, once every
    writer is done). Raises SaveFailed as `save` does."""
    writer = BackgroundWriter()
    try:
        _start(engine, root, step, trainer_state, is_main, writer=writer)
    except Exception as e:
        writer.wait()
        raise _failed(root, step, e) from e
    finally:
        writer.close()
    return writer


def seal(
    root: Path, step: int, writer, keep_last: int, is_main: bool, busy: frozenset = frozenset()
) -> Path:
    """All ranks call, once every rank's writer is done: seal the background save of `step`
    with the hashes its writers took, then move `latest` to it. Raises SaveFailed (naming the
    rank) when some rank's files could not be written: nothing is sealed then."""
    tag = tag_for(step)
    errors = distributed.all_gather_object(writer.error)
    failed = [(r, e) for r, e in enumerate(errors) if e]
    try:
        if failed:
            raise OSError(f"rank {failed[0][0]}: {failed[0][1]}")
        folder = root / tag
        known = {Path(p).relative_to(folder).as_posix(): v for p, v in writer.written.items()}
        _seal(root, tag, keep_last, is_main, known=known, busy=busy)
    except Exception as e:
        raise _failed(root, step, e) from e
    distributed.barrier()
    return root / tag


def _failed(root: Path, step: int, e: Exception) -> SaveFailed:
    prev = find_latest(root)
    free = shutil.disk_usage(root if root.is_dir() else root.parent).free
    return SaveFailed(
        f"could not write checkpoint {tag_for(step)} ({type(e).__name__}: "
        f"{str(e).strip().splitlines()[-1] if str(e).strip() else e!r}; "
        f"{free / 2**20:,.0f} MiB free there); "
        + (
            f"the previous checkpoint {prev} is intact and `latest` still names it"
            if prev
            else "there is no earlier checkpoint"
        )
        + f"; free space (the partial {root / tag_for(step)} can go) and re-run to resume"
    )


def _start(engine, root: Path, step: int, trainer_state: dict, is_main: bool, writer) -> None:
    """The engine's files (written, or staged into `writer`) and the trainer state."""
    tag = tag_for(step)
    folder = root / tag
    if is_main:
        root.mkdir(parents=True, exist_ok=True)
        if (folder / COMPLETE).is_file():  # a sealed checkpoint of this step: never deleted
            integrity.set_aside(folder)
        elif folder.exists():  # a partial save of this step from an earlier, killed run
            shutil.rmtree(folder)
        shutil.rmtree(root / (tag + UNIVERSAL_SUFFIX), ignore_errors=True)  # stale copy of it
    distributed.barrier()
    client_state = {"zerostack": {k: v for k, v in trainer_state.items()}}
    if writer is None:
        engine.save(root, tag, client_state)
    else:
        engine.save(root, tag, client_state, writer=writer)
    rngs = distributed.all_gather_object(rng_state())
    distributed.barrier()
    if is_main:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / STATE).write_text(json.dumps(trainer_state, indent=1))
        (folder / RNG).write_text(json.dumps(rngs))
    distributed.barrier()  # the trainer state is on disk for every rank to see


def _seal(
    root: Path, tag: str, keep_last: int, is_main: bool, known: dict | None, busy=frozenset()
) -> None:
    folder = root / tag
    # Durable before sealed: a power loss after complete.json must not leave the engine's files
    # in the page cache only (a background save's writers fsynced their own already).
    _fsync_files(folder, skip=set(known or {}))
    listing = integrity.listing(folder, known=known)
    if is_main:
        _write_atomic(folder / COMPLETE, json.dumps(listing, indent=1))
        _write_atomic(root / LATEST, tag)
        _prune(root, keep_last, busy)


def _fsync_files(folder: Path, skip: set[str]) -> None:
    """fsync every file this rank sees in `folder` except `skip` (what its background writer
    fsynced already), and the folders that hold them."""
    dirs = {folder}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.relative_to(folder).as_posix() not in skip:
            _fsync_path(p)
        elif p.is_dir():
            dirs.add(p)
    for d in dirs:
        _fsync_path(d)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_listing(folder: Path, extra: dict | None = None) -> None:
    """Seal a folder from one process: list every file with size and sha256 in complete.json
    (written last). Checkpoint saves share this work between the ranks instead."""
    listing = {**integrity.listing(folder, collective=False), **(extra or {})}
    _write_atomic(folder / COMPLETE, json.dumps(listing, indent=1))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def is_complete(folder: Path) -> bool:
    """True when the folder's complete.json exists and every listed file has its size."""
    return integrity.verify(folder, hashes=False, collective=False) is None


def verify(folder: Path, hashes: bool = True) -> None:
    """Raise CheckpointError unless every file complete.json lists is there with its size and
    sha256 (hashes=False: size only). One process; integrity.verify shares it out."""
    problem = integrity.verify(folder, hashes=hashes, collective=False)
    if problem:
        raise CheckpointError(problem)


def complete_tags(root: Path) -> list[str]:
    """Complete checkpoint tags under root, oldest first (universal copies are not tags)."""
    if not root.is_dir():
        return []
    return sorted(
        p.name for p in root.iterdir() if p.is_dir() and _TAG.fullmatch(p.name) and is_complete(p)
    )


def all_tags(root: Path) -> list[str]:
    """Every checkpoint folder under root, complete or not, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and _TAG.fullmatch(p.name))


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
    try:
        return locate(arg)
    except CheckpointError as e:
        raise CheckpointError(f"--resume {e}") from None


def locate(path: str | Path) -> tuple[Path, str]:
    """A user's checkpoint path -> (root, tag). Accepts RUN_DIR (its latest complete checkpoint),
    RUN_DIR/checkpoints, RUN_DIR/checkpoints/step_N, and the short forms RUN_DIR/step_N and
    RUN_DIR/N. Raises CheckpointError with one line naming what is wrong and what exists."""
    p = Path(path)
    if p.name.endswith(UNIVERSAL_SUFFIX):
        raise CheckpointError(
            f"{p}: is a universal copy; name its checkpoint {p.name[: -len(UNIVERSAL_SUFFIX)]}"
        )
    if not p.exists():
        step = p.name.removeprefix("step_")
        run = p.parent
        root = run if run.name == "checkpoints" else run / "checkpoints"
        if not step.isdigit() or not run.is_dir():
            raise CheckpointError(
                f"{p}: no complete checkpoint there (no such run or checkpoint folder)"
            )
        tag = tag_for(int(step))
        if not (root / tag).is_dir():
            have = ", ".join(complete_tags(root)) or "none"
            raise CheckpointError(f"{p}: no checkpoint {tag} in {root} (complete ones: {have})")
        p = root / tag
    if _TAG.fullmatch(p.name) and p.is_dir():
        if not is_complete(p):
            verify(p, hashes=False)  # raises, naming the missing or short file
        return p.parent, p.name
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    latest = root / LATEST
    if latest.is_file() and (root / latest.read_text().strip() / COMPLETE).is_file():
        verify(root / latest.read_text().strip(), hashes=False)  # sealed, then damaged: say so
    tag = find_latest(root) if root.is_dir() else None
    if tag is None:
        tags = all_tags(root)
        if tags:  # say what is wrong with the newest one
            try:
                verify(root / tags[-1])
            except CheckpointError as e:
                raise CheckpointError(f"{p}: holds no complete checkpoint; {e}") from None
        what = "no checkpoints/ folder" if root == p and p.name != "checkpoints" else "none saved"
        raise CheckpointError(f"{p}: holds no complete checkpoint ({what})")
    return root, tag


def load_trainer_state(root: Path, tag: str) -> dict:
    """Checkpoint root/tag's trainer state, with each rank's RNG states under "rng". First
    checks that no file in the folder names a class outside the allow-list (safe_load.py), so
    resume, conversion and export refuse a planted pickle before anything loads it. Raises
    CheckpointError in one line."""
    folder = root / tag
    safe_load.check_folder(folder)
    if not (folder / RNG).is_file() and (folder / PICKLED_STATE).is_file():
        return safe_load.load(folder / PICKLED_STATE)  # older checkpoints: plain data only
    try:
        state = json.loads((folder / STATE).read_text())
        rng = folder / RNG
        state["rng"] = json.loads(rng.read_text()) if rng.is_file() else []
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{folder}: unreadable trainer state ({e})") from None
    return state


def set_aside_unsealed(root: Path, log) -> list[Path]:
    """Rank 0, at a run's start: move every checkpoint folder without its complete.json (a
    save a kill or a failure cut short: nothing in it was sealed, so nothing is resumed from it)
    into `unsealed/` beside them, and say so; kept for a look, never deleted here."""
    moved = []
    for tag in all_tags(root):
        folder = root / tag
        if (folder / COMPLETE).is_file():
            continue
        dest, n = root / "unsealed" / tag, 1
        while dest.exists():
            dest, n = root / "unsealed" / f"{tag}.{n}", n + 1
        dest.parent.mkdir(exist_ok=True)
        folder.rename(dest)
        shutil.rmtree(root / (tag + UNIVERSAL_SUFFIX), ignore_errors=True)
        log(f"moved the unsealed checkpoint {folder} (its save never finished) aside to {dest}")
        moved.append(dest)
    return moved


def prune(root: Path, keep_last: int, busy=frozenset()) -> None:
    """Rank 0: delete the sealed checkpoints (and their universal copies) older than the newest
    `keep_last`, except those in `busy` (a background job reads them)."""
    _prune(root, keep_last, busy)


def _prune(root: Path, keep_last: int, busy=frozenset()) -> None:
    if keep_last <= 0:
        return
    tags = complete_tags(root)
    for old in tags[:-keep_last]:
        if old in busy:
            continue  # a background job reads it: pruned by a later save
        shutil.rmtree(root / (old + UNIVERSAL_SUFFIX), ignore_errors=True)
        shutil.rmtree(root / old, ignore_errors=True)
