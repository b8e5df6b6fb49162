"""zerostack's train entry point.

    deepspeed --num_gpus 2 training/train.py --ds_config ds_configs/zero2.json \
        --data DATA_DIR --model small --out runs/small
    torchrun --nproc_per_node 2 training/train.py --backend ddp --data DATA_DIR --out runs/ddp

parse the run's configuration (settings/flags.py: the flags over the run file) -> check
everything that can be checked before any work (preflight/) -> train under run_exit.py, which turns how the run ended into its exit code
(errors.py: 0 done, 2 bad input, 3 diverged, 4 lost a rank, 5 could not save, 75 preempted).
Training: the process group and the resume plan verified by all ranks (startup.py), the model
built for its engine, the engine, the data restored to where the checkpoint left it, the run's
record (record.py), the loop. docs/architecture.md draws the layers.
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from data import BatchLoader, DataError, TokenDataset, open_split
from data.reader import parse_spans
from models import (
    PRESETS,
    ModelError,
    compile_blocks,
    flops_per_token,
    sdpa_backend,
    set_attention_kernel,
    set_document_mask,
    set_z_loss,
)
from models.hub import resolve_pretrained
from models.lora import apply_lora
from training.checkpoints.resume_point import ResumePlan
from training.checkpoints.weights import folder_weights
from training.engines import Engine, build_engine, replicas
from training.engines.construct import build_for_engine
from training.engines.spike_guard import SpikeGuard
from training.errors import HUNG, CheckpointError, ConfigError
from training.loop import Evaluator, LoopConfig, LoopState, RunLogger, Saver, run
from training.loop.followups import Followups
from training.loop.loop import LiveCeiling
from training.loop.profile import StepProfiler, parse_span
from training.loop.restore import restore
from training.loop.rollback import Rollback
from training.memory.peak import host_peak_bytes
from training.preflight import Prepared, prepare_run
from training.record import (
    banner,
    describe_ranks,
    resumed,
    run_record,
    trainer_facts,
    world_change,
    write_record,
)
from training.run_exit import record_ending, refused, run_guarded
from training.runtime import distributed, hang, launcher, signals
from training.runtime.distributed import DistInfo
from training.runtime.flops import DTYPES, ceiling_drift, model_shapes, run_ceiling
from training.settings import flags, nvme
from training.settings.run_config import RunConfig
from training.startup import Started, give_back_untouched, start

__all__ = ["RunConfig", "main"]


def main(argv: list[str] | None = None) -> int:
    try:
        here = launcher.read()  # srun, mpirun, torchrun, deepspeed: whichever started us
    except ConfigError as e:
        return refused(e, -1, 1)  # no rank to trust: every process says it
    world, rank = here.world, here.rank
    try:
        config = flags.parse(argv)
        prepared = prepare_run(config, world, rank)
    except (ConfigError, DataError, ModelError, CheckpointError) as e:
        return refused(e, rank, world)  # rank 0 speaks for all, a stray rank for itself
    return run_guarded(lambda: train(config, prepared), rank=rank, world=world, run_dir=config.out)


def train(config: RunConfig, prepared: Prepared) -> int:
    """Every rank: train as the configuration and the preflight's findings say."""
    run_dir = Path(config.out)
    started = start(config, prepared, run_dir)
    dist, prepared = started.dist, started.prepared  # its precision settled
    config = prepared.config  # every auto made concrete (preflight/resolved.py)
    done = started.resume.trainer_state()["step"] if started.resume else 0
    if done >= config.optim.steps:  # a launch that changes nothing rewrites nothing of the run
        if dist.is_main:
            print(f"already trained {done} steps (--steps {config.optim.steps}); nothing to do")
        give_back_untouched()
        distributed.teardown()
        return 0
    # the same initial weights on every rank, before the model exists
    torch.manual_seed(config.optim.seed)
    engine, facts = build(config, prepared, started)
    loader, val_ds = make_loaders(config, prepared, engine, started)
    resume = started.resume
    state = restore(resume, engine, loader, dist.rank, dist.world) if resume else LoopState()
    dtype = DTYPES[config.engine.precision]
    # Measured by all ranks at once, on this model's matmul shapes (runtime/flops.py): at the
    # start, where a CPU chose its precision by it, else now.
    shapes = model_shapes(facts["model_config"], prepared.micro_batch * config.data.seq_len)
    ceiling = run_ceiling(dist.device, dtype, shapes, config.logging.peak_tflops, started.probed)
    record = run_record(
        prepared=prepared,
        facts=facts,
        engine=engine,
        dist=dist,
        ranks=describe_ranks(dist, loader, engine.coordinates(), facts["built"]),
        shm=started.shm,
        accelerate_state=started.accelerate,
        resume=resume,
        ceiling=ceiling,
    )
    logger = open_logger(config, prepared, record, engine.dp_world, state.step, started)
    log_start(logger, prepared.precision_choice, ceiling, dtype, state.step)

    def reprobe() -> float:  # all ranks at once, as at the start
        return run_ceiling(dist.device, dtype, shapes).per_rank * dist.world

    followups = start_followups(prepared, dist, run_dir, logger, config.checkpoint.keep_last)
    last_eval = train_loop(
        Training(
            config=config,
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
            resume=resume,
        )
    )
    if dist.world > 1:  # every copy of a parameter that ranks hold whole: the same bits on each
        tensor_rank = engine.coordinates().get("tensor_parallel", 0)
        logger.log(replicas.check(engine.module, tensor_rank).record(state.step))
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


