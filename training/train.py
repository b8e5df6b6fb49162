"""zerostack's train entry point.

    deepspeed --num_gpus 2 training/train.py --ds_config ds_configs/zero2.json \
        --data DATA_DIR --model small --out runs/small
    torchrun --nproc_per_node 2 training/train.py --backend ddp --data DATA_DIR --out runs/ddp

Settings: the DeepSpeed JSON gives the batch triplet, precision, ZeRO stage and clipping; the
flags --micro-batch, --grad-accum, --global-batch and --grad-clip override those keys; every
"auto" is then resolved (training/config.py). Re-running with the same --out resumes from the
latest complete checkpoint; when the checkpoint was saved on another world size, ZeRO stage or
pipeline layout, through a universal copy made beside it (training/universal.py, --universal).
How a run ends is its exit code (training/exits.py): 0 done, 2 bad input, 3 diverged, 4 lost a
rank, 5 could not save, 75 preempted (checkpoint saved).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script by the launchers: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

REPO = Path(__file__).resolve().parent.parent


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Train a causal LM with DeepSpeed, DDP or FSDP2.")
    a = p.add_argument
    a("--backend", choices=["deepspeed", "ddp", "fsdp"], default="deepspeed")
    a(
        "--ds_config",
        "--ds-config",
        "--deepspeed_config",
        dest="ds_config",
        default=None,
        help="DeepSpeed JSON (default ds_configs/zero2.json; ddp/fsdp read its batch, precision "
        "and clipping, default ds_configs/zero0.json)",
    )
    a("--data", required=True, help="a folder written by `python -m data.prepare`")
    a("--model", default="small", help="preset name, or a local HF model folder")
    a("--out", required=True, help="run folder (resumes if it holds checkpoints)")
    a("--seq-len", type=int, default=256)
    a("--steps", type=int, default=200, help="optimizer steps in total")
    a("--micro-batch", type=int, default=None, help="overrides train_micro_batch_size_per_gpu")
    a("--grad-accum", type=int, default=None, help="overrides gradient_accumulation_steps")
    a("--global-batch", type=int, default=None, help="overrides train_batch_size")
    a("--grad-clip", type=float, default=None, help="overrides gradient_clipping")
    a("--lr", type=float, default=1e-3)
    a("--min-lr-ratio", type=float, default=0.1)
    a("--warmup", type=int, default=20)
    a("--weight-decay", type=float, default=0.1)
    a("--beta1", type=float, default=0.9)
    a("--beta2", type=float, default=0.95)
    a("--eps", type=float, default=1e-8)
    a("--seed", type=int, default=1234)
    a("--log-every", type=int, default=10)
    a("--eval-every", type=int, default=100, help="0: only at the end")
    a("--eval-samples", type=int, default=64, help="validation windows per evaluation")
    a("--save-every", type=int, default=100, help="0: only at the end; -1: never")
    a("--keep-last", type=int, default=3)
    a("--activation-checkpointing", action="store_true")
    a(
        "--compile",
        action="store_true",
        help="torch.compile the model in place (fuses the elementwise work; first steps compile)",
    )
    a(
        "--attention",
        choices=["auto", "sdpa", "explicit"],
        default="auto",
        help="attention kernel of our model: SDPA, or softmax(QK^T)V written out (faster on CPUs "
        "at short sequences); auto: explicit on a CPU up to --seq-len 512, else sdpa",
    )
    a(
        "--pipeline-stages",
        type=int,
        default=None,
        help="overrides pipeline.stages (deepspeed: the model cut into this many stages; the "
        "ranks left over are data-parallel replicas)",
    )
    a(
        "--pipeline-partition",
        choices=["parameters", "blocks", "uniform"],
        default=None,
        help="overrides pipeline.partition: balance the stages by parameters, by transformer "
        "blocks, or by layer count",
    )
    a(
        "--fsdp-reshard-after-forward",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fsdp: free each block's gathered weights after its forward and gather them again "
        "for backward (less memory, one more all-gather per block)",
    )
    a(
        "--fsdp-cpu-offload",
        action="store_true",
        help="fsdp: keep parameter shards, gradients and the optimizer step in host memory",
    )
    a(
        "--ddp-bucket-mb",
        type=float,
        default=None,
        help="ddp: gradient all-reduce bucket size in MB (default 25)",
    )
    a(
        "--nvme-path",
        default=None,
        help="local disk folder for ZeRO-Infinity swap files (configs offloading to nvme, "
        "e.g. ds_configs/zero3_nvme.json; default RUN/nvme_swap)",
    )
    a(
        "--precision",
        choices=["bf16", "fp16", "fp32"],
        default=None,
        help="ddp/fsdp only; overrides what the config says",
    )
    a(
        "--stop-at",
        type=int,
        default=None,
        help="save and exit after this step (the schedule still spans --steps)",
    )
    a("--resume", default="auto", help="auto | never | a run or checkpoint folder")
    a(
        "--universal",
        choices=["auto", "always", "never"],
        default="auto",
        help="resume through a universal checkpoint: auto (when world size, ZeRO stage or "
        "pipeline stages differ from the checkpoint's), always, or never (refuse such a resume)",
    )
    a(
        "--peak-tflops",
        type=float,
        default=None,
        help="per-rank peak for MFU (default: measured once and cached)",
    )
    a("--wandb", action="store_true", help="also log to Weights & Biases (offline works)")
    a(
        "--dist-timeout",
        type=float,
        default=600.0,
        help="seconds before a collective gives up (a hung rank is named after this)",
    )
    a(
        "--max-bad-steps",
        type=int,
        default=5,
        help="stop after this many consecutive steps with a non-finite loss or gradient norm "
        "(bf16/fp32; each is skipped on every rank)",
    )
    a("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


@dataclass
class Settings:
    """The flags, typed; the loop and engines read it."""

    backend: str
    ds_config: str | None
    data: str
    model: str
    out: str
    seq_len: int
    steps: int
    micro_batch: int | None
    grad_accum: int | None
    global_batch: int | None
    grad_clip: float | None
    lr: float
    min_lr_ratio: float
    warmup: int
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    seed: int
    log_every: int
    eval_every: int
    eval_samples: int
    save_every: int
    keep_last: int
    activation_checkpointing: bool
    compile: bool
    attention: str
    pipeline_stages: int | None
    pipeline_partition: str | None
    fsdp_reshard_after_forward: bool
    fsdp_cpu_offload: bool
    ddp_bucket_mb: float | None
    nvme_path: str | None
    precision: str | None
    stop_at: int | None
    resume: str
    universal: str
    peak_tflops: float | None
    wandb: bool
    dist_timeout: float
    max_bad_steps: int
    local_rank: int | None


def prepare_run(s: Settings, world: int, rank: int = 0):
    """Everything that can be checked before any process group or model exists.
    Returns (resolved ds config, data manifest, model config, resume target, config path); the
    resume target is None or (checkpoint root, tag, whether to go through a universal copy)."""
    from data import load_manifest
    from training import checkpoint, cluster, config, nvme
    from training.distributed import accelerator

    if s.steps < 1:
        raise config.ConfigError(f"--steps must be at least 1, got {s.steps}")
    if s.seq_len < 2:
        raise config.ConfigError(f"--seq-len must be at least 2, got {s.seq_len}")
    _check_flags_and_env(s, world)
    default_cfg = "zero2.json" if s.backend == "deepspeed" else "zero0.json"
    cfg_path = cluster.accelerate_ds_config(s.ds_config) or str(REPO / "ds_configs" / default_cfg)
    raw = config.load_json(cfg_path)
    manifest = load_manifest(s.data)
    model_cfg = _model_config(s.model, manifest.vocab_size)
    if s.attention == "explicit" and model_cfg.model_type not in ("zerostack", "llama"):
        raise config.ConfigError(
            f"--attention explicit: {s.model} is a {model_cfg.model_type} model; the explicit "
            "kernel is our model's (presets, our exports, Llama folders). Drop the flag"
        )
    raw = nvme.override_path(raw, s.nvme_path, cfg_path)
    flags = {**vars(s), **nvme.auto_values(s.nvme_path, Path(s.out), model_cfg)}
    ds_cfg = config.resolve(
        raw,
        world=world,
        flags=flags,
        hidden_size=model_cfg.hidden_size,
        source=cfg_path,
        device_type=accelerator().device_name(),
    )
    if s.backend == "deepspeed" and nvme.nvme_sections(ds_cfg):
        nvme.check_aio(cfg_path)
    prec = s.precision or config.precision(ds_cfg)
    if s.backend == "deepspeed" and prec == "fp16":
        acc = accelerator()
        if not acc.is_fp16_supported():
            raise config.ConfigError(
                f"{cfg_path}: fp16 is not supported on this device ({acc.device_name()}: no "
                "fp16 kernels); use a bf16 config such as ds_configs/zero2.json, or fp32.json"
            )
    if s.backend != "deepspeed" and config.pipeline_stages(ds_cfg) > 1:
        raise config.ConfigError(f"{cfg_path}: pipeline configs need --backend deepspeed")
    _check_pipeline(s, model_cfg, config.pipeline_stages(ds_cfg), cfg_path)
    for flag, given, needs in (
        ("--no-fsdp-reshard-after-forward", not s.fsdp_reshard_after_forward, "fsdp"),
        ("--fsdp-cpu-offload", s.fsdp_cpu_offload, "fsdp"),
        ("--ddp-bucket-mb", s.ddp_bucket_mb is not None, "ddp"),
    ):
        if given and s.backend != needs:
            raise config.ConfigError(f"{flag} needs --backend {needs} (got --backend {s.backend})")
    if s.ddp_bucket_mb is not None and s.ddp_bucket_mb <= 0:
        raise config.ConfigError(f"--ddp-bucket-mb must be positive, got {s.ddp_bucket_mb}")
    if getattr(model_cfg, "vocab_size", manifest.vocab_size) < manifest.vocab_size:
        raise config.ConfigError(
            f"--model {s.model}: its vocabulary has {model_cfg.vocab_size} tokens but the data in "
            f"{s.data} uses {manifest.vocab_size}; prepare the data with that model's tokenizer"
        )
    resume = checkpoint.resolve_resume(s.resume, Path(s.out))
    existing = checkpoint.find_latest(Path(s.out) / "checkpoints")
    if s.resume == "never" and existing:
        raise checkpoint.CheckpointError(
            f"--resume never, but {s.out} already holds checkpoints (latest {existing}) that "
            "training from scratch would overwrite; pick another --out or use --resume auto"
        )
    if resume is not None:
        resume = _plan_with_fallback(s, ds_cfg, world, rank, *resume)
    return ds_cfg, manifest, model_cfg, resume, cfg_path


def _plan_with_fallback(s: Settings, ds_cfg: dict, world: int, rank: int, root: Path, tag: str):
    """(root, tag, through a universal copy?) for the checkpoint to resume from. With --resume
    auto, a checkpoint whose trainer state will not load gives way to the next older one."""
    from training import checkpoint

    older = [t for t in reversed(checkpoint.complete_tags(root)) if t < tag]
    candidates = [tag, *older] if s.resume == "auto" else [tag]
    for t in candidates[:-1]:
        try:
            checkpoint.load_trainer_state(root, t)
        except Exception as e:  # damaged beyond unpickling
            if rank == 0:
                warning = f"warning: {root / t}: unreadable trainer state ({e})"
                print(f"{warning}; trying the previous checkpoint", file=sys.stderr)
            continue
        return root, t, _plan_resume(s, ds_cfg, world, rank, root, t)
    return root, candidates[-1], _plan_resume(s, ds_cfg, world, rank, root, candidates[-1])


def _plan_resume(s: Settings, ds_cfg: dict, world: int, rank: int, root: Path, tag: str) -> bool:
    """Decide whether checkpoint root/tag loads natively or through a universal copy. Its files
    are checked against their checksums once the process group is up (training/integrity.py)."""
    from training import checkpoint, config, universal

    try:
        saved = checkpoint.load_trainer_state(root, tag)
    except Exception as e:  # damaged beyond unpickling
        raise checkpoint.CheckpointError(f"{root / tag}: unreadable trainer state ({e})") from None
    now = universal.Topology(
        s.backend, world, config.zero_stage(ds_cfg), config.pipeline_stages(ds_cfg)
    )
    use = universal.plan(saved, now, s.universal)
    if use and not os.access(root, os.W_OK) and not universal.is_ready(root, tag):
        raise checkpoint.CheckpointError(
            f"{root / tag}: resuming on {now} needs a universal copy beside it, and {root} is "
            "not writable; copy the checkpoint somewhere writable and --resume from there"
        )
    return use


def _check_pipeline(s: Settings, model_cfg, stages: int, cfg_path: str) -> None:
    """Pipelining cuts our model (a preset, our folder or a Llama folder) between its blocks."""
    from models import ModelError
    from training.config import ConfigError

    if stages <= 1:
        return
    kind = getattr(model_cfg, "model_type", "?")
    if kind not in ("zerostack", "llama"):
        raise ModelError(
            f"--model {s.model}: pipelining needs our model (a preset, a zerostack folder or a "
            f"Llama folder); this is a {kind!r} model, which cannot be cut into stages. Use a "
            "non-pipeline config such as ds_configs/zero1.json"
        )
    if s.compile:
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


def _check_flags_and_env(s: Settings, world: int) -> None:
    """Flags with impossible values and a launcher environment that is only half there."""
    from training.config import ConfigError

    for flag, value, ok, need in (
        ("--lr", s.lr, s.lr >= 0, "0 or more"),
        ("--dist-timeout", s.dist_timeout, s.dist_timeout > 0, "positive (seconds)"),
        ("--max-bad-steps", s.max_bad_steps, s.max_bad_steps >= 1, "at least 1"),
        ("--save-every", s.save_every, s.save_every >= -1, "-1 (never), 0 (at the end) or more"),
    ):
        if not ok:
            raise ConfigError(f"{flag} must be {need}, got {value}")
    out = Path(s.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a folder")
    env = os.environ
    launched = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k in env]
    if launched and len(launched) < 4:
        missing = sorted({"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"} - set(launched))
        raise ConfigError(
            f"the environment sets {', '.join(launched)} but not {', '.join(missing)}: start "
            "through torchrun or deepspeed, or unset them to run as a single process"
        )
    rank = int(env.get("RANK", "0"))
    if not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} is not in 0..WORLD_SIZE-1 (WORLD_SIZE={world})")


def _model_config(spec: str, vocab_size: int):
    """The model's config without building it (presets and folders), for early checks."""
    from models import ModelError, get_config

    path = Path(spec)
    if path.is_dir():
        from transformers import AutoConfig

        if not (path / "config.json").is_file():
            raise ModelError(f"--model {spec}: folder has no config.json, so it holds no model")
        return AutoConfig.from_pretrained(path)
    if "/" in spec or spec.startswith("."):
        raise ModelError(f"--model {spec}: no such folder")
    return get_config(spec, vocab_size=vocab_size)


