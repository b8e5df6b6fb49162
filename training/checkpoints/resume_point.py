"""What a run resumes from, decided in one place and handed to train.py as a named plan.

Two moments decide it. Before any process group exists (`plan_resume`): `--resume auto` takes the
run's latest complete checkpoint, `never` none (and refuses a run folder that holds some), a
path names one; with auto, a checkpoint whose trainer state will not load gives way to the next
older one; and the checkpoint loads either natively or, when the world size, ZeRO stage,
pipeline, tensor- or sequence-parallel layout changed, through a universal copy (universal_copy.py). Once the process group is up
(`verify_resume`), every rank hashes a share of the checkpoint's files against their listing;
with auto, a corrupt one again gives way to the next older one that verifies, and its load is
planned anew. Falling back always says so, on rank 0, naming the damaged file; a run folder
whose every checkpoint is damaged is refused rather than trained from step 0 over them.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from training.checkpoints import integrity, layout, universal_copy
from training.checkpoints.universal_copy import Topology
from training.errors import CheckpointError


@dataclass(frozen=True)
class ResumePlan:
    """The checkpoint a run resumes from and how it loads."""

    root: Path  # RUN/checkpoints (or another run's)
    tag: str  # step_N
    universal: bool  # through the universal copy beside it (another world size, stage, layout)
    saved_on: Topology  # what wrote it
    why: str  # how it was chosen, for the banner

    @property
    def load_tag(self) -> str:
        """The folder the engine loads: the checkpoint, or its universal copy."""
        return universal_copy.universal_tag(self.tag) if self.universal else self.tag

    def trainer_state(self) -> dict:
        """The checkpoint's trainer state, read (and its folder checked for planted pickles)
        once per plan: the preflight, startup and restore all ask."""
        return self._trainer_state

    @functools.cached_property
    def _trainer_state(self) -> dict:
        return layout.load_trainer_state(self.root, self.tag)


def plan_resume(
    arg: str, run_dir: Path, now: Topology, mode: str, log: Callable[[str], None]
) -> ResumePlan | None:
    """Before any process group: what `--resume arg` resumes from in a run of topology `now`
    (`mode` is --universal), or None to start from step 0. Raises CheckpointError in one line."""
    existing = layout.find_latest(run_dir / "checkpoints")
    if arg == "never" and existing:
        raise CheckpointError(
            f"--resume never, but {run_dir} already holds checkpoints (latest {existing}) that "
            "training from scratch would overwrite; pick another --out or use --resume auto"
        )
    found = layout.resolve_resume(arg, run_dir)
    if arg == "auto":
        _name_damaged(run_dir / "checkpoints", found and found[1], log)
    if found is None:
        return None
    root, tag = found
    why = "the latest complete checkpoint" if arg == "auto" else f"--resume {arg}"
    good = _first_good(root, tag, arg == "auto", _unreadable, log)
    if good != tag:
        why = f"{good}, the newest with a readable trainer state"
    return _plan_load(root, good, now, mode, why)


def _name_damaged(root: Path, resumed: str | None, log: Callable[[str], None]) -> None:
    """--resume auto goes past sealed checkpoints newer than `resumed` whose files are damaged
    (truncated, missing): name each one. When every checkpoint is damaged, refuse, instead of
    training from step 0 over them."""
    damaged = {t: p for t, p in integrity.sealed_problems(root).items() if t > (resumed or "")}
    if damaged and resumed is None:
        raise CheckpointError(
            f"every checkpoint in {root} is damaged ({'; '.join(damaged.values())}); nothing was "
            "changed: restore the files, or move the run folder away (or pick another --out) "
            "to start over"
        )
    for tag, problem in sorted(damaged.items(), reverse=True):
        log(f"warning: skipping the damaged checkpoint {tag}: {problem}")
    if damaged:
        log(f"resuming from {resumed}, the newest checkpoint whose files are whole")


def verify_resume(
    plan: ResumePlan, auto: bool, now: Topology, mode: str, log: Callable[[str], None]
) -> ResumePlan:
    """Every rank calls, once the process group is up: the files of the planned checkpoint are
    hashed by all ranks together. A corrupt named checkpoint is refused; with --resume auto the
    newest older one that verifies is planned instead."""

    def corrupt(root: Path, tag: str) -> str | None:
        return integrity.verify(root / tag)

    good = _first_good(plan.root, plan.tag, auto, corrupt, log, refuse="a corrupt checkpoint")
    if good == plan.tag:
        return plan
    log(f"resuming from {good} instead of the corrupt {plan.tag}")
    return _plan_load(plan.root, good, now, mode, f"{good}, the newest that verifies")


def _plan_load(root: Path, tag: str, now: Topology, mode: str, why: str) -> ResumePlan:
    """Whether checkpoint root/tag loads natively or through a universal copy."""
    try:
        saved = layout.load_trainer_state(root, tag)
    except CheckpointError:
        raise  # already one line naming the file
    except Exception as e:  # damaged beyond unpickling
        raise CheckpointError(f"{root / tag}: unreadable trainer state ({e})") from None
    use = universal_copy.plan(saved, now, mode)
    if (root / tag / "offloaded_tensors").is_dir():
        use = _nvme_checkpoint(root / tag, now, mode, native=not use)
    if use and not os.access(root, os.W_OK) and not universal_copy.is_ready(root, tag):
        raise CheckpointError(
            f"{root / tag}: resuming on {now} needs a universal copy beside it, and {root} is "
            "not writable; copy the checkpoint somewhere writable and --resume from there"
        )
    return ResumePlan(root, tag, use, Topology.of_checkpoint(saved), why)


def _nvme_checkpoint(folder: Path, now: Topology, mode: str, native: bool) -> bool:
    """A checkpoint saved with ZeRO-Infinity's optimizer states on NVMe (offloaded_tensors/)
    resumes natively under the same layout with the optimizer still on NVMe (DeepSpeed copies
    the swap files back; engines/ds.py: restore_swapped_optimizer loads the optimizer file that
    DeepSpeed 0.19.8 skips there), and through its universal copy, made from the swap files,
    under a config that keeps the optimizer in memory. A layout change that keeps the optimizer
    on NVMe is refused: DeepSpeed's universal load into swapped sub-groups is untested here."""
    if now.optimizer_on_nvme:
        if native:
            return False
        raise CheckpointError(
            f"{folder} keeps its optimizer states on NVMe (offloaded_tensors/): it resumes "
            "under the same world size and layout with the optimizer on NVMe, or through its "
            "universal copy under a config that keeps the optimizer in memory "
            "(ds_configs/zero3_offload.json, zero3.json), not on a new layout with the optimizer "
            "on NVMe; or export it (python -m training.export)"
        )
    if mode == "never":
        raise CheckpointError(
            f"{folder} keeps its optimizer states on NVMe (offloaded_tensors/), which only "
            "its universal copy hands to another config, and --universal never forbids it"
        )
    return True


