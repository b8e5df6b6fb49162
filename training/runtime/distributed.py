"""The process group every engine shares, and the small collectives the trainer itself uses:
rank, world, device and backend come from the launcher's environment and the accelerator,
never from assumptions about CUDA."""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import os
import socket
import sys
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from training.runtime import launcher, liveness


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world: int
    local_rank: int
    local_world: int
    device: torch.device
    backend: str
    launcher: str = "none"  # who gave the rank (runtime/launcher.py)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def accelerator():
    """DeepSpeed's accelerator abstraction (CPU here, CUDA/XPU/... elsewhere)."""
    from deepspeed.accelerator import get_accelerator  # DeepSpeed is heavy to import: on use

    return get_accelerator()


def setup(
    timeout_s: float = 600.0,
    local_rank_arg: int | None = None,
    keep_freed: bool = True,
    ranks_here: int | None = None,
) -> DistInfo:
    """Initialise torch.distributed from the launcher's env (runtime/launcher.py: torchrun,
    DeepSpeed's launcher, srun, Open MPI's or MPICH's mpirun).

    A plain `python train.py` with no launcher env runs as a world of one. The launcher's rank,
    world and master are written as RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT
    before the group starts, so DeepSpeed's init_distributed sees the same world. The backend
    is the accelerator's (gloo on CPU, NCCL on CUDA); `timeout_s` bounds every collective so a
    dead rank makes the others fail instead of hanging forever; `keep_freed` (a CPU: the
    trainer's --keep-freed-memory) keeps freed blocks on the heap between steps; `ranks_here`
    (the ranks of the world on this host, runtime/launcher.py; None: all of them) share the
    host's cores."""
    env = os.environ
    launch = launcher.read(env)
    if local_rank_arg is not None and launch.launcher in ("torchrun", "deepspeed", "none"):
        if not env.get("LOCAL_RANK"):  # an older launcher's --local_rank argument
            launch = replace(launch, local_rank=local_rank_arg)
    launcher.export(launch, env)
    env.setdefault("MASTER_PORT", str(free_port()))  # a world of one, no port said
    rank, world, local_rank = launch.rank, launch.world, launch.local_rank
    local_world = world if ranks_here is None else ranks_here

    acc = accelerator()
    backend = acc.communication_backend_name()
    if acc.device_name() == "cpu":
        device = torch.device("cpu")
        # Share the cores between the ranks on this host instead of oversubscribing them.
        if "OMP_NUM_THREADS" not in env or local_world > 1:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        if keep_freed:  # the trainer's --keep-freed-memory
            keep_freed_memory()
    else:
        acc.set_device(local_rank)
        device = torch.device(acc.device_name(local_rank))
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend, timeout=timedelta(seconds=timeout_s), **bound_device(backend, device)
        )
    # Groups made later (DeepSpeed clones the world for ZeRO) get torch's default timeout, 30
    # minutes or more, not the world's: make the default ours too.
    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timedelta(seconds=timeout_s)
    liveness.set_timeout(timeout_s)  # for the collectives that cannot time out by themselves
    return DistInfo(rank, world, local_rank, local_world, device, backend, launch.launcher)


def bound_device(backend: str, device: torch.device) -> dict:
    """NCCL's group is bound to this rank's device (LOCAL_RANK's): unbound, NCCL guesses it
    from the global rank modulo the host's GPU count, another GPU than the rank's where hosts
    hold different numbers of ranks (and a warning on every run). gloo takes no device."""
    return {"device_id": device} if backend == "nccl" and device.index is not None else {}


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory in the process instead of unmapping it (CPU training).

    Activations and gradients are allocated and freed every step. glibc serves blocks above its
    mmap threshold with fresh mmaps, and trims the heap back to the OS: every step then
    page-faults its working set in again. Keeping blocks up to 32 MiB on the heap and never
    trimming avoids that (docs/benchmarks.md; the peak RSS is what the process reaches anyway).
    No-op off glibc; the trainer's --keep-freed-memory off leaves glibc as it is."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):  # musl, macOS: no mallopt
        return False
    if mallopt is None:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    ok = mallopt(m_mmap_threshold, 32 * 2**20) == 1
    return mallopt(m_trim_threshold, 2**31 - 1) == 1 and ok  # an int: the most it takes


def teardown() -> None:
    """Destroy the process group; skipping this aborts some gloo runs at exit."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def exit_process(code: int | None = 0):
    """End a rank's process with `code`: the last line of an entry point that ran collectives,
    `distributed.exit_process(main())`, in place of `sys.exit`.

    It runs the atexit handlers and flushes, then leaves without the interpreter's finalization.
    A gloo worker thread can still be dropping the last reference to a finished collective's
    tensors as Python finalizes; the GIL that needs is gone, the thread is unwound, and the rank
    aborts with "terminate called without an active exception" (SIGABRT) after a run that
    succeeded, which fails the whole launch (1 exit in 69 here, with a core showing
    ~AsyncBarrierWork -> ~AsyncAllgatherWork -> decref_pyobject; pytorch/pytorch#179291).
    An exception from main never gets here: it ends the usual way, with its traceback."""
    code = int(code or 0)
    atexit._run_exitfuncs()  # what a normal exit would run, while the interpreter is whole
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def all_reduce_scalars(values: list[float], device: torch.device, op: str = "mean") -> list[float]:
    """Mean (or max) of each value across ranks, in one collective for the whole list."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        if op == "mean":
            t /= dist.get_world_size()
    return t.tolist()


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def all_gather_object(obj) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
