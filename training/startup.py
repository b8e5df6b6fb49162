"""A run's first collective steps, on every rank: the process group, the precision a CPU measures
(every rank at once, so all decide alike), the run folder's lock (taken
before anything is written there), the resume plan verified by all ranks together (falling back
past a corrupt checkpoint with --resume auto), accelerate's process state, DeepSpeed's comm
layer with its shared-memory route, and the universal copy a resume on another topology needs."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from training.checkpoints import layout, universal_copy
from training.checkpoints.resume_point import ResumePlan, verify_resume
from training.errors import BAD_INPUT, CheckpointError, ConfigError
from training.preflight import Prepared, probe_dtypes, rank0_printer, settle_precision
from training.runtime import cluster, distributed, nccl_env, runlock
from training.runtime.distributed import DistInfo
from training.runtime.flops import DTYPES, model_shapes, probe_ranks
from training.runtime.shm import shared_memory_collectives
from training.settings.run_config import RunConfig, flat


@dataclass
class Started:
    """The process group and what was decided once it was up."""

    dist: DistInfo
    prepared: Prepared  # its precision settled (a CPU's "auto" measured)
    probed: dict | None  # {dtype: each rank's matmul FLOP/s} on the model's shapes, if measured
    resume: ResumePlan | None
    ds_config: dict  # the prepared one, asking for a universal load when the plan says so
    shm: bool  # DeepSpeed's collectives go through shared memory
    accelerate: dict | None  # accelerate's process state, when launched by it


def start(config: RunConfig, prepared: Prepared, run_dir: Path) -> Started:
    """The process group; the resume plan verified by every rank (falling back past a corrupt
    checkpoint with --resume auto); DeepSpeed's comm layer; the universal copy, if needed."""
    switches = prepared.switches
    here = prepared.host.ranks_here if prepared.host else None  # runtime/launcher.py
    nccl_env.apply(distributed.accelerator().communication_backend_name(), run_dir)
    dist = distributed.setup(
        timeout_s=config.engine.dist_timeout,
        local_rank_arg=config.engine.local_rank,
        keep_freed=switches.keep_freed_memory,
        ranks_here=here,
    )
    prepared, probed = settle(config, prepared, dist)
    agree(prepared)
    hold_run_folder(run_dir, dist)
    if dist.is_main:  # a save cut short (a kill during an --async-save write): never resumed
        layout.set_aside_unsealed(run_dir / "checkpoints", rank0_printer(dist.rank))
    resume = prepared.resume
    if resume is not None:  # every rank hashes a share of the files; all agree on the verdict
        auto, log = config.checkpoint.resume == "auto", rank0_printer(dist.rank)
        resume = verify_resume(
            resume, auto, prepared.topology, config.checkpoint.universal, log=log
        )
    accelerate = cluster.align_accelerate_state(dist.backend)
    # Hands our process group to deepspeed.comm (zero.Init reads the world size from it); on one
    # CPU host its collectives, and FSDP2's, then go through shared memory.
    shm = config.engine.backend in ("deepspeed", "fsdp") and shared_memory_collectives(
        switches.shm_collectives, ranks_here=here
    )
    cfg = prepared.ds_config
    if resume is not None and resume.universal:
        make_universal_copy(resume, dist)
        cfg = {**cfg, "checkpoint": {**cfg.get("checkpoint", {}), "load_universal": True}}
    return Started(dist, prepared, probed, resume, cfg, shm, accelerate)


def settle(config: RunConfig, prepared: Prepared, dist: DistInfo) -> tuple[Prepared, dict | None]:
    """The precision a CPU measures: bf16 against fp32 on the model's matmul shapes, every rank
    at once with the threads it trains with (preflight/precision.py decides on the mean); the
    rates are kept for the run's MFU ceiling. A slow explicit choice is said once, on rank 0."""
    wanted = probe_dtypes(prepared)
    if not wanted:
        return prepared, None
    shapes = model_shapes(prepared.model_config, prepared.micro_batch * config.data.seq_len)
    probed = probe_ranks(dist.device, [DTYPES[n] for n in wanted], shapes)
    prepared = settle_precision(config, prepared, probed)
    if prepared.precision_choice.warning:
        rank0_printer(dist.rank)(prepared.precision_choice.warning)
    return prepared, probed


def agree(prepared: Prepared) -> None:
    """Every rank resolved the same run: the configuration as it runs (every auto) and the
    DeepSpeed config, compared across ranks once the group is up. Ranks that decided an auto
    differently (GPUs of two generations, hosts of different memory) would hang in their first
    collective instead; the run is refused, on every rank alike, naming the ranks and setting."""
    settings = {f"--{k.replace('_', '-')}": v for k, v in flat(prepared.config).items()}
    settings.pop("--local-rank")  # the launcher's, one per rank
    mine = {**settings, **dict(_dotted(prepared.ds_config, "ds_config "))}
    every = distributed.all_gather_object(mine)
    odd = [r for r, theirs in enumerate(every) if theirs != every[0]]
    if not odd:
        return
    first = every[odd[0]]
    key = next(k for k in sorted(set(every[0]) | set(first)) if every[0].get(k) != first.get(k))
    raise ConfigError(
        f"ranks {', '.join(map(str, odd))} resolved {key} to {first.get(key)!r}, rank 0 to "
        f"{every[0].get(key)!r}: every rank must run the same configuration; give it "
        "explicitly (for example --precision) or launch on machines that decide it alike"
    )


def _dotted(tree: dict, prefix: str):
    """(dotted key, leaf value) of a nested dict."""
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _dotted(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def hold_run_folder(run_dir: Path, dist: DistInfo) -> None:
    """Rank 0 takes the run folder's lock (runlock.py) before anything is written into it; every
    rank learns the verdict, so a refused launch ends alike on all of them (ConfigError)."""
    lock, problem = None, None
    if dist.is_main:
        try:
            lock = runlock.acquire(run_dir, log=lambda m: print(m, file=sys.stderr, flush=True))
        except ConfigError as e:
            problem = str(e)
    problem = distributed.broadcast_object(problem)
    if problem:
        raise ConfigError(problem)
    runlock.hold(lock, run_dir)


def give_back_untouched() -> None:
    """A launch with nothing to do gives the run folder back before writing anything into it,
    not even how it ended (the launch script still gets its code)."""
    runlock.release()


def make_universal_copy(plan: ResumePlan, dist: DistInfo) -> None:
    """Rank 0 converts the checkpoint once, beside it; the other ranks wait."""
    if dist.is_main:
        try:
            universal_copy.ensure(plan.root, plan.tag, log=lambda m: print(m, flush=True))
        except CheckpointError as e:  # the launcher then stops the others
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(BAD_INPUT)
    distributed.barrier()
