"""The host layout: how many ranks of the world run on this machine, read once from whichever
launcher started the run. Everything below preflight gets it as a plain int (the thread split in
runtime/distributed.py, the shm route, the one-host holds and the memory plan)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class HostLayout:
    """Ranks on this host, and which launcher said so."""

    ranks_here: int
    launcher: str  # "torchrun", "deepspeed", "slurm", "openmpi", "mpich", or "none"


def host_layout(world: int, env: Mapping[str, str] | None = None) -> HostLayout:
    """The ranks of `world` on this host, as the launcher says (first that applies):
    torchrun / accelerate: LOCAL_WORLD_SIZE; DeepSpeed's launcher: LOCAL_SIZE (it never sets
    LOCAL_WORLD_SIZE); SLURM's srun: SLURM_NTASKS_PER_NODE, else this node's count in
    SLURM_TASKS_PER_NODE ("2(x3),1": three nodes of 2, then one of 1; SLURM_NODEID picks);
    Open MPI: OMPI_COMM_WORLD_LOCAL_SIZE; MPICH / Intel MPI: MPI_LOCALNRANKS. None of them: a
    single-host launch (the whole world here)."""
    env = os.environ if env is None else env
    for name, launcher in (
        ("LOCAL_WORLD_SIZE", "torchrun"),
        ("LOCAL_SIZE", "deepspeed"),
        ("SLURM_NTASKS_PER_NODE", "slurm"),
        ("SLURM_TASKS_PER_NODE", "slurm"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "openmpi"),
        ("MPI_LOCALNRANKS", "mpich"),
    ):
        value = env.get(name, "").strip()
        if not value:
            continue
        if name == "SLURM_TASKS_PER_NODE":
            n = slurm_tasks_on_node(value, int(env.get("SLURM_NODEID", "0") or 0))
        else:
            # SLURM_NTASKS_PER_NODE is one number when every node runs the same count
            n = int(value) if value.isdigit() else None
        if n:
            return HostLayout(min(n, world), launcher)
    return HostLayout(world, "none")


def slurm_tasks_on_node(spec: str, node: int) -> int | None:
    """Node `node`'s task count in SLURM's compressed list, e.g. "2(x3),1" -> 2 for nodes
    0-2 and 1 for node 3; None when the spec does not parse or has no such node."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node] if 0 <= node < len(counts) else None
