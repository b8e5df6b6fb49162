"""Everything that can be checked before any process group or model exists: the flags, the
launcher's environment, the DeepSpeed config (resolved by training/settings/ds_config.py), the
data, the model's config, and what to resume from. A failure is one line, and nothing was
written."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig

from data import load_data
from data.manifest import MANIFEST, Manifest
from models import PRESETS, ModelError, cpu_attention, get_config
from models.hub import resolve_pretrained
from training.checkpoints.resume import ResumePlan, plan_resume
from training.checkpoints.universal import Topology
from training.engines.base import OptimizerConfig
from training.errors import CheckpointError, ConfigError
from training.loop.profile import parse_span
from training.loop.schedule import Schedule
from training.memory.plan import shape_of_config
from training.runtime import safe_load
from training.runtime.cluster import accelerate_ds_config
from training.runtime.distributed import accelerator
from training.settings import ds_config, nvme, parallel
from training.settings.flags import Settings

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Prepared:
    """What the checks found, for train.py to execute."""

    ds_config: dict  # resolved: no "auto" left, the batch triplet derived
    config_path: str
    precision: str
    manifest: Manifest
    model_config: object  # the model's config (ours or any HF one), not the model
    topology: Topology  # this run's: what a checkpoint's files depend on
    resume: ResumePlan | None
    # The optimizer's numbers and the schedule: flag given > ds_config > default (hparams.py)
    optimizer: OptimizerConfig | None = None
    schedule: Schedule | None = None
    activation_checkpointing: bool = False  # the flag, or the config's section
    model_overrides: dict | None = None  # config fields the model is built with (positions)
    compile: bool = False  # --compile, or its default (compile_by_default)

    @property
    def micro_batch(self) -> int:
        return self.ds_config["train_micro_batch_size_per_gpu"]

    @property
    def grad_accum(self) -> int:
        return self.ds_config["gradient_accumulation_steps"]

    @property
    def effective_flags(self) -> dict:
        """The values the run uses for the flags that default to "not given" (lr, betas, ...),
        for the run's record."""
        o, sch = self.optimizer, self.schedule
        return {
            "lr": o.lr,
            "beta1": o.betas[0],
            "beta2": o.betas[1],
            "eps": o.eps,
            "weight_decay": o.weight_decay,
            "warmup": sch.warmup,
            "min_lr_ratio": sch.min_lr_ratio,
            "schedule": sch.kind,
            "activation_checkpointing": self.activation_checkpointing,
        }


