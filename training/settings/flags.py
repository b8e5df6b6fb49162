"""The trainer's flags, declared once: each field of `Settings` is a flag, with its type, default
and help, and `parser()` is generated from them. What a component needs is taken from here by
train.py and handed over as that component's own small config; nothing below train.py reads a
`Settings`.

A field's flag is `--` plus its name with `_` as `-`; `aliases` adds spellings (DeepSpeed's and
HF Trainer's where they mean the same thing: docs/training.md, "Flags from HF Trainer"). A `bool` field
whose default is False is a switch (`--force`); one whose default is True (or None, decided
later: `--compile`) also gets its `--no-` form (`--no-fsdp-reshard-after-forward`). No prefix of a flag is accepted
(`allow_abbrev=False`): a new flag can never change what an old command line means.

The optimizer's numbers and the schedule default to None, "not given": a value given on the
command line wins over the DeepSpeed JSON's, which wins over the default the help names
(training/settings/hparams.py applies that rule).
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
        "DeepSpeed JSON (default ds_configs/zero2.json; ddp/fsdp read its batch, precision, "
        "clipping, optimizer and scheduler, default ds_configs/zero0.json). Also spelled "
        "--ds_config, --deepspeed_config, --deepspeed X and --deepspeed --deepspeed_config X",
        aliases=["--ds_config", "--deepspeed_config"],
    )
    data: str = flag(
        help="a folder written by `python -m data.prepare`, or a weighted mixture A:0.7,B:0.3"
    )
    model: str = flag("small", "preset name, or a local HF model folder")
    out: str = flag(help="run folder (resumes if it holds checkpoints)", aliases=["--output_dir"])
    seq_len: int = flag(256)
    steps: int = flag(200, "optimizer steps in total", aliases=["--max_steps"])
    micro_batch: int | None = flag(
        None, "overrides train_micro_batch_size_per_gpu", aliases=["--per_device_train_batch_size"]
    )
    grad_accum: int | None = flag(
        None, "overrides gradient_accumulation_steps", aliases=["--gradient_accumulation_steps"]
    )
    global_batch: int | None = flag(None, "overrides train_batch_size")
    grad_clip: float | None = flag(
        None, "overrides gradient_clipping (0: no clipping)", aliases=["--max_grad_norm"]
    )
    lr: float | None = flag(
        None,
        "peak learning rate (default: the config's optimizer.params.lr or scheduler's "
        "warmup_max_lr, else 1e-3)",
        aliases=["--learning_rate"],
    )
    min_lr_ratio: float | None = flag(
        None, "the cosine's floor, as a fraction of --lr (default: cos_min_ratio, else 0.1)"
    )
    warmup: int | None = flag(
        None,
        "warmup steps (default: the config's scheduler.params.warmup_num_steps, else 20)",
        aliases=["--warmup_steps"],
    )
    weight_decay: float | None = flag(
        None,
        "AdamW weight decay on matrices (default: optimizer.params.weight_decay, else 0.1)",
        aliases=["--weight_decay"],
    )
    beta1: float | None = flag(
        None, "AdamW beta1 (default: optimizer.params.betas[0], else 0.9)", aliases=["--adam_beta1"]
    )
    beta2: float | None = flag(
        None,
        "AdamW beta2 (default: optimizer.params.betas[1], else 0.95)",
        aliases=["--adam_beta2"],
    )
    eps: float | None = flag(
        None, "AdamW epsilon (default: optimizer.params.eps, else 1e-8)", aliases=["--adam_epsilon"]
    )
    seed: int = flag(1234)
    log_every: int = flag(10, aliases=["--logging_steps"])
    eval_every: int = flag(100, "0: only at the end", aliases=["--eval_steps"])
    eval_samples: int = flag(64, "validation windows per evaluation")
    eval_on_start: bool = flag(
        False,
        "evaluate before the first step too (step 0: the starting model's figures, e.g. a "
        "base model's before fine-tuning)",
    )
    save_every: int = flag(100, "0: only at the end; -1: never", aliases=["--save_steps"])
    keep_last: int = flag(3, "checkpoints to keep, newest first (0: keep all)")
    async_save: bool = flag(
        False,
        "write checkpoints in the background: the step loop waits only for a host copy of the "
        "states; the checkpoint is sealed (complete.json, then `latest`) at a later step once "
        "every rank's files are durable (every backend; docs/checkpoints.md)",
    )
    export_every: int = flag(
        0,
        "export the checkpoint of every N-th step (a multiple of --save-every) and the run's "
        "last to RUN/exports/step_N, a verified folder stock transformers loads, in a background "
        "process while training goes on (0: off; docs/checkpoints.md)",
    )
    universal_every: int = flag(
        0,
        "deepspeed: convert the checkpoint of every N-th step and the run's last to a universal "
        "copy beside it (resumable on another world size or ZeRO stage), in the background (0: "
        "off)",
    )
    eval_tasks: str | None = flag(
        None,
        "lm-evaluation-harness tasks, comma-separated, scored in a background process on the "
        "checkpoints --eval-tasks-every names (default with --eval-tasks-every: the shipped "
        "offline tasks; docs/evaluation.md)",
    )
    eval_tasks_every: int | None = flag(
        None,
        "score --eval-tasks on the checkpoint of every N-th step (a multiple of --save-every) and "
        "the run's last (default with --eval-tasks: every checkpoint)",
    )
    eval_tasks_limit: int | None = flag(None, "at most N items per task (default: all)")
    activation_checkpointing: bool = flag(
        False,
        "recompute each block in backward (also turned on by the config's "
        "activation_checkpointing section)",
        aliases=["--gradient_checkpointing"],
    )
    compile: bool | None = flag(
        None,
        "torch.compile each transformer block in place (fuses the elementwise work; the first "
        "step compiles). Default: on where it was measured to win (our model on a CPU with a C++ "
        "compiler, a run of 100 steps or more, which pays the first step's compile back; "
        "not with pipeline, tensor or sequence parallelism, activation checkpointing or "
        "parameter offload); --no-compile turns it off",
    )
    hold_weights: str = flag(
        "auto",
        "ZeRO-3 and FSDP2: keep the weights gathered across the micro-steps of a step (ZeRO-3: "
        "the whole model under the persistence threshold; FSDP2: the last micro-step's weights "
        "and whole gradients). auto: on a CPU with every rank on one host, when what is held "
        "fits a quarter of the host's memory",
        choices=["auto", "on", "off"],
    )
    zero3_whole_blocks: str = flag(
        "auto",
        "ZeRO-3: gather and release each transformer block as one unit (one pair of hooks, not "
        "one per layer). auto: on a CPU, not with parameters on NVMe",
        choices=["auto", "on", "off"],
    )
    grad_sum: str = flag(
        "auto",
        "ZeRO-1/2: sum gradients across ranks over a loss divided by the world, instead of "
        "DeepSpeed dividing every reduce bucket (the same gradients). auto: on a CPU, not fp16, "
        "TP/SP or a config naming gradient_allreduce_op",
        choices=["auto", "off"],
    )
    shm_collectives: str = flag(
        "auto",
        "DeepSpeed's and FSDP2's collectives through DeepSpeed's shared-memory kernel instead of "
        "gloo. auto: every rank on one CPU host, when the kernel loads",
        choices=["auto", "off"],
    )
    cpu_malloc: str = flag(
        "tuned",
        "tuned: glibc keeps freed blocks up to 32 MiB on its heap between steps (CPU); "
        "default: glibc's own settings",
        choices=["tuned", "default"],
    )
    attention: str = flag(
        "auto",
        "attention kernel of our model: SDPA; softmax(QK^T)V written out (faster on CPUs at "
        "short sequences); or flash: SDPA's forward with zerostack's CPU backward (built on first "
        "use; needs a C++ compiler and AMX). auto, on a CPU: flash where the host runs it and "
        "--seq-len is a multiple of 64, else explicit up to --seq-len 512, then sdpa; sdpa on "
        "GPUs",
        choices=["auto", "sdpa", "explicit", "flash"],
    )
    doc_mask: bool = flag(
        False,
        "document-aware packing: attention stays inside each document of a window (documents end "
        "at the data's EOS) and positions restart per document; chat data: several whole "
        "examples packed per sample; our model only, no pipeline",
    )
    lora: str | None = flag(
        None,
        "train LoRA adapters (peft) on a frozen --model FOLDER: r=16,alpha=32,dropout=0.05,"
        "targets=q_proj,v_proj (every key optional; 'default' for all defaults; targets default "
        "to every attention and MLP projection); deepspeed ZeRO 0-3 or ddp",
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
        None,
        "overrides the config's bf16/fp16 sections; auto: bf16 where it is fast (a GPU that "
        "supports it, else fp16; a CPU where bf16 measured at least as fast as fp32, else fp32)",
        choices=["auto", "bf16", "fp16", "fp32"],
    )
    stop_at: int | None = flag(
        None, "save and exit after this step (the schedule still spans --steps)"
    )
    profile: str | None = flag(
        None,
        "FIRST:LAST: run the torch profiler over these steps (e.g. 5:8); RUN/profile/ gets where "
        "the time went by kind of work, per rank, the op table and a Chrome trace",
    )
    resume: str = flag(
        "auto", "auto | never | a run or checkpoint folder", aliases=["--resume_from_checkpoint"]
    )
    universal: str = flag(
        "auto",
        "resume through a universal checkpoint: auto (when world size, ZeRO stage, or pipeline, "
        "tensor- or sequence-parallel sizes differ from the checkpoint's), always, or never "
        "(refuse such a resume)",
        choices=["auto", "always", "never"],
    )
    peak_tflops: float | None = flag(
        None,
        "per-rank peak for MFU (default: a GPU's vendor peak, else measured by every run on all ranks)",
    )
    wandb: bool = flag(
        False, "also log to Weights & Biases (offline works; needs `pip install wandb`)"
    )
    report_to: str | None = flag(
        None,
        "HF Trainer's spelling: wandb or all = --wandb; tensorboard or none = no W&B "
        "(metrics.jsonl and TensorBoard files are always written)",
        choices=["wandb", "tensorboard", "all", "none"],
        aliases=["--report_to"],
    )
    wandb_project: str | None = flag(None, "W&B project (default zerostack)")
    run_name: str | None = flag(
        None, "the run's name in W&B (default: the --out folder's name)", aliases=["--run_name"]
    )
    dist_timeout: float = flag(
        600.0, "seconds before a collective gives up (a hung rank is named after this)"
    )
    host_mem_gib: float | None = flag(
        None,
        "plan for this much host memory (GiB) instead of the machine's (the memory plan and the "
        "switches that must fit a quarter of it)",
    )
    device_mem_gib: float | None = flag(
        None, "plan for this much memory per GPU (GiB) instead of the device's"
    )
    force: bool = flag(
        False,
        "start even when the memory plan (python -m training.memory_plan) says the run does not "
        "fit this machine's memory or disk",
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
        p = parser()
        values = vars(p.parse_args(argv))
        if values["report_to"] in ("wandb", "all"):
            values["wandb"] = True
        elif values["report_to"] and values["wandb"]:
            p.error(f"--report_to {values['report_to']} contradicts --wandb: give one of them")
        return cls(**values)

    def as_flags(self) -> dict:
        """{flag dest: value}: what resolved_config.json records and the config rule reads."""
        return asdict(self)


def parser() -> argparse.ArgumentParser:
    """The command line of training/train.py, generated from `Settings`."""
    p = argparse.ArgumentParser(
        description="Train a causal LM with DeepSpeed, DDP or FSDP2.", allow_abbrev=False
    )
    types = typing.get_type_hints(Settings)
    for f in fields(Settings):
        meta, kind = f.metadata, _base_type(types[f.name])
        names = [f"--{f.name.replace('_', '-')}", *meta["aliases"]]
        kw: dict = {"dest": f.name, "help": argparse.SUPPRESS if meta["hidden"] else meta["help"]}
        if f.default is MISSING:
            kw["required"] = True
        else:
            kw["default"] = f.default
        if kind is bool:
            # a switch; a default of True or None ("decided later") also gets its --no- form
            kw["action"] = "store_true" if f.default is False else argparse.BooleanOptionalAction
        else:
            kw["type"] = kind
            if meta["choices"]:
                kw["choices"] = meta["choices"]
        if f.name == "ds_config":
            kw["action"] = _OneConfig
        p.add_argument(*names, **kw)
    # DeepSpeed's own form (deepspeed.add_config_arguments, Megatron-DeepSpeed): `--deepspeed`
    # as a switch beside `--deepspeed_config X`, or `--deepspeed X` naming the file.
    p.add_argument(
        "--deepspeed",
        dest="ds_config",
        nargs="?",
        const=None,
        default=argparse.SUPPRESS,
        action=_OneConfig,
        help="DeepSpeed's spelling: a switch (the config comes from --deepspeed_config) or the "
        "config file itself",
    )
    return p


class _OneConfig(argparse.Action):
    """The config file, under any of its spellings; two different files is an error, not a
    silent "last one wins"."""

    def __call__(self, parser, namespace, value, option_string=None):
        if value is None:  # the bare `--deepspeed` switch
            return
        given = getattr(namespace, self.dest, None)
        if given is not None and given != value:
            parser.error(f"{option_string} {value}: the DeepSpeed config is already {given}")
        setattr(namespace, self.dest, value)


def auto_unless(blockers, on_why: str) -> tuple[bool, str]:
    """A switch's "auto" made concrete: off with the first (condition, why) in `blockers` that
    holds, else on; returns (on, "auto: why")."""
    for blocked, why in blockers:
        if blocked:
            return False, f"auto: {why}"
    return True, f"auto: {on_why}"


def _base_type(t) -> type:
    """int | None -> int."""
    args = [a for a in typing.get_args(t) if a is not type(None)]
    return args[0] if args else t
