"""zerostack's train entry point.

    deepspeed --num_gpus 2 training/train.py --ds_config ds_configs/zero2.json \
        --data DATA_DIR --model small --out runs/small
    torchrun --nproc_per_node 2 training/train.py --backend ddp --data DATA_DIR --out runs/ddp

parse the flags (settings/flags.py) -> check everything that can be checked before any work
(preflight/) -> train under guard.py, which turns how the run ended into its exit code
(errors.py: 0 done, 2 bad input, 3 diverged, 4 lost a rank, 5 could not save, 75 preempted).
Training: the process group and the resume plan verified by all ranks (startup.py), the model
built for its engine, the engine, the data restored to where the checkpoint left it, the run's
record (record.py), the loop. docs/architecture.md draws the layers.
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from data import BatchLoader, DataError, TokenDataset, open_split
from models import (
    PRESETS,
    ModelError,
    compile_blocks,
    flops_per_token,
    set_attention_kernel,
    set_document_mask,
)
from models.hub import resolve_pretrained
from models.lora import apply_lora
from training.checkpoints.weights import folder_weights
from training.engines import Engine, build_engine
from training.engines.construct import build_for_engine
from training.errors import CheckpointError, ConfigError
from training.guard import refused, run_guarded
from training.loop import Evaluator, LoopConfig, LoopState, RunLogger, Saver, run
from training.loop.followups import Followups
from training.loop.loop import LiveCeiling
from training.loop.profile import StepProfiler, parse_span
from training.loop.restore import restore
from training.preflight import Prepared, prepare_run
from training.record import (
    banner,
    describe_ranks,
    resumed,
    run_record,
    trainer_facts,
    write_record,
)
from training.runtime import distributed, signals
from training.runtime.distributed import DistInfo
from training.runtime.flops import DTYPES, ceiling_drift, model_shapes, run_ceiling
from training.settings import nvme
from training.settings.flags import Settings, parser
from training.startup import Started, give_back_untouched, start

__all__ = ["Settings", "main", "parser"]


def main(argv: list[str] | None = None) -> int:
    settings = Settings.parse(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        prepared = prepare_run(settings, world, rank)
    except (ConfigError, DataError, ModelError, CheckpointError) as e:
        return refused(e, rank, world)  # rank 0 speaks for all, a stray rank for itself
    return run_guarded(
        lambda: train(settings, prepared), rank=rank, world=world, run_dir=settings.out
    )


def train(settings: Settings, prepared: Prepared) -> int:
    """Every rank: train as the settings and the preflight's findings say."""
    run_dir = Path(settings.out)
    started = start(settings, prepared, run_dir)
    dist, prepared = started.dist, started.prepared  # its precision settled
    done = started.resume.trainer_state()["step"] if started.resume else 0
    if done >= settings.steps:  # a launch that changes nothing rewrites nothing of the run
        if dist.is_main:
            print(f"already trained {done} steps (--steps {settings.steps}); nothing to do")
        give_back_untouched()
        distributed.teardown()
        return 0
    torch.manual_seed(settings.seed)  # same initial weights on every rank, before the model exists
    engine, facts = build(settings, prepared, started)
    loader, val_ds = make_loaders(settings, prepared, engine)
    resume = started.resume
    state = restore(resume, engine, loader, dist.rank, dist.world) if resume else LoopState()
    dtype = DTYPES[prepared.precision]
    # Measured by all ranks at once, on this model's matmul shapes (runtime/flops.py): at the
    # start, where a CPU chose its precision by it, else now.
    shapes = model_shapes(facts["model_config"], prepared.micro_batch * settings.seq_len)
    ceiling = run_ceiling(dist.device, dtype, shapes, settings.peak_tflops, started.probed)
    record = run_record(
        flags={**settings.as_flags(), **prepared.effective_flags, "attention": prepared.attention},
        prepared=prepared,
        facts=facts,
        engine=engine,
        dist=dist,
        ranks=describe_ranks(dist, loader, engine.coordinates()),
        shm=started.shm,
        accelerate_state=started.accelerate,
        resume=resume,
        ceiling=ceiling,
    )
    logger = open_logger(settings, prepared, record, engine.dp_world, state.step, started)
    choice = prepared.precision_choice
    logger.log(
        {"kind": "precision", "step": state.step, **choice.as_record(), "note": choice.line()}
    )
    first = {"kind": "ceiling", "when": "start", "step": state.step, **ceiling.as_record()}
    logger.log({**first, "note": ceiling.describe(dtype)})

    def reprobe() -> float:  # all ranks at once, as at the start
        return run_ceiling(dist.device, dtype, shapes).per_rank * dist.world

    followups = start_followups(prepared, dist, run_dir, logger, settings.keep_last)
    last_eval = train_loop(
        Training(
            settings=settings,
            prepared=prepared,
            engine=engine,
            loader=loader,
            val_ds=val_ds,
            state=state,
            dist=dist,
            logger=logger,
            run_dir=run_dir,
            record=record,
            reprobe=reprobe if ceiling.measured else None,
            followups=followups,
        )
    )
    # Probe again: a host that changed speed during the run makes its MFU an interval.
    drift = None if signals.current().honored else ceiling_drift(ceiling, dist.device, dtype)
    if drift:
        logger.log({**drift, "step": state.step})
    if dist.is_main and last_eval:
        (run_dir / "final_eval.json").write_text(json.dumps({"step": state.step, **last_eval}))
    # Free the engine (DDP's reducer holds the process group) while the group is alive: freed
    # after destroy_process_group, gloo's destructor has been seen to deadlock at exit.
    del engine, loader
    gc.collect()
    nvme.remove_swap(started.ds_config, run_dir, dist.rank)  # the engine's swap files are dead
    distributed.teardown()
    if followups is not None and not signals.current().honored:
        # rank 0 waits alone, the group gone: no peer held in a collective; a SIGTERM ends it
        followups.finish(lambda: signals.current().requested)
    logger.close()
    return 0


