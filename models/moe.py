"""ZeroStackMoeForCausalLM: our Llama-style blocks with a routed mixture-of-experts MLP.

Routing as Mixtral and Qwen3-MoE do it: the router's logits are computed in fp32, each token goes
to its top-k experts, weighted by a softmax over those k logits (the same numbers as Mixtral's
softmax over all experts renormalised over the chosen k). An optional shared expert sees every
token. Experts are stored as Mixtral's stacked weights (`gate_up_proj` (E, 2I, H) with the gate
rows first, `down_proj` (E, H, I)), so export is a renaming and DeepSpeed's AutoEP finds them.

The training loss adds the load-balancing loss (Switch Transformer's, computed as transformers'
Mixtral does, so the exported model reports the same number) and the router z-loss (ST-MoE),
each times its coefficient in the config. The last forward's router statistics stay on the model
(`router_stats`) for the training loop to log.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers import initialization as init
from transformers.modeling_outputs import MoeCausalLMOutputWithPast

from models.config import ZeroStackMoeConfig
from models.llama import _CACHE_FIELD, Block, FeedForward, ZeroStackForCausalLM, _linear


class Experts(nn.Module):
    """`num_experts` SwiGLU MLPs as stacked weights; tokens are gathered expert by expert."""

    def __init__(self, config: ZeroStackMoeConfig):
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.intermediate_size
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        # read by the initialisers: down is a residual projection, scaled like the dense w2
        std = config.initializer_range
        self.gate_up_proj.init_std = std
        self.down_proj.init_std = std / math.sqrt(2 * config.num_hidden_layers)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x (tokens, H); index, weight (tokens, k): each token's experts and their weights."""
        k = index.shape[1]
        flat = index.reshape(-1)
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // k
        weights = weight.reshape(-1)[order].unsqueeze(1)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = tokens[start : start + n]
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, rows, (y * weights[start : start + n]).to(out.dtype))
            start += n
        return out


class MoeFeedForward(nn.Module):
    """Router (`gate`, fp32), routed `experts` and an optional `shared_expert`. The last forward's
    router logits (tokens, E), fp32, are kept in `router_logits` for the model's losses."""

    def __init__(self, config: ZeroStackMoeConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.gate = _linear(config.hidden_size, config.num_experts, config.initializer_range)
        self.experts = Experts(config)
        width = config.shared_expert_intermediate_size
        self.shared_expert = FeedForward(config, width) if width else None
        self.router_logits: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        # fp32 routing whatever the autocast or parameter dtype: near-ties must not flip experts
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.gate.weight.float())
        top, index = logits.topk(self.top_k, dim=-1)
        self.router_logits = logits
        out = self.experts(x, index, top.softmax(dim=-1))
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out.view(shape)


@dataclass
class RouterStats:
    """One forward's router losses (scalars, with their graph) and each layer's tokens per expert
    (layers, experts), counting a token once for each of its k experts."""

    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    tokens_per_expert: torch.Tensor


def router_stats(router_logits: list[torch.Tensor], top_k: int) -> RouterStats:
    """The load-balancing loss E * sum_e f_e * P_e over all layers' tokens together, f_e the share
    of top-k assignments that went to expert e (its sum is k) and P_e the mean router probability
    (transformers' Mixtral `load_balancing_loss_func`, k at perfect balance), and the z-loss, the
    mean over tokens and layers of logsumexp(logits)^2."""
    num_experts = router_logits[0].shape[-1]
    counts, probs, z = [], 0.0, 0.0
    for logits in router_logits:
        index = logits.topk(top_k, dim=-1).indices
        counts.append(torch.bincount(index.reshape(-1), minlength=num_experts))
        probs = probs + logits.softmax(dim=-1).sum(dim=0)
        z = z + torch.logsumexp(logits, dim=-1).square().mean()
    rows = sum(logits.shape[0] for logits in router_logits)
    tokens = torch.stack(counts)
    share = tokens.sum(dim=0).float() / rows
    aux = num_experts * (share * (probs / rows)).sum()
    return RouterStats(aux, z / len(router_logits), tokens)


