"""AdamW with weight decay only on matrices, in the fastest implementation the device has."""

from __future__ import annotations

import torch

from training.engines.base import OptimizerConfig


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: 2-D+ tensors (matmul weights, embeddings) decay; norms, biases and other
    1-D tensors do not."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        # Under ZeRO-3 p is an empty placeholder; ds_shape is the parameter's real shape.
        dim = len(p.ds_shape) if hasattr(p, "ds_shape") else p.dim()
        (decay if dim >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def adamw(
    groups: list[dict], config: OptimizerConfig, *, device_type: str
) -> torch.optim.Optimizer:
    """torch AdamW over `groups` (their weight decay is their own), fused where the device
    supports it (on CPU several times the default for-each implementation)."""
    fused = device_type in ("cpu", "cuda", "xpu", "mps")
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps, fused=fused)
