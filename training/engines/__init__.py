"""The engines the one training loop drives. Each wraps a model and an optimizer and offers the
same small interface:

    module                      the unwrapped model (for export, generate, FLOPs)
    forward_backward(x, y, boundary) -> loss   one micro-batch; grads reduced only on boundary.
                                The loss returned sums the micro-batches this call completed
                                (the pipeline engine completes the whole step on the boundary)
    step() -> StepResult        optimizer step with clipping (after the last micro-batch)
    set_lr(lr)                  the schedule's value for this step
    eval_loss(x, y) -> loss     no-grad forward
    save(root, tag, client)     write this engine's files for checkpoint `tag` (all ranks call)
    load(root, tag)             restore them (all ranks call)
    state_bytes() -> dict       bytes of params, grads, optimizer states this rank holds
    train() / eval()
    dp_rank, dp_world           optional: this rank's data-parallel replica and their number,
                                when they differ from rank and world (pipelining)

They differ only where the engines differ: DeepSpeed (training/engines/ds.py), DDP (ddp.py) and
FSDP2 (fsdp.py), the last two sharing precision, accumulation and clipping (native.py); the
DeepSpeed pipeline engine (pipeline.py) when the config asks for pipeline stages. DDP and FSDP2
also read their own checkpoints back into whole fp32 weights for export (`load_full_state_dict`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class StepResult:
    grad_norm: float | None
    skipped: bool  # the update was not applied (fp16 overflow, non-finite gradients)
    loss_scale: float | None = None  # fp16 only


def build_engine(kind: str, **kwargs):
    """kind: 'deepspeed', 'ddp' or 'fsdp'; a DeepSpeed config with pipeline.stages > 1 gets
    the pipeline engine."""
    if kind == "deepspeed" and kwargs["ds_config"].get("pipeline", {}).get("stages", 1) > 1:
        from training.engines.pipeline import PipelineEngine

        return PipelineEngine(**kwargs)
    if kind == "deepspeed":
        from training.engines.ds import DeepSpeedEngine

        return DeepSpeedEngine(**kwargs)
    if kind == "ddp":
        from training.engines.ddp import DDPEngine

        return DDPEngine(**kwargs)
    if kind == "fsdp":
        from training.engines.fsdp import FSDPEngine

        return FSDPEngine(**kwargs)
    raise ValueError(f"unknown backend {kind!r}; choose deepspeed, ddp or fsdp")


def data_parallel(engine, dist) -> tuple[int, int]:
    """(replica, replicas): what shards the data. Every rank is its own replica, except under
    pipelining, where the stages of one replica read the same batches."""
    return getattr(engine, "dp_rank", dist.rank), getattr(engine, "dp_world", dist.world)


def load_full_state_dict(backend: str, checkpoint_folder) -> dict[str, torch.Tensor]:
    """A ddp or fsdp checkpoint folder (RUN/checkpoints/step_N) -> its whole weights, fp32,
    under the model's own parameter names. Runs in one process, without a process group."""
    folder = Path(checkpoint_folder)
    if backend == "ddp":
        from training.engines.ddp import load_full_state_dict as load
    elif backend == "fsdp":
        from training.engines.fsdp import load_full_state_dict as load
    else:
        raise ValueError(f"no full-state-dict reader for backend {backend!r} (use training.export)")
    return load(folder)