def prepare_run(settings: Settings, world: int, rank: int = 0) -> Prepared:
    """Check a run before any work; raises ConfigError, DataError, ModelError or CheckpointError
    with one line."""
    check_flags(settings)
    check_out(settings)
    check_launch_env(world)
    default = "zero2.json" if settings.backend == "deepspeed" else "zero0.json"
    cfg_path = accelerate_ds_config(settings.ds_config) or str(ds_config.CONFIG_DIR / default)
    raw = ds_config.load_json(cfg_path)
    device = accelerator().device_name()
    # The config's own mistakes first: before the data's checksums are read.
    ds_config.precheck(raw, flags=settings.as_flags(), source=cfg_path, device_type=device)
    manifest = load_data(settings.data, settings.seq_len, verify=True, log=rank0_printer(rank))
    overrides = model_overrides(settings.model, settings.seq_len)
    model_cfg = model_config(settings.model, manifest.vocab_size, overrides)
    check_lengths(settings, model_cfg, manifest)
    raw = nvme.override_path(raw, settings.nvme_path, cfg_path)
    flags = {
        **settings.as_flags(),
        **nvme.auto_values(settings.nvme_path, Path(settings.out), model_cfg),
    }
    shape = shape_of_config(model_cfg, settings.model)  # counted on the meta device
    cfg = ds_config.resolve(
        raw,
        world=world,
        flags=flags,
        hidden_size=model_cfg.hidden_size,
        source=cfg_path,
        device_type=accelerator().device_name(),
        params=shape.params,
    )
    if settings.backend == "deepspeed" and nvme.nvme_sections(cfg):
        nvme.check_aio(cfg_path)
    precision = settings.precision or ds_config.precision(cfg)
    check_engine(settings, cfg, cfg_path, precision)
    check_model(settings, model_cfg, manifest, ds_config.pipeline_stages(cfg), cfg_path)
    check_parallel(settings, cfg, parallel.layout(cfg, world, cfg_path), model_cfg, cfg_path)
    if settings.backend == "deepspeed":
        check_memory(settings, cfg, cfg_path, shape, world, flags)
    now = Topology(
        settings.backend,
        world,
        ds_config.zero_stage(cfg),
        ds_config.pipeline_stages(cfg),
        parallel.tensor_size(cfg),
        parallel.sequence_size(cfg),
        optimizer_on_nvme="offload_optimizer" in nvme.nvme_sections(cfg),
    )
    log = rank0_printer(rank)
    resume = plan_resume(settings.resume, Path(settings.out), now, settings.universal, log)
    if resume is not None:
        check_resume_shape(resume, model_cfg, settings.model)
    optimizer, schedule = ds_config.hyperparameters(cfg, flags, cfg_path)
    return Prepared(
        cfg,
        cfg_path,
        precision,
        manifest,
        model_cfg,
        now,
        resume,
        OptimizerConfig(
            optimizer["lr"], tuple(optimizer["betas"]), optimizer["eps"], optimizer["weight_decay"]
        ),
        Schedule(**schedule),
        ds_config.activation_checkpointing(cfg, flags),
        overrides,
        settings.compile
        if settings.compile is not None
        else compile_by_default(
            cfg,
            device,
            ds_config.activation_checkpointing(cfg, flags),
            ours=getattr(model_cfg, "model_type", "?") in ("zerostack", "llama"),
        ),
    )


def compile_by_default(
    cfg: dict, device_type: str, activation_checkpointing: bool, ours: bool = True
) -> bool:
    """Whether a run that does not say --compile / --no-compile compiles its blocks: where it
    was measured to win (docs/benchmarks.md: 1.15-1.19x on the peer and accumulation jobs under
    ZeRO-2 and ZeRO-3, the first step 3-11 s longer): our model (a preset, our folder or a
    Llama folder), on a CPU, with a C++ compiler for Inductor, and none of what it was not
    measured with (pipeline stages, which it does not reach; tensor or sequence parallelism;
    activation checkpointing; parameter offload). Other models and GPUs keep it opt-in,
    unmeasured. ZEROSTACK_COMPILE=0 turns this default off."""
    import shutil

    zero = cfg.get("zero_optimization", {})
    return (
        ours
        and device_type == "cpu"
        and os.environ.get("ZEROSTACK_COMPILE") != "0"
        and shutil.which(os.environ.get("CXX", "g++")) is not None
        and ds_config.pipeline_stages(cfg) == 1
        and parallel.tensor_size(cfg) == parallel.sequence_size(cfg) == 1
        and not activation_checkpointing
        and str(zero.get("offload_param", {}).get("device", "none")).lower() == "none"
    )


def rank0_printer(rank: int):
    """print(line) to stderr on rank 0, nothing elsewhere: rank 0 speaks for all."""
    if rank != 0:
        return lambda line: None
    return lambda line: print(line, file=sys.stderr, flush=True)