def open_logger(
    settings: Settings, prepared: Prepared, record: dict, dp_world: int, step: int, started
) -> RunLogger:
    """Rank 0's logger (the others' log nothing), the run's record written, and the banner."""
    run_dir, is_main = Path(settings.out), started.dist.is_main
    logger = RunLogger(
        run_dir,
        is_main,
        settings.steps,
        step,
        wandb=settings.wandb,
        wandb_project=settings.wandb_project,
        run_name=settings.run_name,
        config=record,
    )
    if is_main:
        write_record(run_dir, record, prepared.manifest)
        batch = (prepared.micro_batch, prepared.grad_accum, dp_world, settings.seq_len)
        logger.console(banner(record, batch) + resumed(started.resume))
    return logger


def build(settings: Settings, prepared: Prepared, started: Started) -> tuple[Engine, dict]:
    """The model, built as its engine will hold it, wrapped in that engine. Returns the engine
    and what the record keeps of the model (parameter count, FLOPs per token, config)."""
    dist = started.dist
    model = build_for_engine(
        settings.model,
        vocab_size=prepared.manifest.vocab_size,
        backend=settings.backend,
        ds_config=started.ds_config,
        overrides=prepared.model_overrides,
        keep_freed=prepared.switches.keep_freed_memory,
    )
    attention = prepared.attention  # picked in preflight
    set_attention_kernel(model, attention)  # the pipeline engine sets its own layers' kernel
    if settings.doc_mask:  # documents end at EOS in the prepared data (data/shards.py)
        set_document_mask(model, prepared.manifest.eos_id)
    if prepared.activation_checkpointing:  # the flag, or the config's section
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if prepared.lora is not None:  # frozen base, fresh adapters: what the engine trains
        model = apply_lora(model, prepared.lora, settings.seed)
    compiled = None
    if prepared.compile:  # in place: parameter names and checkpoints are unchanged
        n, what = compile_blocks(model)
        compiled = f"{n} x {what}" if n > 1 else what
    n_params = sum(getattr(w, "ds_numel", w.numel()) for w in model.parameters())
    facts = {
        "n_params": n_params,
        "flops_per_token": flops_per_token(model.config, settings.seq_len, n_params=n_params),
        "model_config": model.config,
        "compiled": compiled,  # "6 x Block": what torch.compile compiles (--compile)
        "trainable_params": sum(
            getattr(w, "ds_numel", w.numel()) for w in model.parameters() if w.requires_grad
        ),
    }
    engine = build_engine(
        settings.backend,
        model=model,
        ds_config=started.ds_config,
        optimizer=prepared.optimizer,  # flag given > ds_config > default (settings/hparams.py)
        device=dist.device,
        precision=prepared.precision,
        attention=attention,
        ddp_bucket_mb=settings.ddp_bucket_mb,
        fsdp_reshard_after_forward=settings.fsdp_reshard_after_forward,
        fsdp_cpu_offload=settings.fsdp_cpu_offload,
        hold_weights=prepared.switches.hold_weights,
        zero3_whole_blocks=prepared.switches.zero3_whole_blocks,
        grad_sum=prepared.switches.grad_sum,
    )
    del model  # the pipeline engine keeps only its stage's layers: free the rest
    imported = settings.model not in PRESETS and prepared.lora is None  # LoRA: no masters
    if started.resume is None and prepared.precision != "fp32" and imported:
        # Continued pretraining starts from the folder's exact weights, not their 16-bit copy.
        engine.set_master_weights(folder_weights(resolve_pretrained(settings.model)))
    return engine, facts


