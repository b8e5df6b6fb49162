"""Process-group setup shared by every engine: rank, world, device and backend come from the
launcher's environment and the accelerator, never from assumptions about CUDA."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world: int
    local_rank: int
    local_world: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def accelerator():
    """DeepSpeed's accelerator abstraction (CPU here, CUDA/XPU/... elsewhere)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator()


def setup(timeout_s: float = 600.0, local_rank_arg: int | None = None) -> DistInfo:
    """Initialise torch.distributed from the launcher's env (torchrun or the deepspeed launcher).

    A plain `python train.py` with no launcher env runs as a world of one. The backend is the
    accelerator's (gloo on CPU, NCCL on CUDA); `timeout_s` bounds every collective so a dead
    rank makes the others fail instead of hanging forever."""
    env = os.environ
    if "RANK" not in env:  # single process, no launcher
        env.setdefault("RANK", "0")
        env.setdefault("WORLD_SIZE", "1")
        env.setdefault("LOCAL_RANK", "0")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(_free_port()))
    rank = int(env["RANK"])
    world = int(env["WORLD_SIZE"])
    local_rank = int(env.get("LOCAL_RANK", local_rank_arg if local_rank_arg is not None else 0))
    local_world = int(env.get("LOCAL_WORLD_SIZE", world))

    acc = accelerator()
    backend = acc.communication_backend_name()
    if acc.device_name() == "cpu":
        device = torch.device("cpu")
        # Share the cores between the ranks on this host instead of oversubscribing them.
        if "OMP_NUM_THREADS" not in env or local_world > 1:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        keep_freed_memory()
    else:
        acc.set_device(local_rank)
        device = torch.device(acc.device_name(local_rank))
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    # Groups made later (DeepSpeed clones the world for ZeRO) get torch's default timeout, 30
    # minutes or more, not the world's: make the default ours too.
    from torch.distributed import distributed_c10d as c10d

    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timedelta(seconds=timeout_s)
    from training import liveness

    liveness.set_timeout(timeout_s)  # for the collectives that cannot time out by themselves
    return DistInfo(rank, world, local_rank, local_world, device, backend)


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory in the process instead of unmapping it (CPU training).

    Activations and gradients are allocated and freed every step. glibc serves blocks above its
    mmap threshold with fresh mmaps, and trims the heap back to the OS: every step then
    page-faults its working set in again. Keeping blocks up to 32 MiB on the heap and never
    trimming measured 1.25x the tokens/s of DDP on the `small` preset here (the peak RSS is
    what the process reaches anyway). No-op off glibc. ZEROSTACK_MALLOC=default opts out."""
    if os.environ.get("ZEROSTACK_MALLOC") == "default":
        return False
    import ctypes
    import ctypes.util

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


def shared_memory_all_reduce() -> bool:
    """Send DeepSpeed's all-reduces through its shared-memory kernel (CPU, all ranks on one host).

    On CPU DeepSpeed builds a shared-memory all-reduce (the one its CPU inference uses), but its
    training collectives still go to gloo, which moves every byte through loopback TCP: a 31 MB
    bf16 gradient bucket takes ~33 ms there and ~14 ms in shared memory. ZeRO-0/1/2 reduce
    gradients with synchronous all-reduces over the whole world, so those are the calls routed;
    an async call, a sub-group, another op or dtype, a non-contiguous tensor still go to gloo.
    The kernel has no timeout, so the wait is marked for the liveness watchdog, which names a
    peer that died in it. Call it before `deepspeed.initialize`. Returns whether the route is
    on. ZEROSTACK_SHM_ALLREDUCE=0 opts out."""
    if not dist.is_initialized():
        return False
    import deepspeed
    import deepspeed.comm.comm as ds_comm

    from training import liveness

    env, world = os.environ, dist.get_world_size()
    wanted = env.get("ZEROSTACK_SHM_ALLREDUCE") != "0" and world > 1
    # DeepSpeed sets its segments up when it starts its comm layer, if LOCAL_SIZE (which its
    # launcher sets and torchrun does not) says every rank is on this host.
    fresh = ds_comm.cdb is None
    if fresh and wanted and "LOCAL_SIZE" not in env:
        if int(env.get("LOCAL_WORLD_SIZE", 0)) == world:
            env["LOCAL_SIZE"] = str(world)
    deepspeed.init_distributed(dist_backend=dist.get_backend())  # wraps the existing group
    cdb = ds_comm.cdb
    if hasattr(cdb, "zerostack_shm"):
        return cdb.zerostack_shm
    cdb.zerostack_shm = False
    if getattr(cdb, "shm_comm_op", None) is None or int(env.get("LOCAL_SIZE", 0)) != world:
        return False  # no segments (another host in the world, or no kernel for this CPU)
    # DeepSpeed does not check that its segment was written whole: a full /dev/shm (Docker's
    # default is 64 MB) or a file-size limit leaves a short one, and the kernel would then
    # fault. Every rank must have a whole one, or nobody routes.
    whole = torch.tensor([int(_shm_segment_bytes(dist.get_rank()) >= SHM_SEGMENT_MIN_BYTES)])
    # Once this returns, every rank has mapped every other's segment (DeepSpeed's init does
    # that before it returns): drop our name, so no segment outlives the run (DeepSpeed never
    # unlinks them).
    dist.all_reduce(whole, op=dist.ReduceOp.MIN)
    _unlink_shm_segment(dist.get_rank())
    level = getattr(cdb, "shm_vector_kernel_level", 0)
    if not (wanted and level >= 1 and whole.item()):
        return False
    kernel = torch.ops.deepspeed.inference_all_reduce_
    needs = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 2}  # 2 = avx512bw
    gloo_all_reduce = cdb.all_reduce

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if (
            not async_op
            and tensor.device.type == "cpu"
            and tensor.is_contiguous()
            and level >= needs.get(tensor.dtype, 99)
            and cdb._reduce_op(op) == dist.ReduceOp.SUM
            and (group is None or dist.get_world_size(group) == world)
        ):
            with liveness.waiting():
                kernel(tensor)
            return None
        return gloo_all_reduce(tensor, op=op, group=group, async_op=async_op)

    cdb.all_reduce = all_reduce
    cdb.zerostack_shm = True
    return True


# DeepSpeed's segment holds two 32 MiB buffers and a few flags (66 MiB in 0.19).
SHM_SEGMENT_MIN_BYTES = 64 * 2**20


def _shm_segment(rank: int) -> str:
    """DeepSpeed names each rank's segment after the user, the master address and port."""
    env = os.environ
    name = f"deepspeed_allreduce_buffer_{os.getuid()}_{env.get('MASTER_ADDR', '')}_"
    return f"/dev/shm/{name}{env.get('MASTER_PORT', '')}_{rank}"


def _shm_segment_bytes(rank: int) -> int:
    try:
        return os.stat(_shm_segment(rank)).st_size
    except OSError:
        return 0  # another name scheme, or no /dev/shm: do not route


def _unlink_shm_segment(rank: int) -> None:
    try:
        os.unlink(_shm_segment(rank))
    except OSError:
        pass  # at worst the segment stays, as it would without us


def teardown() -> None:
    """Destroy the process group; skipping this aborts some gloo runs at exit."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def all_reduce_scalars(values: list[float], device: torch.device, op: str = "mean") -> list[float]:
    """Mean (or max) of each value across ranks, in one collective for the whole list."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        if op == "mean":
            t /= dist.get_world_size()
    return t.tolist()


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


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
