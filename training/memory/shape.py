"""A model counted for the memory plan, without building it: its parameters (LoRA: which of
them train), its largest module, its layers and widths, from a preset, an HF folder, a config
or a run's resolved_config.json."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from models import (
    PRESETS,
    ModelError,
    ZeroStackConfig,
    get_config,
    lora,
    model_class,
    transformer_blocks,
)
from models.hub import is_hub_name, resolve_pretrained


@dataclass
class ModelShape:
    name: str
    params: int
    largest_layer: int  # parameters of the largest single module (ZeRO-3 gathers it whole)
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    # parameters that train (LoRA: the adapters; None: all). Frozen weights carry no gradients
    # and no optimizer states.
    trainable: int | None = None
    # parameters of the routed experts (within `params`): expert parallelism splits them across
    # the ranks of an expert group, where every other weight is on every rank
    experts: int = 0
    tied: bool = False  # the head shares the embedding's weight
    # a block's parameters that tensor parallelism keeps whole on every rank: its norms, and
    # QK-norm's per-head ones (None: the two norms of `hidden` weights)
    block_whole: int | None = None
    # the blocks' 2-D weight matrices: what Muon updates (one momentum buffer where Adam keeps
    # two moments; training/engines/optim.py muon_split)
    matrices: int = 0

    @property
    def trained(self) -> int:
        return self.params if self.trainable is None else self.trainable

    def on_rank(self, n: int, expert_parallel: int) -> float:
        """Of `n` parameters (all of them, or those that train), how many one rank holds when
        each expert group of `expert_parallel` ranks shares the experts out."""
        if self.trainable is not None:  # LoRA: the adapters, none of them on experts
            return n
        return n - self.experts + self.experts / expert_parallel


def model_shape(spec: str, vocab_size: int | None = None, lora_spec=None) -> ModelShape:
    """Count a preset's or an HF folder's parameters on the meta device (no memory, no weights);
    with a LoraSpec, only its adapters train (`with_lora`)."""
    if spec in PRESETS:
        cfg = get_config(spec, **({"vocab_size": vocab_size} if vocab_size else {}))
    elif is_hub_name(spec) or Path(spec).is_dir():
        spec = str(resolve_pretrained(spec, what="--model"))
        if not (Path(spec) / "config.json").is_file():
            raise ModelError(f"--model {spec}: folder has no config.json, so it holds no model")
        cfg = AutoConfig.from_pretrained(spec)
        if vocab_size and vocab_size > cfg.vocab_size:
            cfg.vocab_size = vocab_size
    else:
        raise ModelError(f"--model {spec}: not a preset ({', '.join(PRESETS)}) and not a folder")
    shape = shape_of_config(cfg, spec)
    return with_lora(shape, cfg, lora_spec) if lora_spec else shape


def shape_of_config(cfg, name: str) -> ModelShape:
    """The ModelShape of a model config (ours or any HF causal LM's), built on the meta device."""
    with torch.device("meta"):
        if isinstance(cfg, ZeroStackConfig):
            model = model_class(cfg)._from_config(cfg)
        else:
            model = AutoModelForCausalLM.from_config(cfg)
    # ds_numel: a ZeRO-3 model alive in this process makes transformers build under zero.Init
    numel = lambda p: getattr(p, "ds_numel", p.numel())  # noqa: E731
    unique = {id(p): numel(p) for p in model.parameters()}  # tied weights count once
    largest = max(sum(numel(p) for p in m.parameters(recurse=False)) for m in model.modules())
    experts = sum(numel(p) for n, p in model.named_parameters() if ".experts." in n)
    hidden = cfg.hidden_size  # HF configs map their own names (n_embd, ...) onto these
    # one block's norms (QK-norm's too): what tensor parallelism does not split; a projection's
    # bias is split with it
    blocks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    first = blocks[0][0] if blocks and len(blocks[0]) else None
    whole = None
    if first is not None:
        norms = [p for n, p in first.named_parameters() if "norm" in n or n.startswith("ln_")]
        whole = sum(numel(p) for p in norms)
    inside = {id(p): p for b in transformer_blocks(model) for p in b.parameters()}
    matrices = sum(numel(p) for p in inside.values() if len(getattr(p, "ds_shape", p.shape)) == 2)
    return ModelShape(
        name=name,
        params=sum(unique.values()),
        largest_layer=largest,
        layers=cfg.num_hidden_layers,
        hidden=hidden,
        intermediate=getattr(cfg, "intermediate_size", None) or 4 * hidden,
        vocab=cfg.vocab_size,
        experts=experts,
        tied=bool(getattr(cfg, "tie_word_embeddings", False)),
        block_whole=whole,
        matrices=matrices,
    )


def with_lora(shape: ModelShape, cfg, spec) -> ModelShape:
    """`shape` with the adapters of LoraSpec `spec` (models/lora.py) added and the rest frozen;
    raises ModelError when a target matches no module."""
    with torch.device("meta"):
        if isinstance(cfg, ZeroStackConfig):
            model = model_class(cfg)._from_config(cfg)
        else:
            model = AutoModelForCausalLM.from_config(cfg)
    added = lora.trainable_count(model, spec)
    return replace(shape, params=shape.params + added, trainable=added)


def shape_of_run(resolved: dict) -> ModelShape:
    """The ModelShape of a run, from its resolved_config.json (no model is built)."""
    c = resolved["model_config"]
    h, inter = c["hidden_size"], c.get("intermediate_size") or 4 * c["hidden_size"]
    shape = ModelShape(
        name=str(resolved["flags"]["model"]),
        params=int(resolved["n_params"]),
        largest_layer=max(c["vocab_size"] * h, inter * h),
        layers=c["num_hidden_layers"],
        hidden=h,
        intermediate=inter,
        vocab=c["vocab_size"],
        trainable=resolved.get("trainable_params") if resolved["flags"].get("lora") else None,
        experts=_expert_params(c, inter),
        tied=bool(c.get("tie_word_embeddings", False)),
        block_whole=2 * h + (2 * _head_dim(c) if c.get("qk_norm") else 0),
    )
    embeddings = c["vocab_size"] * h * (1 if c.get("tie_word_embeddings") else 2)
    whole = shape.layers * shape.block_whole + h  # the blocks' norms and the final one
    return replace(shape, matrices=shape.params - embeddings - whole)


def _head_dim(c: dict) -> int:
    """A saved config's head width: its head_dim, else hidden / heads (as the model derives it)."""
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


def _expert_params(c: dict, inter: int) -> int:
    """The routed experts' parameters of a saved config (ours, Mixtral's or Qwen3-MoE's): three
    SwiGLU matrices per expert and layer; 0 for a dense model."""
    experts = c.get("num_experts") or c.get("num_local_experts") or 0
    width = c.get("moe_intermediate_size") or inter
    return experts * 3 * c["hidden_size"] * width * c["num_hidden_layers"]
