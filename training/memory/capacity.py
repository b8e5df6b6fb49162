"""The machine a plan must fit: its device, host and NVMe space (or what the flags say), and
whether every rank's share of a plan fits them."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import psutil

from training.memory.plan import HEADROOM, GiB, Plan, fmt_bytes
from training.runtime.distributed import accelerator


@dataclass
class Capacity:
    device_type: str  # "cuda", ... or "cpu" (then device memory is host memory)
    device_bytes: int  # per device (GPU); for a CPU, the host's
    host_bytes: int  # per host
    nvme_bytes: int | None  # free space where swap files go


def capacity(
    device: str | None = None, device_mem_gib=None, host_mem_gib=None, nvme_dir: str = "."
) -> Capacity:
    """This machine's memory, or what the flags say (the trainer's --host-mem-gib and
    --device-mem-gib, this command's --host-mem and --device-mem): to plan for another machine,
    rehearse a smaller one, or leave room for other work."""
    acc = accelerator()
    here = acc.device_name()
    kind = device or here
    host = int(host_mem_gib * GiB) if host_mem_gib else psutil.virtual_memory().total
    if kind == "cpu":
        dev = host
    elif device_mem_gib:
        dev = int(device_mem_gib * GiB)
    elif kind == here:
        dev = int(acc.total_memory(0))
    else:
        raise ValueError(f"--device {kind} is not this machine's ({here}): give --device-mem")
    d = Path(nvme_dir)
    while not d.exists() and d != d.parent:
        d = d.parent
    return Capacity(kind, dev, host, shutil.disk_usage(d).free)


def fits(p: Plan, cap: Capacity) -> tuple[bool, str]:
    """Whether every rank's share fits; returns (fits, a line saying what needs what)."""
    n = p.ranks_per_host
    dev, host, disk = p.total("device"), p.total("host"), p.total("nvme")
    checks = []
    if cap.device_type == "cpu":  # one memory: everything of every rank on the host
        need = n * (dev + host)
        checks.append(("host memory", need, cap.host_bytes, f"{n} ranks x {fmt_bytes(dev + host)}"))
    else:
        checks.append(("device memory", dev, cap.device_bytes, "per device"))
        checks.append(("host memory", n * host, cap.host_bytes, f"{n} ranks x {fmt_bytes(host)}"))
    if disk:
        checks.append(("nvme", n * disk, cap.nvme_bytes or 0, f"{n} ranks x {fmt_bytes(disk)}"))
    ok = all(need <= HEADROOM * have for _, need, have, _ in checks)
    line = "; ".join(
        f"{what}: needs {fmt_bytes(need)} ({how}) of {fmt_bytes(have)}"
        + ("" if need <= HEADROOM * have else " -> does NOT fit")
        for what, need, have, how in checks
    )
    return ok, line
