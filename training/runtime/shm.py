"""DeepSpeed's shared-memory kernel for training collectives on one CPU host.

On CPU DeepSpeed builds a shared-memory all-reduce (the one its CPU inference uses), but its
training collectives still go to gloo, which moves every byte through loopback TCP; the kernel
is faster per gradient bucket (measured in docs/benchmarks.md). `shared_memory_collectives` routes
DeepSpeed's all-reduces, all-gathers and reduce-scatters (the last two as sums) through it, and
makes sure DeepSpeed's /dev/shm segments never outlive the run and are whole before anything is
routed; ZeRO-3's gradient average (its own coalesced reduce-scatter) is summed in place through
it; `fsdp_comms` hands FSDP2 the same all-gather and reduce-scatter.
"""

from __future__ import annotations

import os

import deepspeed
import deepspeed.comm.comm as ds_comm
import torch
import torch.distributed as dist

from training.runtime import liveness, patches


def shared_memory_collectives(wanted: bool = True, ranks_here: int | None = None) -> bool:
    """Send DeepSpeed's collectives through its shared-memory kernel (CPU, all ranks on one host).

    The kernel only sums, in place, so: an all-reduce is the kernel; an all-gather is a sum
    into zeros (ZeRO-1/2's parameter gathers after the step, ZeRO-3's before each block); a
    reduce-scatter is a sum of the whole buffer of which this rank keeps its chunk; ZeRO-3's
    gradient average (`reduce_scatter_coalesced`, which DeepSpeed's stage 3 calls by name) sums
    a bucket where it lies and divides only this rank's chunks. Two ranks get gloo's bits
    (tested); on more the kernel adds the ranks in another order than gloo, so sums differ in
    the last bit (fp32 rounding, tested on 3 and 4 ranks). Async calls are done before they return
    (gloo's thread would compete for the same cores). A sub-group, another op or dtype, a
    non-contiguous tensor still go to gloo. The kernel has no timeout, so the wait is marked
    for the liveness watchdog, which names a peer that died in it. Call it before
    `deepspeed.initialize` and zero.Init. Returns whether the route is on. `wanted` False (the
    trainer's --shm-collectives off) starts DeepSpeed's comm layer with every collective on
    gloo. `ranks_here`: the world's ranks on this host (runtime/launcher.py; None: all)."""
    if not dist.is_initialized():
        return False

    world = dist.get_world_size()
    one_host = ranks_here is None or ranks_here == world
    wanted = wanted and world > 1 and one_host and patches.verified("shm_route")
    # DeepSpeed sets its segments up when it starts its comm layer, if LOCAL_SIZE (which its
    # launcher sets and the others do not) says every rank is on this host: its own setting,
    # written as its launcher would.
    if ds_comm.cdb is None and wanted and "LOCAL_SIZE" not in os.environ:
        os.environ["LOCAL_SIZE"] = str(world)
    deepspeed.init_distributed(dist_backend=dist.get_backend())  # wraps the existing group
    cdb = ds_comm.cdb
    if hasattr(cdb, "zerostack_shm"):
        return cdb.zerostack_shm
    cdb.zerostack_shm = False
    if getattr(cdb, "shm_comm_op", None) is None or not one_host:
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
    route = _Route(cdb, world, dist.get_rank(), level)
    cdb.all_reduce = route.all_reduce
    cdb.all_gather_into_tensor = route.all_gather_into_tensor
    cdb.reduce_scatter_tensor = route.reduce_scatter_tensor
    cdb.zerostack_shm, cdb.zerostack_route = True, route
    # ZeRO-3 averages its gradient buckets through a function of its own, not the comm layer's
    import deepspeed.runtime.zero.stage3 as stage3

    stage3.reduce_scatter_coalesced = route.reduce_scatter_coalesced
    return True


def fsdp_comms() -> tuple | None:
    """FSDP2's all-gather and reduce-scatter through the same route (its public
    `set_custom_all_gather` / `set_custom_reduce_scatter` take them), or None when the route is
    off: call `shared_memory_collectives` first."""
    route = getattr(ds_comm.cdb, "zerostack_route", None)
    if route is None:
        return None
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    class _AllGather(AllGather):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            return route.all_gather_into_tensor(output_tensor, input_tensor, group, async_op)

    class _ReduceScatter(ReduceScatter):
        allocate = _AllGather.allocate

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            # FSDP2 asks for an average of the gradients (fp32 here): the kernel's sum,
            # divided here as gloo divides its sum (gloo's bits on two ranks; on more, the
            # ranks added in another order: tested).
            if op == dist.ReduceOp.AVG and route.routable(input_tensor, group=group):
                work = route.reduce_scatter_tensor(output_tensor, input_tensor, group=group)
                output_tensor.div_(dist.get_world_size(group))
                return _DONE if async_op else work
            return route.reduce_scatter_tensor(output_tensor, input_tensor, op, group, async_op)

    return _AllGather(), _ReduceScatter()


def routed_dtypes() -> list[str]:
    """The dtypes the route reduces in shared memory (DeepSpeed's kernel level: float32 from
    level 1, AVX2; bf16/fp16 from level 2, AVX-512BW); the rest go to gloo. Empty when off."""
    route = getattr(ds_comm.cdb, "zerostack_route", None)
    if route is None:
        return []
    return [
        str(d).removeprefix("torch.") for d, need in _Route.NEEDS.items() if route.level >= need
    ]


