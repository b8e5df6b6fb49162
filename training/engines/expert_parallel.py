"""Expert parallelism for our MoE model through DeepSpeed's AutoEP (deepspeed.module_inject.auto_ep).

AutoEP, given the patterns below, finds each routed MLP of ZeroStackMoeForCausalLM (a `gate`
router and Mixtral-style stacked `experts`), replaces it with its own layer holding
num_experts / ep_size experts per rank, and exchanges tokens between the ranks of an expert
group with all_to_all_single (gloo does it between CPU ranks). Its router routes as ours does
(softmax over all experts, top-k, renormalised), so a 2-rank expert-parallel step's gradient is
the 1-rank step's (tests/test_moe_training.py). AutoEP was chosen over DeepSpeed's older
`deepspeed.moe.layer.MoE`, whose gate (capacity factor, token dropping, noisy second expert)
routes differently from Mixtral's and from the exported model.

The layout rules (an expert-parallel size that divides the data-parallel ranks and the
experts) live with the others in training/settings/parallel.py.

AutoEP's layer keeps no router logits, which our model needs for its load-balancing and z-losses:
`capture_router_logits` hooks each replaced router so the model finds them where it looks.

AutoEP swaps each matched MLP whole for its own layer (deepspeed/module_inject/auto_ep.py,
`setattr(parent, child_name, replacement)`), which takes over a shared expert only where its
preset declares one (`has_shared_experts` and `shared_experts_pattern`: Qwen3-MoE's does,
Mixtral's, the one ours runs under, does not; auto_ep_layer.py adds the kept one's output in
`_finalize_output`). Our shared expert would leave the model unseen, so `check_shared_expert`
refuses the combination before any work.
"""

from __future__ import annotations

import torch
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


def autoep_layers(model: nn.Module) -> list[nn.Module]:
    """The layers AutoEP put in place of `model`'s routed MLPs."""
    return [m for m in model.modules() if type(m).__name__ == "AutoEPMoELayer"]


def adopt_layers(model: nn.Module) -> None:
    """What our model needs of the layers AutoEP put in place of its routed MLPs: their router
    logits kept, and their forward kept out of compiled graphs."""
    capture_router_logits(model)
    run_eagerly(model)


def capture_router_logits(model: nn.Module) -> int:
    """Make every AutoEP layer of `model` keep its router's fp32 logits of the last forward in
    `router_logits`, as our own routed MLP does; returns how many layers."""
    layers = autoep_layers(model)
    for layer in layers:
        layer.router_logits = None

        def keep(module, inputs, output, layer=layer):
            layer.router_logits = output.float()

        layer.router.gate.register_forward_hook(keep)
    return len(layers)


def run_eagerly(model: nn.Module) -> int:
    """Keep every AutoEP layer of `model` out of torch.compile's graphs: it sends the tokens per
    expert between ranks as Python lists (all_to_all splits), on which Dynamo would specialise
    and recompile the block at every new split until its limit. The compiled parts of a block
    run around it. Returns how many layers."""
    layers = autoep_layers(model)
    for layer in layers:
        layer.forward = torch.compiler.disable(layer.forward)
    return len(layers)


def check_shared_expert(model_cfg, ep_size: int, source: str) -> None:
    """One ConfigError line for expert parallelism (`ep_size` > 1) on our MoE model with a
    shared expert, which AutoEP's Mixtral-preset layer would drop from the model."""
    width = getattr(model_cfg, "shared_expert_intermediate_size", 0)
    if ep_size > 1 and width and getattr(model_cfg, "model_type", None) == "zerostack_moe":
        raise ConfigError(
            f"{source}: expert parallelism (expert_parallel.autoep_size={ep_size}) with a shared "
            f"expert (shared_expert_intermediate_size={width}) is not supported: AutoEP's layer "
            "has no shared expert and would drop it; train without expert_parallel, or without "
            "the shared expert"
        )
