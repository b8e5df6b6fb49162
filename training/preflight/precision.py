"""The run's precision: what the user asked (--precision, else the config's bf16/fp16 sections,
where `"enabled": "auto"` asks the host to choose) made concrete for the device, once, before any
model is built, with why.

- A GPU decides by what it has: bf16 where the device supports it (A100, H100, ...), else fp16
  with DeepSpeed's dynamic loss scaling (V100, T4; DDP/FSDP2: their GradScaler).
- A CPU decides by measuring: bf16 and fp32 matmuls on the model's own shapes, every rank at
  once (runtime/flops.py: probe_ranks); bf16 only where it is at least as fast as fp32 (AVX512-BF16
  and AMX hosts run it 2-10x faster; a CPU with only AVX2 runs it 20-30x slower, which made a
  200-step quickstart take hours). That measurement needs the process group, so a CPU's "auto"
  is planned as bf16 in preflight and settled by `settle` once the group is up.
- An explicit bf16 or fp16 that measured more than SLOW times slower than fp32 on this CPU (bf16
  without bf16 units; fp16, which few CPUs have kernels for) runs as asked and is warned about in
  one line, with both rates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from training.errors import ConfigError

CHOICES = ("auto", "bf16", "fp16", "fp32")
SLOW = 2.0  # an explicit 16-bit choice this many times slower than fp32 on a CPU: warned
PLANNED = "bf16"  # what a CPU's "auto" is planned as until it is measured


@dataclass(frozen=True)
class Precision:
    """The precision a run trains in, what was asked, and why."""

    name: str  # bf16 | fp16 | fp32
    asked: str  # auto | bf16 | fp16 | fp32
    why: str
    rates: dict = field(default_factory=dict)  # {dtype: FLOP/s per rank}, where measured
    warning: str | None = None  # an explicit choice that is slow here

    @property
    def measured(self) -> bool:
        return bool(self.rates)

    def as_record(self) -> dict:
        return {
            "picked": self.name,
            "asked": self.asked,
            "why": self.why,
            "rates_flops": dict(self.rates),
            "warning": self.warning,
        }

    def line(self) -> str:
        """The run's first log line about it."""
        return f"precision {self.name} ({self.asked}): {self.why}"


def asked(flag: str | None, cfg: dict, source: str = "config") -> str:
    """--precision, else the config: "auto" where its bf16 (or fp16) section says so."""
    if flag:
        return flag
    fp16 = cfg.get("fp16", {}).get("enabled", False)
    bf16 = cfg.get("bf16", cfg.get("bfloat16", {})).get("enabled", False)
    if "auto" in (fp16, bf16):
        if True in (fp16, bf16):
            raise ConfigError(f'{source}: one of bf16/fp16 is "auto" and the other true: pick one')
        return "auto"
    if fp16 and bf16:
        raise ConfigError(f"{source}: fp16.enabled and bf16.enabled are both true: pick one")
    return "fp16" if fp16 else "bf16" if bf16 else "fp32"


def apply(cfg: dict, name: str) -> dict:
    """The config with its precision sections saying `name` (fp16 with dynamic loss scaling
    unless the config sets its own scale); a copy."""
    cfg = {**cfg}
    bf16_key = "bfloat16" if "bfloat16" in cfg and "bf16" not in cfg else "bf16"
    cfg[bf16_key] = {**cfg.get(bf16_key, {}), "enabled": name == "bf16"}
    fp16 = {**cfg.get("fp16", {}), "enabled": name == "fp16"}
    if name == "fp16":
        fp16.setdefault("loss_scale", 0)  # 0: DeepSpeed's dynamic loss scaling
    if name == "fp16" or "fp16" in cfg:
        cfg["fp16"] = fp16
    return cfg


def needs_probe(asked_for: str, device_type: str) -> bool:
    """A CPU measures bf16 against fp32 for "auto" (to choose) and for bf16/fp16 (to warn)."""
    return device_type == "cpu" and asked_for != "fp32"


def decide(
    asked_for: str,
    device_type: str,
    *,
    rates: dict[str, float] | None = None,
    bf16_supported: bool = True,
) -> Precision:
    """The precision for `asked_for` on this device: pure, from what the device says it supports
    (GPUs) or what was measured (`rates`: mean FLOP/s per rank by dtype, CPUs)."""
    rates = dict(rates or {})
    if asked_for not in CHOICES:
        raise ConfigError(f"precision {asked_for!r}: choose one of {', '.join(CHOICES)}")
    bf16, fp32 = rates.get("bf16"), rates.get("fp32")
    if asked_for != "auto":
        own = rates.get(asked_for)
        measured = _rates(asked_for, own, fp32) if own and fp32 and asked_for != "fp32" else ""
        warning = None
        if device_type == "cpu" and measured and fp32 > SLOW * own:
            warning = (
                f"warning: {asked_for} runs {fp32 / own:.0f}x slower than fp32 on this CPU "
                f"({measured}, measured now): training as asked; --precision auto (or "
                "ds_configs/fp32.json) would pick fp32"
            )
        why = "asked for" + (f" ({measured})" if measured else "")
        return Precision(asked_for, asked_for, why, rates, warning)
    if device_type != "cpu":
        if bf16_supported:
            return Precision("bf16", "auto", f"{device_type} supports bf16", rates)
        return Precision(
            "fp16", "auto", f"{device_type} without bf16: fp16, dynamic loss scaling", rates
        )
    measured = _rates("bf16", bf16, fp32)
    if not (bf16 and fp32):
        raise ValueError("a CPU's auto precision needs measured bf16 and fp32 rates")
    if bf16 >= fp32:
        return Precision("bf16", "auto", f"measured bf16 at least as fast: {measured}", rates)
    return Precision(
        "fp32", "auto", f"measured bf16 {fp32 / bf16:.1f}x slower than fp32: {measured}", rates
    )


def _rates(name: str, own: float | None, fp32: float | None) -> str:
    if not (own and fp32):
        return ""
    return f"{name} {own / 1e9:,.1f} vs fp32 {fp32 / 1e9:,.1f} GFLOP/s per rank"
