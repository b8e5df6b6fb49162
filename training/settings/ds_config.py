"""One rule for a run's settings.

Values come from the DeepSpeed JSON file first; then the settings that name a key override it
(`overridden_keys` says which; the optimizer's numbers and the schedule follow the same rule in
hparams.py); then every "auto" is resolved; then the batch triplet
`train_batch_size = micro_batch x grad_accum x data_parallel_world` is derived and checked here
and nowhere else (the data-parallel world: settings/parallel.py). Every key is applied or refused (ds_sections.py), and the sections DeepSpeed
models are run through its own classes before any rank starts. Every failure is a
`ConfigError` with one line naming the file and key.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from training.errors import ConfigError
from training.settings import ds_sections, hparams, parallel
from training.settings.run_config import EngineConfig, OptimConfig

CONFIG_DIR = Path(__file__).resolve().parents[2] / "ds_configs"  # the shipped configs

# Top-level keys DeepSpeed understands (0.19). A typo here would be silently ignored by
# DeepSpeed, so anything else is refused. Keys starting with "_" are comments and are dropped.
KNOWN_KEYS = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "steps_per_print",
    "dump_state",
    "optimizer",
    "scheduler",
    "fp16",
    "bf16",
    "bfloat16",
    "amp",
    "torch_autocast",
    "gradient_clipping",
    "prescale_gradients",
    "gradient_predivide_factor",
    "sparse_gradients",
    "zero_optimization",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "activation_checkpointing",
    "flops_profiler",
    "wall_clock_breakdown",
    "memory_breakdown",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comet",
    "comms_logger",
    "aio",
    "pipeline",
    "checkpoint",
    "data_types",
    "data_efficiency",
    "curriculum_learning",
    "compression_training",
    "elasticity",
    "autotuning",
    "communication_data_type",
    "seq_parallel_communication_data_type",
    "disable_allgather",
    "sparse_attention",
    "compile",
    "nebula",
    "timers",
    "weight_quantization",
    "hybrid_engine",
    "eigenvalue",
    "progressive_layer_drop",
    "quantize_training",
    "mics_shard_size",
    "mics_hierarchical_params_gather",
    "graph_harvesting",
    "dataloader_drop_last",
    "use_data_before_expert_parallel_",
    "zero_quantized_weights",
    "zero_quantized_gradients",
    "tensor_parallel",
    "sequence_parallel_size",
    "expert_parallel",
}

DEFAULT_MICRO_BATCH = 4
DEFAULT_GRAD_CLIP = 1.0  # gradient_clipping "auto"
DEFAULT_NVME_BUFFER = 10**8  # offload_param.buffer_size "auto" without a model (DeepSpeed's)

# What the device decides where a config says "auto": on for GPUs (DeepSpeed's and the HF
# Trainer's recommended GPU settings: the gradient reduction overlapped with backward, page-locked
# host buffers for offload), off on a CPU, where there is no copy engine to overlap with or
# pin for (the values measured and shipped for CPUs).
DEVICE_AUTOS = (
    "zero_optimization.overlap_comm",
    "zero_optimization.offload_optimizer.pin_memory",
    "zero_optimization.offload_param.pin_memory",
)

# Every "auto" the trainer knows how to fill (resolve below; the scheduler's in hparams.py).
AUTO_KEYS = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "optimizer.params.lr",
    "optimizer.params.betas",
    "optimizer.params.eps",
    "optimizer.params.weight_decay",
    "scheduler.params.total_num_steps",
    "scheduler.params.warmup_num_steps",
    "scheduler.params.warmup_max_lr",
    "scheduler.params.warmup_min_lr",
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
    "zero_optimization.allgather_bucket_size",
    "bf16.enabled",
    "fp16.enabled",
    "zero_optimization.offload_optimizer.nvme_path",
    "zero_optimization.offload_param.nvme_path",
    "zero_optimization.offload_param.buffer_size",
    *DEVICE_AUTOS,
}


def load_json(path: str | Path) -> dict:
    """Read a JSON config; one line on a missing file or bad JSON."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{p}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"
        ) from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{p}: the top level must be a JSON object")
    return cfg


def check_keys(cfg: dict, source: str) -> dict:
    """Drop comment keys and refuse unknown top-level keys (with a suggestion), and a section
    that is not an object."""
    out = {}
    for k, v in cfg.items():
        if k.startswith("_"):
            continue
        if k not in KNOWN_KEYS:
            hint = ds_sections.near(k, sorted(KNOWN_KEYS))
            raise ConfigError(f"{source}: unknown top-level key {k!r}{hint}")
        if k in ds_sections.OBJECT_KEYS and not isinstance(v, dict):
            raise ConfigError(
                f"{source}: {k} must be an object ({{...}}), got {json.dumps(v)[:40]}"
            )
        out[k] = v
    return out


