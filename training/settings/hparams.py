"""The optimizer's numbers and the learning-rate schedule, under one rule: a flag given on the
command line wins over the DeepSpeed JSON's value, which wins over the default.

The JSON's `optimizer` section (type Adam or AdamW) gives lr, betas, eps and weight_decay; its
`scheduler` section (WarmupLR, WarmupDecayLR or WarmupCosineLR) gives the schedule, computed by
training/loop/schedule.py exactly as DeepSpeed's own class would (every engine, not only
DeepSpeed's, so it is one pure function of the step). Without a scheduler section the schedule is
zerostack's: linear warmup, cosine decay to --min-lr-ratio. The resolved numbers are written
back into both sections, so the run's resolved_config.json says what was used. With
--optimizer muon on DeepSpeed the section becomes DeepSpeed's Muon (`muon_section`).
"""

from __future__ import annotations

import math

from training.errors import ConfigError
from training.settings.ds_sections import is_whole, near
from training.settings.run_config import OptimConfig

DEFAULTS = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
DEFAULT_WARMUP = 20
DEFAULT_MIN_LR_RATIO = 0.1

OPTIMIZERS = ("adam", "adamw")  # DeepSpeed reads the type case-insensitively
# The rest of DeepSpeed's optimizer types: known, but zerostack wires Adam/AdamW (and Muon, by
# --optimizer muon) only.
OTHER_DS_OPTIMIZERS = ("adagrad", "lamb", "lion", "muadam", "muadamw", "musgd")
# --optimizer muon on DeepSpeed: the section is DeepSpeed's Muon, whose params also take these
MUON_PARAMS = ("muon_lr", "adam_lr", "momentum", "ns_method")
MUON_MOMENTUM = 0.95  # Muon's (Keller Jordan's, DeepSpeed's and torch's default)
# What each backend applies of optimizer.params: DeepSpeed's Adam takes its own switches; the
# native engines build torch AdamW from the four numbers.
OPTIMIZER_PARAMS = {
    "deepspeed": (
        "lr",
        "betas",
        "eps",
        "weight_decay",
        "torch_adam",
        "adam_w_mode",
        "bias_correction",
    ),
    "native": ("lr", "betas", "eps", "weight_decay"),
}

# DeepSpeed's schedules (deepspeed/runtime/lr_schedules.py), with their parameters' defaults.
_WARMUP = {"warmup_min_lr": 0.0, "warmup_num_steps": 1000, "warmup_type": "log"}
SCHEDULERS = {
    "WarmupLR": {**_WARMUP, "warmup_max_lr": None},
    "WarmupDecayLR": {**_WARMUP, "warmup_max_lr": None, "total_num_steps": "auto"},
    "WarmupCosineLR": {
        "warmup_min_ratio": 0.0,
        "warmup_num_steps": 1000,
        "cos_min_ratio": 0.0001,
        "warmup_type": "log",
        "total_num_steps": "auto",
    },
}
OTHER_DS_SCHEDULERS = ("LRRangeTest", "OneCycle")


def resolve_optimizer(cfg: dict, optim: OptimConfig, backend: str, source: str) -> dict:
    """{lr, betas, eps, weight_decay} by the rule; checks the `optimizer` section and writes
    the numbers into its params."""
    section = cfg.get("optimizer")
    params: dict = {}
    if section is not None:
        if not isinstance(section, dict):
            raise ConfigError(f"{source}: optimizer must be an object with type and params")
        muon = _check_optimizer_type(section.get("type"), optim, source)
        params = section.get("params", {})
        if not isinstance(params, dict):
            raise ConfigError(f"{source}: optimizer.params must be an object")
        allowed = OPTIMIZER_PARAMS["deepspeed" if backend == "deepspeed" else "native"]
        allowed = allowed + MUON_PARAMS if muon else allowed
        extra = sorted(set(section) - {"type", "params"})
        if extra:
            raise ConfigError(
                f"{source}: optimizer.{extra[0]} is not a key DeepSpeed reads; "
                "hyper-parameters go in optimizer.params"
            )
        for key in params:
            if key not in allowed:
                raise ConfigError(
                    f"{source}: optimizer.params.{key} is not applied with --backend {backend} "
                    f"(it takes {', '.join(allowed)}){near(key, allowed)}"
                )
    betas = params.get("betas", "auto")
    if betas != "auto" and not (isinstance(betas, list) and len(betas) == 2):
        raise ConfigError(
            f"{source}: optimizer.params.betas must be a list of two numbers, got {betas!r}"
        )
    given = {
        "lr": params.get("lr", "auto"),
        "beta1": "auto" if betas == "auto" else betas[0],
        "beta2": "auto" if betas == "auto" else betas[1],
        "eps": params.get("eps", "auto"),
        "weight_decay": params.get("weight_decay", "auto"),
    }
    asked = {
        "lr": optim.lr,
        "beta1": optim.beta1,
        "beta2": optim.beta2,
        "eps": optim.eps,
        "weight_decay": optim.weight_decay,
    }
    out = {k: _pick(k, asked[k], given[k], DEFAULTS[k], source) for k in DEFAULTS}
    _check_optimizer_ranges(out, source)
    values = {
        "lr": out["lr"],
        "betas": [out["beta1"], out["beta2"]],
        "eps": out["eps"],
        "weight_decay": out["weight_decay"],
    }
    if section is not None:
        section["params"] = {**params, **values}
    return values


