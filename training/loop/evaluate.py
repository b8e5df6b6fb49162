"""Validation: loss averaged over every rank's share of a fixed validation set, perplexity and
bits per byte (so runs with different tokenizers compare)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from data import eval_batches


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


class Evaluator:
    """The loop's evaluation: every rank evaluates its data-parallel share; rank 0 logs it."""

    def __init__(self, engine, val_dataset, *, micro_batch: int, max_samples: int, device, logger):
        self.engine, self.val_dataset, self.logger = engine, val_dataset, logger
        self.micro_batch, self.max_samples, self.device = micro_batch, max_samples, device
        self.last: dict = {}  # the latest result

    def __call__(self, step: int) -> dict:
        self.last = evaluate(
            self.engine,
            self.val_dataset,
            micro_batch=self.micro_batch,
            rank=self.engine.dp_rank,
            world=self.engine.dp_world,
            max_samples=self.max_samples,
            device=self.device,
        )
        self.logger.log({"kind": "eval", "step": step, **self.last})
        return self.last
