"""Regional compilation: `torch.compile` of each transformer block rather than the whole model.

The blocks of a model share their code, so Inductor compiles one and reuses it for the others:
the compile time of a 32-layer model is about that of a 2-layer one, where compiling the whole
model traces every layer. What is compiled is each block's `forward`, one compiled function per
block class taking the block as its argument, so module hooks stay outside the graph: ZeRO-3's
gather and release hooks (which carry each module's id, so compiling them through
`Module.compile` recompiled every block until Dynamo's limit) and FSDP2's run eagerly around
the compiled body. Parameter names and checkpoints are unchanged (nothing is wrapped). Works for
our model and any transformers model: the block classes are the ones it lists in
`_no_split_modules` (e.g. `Block`, `LlamaDecoderLayer`)."""

from __future__ import annotations

import os
import types

import torch
from torch import nn

from models.blocks import transformer_blocks


def cxx_compiler() -> str:
    """The C++ compiler Inductor and our CPU kernels build with: $CXX, as both read it, else c++."""
    return os.environ.get("CXX") or "c++"


def compile_blocks(model: nn.Module) -> tuple[int, str]:
    """Compile `model`'s blocks in place; returns (how many, their class name). A model that
    names no block classes is compiled whole: (1, its class name)."""
    blocks = transformer_blocks(model)
    if not blocks:
        model.compile()
        return 1, type(model).__name__
    compiled = {}  # one compiled forward per class, shared by its blocks
    for block in blocks:
        cls = type(block)
        if cls not in compiled:
            compiled[cls] = torch.compile(cls.forward)
        block.forward = types.MethodType(compiled[cls], block)
    return len(blocks), type(blocks[0]).__name__