def resolve_schedule(cfg: dict, optim: OptimConfig, lr: float, source: str) -> dict:
    """The schedule's fields (training/loop/schedule.py `Schedule`) over `optim.steps` by the
    rule; checks the `scheduler` section and writes the numbers into its params."""
    section, steps = cfg.get("scheduler"), optim.steps
    if section is None:
        warmup = _pick("warmup", optim.warmup, "auto", DEFAULT_WARMUP, source)
        ratio = optim.min_lr_ratio
        ratio = DEFAULT_MIN_LR_RATIO if ratio is None else ratio
        fields = {"kind": optim.schedule, "lr": lr, "warmup": int(warmup), "total": steps}
        fields["min_lr_ratio"] = ratio
        if optim.schedule == "wsd":
            fields |= {"decay": _wsd_decay(optim, int(warmup)), "shape": optim.decay_shape}
        elif optim.decay_steps:
            raise ConfigError(
                "--decay-steps: the cosine schedule has no separate decay; add --schedule wsd"
            )
        return fields
    if optim.schedule == "wsd" or optim.decay_steps:
        kind = section.get("type") if isinstance(section, dict) else section
        raise ConfigError(
            f"--schedule wsd with scheduler {kind} in {source}: the schedule has one place; "
            "drop the config's scheduler section or the flag"
        )
    if not isinstance(section, dict):
        raise ConfigError(f"{source}: scheduler must be an object with type and params")
    kind = _check_scheduler_type(section.get("type"), source)
    params = section.get("params", {})
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: scheduler.params must be an object")
    extra = sorted(set(section) - {"type", "params"})
    if extra:
        raise ConfigError(
            f"{source}: scheduler.{extra[0]} is not a key DeepSpeed reads; "
            "its settings go in scheduler.params"
        )
    known = SCHEDULERS[kind]
    for key in params:
        if key not in known:
            why = (
                "the schedule follows the run's own step count"
                if key == "last_batch_iteration"
                else f"{kind} takes {', '.join(known)}"
            )
            raise ConfigError(
                f"{source}: scheduler.params.{key} is not applied ({why}){near(key, known)}"
            )
    p = {**known, **{k: v for k, v in params.items() if v != "auto"}}
    if optim.warmup is not None:
        p["warmup_num_steps"] = optim.warmup
    if p.get("total_num_steps") == "auto":
        p["total_num_steps"] = steps
    if "warmup_max_lr" in p and (optim.lr is not None or p["warmup_max_lr"] is None):
        p["warmup_max_lr"] = lr
    if optim.min_lr_ratio is not None:
        if kind != "WarmupCosineLR":
            raise ConfigError(
                f"--min-lr-ratio: scheduler {kind} in {source} has no floor to set (its "
                "floor is warmup_min_lr); drop the flag or use WarmupCosineLR"
            )
        p["cos_min_ratio"] = optim.min_lr_ratio
    _check_schedule_params(kind, p, source)
    section["params"] = p
    peak = p.get("warmup_max_lr", lr)
    start = p.get("warmup_min_lr", p.get("warmup_min_ratio"))
    return {
        "kind": kind,
        "lr": peak,
        "warmup": p["warmup_num_steps"],
        "total": p.get("total_num_steps", steps),
        "min_lr_ratio": p.get("cos_min_ratio", 0.0),
        "start": start,
        "warmup_type": p["warmup_type"],
    }


WSD_DECAY_FRACTION = 0.2  # the decay's share of the run when --decay-steps is not given


def _wsd_decay(optim: OptimConfig, warmup: int) -> int:
    """wsd's decay steps: given, else 20% of the run; at least 1 and not into the warmup."""
    decay = optim.decay_steps or max(1, round(WSD_DECAY_FRACTION * optim.steps))
    if decay > optim.steps - warmup:
        raise ConfigError(
            f"--decay-steps {decay} with --steps {optim.steps} and --warmup {warmup}: the decay "
            f"would start inside the warmup; at most {max(0, optim.steps - warmup)} decay steps"
        )
    return decay