def log_start(logger: RunLogger, choice, ceiling, dtype, step: int) -> None:
    """The run's first records: the precision it picked and the matmul ceiling MFU is against."""
    logger.log({"kind": "precision", "step": step, **choice.as_record(), "note": choice.line()})
    first = {"kind": "ceiling", "when": "start", "step": step, **ceiling.as_record()}
    logger.log({**first, "note": ceiling.describe(dtype)})


def open_logger(
    config: RunConfig, prepared: Prepared, record: dict, dp_world: int, step: int, started
) -> RunLogger:
    """Rank 0's logger (the others' log nothing), the run's record written, and the banner."""
    run_dir, is_main = Path(config.out), started.dist.is_main
    logger = RunLogger(
        run_dir,
        is_main,
        config.optim.steps,
        step,
        wandb=config.logging.wandb,
        wandb_project=config.logging.wandb_project,
        run_name=config.logging.run_name,
        config=record,
    )
    if is_main:
        write_record(run_dir, record, prepared.manifest)
        batch = (prepared.micro_batch, prepared.grad_accum, dp_world, config.data.seq_len)
        logger.console(banner(record, batch) + resumed(started.resume))
    log_recipe_change(prepared.recipe_changes, logger, step)
    global_batch = record["ds_config"]["train_batch_size"]
    change = world_change(
        started.resume, started.dist.world, global_batch, prepared.grad_accum, step
    )
    if change:  # the run's history keeps every change of world (an elastic launch's restarts)
        logger.log(change)
        logger.console(
            f"world changed at step {step}: {change['from']} -> {change['to']} ranks; global "
            f"batch {change['global_batch']} kept with gradient accumulation {change['grad_accum']}"
        )
    return logger


