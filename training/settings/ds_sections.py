"""What zerostack does with each section of a DeepSpeed JSON: applied (by DeepSpeed, or by
zerostack itself on every engine), or refused in one line naming the key. Nothing is accepted
and then ignored.

The sections DeepSpeed models with pydantic (zero_optimization with its offload sections, fp16,
bf16) are run through DeepSpeed's own classes before any rank starts, so a value DeepSpeed would
refuse is refused here, once, as bad input; a value those classes would coerce (`"yes"` for
true, `"2"` for 2) is refused too, since the file then does not say what it means.
"""

from __future__ import annotations

import difflib
import json
from typing import Any

from training.errors import ConfigError

# Applied by zerostack on every backend (the batch triplet, clipping, precision, the optimizer's
# numbers and the schedule: settings/ds_config.py and settings/hparams.py).
APPLIED_BY_ZEROSTACK = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "fp16",
    "bf16",
    "bfloat16",
    "optimizer",
    "scheduler",
    "activation_checkpointing",
}
# Handed to deepspeed.initialize, which applies them (--backend deepspeed only).
APPLIED_BY_DEEPSPEED = {
    "zero_optimization",
    "pipeline",
    "data_types",
    "checkpoint",
    "aio",
    "steps_per_print",
    "dump_state",
    "wall_clock_breakdown",
    "memory_breakdown",
    "flops_profiler",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comet",
    "comms_logger",
    "timers",
    "prescale_gradients",
    "gradient_predivide_factor",
    "sparse_gradients",
    "communication_data_type",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "graph_harvesting",
    "tensor_parallel",  # AutoTP; the layout's rules: settings/parallel.py
    "sequence_parallel_size",  # Ulysses; the groups and the model's hook: engines/sequence.py
    "expert_parallel",  # AutoEP; the layout's rules: settings/parallel.py
    "seq_parallel_communication_data_type",
}
# The top-level keys whose value is a section (a JSON object), never a number or a list.
OBJECT_KEYS = {
    "zero_optimization", "pipeline", "fp16", "bf16", "bfloat16", "optimizer", "scheduler",
    "activation_checkpointing", "data_types", "checkpoint", "aio", "flops_profiler",
    "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "timers", "tensor_parallel",
}  # fmt: skip
# Known to DeepSpeed, but they need something zerostack does not do; each says why.
REFUSED = {
    "amp": "Apex AMP is not used; precision comes from the bf16 or fp16 section",
    "torch_autocast": "precision comes from the bf16 or fp16 section (one place says what a "
    "run computes in)",
    "compile": "DeepSpeed's compile needs engine.compile(); use --compile",
    "dataloader_drop_last": "it sets DeepSpeed's own data loader, which zerostack does not use "
    "(its reader always drops the last partial batch)",
    "curriculum_learning": "it needs DeepSpeed's data loader and a model that takes the "
    "curriculum sequence length",
    "data_efficiency": "it needs DeepSpeed's data loader and sampler",
    "progressive_layer_drop": "it needs a model that takes progressive-layer-drop arguments",
    "compression_training": "it needs deepspeed.compression.init_compression on the model",
    "eigenvalue": "it serves progressive layer drop and MoQ, neither of which is used",
    "quantize_training": "MoQ needs fp16 and DeepSpeed's quantizer hooks in the model",
    "sparse_attention": "it needs a model built with DeepSpeed's sparse attention",
    "elasticity": "the batch triplet comes from the flags and this file, not from elastic "
    "training's schedule",
    "autotuning": "it is read by `deepspeed --autotuning`, not by a training run",
    "hybrid_engine": "it is DeepSpeed-Chat's RLHF engine",
    "weight_quantization": "it is for inference",
    "nebula": "it is Azure's checkpoint service; checkpoints are zerostack's own",
    "use_data_before_expert_parallel_": "expert groups are laid out by expert_parallel (AutoEP)",
    "mics_shard_size": "MiCS needs its own model construction (deepspeed.zero.MiCS_Init)",
    "mics_hierarchical_params_gather": "MiCS needs its own model construction",
    "zero_quantized_weights": "ZeRO++ settings live inside zero_optimization",
    "zero_quantized_gradients": "ZeRO++ settings live inside zero_optimization",
    "disable_allgather": "DeepSpeed no longer reads it",
}
# DeepSpeed's activation_checkpointing sub-keys and what each needs to apply here.
ACTIVATION_SUBKEYS = {
    "partition_activations": "it splits DeepSpeed's own checkpoint function's saved inputs "
    "across tensor-parallel ranks; the model checkpoints its blocks with torch's",
    "cpu_checkpointing": "checkpoints are kept where the model runs; on a CPU they are in host "
    "memory already (true is accepted there)",
    "contiguous_memory_optimization": "it needs partition_activations",
    "number_checkpoints": "it sizes contiguous_memory_optimization's buffers",
    "synchronize_checkpoint_boundary": "it is a CUDA timing aid for DeepSpeed's own "
    "checkpoint function, which the model does not call",
    "profile": "it profiles DeepSpeed's own checkpoint function, which the model does not call",
}


