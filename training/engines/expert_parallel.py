"""Expert parallelism for our MoE model through DeepSpeed's AutoEP (deepspeed.module_inject.auto_ep).

AutoEP, given the patterns below, finds each routed MLP of ZeroStackMoeForCausalLM (a `gate`
router and Mixtral-style stacked `experts`), replaces it with its own layer holding
num_experts / ep_size experts per rank, and exchanges tokens between the ranks of an expert
group with all_to_all_single (gloo does it between CPU ranks). Its router routes as ours does
(softmax over all experts, top-k, renormalised), so a 2-rank expert-parallel step's gradient is
the 1-rank step's (tests/test_moe_training.py). AutoEP was chosen over DeepSpeed's older
`deepspeed.moe.layer.MoE`, whose gate (capacity factor, token dropping, noisy second expert)
routes differently from Mixtral's and from the exported model.

AutoEP's layer keeps no router logits, which our model needs for its load-balancing and z-losses:
`capture_router_logits` hooks each replaced router so the model finds them where it looks.
"""

from __future__ import annotations

from torch import nn

from training.errors import ConfigError


def autoep_section(ep_size: int) -> dict:
    """The DeepSpeed config's `expert_parallel` section for our MoE model on `ep_size` ranks per
    expert group (the Mixtral preset with our module names; the for-loop expert path, which runs
    on devices without grouped GEMM)."""
    return {
        "enabled": True,
        "autoep_size": ep_size,
        "preset_model": "mixtral",
        "moe_layer_pattern": r"layers\.\d+\.feed_forward",
        "num_experts_attr": "num_experts",
        "top_k_attr": "num_experts_per_tok",
        "use_grouped_mm": False,
    }


def check_expert_layout(
    ep_size: int, data_parallel: int, num_experts: int, top_k: int, source: str
) -> None:
    """One ConfigError line for an expert-parallel size the run cannot have: not a positive
    integer, not dividing the data-parallel ranks, or leaving a rank without an expert or with
    a share of one (num_experts must divide into ep_size whole parts)."""
    if not isinstance(ep_size, int) or isinstance(ep_size, bool) or ep_size < 1:
        raise ConfigError(f"{source}: expert_parallel.autoep_size must be a positive integer")
    if data_parallel % ep_size:
        raise ConfigError(
            f"{source}: expert_parallel.autoep_size={ep_size} does not divide the "
            f"{data_parallel} data-parallel ranks; launch a multiple of {ep_size}"
        )
    if ep_size > num_experts or num_experts % ep_size:
        raise ConfigError(
            f"{source}: expert_parallel.autoep_size={ep_size} cannot share the model's "
            f"{num_experts} experts: each rank must hold the same whole number of experts "
            "(at least one)"
        )
    if top_k > num_experts:
        raise ConfigError(
            f"{source}: num_experts_per_tok={top_k} is above the model's {num_experts} experts"
        )


def capture_router_logits(model: nn.Module) -> int:
    """Make every AutoEP layer of `model` keep its router's fp32 logits of the last forward in
    `router_logits`, as our own routed MLP does; returns how many layers."""
    layers = [m for m in model.modules() if type(m).__name__ == "AutoEPMoELayer"]
    for layer in layers:
        layer.router_logits = None

        def keep(module, inputs, output, layer=layer):
            layer.router_logits = output.float()

        layer.router.gate.register_forward_hook(keep)
    return len(layers)