def build(config: RunConfig, prepared: Prepared, started: Started) -> tuple[Engine, dict]:
    """The model, built as its engine will hold it, wrapped in that engine. Returns the engine
    and what the record keeps of the model (parameter count, FLOPs per token, config)."""
    dist, began = started.dist, time.perf_counter()
    model = build_for_engine(
        config.model.name,
        vocab_size=prepared.manifest.vocab_size,
        backend=config.engine.backend,
        ds_config=started.ds_config,
        overrides=prepared.model_overrides,
        keep_freed=prepared.switches.keep_freed_memory,
    )
    attention = config.model.attention  # picked in preflight
    set_attention_kernel(model, attention)  # the pipeline engine sets its own layers' kernel
    if config.model.z_loss:  # our model's loss (preflight refuses it elsewhere)
        set_z_loss(model, config.model.z_loss)
    if config.data.doc_mask:  # documents end at EOS in the prepared data (data/shards.py)
        set_document_mask(model, prepared.manifest.eos_id)
    if config.model.activation_checkpointing:  # the flag, or the config's section
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if config.model.lora is not None:  # frozen base, fresh adapters: what the engine trains
        # DeepSpeed trains 16-bit weights with fp32 masters: adapters in the base's dtype (a
        # ZeRO-3 base is built 16-bit; ZeRO-0-2 cast the whole module after this)
        in_base = config.engine.backend == "deepspeed"
        model = apply_lora(model, config.model.lora, config.optim.seed, in_base_dtype=in_base)
    compiled = None
    if config.model.compile:  # in place: parameter names and checkpoints are unchanged
        n, what = compile_blocks(model)
        compiled = f"{n} x {what}" if n > 1 else what
    n_params = sum(getattr(w, "ds_numel", w.numel()) for w in model.parameters())
    facts = {
        "n_params": n_params,
        "flops_per_token": flops_per_token(model.config, config.data.seq_len, n_params=n_params),
        "model_config": model.config,
        "compiled": compiled,  # "6 x Block": what torch.compile compiles (--compile)
        # the kernel, and for SDPA which of its kernels torch's dispatcher takes on this device
        "attention": {
            "kernel": attention,
            "sdpa": sdpa_backend(
                model.config, dist.device, DTYPES[prepared.precision], config.data.seq_len
            )
            if attention == "sdpa"
            else None,
        },
        "trainable_params": sum(
            getattr(w, "ds_numel", w.numel()) for w in model.parameters() if w.requires_grad
        ),
    }
    engine = build_engine(
        config.engine,
        model=model,
        ds_config=started.ds_config,
        optimizer=prepared.optimizer,  # flag given > ds_config > default (settings/hparams.py)
        device=dist.device,
        precision=config.engine.precision,
        attention=attention,
        hold_weights=prepared.switches.hold_weights,
        zero3_whole_blocks=prepared.switches.zero3_whole_blocks,
        grad_sum=prepared.switches.grad_sum,
    )
    del model  # the pipeline engine keeps only its stage's layers: free the rest
    # FSDP2 and ZeRO-3 never hold the whole model on a rank: this says how much each one did
    facts["built"] = {"seconds": round(time.perf_counter() - began, 2),
                      "peak_host_bytes": host_peak_bytes()}  # fmt: skip
    imported = config.model.name not in PRESETS and config.model.lora is None  # LoRA: no masters
    if started.resume is None and config.engine.precision != "fp32" and imported:
        # Continued pretraining starts from the folder's exact weights, not their 16-bit copy.
        engine.set_master_weights(folder_weights(resolve_pretrained(config.model.name)))
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
    config: RunConfig, prepared: Prepared, engine: Engine, started: Started
) -> tuple[BatchLoader, TokenDataset]:
    """The training reader, sharded over the data-parallel replicas, and the validation set
    (for a mixture `--data A:0.7,B:0.3`, data.Mixture of the folders); on preference pairs
    with their reference log-probs, and the engine's objective set (use_preference)."""
    pack = config.data.doc_mask  # chat data: several examples a sample, kept apart by the mask
    train_ds = open_split(config.data.path, "train", config.data.seq_len, pack)
    loader = BatchLoader(
        train_ds, prepared.micro_batch, engine.dp_rank, engine.dp_world, config.optim.seed
    )
    loader.skip(parse_spans(config.data.skip_samples))
    val_ds = open_split(config.data.path, "val", config.data.seq_len, pack)
    if getattr(train_ds, "pairs", False):
        use_preference(config, engine, train_ds, val_ds, started)
    return loader, val_ds


def use_preference(config: RunConfig, engine: Engine, train_ds, val_ds, started) -> None:
    """Preference pairs: the engine's objective the DPO-family loss, against the reference
    log-probs computed now by the starting model (before any checkpoint is loaded) or read
    back on a resume (training/objectives/reference.py)."""
    from training.objectives import reference

    objective, resume = config.optim.objective, started.resume
    reference.attach(
        engine,
        {"train": train_ds, "val": val_ds},
        Path(config.out),
        kind=objective,  # concrete: preflight/resolved.py decides "auto"
        beta=config.optim.dpo_beta,
        resumed_from=None if resume is None else reference.source_folder(resume.root),
        micro_batch=started.prepared.micro_batch,
        device=started.dist.device,
        is_main=started.dist.is_main,
        precision=started.prepared.precision,  # stored with the reference, checked on resume
    )


@dataclass(frozen=True, kw_only=True)
class Training:
    """What the loop runs with, once everything it needs is built."""

    config: RunConfig
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
    resume: ResumePlan | None = None  # what the run resumed from, and how it loaded


def log_recipe_change(changes: dict, logger: RunLogger, step: int) -> None:
    """A resume that changes the recipe, as --allow-recipe-change asked: kept in metrics.jsonl
    and said on the console (the record holds it too)."""
    if not changes:
        return
    said = ", ".join(
        f"{k} {str(v['from'])[:12]} -> {str(v['to'])[:12]}" for k, v in changes.items()
    )
    logger.log({"kind": "recipe_change", "step": step, "changes": changes})
    logger.console(f"recipe changed at step {step} (--allow-recipe-change): {said}")


