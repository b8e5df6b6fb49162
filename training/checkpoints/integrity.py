"""Checkpoint integrity: every checkpoint's `complete.json` lists its files with size and
sha256, and a checkpoint is verified against it before anything loads it.

On a save or a resume the hashing is shared out: every rank says which files of the folder it
can see (on node-local disks a rank sees only its own host's), each file goes to one rank that
sees it, each rank hashes its share in a streaming way, and the results are gathered. With
collective=True every rank must call (and all get the same answer); collective=False is for one
process on its own (export, universal conversion, tests).

A damaged checkpoint is never deleted: a resume names it and goes past it, and when a later save
writes the same step, the sealed folder there is moved aside into `checkpoints/damaged/` (or
`checkpoints/replaced/` when it verifies: a run resumed from an older step) by `set_aside`."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from data.files import sha256_file
from training.runtime import distributed

COMPLETE = "complete.json"  # the listing; written last, so its presence means "sealed"


def _gather(obj, collective: bool) -> list:
    return distributed.all_gather_object(obj) if collective else [obj]


# Dotfiles are temporaries (an atomic write's), except DCP's index of an FSDP2 checkpoint: a
# checkpoint does not load without it, so it is sealed with the rest.
_KEPT = {".metadata"}


def _visible(folder: Path) -> dict[str, int]:
    if not folder.is_dir():
        return {}
    return {
        p.relative_to(folder).as_posix(): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != COMPLETE and (not p.name.startswith(".") or p.name in _KEPT)
    }


def _hash_shared(folder: Path, names: list[str] | None, collective: bool) -> tuple[dict, dict]:
    """({name: size}, {name: digest}) of the files of `names` (default: all) that some rank
    sees, each hashed once."""
    views = _gather(_visible(folder), collective)
    me = distributed.rank() if len(views) > 1 else 0
    if names is None:
        names = sorted(set().union(*views))
    mine = []
    for i, name in enumerate(names):
        seen_by = [r for r, view in enumerate(views) if name in view]
        if seen_by and seen_by[i % len(seen_by)] == me:
            mine.append(name)
    sizes, sums = {}, {}
    for view, part in zip(views, _gather({n: sha256_file(folder / n) for n in mine}, collective)):
        for name, value in part.items():
            sizes[name], sums[name] = view[name], value
    return sizes, sums


def listing(folder: Path, collective: bool = True, known: dict | None = None) -> dict:
    """What complete.json records for `folder`: every file's size and sha256. `known`: {name:
    (size, sha256)} of files this rank wrote and hashed itself (a background save's writer),
    taken as they are; the other files are hashed."""
    merged = {}
    for part in _gather(known or {}, collective):
        merged.update(part)
    names = None
    if merged:
        seen = set().union(*_gather(set(_visible(folder)), collective))
        names = sorted(seen - set(merged))
    sizes, sums = _hash_shared(folder, names, collective)
    for name, (size, digest) in merged.items():
        sizes[name], sums[name] = size, digest
    return {"files": dict(sorted(sizes.items())), "sha256": dict(sorted(sums.items()))}


def verify(folder: Path, hashes: bool = True, collective: bool = True) -> str | None:
    """None when every file complete.json lists is there with its size and sha256 (size only
    with hashes=False), else one line naming the first file that is not."""
    if not (folder / COMPLETE).is_file():
        return f"{folder}: incomplete checkpoint (no {COMPLETE}: its save did not finish)"
    try:
        listed = json.loads((folder / COMPLETE).read_text())
        sizes = listed["files"]
        want = listed.get("sha256")
        if not isinstance(sizes, dict) or not isinstance(want, (dict, type(None))):
            raise ValueError("its files and sha256 are not name -> value maps")
        if not all(isinstance(n, str) and type(v) is int for n, v in sizes.items()):
            raise ValueError("a listed size is not a whole number")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{folder}: incomplete checkpoint (unreadable {COMPLETE}: {e})"
    names = sorted(sizes) if hashes and want else []
    seen = {n: s for view in _gather(_visible(folder), collective) for n, s in view.items()}
    _, got = _hash_shared(folder, names, collective) if names else ({}, {})
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
                f"{folder}: corrupt checkpoint: {name} does not match its sha256 (changed on "
                "disk since it was written)"
            )
    return None


def sealed_problems(root: Path) -> dict[str, str]:
    """{tag: one line} for every sealed checkpoint under `root` (it has its complete.json) whose
    listed files are not all there with their sizes: saved whole, damaged since."""
    out = {}
    for folder in sorted(root.glob("step_*")) if root.is_dir() else []:
        if re.fullmatch(r"step_\d+", folder.name) and (folder / COMPLETE).is_file():
            problem = verify(folder, hashes=False, collective=False)
            if problem:
                out[folder.name] = problem
    return out


def set_aside(folder: Path) -> Path:
    """One process: move a sealed checkpoint that a save of the same step is about to replace
    into damaged/ (it does not verify) or replaced/ (it does) beside it, and say so."""
    kind = "damaged" if verify(folder, collective=False) else "replaced"
    dest = folder.parent / kind / folder.name
    n = 1
    while dest.exists():
        dest, n = folder.parent / kind / f"{folder.name}.{n}", n + 1
    dest.parent.mkdir(exist_ok=True)
    folder.rename(dest)
    print(f"moved the {kind} checkpoint {folder} aside to {dest}", file=sys.stderr, flush=True)
    return dest
