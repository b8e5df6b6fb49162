"""Preflight of memory: the run's plan against this machine before any rank allocates."""

from __future__ import annotations

from training.errors import ConfigError
from training.memory import oom
from training.memory.plan import HEADROOM
from training.memory.verdict import check_run
from training.settings import ds_config, nvme, parallel
from training.settings.run_config import RunConfig


def check_memory(
    config: RunConfig,
    cfg: dict,
    cfg_path: str,
    shape,
    world: int,
    ranks_per_host: int,
    background: int = 0,
) -> None:
    """The memory plan (training/memory/verdict.py) before any rank allocates the model: a run it
    says cannot fit is refused, naming the shipped config that would (--force tries anyway).
    The plan's advice is kept for a rank that runs out of memory later (training/run_exit.py).
    `background`: what rank 0's background work on checkpoints adds to its host
    (preflight/followup_checks.py)."""
    verdict = _verdict(
        config, cfg, cfg_path, shape, world, ranks_per_host, config.checkpoint.async_save
    )
    oom.remember(verdict.advice())
    if verdict.fits and background and not config.host.force:
        _check_background(verdict, background, cfg_path)
    if verdict.fits or config.host.force:
        return
    if config.checkpoint.async_save:
        sync = _verdict(config, cfg, cfg_path, shape, world, ranks_per_host, False)
        if sync.fits:
            staging = verdict.plan.per_rank["staging"]["host"]
            raise ConfigError(
                f"{cfg_path}: --async-save's host copy of the states ({staging / 2**30:,.2f} GiB "
                f"a rank) does not fit beside the run ({verdict.needs}); drop --async-save (saves "
                "are then synchronous) or --force"
            )
    raise ConfigError(verdict.refusal())


def _verdict(config, cfg, cfg_path, shape, world, ranks_per_host, async_save):
    zero = cfg.get("zero_optimization", {})
    swap = next((zero[s]["nvme_path"] for s in nvme.nvme_sections(cfg)), None)
    return check_run(
        shape,
        cfg,
        world,
        config_name=cfg_path,
        # Ulysses: each rank's activations cover its slice of the sequence. (Tensor
        # parallelism is planned as data parallelism: an overestimate of its model states.)
        seq_len=config.data.seq_len // parallel.sequence_size(cfg),
        activation_checkpointing=ds_config.activation_checkpointing(
            cfg, config.model.activation_checkpointing
        ),
        ranks_per_host=ranks_per_host,
        nvme_dir=swap,
        host_mem_gib=config.host.host_mem_gib,
        device_mem_gib=config.host.device_mem_gib,
        async_save=async_save,
        pairs=_pairs(config.data.path),
    )


def _pairs(spec: str) -> int:
    """The preference pairs of the run's data, both splits (0 for other data)."""
    from data.manifest import DataError, load_manifest
    from data.mixture import parse_spec
    from data.pairs import is_pairs

    try:
        manifest = load_manifest(parse_spec(spec)[0].folder)
    except DataError:
        return 0
    return sum(manifest.chat["pairs"].values()) if is_pairs(manifest) else 0


def _check_background(verdict, background: int, cfg_path: str) -> None:
    """Rank 0's host holds its ranks and the background job beside them."""
    p, cap = verdict.plan, verdict.capacity
    ranks = p.ranks_per_host * (
        p.total("device") + p.total("host") if cap.device_type == "cpu" else p.total("host")
    )
    if ranks + background <= HEADROOM * cap.host_bytes:
        return
    raise ConfigError(
        f"{cfg_path}: the background export/universal/task work on checkpoints "
        f"({background / 2**30:,.2f} GiB) does not fit on rank 0's host beside its ranks "
        f"({ranks / 2**30:,.2f} GiB of {cap.host_bytes / 2**30:,.2f} GiB); drop --export-every, "
        "--universal-every and --eval-tasks (run them after training), or --force"
    )