# Every numeric flag's domain: (flag, lowest, highest, what to say). None is "not given" and
# passes; a float must also be finite (argparse takes inf and nan).
FLAG_RANGES = (
    ("steps", 1, None, "at least 1"),
    ("seq_len", 2, None, "at least 2"),
    ("micro_batch", 1, None, "at least 1"),
    ("grad_accum", 1, None, "at least 1"),
    ("global_batch", 1, None, "at least 1"),
    ("grad_clip", 0, None, "0 (no clipping) or more"),
    ("lr", 0, None, "0 or more"),
    ("min_lr_ratio", 0, 1, "between 0 and 1"),
    ("warmup", 0, None, "0 or more"),
    ("weight_decay", 0, None, "0 or more"),
    ("beta1", 0, 0.999999, "in [0, 1)"),
    ("beta2", 0, 0.999999, "in [0, 1)"),
    ("eps", 1e-30, None, "positive"),
    ("seed", 0, 2**32 - 1, "in 0..2^32-1"),
    ("log_every", 1, None, "at least 1"),
    ("eval_every", 0, None, "0 (only at the end) or more"),
    ("eval_samples", 1, None, "at least 1"),
    ("save_every", -1, None, "-1 (never), 0 (at the end) or more"),
    ("keep_last", 0, None, "0 (keep all) or more"),
    ("pipeline_stages", 1, None, "at least 1"),
    ("ddp_bucket_mb", 1e-6, None, "positive"),
    ("stop_at", 1, None, "at least 1"),
    ("peak_tflops", 1e-9, None, "positive"),
    ("dist_timeout", 1e-3, None, "positive (seconds)"),
    ("max_bad_steps", 1, None, "at least 1"),
)


def check_flags(settings: Settings) -> None:
    """Flags with impossible values: every number in its domain and finite; the switches that
    need a backend or a package."""
    values = settings.as_flags()
    for name, low, high, need in FLAG_RANGES:
        value = values.get(name)
        if value is None:
            continue
        finite = not isinstance(value, float) or math.isfinite(value)
        if not finite or value < low or (high is not None and value > high):
            raise ConfigError(f"--{name.replace('_', '-')} must be {need}, got {value}")
    if settings.profile is not None:
        try:
            _, last = parse_span(settings.profile)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if last > settings.steps:
            raise ConfigError(f"--profile {settings.profile}: the run has {settings.steps} steps")
    if settings.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "--wandb: the wandb package is not installed; pip install wandb (or drop --wandb)"
        )
    for flag, given, needs in (
        ("--no-fsdp-reshard-after-forward", not settings.fsdp_reshard_after_forward, "fsdp"),
        ("--fsdp-cpu-offload", settings.fsdp_cpu_offload, "fsdp"),
        ("--ddp-bucket-mb", settings.ddp_bucket_mb is not None, "ddp"),
    ):
        if given and settings.backend != needs:
            raise ConfigError(f"{flag} needs --backend {needs} (got --backend {settings.backend})")


def check_out(settings: Settings) -> None:
    """--out can be made a run folder: not a file, no file on its way, writable, and not a
    prepared data folder or inside one (run files would be written into the dataset)."""
    out = Path(settings.out).absolute()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {settings.out} exists and is not a folder")
    existing = out
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"--out {settings.out}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {settings.out}: {existing} is not writable")
    for folder in (existing, *existing.parents):
        if (folder / MANIFEST).is_file():
            raise ConfigError(
                f"--out {settings.out}: {folder} is a prepared data folder (it holds "
                f"{MANIFEST}); put the run elsewhere"
            )


def check_lengths(settings: Settings, model_cfg, manifest) -> None:
    """--seq-len against the model's positions and each split's tokens (one window needs
    seq_len + 1)."""
    positions = getattr(model_cfg, "max_position_embeddings", None)
    if isinstance(positions, int) and settings.seq_len > positions:
        raise ConfigError(
            f"--seq-len {settings.seq_len} is longer than --model {settings.model}'s "
            f"{positions} positions (max_position_embeddings); use --seq-len {positions} or less"
        )
    for name, split in getattr(manifest, "splits", {}).items():
        tokens = getattr(split, "tokens", None)
        if isinstance(tokens, int) and tokens < settings.seq_len + 1:
            raise ConfigError(
                f"--seq-len {settings.seq_len}: the {name} split of {settings.data} has "
                f"{tokens} tokens, too few for one window of seq_len + 1; use --seq-len "
                f"{max(2, tokens - 1)} or less, or more data"
            )


# What a checkpoint's weights depend on: a resume with another value cannot load them.
SHAPE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "tie_word_embeddings",
    "n_embd",
    "n_layer",
    "n_head",
)


