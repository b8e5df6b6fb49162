"""The one training loop. It drives any engine (DeepSpeed, DDP, FSDP2) through the same small
interface, so schedule, accumulation, logging, evaluation and checkpoints are written once."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from training import checkpoint
from training.distributed import all_gather_object, all_reduce_scalars
from training.engines import data_parallel
from training.evaluate import evaluate
from training.metrics import peak_memory_bytes
from training.schedule import lr_at


@dataclass
class LoopState:
    step: int = 0  # optimizer steps done
    tokens: int = 0  # tokens trained on, all ranks
    skipped: int = 0  # updates not applied (fp16 overflow, non-finite)


def run(
    *,
    engine,
    loader,
    val_dataset,
    state: LoopState,
    settings,
    dist,
    logger,
    run_dir: Path,
    grad_accum: int,
    micro_batch: int,
    flops_per_token: float,
    peak_flops: float,
    trainer_extra: dict,
) -> dict:
    """Train until settings.steps; returns the last evaluation."""
    device = dist.device
    seq_len = settings.seq_len
    dp_rank, dp_world = data_parallel(engine, dist)
    tokens_per_step = micro_batch * grad_accum * dp_world * seq_len
    ckpt_root = run_dir / "checkpoints"
    last_eval: dict = {}

    def do_save():
        trainer_state = {
            "step": state.step,
            "tokens": state.tokens,
            "skipped": state.skipped,
            "data": loader.state_dict(),
            "world": dist.world,
            **trainer_extra,
        }
        checkpoint.save(
            engine, ckpt_root, state.step, trainer_state, settings.keep_last, dist.is_main
        )
        logger.console(f"saved checkpoint {checkpoint.tag_for(state.step)}")

    def do_eval():
        nonlocal last_eval
        last_eval = evaluate(
            engine,
            val_dataset,
            micro_batch=micro_batch,
            rank=dp_rank,
            world=dp_world,
            max_samples=settings.eval_samples,
            device=device,
        )
        logger.log({"kind": "eval", "step": state.step, **last_eval})

    def log_state_bytes():
        # Once per run, after the first micro-step's backward of a step that is not the run's
        # first: optimizer states exist (torch's AdamW makes them in its first step) and the
        # gradients are held as they accumulate (at the boundary DeepSpeed's ZeRO-1 has already
        # partitioned its gradients, so only a non-boundary micro-step shows what it keeps).
        per_rank = all_gather_object(engine.state_bytes())
        worst = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
        logger.log(
            {
                "kind": "state_bytes",
                "step": state.step + 1,
                **{f"{k}_bytes": v for k, v in worst.items()},
                "per_rank": per_rank,
            }
        )
        logger.console(
            "model states per rank (max over ranks): "
            + ", ".join(f"{k} {v / 2**20:,.1f} MiB" for k, v in worst.items())
        )

    engine.train()
    state_logged = False
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)  # no host sync per step
    n_loss, t_last, steps_since = 0, time.perf_counter(), 0
    while state.step < settings.steps:
        lr = lr_at(
            state.step,
            lr=settings.lr,
            warmup=settings.warmup,
            total=settings.steps,
            min_lr_ratio=settings.min_lr_ratio,
        )
        engine.set_lr(lr)
        for micro in range(grad_accum):
            x, y = loader.next_batch()
            loss = engine.forward_backward(
                x.to(device, non_blocking=True),
                y.to(device, non_blocking=True),
                boundary=micro == grad_accum - 1,
            )
            loss_sum += loss.float()
            n_loss += 1
            if not state_logged and state.step >= 1:
                t0 = time.perf_counter()
                log_state_bytes()
                state_logged = True
                t_last += time.perf_counter() - t0  # keep the count out of tokens/s
        result = engine.step()
        state.step += 1
        state.tokens += tokens_per_step
        state.skipped += int(result.skipped)
        steps_since += 1
        logger.advance(1)

        if state.step % settings.log_every == 0 or state.step == settings.steps:
            elapsed = time.perf_counter() - t_last
            mean_loss, grad_norm = all_reduce_scalars(
                [
                    loss_sum.item() / max(1, n_loss),
                    result.grad_norm if result.grad_norm is not None else float("nan"),
                ],
                device,
            )
            tps = steps_since * tokens_per_step / elapsed
            (mem,) = all_reduce_scalars([peak_memory_bytes(device)], device, op="max")
            logger.log(
                {
                    "kind": "train",
                    "step": state.step,
                    "loss": mean_loss,
                    "lr": lr,
                    "grad_norm": None if math.isnan(grad_norm) else grad_norm,
                    "tokens_per_s": tps,
                    "mfu": tps * flops_per_token / peak_flops,
                    "peak_mem_gb": mem / 2**30,  # the highest rank's
                    "skipped": state.skipped,
                    "tokens": state.tokens,
                    **({"loss_scale": result.loss_scale} if result.loss_scale else {}),
                }
            )
            loss_sum.zero_()
            n_loss, steps_since, t_last = 0, 0, time.perf_counter()

        if settings.eval_every and state.step % settings.eval_every == 0:
            do_eval()
            t_last = time.perf_counter()  # keep eval time out of tokens/s
        if settings.save_every > 0 and state.step % settings.save_every == 0:
            do_save()
            t_last = time.perf_counter()
        elif settings.stop_at and state.step >= settings.stop_at:
            do_save()
        if settings.stop_at and state.step >= settings.stop_at:
            logger.console(f"stopping after step {state.step} (--stop-at)")
            return last_eval

    if not (settings.eval_every and state.step % settings.eval_every == 0):
        do_eval()
    if (
        not (settings.save_every > 0 and state.step % settings.save_every == 0)
        and settings.save_every >= 0
    ):
        do_save()
    return last_eval
