"""Which shipped config fits: a ds_config resolved as the trainer would resolve it (ZeRO-3's
hold decided by the one-host rule), and the cheapest of the candidates whose plan fits a
machine, at this world size or the smallest larger one."""

from __future__ import annotations

from pathlib import Path

from training.memory.capacity import Capacity, fits
from training.memory.plan import Plan, fmt_bytes, plan
from training.memory.shape import ModelShape
from training.settings import ds_config
from training.settings.ds_config import CONFIG_DIR
from training.settings.flags import auto_unless
from training.settings.run_config import OptimConfig

# Cheapest first: no sharding, then more sharding, then recomputation, then offload.
CANDIDATES = [
    ("zero0.json", False),
    ("zero1.json", False),
    ("zero2.json", False),
    ("zero3.json", False),
    ("zero2.json", True),
    ("zero3.json", True),
    ("zero2_offload.json", True),
    ("zero3_offload.json", True),
    ("zero3_nvme.json", True),
]


def resolve_file(
    path: str | Path,
    shape: ModelShape,
    world: int,
    micro_batch: int | None,
    device_type: str = "cuda",
    ranks_per_host: int | None = None,
    host_bytes: int | None = None,
):
    """A ds_config file resolved as the trainer resolves it (ds_config.resolve_held) on `device_type` (its flag defaults, this
    world size, ZeRO-3's hold as --hold-weights auto decides it on a host of `host_bytes`): bad
    files and combinations raise ConfigError."""
    raw = ds_config.load_json(path)
    kw = dict(
        world=world,
        optim=OptimConfig(micro_batch=micro_batch),  # else the trainer's defaults
        swap=("nvme_swap", max(shape.largest_layer, 1 << 20)),
        hidden_size=shape.hidden,
        source=str(path),
    )
    where = (world, ranks_per_host or world, host_bytes or 0, device_type)

    def holds(cfg: dict) -> bool:  # --hold-weights auto's rule
        return zero3_holds_whole(cfg, shape.params, *where)[0]

    return ds_config.resolve_held(raw, holds, device_type=device_type, params=shape.params, **kw)


def zero3_holds_whole(
    cfg: dict, params: int, world: int, ranks_per_host: int, host_bytes: int, device_type: str
) -> tuple[bool, str]:
    """--hold-weights auto under ZeRO-3 (the trainer's rule, training/preflight/switches.py):
    every rank's whole 16-bit (fp32: 32-bit) weights kept gathered, by `one_cpu_host_holds`,
    not with parameters offloaded. Returns (on, why)."""
    offload = cfg.get("zero_optimization", {}).get("offload_param", {}).get("device", "none")
    held = (4 if ds_config.precision(cfg) == "fp32" else 2) * params
    blockers = [(str(offload).lower() != "none", "parameters offloaded")]
    return one_cpu_host_holds(held, world, ranks_per_host, host_bytes, device_type, blockers)


def one_cpu_host_holds(
    held_per_rank: int,
    world: int,
    ranks_per_host: int,
    host_bytes: int,
    device_type: str,
    blockers=(),
) -> tuple[bool, str]:
    """The rule of the one-host holds (ZeRO-3's whole weights, FSDP2's whole weights and
    gradients across micro-steps): on a CPU (measured there), every rank on this host, and what
    all of them hold within a quarter of its memory (ZeRO-3 and FSDP2 are also how a model too
    big for ZeRO-2 or DDP fits); none of `blockers`. Returns (on, why)."""
    total = held_per_rank * world
    return auto_unless(
        [
            *blockers,
            (device_type != "cpu", f"{device_type}, not a CPU (unmeasured)"),
            (ranks_per_host != world, f"{ranks_per_host} of {world} ranks on this host"),
            (total >= host_bytes / 4, f"{fmt_bytes(total)} over a quarter of the host"),
        ],
        f"one CPU host, {fmt_bytes(total)} held within a quarter of its memory",
    )


def cheapest_fit(
    shape: ModelShape, world: int, cap: Capacity, micro_batch: int | None = None, **kw
) -> Plan | None:
    """The first of CANDIDATES (cheapest first) whose plan fits."""
    return next(fitting_plans(shape, world, cap, micro_batch, **kw), None)


def fitting_plans(shape: ModelShape, world: int, cap: Capacity, micro_batch: int | None, **kw):
    """The plans of the shipped CANDIDATES that fit `cap`, cheapest first."""
    for name, ckpt in CANDIDATES:
        path = CONFIG_DIR / name
        if not path.is_file():
            continue
        rph = kw.get("ranks_per_host")
        cfg = resolve_file(path, shape, world, micro_batch, cap.device_type, rph, cap.host_bytes)
        p = plan(
            shape, cfg, world, config_name=f"ds_configs/{name}", activation_checkpointing=ckpt, **kw
        )
        if fits(p, cap)[0]:
            yield p
    return None


def smallest_world(shape, world: int, cap, micro_batch, kw) -> tuple[int, Plan] | None:
    """The smallest world (doubling, past `world`) at which some shipped config fits."""
    for w in (2**k for k in range(1, 13)):
        if w > world:
            b = cheapest_fit(shape, w, cap, micro_batch=micro_batch, **kw)
            if b is not None:
                return w, b
    return None
