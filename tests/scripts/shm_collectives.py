"""Run under torchrun (2 ranks; 3 and 4 for the order of the sums): DeepSpeed's all-reduces, all-gathers and reduce-scatters, and
FSDP2's, through the shared-memory route give gloo's results, the calls it must not take still
work, and no segment is left in /dev/shm. Prints one JSON line on rank 0."""

import json
import os
import sys

import deepspeed.comm as ds
import deepspeed.runtime.zero.stage3 as stage3
import torch
import torch.distributed as dist

from training.runtime import distributed, shm

info = distributed.setup(timeout_s=60)
if "level1" in sys.argv[1:]:
    # A CPU with AVX2 but no AVX-512 (AMD Zen 3, older Intel): DeepSpeed's kernel reports level 1
    # there and takes float32 only. Simulated by starting DeepSpeed's comm layer first (with its
    # segments: LOCAL_SIZE, which torchrun does not set) and lowering the level it read.
    os.environ.setdefault("LOCAL_SIZE", os.environ["LOCAL_WORLD_SIZE"])
    ds.init_distributed(dist_backend=info.backend)
    ds.comm.cdb.shm_vector_kernel_level = 1
routed = shm.shared_memory_collectives(wanted=sys.argv[1:] != ["off"])  # --shm-collectives
ds.init_distributed(dist_backend=info.backend)  # a no-op when the route did it
rank, world = info.rank, info.world
gloo_calls = [0]
gloo_all_reduce = dist.all_reduce


def counted(*args, **kwargs):  # DeepSpeed's gloo path calls torch.distributed.all_reduce
    gloo_calls[0] += 1
    return gloo_all_reduce(*args, **kwargs)


dist.all_reduce = counted
out = {
    "routed": routed,
    "level": getattr(ds.comm.cdb, "shm_vector_kernel_level", 0),
    "segments_left": sorted(
        n for n in os.listdir("/dev/shm") if n.endswith(f"_{os.environ['MASTER_PORT']}_{rank}")
    ),
}
errors = {}
# Sizes around the kernel's 1 MiB and 32 MiB chunk edges, odd counts included.
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for n in (1, 1001, 262_145, 9_000_017):
        g = torch.Generator().manual_seed(n)
        parts = [torch.randn(n, generator=g).to(dtype) for _ in range(world)]
        want = sum(p.double() for p in parts)
        t = parts[rank].clone()
        ds.all_reduce(t)
        errors[f"{dtype}/{n}"] = float((t.double() - want).abs().max() / want.abs().max())
w = torch.ones(4)
ds.all_reduce(w, async_op=True).wait()
out["async"] = w.tolist()
# All-gathers and reduce-scatters, counted where DeepSpeed hands them to torch (gloo).
cdb = ds.comm.cdb


def counted_by_gloo(f):
    def call(*args, **kwargs):
        gloo_calls[0] += 1
        return f(*args, **kwargs)

    return call


cdb.all_gather_function = counted_by_gloo(cdb.all_gather_function)
cdb.reduce_scatter_function = counted_by_gloo(cdb.reduce_scatter_function)
gathers = {}
for dtype in (torch.float32, torch.bfloat16):
    for n in (1, 1001, 5_000_011):
        g = torch.Generator().manual_seed(n)
        parts = [torch.randn(n, generator=g).to(dtype) for _ in range(world)]
        whole = torch.full((n * world,), float("nan"), dtype=dtype)
        ds.allgather_fn(whole, parts[rank], async_op=True).wait()  # a separate input
        same = torch.equal(whole, torch.cat(parts))
        whole = torch.full((n * world,), float("nan"), dtype=dtype)  # ZeRO-3's way: input is
        whole[rank * n : (rank + 1) * n] = parts[rank]  # this rank's chunk of the output
        ds.allgather_fn(whole, whole[rank * n : (rank + 1) * n], async_op=True).wait()
        gathers[f"{dtype}/{n}"] = same and torch.equal(whole, torch.cat(parts))
        # reduce-scatter: a separate output (input untouched), then DeepSpeed's aliased one
        full = [torch.randn(n * world, generator=g).to(dtype) for _ in range(world)]
        want = sum(f.double() for f in full)[rank * n : (rank + 1) * n]
        mine, kept = torch.empty(n, dtype=dtype), full[rank].clone()
        ds.reduce_scatter_fn(mine, full[rank])
        err = float((mine.double() - want).abs().max() / want.abs().max())
        untouched = torch.equal(full[rank], kept)
        ds.reduce_scatter_fn(full[rank][rank * n : (rank + 1) * n], full[rank])
        got = full[rank][rank * n : (rank + 1) * n]
        err = max(err, float((got.double() - want).abs().max() / want.abs().max()))
        errors[f"{dtype}/scatter/{n}"] = err if untouched else float("inf")