def zero_stage(cfg: dict) -> int:
    return int(cfg.get("zero_optimization", {}).get("stage", 0))


def pipeline_stages(cfg: dict) -> int:
    return int(cfg.get("pipeline", {}).get("stages", 1))


def precision(cfg: dict, source: str = "config") -> str:
    """'bf16', 'fp16' or 'fp32', as the config asks."""
    fp16 = bool(cfg.get("fp16", {}).get("enabled", False))
    bf16 = bool(cfg.get("bf16", cfg.get("bfloat16", {})).get("enabled", False))
    if fp16 and bf16:
        raise ConfigError(f"{source}: fp16.enabled and bf16.enabled are both true: pick one")
    return "fp16" if fp16 else "bf16" if bf16 else "fp32"


def resolve(
    cfg: dict,
    *,
    world: int,
    hidden_size: int,
    optim: OptimConfig = OptimConfig(),
    engine: EngineConfig = EngineConfig(),
    activation_checkpointing: bool = False,
    swap: tuple[str, int] | None = None,
    source: str = "config",
    device_type: str = "cuda",
    params: int | None = None,
    hold_weights: bool = False,
) -> dict:
    """Apply the settings that override keys, resolve every "auto", derive and check the batch
    triplet.

    `optim` and `engine` are the run's sections (a None setting is "not given");
    `activation_checkpointing` the model section's switch; `swap` ZeRO-Infinity's swap folder
    and parameter buffer size (nvme.py: auto_values). `device_type` is the accelerator's
    ("cpu", "cuda", ...): some defaults depend on it. `params` is the model's parameter count,
    where known, and `hold_weights` whether ZeRO-3 keeps them all gathered (its "auto"
    persistence threshold then covers the model).
    Returns a new dict ready for `deepspeed.initialize` (no "auto" left anywhere)."""
    cfg = precheck(cfg, optim=optim, engine=engine, source=source, device_type=device_type)
    optimizer = hparams.resolve_optimizer(cfg, optim, engine.backend, source)

    _resolve_pipeline(cfg, engine, activation_checkpointing, source)
    precision(cfg, source)  # refuses fp16 + bf16 together
    _check_combinations(cfg, source)
    _derive_batch(cfg, parallel.layout(cfg, world, source).data, source)

    # Settings the trainer owns, written into DeepSpeed's sections where they are "auto".
    swap_path, swap_buffer = swap or ("nvme_swap", DEFAULT_NVME_BUFFER)
    autos = {
        # Muon: no clipping by default on every engine (see check_muon)
        "gradient_clipping": 0.0 if optim.optimizer == "muon" else DEFAULT_GRAD_CLIP,
        "optimizer.params.lr": optimizer["lr"],
        "optimizer.params.betas": optimizer["betas"],
        "optimizer.params.eps": optimizer["eps"],
        "optimizer.params.weight_decay": optimizer["weight_decay"],
        "zero_optimization.reduce_bucket_size": reduce_bucket_size(cfg, hidden_size, device_type),
        "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "zero_optimization.stage3_param_persistence_threshold": persistence_threshold(
            hidden_size, params, hold_weights and zero_stage(cfg) == 3
        ),
        "zero_optimization.allgather_bucket_size": max(hidden_size * hidden_size, 50_000_000),
        **dict.fromkeys(DEVICE_AUTOS, device_type != "cpu"),
        "bf16.enabled": True,
        "fp16.enabled": False,
        # ZeRO-Infinity: the swap folder (--nvme-path, default RUN/nvme_swap) and a parameter
        # swap buffer that holds the largest parameter (nvme.py)
        "zero_optimization.offload_optimizer.nvme_path": swap_path,
        "zero_optimization.offload_param.nvme_path": swap_path,
        "zero_optimization.offload_param.buffer_size": swap_buffer,
    }
    for path, _value in auto_paths(cfg):
        if path not in autos or autos[path] is None or autos[path] == [None, None]:
            raise ConfigError(f'{source}: cannot resolve "auto" for {path}; give a value')
        _set(cfg, path, autos[path])
    hparams.resolve_schedule(cfg, optim, optimizer["lr"], source)
    if optim.optimizer == "muon" and engine.backend == "deepspeed":
        cfg["optimizer"] = hparams.muon_section(cfg, optimizer, optim)
        if zero_stage(cfg) == 3:  # DeepSpeed's ZeRO-3 refuses Muon with reduce-scatter
            cfg["zero_optimization"]["reduce_scatter"] = False
        if zero_stage(cfg) == 0 and precision(cfg) == "bf16":
            raise ConfigError(
                f"{source}: --optimizer muon with ZeRO-0 in bf16: DeepSpeed's ZeRO-0 sums bf16 "
                "gradients in bf16 and its bf16 Muon needs fp32 sums; use ZeRO-1, 2 or 3, "
                "--precision fp32, or --backend ddp"
            )
    return cfg


