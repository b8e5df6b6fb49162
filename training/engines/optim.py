"""The optimizers every engine builds from one parameter split: AdamW with weight decay only on
matrices, in the fastest implementation the device has, and (--optimizer muon) Muon on the
transformer blocks' weight matrices beside AdamW on the rest."""

from __future__ import annotations

import torch

from models import transformer_blocks
from training.engines.base import OptimizerHparams
from training.settings.hparams import MUON_MOMENTUM


def _dims(p: torch.Tensor) -> int:
    # Under ZeRO-3 p is an empty placeholder; ds_shape is the parameter's real shape.
    return len(p.ds_shape) if hasattr(p, "ds_shape") else p.dim()


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: 2-D+ tensors (matmul weights, embeddings) decay; norms, biases and other
    1-D tensors do not."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if _dims(p) >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def muon_split(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """(Muon's, AdamW's) trainable parameter names: the 2-D weight matrices inside the
    transformer blocks (attention and MLP projections) go to Muon; embeddings, the lm head,
    norms and biases to AdamW. Muon orthogonalizes a hidden layer's update, which has no
    meaning for a lookup table or a vector."""
    inside = {id(p) for block in transformer_blocks(model) for p in block.parameters()}
    muon, rest = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (muon if id(p) in inside and _dims(p) == 2 else rest).append(name)
    return muon, rest


def tag_muon(model: torch.nn.Module) -> set[str]:
    """Set `use_muon` on every parameter by muon_split (what DeepSpeed's Muon reads); returns
    the names tagged True."""
    muon = set(muon_split(model)[0])
    for name, p in model.named_parameters():
        p.use_muon = name in muon
    return muon


def group_lr(group: dict, lr: float, config: OptimizerHparams) -> float:
    """A param group's learning rate for the schedule's `lr`: Muon's groups follow it in
    proportion, from --muon-lr at the peak --lr."""
    if not group.get("use_muon") or config.muon_lr is None:
        return lr
    return lr * config.muon_lr / config.lr if config.lr > 0 else 0.0


def adamw(
    groups: list[dict], config: OptimizerHparams, *, device_type: str
) -> torch.optim.Optimizer:
    """torch AdamW over `groups` (their weight decay is their own), fused where the device
    supports it (on CPU several times the default for-each implementation)."""
    fused = device_type in ("cpu", "cuda", "xpu", "mps")
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps, fused=fused)


def native_optimizer(
    model: torch.nn.Module, config: OptimizerHparams, muon: list[str], *, device_type: str
) -> torch.optim.Optimizer:
    """What the native engines (DDP, FSDP2) step: AdamW over param_groups, or with a Muon lr
    torch.optim.Muon over the parameters named in `muon` (muon_split's, taken before the
    engine wrapped the model) beside AdamW over the rest."""
    if config.muon_lr is None:
        return adamw(param_groups(model, config.weight_decay), config, device_type=device_type)
    from training.engines.muon import MuonWithAdamW

    muon = set(muon)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    matrices = [p for n, p in named if n in muon]
    rest = [p for n, p in named if n not in muon]
    decay = [p for p in rest if _dims(p) >= 2]
    no_decay = [p for p in rest if _dims(p) < 2]
    adam_groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    muon_optimizer = torch.optim.Muon(
        [{"params": matrices, "use_muon": True}],
        lr=config.muon_lr,
        weight_decay=config.weight_decay,
        momentum=MUON_MOMENTUM,
    )
    return MuonWithAdamW(muon_optimizer, adamw(adam_groups, config, device_type=device_type))
