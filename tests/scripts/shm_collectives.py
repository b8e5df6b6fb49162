"""Run under torchrun (2 ranks): DeepSpeed's all-reduce through the shared-memory route gives
gloo's sums, the calls it must not take still work, and no segment is left in /dev/shm.
Prints one JSON line on rank 0."""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import deepspeed.comm as ds  # noqa: E402
import torch.distributed as dist  # noqa: E402

from training.runtime import distributed, shm  # noqa: E402

info = distributed.setup(timeout_s=60)
routed = shm.shared_memory_all_reduce()
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
w = torch.ones(4)
ds.all_reduce(w, async_op=True).wait()
out["async"] = w.tolist()
if rank == 0:
    v = torch.ones(4)
    ds.all_reduce(v, group=sub)
    out["subgroup"] = v.tolist()
out["gloo_calls_fallback"] = gloo_calls[0] - out["gloo_calls_routed"]
out["errors"] = errors
dist.barrier()
if rank == 0:
    print(json.dumps(out))
distributed.teardown()
distributed.exit_process(0)
