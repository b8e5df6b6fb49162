"""Validation: loss averaged over every rank's share of a fixed validation set, perplexity and
bits per byte (so runs with different tokenizers compare)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def evaluate(
    engine,
    val_dataset,
    *,
    micro_batch: int,
    rank: int,
    world: int,
    max_samples: int | None,
    device: torch.device,
) -> dict:
    """Returns {"val_loss", "ppl", "bpb"}; every rank must call it (ZeRO-3 forwards gather)."""
    from data import eval_batches

    engine.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # sum of losses, batches
    for x, y in eval_batches(val_dataset, micro_batch, rank, world, max_samples=max_samples):
        loss = engine.eval_loss(x.to(device), y.to(device))
        total[0] += loss.double()
        total[1] += 1
    engine.train()
    if dist.is_initialized() and world > 1:
        dist.all_reduce(total)
    val_loss = (total[0] / total[1].clamp(min=1)).item()
    bpb = val_loss / math.log(2) / val_dataset.bytes_per_token
    return {"val_loss": val_loss, "ppl": math.exp(min(val_loss, 50.0)), "bpb": bpb}
