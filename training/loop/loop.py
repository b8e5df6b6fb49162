"""The one training loop. It drives any engine (DeepSpeed, DDP, FSDP2) through the same small
interface (engines/base.py), so schedule, accumulation, logging, evaluation and checkpoints are
written once. A step: micro-batches through the engine, the optimizer step, one small
collective in which every rank learns what every other saw (a stop signal, a non-finite loss, a
skipped update), then logging, evaluation and saving as the settings ask."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from data.examples import IGNORE_INDEX
from training.engines.base import Engine, StepResult
from training.loop.divergence import BadStepCounter
from training.loop.profile import StepProfiler
from training.loop.routers import router_fields
from training.loop.saver import Saver
from training.loop.schedule import Schedule
from training.loop.skips import NONFINITE_LOSS, NONFINITE_NORM, SPIKE, account
from training.loop.timer import StepTimer
from training.loop.validation import Evaluator
from training.memory.peak import peak_memory_bytes
from training.objectives import figures as objective_figures
from training.runtime import liveness, signals
from training.runtime.distributed import all_gather_object, all_reduce_scalars


@dataclass
class LoopState:
    step: int = 0  # optimizer steps done
    tokens: int = 0  # tokens trained on, all ranks
    skipped: int = 0  # updates not applied (fp16 overflow, non-finite)
    nonfinite: int = 0  # bf16/fp32 steps with a non-finite loss or gradient norm
    skipped_by: dict = field(default_factory=dict)  # reason -> skipped steps (loop/skips.py)
    rollbacks: int = 0  # reloads past troubled data (loop/rollback.py)
    guard: dict | None = None  # the spike guard's history a checkpoint saved (to resume it)


@dataclass(frozen=True)
class LoopConfig:
    """What the loop needs of the run's settings."""

    schedule: Schedule
    grad_accum: int
    tokens_per_step: int  # all ranks
    log_every: int
    eval_every: int  # 0: at the end only
    save_every: int  # 0: at the end only; -1: never
    stop_at: int | None
    max_bad_steps: int
    flops_per_token: float
    ceiling: LiveCeiling  # what MFU divides by
    compiled: str | None = None  # what --compile compiled: the first step's time is said
    profiler: StepProfiler | None = None  # --profile
    token_weighted: bool = False  # masked (chat) data: the loss is weighed by trained tokens
    eval_on_start: bool = False  # an evaluation at step 0 (a fresh run's, not a resume's)

    @property
    def steps(self) -> int:
        return self.schedule.total


@dataclass
class LiveCeiling:
    """What MFU divides by: the matmul peak of all ranks together, fixed unless measured again.
    A step that beats it shows something is wrong: a ceiling measured in a slow spell of a
    shared host, or a FLOP count per token above what the model does. `reprobe` (measured
    ceilings only) then measures again, all ranks at once, and the higher figure stands. A step
    that still beats it (or beats a given ceiling) never raises it: its own rate is what is in
    doubt, so it warns once, naming the FLOP count per token, and that row's MFU reads above
    100%."""

    peak_flops: float
    reprobe: Callable[[], float] | None = None
    ranks: int = 1  # for the note's per-rank figures
    flops_per_token: float = 0.0  # named in the warning: the figure a step above the peak doubts
    warned: bool = False

    def check(self, flops_per_s: float, logger, step: int, timer) -> None:
        """Measure the ceiling again when `flops_per_s` beat it, and warn (once) when it still
        does. All ranks call with the same figure (an all-reduced one): the probe is
        collective."""
        if flops_per_s <= self.peak_flops or self.warned:
            return
        before = self.peak_flops
        if self.reprobe is not None:
            with timer.paused():
                fresh = self.reprobe()
            if fresh > before:
                self.peak_flops = fresh
                logger.log(
                    {
                        "kind": "ceiling",
                        "when": "raised",
                        "step": step,
                        "per_rank_flops": fresh / self.ranks,
                        "note": f"step {step} ran faster than the matmul ceiling "
                        f"({self._per_rank(before)} GFLOP/s per rank), which was measured in a "
                        f"slow spell of the host; measured again: MFU from here on is against "
                        f"{self._per_rank(fresh)}",
                    }
                )
        if flops_per_s <= self.peak_flops:
            return
        self.warned = True
        warning = (
            f"WARNING: step {step} ran at {self._per_rank(flops_per_s)} GFLOP/s per rank, above "
            f"the matmul ceiling ({self._per_rank(self.peak_flops)}): the FLOP count per token "
            f"it used ({self.flops_per_token:,.0f}) is more than the model does, or the ceiling "
            "does not describe the path its products take; MFU reads above 100% in such rows"
        )
        logger.log(
            {
                "kind": "ceiling",
                "when": "beaten",
                "step": step,
                "per_rank_flops": self.peak_flops / self.ranks,
                "step_per_rank_flops": flops_per_s / self.ranks,
                "flops_per_token": self.flops_per_token,
                "warning": warning,
                "note": warning,
            }
        )

    def _per_rank(self, flops: float) -> str:
        return f"{flops / self.ranks / 1e9:,.0f}"


