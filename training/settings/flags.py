"""The trainer's flags, declared once: each field of `Settings` is a flag, with its type, default
and help, and `parser()` is generated from them. What a component needs is taken from here by
train.py and handed over as that component's own small config; nothing below train.py reads a
`Settings`.

A field's flag is `--` plus its name with `_` as `-`; `aliases` adds spellings. A `bool` field
whose default is False is a switch (`--compile`); one whose default is True also gets its
`--no-` form (`--no-fsdp-reshard-after-forward`).
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields

REQUIRED = MISSING  # a field without a default is a required flag


def flag(default=REQUIRED, help: str | None = None, *, choices=None, aliases=(), hidden=False):
    """A dataclass field that is also a command-line flag."""
    meta = {"help": help, "choices": choices, "aliases": tuple(aliases), "hidden": hidden}
    if default is REQUIRED:
        return field(metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(kw_only=True)
class Settings:
    """Every flag of training/train.py, typed."""

    backend: str = flag("deepspeed", choices=["deepspeed", "ddp", "fsdp"])
    ds_config: str | None = flag(
        None,
        "DeepSpeed JSON (default ds_configs/zero2.json; ddp/fsdp read its batch, precision and "
        "clipping, default ds_configs/zero0.json)",
        aliases=["--ds-config", "--deepspeed_config"],
    )
    data: str = flag(help="a folder written by `python -m data.prepare`")
    model: str = flag("small", "preset name, or a local HF model folder")
    out: str = flag(help="run folder (resumes if it holds checkpoints)")
    seq_len: int = flag(256)
    steps: int = flag(200, "optimizer steps in total")
    micro_batch: int | None = flag(None, "overrides train_micro_batch_size_per_gpu")
    grad_accum: int | None = flag(None, "overrides gradient_accumulation_steps")
    global_batch: int | None = flag(None, "overrides train_batch_size")
    grad_clip: float | None = flag(None, "overrides gradient_clipping")
    lr: float = flag(1e-3)
    min_lr_ratio: float = flag(0.1)
    warmup: int = flag(20)
    weight_decay: float = flag(0.1)
    beta1: float = flag(0.9)
    beta2: float = flag(0.95)
    eps: float = flag(1e-8)
    seed: int = flag(1234)
    log_every: int = flag(10)
    eval_every: int = flag(100, "0: only at the end")
    eval_samples: int = flag(64, "validation windows per evaluation")
    save_every: int = flag(100, "0: only at the end; -1: never")
    keep_last: int = flag(3)
    activation_checkpointing: bool = flag(False)
    compile: bool = flag(
        False, "torch.compile the model in place (fuses the elementwise work; first steps compile)"
    )
    attention: str = flag(
        "auto",
        "attention kernel of our model: SDPA, or softmax(QK^T)V written out (faster on CPUs at "
        "short sequences); auto: explicit on a CPU up to --seq-len 512, else sdpa",
        choices=["auto", "sdpa", "explicit"],
    )
    pipeline_stages: int | None = flag(
        None,
        "overrides pipeline.stages (deepspeed: the model cut into this many stages; the ranks "
        "left over are data-parallel replicas)",
    )
    pipeline_partition: str | None = flag(
        None,
        "overrides pipeline.partition: balance the stages by parameters, by transformer blocks, "
        "or by layer count",
        choices=["parameters", "blocks", "uniform"],
    )
    fsdp_reshard_after_forward: bool = flag(
        True,
        "fsdp: free each block's gathered weights after its forward and gather them again for "
        "backward (less memory, one more all-gather per block)",
    )
    fsdp_cpu_offload: bool = flag(
        False, "fsdp: keep parameter shards, gradients and the optimizer step in host memory"
    )
    ddp_bucket_mb: float | None = flag(
        None, "ddp: gradient all-reduce bucket size in MB (default 25)"
    )
    nvme_path: str | None = flag(
        None,
        "local disk folder for ZeRO-Infinity swap files (configs offloading to nvme, e.g. "
        "ds_configs/zero3_nvme.json; default RUN/nvme_swap)",
    )
    precision: str | None = flag(
        None, "ddp/fsdp only; overrides what the config says", choices=["bf16", "fp16", "fp32"]
    )
    stop_at: int | None = flag(
        None, "save and exit after this step (the schedule still spans --steps)"
    )
    resume: str = flag("auto", "auto | never | a run or checkpoint folder")
    universal: str = flag(
        "auto",
        "resume through a universal checkpoint: auto (when world size, ZeRO stage or pipeline "
        "stages differ from the checkpoint's), always, or never (refuse such a resume)",
        choices=["auto", "always", "never"],
    )
    peak_tflops: float | None = flag(
        None, "per-rank peak for MFU (default: measured once and cached)"
    )
    wandb: bool = flag(False, "also log to Weights & Biases (offline works)")
    dist_timeout: float = flag(
        600.0, "seconds before a collective gives up (a hung rank is named after this)"
    )
    max_bad_steps: int = flag(
        5,
        "stop after this many consecutive steps with a non-finite loss or gradient norm "
        "(bf16/fp32; each is skipped on every rank)",
    )
    # The deepspeed launcher passes --local_rank; LOCAL_RANK in the environment wins.
    local_rank: int | None = flag(None, aliases=["--local_rank"], hidden=True)

    @classmethod
    def parse(cls, argv: list[str] | None = None) -> Settings:
        return cls(**vars(parser().parse_args(argv)))

    def as_flags(self) -> dict:
        """{flag dest: value}: what resolved_config.json records and the config rule reads."""
        return asdict(self)


def parser() -> argparse.ArgumentParser:
    """The command line of training/train.py, generated from `Settings`."""
    p = argparse.ArgumentParser(description="Train a causal LM with DeepSpeed, DDP or FSDP2.")
    types = typing.get_type_hints(Settings)
    for f in fields(Settings):
        meta, kind = f.metadata, _base_type(types[f.name])
        names = [f"--{f.name.replace('_', '-')}", *meta["aliases"]]
        if f.name == "ds_config":  # the DeepSpeed spelling first, as users know it
            names = ["--ds_config", *meta["aliases"]]
        kw: dict = {"dest": f.name, "help": argparse.SUPPRESS if meta["hidden"] else meta["help"]}
        if f.default is MISSING:
            kw["required"] = True
        else:
            kw["default"] = f.default
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
        else:
            kw["type"] = kind
            if meta["choices"]:
                kw["choices"] = meta["choices"]
        p.add_argument(*names, **kw)
    return p


def _base_type(t) -> type:
    """int | None -> int."""
    args = [a for a in typing.get_args(t) if a is not type(None)]
    return args[0] if args else t
