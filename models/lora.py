"""LoRA adapters through peft: the `--lora` spec, the modules it targets, and the wrapped model.

    --lora r=16,alpha=32,dropout=0.05,targets=q_proj,v_proj

Every key is optional (`--lora r=8`, or `--lora default` for all defaults). Without `targets` the
adapters go on every attention and MLP projection the model has: `wq wk wv wo w1 w2 w3` for our
model (and Llama folders, which load into it), `q_proj k_proj v_proj o_proj gate_proj up_proj
down_proj` for Qwen-, Mistral- and other Llama-shaped HF models. A target names the last part of
a module's name (peft's rule); each must match at least one linear layer. A mixture-of-experts
model's routed experts are stacked weights, not linear layers: they stay frozen, and a target
naming them is refused.

The base weights are frozen (`requires_grad=False`): only the adapters train, so only they have
gradients and optimizer states. Parameter names gain peft's prefix (`base_model.model.`) and
`base_layer` / `lora_A.default` parts; checkpoints hold them under those names.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

import torch
from torch import nn

from models.errors import ModelError
from models.hf_adapter import _PER_BLOCK, _TOP_LEVEL

OURS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
HF = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEYS = {"r": int, "alpha": float, "dropout": float, "targets": str}
PREFIX = "base_model.model."  # what peft puts before the wrapped model's own names


@dataclass(frozen=True)
class LoraSpec:
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.05
    targets: tuple[str, ...] = ()  # empty: the model's default projections

    def as_record(self) -> dict:
        return asdict(self) | {"targets": list(self.targets)}

    def as_text(self) -> str:
        """The --lora text that parses back to this spec."""
        text = f"r={self.r},alpha={self.alpha:g},dropout={self.dropout:g}"
        return text + (f",targets={','.join(self.targets)}" if self.targets else "")


def parse_lora(text: str) -> LoraSpec:
    """'r=16,alpha=32,dropout=0.05,targets=q_proj,v_proj' -> LoraSpec; a word without '=' after
    targets= is one more target. Raises ModelError naming the bad part."""
    values: dict = {}
    key = None
    for part in [p.strip() for p in text.split(",") if p.strip() and p.strip() != "default"]:
        if "=" not in part:
            if key != "targets":
                raise ModelError(f"--lora {text}: {part!r} is not key=value ({', '.join(_KEYS)})")
            values["targets"] += (part,)
            continue
        key, value = (s.strip() for s in part.split("=", 1))
        if key not in _KEYS:
            raise ModelError(f"--lora {text}: unknown key {key!r}; keys: {', '.join(_KEYS)}")
        try:
            values[key] = (value,) if key == "targets" else _KEYS[key](value)
        except ValueError:
            raise ModelError(f"--lora {text}: {key}={value} is not a number") from None
    spec = LoraSpec(**values)
    if spec.r < 1 or spec.alpha <= 0 or not 0 <= spec.dropout < 1:
        raise ModelError(f"--lora {text}: need r >= 1, alpha > 0 and 0 <= dropout < 1")
    return spec


def stored_lora(value: dict | str | None) -> LoraSpec | None:
    """The spec a checkpoint holds: its fields (LoraSpec.as_record), or the --lora text of
    checkpoints written before they held the fields; None for a run without LoRA."""
    if not value:
        return None
    if isinstance(value, str):
        return parse_lora(value)
    try:
        if set(value) - set(_KEYS):
            raise ValueError(f"unknown fields {sorted(set(value) - set(_KEYS))}")
        fields = {k: _KEYS[k](v) for k, v in value.items() if k != "targets"}
        return LoraSpec(**fields, targets=tuple(str(t) for t in value.get("targets", ())))
    except (TypeError, ValueError, AttributeError) as e:
        raise ModelError(f"the stored LoRA spec {value!r} does not read back: {e}") from None


def linear_names(model: nn.Module) -> dict[str, int]:
    """{last name part: how many} of the model's linear layers (peft's unit of targeting)."""
    out: dict[str, int] = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            out[name.rsplit(".", 1)[-1]] = out.get(name.rsplit(".", 1)[-1], 0) + 1
    return out


def stacked_experts(model: nn.Module) -> set[str]:
    """Last name parts of the routed experts' stacked weights (ours, Mixtral's, Qwen3-MoE's:
    `gate_up_proj`, `down_proj`), and `experts` itself."""
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_parameters() if ".experts." in n}
    return names | ({"experts"} if names else set())


def targets(model: nn.Module, spec: LoraSpec) -> list[str]:
    """The module names the adapters go on; ModelError when one matches nothing, or when the
    model has none of the default projections."""
    have = linear_names(model)
    if spec.targets:
        stacked = [t for t in spec.targets if t in stacked_experts(model)]
        if stacked:
            raise ModelError(
                f"--lora targets={stacked[0]}: the routed experts are stacked weights (one "
                "parameter holds a projection of every expert), which these adapters do not "
                "wrap; LoRA trains an MoE model's attention and shared-expert projections"
            )
        missing = [t for t in spec.targets if t not in have]
        if missing:
            raise ModelError(
                f"--lora targets={missing[0]} matches no linear layer of the model; it has: "
                f"{', '.join(sorted(have))}"
            )
        return list(spec.targets)
    found = [t for t in (*OURS, *HF) if t in have]
    if not found:
        raise ModelError(
            "--lora: the model has none of the default projections "
            f"({', '.join(OURS + HF)}); name them with targets=..., from: {', '.join(sorted(have))}"
        )
    return found


def trainable_count(model: nn.Module, spec: LoraSpec) -> int:
    """Parameters the adapters add (all that trains): r x (in + out) per targeted linear layer.
    Works on a meta-device model."""
    names = set(targets(model, spec))
    return sum(
        spec.r * (m.in_features + m.out_features)
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in names
    )


def lora_config(model: nn.Module, spec: LoraSpec, target_modules=None):
    from peft import LoraConfig

    return LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=list(target_modules or targets(model, spec)),
        bias="none",
        task_type="CAUSAL_LM",
    )


def apply_lora(model: nn.Module, spec: LoraSpec, seed: int, in_base_dtype: bool = False):
    """The model wrapped in peft's PeftModelForCausalLM with fresh adapters, base frozen. The
    adapters' initial values come from `seed` alone, so every rank and every engine (ZeRO-3
    builds consume the global RNG differently) starts from the same ones. `in_base_dtype`:
    the adapters take the dtype of the base weights they sit on (for an engine that keeps fp32
    masters of what it trains, as DeepSpeed does), not peft's fp32, which on a 16-bit base
    makes every adapted layer keep an fp32 copy of its input for backward."""
    from peft import get_peft_model

    config = lora_config(model, spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, config, autocast_adapter_dtype=not in_base_dtype)


def is_adapter(name: str) -> bool:
    return ".lora_" in name


def base_name(name: str) -> str:
    """A wrapped model's parameter name -> the base model's own name for it."""
    return name.removeprefix(PREFIX).replace(".base_layer.", ".")


def adapter_state_dict(peft_model) -> dict[str, torch.Tensor]:
    """The adapters under the names peft saves them (`...wq.lora_A.weight`, no adapter name)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(peft_model)


# ours -> Llama's module names, from the one table of renames (models/hf_adapter.py)
_MODULES = {a.removesuffix(".weight"): b.removesuffix(".weight") for a, b in _PER_BLOCK}
_TOP = {a.removesuffix(".weight"): b.removesuffix(".weight") for a, b in _TOP_LEVEL}
_BLOCK = re.compile(r"layers\.(\d+)\.(.+)")


def to_llama_adapter(sd: dict, target_modules: list[str]) -> tuple[dict, list[str]]:
    """Our model's adapter state dict and targets -> the same for LlamaForCausalLM's names, so
    the adapter loads on the Llama folder our model was exported to or loaded from."""
    out = {}
    for key, t in sd.items():
        module, part = key.removeprefix(PREFIX).split(".lora_", 1)
        m = _BLOCK.fullmatch(module)
        renamed = (
            f"model.layers.{m.group(1)}.{_MODULES[m.group(2)]}" if m else _TOP.get(module, module)
        )
        out[f"{PREFIX}{renamed}.lora_{part}"] = t
    last = {
        a.rsplit(".", 1)[-1]: b.rsplit(".", 1)[-1] for a, b in (*_MODULES.items(), *_TOP.items())
    }
    return out, [last.get(t, t) for t in target_modules]
