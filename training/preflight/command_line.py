"""Preflight of the command line: every numeric flag in its domain, the switches that need a
backend or a package, and a launcher environment that is whole."""

from __future__ import annotations

import importlib.util
import math
import os

from training.errors import ConfigError
from training.loop.profile import parse_span
from training.settings.flags import Settings

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


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
    ("export_every", 0, None, "0 (off) or more"),
    ("universal_every", 0, None, "0 (off) or more"),
    ("eval_tasks_every", 1, None, "at least 1"),
    ("eval_tasks_limit", 1, None, "at least 1"),
    ("pipeline_stages", 1, None, "at least 1"),
    ("ddp_bucket_mb", 1e-6, None, "positive"),
    ("stop_at", 1, None, "at least 1"),
    ("peak_tflops", 1e-9, None, "positive"),
    ("dist_timeout", 1e-3, None, "positive (seconds)"),
    ("max_bad_steps", 1, None, "at least 1"),
    ("host_mem_gib", 1e-9, None, "a positive number of GiB"),
    ("device_mem_gib", 1e-9, None, "a positive number of GiB"),
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
