"""How a run's ranks divide the work: pipeline stages (`pipeline.stages`), tensor parallelism
(DeepSpeed AutoTP, `tensor_parallel.autotp_size`) and sequence parallelism (DeepSpeed Ulysses,
`sequence_parallel_size`), the rest being data parallelism:

    data-parallel world = world / (pipeline stages x tensor parallel x sequence parallel)

The ranks of one tensor- or sequence-parallel group work on the same samples, so the batch
triplet, the reader's sharding, evaluation and tokens/s all count data-parallel replicas, never
ranks. Which combinations DeepSpeed composes, and what each needs of the model, is checked here
before any rank starts; every failure is one line.
"""

from __future__ import annotations

from dataclasses import dataclass

from training.errors import ConfigError
from training.settings import ds_sections


@dataclass(frozen=True)
class Layout:
    world: int
    pipeline: int = 1
    tensor: int = 1
    sequence: int = 1

    @property
    def data(self) -> int:
        return self.world // (self.pipeline * self.tensor * self.sequence)

    def describe(self) -> str:
        parts = [f"{self.data} data-parallel"]
        for size, name in (
            (self.tensor, "tensor"),
            (self.sequence, "sequence"),
            (self.pipeline, "pipeline"),
        ):
            if size > 1:
                parts.append(f"{size} {name}-parallel")
        return " x ".join(parts)


def tensor_size(cfg: dict) -> int:
    section = cfg.get("tensor_parallel") or {}
    return int(section.get("autotp_size", 0) or 1) if isinstance(section, dict) else 1


def sequence_size(cfg: dict) -> int:
    return int(cfg.get("sequence_parallel_size", 1) or 1)


def expert_size(cfg: dict) -> int:
    """Ranks per expert group (DeepSpeed AutoEP's `expert_parallel.autoep_size`; 1: off). The
    experts are split across them; everything else is data-parallel as without experts."""
    section = cfg.get("expert_parallel") or {}
    if not isinstance(section, dict) or not section.get("enabled"):
        return 1
    return section.get("autoep_size", 1)


# The MoE layers of zerostack's own model, as ds_configs/moe_ep2.json names them for AutoEP.
OUR_MOE_LAYERS = r"layers\.\d+\.feed_forward"


def check_experts(ep: int, data_parallel: int, model_cfg, source: str, pattern=None) -> None:
    """One ConfigError line for an expert-parallel size the run cannot have: not a positive
    integer, not dividing the data-parallel ranks, for a model without experts, leaving a
    rank without an expert or with a share of one, or a layer pattern (`pattern`, the section's
    moe_layer_pattern) naming our model's layers for another model, where AutoEP finds none."""
    if not ds_sections.is_whole(ep, 1):
        raise ConfigError(f"{source}: expert_parallel.autoep_size must be a positive integer")
    if data_parallel % ep:
        raise ConfigError(
            f"{source}: expert_parallel.autoep_size={ep} does not divide the "
            f"{data_parallel} data-parallel ranks; launch a multiple of {ep}"
        )
    experts = getattr(model_cfg, "num_experts", None)
    if model_cfg is not None and not experts:
        raise ConfigError(f"{source}: expert_parallel is enabled for a model without experts")
    kind = getattr(model_cfg, "model_type", None)
    if pattern == OUR_MOE_LAYERS and kind not in (None, "zerostack_moe"):
        raise ConfigError(
            f"{source}: expert parallelism with a {kind} folder: the config's moe_layer_pattern "
            f"{pattern!r} names zerostack's MoE layers, and AutoEP would find none in it; set "
            "expert_parallel.moe_layer_pattern and preset_model for its layers, or use "
            "ds_configs/zero2.json"
        )
    if experts and (ep > experts or experts % ep):
        raise ConfigError(
            f"{source}: expert_parallel.autoep_size={ep} cannot share the model's {experts} "
            "experts: each rank must hold the same whole number of experts (at least one)"
        )


def layout(cfg: dict, world: int, source: str) -> Layout:
    """The run's layout, with the combinations DeepSpeed does not compose refused."""
    tp_section = cfg.get("tensor_parallel", {})
    if not isinstance(tp_section, dict):
        raise ConfigError(f"{source}: tensor_parallel must be an object")
    tp = tp_section.get("autotp_size", 0)
    if not ds_sections.is_whole(tp):
        raise ConfigError(
            f"{source}: tensor_parallel.autotp_size must be a whole number (0 or 1: off), got {tp!r}"
        )
    sp = cfg.get("sequence_parallel_size", 1)
    if not ds_sections.is_whole(sp, 1):
        raise ConfigError(
            f"{source}: sequence_parallel_size must be a positive integer, got {sp!r}"
        )
    pp = int(cfg.get("pipeline", {}).get("stages", 1))
    out = Layout(world, pp, max(tp, 1), sp)
    if expert_size(cfg) != 1:  # the shape is checked here, the model in preflight
        check_experts(expert_size(cfg), out.data, None, source)
    _check_composition(out, cfg, source)
    product = out.pipeline * out.tensor * out.sequence
    if world % product:
        named = [
            f"{key}={size}"
            for key, size in (
                ("pipeline.stages", out.pipeline),
                ("tensor_parallel.autotp_size", out.tensor),
                ("sequence_parallel_size", out.sequence),
            )
            if size > 1
        ]
        raise ConfigError(
            f"{source}: world size {world} is not divisible by {' x '.join(named)}"
            + (f" (= {product})" if len(named) > 1 else "")
            + f"; launch a multiple of {product} ranks"
        )
    return out


