"""Muon beside AdamW as one torch optimizer, for the native engines: one step, one state dict.
torch.optim.Muon takes 2-D parameters only, so the embeddings, norms and biases it leaves are
AdamW's (engines/optim.py: muon_split). And on every engine, Muon's Newton-Schulz in fp32 where
a run trains in fp32 on a CPU (`newton_schulz_in_fp32`)."""

from __future__ import annotations

import functools

import torch


class MuonWithAdamW(torch.optim.Optimizer):
    """Owns the two optimizers' param groups (Muon's first) and one state keyed by parameter,
    so the base class's state_dict, load_state_dict, zero_grad and every reader of
    `param_groups` (clipping, the GradScaler, distributed checkpoint) see a single optimizer."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer):
        self.muon, self.adamw = muon, adamw
        self._muon_groups = len(muon.param_groups)
        super().__init__([*muon.param_groups, *adamw.param_groups], {})
        self._link()

    def _link(self) -> None:
        # load_state_dict replaces the groups and the state: hand the new ones back to both.
        self.muon.param_groups = self.param_groups[: self._muon_groups]
        self.adamw.param_groups = self.param_groups[self._muon_groups :]
        self.muon.state = self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss


# ------------------------------------------------------------ Newton-Schulz in an fp32 run on a CPU
# DeepSpeed's and torch's Muon orthogonalize each update in bfloat16 (five Newton-Schulz steps of
# three matmuls each: by FLOP count about 60% of a training step of the small preset at 2,048
# tokens a step). On a CPU without bf16 units that is emulated, several times slower than fp32, and it
# is why `auto` trains such a host in fp32: there both run it in fp32 instead (the iteration is
# the same; fp32 is the more exact of the two). A run that trains in bf16 keeps bf16.
DEEPSPEED_MUON = "deepspeed.runtime.zero.muon.original_muon"


def newton_schulz_in_fp32(device_type: str, precision: str) -> list[str]:
    """In an fp32 run on a CPU: DeepSpeed's and torch's Newton-Schulz compute in float32.
    Returns the patches applied (each only within its verified versions)."""
    if device_type != "cpu" or precision != "fp32":
        return []
    import importlib

    from training.runtime import patches

    done = []
    if patches.verified("muon_ns_fp32_on_cpu_deepspeed"):
        module = importlib.import_module(DEEPSPEED_MUON)
        ds_stock = getattr(module.ns_compute_dtype, "stock", module.ns_compute_dtype)

        def ns_compute_dtype(ns_method: str) -> torch.dtype:
            return torch.float32 if ns_method == "standard" else ds_stock(ns_method)

        ns_compute_dtype.stock = ds_stock
        module.ns_compute_dtype = ns_compute_dtype
        done.append("muon_ns_fp32_on_cpu_deepspeed")
    if patches.verified("muon_ns_fp32_on_cpu_torch"):
        from torch.optim import _muon

        torch_stock = getattr(_muon._zeropower_via_newtonschulz, "stock", None)
        fp32 = functools.partial(newton_schulz, dtype=torch.float32)
        fp32.stock = torch_stock or _muon._zeropower_via_newtonschulz
        _muon._zeropower_via_newtonschulz = fp32
        done.append("muon_ns_fp32_on_cpu_torch")
    return done


def newton_schulz(
    grad: torch.Tensor,
    ns_coefficients: tuple[float, float, float],
    ns_steps: int,
    eps: float,
    *,
    dtype: torch.dtype,
) -> torch.Tensor:
    """torch 2.13's `torch.optim._muon._zeropower_via_newtonschulz` computing in `dtype` where
    it takes bfloat16 (in bfloat16, bit for bit the same: tests/test_muon.py)."""
    if grad.ndim != 2:
        raise ValueError("Input tensor gradient must be a 2D matrix")
    a, b, c = ns_coefficients
    x = grad.to(dtype)
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)  # out of place: in fp32, .to() may return `grad` itself
    for _ in range(ns_steps):
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    if grad.size(0) > grad.size(1):
        x = x.T
    return x
