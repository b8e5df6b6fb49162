"""A model's repeated transformer blocks: the unit regional compilation compiles, FSDP2 shards and
ZeRO-3 gathers whole. A transformers model names its block classes in `_no_split_modules` (ours:
`Block`; Llama's: `LlamaDecoderLayer`)."""

from __future__ import annotations

from torch import nn


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` whose class it lists in `_no_split_modules` (else named `Block`),
    in order."""
    names = set(getattr(model, "_no_split_modules", None) or ["Block"])
    return [m for m in model.modules() if type(m).__name__ in names]
