"""Preflight of the command line: every numeric flag in its domain, the switches that need a
backend or a package, and a launcher environment that is whole."""

from __future__ import annotations

import importlib.util
import math
import os

from data.manifest import DataError
from data.reader import parse_spans
from training.errors import ConfigError
from training.loop.profile import parse_span
from training.settings.run_config import RunConfig, flat, settings

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def check_flags(config: RunConfig) -> None:
    """Flags with impossible values: every number in its domain and finite; the switches that
    need a backend or a package."""
    values = flat(config)
    for s in settings():  # each number's domain is declared with its setting (run_config.py)
        low, high, need = s.range
        value = values[s.dest]
        if value is None or not need:
            continue
        finite = not isinstance(value, float) or math.isfinite(value)
        if not finite or value < low or (high is not None and value > high):
            raise ConfigError(f"{s.flag} must be {need}, got {value}")
    if config.logging.profile is not None:
        try:
            _, last = parse_span(config.logging.profile)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if last > config.optim.steps:
            raise ConfigError(
                f"--profile {config.logging.profile}: the run has {config.optim.steps} steps"
            )
    try:
        parse_spans(config.data.skip_samples)
    except DataError as e:
        raise ConfigError(str(e)) from None
    if config.logging.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "--wandb: the wandb package is not installed; pip install wandb (or drop --wandb)"
        )
    if config.optim.optimizer == "muon" and config.model.lora is not None:
        raise ConfigError(
            "--optimizer muon with --lora: Muon orthogonalizes whole hidden matrices, and "
            "zerostack has not verified it on LoRA's low-rank adapters; use --optimizer adamw"
        )
    for flag, given, needs in (
        ("--no-fsdp-reshard-after-forward", not config.engine.fsdp_reshard_after_forward, "fsdp"),
        ("--fsdp-cpu-offload", config.engine.fsdp_cpu_offload, "fsdp"),
        ("--ddp-bucket-mb", config.engine.ddp_bucket_mb is not None, "ddp"),
    ):
        if given and config.engine.backend != needs:
            raise ConfigError(
                f"{flag} needs --backend {needs} (got --backend {config.engine.backend})"
            )


def check_launch_env() -> None:
    """A torchrun-style launcher environment that is only half there."""
    env = os.environ
    launched = [k for k in LAUNCH_VARS if k in env]
    if launched and len(launched) < len(LAUNCH_VARS):
        missing = sorted(set(LAUNCH_VARS) - set(launched))
        raise ConfigError(
            f"the environment sets {', '.join(launched)} but not {', '.join(missing)}: start "
            "through torchrun or deepspeed, or unset them to run as a single process"
        )
    # a rank outside its world, or not a number: runtime/launcher.py, before this
