"""Picking a run up where a checkpoint left it: the engine's files, the loop's counters, the data
reader's position and, on the same world size, each rank's RNG state."""

from __future__ import annotations

from training.checkpoints import layout
from training.checkpoints.resume import ResumePlan
from training.engines.base import Engine
from training.loop.loop import LoopState


def restore(plan: ResumePlan, engine: Engine, loader, rank: int, world: int) -> LoopState:
    """All ranks call. Loads the engine from the plan's folder (its universal copy when the plan
    says so) and moves `loader` to where the checkpoint's run stopped reading."""
    engine.load(plan.root, plan.load_tag)
    saved = plan.trainer_state()
    loader.load_state_dict(saved["data"])
    rngs = saved.get("rng", [])
    if saved.get("world") == world and rank < len(rngs):
        layout.set_rng_state(rngs[rank])
    return LoopState(
        saved["step"], saved["tokens"], saved.get("skipped", 0), saved.get("nonfinite", 0)
    )