class ZeroStackMoeForCausalLM(ZeroStackForCausalLM):
    """The MoE causal LM. `forward` returns a `MoeCausalLMOutputWithPast` whose loss, in training
    mode with labels, is the cross-entropy plus the weighted router losses (eval: cross-entropy
    alone, comparable with a dense model's); `aux_loss` is the load-balancing loss."""

    config_class = ZeroStackMoeConfig
    base_model_prefix = "zerostack_moe"

    def _block(self, config: ZeroStackMoeConfig, layer_idx: int) -> Block:
        return Block(config, layer_idx, MoeFeedForward(config))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, Experts):
            for p in (module.gate_up_proj, module.down_proj):
                init.normal_(p, mean=0.0, std=p.init_std)
        else:
            super()._init_weights(module)

    def moe_layers(self) -> list[nn.Module]:
        """The routed MLPs: ours, or what expert parallelism put in their place (it keeps their
        `router_logits` up to date, training/engines/)."""
        return [m for m in self.modules() if hasattr(m, "router_logits")]

    def forward(self, *args, **kwargs) -> MoeCausalLMOutputWithPast:
        out = super().forward(*args, **kwargs)
        layers = self.moe_layers()
        stats = router_stats([m.router_logits for m in layers], self.config.num_experts_per_tok)
        for m in layers:
            m.router_logits = None
        self.router_stats = RouterStats(
            stats.aux_loss.detach(), stats.z_loss.detach(), stats.tokens_per_expert
        )
        if self.training:  # summed until the loop takes them (take_router_totals)
            totals = getattr(self, "router_totals", None)
            self.router_totals = (
                self.router_stats if totals is None else _add(totals, self.router_stats)
            )
            self.router_forwards = getattr(self, "router_forwards", 0) + 1
        loss = out.loss
        if loss is not None and self.training:
            c = self.config
            loss = (
                loss + c.router_aux_loss_coef * stats.aux_loss + c.router_z_loss_coef * stats.z_loss
            )
        return MoeCausalLMOutputWithPast(
            loss=loss,
            aux_loss=stats.aux_loss,
            logits=out.logits,
            **{_CACHE_FIELD: getattr(out, _CACHE_FIELD)},
        )


def _add(a: RouterStats, b: RouterStats) -> RouterStats:
    return RouterStats(
        a.aux_loss + b.aux_loss, a.z_loss + b.z_loss, a.tokens_per_expert + b.tokens_per_expert
    )


def take_router_totals(model: nn.Module) -> RouterStats | None:
    """The router statistics of the training forwards since the last call, and a reset: the
    mean load-balancing and z-losses over those forwards and the tokens each expert of each
    layer received in all of them. None for a model without our routers, or none run since."""
    totals = getattr(model, "router_totals", None)
    if totals is None:
        return None
    n = model.router_forwards
    model.router_totals, model.router_forwards = None, 0
    return RouterStats(totals.aux_loss / n, totals.z_loss / n, totals.tokens_per_expert)


def router_metrics(stats: RouterStats) -> dict[str, float]:
    """`stats` as the metrics log's fields: the load-balancing loss, the z-loss and the fewest
    and most tokens any expert of any layer received."""
    tokens = stats.tokens_per_expert
    return {
        "moe_aux_loss": float(stats.aux_loss),
        "moe_z_loss": float(stats.z_loss),
        "moe_expert_tokens_min": int(tokens.min()),
        "moe_expert_tokens_max": int(tokens.max()),
    }


AutoConfig.register("zerostack_moe", ZeroStackMoeConfig, exist_ok=True)
AutoModelForCausalLM.register(ZeroStackMoeConfig, ZeroStackMoeForCausalLM, exist_ok=True)
