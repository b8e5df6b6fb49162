"""build_model: a preset name, a local folder or a hub name -> a model the trainer can train.

Folders: our own `save_pretrained` output, an exported (or any compatible) `LlamaForCausalLM` folder, which is
loaded into our class through the adapter, or any other `AutoModelForCausalLM` folder (GPT-2, Qwen2, ...). A
folder with a config.json and no weights builds that architecture freshly initialised. An HF mixture of experts
(Mixtral, Qwen3-MoE) computes its router logits in training mode, so its loss carries its load-balancing loss
(models/moe.py `train_router_losses`); its config stays as the folder has it. A hub name
(`org/name[@revision]`) is the folder `models/hub.py` fetches it into (the HF cache; offline from it).

The model knows nothing of the engine that will train it. An engine that partitions parameters while the model
is built (DeepSpeed ZeRO-3) builds it inside its own construction context and hands `build_model` a
`Partitioned`: how to see a partitioned parameter whole while its value is set (training/engines/construct.py).
"""

import contextlib
import glob
import os
import pickle
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from models.config import ZeroStackConfig, ZeroStackMoeConfig
from models.errors import ModelError
from models.hf_adapter import from_llama_config, from_llama_state_dict
from models.hub import is_hub_name, resolve_pretrained
from models.llama import ZeroStackForCausalLM
from models.moe import ZeroStackMoeForCausalLM, train_router_losses
from models.presets import PRESETS, get_config

_WEIGHT_PATTERNS = ("*.safetensors", "*.bin")


class Partitioned(Protocol):
    """Parameters that live partitioned across ranks while the model is built."""

    def gathered(self, params: list[nn.Parameter]) -> AbstractContextManager:
        """Inside: `params` are whole on every rank, and what rank 0 writes into them is kept."""


def build_model(
    spec: str | os.PathLike,
    *,
    vocab_size: int | None = None,
    overrides: dict | None = None,
    partitioned: Partitioned | None = None,
    dtype: torch.dtype | None = None,
) -> PreTrainedModel:
    """Build the model named by spec: a preset (see PRESETS), a local folder or a hub name.

    vocab_size: the data tokenizer's vocabulary. It replaces a preset's; a folder's model is resized only when
        its own vocabulary is smaller (larger, padded vocabularies are kept).
    overrides: config fields to change (e.g. {"max_position_embeddings": 4096}).
    partitioned: given when the caller builds the model under an engine's partitioning context (ZeRO-3): weights
        are then initialised or loaded one module at a time, each gathered whole while it is set.
    dtype: parameter dtype; None means float32 (the engine casts for mixed precision).
    Seeds are the caller's to set. Returns a `transformers.PreTrainedModel`; bad specs raise ModelError.
    """
    spec = os.fspath(spec)
    overrides = dict(overrides or {})
    dtype = dtype or torch.float32
    if spec in PRESETS:
        config, base_seed = _preset_config(spec, vocab_size, overrides)
        model = model_class(config)._from_config(config, dtype=dtype)
        seeded_init(model, base_seed, partitioned)
    elif os.path.isdir(spec) or is_hub_name(spec):
        model = _from_folder(str(resolve_pretrained(spec)), overrides, dtype, partitioned)
        if vocab_size is not None and vocab_size > model.config.vocab_size:
            model.resize_token_embeddings(vocab_size)
    else:
        raise ModelError(
            f"unknown model {spec!r}: not a preset ({', '.join(PRESETS)}), a folder or a hub "
            "name (org/name)"
        )

    return model


def build_on_meta(
    spec: str | os.PathLike, *, vocab_size: int | None = None, overrides: dict | None = None
) -> tuple[PreTrainedModel, Callable[[nn.Module], None]] | None:
    """The model build_model would give, built on the meta device (no memory, no values), and
    the function that gives it those values once its parameters are real: whole tensors, or
    DTensor shards (each rank then keeps only its own part of each value, computed or read one
    parameter at a time); parameters left on the meta device are skipped. An engine that shards
    a model after construction (FSDP2), or keeps only some of its layers (the pipeline), builds
    it so: no rank ever holds the whole model. Bit for bit the values of build_model.

    For presets and Llama folders with safetensors weights; None for any other spec (whose
    construction runs code of transformers' that sets values as it builds)."""
    spec = os.fspath(spec)
    if spec in PRESETS:
        config, base_seed = _preset_config(spec, vocab_size, dict(overrides or {}))
        with torch.device("meta"):
            model = model_class(config)._from_config(config, dtype=torch.float32)
        stds = init_stds(model)
        return model, lambda m: seeded_init(m, base_seed, stds=stds)
    if not os.path.isdir(spec) or not glob.glob(os.path.join(spec, "*.safetensors")):
        return None
    config = _folder_config(spec, dict(overrides or {}))
    if config.model_type != "llama" or (vocab_size or 0) > config.vocab_size:
        return None  # a resized vocabulary's new rows are drawn from the old ones' statistics
    with torch.device("meta"):
        model = ZeroStackForCausalLM._from_config(from_llama_config(config), dtype=torch.float32)
    return model, lambda m: _load_llama_weights(m, spec, None)


def _preset_config(spec: str, vocab_size: int | None, overrides: dict):
    """A preset's config, and the seed its weights are drawn from (from the caller's torch seed,
    drawn before construction, which consumes the RNG differently under ZeRO-3)."""
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    base_seed = int(torch.randint(0, 2**62, (1,)).item())
    return get_config(spec, **overrides), base_seed


