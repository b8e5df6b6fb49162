"""Who started this process, read once from the launcher's environment: rank, world, local rank,
the ranks on this host, and the master's address and port.

torchrun, accelerate launch and DeepSpeed's launcher hand over RANK / WORLD_SIZE / LOCAL_RANK /
MASTER_ADDR / MASTER_PORT; SLURM's srun, Open MPI's and MPICH's mpirun hand over their own
variables and no master at all. Everything else (train.py, runtime/distributed.py, preflight's
host switches, the doctor) asks this module, and `export` writes the torchrun names before any
process group starts, so torch.distributed and DeepSpeed read the same world."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import zlib
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from training.errors import ConfigError

# (launcher, rank, world, local rank), first that applies. MPI before SLURM: an mpirun inside
# an sbatch script inherits the batch step's SLURM_PROCID; srun's own tasks carry a step id.
RANK_VARIABLES = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("slurm", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID"),
)
# (variable, launcher) that say how many ranks run on this host, first that applies
LOCAL_SIZE_VARIABLES = (
    ("LOCAL_WORLD_SIZE", "torchrun"),  # torchrun, accelerate launch
    ("LOCAL_SIZE", "deepspeed"),  # DeepSpeed's launcher never sets LOCAL_WORLD_SIZE
    ("SLURM_NTASKS_PER_NODE", "slurm"),
    ("SLURM_STEP_TASKS_PER_NODE", "slurm"),
    ("SLURM_TASKS_PER_NODE", "slurm"),
    ("OMPI_COMM_WORLD_LOCAL_SIZE", "openmpi"),
    ("MPI_LOCALNRANKS", "mpich"),
)
# Ports derived from a job's id: below Linux's ephemeral range (32768-60999), so no connection
# the OS opens takes it.
PORT_BASE, PORT_SPAN = 20000, 12000


@dataclass(frozen=True)
class HostLayout:
    """Ranks on this host, and which launcher said so."""

    ranks_here: int
    launcher: str  # "torchrun", "deepspeed", "slurm", "openmpi", "mpich", or "none"


@dataclass(frozen=True)
class Launch:
    """This process's place in the world, as its launcher said."""

    launcher: str  # who gave the rank: "torchrun", "deepspeed", "openmpi", "mpich", "slurm", "none"
    rank: int
    world: int
    local_rank: int
    master_addr: str
    master_port: int | None  # None: a world of one with no port said (any free port serves)

    def torch_env(self) -> dict[str, str]:
        """The variables torch.distributed's env:// and DeepSpeed read."""
        env = {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world),
            "LOCAL_RANK": str(self.local_rank),
            "MASTER_ADDR": self.master_addr,
        }
        if self.master_port is not None:
            env["MASTER_PORT"] = str(self.master_port)
        return env


