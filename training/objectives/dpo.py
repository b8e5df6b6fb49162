"""The DPO family on preference pairs: the loss of a micro-batch of pairs from the policy's and
the reference model's log-probabilities of each answer, and what a user watches (rewards,
margin, accuracy, log-probs).

    dpo  the sigmoid loss of Rafailov et al. (2023): -log sigmoid(beta * h), h the policy's
         log-ratio of chosen over rejected minus the reference's
    ipo  Azar et al. (2023): (h - 1 / (2 beta))^2 on log-probs averaged over the answer's
         tokens (as TRL computes it): a bounded target, where DPO keeps pushing h up on pairs
         it already ranks right, which over-fits preferences that are always the same way

A batch holds 2B rows, chosen and rejected of pair i at rows 2i and 2i + 1 (data/pairs.py).
The loss is the mean over the micro-batch's pairs; every micro-batch of a step holds as many
pairs, so the engines' mean over micro-batches and ranks is the mean over the global batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from data.examples import IGNORE_INDEX
from models.moe import router_inputs, router_loss
from training.runtime.distributed import all_reduce_scalars

OBJECTIVES = ("dpo", "ipo")
# The sums a PreferenceLoss keeps per mode (train, eval), in this order.
# accuracy: the chosen answer's reward is the higher (0 at the start, where both are 0);
# prefers_chosen: the policy gives the chosen answer the higher log-prob (the model's own ranking)
_STATS = ("pairs", "rewards_chosen", "rewards_rejected", "accuracy", "logps_chosen",
          "logps_rejected", "prefers_chosen")  # fmt: skip


CHUNK_ELEMENTS = 1 << 21  # logits upcast at a time: 8 MiB of fp32, whatever the vocabulary


class _TargetLogps(torch.autograd.Function):
    """log p(target) at each position in fp32, from (N, V) logits a block of rows at a time.

    The same numbers as `log_softmax(logits.float()).gather(targets)` and its autograd
    gradient, but neither the fp32 copy of the logits nor their log-softmax over the
    vocabulary is ever whole, in forward or backward: what is kept for backward is the logits
    as they came, and backward makes each block's log-softmax again, forms the gradient
    (g * (onehot - softmax)) in fp32 and rounds it once to the logits' dtype, as autograd does.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        picked = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for i, block in _blocks(logits):
            logp = torch.log_softmax(block.float(), dim=-1)
            picked[i : i + len(block)] = logp.gather(-1, targets[i : i + len(block), None])[:, 0]
        ctx.save_for_backward(logits, targets)
        return picked

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, targets = ctx.saved_tensors
        out = torch.empty_like(logits)
        g = grad.float()
        for i, block in _blocks(logits):
            gi, ti = g[i : i + len(block), None], targets[i : i + len(block), None]
            logp = torch.log_softmax(block.float(), dim=-1)
            onehot = torch.zeros_like(logp).scatter_add_(-1, ti, gi)  # gather's backward
            # log_softmax's own backward kernel (onehot - softmax * g): autograd's numbers
            out[i : i + len(block)] = torch._log_softmax_backward_data(
                onehot, logp, -1, torch.float32
            )
        return out, None