def check_muon(cfg: dict, optim: OptimConfig, source: str, backend: str = "deepspeed") -> None:
    """--optimizer muon against what the config asks for: refuses what DeepSpeed's Muon does not
    run (its bf16 Muon takes no model-parallel groups and no MoE layers; ZeRO-3's takes no
    reduce-scatter), what zerostack has not verified with it (offload), and gradient clipping
    under ZeRO 1-3, where DeepSpeed clips Muon's orthogonalized update instead of the gradient
    (its norm is about 20x the gradient's on the tiny preset, so every step would shrink by
    that): the same clip would mean another step than on ZeRO-0, DDP and FSDP2."""
    if optim.optimizer != "muon":
        return
    clip = cfg.get("gradient_clipping", "auto")
    if backend == "deepspeed" and zero_stage(cfg) > 0 and clip != "auto" and float(clip) > 0:
        raise ConfigError(
            f"{source}: --optimizer muon with gradient clipping ({clip}) under ZeRO-"
            f"{zero_stage(cfg)}: DeepSpeed clips Muon's orthogonalized update there, not the "
            "gradient; use --grad-clip 0 (Muon's default), or ZeRO-0, --backend ddp or fsdp"
        )
    zero = cfg.get("zero_optimization", {})
    offload = [k for k in ("offload_optimizer", "offload_param") if _offloads(zero.get(k))]
    why = None
    if offload:
        why = (
            f"zero_optimization.{offload[0]}: Muon is run on the device only (its offload "
            "path is not verified here); drop the offload or use --optimizer adamw"
        )
    elif pipeline_stages(cfg) > 1:
        why = "pipeline parallelism: DeepSpeed's Muon takes no model-parallel groups"
    elif parallel.tensor_size(cfg) > 1:
        why = "tensor parallelism: Muon would orthogonalize each rank's slice of a matrix"
    elif parallel.sequence_size(cfg) > 1:
        why = "sequence parallelism: DeepSpeed's Muon takes no model-parallel groups"
    elif parallel.expert_size(cfg) > 1:
        why = "expert parallelism: DeepSpeed's Muon takes no MoE layers"
    elif zero_stage(cfg) == 3 and zero.get("reduce_scatter") is True:
        why = "zero_optimization.reduce_scatter true: DeepSpeed's ZeRO-3 Muon refuses it"
    if why:
        raise ConfigError(f"{source}: --optimizer muon with {why}")


def _offloads(section) -> bool:
    return isinstance(section, dict) and section.get("device", "none") not in ("none", None)


def resolve_held(raw: dict, holds: Callable[[dict], bool], **kw) -> dict:
    """The one resolution the trainer and the memory plan share: `resolve(raw, **kw)`, and, when
    `holds` (asked of every resolved config) says ZeRO-3 keeps the weights gathered, once more
    with its "auto" persistence threshold covering the model."""
    cfg = resolve(raw, **kw)
    if holds(cfg) and zero_stage(cfg) == 3:
        return resolve(raw, hold_weights=True, **kw)
    return cfg


def hyperparameters(
    cfg: dict, optim: OptimConfig, backend: str, source: str = "config"
) -> tuple[dict, dict]:
    """From a resolved config: the optimizer's {lr, betas, eps, weight_decay} and the schedule's
    fields (training/loop/schedule.py `Schedule`), by the same rule `resolve` applied."""
    cfg = copy.deepcopy(cfg)
    optimizer = hparams.resolve_optimizer(cfg, optim, backend, source)
    schedule = hparams.resolve_schedule(cfg, optim, optimizer["lr"], source)
    return optimizer, schedule


def activation_checkpointing(cfg: dict, flag: bool) -> bool:
    """--activation-checkpointing, or an activation_checkpointing section in the config."""
    return flag or "activation_checkpointing" in cfg


