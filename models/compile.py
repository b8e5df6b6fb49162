"""Regional compilation: `torch.compile` of each transformer block rather than the whole model.

The blocks of a model share their code, so Inductor compiles one and reuses it for the others:
the compile time of a 32-layer model is about that of a 2-layer one, where compiling the whole
model traces every layer. Parameter names and checkpoints are unchanged (`Module.compile` works
in place). Works for our model and any transformers model: the block classes are the ones it
lists in `_no_split_modules` (e.g. `Block`, `LlamaDecoderLayer`)."""

from __future__ import annotations

from torch import nn

from models.blocks import transformer_blocks


def compile_blocks(model: nn.Module) -> tuple[int, str]:
    """Compile `model`'s blocks in place; returns (how many, their class name). A model that
    names no block classes is compiled whole: (1, its class name)."""
    blocks = transformer_blocks(model)
    if not blocks:
        model.compile()
        return 1, type(model).__name__
    for block in blocks:
        block.compile()
    return len(blocks), type(blocks[0]).__name__
