"""The replica check: every parameter that several ranks hold whole is bit-identical on all of
them (data-parallel replicas under ZeRO-0/1/2 and DDP, the ranks of a tensor-parallel group, a
pipeline stage's replicas, the tied embedding on a pipeline's first and last stage).

Each rank takes a digest of each parameter on the device it lives on (two 64-bit sums of its
bits), and the ranks gather the digests once; the ranks holding the same copy compare theirs.
What a rank holds is read off the marks the engines leave on a parameter:

    ZeRO-3 (`ds_id`), FSDP2 (a sharded DTensor)        a shard: not a copy, skipped
    AutoEP's experts (`allreduce` False)               this rank's experts: skipped
    a tensor-parallel slice (`tensor_model_parallel`)  compared with the ranks holding the same
                                                       slice (the same tensor-parallel rank)
    anything else                                      whole: compared with every rank holding it

The model's weights are never copied to the host: only two numbers per parameter travel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from training.runtime import distributed

CHUNK = 1 << 22  # elements digested at a time: bounds the int64 temporaries (32 MiB each)
BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # by element size


@dataclass(frozen=True)
class Replicas:
    """What the check found: how many parameters (or tensor-parallel slices) several ranks hold
    (`checked`), and the names of those whose copies differ between ranks (`differ`)."""

    checked: int
    differ: list[str]

    def record(self, step: int) -> dict:
        """The metrics.jsonl record, with a note the console shows."""
        held = f"parameters (or tensor-parallel slices) held by several ranks: {self.checked}"
        if self.differ:
            names = ", ".join(self.differ[:5]) + (" ..." if len(self.differ) > 5 else "")
            note = f"warning: {held}, of which {len(self.differ)} differ between them: {names}"
        else:
            note = f"{held}, bit-identical on each" if self.checked else held
        return {
            "kind": "replicas",
            "step": step,
            "checked": self.checked,
            "differ": self.differ,
            "note": note,
        }


def held_copies(module: nn.Module, tensor_rank: int = 0) -> dict[str, torch.Tensor]:
    """This rank's parameters that other ranks may hold the same copy of, by key: the name for
    a whole parameter; for a tensor-parallel slice the name and the slice (`tensor_rank`, this
    rank's place in its tensor-parallel group). Shards (ZeRO-3, FSDP2) and experts are left out."""
    out = {}
    for name, p in module.named_parameters():
        if hasattr(p, "ds_id") or getattr(p, "allreduce", True) is False:
            continue  # a ZeRO-3 partition; an expert-parallel rank's own experts
        if isinstance(p, DTensor):  # FSDP2's: a whole copy only where every mesh replicates
            if not all(pl.is_replicate() for pl in p.placements):
                continue
            p = p.to_local()
        if getattr(p, "tensor_model_parallel", False):
            name = f"{name} (tensor-parallel slice {tensor_rank})"
        out[name] = p
    return out


@torch.no_grad()
def digest(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of `t`'s bits, on `t`'s device: the plain sum, and one weighted by odd
    numbers rising with the position (a permutation changes it). Integer sums wrap and do not
    depend on their order, so equal tensors give equal digests on any device; a tensor differing
    in one element changes both."""
    flat = t.detach().contiguous().view(-1)
    bits = flat.view(BITS.get(flat.element_size(), torch.uint8))
    out = torch.zeros(2, dtype=torch.int64, device=t.device)
    for start in range(0, bits.numel(), CHUNK):
        chunk = bits[start : start + CHUNK].to(torch.int64)
        weight = torch.arange(start, start + chunk.numel(), device=t.device) * 2 + 1
        out[0] += chunk.sum()
        out[1] += (chunk * weight).sum()
    return out


def check(module: nn.Module, tensor_rank: int = 0) -> Replicas:
    """Compare every copy of a parameter across the ranks that hold it (all ranks call; one
    all-gather of two numbers per parameter). `tensor_rank`: this rank's place in its
    tensor-parallel group (0 without one)."""
    copies = held_copies(module, tensor_rank)
    mine = {}
    if copies:  # the digests stacked on one device, then one small copy to the host
        device = next(iter(copies.values())).device
        sums = torch.stack([digest(p).to(device) for p in copies.values()]).cpu().tolist()
        mine = dict(zip(copies, map(tuple, sums), strict=True))
    seen: dict[str, list[tuple[int, int]]] = {}
    for theirs in distributed.all_gather_object(mine):
        for name, value in theirs.items():
            seen.setdefault(name, []).append(value)
    shared = {name: values for name, values in seen.items() if len(values) > 1}
    differ = sorted(name for name, values in shared.items() if len(set(values)) > 1)
    return Replicas(checked=len(shared), differ=differ)
