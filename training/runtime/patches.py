"""Every place zerostack reaches into DeepSpeed's or torch's internals, with the versions it was
verified against (tests/test_patches.py runs each stock path against the patched one). Outside
its range a patch is not applied: the run takes the library's stock path, and says so in one
line at start (preflight) and in resolved_config.json. Widen a range only after those tests pass
on the new version."""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version


@dataclass(frozen=True)
class Patch:
    library: str  # the distribution whose internals it touches
    low: str  # verified from this release ...
    high: str  # ... to this one, both included (local tags such as +cpu ignored)
    what: str  # what it replaces, and the stock path taken outside the range


PATCHES: dict[str, Patch] = {
    "shm_route": Patch(
        "deepspeed",
        "0.19.8",
        "0.19.8",
        "runtime/shm.py replaces cdb.all_reduce / all_gather_into_tensor / reduce_scatter_tensor "
        "and deepspeed.runtime.zero.stage3.reduce_scatter_coalesced; stock: gloo",
    ),
    "optimizer_step_stand_down": Patch(
        "deepspeed",
        "0.19.8",
        "0.19.8",
        "engines/ds.py stands the torch optimizer's step down when a ZeRO-0 fp32 step's gradients "
        "are not finite; stock: DeepSpeed steps, and the loss says the rest",
    ),
    "swapped_optimizer_restore": Patch(
        "deepspeed",
        "0.19.8",
        "0.19.8",
        "engines/ds.py rebuilds ZeRO-3 NVMe-swapped optimizer state that load_checkpoint skips "
        "(when the skip is there); stock: DeepSpeed's load, Adam's state restarts",
    ),
    "ulysses_mpu_shim": Patch(
        "deepspeed",
        "0.19.8",
        "0.19.8",
        "engines/ds.py gives Ulysses's mpu a tensor-parallel size of 1 during a load; stock: "
        "DeepSpeed's loader stops on the missing method",
    ),
    "fsdp2_held_grads": Patch(
        "torch",
        "2.13.0",
        "2.13.0",
        "engines/fsdp.py reads FSDP2's private accumulated gradients to count them; stock: "
        "the held gradients are not counted in the model-state bytes",
    ),
}


def in_range(installed: str, low: str, high: str) -> bool:
    """Whether release `installed` lies in [low, high] (pre-releases and local tags compare by
    their release numbers: 2.13.0+cpu is 2.13.0); an unparsable version is outside."""
    got = release(installed)
    return got is not None and release(low) <= got <= release(high)


def release(v: str) -> tuple[int, ...] | None:
    """ "2.13.0+cpu" -> (2, 13, 0); "0.20.0rc1" -> (0, 20, 0); None when it starts with no number."""
    m = re.match(r"\d+(\.\d+)*", v.strip())
    return tuple(int(x) for x in m.group().split(".")) if m else None


def installed_version(library: str) -> str:
    try:
        return version(library)
    except PackageNotFoundError:
        return "not installed"


def check(name: str, installed: str | None = None) -> tuple[bool, str]:
    """(applied, one line) for patch `name` against `installed` (default: the library's
    installed version)."""
    p = PATCHES[name]
    installed = installed_version(p.library) if installed is None else installed
    span = p.low if p.low == p.high else f"{p.low} to {p.high}"
    if in_range(installed, p.low, p.high):
        return True, f"{p.library} {installed}: verified ({span})"
    return False, (
        f"{name}: {p.library} {installed} is outside the versions it was verified against "
        f"({span}); taking the stock path ({p.what.split('stock: ')[-1]})"
    )


def verified(name: str) -> bool:
    """Whether patch `name` may be applied with the libraries installed."""
    return check(name)[0]


def as_record() -> dict:
    """{patch: {"applied": bool, "why": line}} for resolved_config.json."""
    return {n: dict(zip(("applied", "why"), check(n))) for n in PATCHES}


def unverified_lines() -> list[str]:
    """One line for each patch not applied with the libraries installed (said at start)."""
    return [line for ok, line in map(check, PATCHES) if not ok]
