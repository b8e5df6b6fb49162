"""Checkpoint integrity: every checkpoint's `complete.json` lists its files with size and
sha256, and a checkpoint is verified against it before anything loads it.

On a save or a resume the hashing is shared out: every rank says which files of the folder it
can see (on node-local disks a rank sees only its own host's), each file goes to one rank that
sees it, each rank hashes its share in a streaming way, and the results are gathered. With
collective=True every rank must call (and all get the same answer); collective=False is for one
process on its own (export, universal conversion, tests)."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch.distributed as dist

from data.manifest import sha256_file

COMPLETE = "complete.json"


def _gather(obj, collective: bool) -> list:
    if not (collective and dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _visible(folder: Path) -> dict[str, int]:
    if not folder.is_dir():
        return {}
    return {
        p.relative_to(folder).as_posix(): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != COMPLETE and not p.name.startswith(".")
    }


def _hash_shared(
    folder: Path, names: list[str] | None, collective: bool, digest=sha256_file
) -> tuple[dict, dict]:
    """({name: size}, {name: digest}) of the files of `names` (default: all) that some rank
    sees, each hashed once."""
    views = _gather(_visible(folder), collective)
    me = dist.get_rank() if len(views) > 1 else 0
    if names is None:
        names = sorted(set().union(*views))
    mine = []
    for i, name in enumerate(names):
        seen_by = [r for r, view in enumerate(views) if name in view]
        if seen_by and seen_by[i % len(seen_by)] == me:
            mine.append(name)
    sizes, sums = {}, {}
    for view, part in zip(views, _gather({n: digest(folder / n) for n in mine}, collective)):
        for name, value in part.items():
            sizes[name], sums[name] = view[name], value
    return sizes, sums


def listing(folder: Path, collective: bool = True) -> dict:
    """What complete.json records for `folder`: every file's size and sha256."""
    sizes, sums = _hash_shared(folder, None, collective)
    return {"files": sizes, "sha256": sums}


def verify(folder: Path, hashes: bool = True, collective: bool = True) -> str | None:
    """None when every file complete.json lists is there with its size and checksum (sha256;
    CRC-32 in listings from before sha256; none with hashes=False), else one line naming the
    first file that is not."""
    if not (folder / COMPLETE).is_file():
        return f"{folder}: incomplete checkpoint (no {COMPLETE}: its save did not finish)"
    try:
        listed = json.loads((folder / COMPLETE).read_text())
        sizes = listed["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"{folder}: incomplete checkpoint (unreadable {COMPLETE}: {e})"
    kind, want = ("sha256", listed.get("sha256")) if "sha256" in listed else ("CRC-32", None)
    digest = sha256_file
    if want is None and hashes and "crc32" in listed:
        want, digest = listed["crc32"], _crc32
    names = sorted(sizes) if hashes and want else []
    seen = {n: s for view in _gather(_visible(folder), collective) for n, s in view.items()}
    _, got = _hash_shared(folder, names, collective, digest) if names else ({}, {})
    for name, size in sorted(sizes.items()):
        if name not in seen:
            return f"{folder}: corrupt checkpoint: {name} is missing"
        if seen[name] != size:
            return (
                f"{folder}: corrupt checkpoint: {name} is {seen[name]} bytes, {size} were "
                "written (truncated?)"
            )
        if name in got and want and name in want and got[name] != want[name]:
            return (
                f"{folder}: corrupt checkpoint: {name} does not match its {kind} (changed on "
                "disk since it was written)"
            )
    return None


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def verified_resume(
    resume: tuple[Path, str], auto: bool, complete_tags, log
) -> tuple[Path, str] | None:
    """The checkpoint to resume from, verified by all ranks together. A named checkpoint that
    fails is refused (CheckpointError); with --resume auto the newest older complete one that
    verifies is used instead, with a warning. `complete_tags(root)` lists candidates, oldest
    first."""
    from training.checkpoint import CheckpointError

    root, tag = resume
    problem = verify(root / tag)
    if problem is None:
        return resume
    if not auto:
        raise CheckpointError(f"refusing to resume from a corrupt checkpoint: {problem}")
    for older in reversed([t for t in complete_tags(root) if t < tag]):
        log(f"warning: {problem}; trying the previous checkpoint {older}")
        problem = verify(root / older)
        if problem is None:
            log(f"resuming from {older} instead of the corrupt {tag}")
            return root, older
    raise CheckpointError(
        f"no checkpoint in {root} verifies (last problem: {problem}); to start over, move "
        "the run folder away or pick another --out"
    )
