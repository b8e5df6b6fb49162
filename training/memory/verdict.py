"""The trainer's memory check before any work: this run's plan against this machine, the
refusal when it does not fit (naming the shipped config that would), and the advice kept for
a rank that runs out of memory later."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from training.memory.capacity import Capacity, capacity, fits
from training.memory.fit import fitting_plans
from training.memory.plan import HEADROOM, Plan, fmt_bytes, plan
from training.memory.shape import ModelShape


@dataclass
class Verdict:
    """The plan of a run against this machine, and the shipped configs that would fit."""

    plan: Plan
    capacity: Capacity
    fits: bool
    needs: str  # fits()'s line
    cheapest: Plan | None  # the cheapest shipped config that fits (None: none does)
    roomier: Plan | None  # the first that fits holding less per rank than this run's config

    def refusal(self) -> str:
        """One line: what does not fit, what would, and how to try anyway."""
        short = "; ".join(part for part in self.needs.split("; ") if "does NOT fit" in part)
        return (
            f"{self.plan.config}: the memory plan says this run does not fit this machine "
            f"({short.replace(' -> does NOT fit', '')}, planning to use at most "
            f"{HEADROOM:.0%}); {self._fix()}; --force starts it anyway "
            "(python -m training.memory_plan shows the plan)"
        )

    def advice(self) -> str:
        """One line for a rank that ran out of memory: the plan and the roomier config."""
        p = self.plan
        mine = f"the memory plan for this run was {fmt_bytes(in_memory(p))} per rank"
        better = self.roomier
        if better is None:
            return (
                f"{mine}; no shipped config plans much less here: more hosts, or a shorter "
                "--seq-len or --micro-batch"
            )
        return f"{mine}; {plan_name(better)} plans {fmt_bytes(in_memory(better))}"

    def _fix(self) -> str:
        if self.cheapest is None:
            return (
                f"no shipped config fits {self.plan.world} rank(s) here: more hosts, a smaller "
                "--micro-batch or --seq-len"
            )
        return f"{plan_name(self.cheapest)} fits"


def plan_name(p: Plan) -> str:
    """The plan's config as a user would ask for it."""
    return p.config + (" with --activation-checkpointing" if p.activation_checkpointing else "")


def in_memory(p: Plan) -> int:
    """What one rank holds in memory: device + host (one memory on a CPU), NVMe left out."""
    return p.total("device") + p.total("host")


def check_run(
    shape: ModelShape,
    ds_cfg: dict,
    world: int,
    *,
    config_name: str,
    seq_len: int,
    activation_checkpointing: bool,
    ranks_per_host: int | None = None,
    nvme_dir: str | None = None,
    host_mem_gib: float | None = None,
    device_mem_gib: float | None = None,
    async_save: bool = False,
    pairs: int = 0,
) -> Verdict:
    """The trainer's check before any work: this run's plan against this machine (or the memory
    --host-mem-gib / --device-mem-gib say), and the shipped configs that fit. `pairs`: the
    preference pairs of the run's data (0: other data)."""
    cap = capacity(
        device_mem_gib=device_mem_gib, host_mem_gib=host_mem_gib, nvme_dir=nvme_dir or "."
    )
    if nvme_dir and Path(nvme_dir).is_dir():  # a resumed run's swap files are reused, not added
        cap.nvme_bytes = (cap.nvme_bytes or 0) + _folder_bytes(Path(nvme_dir))
    micro = ds_cfg.get("train_micro_batch_size_per_gpu")
    kw = dict(seq_len=seq_len, ranks_per_host=ranks_per_host, device_type=cap.device_type)
    kw["pairs"] = pairs  # preference data (plan.py)
    p = plan(
        shape,
        ds_cfg,
        world,
        config_name=config_name,
        activation_checkpointing=activation_checkpointing,
        async_save=async_save,
        **kw,
    )
    ok, needs = fits(p, cap)
    cheapest = roomier = None
    for c in fitting_plans(shape, world, cap, micro, **kw):
        cheapest = cheapest or c
        if roomier is None and in_memory(c) < 0.9 * in_memory(p):  # a real saving, not noise
            roomier = c
    return Verdict(p, cap, ok, needs, cheapest, roomier)


def _folder_bytes(folder: Path) -> int:
    total = 0
    for f in folder.rglob("*"):
        try:
            total += f.stat().st_size if f.is_file() else 0
        except OSError:
            continue
    return total
