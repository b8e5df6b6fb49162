"""What the two native-PyTorch engines (DDP, FSDP2) share: precision, accumulation, clipping,
the optimizer step and its skip rule. Each subclass only wraps the model, says how a micro-step
skips gradient sync, and reads and writes its checkpoint files."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from training.engines.base import Engine, OptimizerHparams, StepResult
from training.engines.muon import newton_schulz_in_fp32
from training.engines.nonfinite import poison
from training.engines.optim import group_lr, muon_split, native_optimizer
from training.memory.state_bytes import state_bytes
from training.runtime.flops import DTYPES


class NativeEngine(Engine):
    """Subclasses wrap the model in `_wrap` and implement `save` and `load`."""

    name = "native"

    def __init__(
        self,
        *,
        model,
        optimizer: OptimizerHparams,
        device: torch.device,
        precision: str,
        grad_accum: int,
        grad_clip: float,
    ):
        super().__init__()
        if precision not in DTYPES:
            raise ValueError(f"precision must be one of {sorted(DTYPES)}, got {precision!r}")
        self.device = device
        self.precision = precision
        self.dtype = DTYPES[precision]
        self.grad_accum = grad_accum  # divides the loss, as DeepSpeed's engine.backward does
        self.grad_clip = grad_clip  # 0: no clipping
        muon = muon_split(model)[0]  # by the block classes, which FSDP2's wrapping renames
        # a model built on the meta device is given its values by `_wrap` (FSDP2, construct.py)
        on_meta = any(p.is_meta for p in model.parameters())
        self.model = self._wrap(model if on_meta else model.to(device))
        self.optimizer = native_optimizer(self.module, optimizer, muon, device_type=device.type)
        if optimizer.muon_lr is not None:
            newton_schulz_in_fp32(device.type, precision)
        self.optimizer_config = optimizer
        # fp16 needs loss scaling; bf16 and fp32 have fp32's exponent range and do not.
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None

    # --- what subclasses provide ---------------------------------------------------------
    def _wrap(self, model):
        raise NotImplementedError

    def _no_sync(self):
        """The context of a non-boundary micro-step (DDP: accumulate without reducing)."""
        return contextlib.nullcontext()

    def _autocast(self):
        """Mixed precision of the forward pass (FSDP2 casts parameters itself instead)."""
        return contextlib.nullcontext()

    # --- the engine interface (see base.py) --------------------------
    @property
    def module(self):
        return self.model

    def forward_backward(self, x, y, boundary: bool, num_items=None, reference=None):
        with contextlib.nullcontext() if boundary else self._no_sync():
            with self._autocast():
                loss = self.objective(self.model, x, y, num_items, reference)
            # Mean over the accumulated micro-batches, as DeepSpeed's engine.backward does.
            # A non-finite loss gives non-finite gradients, which step() then skips.
            scaled = poison(loss) / self.grad_accum
            (self.scaler.scale(scaled) if self.scaler else scaled).backward()
        return loss.detach()

    def step(self) -> StepResult:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
            self._agree_on_overflow()
        norm, gated = self._clip(params)
        spike = math.isfinite(norm) and not math.isfinite(gated)
        if self.scaler:
            scale = self.scaler.get_scale()
            if not spike:
                self.scaler.step(self.optimizer)  # skips the update on inf/nan
            self.scaler.update()
            skipped = spike or self.scaler.get_scale() < scale
        else:
            skipped = not math.isfinite(gated)
            if not skipped:
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(
            norm if math.isfinite(norm) else None,
            skipped,
            self.scaler.get_scale() if self.scaler else None,
        )

    def _clip(self, params) -> tuple[float, float]:
        """The global gradient norm before clipping (clipped to grad_clip when it is set), and
        the same through the spike gate (infinite for a spike: nothing is applied)."""
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        if hasattr(norm, "full_tensor"):  # FSDP2: a norm over sharded DTensor gradients
            norm = norm.full_tensor()
        gated = self.spike_gate(norm).to(norm.dtype) if self.spike_gate else norm
        if self.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.grad_clip, gated, foreach=True)
        both = torch.stack([norm.float(), gated.float()]).tolist()  # the step's one host read
        return both[0], both[1]

    def _agree_on_overflow(self) -> None:
        # With sharded gradients each rank sees only its shard's inf/nan: all must skip together.
        if dist.is_initialized() and dist.get_world_size() > 1:
            for found in self.scaler._found_inf_per_device(self.optimizer).values():
                dist.all_reduce(found, op=dist.ReduceOp.MAX)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = group_lr(group, lr, self.optimizer_config)

    @torch.no_grad()
    def eval_loss(self, x, y, num_items=None, reference=None) -> torch.Tensor:
        with self._autocast():
            return self.objective(self.model, x, y, num_items, reference).detach()

    def train(self) -> None:
        self.model.train()

    def eval(self) -> None:
        self.model.eval()

    def state_bytes(self) -> dict[str, int]:
        return state_bytes(self.module, self.optimizer, self.scaler)