def check_applied(cfg: dict, *, backend: str, steps: int, device_type: str, source: str) -> bool:
    """Refuse every key this run would not apply; returns whether the config asks for
    activation checkpointing (an activation_checkpointing section turns it on)."""
    for key in sorted(cfg):
        if key in REFUSED:
            raise ConfigError(f"{source}: {key} is not applied: {REFUSED[key]}")
        if backend != "deepspeed" and key in APPLIED_BY_DEEPSPEED and not _off(key, cfg, steps):
            raise ConfigError(
                f"{source}: {key} is DeepSpeed's and --backend {backend} does not apply it; "
                "drop it or use --backend deepspeed"
            )
    if cfg.get("checkpoint", {}).get("load_universal") is not None:
        raise ConfigError(
            f"{source}: checkpoint.load_universal is decided by --universal (auto: when the "
            "topology changed); drop the key"
        )
    _check_writer(cfg.get("checkpoint", {}), source)
    return _activation_checkpointing(cfg, device_type, source)


def _check_writer(section, source: str) -> None:
    """DeepSpeed's checkpoint.writer (FastPersist, "fast", and its "decoupled" mode) replaces the
    engine that writes checkpoint files. Decoupled, save_checkpoint returns before the files
    are written and commits them at a later step, while zerostack seals (complete.json, then
    `latest`) a folder as soon as the save returns: it would seal files still being written.
    The fast writer changes which ranks write which files and was not verified under that
    rule either. --async-save writes in the background and seals only what is on disk."""
    if not isinstance(section, dict) or section.get("writer") is None:
        return
    writer = section["writer"]
    kind = "decoupled" if isinstance(writer, dict) and writer.get("decoupled") else "fast"
    raise ConfigError(
        f"{source}: checkpoint.writer ({kind} writer) is not applied: zerostack seals a "
        "checkpoint only once every file is on disk, which DeepSpeed's "
        f"{kind} writer does not tell it; drop the key (--async-save writes checkpoints in the "
        "background and seals them when they are durable)"
    )


def _off(key: str, cfg: dict, steps: int) -> bool:
    """A DeepSpeed-only key whose value asks for nothing (so ignoring it changes nothing)."""
    v = cfg[key]
    if key == "steps_per_print":  # DeepSpeed would print nothing within the run either
        return isinstance(v, int) and v >= steps
    if key == "zero_optimization":
        return v.get("stage", 0) == 0 and set(v) <= {"stage"}
    if key == "pipeline":
        return v.get("stages", 1) == 1
    if key == "tensor_parallel":
        return isinstance(v, dict) and v.get("autotp_size", 0) in (0, 1)
    if key == "sequence_parallel_size":
        return v == 1
    if key == "expert_parallel":
        return not (isinstance(v, dict) and v.get("enabled")) or v.get("autoep_size", 1) == 1
    if isinstance(v, dict):
        return v.get("enabled") is False or not v
    return v in (False, None)


def _activation_checkpointing(cfg: dict, device_type: str, source: str) -> bool:
    section = cfg.get("activation_checkpointing")
    if section is None:
        return False
    if not isinstance(section, dict):
        raise ConfigError(f"{source}: activation_checkpointing must be an object")
    for key, value in section.items():
        if key not in ACTIVATION_SUBKEYS:
            raise ConfigError(
                f"{source}: activation_checkpointing.{key} is not a key DeepSpeed "
                f"reads{near(key, ACTIVATION_SUBKEYS)}"
            )
        harmless = value in (False, None) or (
            key == "cpu_checkpointing" and value is True and device_type == "cpu"
        )
        if not harmless:
            raise ConfigError(
                f"{source}: activation_checkpointing.{key}={json.dumps(value)} is "
                f"not applied: {ACTIVATION_SUBKEYS[key]}"
            )
    return True