def _pick(name: str, flag_value, config_value, default, source: str):
    """flag > config > default; a config value must be a number."""
    if flag_value is not None:
        return flag_value
    if config_value == "auto" or config_value is None:
        return default
    if not _is_number(config_value):
        raise ConfigError(f"{source}: optimizer {name} must be a number, got {config_value!r}")
    return config_value


def muon_section(cfg: dict, values: dict, optim: OptimConfig) -> dict:
    """DeepSpeed's Muon section for --optimizer muon: the resolved AdamW numbers (`values`) for
    the embeddings, norms and biases, --muon-lr and Muon's momentum for the blocks' matrices.
    Newton-Schulz as torch.optim.Muon runs it (the native engines'), not DeepSpeed's Gram
    variant, so every engine takes the same step."""
    params = cfg.get("optimizer", {}).get("params", {})
    muon = {"muon_lr": optim.muon_lr, "adam_lr": values["lr"], "momentum": MUON_MOMENTUM}
    return {"type": "Muon", "params": {**params, **values, **muon, "ns_method": "standard"}}


def _check_optimizer_type(kind, optim: OptimConfig, source: str) -> bool:
    """Refuses a type zerostack does not run; returns whether it is Muon."""
    if not isinstance(kind, str):
        raise ConfigError(f'{source}: optimizer.type must be a name such as "AdamW", got {kind!r}')
    if kind.lower() == "muon":
        if optim.optimizer != "muon":
            raise ConfigError(
                f"{source}: optimizer.type {kind!r}: Muon is chosen with --optimizer muon "
                "(which writes this section and splits the parameters); add the flag"
            )
        return True
    if kind.lower() in OPTIMIZERS:
        return False
    if kind.lower() in OTHER_DS_OPTIMIZERS:
        raise ConfigError(
            f"{source}: optimizer.type {kind!r} is a DeepSpeed optimizer zerostack does not "
            "wire (its weight decay groups and schedule are AdamW's); use Adam or AdamW"
        )
    raise ConfigError(
        f"{source}: unknown optimizer.type {kind!r}{near(kind, ('Adam', 'AdamW'))}"
        "; zerostack runs Adam or AdamW"
    )


def _check_scheduler_type(kind, source: str) -> str:
    if kind in SCHEDULERS:
        return kind
    names = tuple(SCHEDULERS)
    if kind in OTHER_DS_SCHEDULERS:
        raise ConfigError(
            f"{source}: scheduler.type {kind!r} is a DeepSpeed schedule zerostack does not "
            f"reproduce; use one of {', '.join(names)} (or no scheduler section: warmup, cosine)"
        )
    raise ConfigError(
        f"{source}: unknown scheduler.type {kind!r}{near(str(kind), names)}; "
        f"use one of {', '.join(names)}"
    )


def _check_optimizer_ranges(v: dict, source: str) -> None:
    for name, ok, need in (
        ("lr", v["lr"] >= 0, "0 or more"),
        ("beta1", 0 <= v["beta1"] < 1, "in [0, 1)"),
        ("beta2", 0 <= v["beta2"] < 1, "in [0, 1)"),
        ("eps", v["eps"] > 0, "positive"),
        ("weight_decay", v["weight_decay"] >= 0, "0 or more"),
    ):
        if not (_is_number(v[name]) and math.isfinite(v[name]) and ok):
            raise ConfigError(
                f"{source}: the optimizer's {name} must be finite and {need}, got {v[name]!r} "
                f"(from --{name.replace('_', '-')} or optimizer.params)"
            )


def _check_schedule_params(kind: str, p: dict, source: str) -> None:
    n = p["warmup_num_steps"]
    if not is_whole(n, 1):
        raise ConfigError(
            f"{source}: scheduler.params.warmup_num_steps must be a positive "
            f"integer (DeepSpeed's {kind}), got {n!r}"
        )
    if p["warmup_type"] not in ("log", "linear"):
        raise ConfigError(
            f"{source}: scheduler.params.warmup_type must be log or linear, "
            f"got {p['warmup_type']!r}"
        )
    total = p.get("total_num_steps", 1)
    if not is_whole(total, 1):
        raise ConfigError(
            f"{source}: scheduler.params.total_num_steps must be a positive "
            f'integer (or "auto": --steps), got {total!r}'
        )
    for key in ("warmup_min_lr", "warmup_max_lr", "warmup_min_ratio", "cos_min_ratio"):
        if key in p and not (_is_number(p[key]) and math.isfinite(p[key]) and p[key] >= 0):
            raise ConfigError(
                f"{source}: scheduler.params.{key} must be a finite number, 0 or "
                f"more, got {p[key]!r}"
            )


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