out["gathers"] = gathers
# FSDP2's collectives (engines/fsdp.py hands it these): a gather into a fresh buffer, and the
# average it asks of fp32 gradients, bitwise what gloo's own average gives.
comms = shm.fsdp_comms()
out["fsdp"] = None if comms is None else {}
for n in (1001, 5_000_011) if comms else ():
    g = torch.Generator().manual_seed(n)
    parts = [torch.randn(n, generator=g) for _ in range(world)]
    whole = comms[0].allocate((n * world,), dtype=torch.float32, device=torch.device("cpu"))
    comms[0](output_tensor=whole, input_tensor=parts[rank], group=dist.group.WORLD)
    full = [torch.randn(n * world, generator=g) for _ in range(world)]
    mine, theirs = torch.empty(n), torch.empty(n)
    comms[1](mine, full[rank].clone(), dist.group.WORLD, dist.ReduceOp.AVG)
    dist.reduce_scatter_tensor(theirs, full[rank].clone(), op=dist.ReduceOp.AVG)  # gloo's
    out["fsdp"][n] = torch.equal(whole, torch.cat(parts)) and torch.equal(mine, theirs)
    out.setdefault("fsdp_err", {})[n] = float((mine - theirs).abs().max() / theirs.abs().max())
out["gloo_calls_routed"] = gloo_calls[0]
# Calls that must stay with gloo, and still be right.
sub = dist.new_group([0])
x = torch.full((5,), float(rank + 1))
ds.all_reduce(x, op=ds.ReduceOp.MAX)
out["max"] = x.tolist()
y = torch.arange(10.0).reshape(2, 5).t() * (rank + 1)  # not contiguous
ds.all_reduce(y)
out["noncontiguous"] = float(y.sum())
z = torch.full((3,), rank + 1, dtype=torch.int64)
ds.all_reduce(z)
out["int64"] = z.tolist()
if rank == 0:
    v = torch.ones(4)
    ds.all_reduce(v, group=sub)
    out["subgroup"] = v.tolist()
out["gloo_calls_fallback"] = gloo_calls[0] - out["gloo_calls_routed"]
# ZeRO-3's gradient average (what it calls, the route's when on): this rank's chunk of each
# tensor's mean, bitwise DeepSpeed's way on gloo (each rank's tensor divided, then summed), for
# a bucket's gradients side by side in one buffer (in reverse, as ZeRO-3 sorts them) and for
# tensors apart. Odd sizes: the last rank's chunk is shorter.
out["coalesced"] = {}
for dtype in (torch.float32, torch.bfloat16):
    sizes = (1001, 7, 262_145, 3)
    for side_by_side in (True, False):
        g = torch.Generator().manual_seed(len(sizes) + rank)
        mine = [torch.randn(n, generator=g).to(dtype) for n in sizes]
        want = []
        for t in mine:
            summed = t / world
            gloo_all_reduce(summed)  # gloo, uncounted
            chunk = -(-t.numel() // world)
            want.append(summed[rank * chunk : (rank + 1) * chunk])
        if side_by_side:
            buffer = torch.cat(mine[::-1])
            views, at = [], buffer.numel()
            for t in mine:
                at -= t.numel()
                views.append(buffer.narrow(0, at, t.numel()))
            mine = views
        got = stage3.reduce_scatter_coalesced(mine, dist.group.WORLD)
        key = f"{dtype}/{'side by side' if side_by_side else 'apart'}"
        out["coalesced"][key] = all(torch.equal(a, b) for a, b in zip(got, want))
        out.setdefault("coalesced_err", {})[key] = max(
            float((a.double() - b.double()).abs().max() / b.double().abs().max())
            for a, b in zip(got, want)
            if b.numel()
        )
out["errors"] = errors
dist.barrier()
if rank == 0:
    print(json.dumps(out))
distributed.teardown()
distributed.exit_process(0)