def start_followups(prepared: Prepared, dist: DistInfo, run_dir: Path, logger, keep_last: int):
    """Rank 0's background work on sealed checkpoints (None elsewhere, or when none is asked),
    started on what a stopped or killed run left undone on its latest checkpoint."""
    if not (dist.is_main and prepared.followups):
        return None
    followups = Followups(
        run_dir, list(prepared.followups), logger, prepared.schedule.total, keep_last
    )
    followups.catch_up()
    return followups


def make_loaders(
    settings: Settings, prepared: Prepared, engine: Engine
) -> tuple[BatchLoader, TokenDataset]:
    """The training reader, sharded over the data-parallel replicas, and the validation set
    (for a mixture `--data A:0.7,B:0.3`, data.Mixture of the folders)."""
    pack = settings.doc_mask  # chat data: several examples a sample, kept apart by the mask
    train_ds = open_split(settings.data, "train", settings.seq_len, pack)
    loader = BatchLoader(
        train_ds, prepared.micro_batch, engine.dp_rank, engine.dp_world, settings.seed
    )
    return loader, open_split(settings.data, "val", settings.seq_len, pack)


@dataclass(frozen=True, kw_only=True)
class Training:
    """What the loop runs with, once everything it needs is built."""

    settings: Settings
    prepared: Prepared
    engine: Engine
    loader: BatchLoader
    val_ds: TokenDataset
    state: LoopState
    dist: DistInfo
    logger: RunLogger
    run_dir: Path
    record: dict  # resolved_config.json's content
    reprobe: Callable[[], float] | None  # the matmul ceiling again (None: it was not measured)
    followups: Followups | None = None  # rank 0's background work on sealed checkpoints


def train_loop(t: Training) -> dict:
    """The loop, with its saver and evaluator; returns the last evaluation."""
    settings, prepared, engine, dist, run_dir = t.settings, t.prepared, t.engine, t.dist, t.run_dir
    loader, logger, record = t.loader, t.logger, t.record
    micro, accum = prepared.micro_batch, prepared.grad_accum
    config = LoopConfig(
        schedule=prepared.schedule,
        grad_accum=accum,
        tokens_per_step=micro * accum * engine.dp_world * settings.seq_len,
        log_every=settings.log_every,
        eval_every=settings.eval_every,
        save_every=settings.save_every,
        stop_at=settings.stop_at,
        max_bad_steps=settings.max_bad_steps,
        flops_per_token=record["flops_per_token"],
        ceiling=LiveCeiling(record["peak_flops_per_rank"] * dist.world, t.reprobe, dist.world),
        compiled=record["compiled"],
        token_weighted=getattr(loader.dataset, "masked", False),
        eval_on_start=settings.eval_on_start,
        profiler=StepProfiler(
            parse_span(settings.profile), run_dir / "profile", dist.is_main, dist.device.type
        )
        if settings.profile
        else None,
    )
    saver = Saver(
        engine,
        loader,
        logger,
        root=run_dir / "checkpoints",
        keep_last=settings.keep_last,
        world=dist.world,
        is_main=dist.is_main,
        run_facts=trainer_facts(record),
        async_save=settings.async_save,
        device=dist.device,
        followups=t.followups,
    )
    evaluator = Evaluator(
        engine,
        t.val_ds,
        micro_batch=micro,
        max_samples=settings.eval_samples,
        device=dist.device,
        logger=logger,
    )
    return run(
        engine,
        loader,
        t.state,
        config,
        device=dist.device,
        logger=logger,
        saver=saver,
        evaluator=evaluator,
    )


def cli() -> None:
    """The `zerostack-train` command and `training/train.py` run as a script: main's exit code,
    through distributed.exit_process (it leaves without the interpreter's finalization)."""
    distributed.exit_process(main())


if __name__ == "__main__":
    cli()
