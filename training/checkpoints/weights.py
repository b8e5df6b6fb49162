"""The weights of a checkpoint or of a Hugging Face folder, one tensor at a time.

`iter_weights` reads any zerostack checkpoint (DeepSpeed ZeRO 0-3 and pipeline through
zero_files.py, DDP and FSDP2 through their engines) as fp32 tensors under our model's
parameter names; `load_model` fills a model with them; `folder_weights` is the import direction,
an HF folder's weights under the names `models.build_model(folder)` gives them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from models import (
    ZeroStackForCausalLM,
    build_model,
    from_llama_state_dict,
    model_class,
    pipeline_state_dict_to_model,
)
from models.lora import apply_lora, is_adapter, stored_lora
from training.checkpoints.zero_files import ZeroFiles, load_mapped
from training.engines import load_full_state_dict
from training.engines.optim import param_groups
from training.errors import WeightsError
from training.runtime import safe_load


def iter_weights(
    root: Path, tag: str, state: dict, config=None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, fp32 tensor) for every weight of checkpoint root/tag, under the model's own
    parameter names, one at a time. Tied weights may come under both names."""
    folder = root / tag
    backend = state.get("backend", "deepspeed")
    if backend != "deepspeed":
        yield from ((k, v.float()) for k, v in load_full_state_dict(backend, folder).items())
        return
    if any(folder.glob("*_optim_states.pt")):  # ZeRO 1-3 (and pipeline): fp32 master weights
        rename = _pipeline_renamer(state, config)
        for name, states, _ in ZeroFiles(folder).params(("fp32",)):
            yield from rename(name, states["fp32"])
        return
    if state.get("tensor_parallel", 1) > 1:  # ZeRO-0: each rank's module holds its slices
        raise WeightsError(
            f"{folder}: a ZeRO-0 tensor-parallel checkpoint without optimizer files, whose "
            "per-rank slices are not joined here; tensor-parallel runs with ZeRO-1 or 2 "
            "(ds_configs/tp2.json) export"
        )
    if state.get("pipeline_stages", 1) > 1:  # no ZeRO files (fp32): the layer files hold them
        yield from _pipeline_layer_weights(folder, config)
        return
    yield from _zero0_weights(folder, config, state.get("lora"))


def _pipeline_layer_weights(folder: Path, config) -> Iterator[tuple[str, torch.Tensor]]:
    """A pipeline checkpoint's `layer_XX-model_states.pt` files (the tied head is saved once,
    as the embedding's layer), under the model's names."""
    for f in sorted(folder.glob("layer_*-model_states.pt")):
        idx = int(f.name[len("layer_") :].split("-")[0])
        layer = {f"{idx}.{k}": v.float() for k, v in load_mapped(f).items()}
        yield from pipeline_state_dict_to_model(layer, config).items()


def _pipeline_renamer(state: dict, config):
    """Pipeline checkpoints name weights `<layer>.<name>` and `tied_modules.embed.weight`;
    everything else already uses the model's names."""

    def rename(name, t):
        if name.startswith("tied_modules.") or name.split(".", 1)[0].isdigit():
            return pipeline_state_dict_to_model({name: t}, config).items()
        return [(name, t)]

    return rename


