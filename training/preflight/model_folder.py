"""Preflight of the model: its config (a preset, a local folder, a hub name) read without
building it, its weights' shapes against that config, and the model against the data, the
attention kernel, the pipeline and tensor/sequence parallelism."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoConfig

from models import PRESETS, ModelError, cpu_attention, get_config
from models.hub import resolve_pretrained
from training.errors import ConfigError
from training.runtime import safe_load
from training.settings.run_config import RunConfig


def model_overrides(spec: str, seq_len: int, qk_norm: bool = False) -> dict:
    """A preset has no trained positions: a --seq-len beyond its max_position_embeddings (long
    context) widens the rotary range it is built with. A folder's positions are its own.
    --qk-norm builds a preset with a norm of each head's queries and keys (presets only)."""
    if qk_norm and spec not in PRESETS:
        raise ConfigError(f"--qk-norm: builds one of our presets; --model {spec} is not one")
    out = {"qk_norm": True} if qk_norm else {}
    if spec in PRESETS and seq_len > get_config(spec).max_position_embeddings:
        out["max_position_embeddings"] = seq_len
    return out


def model_config(spec: str, vocab_size: int, overrides: dict | None = None):
    """The model's config without building it (presets, folders and hub names), for early checks."""
    if "/" not in spec and not spec.startswith(".") and not Path(spec).is_dir():
        return get_config(spec, vocab_size=vocab_size, **(overrides or {}))
    path = resolve_pretrained(spec)  # a hub name: its snapshot in the HF cache, fetched if need be
    if not (path / "config.json").is_file():
        raise ModelError(f"--model {spec}: folder has no config.json, so it holds no model")
    safe_load.check_model_folder(path)  # pickled weights that could run code when loaded
    try:
        json.loads((path / "config.json").read_text())
        config = AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, TypeError, OSError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelError(f"--model {spec}: config.json cannot be read ({why})") from None
    check_weight_shapes(spec, path, config)
    return config


def check_weight_shapes(spec: str, path: Path, config) -> None:
    """The shapes in the folder's safetensors headers (no tensor is read) against the model its
    config.json describes, built on the meta device."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from models import from_llama_config, from_llama_state_dict, model_class

    llama = config.model_type == "llama"
    with torch.device("meta"):
        if llama or config.model_type in ("zerostack", "zerostack_moe"):
            ours = from_llama_config(config) if llama else config
            model = model_class(ours)(ours)
        else:
            model = AutoModelForCausalLM.from_config(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    found = {}
    for f in files:
        with safe_open(f, framework="pt") as sf:
            for key in sf.keys():
                found[key] = torch.empty(sf.get_slice(key).get_shape(), device="meta")
    found = from_llama_state_dict(found) if llama else found
    for name, tensor in found.items():
        if name in expected and expected[name] != tuple(tensor.shape):
            raise ModelError(
                f"--model {spec}: weight {name} has shape {list(tensor.shape)} but config.json "
                f"gives {list(expected[name])}; the weights and config.json are of different models"
            )
    if found and not set(found) & set(expected):
        raise ModelError(
            f"--model {spec}: none of its weights belong to the model its config.json describes"
        )


def check_lengths(config: RunConfig, model_cfg, manifest) -> None:
    """--seq-len against the model's positions and each split's tokens (one window needs
    seq_len + 1)."""
    positions = getattr(model_cfg, "max_position_embeddings", None)
    if isinstance(positions, int) and config.data.seq_len > positions:
        raise ConfigError(
            f"--seq-len {config.data.seq_len} is longer than --model {config.model.name}'s "
            f"{positions} positions (max_position_embeddings); use --seq-len {positions} or less"
        )
    if getattr(manifest, "chat", None) is not None:
        return  # one example per sample: data.load_data checked each fits seq_len + 1
    for name, split in getattr(manifest, "splits", {}).items():
        tokens = getattr(split, "tokens", None)
        if isinstance(tokens, int) and tokens < config.data.seq_len + 1:
            raise ConfigError(
                f"--seq-len {config.data.seq_len}: the {name} split of {config.data.path} has "
                f"{tokens} tokens, too few for one window of seq_len + 1; use --seq-len "
                f"{max(2, tokens - 1)} or less, or more data"
            )


def check_model(config: RunConfig, model_cfg, manifest, stages: int, cfg_path: str) -> None:
    """The model against the data, the attention kernel and the pipeline: pipelining cuts our
    model (a preset, our folder or a Llama folder) between its blocks."""
    kind = getattr(model_cfg, "model_type", "?")
    ours = kind in ("zerostack", "llama")
    if config.model.attention in ("explicit", "amx", "flex") and not ours:
        raise ConfigError(
            f"--attention {config.model.attention}: {config.model.name} is a {kind} model; that kernel "
            "is our model's (presets, our exports, Llama folders). Drop the flag"
        )
    if config.model.attention == "amx" and config.data.doc_mask:
        raise ConfigError(
            "--attention amx with --doc-mask: the amx kernel is causal only; drop one "
            "(--attention auto picks a kernel that takes the documents' mask)"
        )
    if config.model.attention == "amx" and (why := cpu_attention.available()) is not None:
        raise ConfigError(f"--attention amx: not on this host: {why}. Use --attention sdpa")
    if config.data.doc_mask and not ours:
        raise ConfigError(
            f"--doc-mask: {config.model.name} is a {kind} model; document masking is our model's "
            "(presets, our exports, Llama folders): transformers' SDPA models ignore document "
            "boundaries in position_ids. Drop the flag"
        )
    if config.model.z_loss and (not ours or stages > 1):
        where = f"{cfg_path}: the pipeline's stages" if ours else f"{config.model.name} ({kind})"
        raise ConfigError(f"--z-loss: {where} do not take it; it is our model's loss. Drop it")
    if config.data.doc_mask and stages > 1:
        raise ConfigError(
            f"{cfg_path}: --doc-mask does not reach the pipeline's stages (only hidden states "
            "travel between them); drop --doc-mask or use a non-pipeline config"
        )
    if getattr(model_cfg, "vocab_size", manifest.vocab_size) < manifest.vocab_size:
        raise ConfigError(
            f"--model {config.model.name}: its vocabulary has {model_cfg.vocab_size} tokens but the data in "
            f"{config.data.path} uses {manifest.vocab_size}; prepare the data with that model's tokenizer"
        )
    if stages <= 1:
        return
    if not ours:
        raise ModelError(
            f"--model {config.model.name}: pipelining needs our model (a preset, a zerostack folder or a "
            f"Llama folder); this is a {kind!r} model, which cannot be cut into stages. Use a "
            "non-pipeline config such as ds_configs/zero1.json"
        )
    if config.model.compile:  # asked for (the default leaves pipelines eager)
        raise ConfigError(
            f"{cfg_path}: --compile does not reach the pipeline's stages (it compiles the built "
            "model's blocks); drop --compile or use a non-pipeline config"
        )
    blocks = model_cfg.num_hidden_layers
    if stages > blocks:
        raise ConfigError(
            f"{cfg_path}: pipeline.stages={stages} is more than the model's {blocks} blocks; "
            f"use at most {blocks} stages"
        )
