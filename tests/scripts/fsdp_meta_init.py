"""FSDP2's construction on the meta device against the whole model, on each rank.

    torchrun --nproc_per_node N tests/scripts/fsdp_meta_init.py MODEL OUT.json
        [--whole] [--offload] [--no-compare] [--layers N]

MODEL is a preset or a Llama folder. Each rank builds MODEL the trainer's way for --backend fsdp
(training/engines/construct.py: on the meta device, each rank's shards set by the engine; with
--whole as every other engine builds it, whole, then sharded), then, unless --no-compare, the
whole model from the same seed. Rank 0 writes {"deferred": was it built on meta, "differ":
[names whose gathered values are not bit-equal to the whole model's], "tied": the head still
the embedding's tensor, "params": count, "ranks": [{"before": resident bytes before the build,
"build_peak": the process's peak resident bytes after it, "seconds", "local_bytes": bytes of
its shards}, ...]}."""

import argparse
import json
import os
import time
from pathlib import Path

import torch

from models import build_model
from training.engines import OptimizerHparams
from training.engines.construct import build_for_engine
from training.engines.fsdp import FSDPEngine
from training.memory.peak import host_peak_bytes
from training.runtime import distributed
from training.runtime.liveness import rss_bytes


def main() -> None:
    cli = argparse.ArgumentParser()
    cli.add_argument("model")
    cli.add_argument("out")
    cli.add_argument("--whole", action="store_true")
    cli.add_argument("--offload", action="store_true")
    cli.add_argument("--no-compare", action="store_true")
    cli.add_argument("--layers", type=int, help="a preset's shapes with N layers")
    a = cli.parse_args()
    spec, overrides = a.model, {"num_hidden_layers": a.layers} if a.layers else None
    dist = distributed.setup()
    torch.manual_seed(0)
    before, began = rss_bytes()[0], time.perf_counter()
    if a.whole:
        model = build_model(spec, overrides=overrides)
    else:
        model = build_for_engine(
            spec, vocab_size=None, backend="fsdp", ds_config={}, overrides=overrides
        )
    deferred = hasattr(model, "deferred_init")
    engine = FSDPEngine(
        model=model,
        optimizer=OptimizerHparams(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0),
        device=dist.device,
        precision="fp32",
        grad_accum=1,
        grad_clip=0.0,
        cpu_offload=a.offload,
    )
    built = {"before": before, "build_peak": host_peak_bytes()}
    built["seconds"] = round(time.perf_counter() - began, 2)
    sharded = dict(engine.module.named_parameters())
    built["local_bytes"] = sum(p.to_local().untyped_storage().nbytes() for p in sharded.values())
    differ, n = None, sum(p.numel() for p in sharded.values())
    if not a.no_compare:
        torch.manual_seed(0)
        whole = dict(build_model(spec, overrides=overrides).named_parameters())
        differ = [
            name
            for name, p in sharded.items()
            if not torch.equal(p.full_tensor().cpu(), whole[name].detach())
        ]
    tied = getattr(engine.module.config, "tie_word_embeddings", False)
    head, emb = engine.module.get_output_embeddings(), engine.module.get_input_embeddings()
    ranks = distributed.all_gather_object(built)
    if dist.is_main:
        result = {
            "deferred": deferred,
            "differ": differ,
            "tied": (head.weight is emb.weight) if tied else None,
            "params": n,
            "ranks": ranks,
        }
        Path(a.out).write_text(json.dumps(result, indent=1))
    distributed.teardown()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
    distributed.exit_process(0)