def precheck(
    cfg: dict, *, optim: OptimConfig, engine: EngineConfig, source: str, device_type: str
) -> dict:
    """What can be checked of a config before the model and data are known: its keys, the
    settings that override them, DeepSpeed's own models, and that every key is applied. Returns
    a copy with the settings applied."""
    cfg = check_keys(copy.deepcopy(cfg), source)
    for key, value in overridden_keys(optim).items():
        if value is not None:
            cfg[key] = value
    backend = engine.backend
    ds_sections.check_stage(cfg, source)
    ds_sections.validate_with_deepspeed(cfg, source)
    ds_sections.check_applied(
        cfg, backend=backend, steps=optim.steps, device_type=device_type, source=source
    )
    for path, _value in auto_paths(cfg):
        if path not in AUTO_KEYS:
            raise ConfigError(f'{source}: cannot resolve "auto" for {path}; give a value')
    hparams.resolve_optimizer(copy.deepcopy(cfg), optim, backend, source)
    hparams.resolve_schedule(copy.deepcopy(cfg), optim, 1e-3, source)
    check_muon(cfg, optim, source, backend)
    return cfg


def overridden_keys(optim: OptimConfig) -> dict:
    """{DeepSpeed key: the optim section's value for it} (None: not given, the file's stands)."""
    return {
        "train_micro_batch_size_per_gpu": optim.micro_batch,
        "gradient_accumulation_steps": optim.grad_accum,
        "train_batch_size": optim.global_batch,
        "gradient_clipping": optim.grad_clip,
    }


# glibc serves a block of 32 MiB or more (its largest mmap threshold) with a fresh mmap, which
# is page-faulted in as it is written and unmapped when freed. Below that the heap recycles it.
CPU_BUCKET_BYTES = 30 * 2**20