class _Route:
    """DeepSpeed's comm calls, through the kernel where it can take them, else to gloo (the
    comm layer's own methods, kept from before the route)."""

    NEEDS = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 2}  # kernel level; 2 = avx512bw

    def __init__(self, cdb, world: int, rank: int, level: int):
        self.cdb, self.world, self.rank, self.level = cdb, world, rank, level
        self.gloo = cdb.all_reduce, cdb.all_gather_into_tensor, cdb.reduce_scatter_tensor
        self.kernel = torch.ops.deepspeed.inference_all_reduce_
        from deepspeed.runtime.comm.coalesced_collectives import reduce_scatter_coalesced

        self.coalesced = reduce_scatter_coalesced  # DeepSpeed's own, for what the kernel can't take

    def routable(self, tensor, op=dist.ReduceOp.SUM, group=None) -> bool:
        return (
            tensor.device.type == "cpu"
            and tensor.is_contiguous()
            and self.level >= self.NEEDS.get(tensor.dtype, 99)
            and self.cdb._reduce_op(op) == dist.ReduceOp.SUM
            and (group is None or dist.get_world_size(group) == self.world)
        )

    def reduce(self, tensor, async_op: bool):
        with liveness.waiting():
            self.kernel(tensor)
        return _DONE if async_op else None  # an async call is done by the time it returns

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if self.routable(tensor, op, group):
            return self.reduce(tensor, async_op)
        return self.gloo[0](tensor, op=op, group=group, async_op=async_op)

    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        # A sum over zeros: the other ranks' chunks start at zero, so the sum puts each rank's
        # chunk in place bit for bit (only a -0.0 comes back +0.0). ZeRO-3's gathers pass this
        # rank's chunk of the output as the input: it is left as it is.
        n = input_tensor.numel()
        if (
            self.routable(output_tensor, group=group)
            and input_tensor.dtype == output_tensor.dtype
            and n > 0
            and output_tensor.numel() == n * self.world
        ):
            for r, chunk in enumerate(output_tensor.view(-1).split(n)):
                if r != self.rank:
                    chunk.zero_()
                elif chunk.data_ptr() != input_tensor.data_ptr():
                    chunk.copy_(input_tensor.reshape(-1))
            return self.reduce(output_tensor, async_op)
        return self.gloo[1](output_tensor, input_tensor, group=group, async_op=async_op)

    def reduce_scatter_tensor(
        self, output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=None, async_op=False
    ):
        # The whole input is summed and this rank keeps its chunk. DeepSpeed's coalesced
        # reduce-scatter (ZeRO-3's gradients) passes this rank's chunk of its own staging
        # buffer as the output: that buffer is summed in place; any other input is copied.
        n = output_tensor.numel()
        if (
            self.routable(input_tensor, op, group)
            and output_tensor.is_contiguous()
            and output_tensor.dtype == input_tensor.dtype
            and n > 0
            and input_tensor.numel() == n * self.world
        ):
            lo, hi = self.rank * n, (self.rank + 1) * n
            if input_tensor.view(-1)[lo:hi].data_ptr() == output_tensor.data_ptr():
                return self.reduce(input_tensor, async_op)
            whole = input_tensor.clone()
            self.reduce(whole, False)
            output_tensor.view(-1).copy_(whole.view(-1)[lo:hi])
            return _DONE if async_op else None
        return self.gloo[2](output_tensor, input_tensor, op=op, group=group, async_op=async_op)

    def reduce_scatter_coalesced(self, tensors, group=None):
        """ZeRO-3's gradient average, DeepSpeed's `reduce_scatter_coalesced`: this rank's chunk
        of each tensor's mean over the ranks. DeepSpeed copies the ranks' chunks of every
        tensor into a new interleaved buffer, divides all of it by the world and
        reduce-scatters that; the kernel sums whole buffers anyway, so here the gradients are
        summed where they lie (ZeRO-3 keeps a bucket's gradients side by side in one buffer)
        and only this rank's chunks are divided: no copy, a world-th of the division. On two
        ranks, DeepSpeed's bits; on more, its sum in another order (tested on 2, 3 and 4)."""
        if not tensors or not all(self.routable(t, group=group) for t in tensors):
            return self.coalesced(tensors, group)
        region = _one_region(tensors)
        if region is not None:
            self.reduce(region, False)
            flats = [t.view(-1) for t in tensors]  # summed in place
        else:
            flat = torch.cat([t.reshape(-1) for t in tensors])
            self.reduce(flat, False)
            flats = flat.split([t.numel() for t in tensors])
        out = []
        for f in flats:
            n = f.numel()
            chunk = -(-n // self.world)  # DeepSpeed's split: ceil, the last rank's shorter
            lo, hi = min(self.rank * chunk, n), min((self.rank + 1) * chunk, n)
            out.append(f.narrow(0, lo, hi - lo).div_(self.world))
        return out


def _one_region(tensors) -> torch.Tensor | None:
    """A flat view over the memory `tensors` tile without gaps or overlaps (in any order) in
    one storage, else None."""
    first = tensors[0]
    storage, size = first.untyped_storage().data_ptr(), first.element_size()
    if not all(
        t.is_contiguous() and t.dtype == first.dtype and t.untyped_storage().data_ptr() == storage
        for t in tensors
    ):
        return None
    ordered = sorted(tensors, key=lambda t: t.data_ptr())
    at = ordered[0].data_ptr()
    for t in ordered:
        if t.data_ptr() != at:
            return None
        at += t.numel() * size
    low = ordered[0]
    return low.as_strided((sum(t.numel() for t in tensors),), (1,), low.storage_offset())


class _Done:
    """The handle of an async call the route finished before returning."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


_DONE = _Done()


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
