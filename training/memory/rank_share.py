"""How many of a model's parameters one rank holds when the model is cut into pipeline stages
and its blocks are split over a tensor-parallel group (3D parallelism: pp x tp x dp).

The pipeline engine (training/engines/pipeline_engine.py) lays the model out as layers

    embedding, block 1 ... block L, final norm, head (a tied head: a second copy of the embedding)

and gives each stage a run of them, by DeepSpeed's own partition of `pipeline.partition`
(`parameters`: balanced parameter counts of the whole layers; `blocks`: balanced block counts;
`uniform`: balanced layer counts). Tensor parallelism (pipeline_tensor.py, and AutoTP by the
model's `base_model_tp_plan`) splits each block's attention and MLP projections over the group
and keeps the embedding, the norms (QK-norm's per-head ones too) and the head whole on every rank
of it. The plan counts the fullest rank: the largest stage, with its blocks' projections
divided by tp.
"""

from __future__ import annotations

from training.memory.shape import ModelShape
from training.settings import ds_config, parallel

BLOCK_NORMS = 2  # a block's attention and MLP norms, `hidden` weights each: kept whole where the
# shape does not say (ModelShape.block_whole)


def layer_params(shape: ModelShape) -> list[int]:
    """Parameters of the pipeline's layers, in order (the tied head counted: each stage that
    holds the embedding's weight holds all of it)."""
    embed = shape.vocab * shape.hidden
    head = 0 if shape.tied else embed
    block = (shape.params - embed - head - shape.hidden) // max(shape.layers, 1)
    return [embed, *[block] * shape.layers, shape.hidden, embed]


def stage_layers(shape: ModelShape, stages: int, partition: str = "parameters") -> list[range]:
    """The layers (indices into layer_params) of each stage, as DeepSpeed's PipelineModule
    partitions them."""
    from deepspeed.runtime.utils import partition_balanced, partition_uniform

    weights = layer_params(shape)
    if partition == "uniform":
        parts = partition_uniform(num_items=len(weights), num_parts=stages)
    elif partition == "blocks":
        blocks = [0, *[1] * shape.layers, 0, 0]
        parts = partition_balanced(weights=blocks, num_parts=stages)
    else:
        parts = partition_balanced(weights=weights, num_parts=stages)
    return [range(parts[i], parts[i + 1]) for i in range(stages)]


def rank_params(shape: ModelShape, ds_cfg: dict) -> int:
    """Parameters on the fullest rank of a config's layout (the whole model without pipeline
    stages or tensor parallelism)."""
    tp = parallel.tensor_size(ds_cfg)
    pp = ds_config.pipeline_stages(ds_cfg)
    if tp == 1 and pp == 1:
        return shape.params
    weights = layer_params(shape)
    kept = BLOCK_NORMS * shape.hidden if shape.block_whole is None else shape.block_whole
    sliced = [
        (w - kept) // tp + kept if 1 <= i <= shape.layers else w for i, w in enumerate(weights)
    ]
    if pp == 1:  # one copy of a tied embedding
        return sum(sliced[:-1]) + (0 if shape.tied else sliced[-1])
    partition = str(ds_cfg.get("pipeline", {}).get("partition", "parameters"))
    return max(sum(sliced[i] for i in stage) for stage in stage_layers(shape, pp, partition))


def rank_trained(shape: ModelShape, ds_cfg: dict) -> int:
    """Trained parameters on that rank (LoRA: the adapters, in the same share)."""
    held = rank_params(shape, ds_cfg)
    return held if shape.trainable is None else round(shape.trainable * held / shape.params)


def data_parallel(ds_cfg: dict, world: int) -> int:
    """The ranks ZeRO partitions over: world / (pipeline stages x tensor parallel). Ulysses'
    sequence-parallel ranks stay in: DeepSpeed partitions over its sequence x data group."""
    return max(1, world // (ds_config.pipeline_stages(ds_cfg) * parallel.tensor_size(ds_cfg)))
