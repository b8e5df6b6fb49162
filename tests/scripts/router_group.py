"""The load-balancing and z-losses of sequences split over the ranks of the world (sequence
parallelism), each rank holding a contiguous slice: the ranks' shares (`router_stats` and
`pooled_balancing_loss` with the world as their group) against the same losses of the whole
sequences in this process, values and the gradients of the router logits. Rank 0 writes the
largest differences, relative to the whole's, to the JSON file named by argv[1]."""

import json
import sys

import torch
import torch.distributed as dist
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from models.moe import pooled_balancing_loss, router_stats

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
layers, batch, seq, experts, k = 3, 2, 16, 8, 2
g = torch.Generator().manual_seed(0)
whole = [torch.randn(batch, seq, experts, generator=g, dtype=torch.float64) for _ in range(layers)]
real = torch.ones(batch, seq, dtype=torch.bool)
real[1, 11:] = False  # the second row padded at its end: it crosses into the last slice
part = slice(rank * seq // world, (rank + 1) * seq // world)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


out = {}
# ours: per layer, padding left out
mine = [w[:, part].clone().requires_grad_() for w in whole]
full = [w.clone().requires_grad_() for w in whole]
share = router_stats([m.reshape(-1, experts) for m in mine], k, real[:, part], dist.group.WORLD)
ref = router_stats([f.reshape(-1, experts) for f in full], k, real)
(share.aux_loss + share.z_loss).backward()
(ref.aux_loss + ref.z_loss).backward()
summed = torch.stack([share.aux_loss.detach(), share.z_loss.detach()])
dist.all_reduce(summed)
out["ours_loss"] = relative(summed, torch.stack([ref.aux_loss, ref.z_loss]).detach())
out["ours_grad"] = max(relative(m.grad, f.grad[:, part]) for m, f in zip(mine, full, strict=True))
counts = share.tokens_per_expert.clone()
dist.all_reduce(counts)
out["ours_counts_equal"] = bool(torch.equal(counts, ref.tokens_per_expert))
# transformers': every layer's tokens pooled, no padding mask
mine = [w[:, part].reshape(-1, experts).clone().requires_grad_() for w in whole]
full = [w.reshape(-1, experts).clone().requires_grad_() for w in whole]
share = pooled_balancing_loss(tuple(mine), experts, k, dist.group.WORLD)
theirs = load_balancing_loss_func(tuple(full), experts, k)
share.backward()
theirs.backward()
summed = share.detach().clone()
dist.all_reduce(summed)
out["pooled_loss"] = relative(summed, theirs.detach())
grads = [
    relative(m.grad, f.grad.view(batch, seq, experts)[:, part].reshape(-1, experts))
    for m, f in zip(mine, full, strict=True)
]
out["pooled_grad"] = max(grads)
# without the group, each slice's own loss: what sequence parallelism trained before
alone = router_stats([w[:, part].reshape(-1, experts) for w in whole], k, real[:, part])
summed = torch.stack([alone.aux_loss, alone.z_loss])
dist.all_reduce(summed)
out["slices_alone_loss"] = relative(summed, torch.stack([ref.aux_loss, ref.z_loss]).detach())
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)
dist.destroy_process_group()
