"""What a mixture-of-experts model's routers did since the last log line, over every rank: the
load-balancing and z-losses the training loss took (means; each a mean over the layers, padding
left out: models/moe.py `router_stats`) and the fewest and most real tokens any expert received
(sums over the ranks' micro-batches), as fields of the train line of metrics.jsonl."""

from __future__ import annotations

import torch
import torch.distributed as dist

from models import router_metrics, take_router_totals


def router_fields(model: torch.nn.Module, device: torch.device) -> dict:
    """{} for a model without routers (every rank alike, so the collective is all or none)."""
    stats = take_router_totals(model)
    if stats is None:
        return {}
    losses = torch.stack([stats.aux_loss, stats.z_loss]).to(device, torch.float64)
    tokens = stats.tokens_per_expert.to(device, torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        flat = torch.cat([losses, tokens.flatten()])
        dist.all_reduce(flat)
        losses, tokens = flat[:2] / dist.get_world_size(), flat[2:].view_as(tokens)
    stats.aux_loss, stats.z_loss, stats.tokens_per_expert = losses[0], losses[1], tokens
    return router_metrics(stats)
