"""Validation: loss averaged over every rank's share of a fixed validation set, perplexity and
bits per byte (so runs with different tokenizers compare). For a data mixture, each source's
validation set is evaluated on its own (`val_loss/NAME`, `bpb/NAME`) and the mixture's figures
are those of its weights: the loss and the bytes per token the training mix would see."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from data import Mixture, eval_batches
from data.examples import IGNORE_INDEX
from data.manifest import small_val_warning
from training.objectives import figures as objective_figures


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
    """Returns {"val_loss", "ppl", "bpb"}, plus "val_loss/NAME" and "bpb/NAME" for each source
    of a Mixture (`max_samples` windows each); for preference pairs the objective's loss and
    figures (val_accuracy, val_margin, ...). Every rank must call it (ZeRO-3 forwards gather)."""
    if not isinstance(val_dataset, Mixture):
        loss = _mean_loss(engine, val_dataset, micro_batch, rank, world, max_samples, device)
        if getattr(val_dataset, "pairs", False):  # a DPO loss has no perplexity nor bits/byte
            return {"val_loss": loss, **objective_figures(engine, "eval", device)}
        return _figures(loss, val_dataset.bytes_per_token)
    out, mix_loss, mix_bpt = {}, 0.0, 0.0
    for part, ds in val_dataset.sources():
        loss = _mean_loss(engine, ds, micro_batch, rank, world, max_samples, device)
        out[f"val_loss/{part.name}"] = loss
        out[f"bpb/{part.name}"] = _figures(loss, ds.bytes_per_token)["bpb"]
        mix_loss += float(part.weight) * loss
        mix_bpt += float(part.weight) * ds.bytes_per_token
    return {**_figures(mix_loss, mix_bpt), **out}


def _mean_loss(engine, dataset, micro_batch, rank, world, max_samples, device) -> float:
    """The mean loss over batches; on masked (chat) data over trained tokens."""
    engine.eval()
    masked = getattr(dataset, "masked", False)
    total = torch.zeros(2, dtype=torch.float64, device=device)  # sum of losses, batches/tokens
    for x, y, *reference in eval_batches(
        dataset, micro_batch, rank, world, max_samples=max_samples
    ):
        if reference:  # preference pairs: the objective's mean over the batch's pairs
            total[0] += engine.eval_loss(
                x.to(device), y.to(device), reference=reference[0].to(device)
            ).double()
            total[1] += 1
            continue
        if masked:  # the per-token losses' sum, and how many tokens it holds
            total[0] += engine.eval_loss(x.to(device), y.to(device), num_items=1.0).double()
            total[1] += int((y != IGNORE_INDEX).sum())
            continue
        loss = engine.eval_loss(x.to(device), y.to(device))
        total[0] += loss.double()
        total[1] += 1
    engine.train()
    if dist.is_initialized() and world > 1:
        dist.all_reduce(total)
    return (total[0] / total[1].clamp(min=1)).item()


def _figures(val_loss: float, bytes_per_token: float) -> dict:
    bpb = val_loss / math.log(2) / bytes_per_token
    return {"val_loss": val_loss, "ppl": math.exp(min(val_loss, 50.0)), "bpb": bpb}


class Evaluator:
    """The loop's evaluation: every rank evaluates its data-parallel share; rank 0 logs it."""

    def __init__(self, engine, val_dataset, *, micro_batch: int, max_samples: int, device, logger):
        self.engine, self.val_dataset, self.logger = engine, val_dataset, logger
        self.micro_batch, self.max_samples, self.device = micro_batch, max_samples, device
        self.last: dict = {}  # the latest result
        sets = val_dataset.datasets if isinstance(val_dataset, Mixture) else [val_dataset]
        for warning in filter(None, (small_val_warning(d.manifest) for d in sets)):
            logger.console(warning)  # the figures below come from a small sample

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