@dataclass(frozen=True)
class Agreed:
    """What every rank learned from the step's one collective."""

    signum: int  # a stop signal some rank received (0: none)
    by_rank: int  # which rank received it
    loss_bad: bool
    skipped: bool
    spiked: bool = False  # the spike guard skipped it (engines/spike_guard.py)


def run(
    engine: Engine,
    loader,
    state: LoopState,
    config: LoopConfig,
    *,
    device: torch.device,
    logger,
    saver: Saver,
    evaluator: Evaluator,
    guard=None,
    rollback=None,
) -> dict:
    """Train until config.steps (or --stop-at, or an agreed stop signal: then `signals.current()
    .honored`); returns the last evaluation. Raises Diverged (see _rolled_back, BadStepCounter)."""
    stop = signals.current()
    bad_steps = BadStepCounter(config.max_bad_steps, state.nonfinite)
    timer = StepTimer()
    losses = LossMeter(device, engine.module)
    first_step = state.step
    engine.train()
    profiler = config.profiler
    if config.eval_on_start and state.step == 0:
        evaluator(0)
    while state.step < config.steps:
        if profiler:
            profiler.before_step(state.step + 1)
        lr = config.schedule.at(state.step)
        engine.set_lr(lr)
        # Model states are counted once, in the run's second step (see log_state_bytes).
        count_states = None
        if state.step == max(first_step, 1):
            count_states = lambda: log_state_bytes(engine, logger, state.step + 1)  # noqa: E731
        started = time.perf_counter()
        step_loss = _micro_batches(
            engine, loader, config.grad_accum, device, count_states, timer, config.token_weighted
        )
        span = _judged(loader, config.grad_accum, guard, step_loss)
        result = engine.step()
        state.step += 1
        if config.compiled and state.step == first_step + 1:  # torch.compile runs in step 1
            logger.console(
                f"torch.compile ({config.compiled}): the first step took "
                f"{time.perf_counter() - started:.1f} s, compiling included"
            )
        state.tokens += config.tokens_per_step
        liveness.note_step(state.step)
        agreed = _agree(stop, step_loss, result, device, guard)
        state.skipped += int(agreed.skipped)
        bad = _count_nonfinite(agreed, result, state, bad_steps, saver, logger)
        if _rolled_back(agreed, result, state, guard, rollback, span, saver, logger, bad_steps):
            losses.take()  # the mean of steps left behind
            continue
        losses.add(step_loss, config.grad_accum, keep=not bad)
        timer.tick()
        if profiler:
            profiler.after_step(state.step, logger)
        logger.advance(1)
        if state.step % config.log_every == 0 or state.step == config.steps:
            _log_train(state, config, lr, result, losses, timer, device, logger, engine)
        if config.eval_every and state.step % config.eval_every == 0:
            with timer.paused():
                evaluator(state.step)
        with timer.paused():
            saver.poll()  # --async-save: seal the save in flight once every rank has written it
        saved = _save_if_due(state, config, bad, saver, timer)
        if agreed.signum:  # every rank agreed to stop: save here and exit (errors.PREEMPTED)
            _stop_here(agreed, state, saver, saved, stop, logger)
            return evaluator.last
        if config.stop_at and state.step >= config.stop_at:
            saver.settle()
            logger.console(f"stopping after step {state.step} (--stop-at)")
            return evaluator.last
    if not (config.eval_every and state.step % config.eval_every == 0):
        evaluator(state.step)
    if config.save_every == 0 or (config.save_every > 0 and state.step % config.save_every):
        saver(state)
    saver.settle()  # the run ends with its last save sealed
    return evaluator.last


def _judged(loader, grad_accum: int, guard, step_loss) -> tuple[int, int]:
    """Before the engine steps: the spike guard (engines/spike_guard.py, its gate set on the
    engine; None: off) judges the step's loss. Returns the [start, end) global samples the step
    read (the reader's position is their end)."""
    if guard is not None:
        guard.begin(step_loss / grad_accum)  # the mean micro-batch loss: no layout in it
    end = loader.consumed_samples
    return end - loader.micro_batch * loader.world * grad_accum, end


