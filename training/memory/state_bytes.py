"""How many bytes of model states one rank holds, the same way for every engine.

Model states are what ZeRO's theory counts: parameters, gradients and optimizer states (fp32
master copies and Adam's moments). Communication buckets are counted apart as `buffers`.
The count walks the engine's own objects: every tensor storage reachable from the model's
parameters (and their `.grad`) and from the optimizer object (its `state`, and for DeepSpeed its
flat partitions and buckets) is counted once, by its storage size, so views into a flat buffer
are never double-counted. A storage is

    params      if it backs a model parameter (a DTensor's local shard; ZeRO-3's `ds_tensor`)
    grads       if it backs a parameter's `.grad`, or is reached through a name holding "grad"
    buffers     if it is reached through a name holding "ipg" or "bucket" (reduction buckets)
    optimizer   otherwise (master weights, exp_avg, exp_avg_sq, step counters)
"""

from __future__ import annotations

import torch
from torch import nn

CATEGORIES = ("params", "grads", "optimizer", "buffers")
_WALK_PACKAGES = ("deepspeed", "torch.optim", "torch.amp", "torch.distributed.optim")


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # DTensor: the shard this rank holds
    return to_local() if callable(to_local) else t


def state_bytes(module: nn.Module, *optimizers) -> dict[str, int]:
    """{"params", "grads", "optimizer", "buffers", "total"}: bytes this rank holds."""
    seen: dict[tuple, str] = {}
    sizes: dict[tuple, int] = {}

    def add(t, category: str) -> None:
        if not isinstance(t, torch.Tensor):
            return
        t = _local(t)
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        if storage.nbytes() == 0 or key in seen:
            return
        seen[key] = category
        sizes[key] = storage.nbytes()

    params = list(module.parameters())
    for p in params:
        add(getattr(p, "ds_tensor", None), "params")  # ZeRO-3 partition
        add(p, "params")
    for p in params:
        add(p.grad, "grads")
    visited: set[int] = set()
    for opt in optimizers:
        _walk(opt, "", add, visited, depth=0)

    out = dict.fromkeys(CATEGORIES, 0)
    for key, category in seen.items():
        out[category] += sizes[key]
    out["total"] = sum(out[c] for c in CATEGORIES)
    return out


def _category(path: str) -> str:
    name = path.lower()
    if "ipg" in name or "bucket" in name:
        return "buffers"
    if "grad" in name:
        return "grads"
    return "optimizer"


def _walk(obj, path: str, add, visited: set[int], depth: int) -> None:
    if depth > 8 or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    if isinstance(obj, torch.Tensor):
        add(obj, _category(path))
        add(obj.grad, "grads")
        return
    if id(obj) in visited or isinstance(obj, nn.Module):  # the model's tensors are counted above
        return
    visited.add(id(obj))
    if isinstance(obj, dict):
        for k, v in obj.items():
            _walk(k, path, add, visited, depth + 1)
            _walk(v, f"{path}.{k}" if isinstance(k, str) else path, add, visited, depth + 1)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            _walk(v, path, add, visited, depth + 1)
    elif type(obj).__module__.startswith(_WALK_PACKAGES) and hasattr(obj, "__dict__"):
        for k, v in vars(obj).items():
            _walk(v, f"{path}.{k}", add, visited, depth + 1)