def reduce_bucket_size(cfg: dict, hidden_size: int, device_type: str = "cuda") -> int:
    """The "auto" reduce bucket, in elements: DeepSpeed's usual 50M (or one hidden x hidden
    matrix, if larger); on CPU, ZeRO-1/2 keep it under CPU_BUCKET_BYTES.

    ZeRO-1/2 allocate their reduce bucket anew for every backward. A GPU's caching allocator
    hands the same block back; on CPU a bucket above the threshold is a fresh mmap every
    micro-batch, page-faulted in as the gradients are written. Under it, the heap hands it back
    warm (measured in docs/benchmarks.md, "the reduce bucket")."""
    n = max(hidden_size * hidden_size, 50_000_000)
    if device_type == "cpu" and zero_stage(cfg) in (1, 2):
        accum = str(cfg.get("data_types", {}).get("grad_accum_dtype", "")).lower()
        itemsize = 4 if precision(cfg) == "fp32" or accum in ("fp32", "float32") else 2
        n = min(n, CPU_BUCKET_BYTES // itemsize)
    return n


def persistence_threshold(hidden_size: int, params: int | None, hold_weights: bool) -> int:
    """ZeRO-3's "auto" stage3_param_persistence_threshold, in elements: parameters this size or
    smaller are never partitioned. Usually 10 x hidden (norms and biases stay whole).

    With `hold_weights` (the trainer's --hold-weights, resolved in training/preflight/
    switches.py), the whole model: every weight stays gathered across the micro-steps of a
    step and is gathered once after the optimizer step, as ZeRO-2 does (the 16-bit weights),
    instead of once per block and micro-step. Optimizer states and gradients stay partitioned;
    the plan counts the whole 16-bit weights (training/memory/plan.py)."""
    usual = 10 * hidden_size
    return max(usual, params) if hold_weights and params else usual


PIPELINE_PARTITIONS = ("parameters", "blocks", "uniform")


def _resolve_pipeline(cfg: dict, engine: EngineConfig, checkpointing: bool, source: str) -> None:
    """The "pipeline" section: stages (--pipeline-stages wins), how layers are split across them
    (partition, --pipeline-partition wins) and the activation checkpoint interval in layers
    (--activation-checkpointing means 1 when the config gives none)."""
    pipe = dict(cfg.get("pipeline", {}))
    if engine.pipeline_stages is not None:
        pipe["stages"] = engine.pipeline_stages
    if engine.pipeline_partition is not None:
        pipe["partition"] = engine.pipeline_partition
    if not pipe:
        return
    stages = pipe.get("stages", 1)
    if not ds_sections.is_whole(stages, 1):
        raise ConfigError(f"{source}: pipeline.stages must be a positive integer, got {stages!r}")
    if pipe.get("partition", "parameters") not in PIPELINE_PARTITIONS:
        raise ConfigError(
            f"{source}: pipeline.partition must be one of {', '.join(PIPELINE_PARTITIONS)}, "
            f"got {pipe['partition']!r}"
        )
    interval = pipe.get("activation_checkpoint_interval", 0)
    if not ds_sections.is_whole(interval):
        raise ConfigError(
            f"{source}: pipeline.activation_checkpoint_interval must be a whole number of "
            f"layers (0: off), got {interval!r}"
        )
    if activation_checkpointing(cfg, checkpointing) and stages > 1 and interval == 0:
        pipe["activation_checkpoint_interval"] = 1
    cfg["pipeline"] = pipe


def _derive_batch(cfg: dict, dp: int, source: str) -> None:
    def val(key):
        v = cfg.get(key, "auto")
        if v == "auto" or v is None:
            return None
        if not ds_sections.is_whole(v, 1):
            raise ConfigError(f"{source}: {key} must be a positive integer, got {v!r}")
        return v

    tb = val("train_batch_size")
    mb = val("train_micro_batch_size_per_gpu")
    ga = val("gradient_accumulation_steps")
    if tb and mb and ga:
        if tb != mb * ga * dp:
            raise ConfigError(
                f"{source}: train_batch_size={tb} != train_micro_batch_size_per_gpu={mb} x "
                f"gradient_accumulation_steps={ga} x data-parallel world {dp} (= {mb * ga * dp});"
                f" set train_batch_size to {mb * ga * dp}, or drop one of the three (or set it"
                f' to "auto") so it is derived'
            )
    elif tb and mb:
        if tb % (mb * dp):
            raise ConfigError(
                f"{source}: train_batch_size={tb} is not a multiple of "
                f"train_micro_batch_size_per_gpu={mb} x data-parallel world {dp}; change "
                f"train_batch_size to a multiple of {mb * dp}"
            )
        ga = tb // (mb * dp)
    elif tb and ga:
        if tb % (ga * dp):
            raise ConfigError(
                f"{source}: train_batch_size={tb} is not a multiple of "
                f"gradient_accumulation_steps={ga} x data-parallel world {dp}; change "
                f"train_batch_size to a multiple of {ga * dp}"
            )
        mb = tb // (ga * dp)
    elif tb:
        if tb % dp:
            raise ConfigError(
                f"{source}: train_batch_size={tb} is not a multiple of the data-parallel "
                f"world {dp}; change train_batch_size"
            )
        ga = 1
        mb = tb // dp
    else:
        mb = mb or DEFAULT_MICRO_BATCH
        ga = ga or 1
    cfg["train_batch_size"] = mb * ga * dp
    cfg["train_micro_batch_size_per_gpu"] = mb
    cfg["gradient_accumulation_steps"] = ga


def _check_combinations(cfg: dict, source: str) -> None:
    stage = zero_stage(cfg)
    zero = cfg.get("zero_optimization", {})
    if pipeline_stages(cfg) > 1 and stage > 1:
        raise ConfigError(
            f"{source}: pipeline parallelism works with ZeRO stage 0 or 1 only (DeepSpeed "
            f"refuses ZeRO-{stage} with pipelining); set zero_optimization.stage to 1"
        )
    off_opt = zero.get("offload_optimizer", {}).get("device", "none")
    off_par = zero.get("offload_param", {}).get("device", "none")
    if off_par not in ("none", None) and stage != 3:
        raise ConfigError(f"{source}: offload_param needs ZeRO stage 3 (stage is {stage})")
    if off_opt == "nvme" and stage != 3:
        raise ConfigError(
            f"{source}: offload_optimizer.device=nvme needs ZeRO stage 3; with stage {stage} "
            "DeepSpeed silently falls back to CPU offload. Use device cpu, or stage 3"
        )
    if off_opt not in ("none", None):
        if stage == 0:
            raise ConfigError(f"{source}: offload_optimizer needs ZeRO stage 1, 2 or 3")
        opt = cfg.get("optimizer", {}).get("type", "")
        if opt.lower() not in ("adam", "adamw", "cpuadam"):
            raise ConfigError(
                f'{source}: offload_optimizer needs an "optimizer" section of type AdamW '
                "(DeepSpeed then uses its CPU Adam); none was given"
                if not opt
                else f"{source}: offload_optimizer does not support optimizer type {opt!r}; "
                "use AdamW"
            )


def auto_paths(obj: Any, prefix: str = ""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from auto_paths(v, f"{prefix}.{k}" if prefix else k)
    elif isinstance(obj, list):
        if any(x == "auto" for x in obj):
            yield prefix, obj
    elif obj == "auto":
        yield prefix, obj


def _set(cfg: dict, path: str, value: Any) -> None:
    *parents, last = path.split(".")
    d = cfg
    for p in parents:
        d = d[p]
    d[last] = value