def check_stage(cfg: dict, source: str) -> None:
    """zero_optimization.stage is a whole number 0-3 (not "2", not 2.5): checked before anything
    reads it."""
    zero = cfg.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(f"{source}: zero_optimization must be an object")
    stage = zero.get("stage", 0)
    if not is_whole(stage) or stage > 3:
        raise ConfigError(
            f"{source}: zero_optimization.stage must be 0, 1, 2 or 3 (a number), got {stage!r}"
        )


def validate_with_deepspeed(cfg: dict, source: str) -> None:
    """DeepSpeed's own pydantic models on the sections it models ("auto" values, resolved
    later, left out); one line for the first problem."""
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    for key, model in (
        ("zero_optimization", DeepSpeedZeroConfig),
        ("fp16", DeepSpeedFP16Config),
        ("bf16", DeepSpeedBF16Config),
        ("bfloat16", DeepSpeedBF16Config),
    ):
        if key not in cfg:
            continue
        if not isinstance(cfg[key], dict):
            raise ConfigError(f"{source}: {key} must be an object")
        given = _without_autos(cfg[key])
        try:
            parsed = model(**given)
        except Exception as e:  # pydantic's ValidationError, or a DeepSpeed validator's own
            raise ConfigError(f"{source}: {_first_error(e, key, model)}") from None
        _refuse_coercion(given, parsed, key, source)


def _without_autos(section: dict) -> dict:
    """`section` without its "auto" values (nested sections kept, their autos dropped)."""
    out = {}
    for k, v in section.items():
        if isinstance(v, dict):
            out[k] = _without_autos(v)
        elif not _has_auto(v):
            out[k] = v
    return out


def _has_auto(v) -> bool:
    if isinstance(v, dict):
        return any(_has_auto(x) for x in v.values())
    return v == "auto" or (isinstance(v, list) and "auto" in v)


def _first_error(e: Exception, key: str, model) -> str:
    errors = getattr(e, "errors", None)
    if not callable(errors):
        return f"{key}: {e}".splitlines()[0]
    err = errors()[0]
    where = ".".join(str(x) for x in (key, *err["loc"]))
    if err["type"] == "extra_forbidden":
        names = _field_names(model, err["loc"])
        return f"{where} is not a key DeepSpeed reads{near(str(err['loc'][-1]), names)}"
    return f"{where}: {err['msg']} (got {err.get('input')!r})"


def _field_names(model, loc) -> list[str]:
    """Field names and aliases of the (nested) model that `loc` points into."""
    for part in loc[:-1]:
        info = model.model_fields.get(part)
        model = getattr(info, "annotation", None)
        if not hasattr(model, "model_fields"):
            return []
    names = []
    for name, info in model.model_fields.items():
        names += [name] + ([info.alias] if info.alias else [])
    return names


def _refuse_coercion(raw: Any, parsed: Any, where: str, source: str) -> None:
    """A value of another JSON type than the field's (a string for a bool or a number, a bool for
    a number) that DeepSpeed's model converted silently."""
    if isinstance(raw, dict) and hasattr(type(parsed), "model_fields"):
        aliases = {info.alias: name for name, info in type(parsed).model_fields.items()}
        for k, v in raw.items():
            name = aliases.get(k, k)
            if name in type(parsed).model_fields:
                _refuse_coercion(v, getattr(parsed, name), f"{where}.{k}", source)
        return
    value = getattr(parsed, "value", parsed)  # an enum member's value
    if isinstance(value, bool):
        ok = isinstance(raw, bool)
    elif isinstance(value, (int, float)):
        ok = isinstance(raw, (int, float)) and not isinstance(raw, bool)
    elif isinstance(value, str):
        ok = isinstance(raw, str)
    else:
        ok = True
    if not ok:
        kind = "true or false" if isinstance(value, bool) else f"a {type(value).__name__}"
        raise ConfigError(f"{source}: {where} must be {kind}, got {json.dumps(raw)}")


def near(word: str, choices) -> str:
    """' (did you mean X?)' for the closest of `choices`, or ''."""
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def is_whole(value, low: int = 0) -> bool:
    """An int (JSON's true/false are not) of at least `low`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low
