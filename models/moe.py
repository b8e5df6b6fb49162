"""ZeroStackMoeForCausalLM: our Llama-style blocks with a routed mixture-of-experts MLP.

Routing as Mixtral and Qwen3-MoE do it: the router's logits are computed in fp32, each token goes
to its top-k experts, weighted by a softmax over those k logits (the same numbers as Mixtral's
softmax over all experts renormalised over the chosen k). An optional shared expert sees every
token. Experts are stored as Mixtral's stacked weights (`gate_up_proj` (E, 2I, H) with the gate
rows first, `down_proj` (E, H, I)), so export is a renaming and DeepSpeed's AutoEP finds them.

The training loss adds the load-balancing loss (Switch Transformer's, each layer's over its real
tokens, averaged over the layers as Switch and Megatron do) and the router z-loss (ST-MoE), each
times its coefficient in the config. Padding is left out of both: the real tokens are given
(`router_mask`), or read off the targets of a right-padded batch (`real_tokens`). The last
forward's router statistics stay on the model (`router_stats`) for the training loop to log.

Any MoE model, ours or an HF folder's (Mixtral, Qwen3-MoE), trains on its router losses:
`router_loss` gives what an objective that computes its own loss from the logits (DPO) must
add, and `train_router_losses` makes an HF MoE model compute its router logits in training
(transformers adds its load-balancing loss only when asked for them) without changing its config.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers import initialization as init
from transformers.modeling_outputs import MoeCausalLMOutputWithPast

from models.config import ZeroStackMoeConfig
from models.llama import (
    _CACHE_FIELD,
    IGNORE_INDEX,
    Block,
    FeedForward,
    ZeroStackForCausalLM,
    _linear,
    compute_dtype,
)

# (device type, dtype, compiled) -> whether torch._grouped_mm runs there (grouped_mm_runs)
_GROUPED: dict[tuple[str, torch.dtype, bool], bool] = {}


def grouped_mm_runs(device: torch.device, dtype: torch.dtype, compiled: bool = False) -> bool:
    """Whether torch._grouped_mm runs on `device` in `dtype`, forward and backward with an empty
    group, and `compiled`: under torch.compile too. Tried once per device type and dtype. CPU
    runs it eagerly in every float dtype; compiled, torch traces it in bf16 alone; CUDA has it
    where it has a grouped kernel (bf16 on recent devices). Elsewhere the experts loop."""
    key = (device.type, dtype, compiled)
    if key not in _GROUPED:
        _GROUPED[key] = _try_grouped_mm(device, dtype) and (
            not compiled or _try_grouped_mm(torch.device("meta"), dtype)  # what tracing runs
        )
    return _GROUPED[key]


@torch.compiler.disable
def _try_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        with torch.enable_grad():
            a = torch.ones(32, 16, device=device, dtype=dtype, requires_grad=True)
            b = torch.ones(2, 32, 16, device=device, dtype=dtype, requires_grad=True)
            offs = torch.tensor([0, 32], device=device, dtype=torch.int32)
            out = torch._grouped_mm(a, b.transpose(-2, -1), offs=offs)
            (out * out).sum().backward()  # an expanded gradient (sum alone) it refuses
        if device.type == "meta":
            return True
        return bool(out.float().eq(16).all()) and bool(b.grad[1].eq(2 * 16 * 32).all())
    except (RuntimeError, NotImplementedError, TypeError):
        return False


class Experts(nn.Module):
    """`num_experts` SwiGLU MLPs as stacked weights; each projection of every expert's tokens is
    one grouped matmul where the device has one."""

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
        """x (tokens, H); index, weight (tokens, k): each token's experts and their weights.
        Every expert's tokens in one grouped matmul per projection where the device has one
        (`grouped_mm_runs`), else a matmul per expert (`loop_forward`)."""
        dtype = compute_dtype(x)
        if torch.compiler.is_compiling():  # the choice the model's eager forward made (no probe)
            grouped = _GROUPED.get((x.device.type, dtype, True), False)
        else:
            grouped = grouped_mm_runs(x.device, dtype)
        if not grouped:
            return self.loop_forward(x, index, weight)
        flat, tokens, weights = _by_expert(index, weight)
        # the groups' ends stay on the device: no host sync (bincount's CUDA kernel has one)
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        ends = counts.cumsum(0, dtype=torch.int32)
        rows = x[tokens].to(dtype)
        gate_up = torch._grouped_mm(rows, self.gate_up_proj.to(dtype).transpose(-2, -1), offs=ends)
        gate, up = gate_up.chunk(2, dim=-1)
        down = self.down_proj.to(dtype).transpose(-2, -1)
        y = torch._grouped_mm(F.silu(gate) * up, down, offs=ends)
        # in expert order, as the loop adds them: each token's k outputs summed in the same order
        return torch.zeros_like(x).index_add_(0, tokens, (y * weights).to(x.dtype))

    # Never compiled: its tokens per expert are Python ints, which Dynamo would specialise on
    # and recompile the block for at every new count until its limit.
    @torch.compiler.disable
    def loop_forward(
        self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor
    ) -> torch.Tensor:
        """`forward` as a matmul per expert: the reference the grouped path is held to, and the
        path of devices without a grouped matmul (a host sync for the tokens per expert)."""
        flat, tokens, weights = _by_expert(index, weight)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
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


def _by_expert(index: torch.Tensor, weight: torch.Tensor):
    """(each slot's expert, its token, its weight (slots, 1)) of the (token, slot) pairs of
    `index` and `weight` (tokens, k), grouped by expert in token order."""
    flat = index.reshape(-1)
    order = flat.argsort(stable=True)
    return flat, order // index.shape[1], weight.reshape(-1)[order].unsqueeze(1)


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


def router_stats(
    router_logits: list[torch.Tensor],
    top_k: int,
    real: torch.Tensor | None = None,
    group=None,
) -> RouterStats:
    """Per layer, over its real tokens: the load-balancing loss E * sum_e f_e * P_e, f_e the share
    of the layer's top-k assignments that went to expert e (its sum is k) and P_e the expert's
    mean router probability (k at perfect balance), and the z-loss, the mean of
    logsumexp(logits)^2; each averaged over the layers. `router_logits`: each layer's (tokens, E);
    `real`: (tokens,) or any shape of as many, True for a token of the batch, False for padding,
    which counts in neither f_e nor P_e nor the tokens per expert; None: every token.

    `group`: the ranks holding the other slices of the same sequences (sequence parallelism).
    f_e, the token counts and the means' denominators are then the group's, and the losses are
    this rank's share (its own probabilities over the group's tokens): the shares add up over the
    group to the losses of the whole sequences, and so do their gradients. Each slice's own
    losses would not: the loss is a product of two means. The tokens per expert stay this
    rank's own."""
    num_experts = router_logits[0].shape[-1]
    weight = None if real is None else real.reshape(-1, 1).float()
    tokens, probs, lse = [], [], []
    for logits in router_logits:
        logits = logits.reshape(-1, num_experts)
        index = logits.topk(top_k, dim=-1).indices
        p = logits.softmax(dim=-1)
        z = torch.logsumexp(logits, dim=-1).square()
        if weight is None:
            n = torch.tensor(float(logits.shape[0]), device=logits.device)
            tokens.append(torch.bincount(index.reshape(-1), minlength=num_experts))
            probs.append(p.sum(dim=0))
            lse.append(z.sum())
        else:
            w = weight.to(logits.device)
            n = w.sum()
            # padding's assignments go to a bin past the experts, which is dropped
            index = index.masked_fill(w == 0, num_experts)
            tokens.append(torch.bincount(index.reshape(-1), minlength=num_experts + 1)[:-1])
            probs.append((p * w).sum(dim=0))
            lse.append((z * w[:, 0]).sum())
    own, probs, lse = torch.stack(tokens), torch.stack(probs), torch.stack(lse)
    counts = own.float()
    if group is not None:  # one all-reduce: the counts and the denominator, no gradient
        packed = torch.cat([counts.flatten(), n.reshape(1).float()])
        torch.distributed.all_reduce(packed, group=group)
        counts, n = packed[:-1].view_as(counts), packed[-1]
    n = n.clamp_min(1.0)
    aux = num_experts * ((counts / n) * (probs / n)).sum(dim=-1)
    return RouterStats(aux.mean(), (lse / n).mean(), own)