def _unreadable(root: Path, tag: str) -> str | None:
    try:
        layout.load_trainer_state(root, tag)
    except CheckpointError as e:
        return str(e)
    except Exception as e:  # damaged beyond unpickling: torch raises many kinds
        return f"{root / tag}: unreadable trainer state ({e})"
    return None


def _first_good(
    root: Path,
    tag: str,
    auto: bool,
    problem_of: Callable[[Path, str], str | None],
    log: Callable[[str], None],
    refuse: str = "",
) -> str:
    """`tag` if `problem_of` finds nothing wrong with it; else, with auto, the newest older
    complete checkpoint that passes (each skip is logged). A named checkpoint that fails, or a
    run where none passes, raises CheckpointError."""
    problem = problem_of(root, tag)
    if problem is None:
        return tag
    if not auto:
        raise CheckpointError(f"refusing to resume from {refuse}: {problem}" if refuse else problem)
    problems = [problem]
    for older in reversed([t for t in layout.complete_tags(root) if t < tag]):
        log(f"warning: {problem}; trying the previous checkpoint {older}")
        problem = problem_of(root, older)
        if problem is None:
            return older
        problems.append(problem)
    raise CheckpointError(
        f"no checkpoint in {root} can be resumed ({'; '.join(problems)}); nothing was changed: "
        "restore the files, or move the run folder away (or pick another --out) to start over"
    )