def read(env: Mapping[str, str] | None = None) -> Launch:
    """This process's launch from `env` (os.environ): the first launcher of RANK_VARIABLES whose
    rank is set, else a world of one. A value that is not a number raises ConfigError naming
    it; so does a multi-host MPI launch that says no master address."""
    env = os.environ if env is None else env
    for launcher, rank_name, world_name, local_name in RANK_VARIABLES:
        if not env.get(rank_name, "").strip():
            continue
        if launcher == "slurm" and not (env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")):
            continue  # an sbatch script itself (the batch step): not a task of an srun
        if launcher == "slurm" and not env.get(world_name, "").strip():
            world_name = "SLURM_NTASKS"
        rank = _integer(env, rank_name)
        world = _integer(env, world_name, "1")
        local = _integer(env, local_name, "0")
        if not (world >= 1 and 0 <= rank < world and local >= 0):
            raise ConfigError(
                f"{rank_name}={rank} is not in 0..{world_name}-1 ({world_name}={world}); "
                "a launcher's rank is below its world size"
            )
        addr, port = master(env, launcher, world)
        if launcher == "torchrun" and "LOCAL_SIZE" in env and "LOCAL_WORLD_SIZE" not in env:
            launcher = "deepspeed"  # its launcher sets the same names, and LOCAL_SIZE
        return Launch(launcher, rank, world, local, addr, port)
    addr, port = master(env, "none", 1)
    return Launch("none", 0, 1, 0, addr, port)


def export(launch: Launch, env: MutableMapping[str, str] | None = None) -> None:
    """Write `launch` as the torchrun variables (what env:// and deepspeed.init_distributed read)
    into `env` (os.environ). A world of one with no port said keeps MASTER_PORT unset: the
    caller picks a free one."""
    env = os.environ if env is None else env
    env.update(launch.torch_env())


def master(env: Mapping[str, str], launcher: str, world: int) -> tuple[str, int | None]:
    """(MASTER_ADDR, MASTER_PORT) as the launcher says, else from the allocation: the first host
    of SLURM's node list (127.0.0.1 when the whole world is on this host); a port derived from
    the job's id, the same on every rank of the job."""
    addr = env.get("MASTER_ADDR", "").strip()
    port = _integer(env, "MASTER_PORT") if env.get("MASTER_PORT", "").strip() else None
    if port is not None and not 0 < port < 65536:
        raise ConfigError(f"the launcher's MASTER_PORT={port} is not a TCP port (1-65535)")
    if world == 1 or (addr and port is not None):
        return addr or "127.0.0.1", port
    if not addr:
        addr = _master_host(env, launcher, world)
    if port is None:
        key = _job_key(env, launcher, alone=host_layout(world, env).ranks_here >= world)
        port = PORT_BASE + zlib.crc32(key.encode()) % PORT_SPAN if key else 29500
    return addr, port


def host_layout(world: int, env: Mapping[str, str] | None = None) -> HostLayout:
    """The ranks of `world` on this host, as the launcher says (LOCAL_SIZE_VARIABLES, first that
    applies; SLURM's compressed "2(x3),1" picks this node's count by SLURM_NODEID). None of
    them: a single-host launch (the whole world here)."""
    env = os.environ if env is None else env
    for name, launcher in LOCAL_SIZE_VARIABLES:
        value = env.get(name, "").strip()
        if not value:
            continue
        if name in ("SLURM_TASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE"):
            node = env.get("SLURM_NODEID", "0").strip()
            n = slurm_tasks_on_node(value, int(node) if node.isdigit() else 0)
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


def first_host(nodelist: str) -> str | None:
    """The first host of a SLURM node list ("gpu[07-09,12],cpu1" -> "gpu07"): scontrol's answer
    where SLURM's tools are installed, else read here; None when it does not parse."""
    nodelist = nodelist.strip()
    if not nodelist:
        return None
    scontrol = shutil.which("scontrol")
    if scontrol:
        try:
            out = subprocess.run(
                [scontrol, "show", "hostnames", nodelist],
                capture_output=True,
                text=True,
                timeout=30,
            )
            if out.returncode == 0 and out.stdout.split():
                return out.stdout.split()[0]
        except (OSError, subprocess.TimeoutExpired):
            pass  # read it here
    m = re.match(r"([^,\[]+)(?:\[([^\]]*)\])?", nodelist)
    if m is None:
        return None
    prefix, ranges = m.group(1), m.group(2)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first if first else None


def _master_host(env: Mapping[str, str], launcher: str, world: int) -> str:
    if host_layout(world, env).ranks_here >= world:
        return "127.0.0.1"  # the whole world on this host
    nodelist = next(
        (env[n] for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
         if env.get(n, "").strip()),
        "",
    )  # fmt: skip
    if launcher == "slurm" or nodelist:
        host = first_host(nodelist)
        if host:
            return host
        raise ConfigError(
            f"cannot read the first host of SLURM's node list {nodelist!r}: set MASTER_ADDR"
        )
    raise ConfigError(
        f"{launcher} started {world} ranks on more than one host without MASTER_ADDR: set it "
        "to the first host's address for every rank (mpirun -x MASTER_ADDR=HOST)"
    )


def _job_key(env: Mapping[str, str], launcher: str, alone: bool) -> str | None:
    """A string every rank of this launch shares and another launch does not, or None."""
    if env.get("SLURM_JOB_ID") and launcher == "slurm":
        step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or ""
        return f"slurm-{env['SLURM_JOB_ID']}-{step}"
    for name in ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "PMI_KVSNAME"):
        if env.get(name):
            return f"{name}-{env[name]}"
    # one host: the ranks' parent is the launcher's one local daemon (Hydra's proxy, prted)
    return f"parent-{os.getppid()}" if alone else None


def _integer(env: Mapping[str, str], name: str, default: str | None = None) -> int:
    value = env.get(name, "").strip() or default
    try:
        return int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(
            f"the launcher's {name}={env.get(name, '')!r} is not a whole number"
        ) from None