def pooled_balancing_loss(
    router_logits: tuple[torch.Tensor, ...],
    num_experts: int,
    top_k: int,
    group=None,
    real: torch.Tensor | None = None,
) -> torch.Tensor:
    """transformers' load-balancing loss (`load_balancing_loss_func` of Mixtral, Qwen3-MoE:
    f_e and P_e over the tokens of every layer pooled; `real` (batch, seq) as its attention
    mask, padding left out), as this rank's share when `group` holds the other slices of the
    same sequences: the shares add up over the group to the whole sequences' loss, as
    `router_stats`'s do."""
    device = router_logits[0].device
    counts = torch.zeros(num_experts + 1, device=device)  # the last bin: padding's assignments
    probs = torch.zeros(num_experts, device=device)
    w = None if real is None else real.reshape(-1).to(device=device, dtype=torch.float32)
    rows = torch.zeros((), device=device)
    for logits in router_logits:
        p = logits.float().softmax(dim=-1)
        index = p.topk(top_k, dim=-1).indices
        if w is None:
            rows = rows + p.shape[0]
        else:
            index = index.masked_fill(w[:, None] == 0, num_experts)
            p, rows = p * w[:, None], rows + w.sum()
        counts = counts + torch.bincount(index.reshape(-1), minlength=num_experts + 1).float()
        probs = probs + p.sum(dim=0)
    packed = torch.cat([counts[:-1], rows.reshape(1)])
    if group is not None:
        torch.distributed.all_reduce(packed, group=group)
    counts, n = packed[:-1], packed[-1].clamp_min(1.0)
    return num_experts * ((counts / n) * (probs / n)).sum()


