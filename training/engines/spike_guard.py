"""Skipping a step whose loss or gradient norm is far above its recent level, though finite.

The rule (OLMo-core's SkipStepAdamW, the gradient norm taken in log space): once `warmup` steps
are in the history, a step is a spike when its loss (the mean over every rank) or the log of its
global gradient norm is more than `sigmas` standard deviations above the mean over the last
`window` accepted steps. Gradient norms vary by factors, not by amounts: on small batches their
linear spread has a long upper tail that a linear rule skips as spikes
(benchmarks/spike_rate.py measured it). A spike's figures do not enter the history, so one
spike does not hide the next.

Everything stays on the device: the history is a ring of tensors and the verdict a 0-dim
tensor. It reaches the update through the one check every engine already makes before it
steps: the engine hands its global gradient norm to `gate`, which returns it unchanged, or
infinite for a spike, and the engine's own non-finite rule (DeepSpeed's overflow check,
engines/native.py's) skips the update. The loss and the norm are the same on every rank
(the loss is all-reduced, the norm is global), so every rank skips alike."""

from __future__ import annotations

import contextlib
import importlib
import math

import torch
import torch.distributed as dist

# DeepSpeed's optimizer wrappers (ZeRO-1/2, ZeRO-3, bf16, fp16) each decide a skip by calling
# this function on their global norm, a name each imports into its own module.
DEEPSPEED_NORM_CHECKS = (
    "deepspeed.runtime.zero.stage_1_and_2",
    "deepspeed.runtime.zero.stage3",
    "deepspeed.runtime.bf16_optimizer",
    "deepspeed.runtime.fp16.fused_optimizer",
    "deepspeed.runtime.fp16.unfused_optimizer",
)
CHECK_NAME = "is_invalid_grad_norm"
# What the history's loss row holds, saved with it: a step's mean micro-batch loss (the same on
# any world size or accumulation with the same global batch).
LOSS_SCALE = "micro-batch mean"


