"""The gradient of one step on chat data, through the training loop's own micro-batch code.

    torchrun --nproc_per_node 2 tests/scripts/sft_grads.py DATA_DIR OUT.pt SEED RUN...

RUN is ENGINE:MICRO:ACCUM, ENGINE ddp, fsdp or a ds_configs name (zero0 ... zero3), in fp32. For each
run, in one process group: the tiny preset built with seed 0, the real BatchLoader over the
data's ExampleDataset (SEED), `training.loop.loop._micro_batches` with the loss weighed by
trained tokens, then the whole gradient (DeepSpeed: `safe_get_full_grad`, before the step).
Rank 0 saves {RUN: {"init": {name: weight}, "grads": {name: tensor}, "loss": step loss}}.
"""

import gc
import os
import sys
from pathlib import Path

import torch

from data import BatchLoader, load_manifest, open_split
from training.engines import OptimizerHparams, build_engine
from training.engines.construct import build_for_engine
from training.loop.loop import _micro_batches
from training.runtime import distributed
from training.settings import ds_config, flags

SEQ = 64


def whole(p, backend: str, what: str) -> torch.Tensor:
    """A parameter's whole fp32 value or gradient, however its engine shards it."""
    if backend == "deepspeed":
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

        t = safe_get_full_grad(p) if what == "grad" else safe_get_full_fp32_param(p)
    else:
        t = p.grad if what == "grad" else p.data
    t = t.full_tensor() if hasattr(t, "full_tensor") else t  # FSDP2's DTensors
    return t.detach().clone()


def one_step(run: str, data: str, seed: int, dist) -> tuple[dict, dict, float]:
    name, micro, accum = run.split(":")
    backend = name if name in ("ddp", "fsdp") else "deepspeed"
    native = backend != "deepspeed"
    cfg_file = ds_config.CONFIG_DIR / ("zero0.json" if native else f"{name}.json")
    argv = ["--backend", backend, "--data", data, "--out", "unused", "--seq-len", str(SEQ)]
    s = flags.parse([*argv, "--micro-batch", micro, "--grad-accum", accum])
    manifest = load_manifest(data)
    cfg = ds_config.resolve(
        ds_config.load_json(cfg_file),
        world=dist.world,
        optim=s.optim,
        engine=s.engine,
        hidden_size=64,
    )
    if not native:  # the DeepSpeed configs' own precision section off: fp32 (the test's claim)
        cfg = {k: v for k, v in cfg.items() if k not in ("bf16", "fp16")}
    torch.manual_seed(0)
    model = build_for_engine("tiny", vocab_size=manifest.vocab_size, backend=backend, ds_config=cfg)
    engine = build_engine(
        s.engine,
        model=model,
        ds_config=cfg,
        optimizer=OptimizerHparams(1e-3, (0.9, 0.95), 1e-8, 0.0),
        device=dist.device,
        precision="fp32",
    )
    init = {k: whole(p, backend, "param") for k, p in engine.module.named_parameters()}
    loader = BatchLoader(open_split(data, "train", SEQ), int(micro), dist.rank, dist.world, seed)
    loss = _micro_batches(engine, loader, int(accum), dist.device, None, None, weighted=True)
    grads = {k: whole(p, backend, "grad") for k, p in engine.module.named_parameters()}
    loss = distributed.all_reduce_scalars([float(loss) / int(accum)], dist.device)[0]
    del engine, model
    gc.collect()
    return init, grads, loss


def main() -> None:
    data, out_path, seed, *runs = sys.argv[1:]
    dist = distributed.setup()
    results = {}
    for run in runs:
        init, grads, loss = one_step(run, data, int(seed), dist)
        results[run] = {"grads": grads, "loss": loss, "init": init}
    if dist.is_main:
        torch.save(results, Path(out_path))
    distributed.teardown()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
    distributed.exit_process(0)
