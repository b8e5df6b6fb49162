"""Model-state bytes per rank of each engine, measured in one torchrun process group.

    torchrun --nproc_per_node 2 tests/scripts/state_bytes.py DATA_DIR MODEL_DIR OUT.json ENGINE...

ENGINE is ddp, fsdp or a ds_configs name (zero0 ... zero3). For each, in turn: the trainer's own
config rule, model factory and engine, 2 micro-batches per step; `engine.state_bytes()` after
the first micro-batch of the second step, where the training loop measures
(training/loop/loop.py). Rank 0 writes {engine: [rank 0, rank 1, ...]}.
Building the engines in one process saves the ~10 s start-up of a run per engine.
"""

import gc
import json
import os
import sys
from pathlib import Path

import torch

from data import load_manifest
from training.engines import OptimizerHparams, build_engine
from training.engines.construct import build_for_engine
from training.runtime import distributed
from training.settings import ds_config, flags
from training.settings.hparams import DEFAULTS as D


def measure(name: str, data: str, model_dir: str, dist) -> dict:
    backend = name if name in ("ddp", "fsdp") else "deepspeed"
    cfg_file = ds_config.CONFIG_DIR / ("zero0.json" if backend != "deepspeed" else f"{name}.json")
    argv = ["--backend", backend, "--data", data, "--out", "unused"]
    s = flags.parse([*argv, "--micro-batch", "1", "--grad-accum", "2"])
    manifest = load_manifest(data)
    model_cfg = json.loads((Path(model_dir) / "config.json").read_text())
    ds_cfg = ds_config.resolve(
        ds_config.load_json(cfg_file),
        world=dist.world,
        optim=s.optim,
        engine=s.engine,
        hidden_size=model_cfg["hidden_size"],
    )
    torch.manual_seed(0)
    model = build_for_engine(
        model_dir, vocab_size=manifest.vocab_size, backend=backend, ds_config=ds_cfg
    )
    engine = build_engine(
        s.engine,
        model=model,
        ds_config=ds_cfg,
        optimizer=OptimizerHparams(D["lr"], (D["beta1"], D["beta2"]), D["eps"], D["weight_decay"]),
        device=dist.device,
        precision=ds_config.precision(ds_cfg),
    )
    x = torch.randint(0, manifest.vocab_size, (1, 32))
    for step in range(2):
        engine.forward_backward(x, x, boundary=False)
        if step == 1:  # where the training loop measures: see training/loop/loop.py
            out = engine.state_bytes()
        engine.forward_backward(x, x, boundary=True)
        engine.step()
    del engine, model
    gc.collect()
    return out


def main() -> None:
    data, model_dir, out_path, *engines = sys.argv[1:]
    dist = distributed.setup()
    results = {}
    for name in engines:
        results[name] = distributed.all_gather_object(measure(name, data, model_dir, dist))
    if dist.is_main:
        Path(out_path).write_text(json.dumps(results, indent=1))
    distributed.teardown()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
    distributed.exit_process(0)