def train_loop(t: Training) -> dict:
    """The loop, with its saver and evaluator; returns the last evaluation."""
    config, prepared, engine, dist, run_dir = t.config, t.prepared, t.engine, t.dist, t.run_dir
    loader, logger, record = t.loader, t.logger, t.record
    micro, accum = prepared.micro_batch, prepared.grad_accum
    sequences = 2 if getattr(loader.dataset, "pairs", False) else 1  # a preference pair: two
    loop = LoopConfig(
        schedule=prepared.schedule,
        grad_accum=accum,
        tokens_per_step=micro * accum * engine.dp_world * config.data.seq_len * sequences,
        log_every=config.logging.every,
        eval_every=config.eval.every,
        save_every=config.checkpoint.save_every,
        stop_at=config.checkpoint.stop_at,
        max_bad_steps=config.optim.max_bad_steps,
        flops_per_token=record["flops_per_token"],
        ceiling=LiveCeiling(
            record["peak_flops_per_rank"] * dist.world,
            t.reprobe,
            dist.world,
            record["flops_per_token"],
        ),
        compiled=record["compiled"],
        token_weighted=getattr(loader.dataset, "masked", False),
        eval_on_start=config.eval.on_start,
        profiler=StepProfiler(
            parse_span(config.logging.profile), run_dir / "profile", dist.is_main, dist.device.type
        )
        if config.logging.profile
        else None,
    )
    guard, rollback = safeguards(config.optim, engine, loader, dist, run_dir, t.state, t.resume)
    saver = Saver(
        engine,
        loader,
        logger,
        checkpoint=config.checkpoint,
        root=run_dir / "checkpoints",
        world=dist.world,
        is_main=dist.is_main,
        run_facts=trainer_facts(record),
        device=dist.device,
        followups=t.followups,
        guard=guard,
    )
    evaluator = Evaluator(
        engine,
        t.val_ds,
        micro_batch=micro,
        max_samples=config.eval.samples,
        device=dist.device,
        logger=logger,
    )
    watch_for_hangs(config, dist, run_dir)
    try:
        return run(
            engine,
            loader,
            t.state,
            loop,
            device=dist.device,
            logger=logger,
            saver=saver,
            evaluator=evaluator,
            guard=guard,
            rollback=rollback,
        )
    finally:
        hang.stop()  # evaluation, saving and the end's work are no steps


def watch_for_hangs(config: RunConfig, dist: DistInfo, run_dir: Path) -> None:
    """The hang watch over the loop's steps (runtime/hang.py); rank 0 records the ending."""

    def record(step: int, elapsed: float, limit: float) -> None:
        why = f"step {step} ran {elapsed:.0f} s, past its limit of {limit:.0f} s"
        record_ending(HUNG, why, rank=dist.rank)

    engine = config.engine
    on_hang = record if dist.is_main else None
    last = min(config.optim.steps, config.checkpoint.stop_at or config.optim.steps)
    hang.start(run_dir, dist.rank, engine.hang_factor, engine.hang_floor_s, on_hang, last)


def safeguards(
    optim, engine: Engine, loader, dist: DistInfo, run_dir: Path, state: LoopState, resumed=None
):
    """The spike guard (its gate set on the engine; None when off, and on the pipeline engine,
    which steps inside one train_batch call) and the rollback past troubled data."""
    guard = None
    if optim.spike_sigmas > 0 and engine.name != "pipeline":
        window = optim.spike_window
        guard = SpikeGuard(optim.spike_sigmas, window, window // 2, dist.device)
        engine.spike_gate = guard.gate
        guard.load_state_dict(state.guard)  # a resumed run's: where the checkpoint left it
    rollback = Rollback(
        optim.rollback_after,
        optim.rollback_window,
        optim.max_rollbacks,
        engine=engine,
        loader=loader,
        root=run_dir / "checkpoints",
        rank=dist.rank,
        world=dist.world,
        run_dir=run_dir,
        is_main=dist.is_main,
        guard=guard,
        resumed=resumed,
    )
    return guard, rollback


def cli() -> None:
    """The `zerostack-train` command and `training/train.py` run as a script: main's exit code,
    through distributed.exit_process (it leaves without the interpreter's finalization)."""
    # What the imports made (~400k objects) lives as long as the process: frozen, the garbage
    # collector stops scanning it at each full collection (0.5 s per collection on a CPU).
    gc.freeze()
    distributed.exit_process(main())


if __name__ == "__main__":
    cli()