def _rolled_back(agreed, result, state, guard, rollback, span, saver, logger, bad_steps) -> bool:
    """Count a skipped step under its reason, give the spike guard the step, and roll the run
    back when its trouble is due (`rollback`: loop/rollback.py's, or None). Returns whether it
    rolled back."""
    why = account(agreed, result, state, guard, logger)
    if guard is not None:
        guard.commit()
    trouble = why in (SPIKE, NONFINITE_LOSS, NONFINITE_NORM)
    if rollback is None or not rollback.note(state, trouble, span, saver, logger):
        return False
    bad_steps.in_a_row = 0
    return True


def _stop_here(agreed, state: LoopState, saver: Saver, saved, stop, logger) -> None:
    """Save at this step, say where a re-run resumes, and mark the stop signal honored."""
    resume_from = saver.stop(state, saved)
    saver.stop_followups()
    logger.console(
        f"stopped by {signals.name(agreed.signum)} (received by rank {agreed.by_rank}) "
        f"after step {state.step}; re-run the same command to resume from "
        f"{resume_from or 'step 0'}"
    )
    stop.honored = True
    stop.signum = stop.signum or agreed.signum  # a peer's signal: say which


class LossMeter:
    """The mean micro-batch loss since the last log line, and the z-loss's part of it (our
    model's z_loss_sum, --z-loss), kept on the device (no host sync per step)."""

    def __init__(self, device: torch.device, model=None):
        self.sum = torch.zeros((), dtype=torch.float32, device=device)
        self.z = torch.zeros((), dtype=torch.float32, device=device)
        self.count = 0
        self.model = model
        self.z_mean = float("nan")  # of the last take(); nan without a z-loss

    def add(self, step_loss: torch.Tensor, micro_batches: int, keep: bool = True) -> None:
        """A step's summed micro-batch loss; `keep` False (a bad step): dropped."""
        z = getattr(self.model, "z_loss_sum", None)
        if z is not None:
            self.model.z_loss_sum = None  # this step's, taken
        if not keep:
            return
        self.sum += step_loss
        self.z = self.z + z if z is not None else self.z
        self.count += micro_batches

    def take(self) -> float:
        has_z = getattr(self.model, "z_loss", 0)
        mean, z = torch.stack([self.sum, self.z]).tolist() if self.count else (math.nan,) * 2
        mean, z = mean / max(self.count, 1), z / max(self.count, 1)
        self.z_mean = z if has_z else math.nan
        self.sum.zero_()
        self.z.zero_()
        self.count = 0
        return mean


def _micro_batches(engine, loader, grad_accum, device, after_first, timer, weighted=False):
    """One step's micro-batches through the engine; returns their summed loss. `after_first`,
    when given, runs after the first micro-batch, its time kept out of tokens/s. `weighted`:
    the step's batches are read first, to weigh each loss by the step's trained tokens."""
    step_loss = torch.zeros((), dtype=torch.float32, device=device)
    batches = [loader.next_batch() for _ in range(grad_accum)] if weighted else None
    weights = {"num_items": token_weights([b[1] for b in batches], device)} if weighted else {}
    for micro in range(grad_accum):
        batch = batches[micro] if weighted else loader.next_batch()
        x, y, *reference = (t.to(device, non_blocking=True) for t in batch)
        loss = engine.forward_backward(
            x,
            y,
            boundary=micro == grad_accum - 1,
            **weights,
            **({"reference": reference[0]} if reference else {}),  # preference pairs
        )
        step_loss += loss.float()
        if micro == 0 and after_first is not None:
            with timer.paused():
                after_first()
    return step_loss


def token_weights(targets: list[torch.Tensor], device) -> float:
    """What each micro-batch's summed per-token loss is divided by, on masked data: the step's
    trained tokens per replica and micro-batch, averaged over every rank (tensor-parallel ranks
    count their shared batch alike). The engines take the mean over micro-batches and replicas,
    so the gradient is the sum of every trained token's loss in the global batch divided once
    by their count, however unevenly the micro-batches hold them. All ranks call."""
    here = sum(float((y != IGNORE_INDEX).sum()) for y in targets)
    (mean,) = all_reduce_scalars([here], device)
    return mean / len(targets) if mean > 0 else 1.0  # no trained token anywhere: a zero loss


