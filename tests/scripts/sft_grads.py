"""The gradient of one step on chat data, through the training loop's own micro-batch code.

    torchrun --nproc_per_node 2 tests/scripts/sft_grads.py DATA_DIR OUT.pt SEED RUN...

RUN is ENGINE:MICRO:ACCUM, ENGINE ddp or a ds_configs name (fp32 is ZeRO-2 in fp32). For each
run, in one process group: the tiny preset built with seed 0, the real BatchLoader over the
data's ExampleDataset (SEED), `training.loop.loop._micro_batches` with the loss weighed by
trained tokens, then the whole gradient (DeepSpeed: `safe_get_full_grad`, before the step).
Rank 0 saves {"init": the weights, RUN: {"grads": {name: tensor}, "loss": step loss}}.
"""

import gc
import os
import sys
from pathlib import Path

import torch

from data import BatchLoader, load_manifest, open_split
from training.engines import OptimizerConfig, build_engine
from training.engines.construct import build_for_engine
from training.loop.loop import _micro_batches
from training.runtime import distributed
from training.settings import ds_config
from training.settings.flags import Settings

SEQ = 64


def one_step(run: str, data: str, seed: int, dist) -> tuple[dict, dict, float]:
    name, micro, accum = run.split(":")
    backend = "ddp" if name == "ddp" else "deepspeed"
    cfg_file = ds_config.CONFIG_DIR / ("zero0.json" if backend == "ddp" else f"{name}.json")
    argv = ["--backend", backend, "--data", data, "--out", "unused", "--seq-len", str(SEQ)]
    s = Settings.parse([*argv, "--micro-batch", micro, "--grad-accum", accum])
    manifest = load_manifest(data)
    cfg = ds_config.resolve(
        ds_config.load_json(cfg_file), world=dist.world, flags=s.as_flags(), hidden_size=64
    )
    torch.manual_seed(0)
    model = build_for_engine("tiny", vocab_size=manifest.vocab_size, backend=backend, ds_config=cfg)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine = build_engine(
        backend,
        model=model,
        ds_config=cfg,
        optimizer=OptimizerConfig(1e-3, (0.9, 0.95), 1e-8, 0.0),
        device=dist.device,
        precision="fp32",
    )
    loader = BatchLoader(open_split(data, "train", SEQ), int(micro), dist.rank, dist.world, seed)
    loss = _micro_batches(engine, loader, int(accum), dist.device, None, None, weighted=True)
    grads = {}
    for pname, p in engine.module.named_parameters():
        if backend == "deepspeed":
            from deepspeed.utils import safe_get_full_grad

            grads[pname] = safe_get_full_grad(p).detach().clone()
        else:
            grads[pname] = p.grad.detach().clone()
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
        results.setdefault("init", init)
        results[run] = {"grads": grads, "loss": loss, "init": init}
    if dist.is_main:
        torch.save(results, Path(out_path))
    distributed.teardown()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
    distributed.exit_process(0)