def saved_accumulation(trainer_state: dict) -> int:
    """The gradient accumulation a checkpoint's run stepped with, from its trainer state."""
    model_parallel = 1
    for key in ("pipeline_stages", "tensor_parallel", "sequence_parallel"):
        model_parallel *= int(trainer_state.get(key) or 1)
    replicas = max(1, int(trainer_state.get("world", 1)) // model_parallel)
    micro = int(trainer_state.get("micro_batch") or 1)
    return max(1, int(trainer_state.get("global_batch") or micro * replicas) // (micro * replicas))


class SpikeGuard:
    """The rolling history and the verdict of the step in progress. Per step: `begin(loss)`
    before the engine steps, the engine calls `gate(norm)`, then `commit()`."""

    def __init__(
        self, sigmas: float, window: int, warmup: int, device: torch.device, log_norm: bool = True
    ):
        """`log_norm` False: OLMo-core's linear rule for the norm (benchmarks compare the two)."""
        self.sigmas, self.window, self.warmup = float(sigmas), int(window), int(warmup)
        self.log_norm = log_norm
        self.device = device
        # rows: loss, log gradient norm; fp64 so a long run's figures keep their digits
        self.history = torch.zeros(2, window, dtype=torch.float64, device=device)
        self.count = torch.zeros((), dtype=torch.int64, device=device)  # accepted so far
        self.loss = torch.zeros((), dtype=torch.float64, device=device)
        self.norm = torch.full((), math.nan, dtype=torch.float64, device=device)
        self._spiked = torch.zeros((), dtype=torch.bool, device=device)
        self.limits = torch.full((2,), math.inf, dtype=torch.float64, device=device)
        self._judged = self._settled = False
        self._work = None

    def begin(self, step_loss: torch.Tensor) -> None:
        """The step's mean micro-batch loss on this rank; its mean over the ranks is judged (a
        figure that the world size and the accumulation leave alone, so a history carried across
        a resume on another layout still describes the steps after it). All ranks call. The all-reduce of that one number is started here and waited for when
        the engine gives its norm: it runs beside the engine's step instead of before it."""
        loss = step_loss.detach().to(torch.float64).reshape(()).clone()
        self._work = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            self._work = dist.all_reduce(loss, async_op=True)
        self.loss = loss
        self.norm = torch.full((), math.nan, dtype=torch.float64, device=self.device)
        self.limits = self._limits()
        self._judged = False
        self._settled = False

    @property
    def spiked(self) -> torch.Tensor:
        """The step's verdict (a 0-dim bool tensor on the device)."""
        self._settle()
        return self._spiked

    def _settle(self) -> None:
        """The loss's mean over the ranks is in: judge it (once a step)."""
        if self._settled:
            return
        if self._work is not None:
            self._work.wait()  # on a GPU the stream waits, not the host
            self.loss = self.loss / dist.get_world_size()
        self._spiked = self._above(self.loss, 0)
        self._settled = True

    def gate(self, norm):
        """The engine's global gradient norm (a tensor or a number), or infinity when the step is
        a spike by its loss or by this norm. Called at most once per step (a second call, as in
        DeepSpeed's fp16 wrapper that checks twice, returns the same verdict)."""
        t = torch.as_tensor(norm, dtype=torch.float64).to(self.device).reshape(())
        self._settle()
        if not self._judged:
            self.norm = t.detach().clone()
            self._spiked = self._spiked | self._above(self._log(self.norm), 1)
            self._judged = True
        return torch.where(self._spiked, torch.full_like(t, math.inf), t)

    def commit(self) -> None:
        """Add the step's figures to the history, unless it was a spike or not finite."""
        self._settle()
        ok = ~self._spiked & torch.isfinite(self.loss)
        if self._judged:
            ok = ok & torch.isfinite(self.norm)
        slot = (self.count % self.window).reshape(1)  # a tensor index: no host read
        old = self.history.index_select(1, slot)[:, 0]
        norm = torch.nan_to_num(self._log(self.norm), nan=0.0) if self._judged else old[1]
        row = torch.stack([self.loss, norm])  # (a norm never given keeps the row as it was)
        self.history.index_copy_(1, slot, torch.where(ok, row, old)[:, None])
        self.count += ok.to(torch.int64)

    def state_dict(self) -> dict:
        """The accepted history, for a checkpoint's trainer state (plain numbers: JSON keeps
        float64 exactly). Read on the host, so only when saving."""
        return {
            "window": self.window,
            "count": int(self.count),
            "history": self.history.tolist(),
            "loss": LOSS_SCALE,
        }

    def load_state_dict(self, saved: dict | None) -> None:
        """The history a checkpoint saved, so a resumed run judges its next steps as the run
        that never stopped would. Another --spike-window keeps the newest accepted steps that
        fit, oldest first; None (a checkpoint from before the guard kept its history, or saved
        with the guard off) leaves the guard to warm up again. A history whose loss row is
        summed over the micro-batches of a step (checkpoints written before it kept the mean)
        comes with `summed_over`, the accumulation it was summed over, and is divided by it."""
        if not saved:
            return
        history = torch.tensor(saved["history"], dtype=torch.float64, device=self.device)
        if saved.get("loss") != LOSS_SCALE:
            history[0] /= int(saved["summed_over"])
        count, window = int(saved["count"]), int(saved["window"])
        if window == self.window:
            self.history.copy_(history)
            self.count.fill_(count)
            return
        kept = min(count, window, self.window)
        slots = [(count - kept + i) % window for i in range(kept)]  # oldest first
        self.history.zero_()
        self.history[:, :kept] = history[:, slots]
        self.count.fill_(kept)

    def figures(self) -> dict:
        """The step's loss and norm and the thresholds they were held to (host numbers: call only
        when logging)."""
        norm_limit = self.limits[1].exp() if self.log_norm else self.limits[1]
        limits = torch.stack([self.limits[0], norm_limit])
        loss, norm, lim_loss, lim_norm = torch.cat(
            [self.loss[None], self.norm[None], limits]
        ).tolist()
        return {
            "loss": loss,
            "grad_norm": norm,
            "loss_limit": lim_loss,
            "grad_norm_limit": lim_norm,
        }

    def _limits(self) -> torch.Tensor:
        """mean + sigmas * std of each row over the accepted history; infinite in the warm-up."""
        n = torch.clamp(self.count, max=self.window)
        used = (torch.arange(self.window, device=self.device) < n).to(torch.float64)
        k = torch.clamp(n, min=1).to(torch.float64)
        mean = (self.history * used).sum(1) / k
        var = (((self.history - mean[:, None]) * used) ** 2).sum(1) / torch.clamp(k - 1, min=1)
        limit = mean + self.sigmas * var.sqrt()
        return torch.where(n >= self.warmup, limit, torch.full_like(limit, math.inf))

    def _log(self, norm: torch.Tensor) -> torch.Tensor:
        return norm.clamp(min=1e-30).log() if self.log_norm else norm

    def _above(self, value: torch.Tensor, row: int) -> torch.Tensor:
        return torch.isfinite(value) & (value > self.limits[row])


@contextlib.contextmanager
def deepspeed_norm_checks(gate):
    """While DeepSpeed's engine steps: its optimizer wrappers' norm check sees `gate(norm)`, so
    a spike is skipped by DeepSpeed's own overflow path (counters, zeroed gradients, and the
    same decision on every rank). The check already reads its answer on the host, so the gate
    adds no host sync. `gate` None: nothing changes."""
    if gate is None:
        yield
        return
    patched = []
    for name in DEEPSPEED_NORM_CHECKS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        own = getattr(module, CHECK_NAME, None)
        if own is None:
            continue
        setattr(module, CHECK_NAME, lambda norm, own=own: own(gate(norm)))
        patched.append((module, own))
    try:
        yield
    finally:
        for module, own in patched:
            setattr(module, CHECK_NAME, own)
