"""Everything that can be checked before any process group or model exists: the flags, the
launcher's environment, the DeepSpeed config (resolved by training/settings/ds_config.py), the
data, the model's config, and what to resume from. A failure is one line, and nothing was
written."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig

from data import load_manifest
from data.manifest import Manifest
from models import ModelError, get_config
from training.checkpoints.resume import ResumePlan, plan_resume
from training.checkpoints.universal import Topology
from training.errors import ConfigError
from training.runtime.cluster import accelerate_ds_config
from training.runtime.distributed import accelerator
from training.settings import ds_config, nvme
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

    @property
    def micro_batch(self) -> int:
        return self.ds_config["train_micro_batch_size_per_gpu"]

    @property
    def grad_accum(self) -> int:
        return self.ds_config["gradient_accumulation_steps"]


def prepare_run(settings: Settings, world: int, rank: int = 0) -> Prepared:
    """Check a run before any work; raises ConfigError, DataError, ModelError or CheckpointError
    with one line."""
    check_flags(settings)
    check_launch_env(world)
    default = "zero2.json" if settings.backend == "deepspeed" else "zero0.json"
    cfg_path = accelerate_ds_config(settings.ds_config) or str(ds_config.CONFIG_DIR / default)
    raw = ds_config.load_json(cfg_path)
    manifest = load_manifest(settings.data)
    model_cfg = model_config(settings.model, manifest.vocab_size)
    raw = nvme.override_path(raw, settings.nvme_path, cfg_path)
    flags = {
        **settings.as_flags(),
        **nvme.auto_values(settings.nvme_path, Path(settings.out), model_cfg),
    }
    cfg = ds_config.resolve(
        raw,
        world=world,
        flags=flags,
        hidden_size=model_cfg.hidden_size,
        source=cfg_path,
        device_type=accelerator().device_name(),
    )
    if settings.backend == "deepspeed" and nvme.nvme_sections(cfg):
        nvme.check_aio(cfg_path)
    precision = settings.precision or ds_config.precision(cfg)
    check_engine(settings, cfg, cfg_path, precision)
    check_model(settings, model_cfg, manifest, ds_config.pipeline_stages(cfg), cfg_path)
    now = Topology(
        settings.backend, world, ds_config.zero_stage(cfg), ds_config.pipeline_stages(cfg)
    )
    log = rank0_printer(rank)
    resume = plan_resume(settings.resume, Path(settings.out), now, settings.universal, log)
    return Prepared(cfg, cfg_path, precision, manifest, model_cfg, now, resume)


def rank0_printer(rank: int):
    """print(line) to stderr on rank 0, nothing elsewhere: rank 0 speaks for all."""
    if rank != 0:
        return lambda line: None
    return lambda line: print(line, file=sys.stderr, flush=True)


def check_flags(settings: Settings) -> None:
    """Flags with impossible values."""
    for flag, value, ok, need in (
        ("--steps", settings.steps, settings.steps >= 1, "at least 1"),
        ("--seq-len", settings.seq_len, settings.seq_len >= 2, "at least 2"),
        ("--lr", settings.lr, settings.lr >= 0, "0 or more"),
        ("--dist-timeout", settings.dist_timeout, settings.dist_timeout > 0, "positive (seconds)"),
        ("--max-bad-steps", settings.max_bad_steps, settings.max_bad_steps >= 1, "at least 1"),
        (
            "--save-every",
            settings.save_every,
            settings.save_every >= -1,
            "-1 (never), 0 (at the end) or more",
        ),
    ):
        if not ok:
            raise ConfigError(f"{flag} must be {need}, got {value}")
    out = Path(settings.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a folder")
    for flag, given, needs in (
        ("--no-fsdp-reshard-after-forward", not settings.fsdp_reshard_after_forward, "fsdp"),
        ("--fsdp-cpu-offload", settings.fsdp_cpu_offload, "fsdp"),
        ("--ddp-bucket-mb", settings.ddp_bucket_mb is not None, "ddp"),
    ):
        if given and settings.backend != needs:
            raise ConfigError(f"{flag} needs --backend {needs} (got --backend {settings.backend})")
    if settings.ddp_bucket_mb is not None and settings.ddp_bucket_mb <= 0:
        raise ConfigError(f"--ddp-bucket-mb must be positive, got {settings.ddp_bucket_mb}")


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


def check_model(settings: Settings, model_cfg, manifest, stages: int, cfg_path: str) -> None:
    """The model against the data, the attention kernel and the pipeline: pipelining cuts our
    model (a preset, our folder or a Llama folder) between its blocks."""
    kind = getattr(model_cfg, "model_type", "?")
    ours = kind in ("zerostack", "llama")
    if settings.attention == "explicit" and not ours:
        raise ConfigError(
            f"--attention explicit: {settings.model} is a {kind} model; the explicit kernel is our "
            "model's (presets, our exports, Llama folders). Drop the flag"
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
    if settings.compile:
        raise ConfigError(
            f"{cfg_path}: --compile does not reach the pipeline's stages (it compiles the whole "
            "model); drop --compile or use a non-pipeline config"
        )
    blocks = model_cfg.num_hidden_layers
    if stages > blocks:
        raise ConfigError(
            f"{cfg_path}: pipeline.stages={stages} is more than the model's {blocks} blocks; "
            f"use at most {blocks} stages"
        )


def model_config(spec: str, vocab_size: int):
    """The model's config without building it (presets and folders), for early checks."""
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"--model {spec}: folder has no config.json, so it holds no model")
        return AutoConfig.from_pretrained(path)
    if "/" in spec or spec.startswith("."):
        raise ModelError(f"--model {spec}: no such folder")
    return get_config(spec, vocab_size=vocab_size)