def real_tokens(targets: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """(batch, seq) bool, the tokens of each row's example, from its targets (batch, seq:
    targets[:, t] is what token t predicts, `ignore_index` where nothing is trained). Samples are
    padded at the end (data/examples.py, data/pairs.py), so a row's tokens run to the one its
    last trained target names; what follows is padding, or an untrained tail of the example that
    no trained position sees. A row with nothing trained keeps its first token."""
    pos = torch.arange(targets.shape[-1], device=targets.device)
    last = torch.where(targets != ignore_index, pos, -1).amax(dim=-1, keepdim=True)
    return pos <= last + 1


@dataclass
class MoeOutput(MoeCausalLMOutputWithPast):
    """transformers' MoE output, and `router_loss`: in training, the weighted router losses of
    this forward (what `loss` includes when labels are given); None in eval."""

    router_loss: torch.FloatTensor | None = None


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

    def _choose_expert_matmuls(self, input_ids, inputs_embeds) -> None:
        """Try the grouped matmul for this forward's device and dtype, eagerly: compiled blocks
        read the answer (Experts.forward) rather than break their graph to try it."""
        given = input_ids if input_ids is not None else inputs_embeds
        if given is None:
            return
        device = given.device
        dtype = (
            torch.get_autocast_dtype(device.type)
            if torch.is_autocast_enabled(device.type)
            else self.get_input_embeddings().weight.dtype
        )
        grouped_mm_runs(device, dtype)
        grouped_mm_runs(device, dtype, compiled=True)

    def moe_layers(self) -> list[nn.Module]:
        """The routed MLPs: ours, or what expert parallelism put in their place (it keeps their
        `router_logits` up to date, training/engines/)."""
        return [m for m in self.modules() if hasattr(m, "router_logits")]

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        shift_labels: torch.LongTensor | None = None,
        *args,
        router_mask: torch.Tensor | None = None,
        router_group=None,
        **kwargs,
    ) -> MoeOutput:
        """As the dense model's forward (models/llama.py), and `router_mask` (batch, seq), True
        for the tokens the router losses and counts take; without it, the ones `attention_mask`
        keeps, else the real tokens of the targets (`real_tokens`) when labels are given, else
        every token. `router_group`: the ranks holding the other slices of these sequences
        (sequence parallelism; `router_stats`)."""
        self._choose_expert_matmuls(input_ids, kwargs.get("inputs_embeds"))
        out = super().forward(input_ids, attention_mask, labels, shift_labels, *args, **kwargs)
        layers = self.moe_layers()
        logits = [m.router_logits for m in layers]
        if router_mask is None and attention_mask is not None:  # its last columns: these tokens
            rows = logits[0].shape[0] // attention_mask.shape[0]
            router_mask = attention_mask[:, -rows:].bool()
        elif router_mask is None and labels is not None:
            if shift_labels is None:  # as causal_lm_loss shifts them
                shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
            router_mask = real_tokens(shift_labels, kwargs.get("ignore_index", IGNORE_INDEX))
        stats = router_stats(logits, self.config.num_experts_per_tok, router_mask, router_group)
        for m in layers:
            m.router_logits = None
        # logged as means over every rank (training/loop/routers.py): a share times its group's
        # size averages to the whole sequences' loss
        size = 1 if router_group is None else torch.distributed.get_world_size(router_group)
        self.router_stats = RouterStats(
            stats.aux_loss.detach() * size, stats.z_loss.detach() * size, stats.tokens_per_expert
        )
        loss, weighted = out.loss, None
        if self.training:  # summed until the loop takes them (take_router_totals)
            totals = getattr(self, "router_totals", None)
            self.router_totals = (
                self.router_stats if totals is None else _add(totals, self.router_stats)
            )
            self.router_forwards = getattr(self, "router_forwards", 0) + 1
            c = self.config
            weighted = c.router_aux_loss_coef * stats.aux_loss + c.router_z_loss_coef * stats.z_loss
            if loss is not None:
                loss = loss + weighted
        return MoeOutput(
            loss=loss,
            aux_loss=stats.aux_loss,
            logits=out.logits,
            router_loss=weighted,
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


def _unwrapped(model: nn.Module) -> nn.Module:
    """The model inside an engine's wrapper (DeepSpeed's engine, DDP: `.module`) and peft's."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    base = getattr(model, "get_base_model", None)
    return base() if callable(base) else model


def router_inputs(model: nn.Module, targets: torch.Tensor) -> dict:
    """What an objective that calls `model` (or an engine or peft wrapper of it) without labels
    passes beside its inputs so the router losses leave padding out: for our MoE model, and an
    HF MoE model made to train its router losses, the real tokens of `targets` (batch, seq;
    `real_tokens`) as `router_mask`; nothing for any other."""
    if takes_router_group(_unwrapped(model)):
        return {"router_mask": real_tokens(targets)}
    return {}


def router_loss(model: nn.Module, output) -> torch.Tensor | float:
    """The weighted router losses an objective that computes its own loss from `output`, the
    forward of `model` (or an engine or peft wrapper of it) without labels, must add: in
    training, our MoE model's `router_loss` (router_aux_loss_coef x the load-balancing loss +
    router_z_loss_coef x the z-loss), or an HF MoE model's router_aux_loss_coef x its `aux_loss`
    (transformers' load-balancing loss, what its forward adds with labels; `train_router_losses`);
    0 for a model without routers, and in eval (a validation loss stays the objective's alone)."""
    inner = _unwrapped(model)
    if not inner.training:
        return 0.0
    own = getattr(output, "router_loss", None)
    if own is not None:
        return own
    aux = getattr(output, "aux_loss", None)
    if aux is None:
        return 0.0
    config = getattr(inner, "config", None)
    coef = getattr(inner, "router_aux_loss_coef", getattr(config, "router_aux_loss_coef", 0.0))
    return coef * aux


def train_router_losses(model: nn.Module) -> nn.Module:
    """`model` itself; an HF MoE model (a config with `output_router_logits`: Mixtral,
    Qwen3-MoE, ...) now asks for its router logits in training mode, so its forward adds
    router_aux_loss_coef x its load-balancing loss to the loss it returns with labels and returns
    that loss as `aux_loss` without: transformers adds it only when `output_router_logits` is
    set, which its configs leave off. The config is not changed, so a save or export of it, and
    the run's record, load in stock transformers as before; eval mode (validation, generation)
    runs as stock. Our MoE model and dense models are returned as they are."""
    config = getattr(model, "config", None)
    if isinstance(model, ZeroStackMoeForCausalLM) or not hasattr(config, "output_router_logits"):
        return model
    # bound to the model, so callers of model.forward (peft) get it too, and a copy rebinds it
    model.forward = types.MethodType(_forward_with_router_logits, model)
    return model


def takes_router_group(model: nn.Module) -> bool:
    """Whether `model`'s forward takes `router_group`: our MoE model's, and an HF MoE model's
    once `train_router_losses` made it train its router losses."""
    forward = getattr(model, "forward", None)
    own = getattr(forward, "__func__", None) is _forward_with_router_logits
    return isinstance(model, ZeroStackMoeForCausalLM) or own


def _forward_with_router_logits(self, *args, router_group=None, router_mask=None, **kwargs):
    """The model's forward with router logits in training. transformers' load-balancing loss
    counts every token of the batch (it takes no mask without an attention mask) and each
    slice alone under sequence parallelism; where there is padding (`router_mask`, else the
    real tokens of the labels, as our model takes them) or a `router_group` (the ranks holding
    the other slices of these sequences), it is replaced by `pooled_balancing_loss` over the
    real tokens of the whole sequences (this rank's share)."""
    if self.training and kwargs.get("output_router_logits") is None:
        kwargs["output_router_logits"] = True
    out = type(self).forward(self, *args, **kwargs)
    if getattr(out, "router_logits", None) is None or out.aux_loss is None:
        return out
    labels = kwargs.get("labels")
    if router_mask is None and labels is not None and kwargs.get("attention_mask") is None:
        shifted = kwargs.get("shift_labels")
        if shifted is None:
            shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        router_mask = real_tokens(shifted)
    padded = router_mask is not None and not bool(router_mask.all())
    if router_group is None and not padded:
        return out  # transformers' own loss is the same
    experts, k = out.router_logits[0].shape[-1], self.num_experts_per_tok
    share = pooled_balancing_loss(out.router_logits, experts, k, router_group, router_mask)
    if out.loss is not None:
        out.loss = out.loss + self.router_aux_loss_coef * (share - out.aux_loss)
    out.aux_loss = share
    return out


AutoConfig.register("zerostack_moe", ZeroStackMoeConfig, exist_ok=True)
AutoModelForCausalLM.register(ZeroStackMoeConfig, ZeroStackMoeForCausalLM, exist_ok=True)