def _blocks(logits: torch.Tensor):
    """(first row, block) over (N, V) logits, CHUNK_ELEMENTS at a time."""
    rows = max(1, CHUNK_ELEMENTS // logits.shape[-1])
    for i in range(0, logits.shape[0], rows):
        yield i, logits[i : i + rows]


def sequence_logps(
    logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of each row's trained targets in fp32, their count): logits
    (rows, T, V) predict targets (rows, T), IGNORE_INDEX where nothing is trained. No
    full-vocabulary fp32 tensor is made (_TargetLogps), in forward or backward."""
    trained = targets != IGNORE_INDEX
    flat = logits.reshape(-1, logits.shape[-1])
    picked = _TargetLogps.apply(flat, targets.clamp(min=0).reshape(-1)).view(targets.shape)
    return (picked * trained).sum(-1), trained.sum(-1)


def preference_loss(
    kind: str,
    beta: float,
    policy: torch.Tensor,
    reference: torch.Tensor,
    lengths: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss over the pairs, the batch's sums in _STATS order): `policy` and `reference`
    are the 2B summed answer log-probs (chosen, rejected interleaved), `lengths` their token
    counts. Rewards are beta times the policy's log-ratio over the reference."""
    if kind == "ipo":  # IPO works on per-token averages
        policy, reference = policy / lengths, reference / lengths
    pi, ref = policy.view(-1, 2), reference.view(-1, 2).to(policy.dtype)
    h = (pi[:, 0] - pi[:, 1]) - (ref[:, 0] - ref[:, 1])
    if kind == "dpo":
        losses = -F.logsigmoid(beta * h)
    elif kind == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {kind!r}")
    rewards = (beta * (pi - ref)).detach()
    stats = torch.stack(
        [
            torch.tensor(float(len(h)), device=h.device),
            rewards[:, 0].sum(),
            rewards[:, 1].sum(),
            (rewards[:, 0] > rewards[:, 1]).float().sum(),
            pi[:, 0].detach().sum(),
            pi[:, 1].detach().sum(),
            (pi[:, 0] > pi[:, 1]).float().sum(),
        ]
    )
    return losses.mean(), stats


class PreferenceLoss:
    """An engine's objective on preference pairs (engines/base.py `next_token_loss` is the
    default): the model's logits once over both answers of every pair, the loss against the
    stored reference log-probs, and the batch's figures summed per mode (train, or eval: an
    engine's no-grad eval_loss) until `figures` takes them."""

    def __init__(self, kind: str, beta: float):
        if kind not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {kind!r}")
        self.kind, self.beta = kind, beta
        self.note = ""  # where the reference log-probs came from (reference.py)
        self.sums: dict[str, torch.Tensor | None] = {"train": None, "eval": None}

    def __call__(self, model, x, y, num_items=None, reference=None) -> torch.Tensor:
        if reference is None or bool(torch.isnan(reference).any()):
            raise RuntimeError("preference pairs without their reference log-probs")
        out = model(input_ids=x, **router_inputs(model, y))  # an MoE model's padding left out
        logps, lengths = sequence_logps(out.logits, y)
        loss, stats = preference_loss(self.kind, self.beta, logps, reference, lengths)
        mode = "train" if torch.is_grad_enabled() else "eval"  # eval_loss runs without grad
        self.sums[mode] = stats if self.sums[mode] is None else self.sums[mode] + stats
        # an MoE model's load-balancing (and z-) loss, as its next-token training adds it
        return loss + router_loss(model, out)

    def describe(self) -> str:
        """The objective in the run's banner and record."""
        return f"{self.kind} (beta {self.beta}; {self.note})" if self.note else self.kind

    def take(self, mode: str, device) -> dict:
        """The mean figures of `mode` since the last take, over all ranks (all ranks call)."""
        sums = self.sums[mode]
        self.sums[mode] = None
        values = [0.0] * len(_STATS) if sums is None else sums.double().tolist()
        totals = all_reduce_scalars(values, device, op="sum")
        pairs = max(totals[0], 1.0)
        out = {name: total / pairs for name, total in zip(_STATS[1:], totals[1:])}
        out["margin"] = out["rewards_chosen"] - out["rewards_rejected"]
        return out


def figures(engine, mode: str, device) -> dict:
    """What the engine's preference objective saw since the last call, prefixed for its mode
    (`val_` for eval); {} for next-token training. All ranks call."""
    objective = getattr(engine, "objective", None)
    if not isinstance(objective, PreferenceLoss):
        return {}
    prefix = "val_" if mode == "eval" else ""
    return {f"{prefix}{k}": v for k, v in objective.take(mode, device).items()}