def _zero0_weights(
    folder: Path, config, lora: dict | str | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """ZeRO-0 keeps the fp32 masters in the model-states file, grouped as our optimizer groups
    them; the module's own (16-bit) weights are the fallback."""
    states = load_mapped(folder / "mp_rank_00_model_states.pt")
    masters = (states.get("optimizer") or {}).get("fp32_groups")
    if masters is not None and config is not None:
        names = _group_names(config, lora)
        shapes_match = [len(g) for g in names] == [len(g) for g in masters] and all(
            tuple(p.shape) == shape for g, gn in zip(masters, names) for p, (_, shape) in zip(g, gn)
        )
        if shapes_match:
            for group, group_names in zip(masters, names):
                for t, (name, _) in zip(group, group_names):
                    yield name, t.float()
            return
    for name, t in states["module"].items():
        yield name, t.float()


def _group_names(config, lora: dict | str | None = None) -> list[list[tuple[str, tuple]]]:
    """Parameter names in the order the trainer's optimizer groups hold them (a LoRA run's: the
    adapters only; DeepSpeed keeps no empty group)."""
    model = _meta_model(config)
    if lora:
        with torch.device("meta"):
            model = apply_lora(model, stored_lora(lora), seed=0)
    names = {id(p): (n, tuple(p.shape)) for n, p in model.named_parameters()}
    groups = param_groups(model, 0.0)
    return [[names[id(p)] for p in g["params"]] for g in groups if g["params"]]


def _meta_model(config):
    with torch.device("meta"):
        if isinstance(config, ZeroStackForCausalLM.config_class):
            return model_class(config)(config)
        return AutoModelForCausalLM.from_config(config)


def load_model(root: Path, tag: str, state: dict, dtype: torch.dtype = torch.float32):
    """Our model (or the checkpoint's HF class) holding checkpoint root/tag's weights, rounded
    to `dtype` and held in fp32. Fills a meta-device model tensor by tensor: one fp32 copy."""
    config = config_from_dict(state["model_config"])
    model = _meta_model(config)
    for name, t in iter_weights(root, tag, state, config):
        if dtype != torch.float32:
            t = t.to(dtype).float()
        try:
            model.load_state_dict({name: t}, strict=False, assign=True)
        except RuntimeError as e:
            raise WeightsError(
                f"{root / tag}: weight {name} does not fit the model ({e})"
            ) from None
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise WeightsError(
            f"{root / tag}: holds no weights for {len(missing)} parameters, e.g. {missing[0]}"
        )
    for name, buf in list(model.named_buffers()):
        if buf.is_meta:  # non-persistent buffers (rotary tables) are rebuilt, not stored
            raise WeightsError(f"{root / tag}: buffer {name} has no value")
    return model.eval()


def load_lora_model(root: Path, tag: str, state: dict, dtype: torch.dtype = torch.float32):
    """A LoRA run's checkpoint as peft holds it: the run's base model (`base_model`, the folder
    it started from) wrapped with the checkpoint's adapters, rounded to `dtype` and held in fp32.
    The base weights come from that folder, frozen as they were in training."""
    base_folder = state.get("base_model")
    if not base_folder or not Path(base_folder).is_dir():
        raise WeightsError(
            f"{root / tag}: a LoRA checkpoint whose base model {base_folder} is not a folder here; "
            "the adapters need it"
        )
    config = config_from_dict(state["model_config"])
    base = build_model(base_folder, vocab_size=config.vocab_size)
    model = apply_lora(base, stored_lora(state["lora"]), seed=0)
    params = dict(model.named_parameters())
    found = set()
    with torch.no_grad():
        for name, t in iter_weights(root, tag, state, config):
            if is_adapter(name):
                if name not in params or params[name].shape != t.shape:
                    raise WeightsError(
                        f"{root / tag}: adapter weight {name} does not fit the model"
                    )
                params[name].copy_(t.to(dtype).float())
                found.add(name)
    missing = [n for n in params if is_adapter(n) and n not in found]
    if missing:
        raise WeightsError(
            f"{root / tag}: holds no weights for {len(missing)} adapters, e.g. {missing[0]}"
        )
    return model.eval()


def folder_weights(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The import direction: (name, tensor) for the weights of an HF folder, under the names of
    the model `models.build_model(folder)` builds (ours for Llama folders), one at a time."""
    folder = Path(folder)
    llama = AutoConfig.from_pretrained(folder).model_type == "llama"
    files = sorted(folder.glob("*.safetensors"))
    if not files:  # pickled weights: small legacy folders, read whole
        sd = {}
        for f in sorted(folder.glob("*.bin")):
            sd.update(safe_load.load(f))  # weights-only: tensors, nothing that runs
        yield from (from_llama_state_dict(sd) if llama else sd).items()
        return
    for f in files:
        with safe_open(f, framework="pt") as sf:
            for key in sf.keys():
                if key.endswith("rotary_emb.inv_freq"):
                    continue
                t = sf.get_tensor(key)
                yield from (from_llama_state_dict({key: t}) if llama else {key: t}).items()


def load_state_dict(root: Path, tag: str, state: dict) -> dict[str, torch.Tensor]:
    """The full fp32 weights of checkpoint `tag`, under the model's own parameter names."""
    config = config_from_dict(state["model_config"])
    return dict(iter_weights(root, tag, state, config))


def config_from_dict(d: dict):
    """A model config saved as a dict (ours or any HF model type) -> its config object."""
    d = dict(d)  # importing models registered the "zerostack" model type with AutoConfig
    return AutoConfig.for_model(d.pop("model_type"), **d)
