"""The memory plan next to the model-state bytes a real engine holds, per rank.

    torchrun --nproc_per_node 2 tests/scripts/plan_vs_measured.py DATA_DIR MODEL OUT.json CONFIG...

CONFIG is a ds_configs name (zero0 ... zero3; ZeRO-3 ones last: transformers builds every later
model partitioned while a ZeRO-3 one lives), `+muon` after it for --optimizer muon. For each, in one process group: the trainer's own
config rule, model factory and DeepSpeed engine, micro-batch 1 x 2 accumulation steps, and
`engine.state_bytes()` (training/memory/state_bytes.py, the count the training loop logs and
benchmarks/compare reports) after the first micro-batch of the second step, where the loop
measures: gradients and optimizer states both exist then. Rank 0 writes
{config: {"measured": [rank 0, rank 1, ...], "plan": training/memory/plan.py's per-rank plan}}.
"""

import gc
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from data import load_manifest
from training.engines import OptimizerHparams, build_engine
from training.engines.construct import build_for_engine
from training.memory import plan as memory_plan
from training.memory.shape import model_shape
from training.runtime import distributed
from training.settings import ds_config, flags
from training.settings.hparams import DEFAULTS as D


def measure(config: str, data: str, model: str, dist) -> tuple[dict, dict]:
    name, _, optimizer = config.partition("+")
    argv = ["--data", data, "--out", "-", "--model", model, "--micro-batch", "1"]
    s = flags.parse([*argv, "--grad-accum", "2", "--optimizer", optimizer or "adamw"])
    vocab = load_manifest(data).vocab_size
    shape = model_shape(model, vocab)
    raw = ds_config.load_json(ds_config.CONFIG_DIR / f"{name}.json")
    ds_cfg = ds_config.resolve(
        raw, world=dist.world, optim=s.optim, engine=s.engine, hidden_size=shape.hidden
    )
    plan = memory_plan.plan(shape, ds_cfg, dist.world, config_name=name, seq_len=32)
    torch.manual_seed(0)
    net = build_for_engine(model, vocab_size=vocab, backend="deepspeed", ds_config=ds_cfg)
    engine = build_engine(
        s.engine,
        model=net,
        ds_config=ds_cfg,
        optimizer=OptimizerHparams(
            D["lr"], (D["beta1"], D["beta2"]), D["eps"], D["weight_decay"], s.optim.muon_lr
        ),
        device=dist.device,
        precision=ds_config.precision(ds_cfg),
    )
    x = torch.randint(0, vocab, (1, 32))
    for step in range(2):
        engine.forward_backward(x, x, boundary=False)
        if step == 1:
            measured = engine.state_bytes()
        engine.forward_backward(x, x, boundary=True)
        engine.step()
    del engine, net
    gc.collect()
    return measured, {**asdict(plan), "model_states": plan.model_states}


def main() -> None:
    data, model, out_path, *configs = sys.argv[1:]
    dist = distributed.setup()
    import deepspeed

    deepspeed.init_distributed(dist_backend=dist.backend)
    results = {}
    for name in configs:
        measured, plan = measure(name, data, model, dist)
        results[name] = {"measured": distributed.all_gather_object(measured), "plan": plan}
    if dist.is_main:
        Path(out_path).write_text(json.dumps(results, indent=1))
    distributed.teardown()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
    distributed.exit_process(0)
