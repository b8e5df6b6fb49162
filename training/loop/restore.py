"""Picking a run up where a checkpoint left it: the engine's files, the loop's counters, the data
reader's position and, on the same world size, each rank's RNG state."""

from __future__ import annotations

import pickle

from training.checkpoints import layout
from training.checkpoints.resume_point import ResumePlan
from training.engines.base import Engine
from training.engines.spike_guard import LOSS_SCALE, saved_accumulation
from training.errors import CheckpointError
from training.loop.loop import LoopState
from training.runtime import safe_load


def restore(plan: ResumePlan, engine: Engine, loader, rank: int, world: int) -> LoopState:
    """All ranks call. Loads the engine from the plan's folder (its universal copy when the plan
    says so) and moves `loader` to where the checkpoint's run stopped reading."""
    try:
        with safe_load.weights_only():  # DeepSpeed's and DCP's own torch.loads too
            engine.load(plan.root, plan.load_tag)
    except pickle.UnpicklingError as e:  # a file changed after the preflight's check
        raise CheckpointError(
            safe_load.refusal(plan.root / plan.load_tag, [safe_load.refused_name(e)])
        ) from None
    saved = plan.trainer_state()
    loader.load_state_dict(saved["data"])
    rngs = saved.get("rng", [])
    if saved.get("world") == world and rank < len(rngs):
        layout.set_rng_state(rngs[rank])
    return LoopState(
        saved["step"],
        saved["tokens"],
        saved.get("skipped", 0),
        saved.get("nonfinite", 0),
        dict(saved.get("skipped_by", {})),
        saved.get("rollbacks", 0),
        _guard_state(saved),
    )


def _guard_state(saved: dict) -> dict | None:
    """The spike guard's history as the checkpoint kept it, with the accumulation its loss row
    was summed over where it was kept summed."""
    guard = saved.get("spike_guard")
    if not guard or guard.get("loss") == LOSS_SCALE:
        return guard
    return {**guard, "summed_over": saved_accumulation(saved)}