def _check_composition(out: Layout, cfg: dict, source: str) -> None:
    stage = int(cfg.get("zero_optimization", {}).get("stage", 0))
    if out.tensor > 1 and out.sequence > 1:
        raise ConfigError(
            f"{source}: tensor_parallel.autotp_size and sequence_parallel_size are both above 1: "
            "DeepSpeed's AutoTP and Ulysses each build their own process groups (AutoTP installs "
            "its groups as the engine's mpu, Ulysses passes its own), so they do not compose; "
            "pick one"
        )
    if out.pipeline > 1 and out.sequence > 1:
        raise ConfigError(
            f"{source}: sequence_parallel_size with pipeline.stages > 1: DeepSpeed's pipeline "
            "engine builds its grid from the PipelineModule's topology and does not apply "
            "Ulysses to it; use pipeline x tensor x data parallelism, or sequence x data"
        )
    if out.tensor > 1 and stage == 3:
        raise ConfigError(
            f"{source}: tensor_parallel with ZeRO-3: zerostack builds ZeRO-3 models under "
            "zero.Init, whose partitioned weights AutoTP would have to re-shard; use ZeRO 0-2 "
            "with tensor parallelism (ds_configs/tp2.json is ZeRO-1)"
        )
    off = cfg.get("zero_optimization", {})
    offload = any(
        (off.get(k) or {}).get("device", "none") not in ("none", None)
        for k in ("offload_optimizer", "offload_param")
    )
    if (out.tensor > 1 or out.sequence > 1) and offload:
        raise ConfigError(
            f"{source}: offload with tensor or sequence parallelism is not supported here; "
            "drop the offload sections"
        )


def check_model(
    out: Layout, *, heads: int, kv_heads: int, seq_len: int, source: str, intermediate: int = 0
) -> None:
    """What tensor and sequence parallelism need of the model's shape and the sequence
    (`intermediate`: the MLP width, which tensor-parallel pipeline stages cut evenly)."""
    if out.tensor > 1:
        sizes = [("num_attention_heads", heads), ("num_key_value_heads", kv_heads)]
        if out.pipeline > 1:
            sizes.append(("intermediate_size", intermediate))
        for name, n in sizes:
            if n % out.tensor:
                raise ConfigError(
                    f"{source}: tensor_parallel.autotp_size={out.tensor} does not divide the "
                    f"model's {name}={n}: each rank must hold whole heads and equal MLP slices"
                )
    if out.sequence > 1:
        sp = out.sequence
        if heads % sp:
            raise ConfigError(
                f"{source}: sequence_parallel_size={sp} does not divide the model's "
                f"num_attention_heads={heads}: Ulysses gives each rank whole heads"
            )
        if kv_heads % sp and sp % kv_heads:
            raise ConfigError(
                f"{source}: sequence_parallel_size={sp} and num_key_value_heads={kv_heads}: one "
                "must divide the other (Ulysses splits or replicates the kv heads)"
            )
        if seq_len % sp:
            raise ConfigError(
                f"{source}: --seq-len {seq_len} is not divisible by sequence_parallel_size={sp}; "
                f"use a multiple of {sp}"
            )


def check_own_plan(cfg: dict, model_cfg, source: str) -> None:
    """A config's own AutoTP plan (tensor_parallel.partition_config or preset_model) for a model
    with per-head query and key norms (qk_norm): where it splits wq or wk by heads, it must sum
    the matching norm's gradients over the group (a SKIP spec with grad_allreduce), as the
    model's own plan does; each rank's gradient is only its heads' share. Refused otherwise."""
    if not getattr(model_cfg, "qk_norm", False):
        return
    from deepspeed.module_inject.autotp_config import PartitionType
    from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig

    plan = TPTrainingConfig(**cfg["tensor_parallel"]).get_partition_config_object()
    if plan is None:
        return

    def spec(module: str):
        return plan.find_matching_spec(f"layers.0.attention.{module}.weight", model_cfg.model_type)

    for projection, norm in (("wq", "q_norm"), ("wk", "k_norm")):
        split = spec(projection)
        split = split is not None and split.partition_type != PartitionType.SKIP
        if split and not getattr(spec(norm), "grad_allreduce", False):
            raise ConfigError(
                f"{source}: --qk-norm with this tensor_parallel plan: it splits {projection} by "
                f"heads but does not sum {norm}'s gradients over the group; add the layer spec "
                f'{{"patterns": [".*{norm}.weight$"], "partition_type": "skip", '
                '"grad_allreduce": true}, or drop partition_config and preset_model'
            )