def check_resume_shape(plan: ResumePlan, model_cfg, model: str) -> None:
    """The checkpoint's recorded model config against the requested one, before ranks start (a
    state-dict traceback on every rank otherwise)."""
    saved = plan.trainer_state().get("model_config")
    if not isinstance(saved, dict):
        return  # an old checkpoint without it: the engine's load says
    wanted = model_cfg.to_dict()
    for key in SHAPE_KEYS:
        if key in saved and key in wanted and saved[key] != wanted[key]:
            raise CheckpointError(
                f"{plan.root / plan.tag} holds a model with {key}={saved[key]!r}, but --model "
                f"{model} has {key}={wanted[key]!r}; resume with the model it was trained with, "
                "or start a new run in another --out (or --resume never)"
            )


def check_launch_env(world: int) -> None:
    """A launcher environment that is only half there, or a rank outside the world."""
    env = os.environ
    launched = [k for k in LAUNCH_VARS if k in env]
    if launched and len(launched) < len(LAUNCH_VARS):
        missing = sorted(set(LAUNCH_VARS) - set(launched))
        raise ConfigError(
            f"the environment sets {', '.join(launched)} but not {', '.join(missing)}: start "
            "through torchrun or deepspeed, or unset them to run as a single process"
        )
    rank = int(env.get("RANK", "0"))
    if not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} is not in 0..WORLD_SIZE-1 (WORLD_SIZE={world})")


def check_engine(settings: Settings, cfg: dict, cfg_path: str, precision: str) -> None:
    """What the chosen backend cannot do with this config on this device."""
    if settings.backend == "deepspeed" and precision == "fp16":
        acc = accelerator()
        if not acc.is_fp16_supported():
            raise ConfigError(
                f"{cfg_path}: fp16 is not supported on this device ({acc.device_name()}: no "
                "fp16 kernels); use a bf16 config such as ds_configs/zero2.json, or fp32.json"
            )
    if settings.backend != "deepspeed" and ds_config.pipeline_stages(cfg) > 1:
        raise ConfigError(f"{cfg_path}: pipeline configs need --backend deepspeed")


def check_parallel(
    settings: Settings, cfg: dict, layout: parallel.Layout, model_cfg, cfg_path: str
) -> None:
    """What tensor and sequence parallelism need of the model (settings/parallel.py)."""
    if layout.tensor == 1 and layout.sequence == 1:
        return
    text = model_cfg.get_text_config() if hasattr(model_cfg, "get_text_config") else model_cfg
    heads = text.num_attention_heads
    parallel.check_model(
        layout,
        heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        seq_len=settings.seq_len,
        source=cfg_path,
    )
    own_plan = {"partition_config", "preset_model"} & set(cfg.get("tensor_parallel", {}))
    if layout.tensor > 1 and not own_plan:  # the config's own plan wins over the model's
        check_tp_plan(model_cfg, settings.model, cfg_path)
    if layout.sequence > 1 and settings.doc_mask:
        raise ConfigError(
            f"{cfg_path}: --doc-mask with sequence_parallel_size > 1: Ulysses attends over the "
            "whole gathered sequence with the causal flag only; drop --doc-mask"
        )


def check_tp_plan(model_cfg, model: str, cfg_path: str) -> None:
    """A transformers model's tensor-parallel plan in styles DeepSpeed's AutoTP applies: it
    refuses any other inside deepspeed.initialize, after every rank has started."""
    from deepspeed.module_inject.tp_plan_converter import SUPPORTED_STYLES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    plan = dict(getattr(model_cfg, "base_model_tp_plan", None) or {})
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(model_cfg), None)
    plan.update(getattr(model_class, "_tp_plan", None) or {})
    odd = sorted({style for style in plan.values() if style.lower() not in SUPPORTED_STYLES})
    if odd:
        raise ConfigError(
            f"{cfg_path}: --model {model}: its tensor-parallel plan uses {', '.join(odd)}, which "
            "DeepSpeed's AutoTP does not apply; give tensor_parallel.partition_config for this "
            "model, or use data parallelism / ZeRO-3"
        )


