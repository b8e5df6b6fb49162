"""Ulysses sequence parallelism through DeepSpeed (`deepspeed.runtime.sequence_parallel`).

The ranks of one sequence-parallel group train on the same samples, each on its own contiguous
slice of every sequence. Around the attention proper, DeepSpeed's `UlyssesSPAttentionHF` trades
the slice of the sequence for a slice of the heads with one all-to-all (and back after), so
attention sees every position while everything else (projections, MLP, norms, logits and loss)
runs on a rank's slice only: activations per rank shrink by the group's size.

The groups are DeepSpeed's (`parallel_state_sp`: ranks r*size .. r*size+size-1 form one group;
the engine gets the module as its mpu). Our model takes the wrapper through
`models.set_sequence_parallel`; a transformers model through DeepSpeed's own registration, which
replaces its "sdpa" attention function.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from models import ZeroStackForCausalLM, set_sequence_parallel, takes_router_group
from models.llama import IGNORE_INDEX


class SequenceParallel:
    def __init__(self, model, size: int, micro_batch: int, zero_stage: int):
        from deepspeed.runtime.sequence_parallel import parallel_state_sp
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        self.size = size
        self._positions: torch.Tensor | None = None
        if isinstance(model, ZeroStackForCausalLM):
            parallel_state_sp.initialize_sequence_parallel(size)
            self._group = parallel_state_sp.get_sequence_parallel_group()
            config = model.config
            self._ulysses = UlyssesSPAttentionHF(
                attn=_core,
                batch_size=micro_batch,
                attn_head_count=config.num_attention_heads,
                attn_head_size=config.head_dim,
                kv_head_count=config.num_key_value_heads,
                num_hidden_layers=config.num_hidden_layers,
                process_group=self._group,
                seq_length_is_variable=True,
            )
            set_sequence_parallel(model, self._attend)
        else:  # transformers' own attention: DeepSpeed swaps the "sdpa" function for its wrapper
            text = model.config.get_text_config()
            if getattr(text, "head_dim", None) is None:  # DeepSpeed sizes its buffers by it
                text.head_dim = text.hidden_size // text.num_attention_heads  # (Mixtral: None)
            UlyssesSPAttentionHF.register_with_transformers(
                model,
                core_attn_implementation="sdpa",
                sequence_parallel_size=size,
                micro_batch_size=micro_batch,
                seq_length_is_variable=True,
            )
            self._group = parallel_state_sp.get_sequence_parallel_group()
        self.mpu = parallel_state_sp
        self.rank = dist.get_rank(self._group)
        # an MoE model's load-balancing loss is a product of two means over the whole
        # sequences: its routers count over the group (models/moe.py router_stats)
        self._routed = takes_router_group(model)
        # ZeRO-3 averages gradients over every rank of its group, ZeRO 0-2 over the
        # data-parallel replicas only (world / size): scaling ZeRO-3's loss by the group size
        # gives both the gradient of the whole sequence's mean loss (tests/test_parallelism.py).
        self.backward_scale = float(size) if zero_stage == 3 else 1.0

    def _attend(self, module, q, k, v) -> torch.Tensor:
        out, _ = self._ulysses(module, q, k, v, None, position_ids=self._positions)
        return out

    def inputs(self, x: torch.Tensor, y: torch.Tensor) -> dict:
        """This rank's slice of the micro-batch (x, y: inputs and next-token targets), as
        keyword arguments for the model. The loss it gives is this slice's summed loss over the
        whole sequence's target count, so the group's losses add up to the sequence's mean."""
        chunk = x.shape[1] // self.size
        start = self.rank * chunk
        positions = torch.arange(start, start + chunk, device=x.device).expand(x.shape[0], chunk)
        self._positions = positions
        part = slice(start, start + chunk)
        # Contiguous: transformers' loss views the targets flat.
        mine = y[:, part].contiguous()
        return {
            "input_ids": x[:, part].contiguous(),
            "labels": mine,
            # y is already shifted: the slice's last target is the next slice's first input.
            "shift_labels": mine,
            "position_ids": positions,
            "num_items_in_batch": (y != IGNORE_INDEX).sum(),
            **({"router_group": self._group} if self._routed else {}),
        }

    def whole_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The sequence's loss from this rank's share (detached, summed over the group)."""
        total = loss.detach().clone()
        dist.all_reduce(total, group=self._group)
        return total


def _core(module, q, k, v, mask, *args, **kwargs):
    """The attention proper on all positions of this rank's heads, (batch, seq, heads, dim) out,
    as transformers' attention functions return it."""
    return module.core(q, k, v, None).transpose(1, 2), None
