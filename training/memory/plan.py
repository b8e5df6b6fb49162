"""Memory planning: what one rank will hold for a model, a DeepSpeed config and a world size,
whether that fits the machine, and the cheapest shipped config that does.

    python -m training.memory_plan --model small --ds_config ds_configs/zero2.json --world 2
    python -m training.memory_plan --model 7B --ds_config ds_configs/zero3.json --world 16 \\
        --ranks-per-host 8 --device-mem 80 --host-mem 1000 --micro-batch 1 --seq-len 4096

Model states per rank, P parameters, N data-parallel ranks, w bytes per 16-bit (2) or fp32 (4)
parameter, as DeepSpeed 0.19 allocates them with our engine (mixed precision keeps fp32 master
weights and Adam's two moments: 12 bytes per parameter, in every precision):

    ZeRO   parameters   gradients   optimizer states   reduce bucket
    0      w P          w P         12 P (8 P in fp32)  -
    1      w P          w P         12 P / N            reduce_bucket_size x w
    2      w P          w P / N     12 P / N            -
    3      w P / N      w P / N     12 P / N            reduce_bucket_size x w

Offloading the optimizer to the CPU moves its states and an fp32 copy of the gradient partition
(4 P / N) to host memory; offloading parameters moves the parameter partition there; nvme moves
them to disk and keeps swap buffers in host memory. Activations are an estimate (a Llama block
keeps about 8h + 4I values per token in w bytes; activation checkpointing keeps the block inputs
plus one block's worth); `runtime` is the process itself (CUDA context, libraries).
DeepSpeed's own estimators (`estimate_zero2_model_states_mem_needs`, `..._zero3_...`) are shown
beside ours where they exist; they assume 16-bit training and add a 1.5x buffer on the host.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import psutil
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from data import DataError, load_data
from models import PRESETS, ModelError, ZeroStackConfig, ZeroStackForCausalLM, get_config, lora
from models.hub import is_hub_name, resolve_pretrained
from training.errors import ConfigError
from training.runtime.distributed import accelerator
from training.settings import ds_config
from training.settings.config import OptimConfig
from training.settings.ds_config import CONFIG_DIR
from training.settings.flags import auto_unless

GiB = 2**30
HEADROOM = 0.9  # plan to use at most this share of a device: allocators fragment
RUNTIME_BYTES = {"cuda": int(0.75 * GiB), "cpu": int(0.5 * GiB)}
# Cheapest first: no sharding, then more sharding, then recomputation, then offload.
CANDIDATES = [
    ("zero0.json", False),
    ("zero1.json", False),
    ("zero2.json", False),
    ("zero3.json", False),
    ("zero2.json", True),
    ("zero3.json", True),
    ("zero2_offload.json", True),
    ("zero3_offload.json", True),
    ("zero3_nvme.json", True),
]
LOCATIONS = ("device", "host", "nvme")
CATEGORIES = (
    "params",
    "grads",
    "optimizer",
    "buffers",
    "working",
    "activations",
    "heap",
    "runtime",
    "staging",  # --async-save: the host copy of the states a background save writes
)
# On a CPU the trainer keeps freed blocks on glibc's heap for the next step (keep_freed_memory):
# what one phase frees (activations, in backward) the next (the optimizer step) cannot always
# reuse. Measured (docs/scale.md): the step's transients cost about twice their size in RSS.
CPU_HEAP_SLACK = 1.0
# What ZeRO-Infinity's optimizer path holds in memory beside its swap buffers (buffer_count x 4
# bytes a sub-group element): bytes more a sub-group element, and a fixed part plus bytes a
# parameter of the rank's partition (freed sub-group copies the heap keeps), fitted to the NVMe
# rows of docs/scale.md (which says how well).
NVME_SUB_GROUP_EXTRA = 16
NVME_FIXED = int(0.4 * GiB)
NVME_PER_PARAM = 1.6
STATE_CATEGORIES = ("params", "grads", "optimizer", "buffers")


@dataclass
class ModelShape:
    name: str
    params: int
    largest_layer: int  # parameters of the largest single module (ZeRO-3 gathers it whole)
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    # parameters that train (LoRA: the adapters; None: all). Frozen weights carry no gradients
    # and no optimizer states.
    trainable: int | None = None

    @property
    def trained(self) -> int:
        return self.params if self.trainable is None else self.trainable


@dataclass
class Plan:
    model: ModelShape
    config: str
    stage: int
    precision: str
    world: int
    ranks_per_host: int
    micro_batch: int
    seq_len: int
    activation_checkpointing: bool
    per_rank: dict = field(default_factory=dict)  # category -> {device, host, nvme} bytes
    deepspeed_estimate: dict | None = None

    def total(self, where: str | None = None, categories=CATEGORIES) -> int:
        return sum(
            v for c in categories for loc, v in self.per_rank[c].items() if where in (None, loc)
        )

    @property
    def model_states(self) -> int:
        """Parameters, gradients, optimizer states and reduce buckets in memory (device and
        host: what `engine.state_bytes()` counts), leaving out what is swapped to NVMe."""
        return sum(self.total(loc, STATE_CATEGORIES) for loc in ("device", "host"))


# ---------------------------------------------------------------------------- the model
def model_shape(spec: str, vocab_size: int | None = None, lora_spec=None) -> ModelShape:
    """Count a preset's or an HF folder's parameters on the meta device (no memory, no weights);
    with a LoraSpec, only its adapters train (`with_lora`)."""
    if spec in PRESETS:
        cfg = get_config(spec, **({"vocab_size": vocab_size} if vocab_size else {}))
    elif is_hub_name(spec) or Path(spec).is_dir():
        spec = str(resolve_pretrained(spec, what="--model"))
        if not (Path(spec) / "config.json").is_file():
            raise ModelError(f"--model {spec}: folder has no config.json, so it holds no model")
        cfg = AutoConfig.from_pretrained(spec)
        if vocab_size and vocab_size > cfg.vocab_size:
            cfg.vocab_size = vocab_size
    else:
        raise ModelError(f"--model {spec}: not a preset ({', '.join(PRESETS)}) and not a folder")
    shape = shape_of_config(cfg, spec)
    return with_lora(shape, cfg, lora_spec) if lora_spec else shape


def shape_of_config(cfg, name: str) -> ModelShape:
    """The ModelShape of a model config (ours or any HF causal LM's), built on the meta device."""
    with torch.device("meta"):
        if isinstance(cfg, ZeroStackConfig):
            model = ZeroStackForCausalLM._from_config(cfg)
        else:
            model = AutoModelForCausalLM.from_config(cfg)
    # ds_numel: a ZeRO-3 model alive in this process makes transformers build under zero.Init
    numel = lambda p: getattr(p, "ds_numel", p.numel())  # noqa: E731
    unique = {id(p): numel(p) for p in model.parameters()}  # tied weights count once
    largest = max(sum(numel(p) for p in m.parameters(recurse=False)) for m in model.modules())
    hidden = cfg.hidden_size  # HF configs map their own names (n_embd, ...) onto these
    return ModelShape(
        name=name,
        params=sum(unique.values()),
        largest_layer=largest,
        layers=cfg.num_hidden_layers,
        hidden=hidden,
        intermediate=getattr(cfg, "intermediate_size", None) or 4 * hidden,
        vocab=cfg.vocab_size,
    )


def with_lora(shape: ModelShape, cfg, spec) -> ModelShape:
    """`shape` with the adapters of LoraSpec `spec` (models/lora.py) added and the rest frozen;
    raises ModelError when a target matches no module."""
    with torch.device("meta"):
        if isinstance(cfg, ZeroStackConfig):
            model = ZeroStackForCausalLM._from_config(cfg)
        else:
            model = AutoModelForCausalLM.from_config(cfg)
    added = lora.trainable_count(model, spec)
    return replace(shape, params=shape.params + added, trainable=added)


def shape_of_run(resolved: dict) -> ModelShape:
    """The ModelShape of a run, from its resolved_config.json (no model is built)."""
    c = resolved["model_config"]
    h, inter = c["hidden_size"], c.get("intermediate_size") or 4 * c["hidden_size"]
    return ModelShape(
        name=str(resolved["flags"]["model"]),
        params=int(resolved["n_params"]),
        largest_layer=max(c["vocab_size"] * h, inter * h),
        layers=c["num_hidden_layers"],
        hidden=h,
        intermediate=inter,
        vocab=c["vocab_size"],
        trainable=resolved.get("trainable_params") if resolved["flags"].get("lora") else None,
    )


def planned_model_states(resolved: dict) -> int | None:
    """The plan's model-state bytes per rank for a DeepSpeed run's resolved_config.json (None for
    other backends): what benchmarks/compare puts beside the measured count."""
    if resolved["flags"].get("backend", "deepspeed") != "deepspeed":
        return None
    try:
        shape = shape_of_run(resolved)
    except KeyError:  # a model config without Llama-style names (GPT-2's n_embd, ...)
        return None
    return plan(shape, resolved["ds_config"], resolved["world"]).model_states


# ---------------------------------------------------------------------------- the plan
def plan(
    shape: ModelShape,
    ds_cfg: dict,
    world: int,
    *,
    config_name: str = "config",
    micro_batch: int | None = None,
    seq_len: int = 256,
    activation_checkpointing: bool = False,
    ranks_per_host: int | None = None,
    device_type: str = "cpu",
    async_save: bool = False,
) -> Plan:
    """Per-rank bytes by category and location for a resolved or raw ds_config. `async_save`:
    a background save's host copy of the states in memory (weights and optimizer states, what
    the rank's checkpoint files hold; what is swapped to NVMe is copied file to file)."""
    prec = ds_config.precision(ds_cfg)
    w = 4 if prec == "fp32" else 2
    micro = micro_batch or _int(
        ds_cfg.get("train_micro_batch_size_per_gpu"), ds_config.DEFAULT_MICRO_BATCH
    )
    per = model_state_placement(shape, ds_cfg, world, device_type)
    per["activations"]["device"] = activation_bytes(
        shape, micro, seq_len, w, activation_checkpointing
    )
    per["working"]["device"] = working_bytes(shape, ds_cfg, world, per["activations"]["device"])
    if device_type == "cpu":
        transient = per["working"]["device"] + per["activations"]["device"]
        per["heap"]["host"] = CPU_HEAP_SLACK * transient
    per["runtime"]["device" if device_type != "cpu" else "host"] = RUNTIME_BYTES.get(
        device_type, RUNTIME_BYTES["cuda"]
    )
    if async_save:
        per["staging"]["host"] = sum(
            per[c][loc] for c in ("params", "optimizer") for loc in ("device", "host")
        )
    out = Plan(
        model=shape,
        config=config_name,
        stage=ds_config.zero_stage(ds_cfg),
        precision=prec,
        world=world,
        ranks_per_host=ranks_per_host or world,
        micro_batch=micro,
        seq_len=seq_len,
        activation_checkpointing=activation_checkpointing,
        per_rank={c: {k: int(v) for k, v in d.items()} for c, d in per.items()},
    )
    zero = ds_cfg.get("zero_optimization", {})
    out.deepspeed_estimate = deepspeed_estimate(
        out, _device(zero, "optimizer"), _device(zero, "param")
    )
    return out


def _device(zero: dict, what: str) -> str:
    """Where offload_optimizer / offload_param puts things: none, cpu or nvme."""
    return str(zero.get(f"offload_{what}", {}).get("device", "none")).lower()


def model_state_placement(
    shape: ModelShape, ds_cfg: dict, world: int, device_type: str
) -> dict[str, dict[str, float]]:
    """{category: {location: bytes}} of the model states one rank holds (see the module doc's
    table), with the offload sections moving them to the host or to disk."""
    zero = ds_cfg.get("zero_optimization", {})
    stage = ds_config.zero_stage(ds_cfg)
    w = 4 if ds_config.precision(ds_cfg) == "fp32" else 2
    dp = max(1, world // ds_config.pipeline_stages(ds_cfg))
    n_params = shape.params
    off_opt, off_par = _device(zero, "optimizer"), _device(zero, "param")
    bucket = _int(
        zero.get("reduce_bucket_size"),
        ds_config.reduce_bucket_size(ds_cfg, shape.hidden, device_type),
    )
    params = w * n_params / dp if stage == 3 else w * n_params
    if stage == 3 and _held_whole(shape, zero):
        params += w * n_params  # every weight persists whole beside its partition
    n_train = shape.trained  # frozen weights: no gradient, no optimizer state
    grads = w * n_train / dp if stage >= 2 else w * n_train
    optimizer = 12 * n_train / dp if stage >= 1 else (12 if w == 2 else 8) * n_train
    buffers = bucket * w if stage in (1, 3) else 0

    per = {c: dict.fromkeys(LOCATIONS, 0) for c in CATEGORIES}
    per["params"]["device"] = params
    per["grads"]["device"] = grads
    per["buffers"]["device"] = buffers
    if off_opt == "none":
        per["optimizer"]["device"] = optimizer
    else:
        # The optimizer step runs on the host, on an fp32 copy of this rank's gradient partition.
        per["grads"]["host"] = 4 * n_train / dp
        if off_opt == "cpu":
            per["optimizer"]["host"] = optimizer
        else:  # nvme: states and fp32 gradients on disk, swapped through buffer_count buffers
            sub = min(_int(zero.get("sub_group_size"), 1_000_000_000), math.ceil(n_train / dp))
            count = _int(zero["offload_optimizer"].get("buffer_count"), 4)
            per["optimizer"]["nvme"] = optimizer
            per["grads"]["nvme"] = per["grads"]["host"]
            per["grads"]["host"] = 0
            held = NVME_SUB_GROUP_EXTRA * sub + NVME_FIXED + NVME_PER_PARAM * n_train / dp
            per["optimizer"]["host"] = count * 4 * sub + held
    if off_opt != "none" and stage in (1, 2):
        # DeepSpeed's gradient staging for the host's step (stage_1_and_2.py): one buffer of the
        # largest parameter on the host and one on the device, and with accumulation a
        # host copy of every gradient this rank's partition touches, kept between micro-steps
        largest = w * (shape.largest_layer if shape.trainable is None else 0)
        per["grads"]["host"] += largest
        per["grads"]["device"] += largest
        if _int(ds_cfg.get("gradient_accumulation_steps"), 1) > 1:
            per["grads"]["host"] += w * n_train / dp
    if off_par in ("cpu", "nvme") and stage == 3:
        per["params"]["device"] = w * shape.largest_layer  # one gathered module at a time
        if off_par == "cpu":
            per["params"]["host"] = params
        else:
            per["params"]["nvme"] = params
            op = zero["offload_param"]
            size = _int(op.get("buffer_size"), max(shape.largest_layer, 1 << 20))
            per["params"]["host"] = _int(op.get("buffer_count"), 5) * size * w
    return per


def _held_whole(shape: ModelShape, zero: dict) -> bool:
    """Whether ZeRO-3 keeps every weight gathered (its persistence threshold covers the largest
    module's: settings/ds_config.py persistence_threshold): then they are model states, held
    whole all along, not gathered for a while."""
    threshold = zero.get("stage3_param_persistence_threshold")
    return isinstance(threshold, int) and threshold >= shape.largest_layer


def working_bytes(shape: ModelShape, ds_cfg: dict, world: int, activations: int) -> int:
    """What a step holds for a while beside the model states, the larger of its two phases:
    ZeRO-3's gathered parameters in forward and backward (DeepSpeed keeps a gathered parameter
    whole until its reuse in backward when that comes within stage3_max_reuse_distance
    elements, up to stage3_max_live_parameters: for a model under ~500M parameters, all of it),
    and the optimizer step's fp32 copy of this rank's gradient partition (ZeRO 1-3 without
    optimizer offload; ZeRO-3 offloading it to NVMe, before the swap-out), which reuses what
    the activations freed."""
    zero = ds_cfg.get("zero_optimization", {})
    stage = ds_config.zero_stage(ds_cfg)
    w = 4 if ds_config.precision(ds_cfg) == "fp32" else 2
    dp = max(1, world // ds_config.pipeline_stages(ds_cfg))
    gathered = 0
    if stage == 3 and not _held_whole(shape, zero):
        live = _int(zero.get("stage3_max_live_parameters"), 1_000_000_000)
        reuse = _int(zero.get("stage3_max_reuse_distance"), 1_000_000_000)
        kept = min(shape.params, live, max(reuse // 2, shape.largest_layer))
        gathered = w * max(kept, shape.largest_layer)  # at least the module in use
    step = 0
    if stage >= 1 and _device(zero, "optimizer") == "none" and w == 2:
        step = max(0, 4 * shape.trained // dp - activations)
    # With the optimizer on NVMe the fp32 gradients are cast and swapped out a reduce bucket at
    # a time (stage3.partition_grads at the boundary), never as a whole partition; what that
    # path holds is a sub-group's worth (model_state_placement).
    return max(gathered, step)


def activation_bytes(shape: ModelShape, micro: int, seq_len: int, w: int, ckpt: bool) -> int:
    """A rough count of what backward needs from forward, for one micro-batch."""
    tokens = micro * seq_len
    block = tokens * (w * (8 * shape.hidden + 4 * shape.intermediate) + 8 * shape.hidden)
    kept = shape.layers * tokens * w * shape.hidden + block if ckpt else shape.layers * block
    logits = tokens * shape.vocab * (w + 4)  # 16-bit logits and the fp32 loss pass over them
    return int(kept + logits)


def deepspeed_estimate(p: Plan, off_opt: str, off_par: str) -> dict | None:
    """DeepSpeed's own model-state estimate (ZeRO-2 and ZeRO-3 only): bytes per device and per
    host, from its estimate_zero{2,3}_model_states_mem_needs."""
    if p.stage not in (2, 3):
        return None
    hosts = max(1, math.ceil(p.world / p.ranks_per_host))
    per_host = min(p.world, p.ranks_per_host)
    if p.stage == 2:
        # DeepSpeed's estimators are heavy to import and only shown beside ours.
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        host, dev = estimate_zero2_model_states_mem_needs(
            p.model.params, per_host, hosts, cpu_offload=off_opt != "none"
        )
        fn = "estimate_zero2_model_states_mem_needs"
    else:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        host, dev, _ = estimate_zero3_model_states_mem_needs(
            p.model.params,
            p.model.largest_layer,
            per_host,
            hosts,
            cpu_offload=off_opt != "none",
            cpu_offload_params=off_par != "none",
        )
        fn = "estimate_zero3_model_states_mem_needs"
    return {"function": fn, "device_bytes": int(dev), "host_bytes": int(host)}


def _int(v, default: int) -> int:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default


# ---------------------------------------------------------------------------- the machine
@dataclass
class Capacity:
    device_type: str  # "cuda", ... or "cpu" (then device memory is host memory)
    device_bytes: int  # per device (GPU); for a CPU, the host's
    host_bytes: int  # per host
    nvme_bytes: int | None  # free space where swap files go


def capacity(
    device: str | None = None, device_mem_gib=None, host_mem_gib=None, nvme_dir: str = "."
) -> Capacity:
    """This machine's memory, or what the flags say (the trainer's --host-mem-gib and
    --device-mem-gib, this command's --host-mem and --device-mem): to plan for another machine,
    rehearse a smaller one, or leave room for other work."""
    acc = accelerator()
    here = acc.device_name()
    kind = device or here
    host = int(host_mem_gib * GiB) if host_mem_gib else psutil.virtual_memory().total
    if kind == "cpu":
        dev = host
    elif device_mem_gib:
        dev = int(device_mem_gib * GiB)
    elif kind == here:
        dev = int(acc.total_memory(0))
    else:
        raise ValueError(f"--device {kind} is not this machine's ({here}): give --device-mem")
    d = Path(nvme_dir)
    while not d.exists() and d != d.parent:
        d = d.parent
    return Capacity(kind, dev, host, shutil.disk_usage(d).free)


def fits(p: Plan, cap: Capacity) -> tuple[bool, str]:
    """Whether every rank's share fits; returns (fits, a line saying what needs what)."""
    n = p.ranks_per_host
    dev, host, disk = p.total("device"), p.total("host"), p.total("nvme")
    checks = []
    if cap.device_type == "cpu":  # one memory: everything of every rank on the host
        need = n * (dev + host)
        checks.append(("host memory", need, cap.host_bytes, f"{n} ranks x {_fmt(dev + host)}"))
    else:
        checks.append(("device memory", dev, cap.device_bytes, "per device"))
        checks.append(("host memory", n * host, cap.host_bytes, f"{n} ranks x {_fmt(host)}"))
    if disk:
        checks.append(("nvme", n * disk, cap.nvme_bytes or 0, f"{n} ranks x {_fmt(disk)}"))
    ok = all(need <= HEADROOM * have for _, need, have, _ in checks)
    line = "; ".join(
        f"{what}: needs {_fmt(need)} ({how}) of {_fmt(have)}"
        + ("" if need <= HEADROOM * have else " -> does NOT fit")
        for what, need, have, how in checks
    )
    return ok, line


def resolve_config(
    path: str | Path,
    shape: ModelShape,
    world: int,
    micro_batch: int | None,
    device_type: str = "cuda",
    ranks_per_host: int | None = None,
    host_bytes: int | None = None,
):
    """A ds_config file resolved as the trainer would on `device_type` (its flag defaults, this
    world size, ZeRO-3's hold as --hold-weights auto decides it on a host of `host_bytes`): bad
    files and combinations raise ConfigError."""
    raw = ds_config.load_json(path)
    kw = dict(
        world=world,
        optim=OptimConfig(micro_batch=micro_batch),  # else the trainer's defaults
        swap=("nvme_swap", max(shape.largest_layer, 1 << 20)),
        hidden_size=shape.hidden,
        source=str(path),
    )
    cfg = ds_config.resolve(raw, device_type=device_type, params=shape.params, **kw)
    held, _ = zero3_holds_whole(
        cfg, shape.params, world, ranks_per_host or world, host_bytes or 0, device_type
    )
    if not held:
        return cfg
    return ds_config.resolve(
        raw, device_type=device_type, params=shape.params, hold_weights=True, **kw
    )


def zero3_holds_whole(
    cfg: dict, params: int, world: int, ranks_per_host: int, host_bytes: int, device_type: str
) -> tuple[bool, str]:
    """--hold-weights auto under ZeRO-3 (the trainer's rule, training/preflight/switches.py):
    every rank's whole 16-bit (fp32: 32-bit) weights kept gathered, by `one_cpu_host_holds`,
    not with parameters offloaded. Returns (on, why)."""
    offload = cfg.get("zero_optimization", {}).get("offload_param", {}).get("device", "none")
    held = (4 if ds_config.precision(cfg) == "fp32" else 2) * params
    blockers = [(str(offload).lower() != "none", "parameters offloaded")]
    return one_cpu_host_holds(held, world, ranks_per_host, host_bytes, device_type, blockers)


def one_cpu_host_holds(
    held_per_rank: int,
    world: int,
    ranks_per_host: int,
    host_bytes: int,
    device_type: str,
    blockers=(),
) -> tuple[bool, str]:
    """The rule of the one-host holds (ZeRO-3's whole weights, FSDP2's whole weights and
    gradients across micro-steps): on a CPU (measured there), every rank on this host, and what
    all of them hold within a quarter of its memory (ZeRO-3 and FSDP2 are also how a model too
    big for ZeRO-2 or DDP fits); none of `blockers`. Returns (on, why)."""
    total = held_per_rank * world
    return auto_unless(
        [
            *blockers,
            (device_type != "cpu", f"{device_type}, not a CPU (unmeasured)"),
            (ranks_per_host != world, f"{ranks_per_host} of {world} ranks on this host"),
            (total >= host_bytes / 4, f"{_fmt(total)} over a quarter of the host"),
        ],
        f"one CPU host, {_fmt(total)} held within a quarter of its memory",
    )


def cheapest_fit(
    shape: ModelShape, world: int, cap: Capacity, micro_batch: int | None = None, **kw
) -> Plan | None:
    """The first of CANDIDATES (cheapest first) whose plan fits."""
    return next(fitting_plans(shape, world, cap, micro_batch, **kw), None)


def fitting_plans(shape: ModelShape, world: int, cap: Capacity, micro_batch: int | None, **kw):
    """The plans of the shipped CANDIDATES that fit `cap`, cheapest first."""
    for name, ckpt in CANDIDATES:
        path = CONFIG_DIR / name
        if not path.is_file():
            continue
        rph = kw.get("ranks_per_host")
        cfg = resolve_config(path, shape, world, micro_batch, cap.device_type, rph, cap.host_bytes)
        p = plan(
            shape, cfg, world, config_name=f"ds_configs/{name}", activation_checkpointing=ckpt, **kw
        )
        if fits(p, cap)[0]:
            yield p
    return None


# ---------------------------------------------------------------------------- the trainer's check
@dataclass
class Verdict:
    """The plan of a run against this machine, and the shipped configs that would fit."""

    plan: Plan
    capacity: Capacity
    fits: bool
    needs: str  # fits()'s line
    cheapest: Plan | None  # the cheapest shipped config that fits (None: none does)
    roomier: Plan | None  # the first that fits holding less per rank than this run's config

    def refusal(self) -> str:
        """One line: what does not fit, what would, and how to try anyway."""
        short = "; ".join(part for part in self.needs.split("; ") if "does NOT fit" in part)
        return (
            f"{self.plan.config}: the memory plan says this run does not fit this machine "
            f"({short.replace(' -> does NOT fit', '')}, planning to use at most "
            f"{HEADROOM:.0%}); {self._fix()}; --force starts it anyway "
            "(python -m training.memory_plan shows the plan)"
        )

    def advice(self) -> str:
        """One line for a rank that ran out of memory: the plan and the roomier config."""
        p = self.plan
        mine = f"the memory plan for this run was {_fmt(in_memory(p))} per rank"
        better = self.roomier
        if better is None:
            return (
                f"{mine}; no shipped config plans much less here: more hosts, or a shorter "
                "--seq-len or --micro-batch"
            )
        return f"{mine}; {_name(better)} plans {_fmt(in_memory(better))}"

    def _fix(self) -> str:
        if self.cheapest is None:
            return (
                f"no shipped config fits {self.plan.world} rank(s) here: more hosts, a smaller "
                "--micro-batch or --seq-len"
            )
        return f"{_name(self.cheapest)} fits"


def _name(p: Plan) -> str:
    return p.config + (" with --activation-checkpointing" if p.activation_checkpointing else "")


def in_memory(p: Plan) -> int:
    """What one rank holds in memory: device + host (one memory on a CPU), NVMe left out."""
    return p.total("device") + p.total("host")


def check_run(
    shape: ModelShape,
    ds_cfg: dict,
    world: int,
    *,
    config_name: str,
    seq_len: int,
    activation_checkpointing: bool,
    ranks_per_host: int | None = None,
    nvme_dir: str | None = None,
    host_mem_gib: float | None = None,
    device_mem_gib: float | None = None,
    async_save: bool = False,
) -> Verdict:
    """The trainer's check before any work: this run's plan against this machine (or the memory
    --host-mem-gib / --device-mem-gib say), and the shipped configs that fit."""
    cap = capacity(
        device_mem_gib=device_mem_gib, host_mem_gib=host_mem_gib, nvme_dir=nvme_dir or "."
    )
    if nvme_dir and Path(nvme_dir).is_dir():  # a resumed run's swap files are reused, not added
        cap.nvme_bytes = (cap.nvme_bytes or 0) + _folder_bytes(Path(nvme_dir))
    micro = ds_cfg.get("train_micro_batch_size_per_gpu")
    kw = dict(seq_len=seq_len, ranks_per_host=ranks_per_host, device_type=cap.device_type)
    p = plan(
        shape,
        ds_cfg,
        world,
        config_name=config_name,
        activation_checkpointing=activation_checkpointing,
        async_save=async_save,
        **kw,
    )
    ok, needs = fits(p, cap)
    cheapest = roomier = None
    for c in fitting_plans(shape, world, cap, micro, **kw):
        cheapest = cheapest or c
        if roomier is None and in_memory(c) < 0.9 * in_memory(p):  # a real saving, not noise
            roomier = c
    return Verdict(p, cap, ok, needs, cheapest, roomier)


def _folder_bytes(folder: Path) -> int:
    total = 0
    for f in folder.rglob("*"):
        try:
            total += f.stat().st_size if f.is_file() else 0
        except OSError:
            continue
    return total


# ---------------------------------------------------------------------------- the command
def _fmt(b: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return f"{b / size:,.1f} {unit}"
    return f"{int(b)} B"


def report(p: Plan, cap: Capacity) -> str:
    m = p.model
    lines = [
        f"model {m.name}: {m.params / 1e6:,.2f}M parameters (largest layer "
        f"{m.largest_layer / 1e6:,.2f}M) | {p.config}: ZeRO-{p.stage}, {p.precision} | "
        f"world {p.world}, {p.ranks_per_host} rank(s) per host | micro-batch {p.micro_batch} x "
        f"{p.seq_len} tokens{' | activation checkpointing' if p.activation_checkpointing else ''}",
        f"{'per rank':<22}{'device':>12}{'host':>12}{'nvme':>12}",
    ]
    names = {
        "params": "parameters",
        "grads": "gradients",
        "optimizer": "optimizer states",
        "buffers": "reduce buckets",
        "working": "working set (est.)",
        "heap": "heap slack (cpu)",
        "activations": "activations (est.)",
        "runtime": "runtime",
        "staging": "async-save copy",
    }
    for c in CATEGORIES:
        row = p.per_rank[c]
        if c == "staging" and not any(row.values()):
            continue  # no --async-save
        cells = "".join(f"{(_fmt(row[loc]) if row[loc] else '-'):>12}" for loc in LOCATIONS)
        lines.append(f"  {names[c]:<20}{cells}")
    totals = "".join(f"{_fmt(p.total(loc)):>12}" for loc in LOCATIONS)
    lines.append(f"  {'total':<20}{totals}")
    lines.append(
        f"  model states in memory (params + grads + optimizer + buckets): {_fmt(p.model_states)}"
    )
    if p.deepspeed_estimate:
        e = p.deepspeed_estimate
        lines.append(
            f"DeepSpeed's {e['function']}: {_fmt(e['device_bytes'])} per device, "
            f"{_fmt(e['host_bytes'])} per host (model states only, 1.5x host buffer)"
        )
    ok, line = fits(p, cap)
    if cap.device_type == "cpu":
        line += " (on a CPU, device and host are one memory)"
    lines.append(f"{'fits' if ok else 'does NOT fit'} ({cap.device_type}): {line}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description="Per-rank memory for a model, a DeepSpeed config and a world size; whether it "
        "fits; the cheapest shipped config that fits."
    )
    ap.add_argument("--model", required=True, help="preset name or HF model folder")
    ap.add_argument("--ds_config", "--ds-config", default=str(CONFIG_DIR / "zero2.json"))
    ap.add_argument("--world", type=int, default=1, help="ranks in all")
    ap.add_argument("--ranks-per-host", type=int, default=None, help="default: all on one host")
    ap.add_argument("--data", default=None, help="a prepared data folder (its vocabulary)")
    ap.add_argument("--vocab-size", type=int, default=None)
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lora", default=None, help="the trainer's --lora spec: only adapters train")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument(
        "--device",
        default=None,
        help="cpu, or an accelerator such as cuda (default: this machine's); with another "
        "machine's accelerator give --device-mem",
    )
    ap.add_argument("--device-mem", type=float, default=None, help="GiB per device")
    ap.add_argument("--host-mem", type=float, default=None, help="GiB per host")
    ap.add_argument("--nvme-path", default=".", help="where swap files would go (free space)")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # --json keeps stdout for the JSON alone: DeepSpeed logs its warnings to stdout.
    with contextlib.redirect_stdout(sys.stderr) if a.json else contextlib.nullcontext():
        try:
            if a.world < 1:
                raise ConfigError(f"--world must be at least 1, got {a.world}")
            vocab = a.vocab_size or (load_data(a.data).vocab_size if a.data else None)
            shape = model_shape(a.model, vocab, a.lora and lora.parse_lora(a.lora))
            cap = capacity(a.device, a.device_mem, a.host_mem, a.nvme_path)
            rph = a.ranks_per_host or a.world
            cfg = resolve_config(
                a.ds_config, shape, a.world, a.micro_batch, cap.device_type, rph, cap.host_bytes
            )
        except (ConfigError, ModelError, DataError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        kw = dict(seq_len=a.seq_len, ranks_per_host=rph, device_type=cap.device_type)
        p = plan(
            shape,
            cfg,
            a.world,
            config_name=a.ds_config,
            activation_checkpointing=a.activation_checkpointing,
            **kw,
        )
        best = cheapest_fit(shape, a.world, cap, micro_batch=a.micro_batch, **kw)
        more = None if best is not None else _smallest_world(shape, a.world, cap, a.micro_batch, kw)
    if a.json:
        print(json.dumps(_summary(p, cap, best or (more and more[1])), indent=1))
        return 0
    print(report(p, cap))
    if best is not None:
        extra = " with --activation-checkpointing" if best.activation_checkpointing else ""
        same = Path(best.config).name == Path(a.ds_config).name
        print(f"cheapest config that fits: {best.config}{extra}" + (" (this one)" if same else ""))
    elif more is not None:
        print(
            f"no shipped config fits {a.world} rank(s); {more[1].config} fits from {more[0]} "
            f"ranks ({rph} per host)"
        )
    else:
        print(f"no shipped config fits even {2**12} ranks; shrink --micro-batch or --seq-len")
    return 0


def _smallest_world(shape, world: int, cap, micro_batch, kw) -> tuple[int, Plan] | None:
    """The smallest world (doubling, past `world`) at which some shipped config fits."""
    for w in (2**k for k in range(1, 13)):
        if w > world:
            b = cheapest_fit(shape, w, cap, micro_batch=micro_batch, **kw)
            if b is not None:
                return w, b
    return None


def _summary(p: Plan, cap: Capacity, fit: Plan | None) -> dict:
    """What --json prints."""
    return {
        **asdict(p),
        "model_states_bytes": p.model_states,
        "total_bytes": {loc: p.total(loc) for loc in LOCATIONS},
        "capacity": asdict(cap),
        "fits": fits(p, cap)[0],
        "cheapest_fit": fit
        and {
            "config": fit.config,
            "activation_checkpointing": fit.activation_checkpointing,
            "world": fit.world,
        },
    }
