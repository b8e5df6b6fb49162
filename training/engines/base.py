"""The interface the one training loop drives every engine through, and what an engine is built
from besides the model. An engine wraps a model and its optimizer; engines differ only where
DeepSpeed, DDP and FSDP2 differ."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def model_inputs(x: torch.Tensor, y: torch.Tensor, num_items: float | None = None) -> dict:
    """The model's arguments for a micro-batch, the same for every engine; `num_items` (masked
    data) divides the summed per-token loss instead of taking its mean (models/llama.py
    `causal_lm_loss`, transformers' ForCausalLMLoss)."""
    weighed = {} if num_items is None else {"num_items_in_batch": num_items}
    return {"input_ids": x, "labels": y, "shift_labels": y, **weighed}


def next_token_loss(model, x, y, num_items=None, reference=None) -> torch.Tensor:
    """The default objective: the model's own next-token loss of the micro-batch. An objective
    is any callable of (model, x, y, num_items, reference) -> loss (training/objectives/)."""
    return model(**model_inputs(x, y, num_items)).loss


@dataclass
class StepResult:
    grad_norm: float | None
    skipped: bool  # the update was not applied (fp16 overflow, non-finite gradients)
    loss_scale: float | None = None  # fp16 only


@dataclass(frozen=True)
class OptimizerHparams:
    """The optimizer's hyper-parameters (the learning rate is the schedule's start; `set_lr`
    moves it)."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float  # on matrices only (engines/optim.py)
    # Muon's peak learning rate on the blocks' matrices (engines/optim.py: muon_split); None:
    # AdamW on everything
    muon_lr: float | None = None


class Engine(ABC):
    """What the loop calls. `dp_rank`/`dp_world` say which data-parallel replica this rank is and
    how many there are: what shards the data. Every rank is its own replica, except under
    pipelining, where the stages of one replica read the same batches."""

    name: str
    dp_rank: int
    dp_world: int
    # What an engine does differently, for the run record (record.py); False unless it sets them:
    blocks_whole = False  # ZeRO-3 gathers each transformer block whole (engines/ds.py)
    hold = False  # weights kept gathered across micro-steps (ZeRO-3, FSDP2 on one CPU host)
    sums_gradients = False  # ZeRO-1/2 sums gradients over a loss divided by the world (ds.py)
    # What a micro-batch's loss is (training/objectives/: DPO on preference pairs)
    objective = staticmethod(next_token_loss)
    # engines/spike_guard.py's gate: step() hands it the global gradient norm before deciding
    # whether to apply the update (None: no spike guard; the pipeline engine never has one)
    spike_gate = None

    def __init__(self) -> None:
        initialized = dist.is_initialized()
        self.dp_rank = dist.get_rank() if initialized else 0
        self.dp_world = dist.get_world_size() if initialized else 1

    @property
    @abstractmethod
    def module(self) -> nn.Module:
        """The unwrapped model (for export, generate, FLOPs)."""

    @abstractmethod
    def forward_backward(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        boundary: bool,
        num_items: float | None = None,
        reference: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One micro-batch; gradients are reduced only on the boundary. The loss returned sums the
        micro-batches this call completed (the pipeline engine completes the whole step on the
        boundary). `num_items` (masked data): the micro-batch loss is the sum of its per-token
        losses over this, not their mean (training/loop/loop.py: token_weights). `reference`
        (preference pairs): the reference model's log-probs, for the objective."""

    @abstractmethod
    def step(self) -> StepResult:
        """The optimizer step with clipping, after the step's last micro-batch."""

    @abstractmethod
    def set_lr(self, lr: float) -> None:
        """The schedule's value for this step."""

    @abstractmethod
    def eval_loss(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        num_items: float | None = None,
        reference: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A no-grad forward; every rank calls (ZeRO-3 gathers, the pipeline passes stages).
        `num_items` as for forward_backward (1: the sum of the per-token losses)."""

    @abstractmethod
    def save(self, root: Path, tag: str, client_state: dict, writer=None) -> None:
        """Write this engine's files for checkpoint `tag` (all ranks call). With a `writer`
        (checkpoints/background.py, --async-save) hand each file's object to `writer.save`
        instead (or the whole state and a function that writes its files to `writer.call`):
        it stages a copy and writes it in the background."""

    @abstractmethod
    def load(self, root: Path, tag: str) -> None:
        """Restore them (all ranks call)."""

    @abstractmethod
    def state_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients, optimizer states and buffers this rank holds."""

    @abstractmethod
    def train(self) -> None: ...

    @abstractmethod
    def eval(self) -> None: ...

    def coordinates(self) -> dict[str, int]:
        """Where this rank sits in the run's layout (settings/parallel.py), for the run record."""
        return {"data_parallel": self.dp_rank}

    def layout(self) -> list[list[str]] | None:
        """Layer class names per pipeline stage; None when the model is not cut into stages."""
        return None

    def set_master_weights(self, weights) -> int:
        """Overwrite the fp32 master weights from (name, tensor) pairs; returns how many were set.
        Only engines that keep 16-bit weights beside fp32 masters need it (DeepSpeed's)."""
        return 0
