"""Building the model the way its engine will hold it. The model package knows no engine: for
DeepSpeed ZeRO-3 the model is built inside DeepSpeed's construction context, so each rank only
ever holds its partition, and `build_model` is handed how to see a partitioned parameter whole
while its initial value is set. FSDP2 shards a model after it is built: the model is built on
the meta device and its values are set after sharding, each rank computing or reading one
parameter at a time and keeping its shard; the pipeline engine makes real only its stage's
layers of such a model. Every other engine gets the model built plainly."""

from __future__ import annotations

import deepspeed
from transformers.integrations import HfDeepSpeedConfig

from models import build_model
from models.factory import build_on_meta
from training.memory.heap import freed_blocks_returned
from training.settings.ds_config import pipeline_stages, zero_stage


class ZeRO3Partitioned:
    """DeepSpeed ZeRO-3's side of `models.Partitioned`. While this object lives, transformers
    builds models under `deepspeed.zero.Init(config)` (it keeps a weak reference to the
    HfDeepSpeedConfig), and treats ZeRO-3 as on: that is what makes `generate` use
    `synced_gpus`. torch.distributed must be initialised first."""

    def __init__(self, ds_config: dict):
        self.hf_config = HfDeepSpeedConfig(ds_config)

    def gathered(self, params):
        return deepspeed.zero.GatheredParameters(params, modifier_rank=0)


def build_for_engine(
    spec: str,
    *,
    vocab_size: int | None,
    backend: str,
    ds_config: dict,
    overrides=None,
    keep_freed: bool = True,
):
    """The model named by spec (a preset or a folder), built for `backend` with `ds_config`:
    partitioned from the start under DeepSpeed ZeRO-3; for FSDP2 and the pipeline engine, on the
    meta device with the function that sets its values (`deferred_init`, which the engine calls
    once it has made real what the rank keeps: its shards, its stage's layers); whole
    otherwise. `keep_freed`: the heap's setting for the training steps after a ZeRO-3 build
    (memory/heap.py)."""
    if backend == "fsdp" or (backend == "deepspeed" and pipeline_stages(ds_config) > 1):
        on_meta = build_on_meta(spec, vocab_size=vocab_size, overrides=overrides)
        if on_meta is not None:
            model, init = on_meta
            model.deferred_init = init
            return model
    if backend != "deepspeed" or zero_stage(ds_config) != 3:
        return build_model(spec, vocab_size=vocab_size, overrides=overrides)
    partitioned = ZeRO3Partitioned(ds_config)
    # the freed whole modules must not stay on the heap
    with freed_blocks_returned(kept=keep_freed):
        model = build_model(
            spec, vocab_size=vocab_size, overrides=overrides, partitioned=partitioned
        )
    model.hf_deepspeed_config = partitioned.hf_config  # keeps ZeRO-3 on while the model lives
    return model
