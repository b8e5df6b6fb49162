"""The run's configuration, one typed tree: `RunConfig` holds a frozen section per part of the
trainer (data, model, optim, checkpoint, engine, eval, followups, logging, host), and each part
is handed its own section (`build_engine(..., engine=config.engine)`, the saver the checkpoint
section, the DeepSpeed config rule the optim and engine sections).

Every field is also a flag of training/train.py: `--` plus its name with `_` as `-`, unless
`flag=` names it (`data.path` is `--data`); `aliases` adds DeepSpeed's and the HF Trainer's
spellings. Its help, its default and, for numbers, its domain are declared here and nowhere
else: the command line (flags.py), the run file (runfile.py), the range check (preflight) and
docs/settings.md are all generated from them.

The optimizer's numbers and the schedule default to None, "not given": a value given wins over
the DeepSpeed JSON's, which wins over the default the help names (settings/hparams.py).
"""

from __future__ import annotations

import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Literal

from models.lora import LoraSpec

REQUIRED = MISSING  # a field without a default is a required setting


def setting(
    default=REQUIRED,
    help: str = "",
    *,
    flag: str | None = None,
    aliases=(),
    low=None,
    high=None,
    need: str = "",
    hidden: bool = False,
    shown: str | None = None,
):
    """A field of a section, which is also a flag. `low`/`high` bound a number (None: open) and
    `need` says the domain in words, for the one-line refusal. A hidden setting is the
    launcher's: not in --help, nor in a run file. `shown`: what the default is, in words, where
    it is decided later (None: not given)."""
    meta = {"help": help, "flag": flag, "aliases": tuple(aliases), "range": (low, high, need)}
    meta["hidden"], meta["shown"] = hidden, shown
    if default is REQUIRED:
        return field(metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """What is read and how it is cut into samples."""

    path: str = setting(
        help="a folder written by `python -m data.prepare`, or a weighted mixture A:0.7,B:0.3",
        flag="data",
    )
    seq_len: int = setting(256, "tokens per sample", low=2, need="at least 2")
    doc_mask: bool = setting(
        False,
        "document-aware packing: attention stays inside each document of a window (documents end "
        "at the data's EOS) and positions restart per document; chat data: several whole "
        "examples packed per sample; our model only, no pipeline",
    )
    skip_samples: str = setting(
        "",
        "global sample positions never trained on, START:END[,START:END...] (end excluded), as a "
        "rollback records them in metrics.jsonl and skipped_data.json",
    )


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The model, as built before any engine wraps it."""

    name: str = setting(
        "small",
        "a preset (tiny, small, 125M, 350M, 760M, 1.3B, 2.7B, 7B, 13B), a local HF model folder, "
        "or a hub name (org/name[@revision], fetched into the HF cache)",
        flag="model",
    )
    lora: LoraSpec | None = setting(
        None,
        "train LoRA adapters (peft) on a frozen --model FOLDER: r=16,alpha=32,dropout=0.05,"
        "targets=q_proj,v_proj (every key optional; 'default' for all defaults; targets default "
        "to every attention and MLP projection); deepspeed ZeRO 0-3 or ddp",
    )
    attention: Literal["auto", "sdpa", "explicit", "amx", "flex"] = setting(
        "auto",
        "attention kernel of our model: SDPA; softmax(QK^T)V written out (faster on CPUs at "
        "short sequences); amx: SDPA's forward with zerostack's CPU backward (built on first "
        "use; needs a C++ compiler and AMX); or flex: FlexAttention's block mask for "
        "--doc-mask windows (GPUs only). auto, on a CPU: amx where the host runs it and "
        "--seq-len is a multiple of 64, else explicit up to --seq-len 512, then sdpa; with "
        "--doc-mask, sdpa (per document); on GPUs sdpa, flex with --doc-mask. For sdpa the run "
        "names the kernel torch's dispatcher takes on its device (flash, memory-efficient, cuDNN "
        "or math) in its banner and resolved_config.json",
    )
    qk_norm: bool = setting(
        False,
        "RMSNorm of each head's queries and keys before the rotary embedding (Qwen3's, OLMo 2's: "
        "steadier attention logits); a preset only; exports as Qwen3ForCausalLM",
    )
    z_loss: float = setting(
        0.0,
        "add this times the mean squared log of the softmax's normalizer (PaLM's z-loss, 1e-4 "
        "there) to the loss, keeping the output logits from drifting; logged as z_loss; 0: off",
        low=0,
        need="0 (off) or more",
    )
    activation_checkpointing: bool = setting(
        False,
        "recompute each block in backward (also turned on by the config's "
        "activation_checkpointing section)",
        aliases=["--gradient_checkpointing"],
    )
    compile: bool | None = setting(
        None,
        "torch.compile each transformer block in place (fuses the elementwise work; the first "
        "step compiles); --no-compile turns it off",
        shown="on where it was measured to win: our model on a CPU with a C++ compiler, a run "
        "of 100 steps or more, which pays the first step's compile back; not with pipeline, "
        "tensor or sequence parallelism, activation checkpointing or parameter offload",
    )


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """Steps, batch, the optimizer's numbers and the schedule."""

    steps: int = setting(
        200, "optimizer steps in total", aliases=["--max_steps"], low=1, need="at least 1"
    )
    micro_batch: int | None = setting(
        None,
        "overrides train_micro_batch_size_per_gpu",
        shown="the config's, else 4",
        aliases=["--per_device_train_batch_size"],
        low=1,
        need="at least 1",
    )
    grad_accum: int | None = setting(
        None,
        "overrides gradient_accumulation_steps",
        shown="the config's, else 1",
        aliases=["--gradient_accumulation_steps"],
        low=1,
        need="at least 1",
    )
    global_batch: int | None = setting(
        None,
        "overrides train_batch_size",
        low=1,
        need="at least 1",
        shown="the config's, else micro batch x accumulation x data-parallel world",
    )
    lr: float | None = setting(
        None,
        "peak learning rate",
        shown="the config's optimizer.params.lr or scheduler's warmup_max_lr, else 1e-3",
        aliases=["--learning_rate"],
        low=0,
        need="0 or more",
    )
    min_lr_ratio: float | None = setting(
        None,
        "the schedule's floor, as a fraction of --lr",
        shown="the config's cos_min_ratio, else 0.1",
        low=0,
        high=1,
        need="between 0 and 1",
    )
    schedule: Literal["cosine", "wsd"] = setting(
        "cosine",
        "the learning rate after warmup: cosine decay over the whole run, or warmup-stable-decay "
        "(wsd: the peak held until the last decay steps, which decay to the floor; a run "
        "resumed from a checkpoint of the stable phase with a new step count decays from there)",
    )
    decay_steps: int = setting(
        0,
        "wsd: the steps of the final decay (0: 20% of the steps)",
        low=0,
        need="0 or more",
    )
    decay_shape: Literal["1-sqrt", "linear", "cosine"] = setting(
        "1-sqrt",
        "wsd: the decay's shape from the peak to the floor (1-sqrt: 1 - sqrt(progress), the "
        "shape that matched cosine's final loss in Hägele et al. 2024)",
    )
    warmup: int | None = setting(
        None,
        "warmup steps",
        shown="the config's scheduler.params.warmup_num_steps, else 20",
        aliases=["--warmup_steps"],
        low=0,
        need="0 or more",
    )
    optimizer: Literal["adamw", "muon"] = setting(
        "adamw",
        "adamw: AdamW on every parameter; muon: Muon (momentum orthogonalized by Newton-Schulz) "
        "on the 2-D weight matrices inside the transformer blocks, AdamW (--lr, betas, "
        "--weight-decay) on embeddings, the lm head, norms and biases; every engine "
        "(DeepSpeed's Muon on ZeRO 0-3, ZeRO-0 in fp32 only; torch.optim.Muon on ddp and fsdp); "
        "not with offload, pipeline, tensor, sequence or expert parallelism, LoRA or a "
        "mixture-of-experts model (docs/training.md)",
    )
    muon_lr: float = setting(
        0.02,
        "--optimizer muon: Muon's peak learning rate; it follows the schedule in proportion "
        "to --lr",
        low=0,
        need="0 or more",
    )
    weight_decay: float | None = setting(
        None,
        "AdamW weight decay on matrices (with --optimizer muon also Muon's, decoupled)",
        shown="the config's optimizer.params.weight_decay, else 0.1",
        aliases=["--weight_decay"],
        low=0,
        need="0 or more",
    )
    beta1: float | None = setting(
        None,
        "AdamW beta1",
        shown="the config's optimizer.params.betas[0], else 0.9",
        aliases=["--adam_beta1"],
        low=0,
        high=0.999999,
        need="in [0, 1)",
    )
    beta2: float | None = setting(
        None,
        "AdamW beta2",
        shown="the config's optimizer.params.betas[1], else 0.95",
        aliases=["--adam_beta2"],
        low=0,
        high=0.999999,
        need="in [0, 1)",
    )
    eps: float | None = setting(
        None,
        "AdamW epsilon",
        shown="the config's optimizer.params.eps, else 1e-8",
        aliases=["--adam_epsilon"],
        low=1e-30,
        need="positive",
    )
    grad_clip: float | None = setting(
        None,
        "overrides gradient_clipping (0: no clipping)",
        shown="the config's, else 1.0",
        aliases=["--max_grad_norm"],
        low=0,
        need="0 (no clipping) or more",
    )
    seed: int = setting(
        1234,
        "the initial weights and the data order (the same on every rank)",
        low=0,
        high=2**32 - 1,
        need="in 0..2^32-1",
    )
    objective: Literal["auto", "next-token", "dpo", "ipo"] = setting(
        "auto",
        "what the loss is: next-token prediction, or on preference pairs (data.prepare of "
        "prompt/chosen/rejected rows) DPO's sigmoid loss or IPO's squared one, against the "
        "starting model's log-probs computed once (auto: dpo on pairs, else next-token)",
    )
    dpo_beta: float = setting(
        0.1,
        "the DPO family's beta (IPO's tau): how far from the starting model the policy may go",
        low=1e-6,
        need="positive",
    )
    max_bad_steps: int = setting(
        5,
        "stop after this many consecutive steps with a non-finite loss or gradient norm "
        "(bf16/fp32; each is skipped on every rank)",
        low=1,
        need="at least 1",
    )
    spike_sigmas: float = setting(
        8.0,
        "skip a step (on every rank) whose loss or gradient norm is more than this many "
        "standard deviations above its mean over the spike window's last steps; 0: off",
        low=0,
        need="0 (off) or more",
    )
    spike_window: int = setting(
        128,
        "the steps the spike guard's mean and deviation cover; it acts once half of them are in",
        low=4,
        need="at least 4",
    )
    rollback_after: int = setting(
        3,
        "this many skipped spikes or non-finite steps within the rollback window reload the last "
        "checkpoint and skip the samples those steps read; 0: never roll back",
        low=0,
        need="0 (never) or more",
    )
    rollback_window: int = setting(
        50, "the steps the rollback count covers", low=1, need="at least 1"
    )
    max_rollbacks: int = setting(
        3,
        "stop the run (exit 3) when trouble would roll it back more often than this",
        low=0,
        need="0 or more",
    )


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """When checkpoints are written, how many are kept, and what a run resumes from."""

    save_every: int = setting(
        100,
        "0: only at the end; -1: never",
        aliases=["--save_steps"],
        low=-1,
        need="-1 (never), 0 (at the end) or more",
    )
    keep_last: int = setting(
        3, "checkpoints to keep, newest first (0: keep all)", low=0, need="0 (keep all) or more"
    )
    async_save: bool = setting(
        False,
        "write checkpoints in the background: the step loop waits only for a host copy of the "
        "states; the checkpoint is sealed (complete.json, then `latest`) at a later step once "
        "every rank's files are durable (every backend; docs/checkpoints.md)",
    )
    resume: str = setting(
        "auto", "auto | never | a run or checkpoint folder", aliases=["--resume_from_checkpoint"]
    )
    universal: Literal["auto", "always", "never"] = setting(
        "auto",
        "resume through a universal checkpoint: auto (when world size, ZeRO stage, or pipeline, "
        "tensor- or sequence-parallel sizes differ from the checkpoint's), always, or never "
        "(refuse such a resume)",
    )
    allow_recipe_change: str | None = setting(
        None,
        "what a resume may change from the checkpoint's run, comma-separated: seq_len (a "
        "context extension), global_batch, data. Without it a resume that changes any of "
        "them is refused; an allowed change is recorded in the run folder",
        shown="none: the checkpoint's recipe",
    )
    stop_at: int | None = setting(
        None,
        "save and exit after this step (the schedule still spans --steps)",
        shown="none: the run's last step",
        low=1,
        need="at least 1",
    )


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """The backend, its DeepSpeed config, the precision and the parallel layout."""

    backend: Literal["deepspeed", "ddp", "fsdp"] = setting(
        "deepspeed", "the engine: DeepSpeed, or PyTorch's DDP or FSDP2 on the same model and data"
    )
    ds_config: str | dict | None = setting(
        None,
        "DeepSpeed JSON (ddp/fsdp read its batch, precision, clipping, optimizer and "
        "scheduler). Also spelled --deepspeed X and --deepspeed --deepspeed_config X; a run "
        "file may hold the JSON itself as a mapping, as RUN/run.yaml does",
        shown="ds_configs/zero2.json; ddp/fsdp: ds_configs/zero0.json",
        aliases=["--ds_config", "--deepspeed_config"],
    )
    precision: Literal["auto", "bf16", "fp16", "fp32"] | None = setting(
        None,
        "overrides the config's bf16/fp16 sections; auto: bf16 where it is fast (a GPU that "
        "supports it, else fp16; a CPU where bf16 measured at least as fast as fp32, else fp32)",
        shown="the config's (auto in the shipped configs)",
    )
    pipeline_stages: int | None = setting(
        None,
        "overrides pipeline.stages (deepspeed: the model cut into this many stages; the ranks "
        "left over are data-parallel replicas)",
        shown="the config's, else 1",
        low=1,
        need="at least 1",
    )
    pipeline_partition: Literal["parameters", "blocks", "uniform"] | None = setting(
        None,
        "overrides pipeline.partition: balance the stages by parameters, by transformer blocks, "
        "or by layer count",
        shown="the config's, else parameters",
    )
    fsdp_reshard_after_forward: bool = setting(
        True,
        "fsdp: free each block's gathered weights after its forward and gather them again for "
        "backward (less memory, one more all-gather per block)",
    )
    fsdp_cpu_offload: bool = setting(
        False, "fsdp: keep parameter shards, gradients and the optimizer step in host memory"
    )
    ddp_bucket_mb: float | None = setting(
        None,
        "ddp: gradient all-reduce bucket size in MB",
        low=1e-6,
        need="positive",
        shown="25",
    )
    nvme_path: str | None = setting(
        None,
        "local disk folder for ZeRO-Infinity swap files (configs offloading to nvme, e.g. "
        "ds_configs/zero3_nvme.json)",
        shown="RUN/nvme_swap",
    )
    dist_timeout: float = setting(
        600.0,
        "seconds before a collective gives up (a hung rank is named after this)",
        low=1e-3,
        need="positive (seconds)",
    )
    hang_factor: float = setting(
        10.0,
        "a step that runs this many times longer than the median of the last 20 (and at least "
        "the hang floor) writes every rank's Python stacks into RUN/hang/ and ends the run with "
        "exit 6, which the launch scripts restart; 0: no hang watch",
        low=0,
        need="0 (off) or more",
    )
    hang_floor_s: float = setting(
        300.0,
        "the shortest step, in seconds, that counts as hung",
        low=1e-3,
        need="positive (seconds)",
    )
    # The deepspeed launcher passes --local_rank; LOCAL_RANK in the environment wins.
    local_rank: int | None = setting(None, aliases=["--local_rank"], hidden=True)


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Validation loss during the run."""

    every: int = setting(
        100,
        "evaluate every N steps (0: only at the end)",
        flag="eval_every",
        aliases=["--eval_steps"],
        low=0,
        need="0 (only at the end) or more",
    )
    samples: int = setting(
        64, "validation windows per evaluation", flag="eval_samples", low=1, need="at least 1"
    )
    on_start: bool = setting(
        False,
        "evaluate before the first step too (step 0: the starting model's figures, e.g. a "
        "base model's before fine-tuning)",
        flag="eval_on_start",
    )


@dataclass(frozen=True, kw_only=True)
class FollowupConfig:
    """Rank 0's background work on sealed checkpoints (loop/followups.py)."""

    export_every: int = setting(
        0,
        "export the checkpoint of every N-th step (a multiple of --save-every) and the run's "
        "last to RUN/exports/step_N, a verified folder stock transformers loads, in a background "
        "process while training goes on (0: off; docs/checkpoints.md)",
        low=0,
        need="0 (off) or more",
    )
    universal_every: int = setting(
        0,
        "deepspeed: convert the checkpoint of every N-th step and the run's last to a universal "
        "copy beside it (resumable on another world size or ZeRO stage), in the background (0: "
        "off)",
        low=0,
        need="0 (off) or more",
    )
    eval_tasks: str | None = setting(
        None,
        "lm-evaluation-harness tasks, comma-separated, scored in a background process on the "
        "checkpoints --eval-tasks-every names (docs/evaluation.md)",
        shown="off; with --eval-tasks-every: the shipped offline tasks",
    )
    eval_tasks_every: int | None = setting(
        None,
        "score --eval-tasks on the checkpoint of every N-th step (a multiple of --save-every) and "
        "the run's last",
        shown="off; with --eval-tasks: every checkpoint",
        low=1,
        need="at least 1",
    )
    eval_tasks_limit: int | None = setting(
        None, "at most N items per task", low=1, need="at least 1", shown="all"
    )


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """What rank 0 reports, and where."""

    every: int = setting(
        10,
        "print and log the loss every N steps",
        flag="log_every",
        aliases=["--logging_steps"],
        low=1,
        need="at least 1",
    )
    wandb: bool = setting(
        False,
        "also log to Weights & Biases (offline works; needs `pip install wandb`); "
        "HF Trainer's --report_to wandb|all means the same",
    )
    wandb_project: str | None = setting(None, "W&B project", shown="zerostack")
    run_name: str | None = setting(
        None, "the run's name in W&B", aliases=["--run_name"], shown="the --out folder's name"
    )
    profile: str | None = setting(
        None,
        "FIRST:LAST: run the torch profiler over these steps (e.g. 5:8); RUN/profile/ gets where "
        "the time went by kind of work, per rank, the op table and a Chrome trace",
    )
    peak_tflops: float | None = setting(
        None,
        "per-rank peak for MFU",
        shown="a GPU's vendor peak, else measured by every run on all ranks",
        low=1e-9,
        need="positive",
    )


@dataclass(frozen=True, kw_only=True)
class HostConfig:
    """Tuning for the machine: how much memory to plan for, and the CPU switches."""

    host_mem_gib: float | None = setting(
        None,
        "plan for this much host memory (GiB) instead of the machine's (the memory plan and the "
        "switches that must fit a quarter of it)",
        low=1e-9,
        need="a positive number of GiB",
    )
    device_mem_gib: float | None = setting(
        None,
        "plan for this much memory per GPU (GiB) instead of the device's",
        low=1e-9,
        need="a positive number of GiB",
    )
    force: bool = setting(
        False,
        "start even when the memory plan (python -m training.memory_plan) says the run does not "
        "fit this machine's memory or disk",
    )
    hold_weights: Literal["auto", "on", "off"] = setting(
        "auto",
        "ZeRO-3 and FSDP2: keep the weights gathered across the micro-steps of a step (ZeRO-3: "
        "the whole model under the persistence threshold; FSDP2: the last micro-step's weights "
        "and whole gradients). auto: on a CPU with every rank on one host, when what is held "
        "fits a quarter of the host's memory",
    )
    zero3_whole_blocks: Literal["auto", "on", "off"] = setting(
        "auto",
        "ZeRO-3: gather and release each transformer block as one unit (one pair of hooks, not "
        "one per layer). auto: on a CPU, not with parameters on NVMe",
    )
    grad_sum: Literal["auto", "off"] = setting(
        "auto",
        "ZeRO-1/2: sum gradients across ranks over a loss divided by the world, instead of "
        "DeepSpeed dividing every reduce bucket (the same gradients). auto: on a CPU, at most 2 "
        "ranks, not fp16, TP/SP or a config naming gradient_allreduce_op",
    )
    shm_collectives: Literal["auto", "off"] = setting(
        "auto",
        "DeepSpeed's and FSDP2's collectives through DeepSpeed's shared-memory kernel instead of "
        "gloo. auto: every rank on one CPU host, when the kernel loads",
    )
    keep_freed_memory: Literal["auto", "off"] = setting(
        "auto",
        "glibc keeps freed blocks up to 32 MiB on its heap between steps, so a step does not "
        "page-fault its working set in again. auto: on a CPU; off: glibc's own settings",
    )


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Every setting of a training run, one section per part of the trainer."""

    out: str = setting(
        help="run folder (resumes if it holds checkpoints)", aliases=["--output_dir"]
    )
    data: DataConfig
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    followups: FollowupConfig = field(default_factory=FollowupConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    host: HostConfig = field(default_factory=HostConfig)


SECTIONS: dict[str, type] = {
    name: kind for name, kind in typing.get_type_hints(RunConfig).items() if name != "out"
}

# The groups of --help and docs/settings.md, in the order a user reads them: (title, sections).
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("data", ("data",)),
    ("model", ("model",)),
    ("optimization", ("optim",)),
    ("checkpoints", ("checkpoint",)),
    ("parallelism and engines", ("engine",)),
    ("evaluation and follow-up jobs", ("eval", "followups")),
    ("logging", ("logging",)),
    ("host tuning", ("host",)),
)


@dataclass(frozen=True)
class Setting:
    """One field of the tree as the command line and the run file see it."""

    section: str  # "" for the top-level `out`
    name: str  # the field's name in its section
    flag: str  # "--seq-len"
    aliases: tuple[str, ...]
    kind: object  # the field's type hint
    default: object  # REQUIRED when the setting must be given
    help: str
    range: tuple  # (low, high, need)
    hidden: bool
    shown: str | None  # the default in words, where it is decided later

    @property
    def dest(self) -> str:
        """The flag's name with `_`: argparse's dest, and the key of the run's flat record."""
        return self.flag[2:].replace("-", "_")

    @property
    def path(self) -> str:
        return f"{self.section}.{self.name}" if self.section else self.name


def settings() -> list[Setting]:
    """Every setting of the tree, `out` first, then section by section."""
    hints = {name: typing.get_type_hints(cls) for name, cls in SECTIONS.items()}
    hints[""] = typing.get_type_hints(RunConfig)
    out = []
    for section, cls in [("", RunConfig), *SECTIONS.items()]:
        for f in fields(cls):
            if section == "" and f.name != "out":
                continue
            meta = f.metadata
            name = meta["flag"] or f.name
            out.append(
                Setting(
                    section,
                    f.name,
                    f"--{name.replace('_', '-')}",
                    meta["aliases"],
                    hints[section][f.name],
                    f.default,
                    meta["help"],
                    meta["range"],
                    meta["hidden"],
                    meta["shown"],
                )
            )
    return out


def flat(config: RunConfig) -> dict:
    """{dest: value} of every setting (a LoRA spec as its text): the run record's `flags`."""
    values = {}
    for s in settings():
        value = getattr(getattr(config, s.section) if s.section else config, s.name)
        values[s.dest] = value.as_text() if isinstance(value, LoraSpec) else value
    return values


def nested(config: RunConfig) -> dict:
    """The tree as plain data, sections as mappings: what a run file holds."""
    tree: dict = {"out": config.out}
    for s in settings():
        if s.section and not s.hidden:
            value = getattr(getattr(config, s.section), s.name)
            value = value.as_text() if isinstance(value, LoraSpec) else value
            tree.setdefault(s.section, {})[s.name] = value
    return tree
