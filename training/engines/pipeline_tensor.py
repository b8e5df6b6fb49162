"""Tensor-parallel pipeline stages (3D parallelism, as Megatron-DeepSpeed runs it): the ranks
laid out by DeepSpeed's `PipeModelDataParallelTopology(num_pp, num_mp, num_dp)`, and each
stage's blocks split across its tensor-parallel group with DeepSpeed's own training layers
(`deepspeed.module_inject.layers`, the ones AutoTP puts in):

    attention  wq, wk, wv: LinearLayer (column-parallel, whole heads)   wo: LinearAllreduce (row)
    MLP        w1, w3:     LinearLayer (column-parallel)                w2: LinearAllreduce (row)

The embedding, the norms and the (tied) head stay whole on every rank of the group: a
column-parallel layer's backward sums its input's gradient over the group, so a replicated
weight before one (the embedding, the block norms) gets the same whole gradient on each rank, as
does one after a row-parallel layer's all-reduce (the final norm, the head). The per-head norms
of `qk_norm` (q_norm, k_norm) are whole too but applied to the rank's own heads after wq and wk,
so each rank's gradient is its heads' share: a hook sums it over the group as soon as it is
computed, before accumulation, clipping and the optimizer, as AutoTP does for the model plan's
`replicated_with_grad_allreduce` entries. (A vocabulary split would save the head's memory and
logits, but needs a vocabulary-parallel loss DeepSpeed's layers do not provide.)

AutoTP itself cannot do this: it replaces the layers of a whole model inside
`deepspeed.initialize` and installs its own process groups as the engine's mpu, where the
pipeline engine needs the grid its topology builds (the DeepSpeed engine is given the config
without its `tensor_parallel` section). What is ours is only which linear layer gets which split.
"""

from __future__ import annotations

import functools

import torch.distributed as dist
from deepspeed import comm
from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
from deepspeed.module_inject.layers import (
    LinearAllreduce,
    LinearLayer,
    collect_autotp_universal_checkpoint_info,
    set_autotp_mode,
)
from deepspeed.module_inject.tp_shard import AutoTPMeta
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from models.pipeline import BlockPipe

# (submodule, attribute) -> column split (output features) or row split (input features).
COLUMN = (("attention", "wq"), ("attention", "wk"), ("attention", "wv"), ("feed_forward", "w1"),
          ("feed_forward", "w3"))  # fmt: skip
ROW = (("attention", "wo"), ("feed_forward", "w2"))
# whole on every rank, applied to the rank's heads: gradients summed over the group
SUMMED = (("attention", "q_norm"), ("attention", "k_norm"))


def stage_topology(stages: int, tensor: int) -> PipeModelDataParallelTopology:
    """pipe x model x data over the whole world (call deepspeed.init_distributed() first): the
    ranks of one tensor-parallel group are adjacent, as DeepSpeed's topology orders them."""
    data = dist.get_world_size() // (stages * tensor)
    return PipeModelDataParallelTopology(num_pp=stages, num_mp=tensor, num_dp=data)


def without_tensor_parallel(ds_config: dict) -> dict:
    """The config the DeepSpeed engine gets: with a tensor_parallel section it would apply AutoTP
    to the whole PipelineModule over groups of its own."""
    return {k: v for k, v in ds_config.items() if k != "tensor_parallel"}


def split_stage(module, group, config) -> int:
    """Replace the linear layers of every block this rank's stage holds by their
    tensor-parallel slices over `group` (the whole weights must be loaded first: each rank
    keeps its slice of them). The module then carries AutoTP's record of which weights are
    split how, which DeepSpeed saves with every checkpoint (export joins the slices by it).
    Returns how many layers were split; the per-head norms (qk_norm) get their gradients summed
    over `group`."""
    set_autotp_mode(training=True)  # DeepSpeed's layers all-reduce with autograd in training mode
    meta = AutoTPMeta.from_model_config(config)
    n = 0
    for prefix, block in module.named_modules():
        if not isinstance(block, BlockPipe):
            continue
        for kind, pairs in ((LinearLayer, COLUMN), (LinearAllreduce, ROW)):
            for sub, attr in pairs:
                parent = getattr(block, sub)
                name = f"{prefix}.{sub}.{attr}"
                setattr(parent, attr, kind(getattr(parent, attr), group, name=name, tp_meta=meta))
                n += 1
        for sub, attr in SUMMED:
            norm = getattr(getattr(block, sub), attr, None)  # None without qk_norm
            for p in norm.parameters() if norm is not None else ():
                p.register_hook(functools.partial(sum_over, group=group))
    setattr(module, UNIVERSAL_CHECKPOINT_INFO, collect_autotp_universal_checkpoint_info(module))
    return n


def sum_over(grad, group):
    """A whole parameter's gradient from each rank's share of it, summed over `group`."""
    grad = grad.contiguous()
    comm.all_reduce(grad, group=group)  # DeepSpeed's, as its own layers' all-reduces
    return grad