def log_state_bytes(engine, logger, step: int) -> None:
    """Once per run, after the first micro-step's backward of a step that is not the run's first
    (resumed runs: their first step after the resume): optimizer
    states exist (torch's AdamW makes them in its first step) and the gradients are held as they
    accumulate (at the boundary DeepSpeed's ZeRO-1 has already partitioned its gradients, so only
    a non-boundary micro-step shows what it keeps). All ranks call."""
    per_rank = all_gather_object(engine.state_bytes())
    worst = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
    logger.log(
        {
            "kind": "state_bytes",
            "step": step,
            **{f"{k}_bytes": v for k, v in worst.items()},
            "per_rank": per_rank,
        }
    )
    logger.console(
        "model states per rank (max over ranks): "
        + ", ".join(f"{k} {v / 2**20:,.1f} MiB" for k, v in worst.items())
    )


def _agree(stop, step_loss: torch.Tensor, result: StepResult, device, guard=None) -> Agreed:
    """One small collective per step: every rank learns of a stop signal, a non-finite loss and
    a skipped update anywhere, so they all count, log and stop alike."""
    signum, by, loss_bad, skipped, spiked = all_reduce_scalars(
        [
            stop.signum,
            stop.rank + 1 if stop.requested else 0,
            float(not torch.isfinite(step_loss)),
            float(result.skipped),
            float(guard.spiked) if guard is not None else 0.0,
        ],
        device,
        op="max",
    )
    return Agreed(int(signum), int(by) - 1, bool(loss_bad), bool(skipped), bool(spiked))


def _count_nonfinite(
    agreed: Agreed, result, state, bad_steps: BadStepCounter, saver: Saver, logger
) -> bool:
    """Whether this step was bad (logged, and counted toward --max-bad-steps)."""
    # fp16: a skipped update with a finite loss is an overflow, the loss scaler's business.
    bad = agreed.loss_bad or (agreed.skipped and result.loss_scale is None)
    bad = bad and not agreed.spiked  # a spike is counted as one (loop/skips.py)
    if bad:
        in_a_row, total = bad_steps.in_a_row + 1, bad_steps.total + 1
        what = "gradient norm" if not agreed.loss_bad else "loss"
        applied = "skipped on every rank" if agreed.skipped else "APPLIED"
        logger.log(
            {
                "kind": "nonfinite",
                "step": state.step,
                "loss_finite": not agreed.loss_bad,
                "update_skipped": agreed.skipped,
                "in_a_row": in_a_row,
                "total": total,
                "note": f"non-finite {what}, update {applied} ({in_a_row} in a row, {total} in "
                "total)",
            }
        )
    bad_steps.update(state.step, bad, saver.latest() if bad else None)
    state.nonfinite = bad_steps.total
    return bad


def _log_train(
    state, config: LoopConfig, lr, result, losses, timer, device, logger, engine
) -> None:
    extra = objective_figures(engine, "train", device)  # DPO's rewards, accuracy
    extra |= router_fields(engine.module, device)  # MoE's router figures ({} for a dense model)
    steps, seconds = timer.lap()
    grad_norm = result.grad_norm if result.grad_norm is not None else float("nan")
    mean_loss, grad_norm, z_loss = all_reduce_scalars(
        [losses.take(), grad_norm, losses.z_mean], device
    )
    tps = steps * config.tokens_per_step / seconds
    # The fastest rank's tokens/s decides a re-probe, so every rank agrees to join it.
    mem, fastest = all_reduce_scalars([peak_memory_bytes(device), tps], device, op="max")
    config.ceiling.check(fastest * config.flops_per_token, logger, state.step, timer)
    mfu = tps * config.flops_per_token / config.ceiling.peak_flops
    logger.log(
        {
            "kind": "train",
            "step": state.step,
            "loss": None if math.isnan(mean_loss) else mean_loss,  # the z-loss's part included
            **({} if math.isnan(z_loss) else {"z_loss": z_loss}),
            "lr": lr,
            "grad_norm": None if math.isnan(grad_norm) else grad_norm,
            "tokens_per_s": tps,
            "mfu": mfu,
            "mfu_peak_flops": config.ceiling.peak_flops,  # against: the run's ceiling, all ranks
            "peak_mem_gb": mem / 2**30,  # the highest rank's
            "skipped": state.skipped,
            "skipped_by": dict(state.skipped_by),
            "nonfinite": state.nonfinite,
            "tokens": state.tokens,
            **({"loss_scale": result.loss_scale} if result.loss_scale else {}),
            **extra,
        }
    )


def _save_if_due(state, config: LoopConfig, bad: bool, saver: Saver, timer) -> bool:
    """Save every --save-every steps (never inside a run of bad steps: keep the last good
    checkpoint), and at --stop-at. Returns whether it saved."""
    if config.save_every > 0 and state.step % config.save_every == 0 and not bad:
        with timer.paused():
            saver(state)
        return True
    if config.stop_at and state.step >= config.stop_at:
        saver(state)
        return True
    return False
