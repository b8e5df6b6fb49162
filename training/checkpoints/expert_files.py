"""The experts of an expert-parallel (AutoEP) checkpoint, put back together under our names.

AutoEP holds, on each rank of an expert group, `num_experts / ep_size` experts of every routed
MLP as TorchTitan-style stacks `experts.w1` (gate), `experts.w3` (up), `experts.w2` (down),
and its router as `router.gate.weight`. ZeRO-1/2 keeps those experts in their own parameter
group, partitioned across the expert-data-parallel ranks only (global ranks r with
r % ep_size == the expert rank, DeepSpeed's default layout), so each expert rank's files hold a
different slice of experts. `ExpertLayout` reads which rank holds which experts from the record
AutoEP writes into the model-states file (`ds_autoep_layers`); `model_params` renames and fuses
the joined tensors into our model's parameters: `gate_up_proj` = [w1; w3] along the rows,
`down_proj` = w2, `gate.weight` = the router's. Adam's moments are elementwise, so they fuse
the same way. Export, the universal copy and the tests all read these names.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from training.errors import CheckpointError

_EXPERT = re.compile(r"(.*)\.experts\.(w[123])$")
_ROUTER = re.compile(r"(.*)\.router\.gate\.weight$")


class ExpertLayout:
    """Which expert rank holds which experts of an AutoEP checkpoint."""

    def __init__(self, folder: Path, layers: list[dict]):
        self.ep_size = int(layers[0]["ep_size"])
        for layer in layers:
            placement = layer["expert_placement"]["ranks"]
            per_rank = layer["num_experts"] // self.ep_size
            contiguous = all(
                p["experts"] == list(range(p["rank"] * per_rank, (p["rank"] + 1) * per_rank))
                for p in placement
            )
            if not contiguous or int(layer["ep_size"]) != self.ep_size:
                raise CheckpointError(
                    f"{folder}: AutoEP placed the experts of {layer['module_path']} out of "
                    "rank order, which is not joined here"
                )

    @staticmethod
    def of(folder: Path, model_states: dict) -> ExpertLayout | None:
        """The layout recorded in a checkpoint's model-states file; None without experts split
        across ranks."""
        layers = model_states.get("ds_autoep_layers") or []
        if not layers or int(layers[0].get("ep_size", 1)) <= 1:
            return None
        return ExpertLayout(folder, layers)

    @staticmethod
    def is_expert(name: str) -> bool:
        return _EXPERT.fullmatch(name) is not None

    def ranks_of(self, ep_rank: int, world: int) -> list[int]:
        """The global ranks whose files hold expert rank `ep_rank`'s experts."""
        return list(range(ep_rank, world, self.ep_size))


class _Rows(Mapping):
    """Several parameters' states joined along `dim` (a fused gate_up_proj: w1 then w3)."""

    def __init__(self, parts: list[Mapping], dim: int):
        self._parts, self._dim = parts, dim
        shape = list(parts[0].shape)
        shape[dim] = sum(p.shape[dim] for p in parts)
        self.shape = torch.Size(shape)

    def __getitem__(self, key: str) -> torch.Tensor:
        return torch.cat([p[key] for p in self._parts], dim=self._dim)

    def __iter__(self):
        return iter(self._parts[0])

    def __len__(self) -> int:
        return len(self._parts[0])


def model_params(params: Iterator[tuple[str, Mapping, object]]) -> Iterator[tuple]:
    """(name, states, step) under AutoEP's names -> the same under our model's names, w1 held
    back until its w3 arrives (one layer's gate stack, never the whole model)."""
    waiting: dict[str, Mapping] = {}
    for name, states, step in params:
        if m := _ROUTER.fullmatch(name):
            yield f"{m.group(1)}.gate.weight", states, step
        elif m := _EXPERT.fullmatch(name):
            prefix, which = m.groups()
            if which == "w2":
                yield f"{prefix}.experts.down_proj", states, step
                continue
            waiting[f"{prefix}.{which}"] = states
            w1, w3 = waiting.get(f"{prefix}.w1"), waiting.get(f"{prefix}.w3")
            if w1 is not None and w3 is not None:
                del waiting[f"{prefix}.w1"], waiting[f"{prefix}.w3"]
                yield f"{prefix}.experts.gate_up_proj", _Rows([w1, w3], 1), step
        else:
            yield name, states, step
    if waiting:
        raise CheckpointError(f"AutoEP expert stacks without their pair: {sorted(waiting)}")