def main(argv: list[str] | None = None) -> int:
    s = Settings(**vars(parser().parse_args(argv)))
    from data import DataError
    from models import ModelError
    from training.checkpoint import CheckpointError
    from training.config import ConfigError

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        ds_cfg, manifest, model_cfg, resume, cfg_path = prepare_run(s, world, rank)
    except (ConfigError, DataError, ModelError, CheckpointError) as e:
        if rank == 0 or not 0 <= rank < world:  # rank 0 speaks for all, a stray rank for itself
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    from training.exits import run_guarded

    return run_guarded(
        lambda: _train(s, ds_cfg, manifest, model_cfg, resume, cfg_path),
        rank=rank,
        world=world,
        run_dir=s.out,
    )


def _train(s: Settings, ds_cfg: dict, manifest, model_cfg, resume, cfg_path: str) -> int:
    import torch

    from data import BatchLoader, TokenDataset
    from models import build_model, flops_per_token, pick_attention_kernel, set_attention_kernel
    from training import checkpoint, cluster, integrity
    from training import config as C
    from training import distributed as D
    from training.engines import build_engine, data_parallel
    from training.loop import LoopState, run
    from training.metrics import RunLogger, peak_flops

    dist = D.setup(timeout_s=s.dist_timeout, local_rank_arg=s.local_rank)
    run_dir = Path(s.out)
    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    D.barrier()
    if resume is not None:  # every rank hashes a share of the files; all agree on the verdict
        root, tag = integrity.verified_resume(
            resume[:2],
            auto=s.resume == "auto",
            complete_tags=checkpoint.complete_tags,
            log=lambda m: print(m, file=sys.stderr, flush=True) if dist.is_main else None,
        )
        if tag != resume[1]:  # fell back to an older checkpoint: plan its load again
            resume = (root, tag, _plan_resume(s, ds_cfg, dist.world, dist.rank, root, tag))
    accelerate_state = cluster.align_accelerate_state(dist.backend)

    # Hands our process group to deepspeed.comm (zero.Init reads the world size from it); on one
    # CPU host its all-reduces then go through shared memory.
    shm = s.backend == "deepspeed" and D.shared_memory_all_reduce()
    load_tag = None
    if resume is not None:
        root, tag, use_universal = resume
        load_tag = tag
        if use_universal:
            from training import universal

            if dist.is_main:  # once, beside the checkpoint; the other ranks wait
                try:
                    universal.ensure(root, tag, log=lambda m: print(m, flush=True))
                except checkpoint.CheckpointError as e:  # the launcher then stops the others
                    print(f"error: {e}", file=sys.stderr, flush=True)
                    sys.exit(2)
            D.barrier()
            load_tag = universal.universal_tag(tag)
            ds_cfg = {
                **ds_cfg,
                "checkpoint": {**ds_cfg.get("checkpoint", {}), "load_universal": True},
            }

    torch.manual_seed(s.seed)  # same initial weights on every rank, before the model exists
    stage = C.zero_stage(ds_cfg)
    model = build_model(
        s.model,
        vocab_size=manifest.vocab_size,
        zero3_config=ds_cfg if (s.backend == "deepspeed" and stage == 3) else None,
    )
    s.attention = pick_attention_kernel(s.attention, dist.device.type, s.seq_len)
    set_attention_kernel(model, s.attention)  # the pipeline engine sets its layers from s
    if s.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if s.compile:
        model.compile()  # in place: parameter names and checkpoints are unchanged
    n_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
    fpt = flops_per_token(model.config, s.seq_len, n_params=n_params)
    model_config = model.config

    precision = s.precision or C.precision(ds_cfg)
    engine = build_engine(
        s.backend,
        model=model,
        ds_config=ds_cfg,
        settings=s,
        device=dist.device,
        **({} if s.backend == "deepspeed" else {"precision": precision}),
    )
    del model  # the pipeline engine keeps only its stage's layers: free the rest

    if (
        s.backend == "deepspeed"
        and resume is None
        and precision != "fp32"
        and Path(s.model).is_dir()
    ):
        from training.weights import folder_weights

        # Continued pretraining starts from the folder's exact weights, not their 16-bit copy.
        engine.set_master_weights(folder_weights(s.model))

    micro = ds_cfg["train_micro_batch_size_per_gpu"]
    accum = ds_cfg["gradient_accumulation_steps"]
    train_ds = TokenDataset(s.data, "train", s.seq_len)
    val_ds = TokenDataset(s.data, "val", s.seq_len)
    dp_rank, dp_world = data_parallel(engine, dist)  # pipeline stages of a replica share data
    loader = BatchLoader(train_ds, micro, dp_rank, dp_world, s.seed)
    state = LoopState()

    if resume is not None:
        root, tag, _ = resume
        engine.load(root, load_tag)
        ts = checkpoint.load_trainer_state(root, tag)
        state = LoopState(
            step=ts["step"],
            tokens=ts["tokens"],
            skipped=ts.get("skipped", 0),
            nonfinite=ts.get("nonfinite", 0),
        )
        loader.load_state_dict(ts["data"])
        rngs = ts.get("rng", [])
        if ts.get("world") == dist.world and dist.rank < len(rngs):
            checkpoint.set_rng_state(rngs[dist.rank])
    # Where each rank runs and what it reads first (a fresh loader: the real one is untouched).
    first_x, _ = BatchLoader(
        train_ds, micro, dist.rank, dist.world, s.seed, loader.consumed_samples
    ).next_batch()
    ranks = cluster.describe_ranks(dist.rank, dist.local_rank, first_x)

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    peak = s.peak_tflops * 1e12 if s.peak_tflops else None
    if peak is None:
        peak = D.broadcast_object(peak_flops(dist.device, dtype) if dist.is_main else None)
    peak_total = peak * dist.world

    resolved = {
        "flags": vars(s),
        "ds_config_file": cfg_path,
        "ds_config": ds_cfg,
        "model_config": model_config.to_dict(),
        "n_params": n_params,
        "flops_per_token": fpt,
        "data": {
            "dir": str(Path(s.data).resolve()),
            "source": manifest.source,
            "tokenizer_sha256": getattr(manifest, "tokenizer_sha256", None),
        },
        "world": dist.world,
        "pipeline": _pipeline_info(engine),
        "ranks": ranks,
        **({"accelerate": accelerate_state} if accelerate_state else {}),
        "backend": dist.backend,
        "shm_all_reduce": shm,
        "device": str(dist.device),
        "precision": precision,
        "peak_flops_per_rank": peak,
        "versions": _versions(),
        "git_commit": _git_commit(),
    }
    logger = RunLogger(
        run_dir,
        dist.is_main,
        s.steps,
        state.step,
        wandb=s.wandb,
        run_name=run_dir.name,
        config=resolved,
    )
    if dist.is_main:
        (run_dir / "resolved_config.json").write_text(json.dumps(resolved, indent=1, default=str))
        # The run keeps its own tokenizer copy, so exports work after the data folder moves.
        shutil.copytree(manifest.tokenizer_dir, run_dir / "tokenizer", dirs_exist_ok=True)
        how = f"ZeRO-{stage}" if s.backend == "deepspeed" else "batch and clipping"
        comm = dist.backend + (" + shm all-reduce" if shm else "")
        logger.console(
            f"zerostack: {s.backend} | {Path(cfg_path).name} ({how}) | {precision} | "
            f"world {dist.world} ({comm}) | model {s.model} {n_params / 1e6:.2f}M params | "
            f"batch {micro}x{accum}x{dp_world}x{s.seq_len} tokens"
            + (
                f" | pipeline {engine.stages} stages x {dp_world} data-parallel"
                if hasattr(engine, "stages")
                else ""
            )
            + (f" | resumed from {resume[1]}" if resume else "")
            + (f" (universal: saved on {_saved_topology(resume)})" if resume and resume[2] else "")
        )

    if state.step >= s.steps:
        logger.console(f"already trained {state.step} steps; nothing to do")
        last_eval = {}
    else:
        last_eval = run(
            engine=engine,
            loader=loader,
            val_dataset=val_ds,
            state=state,
            settings=s,
            dist=dist,
            logger=logger,
            run_dir=run_dir,
            grad_accum=accum,
            micro_batch=micro,
            flops_per_token=fpt,
            peak_flops=peak_total,
            trainer_extra={
                "seed": s.seed,
                "backend": s.backend,
                "zero_stage": stage,
                "pipeline_stages": C.pipeline_stages(ds_cfg),
                "model": s.model,
                "data_dir": str(Path(s.data).resolve()),
                "seq_len": s.seq_len,
                "model_config": model_config.to_dict(),
            },
        )
    if dist.is_main and last_eval:
        (run_dir / "final_eval.json").write_text(json.dumps({"step": state.step, **last_eval}))
    logger.close()
    # Free the engine (DDP's reducer holds the process group) while the group is alive: freed
    # after destroy_process_group, gloo's destructor has been seen to deadlock at exit.
    del engine, loader
    gc.collect()
    D.teardown()
    return 0


def _saved_topology(resume) -> str:
    from training import checkpoint, universal

    return str(universal.Topology.of_checkpoint(checkpoint.load_trainer_state(*resume[:2])))


def _pipeline_info(engine) -> dict | None:
    if not hasattr(engine, "layout"):
        return None
    return {"stages": engine.stages, "data_parallel": engine.dp_world, "layers": engine.layout()}


def _versions() -> dict:
    import deepspeed
    import torch
    import transformers

    return {
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
    }


def _git_commit() -> str | None:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        return None


if __name__ == "__main__":
    sys.exit(main())