def _assign(param: torch.Tensor, value: torch.Tensor) -> None:
    """param <- value, a whole tensor; a parameter sharded as a DTensor takes its own shard."""
    if isinstance(param, DTensor):
        value = distribute_tensor(  # every rank holds the same value: no communication
            value.to(param.device), param.device_mesh, param.placements, src_data_rank=None
        )
    param.copy_(value)


def model_class(config: ZeroStackConfig) -> type[ZeroStackForCausalLM]:
    """Our model class for our config: the MoE model for an MoE config, else the dense one."""
    if isinstance(config, ZeroStackMoeConfig):
        return ZeroStackMoeForCausalLM
    return ZeroStackForCausalLM


def seeded_init(
    model: ZeroStackForCausalLM,
    base_seed: int,
    partitioned: Partitioned | None = None,
    stds: dict[str, float] | None = None,
) -> None:
    """Re-draw every weight from a generator of its own, seeded from the caller's torch seed and
    the module's position, so a preset starts from the same weights however it is built: whole,
    partitioned under ZeRO-3 (where construction consumes the global RNG differently) or sharded
    by FSDP2 after a build on the meta device. That is what lets ZeRO 0-3, DDP and FSDP runs
    start identically from one seed. `stds`: init_stds of the model as built (sharding replaces
    parameters, and with them what they carried)."""
    stds = stds or init_stds(model)
    seen: set[int] = set()
    for i, (prefix, module) in enumerate(model.named_modules()):
        named = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in seen]
        if not named or all(p.is_meta for _, p in named):  # left on meta: not this rank's
            continue
        seen.update(id(p) for _, p in named)
        gen = torch.Generator().manual_seed(base_seed + i)
        params = [p for _, p in named]
        gather = partitioned.gathered(params) if partitioned else contextlib.nullcontext()
        with gather, torch.no_grad():
            for name, p in named:
                if p.dim() == 1:  # norm scales
                    p.fill_(1.0)  # elementwise: a DTensor shard fills its own part
                else:  # linear and embedding matrices, stacked experts
                    w = torch.empty(p.shape, dtype=torch.float32)
                    w.normal_(0.0, stds[f"{prefix}.{name}" if prefix else name], generator=gen)
                    _assign(p, w)


def init_stds(model: nn.Module) -> dict[str, float]:
    """Each parameter's initial std, by name: residual projections carry a smaller one, on the
    module or (stacked experts) on the parameter; the config's initializer_range otherwise."""
    std = model.config.initializer_range
    return {
        f"{prefix}.{name}" if prefix else name: getattr(p, "init_std", getattr(m, "init_std", std))
        for prefix, m in model.named_modules()
        for name, p in m.named_parameters(recurse=False)
    }


def _from_folder(
    path: str, overrides: dict, dtype: torch.dtype, partitioned: Partitioned | None
) -> PreTrainedModel:
    config = _folder_config(path, overrides)
    has_weights = any(glob.glob(os.path.join(path, p)) for p in _WEIGHT_PATTERNS)

    if config.model_type == "llama":
        # Train our own (faster) model on Llama weights: same shapes, renamed parameters.
        model = ZeroStackForCausalLM._from_config(from_llama_config(config), dtype=dtype)
        if has_weights:
            _load_llama_weights(model, path, partitioned)
        return model
    try:
        if has_weights:
            model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except ValueError as e:
        raise ModelError(f"folder {path} holds no causal LM: {str(e).splitlines()[0]}") from None
    # an HF mixture of experts trains on its load-balancing loss, its config left as stock
    return train_router_losses(model)


def _folder_config(path: str, overrides: dict):
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelError(f"folder {path} holds no model: it has no config.json")
    try:
        return AutoConfig.from_pretrained(path, **overrides)
    except (ValueError, KeyError, OSError) as e:
        raise ModelError(
            f"folder {path} holds no model transformers knows: {str(e).splitlines()[0]}"
        ) from None


def _load_pickled(f: str) -> dict:
    """A pickled weights file, tensors only: weights_only refuses anything that could run code."""
    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ModelError(
            f"{f}: refusing to load it: it is not plain tensors (unpickling it could run code; "
            f"{str(e).strip().splitlines()[0]})"
        ) from None


def _load_llama_weights(model: nn.Module, path: str, partitioned: Partitioned | None) -> None:
    """Copy a Llama folder's weights into our model, one parameter at a time (gathered under ZeRO-3)."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        where = {}
        for f in files:
            with safe_open(f, framework="pt") as sf:
                where.update({key: (f, key) for key in sf.keys()})
        # The adapter only renames, so it maps our names to (file, key) as well as to tensors.
        where = from_llama_state_dict(where)

        def read(name):
            f, key = where[name]
            with safe_open(f, framework="pt") as sf:
                return sf.get_tensor(key)
    else:
        sd = {}
        for f in sorted(glob.glob(os.path.join(path, "*.bin"))):
            sd.update(_load_pickled(f))
        where = from_llama_state_dict(sd)

        def read(name):
            return where[name]

    # a parameter left on the meta device is not this rank's (a tied head, cut off from the
    # embedding it shares its weight with, among them)
    missing = [n for n, p in model.named_parameters() if n not in where and not p.is_meta]
    if missing:
        raise ModelError(
            f"folder {path} lacks weights for {len(missing)} parameters, e.g. {missing[0]}"
        )
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    for name, param in model.named_parameters():
        if param.is_meta:  # left on the meta device: not this rank's to hold
            continue
        if partitioned is not None:  # gather, fill on rank 0, re-partition from rank 0
            with partitioned.gathered([param]), torch.no_grad():
                if rank == 0:
                    param.copy_(read(name))
        else:
            with torch.no_grad():
                _assign(param, read(name))