def check_model(settings: Settings, model_cfg, manifest, stages: int, cfg_path: str) -> None:
    """The model against the data, the attention kernel and the pipeline: pipelining cuts our
    model (a preset, our folder or a Llama folder) between its blocks."""
    kind = getattr(model_cfg, "model_type", "?")
    ours = kind in ("zerostack", "llama")
    if settings.attention in ("explicit", "flash") and not ours:
        raise ConfigError(
            f"--attention {settings.attention}: {settings.model} is a {kind} model; that kernel "
            "is our model's (presets, our exports, Llama folders). Drop the flag"
        )
    if settings.attention == "flash" and settings.doc_mask:
        raise ConfigError(
            "--attention flash with --doc-mask: the flash kernel is causal only; drop one "
            "(--attention auto picks a kernel that takes the documents' mask)"
        )
    if settings.attention == "flash" and (why := cpu_attention.available()) is not None:
        raise ConfigError(f"--attention flash: not on this host: {why}. Use --attention sdpa")
    if settings.doc_mask and not ours:
        raise ConfigError(
            f"--doc-mask: {settings.model} is a {kind} model; document masking is our model's "
            "(presets, our exports, Llama folders): transformers' SDPA models ignore document "
            "boundaries in position_ids. Drop the flag"
        )
    if settings.doc_mask and stages > 1:
        raise ConfigError(
            f"{cfg_path}: --doc-mask does not reach the pipeline's stages (only hidden states "
            "travel between them); drop --doc-mask or use a non-pipeline config"
        )
    if getattr(model_cfg, "vocab_size", manifest.vocab_size) < manifest.vocab_size:
        raise ConfigError(
            f"--model {settings.model}: its vocabulary has {model_cfg.vocab_size} tokens but the data in "
            f"{settings.data} uses {manifest.vocab_size}; prepare the data with that model's tokenizer"
        )
    if stages <= 1:
        return
    if not ours:
        raise ModelError(
            f"--model {settings.model}: pipelining needs our model (a preset, a zerostack folder or a "
            f"Llama folder); this is a {kind!r} model, which cannot be cut into stages. Use a "
            "non-pipeline config such as ds_configs/zero1.json"
        )
    if settings.compile:  # asked for (the default leaves pipelines eager)
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


def check_memory(settings: Settings, cfg: dict, cfg_path: str, shape, world: int, flags) -> None:
    """The memory plan (training/memory/plan.py) before any rank allocates the model: a run it
    says cannot fit is refused, naming the shipped config that would (--force tries anyway).
    The plan's advice is kept for a rank that runs out of memory later (training/guard.py)."""
    from training.memory import oom, plan

    zero = cfg.get("zero_optimization", {})
    swap = next((zero[s]["nvme_path"] for s in nvme.nvme_sections(cfg)), None)
    verdict = plan.check_run(
        shape,
        cfg,
        world,
        config_name=cfg_path,
        # Ulysses: each rank's activations cover its slice of the sequence. (Tensor
        # parallelism is planned as data parallelism: an overestimate of its model states.)
        seq_len=settings.seq_len // parallel.sequence_size(cfg),
        activation_checkpointing=ds_config.activation_checkpointing(cfg, flags),
        ranks_per_host=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
        nvme_dir=swap,
    )
    oom.remember(verdict.advice())
    if not verdict.fits and not settings.force:
        raise ConfigError(verdict.refusal())


def model_overrides(spec: str, seq_len: int) -> dict:
    """A preset has no trained positions: a --seq-len beyond its max_position_embeddings (long
    context) widens the rotary range it is built with. A folder's positions are its own."""
    if spec in PRESETS and seq_len > get_config(spec).max_position_embeddings:
        return {"max_position_embeddings": seq_len}
    return {}


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

    from models import ZeroStackForCausalLM, from_llama_config, from_llama_state_dict

    llama = config.model_type == "llama"
    with torch.device("meta"):
        if llama or config.model_type == "zerostack":
            ours = from_llama_config(config) if llama else config
            model = ZeroStackForCausalLM(ours)
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
