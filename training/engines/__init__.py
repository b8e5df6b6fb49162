"""The engines the one training loop drives (the interface: base.py): DeepSpeed (ds.py), its
pipeline engine when the config asks for pipeline stages (pipeline.py), and native PyTorch DDP
(ddp.py) and FSDP2 (fsdp.py), the last two sharing precision, accumulation and clipping
(native.py). Each is built from the model, its own config and nothing else; DDP and FSDP2 also
read their own checkpoints back into whole fp32 weights for export (`load_full_state_dict`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from training.engines.base import Engine, OptimizerHparams, StepResult
from training.engines.ddp import DDPEngine
from training.engines.ddp import load_full_state_dict as ddp_full_state_dict
from training.engines.ds import DeepSpeedEngine
from training.engines.fsdp import FSDPEngine
from training.engines.fsdp import load_full_state_dict as fsdp_full_state_dict
from training.engines.pipeline_engine import PipelineEngine
from training.settings.ds_config import pipeline_stages
from training.settings.run_config import EngineConfig

__all__ = ["Engine", "OptimizerHparams", "StepResult", "build_engine", "load_full_state_dict"]


def build_engine(
    engine: EngineConfig,
    *,
    model,
    ds_config: dict,
    optimizer: OptimizerHparams,
    device: torch.device,
    precision: str,
    attention: str = "sdpa",
    hold_weights: bool = False,
    zero3_whole_blocks: bool = False,
    grad_sum: bool = False,
) -> Engine:
    """The run's engine section says which: 'deepspeed' (the pipeline engine when ds_config has
    pipeline.stages > 1), 'ddp' or 'fsdp', with their own settings. DeepSpeed reads precision,
    batch and clipping from ds_config; the native engines take precision as given and read
    accumulation and clipping from the same keys DeepSpeed would. Each engine gets its own
    switches only (resolved by training/preflight/switches.py): ZeRO-3 `zero3_whole_blocks`,
    ZeRO-1/2 `grad_sum`, FSDP2 `hold_weights` (ZeRO-3's hold is in its config's persistence
    threshold)."""
    backend = engine.backend
    if backend == "deepspeed":
        if pipeline_stages(ds_config) > 1:
            return PipelineEngine(
                model=model,
                ds_config=ds_config,
                optimizer=optimizer,
                device=device,
                attention=attention,
            )
        return DeepSpeedEngine(
            model=model,
            ds_config=ds_config,
            optimizer=optimizer,
            device=device,
            whole_blocks=zero3_whole_blocks,
            grad_sum=grad_sum,
        )
    native = {
        "model": model,
        "optimizer": optimizer,
        "device": device,
        "precision": precision,
        "grad_accum": int(ds_config["gradient_accumulation_steps"]),
        "grad_clip": float(ds_config.get("gradient_clipping") or 0.0),
    }
    if backend == "ddp":
        return DDPEngine(**native, bucket_mb=engine.ddp_bucket_mb)
    if backend == "fsdp":
        return FSDPEngine(
            **native,
            reshard_after_forward=engine.fsdp_reshard_after_forward,
            cpu_offload=engine.fsdp_cpu_offload,
            hold=hold_weights,
        )
    raise ValueError(f"unknown backend {backend!r}; choose deepspeed, ddp or fsdp")


def load_full_state_dict(backend: str, checkpoint_folder) -> dict[str, torch.Tensor]:
    """A ddp or fsdp checkpoint folder (RUN/checkpoints/step_N) -> its whole weights, fp32,
    under the model's own parameter names. Runs in one process, without a process group."""
    folder = Path(checkpoint_folder)
    if backend == "ddp":
        return ddp_full_state_dict(folder)
    if backend == "fsdp":
        return fsdp_full_state_dict(folder)
    raise ValueError(f"no full-state-dict reader for backend {backend!r} (use training.export)")
