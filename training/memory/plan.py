"""The memory plan: what one rank will hold for a model, a DeepSpeed config and a world size, by
category (parameters, gradients, optimizer states, buckets, working set, activations, heap,
runtime) and location (device, host, NVMe). Whether that fits is capacity.py's, the cheapest
config that does fit.py's, the trainer's check verdict.py's, the command plan_command.py's.

Model states per rank, P parameters on the rank (pipeline stages and tensor parallelism: the
fullest stage, its blocks' projections divided by tp; rank_share.py), N data-parallel ranks
(world / (pp x tp)), w bytes per 16-bit (2) or fp32 (4)
parameter, as DeepSpeed 0.19 allocates them with our engine (mixed precision keeps fp32 master
weights and Adam's two moments: 12 bytes per parameter, in every precision; 8 for the blocks'
matrices under Muon with ZeRO-1/2 in 16 bits, where it keeps one momentum; under expert
parallelism, ep ranks to an expert group, a P not divided by N counts the experts' parameters
once per ep ranks):

    ZeRO   parameters   gradients   optimizer states   reduce bucket
    0      w P          w P         12 P (8 P in fp32)  -
    1      w P          w P         12 P / N            reduce_bucket_size x w
    2      w P          w P / N     12 P / N            -
    3      w P / N      w P / N     12 P / N            reduce_bucket_size x w

bf16 with fp32 gradient accumulation at ZeRO-1 (the pipeline configs) is DeepSpeed's BF16_Optimizer:
gradients 4 P, whole on every rank, and no reduce bucket.
Offloading the optimizer to the CPU moves its states and an fp32 copy of the gradient partition
(4 P / N) to host memory; offloading parameters moves the parameter partition there; nvme moves
them to disk and keeps swap buffers in host memory. Activations are an estimate (a Llama block
keeps about 8h + 4I values per token in w bytes; activation checkpointing keeps the block inputs
plus one block's worth); `runtime` is the process itself (CUDA context, libraries).
DeepSpeed's own estimators (`estimate_zero2_model_states_mem_needs`, `..._zero3_...`) are shown
beside ours where they exist; they assume 16-bit training and add a 1.5x buffer on the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from training.memory import rank_share
from training.memory.shape import ModelShape, shape_of_run
from training.settings import ds_config, parallel

GiB = 2**30
HEADROOM = 0.9  # plan to use at most this share of a device: allocators fragment
RUNTIME_BYTES = {"cuda": int(0.75 * GiB), "cpu": int(0.5 * GiB)}
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
REFERENCE_BYTES = 16  # a pair's stored reference log-probs: two float64


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
    pairs: int = 0,
) -> Plan:
    """Per-rank bytes by category and location for a resolved or raw ds_config. `async_save`:
    a background save's host copy of the states in memory (weights and optimizer states, what
    the rank's checkpoint files hold; what is swapped to NVMe is copied file to file). `pairs`:
    preference data's pairs (training/objectives/): a micro-batch of pairs is twice as many
    sequences, and each rank holds the stored reference log-probs of every pair."""
    prec = ds_config.precision(ds_cfg)
    w = 4 if prec == "fp32" else 2
    micro = micro_batch or _int(
        ds_cfg.get("train_micro_batch_size_per_gpu"), ds_config.DEFAULT_MICRO_BATCH
    )
    per = model_state_placement(shape, ds_cfg, world, device_type)
    per["activations"]["device"] = activation_bytes(
        shape, micro, seq_len, w, activation_checkpointing, pairs=pairs > 0
    )
    per["working"]["device"] = working_bytes(shape, ds_cfg, world, per["activations"]["device"])
    if device_type == "cpu":
        transient = per["working"]["device"] + per["activations"]["device"]
        per["heap"]["host"] = CPU_HEAP_SLACK * transient
    per["runtime"]["device" if device_type != "cpu" else "host"] = RUNTIME_BYTES.get(
        device_type, RUNTIME_BYTES["cuda"]
    )
    per["runtime"]["host"] += REFERENCE_BYTES * pairs
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
    dp = rank_share.data_parallel(ds_cfg, world)
    n_params = rank_share.rank_params(shape, ds_cfg)  # this rank's stage and slices
    off_opt, off_par = _device(zero, "optimizer"), _device(zero, "param")
    bucket = _int(
        zero.get("reduce_bucket_size"),
        ds_config.reduce_bucket_size(ds_cfg, shape.hidden, device_type),
    )
    # Expert parallelism: a rank holds its expert group's share of the experts, partitioned
    # across the dp / ep ranks holding the same experts: unpartitioned terms count the share,
    # partitioned ones come to the same experts / dp as replicated experts would.
    ep = parallel.expert_size(ds_cfg)
    local = shape.on_rank(n_params, ep)
    params = w * n_params / dp if stage == 3 else w * local
    if stage == 3 and _held_whole(shape, zero):
        params += w * local  # every weight persists whole beside its partition
    n_train = rank_share.rank_trained(shape, ds_cfg)  # frozen: no gradient, no optimizer state
    local_train = shape.on_rank(n_train, ep)
    grads = w * n_train / dp if stage >= 2 else w * local_train
    optimizer = 12 * n_train / dp if stage >= 1 else (12 if w == 2 else 8) * local_train
    if ds_cfg.get("optimizer", {}).get("type") == "Muon" and stage in (1, 2) and w == 2:
        # one momentum, not two moments; measured (tests/test_memory_plan.py): DeepSpeed's Muon
        # keeps as much as AdamW under ZeRO-3 and in fp32
        optimizer -= 4 * shape.matrices / dp
    buffers = bucket * w if stage in (1, 3) else 0
    if _bf16_optimizer(ds_cfg, stage, off_opt):
        grads, buffers = 4 * n_train, 0  # whole fp32 gradients, reduced in place: no bucket

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


def _bf16_optimizer(ds_cfg: dict, stage: int, off_opt: str) -> bool:
    """Whether DeepSpeed runs its BF16_Optimizer in place of ZeRO-1's (engine.py's optimizer
    check: bf16 with fp32 gradient accumulation at stage 1 without offload, as the pipeline
    configs ship): every rank keeps the whole gradient in fp32 and no reduce bucket."""
    accum = str(ds_cfg.get("data_types", {}).get("grad_accum_dtype", "")).lower()
    bf16 = ds_config.precision(ds_cfg) == "bf16"
    return bf16 and accum in ("fp32", "float32") and stage == 1 and off_opt == "none"


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
    dp = rank_share.data_parallel(ds_cfg, world)
    gathered = 0
    if stage == 3 and not _held_whole(shape, zero):
        live = _int(zero.get("stage3_max_live_parameters"), 1_000_000_000)
        reuse = _int(zero.get("stage3_max_reuse_distance"), 1_000_000_000)
        kept = min(shape.params, live, max(reuse // 2, shape.largest_layer))
        gathered = w * max(kept, shape.largest_layer)  # at least the module in use
    step = 0
    if stage >= 1 and _device(zero, "optimizer") == "none" and w == 2:
        step = max(0, 4 * rank_share.rank_trained(shape, ds_cfg) // dp - activations)
    # With the optimizer on NVMe the fp32 gradients are cast and swapped out a reduce bucket at
    # a time (stage3.partition_grads at the boundary), never as a whole partition; what that
    # path holds is a sub-group's worth (model_state_placement).
    return max(gathered, step)


def activation_bytes(
    shape: ModelShape, micro: int, seq_len: int, w: int, ckpt: bool, pairs: bool = False
) -> int:
    """A rough count of what backward needs from forward, for one micro-batch (`pairs`: of
    preference pairs, two sequences each; the DPO loss keeps the 16-bit logits and makes their
    gradient a block of rows at a time, as the next-token loss does: objectives/dpo.py)."""
    tokens = micro * seq_len * (2 if pairs else 1)
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


def fmt_bytes(b: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return f"{b / size:,.1f} {unit}"
    return f"{int(b)} B"
