"""Peak resident memory of each rank while the trainer builds a model under DeepSpeed ZeRO-3.

    torchrun --nproc_per_node 2 tests/scripts/construct_rss.py MODEL OUT.json [CONFIG [VOCAB [SWAP]]]

MODEL is a preset or a model folder (a config.json alone builds it freshly initialised); CONFIG a
ds_configs name (default zero3); VOCAB the data's vocabulary (a preset's own by default); SWAP
the folder for an nvme config's swap files (default beside OUT.json). Each rank builds it with the trainer's own path
(training/engines/construct.py: inside deepspeed.zero.Init), sampling its resident set every
5 ms from a thread (and the kernel's own peak). Rank 0 writes {"params", "fp32_bytes",
"seconds", "ranks": [{"before", "peak", "after"}, ...]} (bytes, per rank)."""

import json
import os
import resource
import sys
import threading
import time
from pathlib import Path

import torch

from models import PRESETS
from training import preflight
from training.engines.construct import build_for_engine
from training.runtime import distributed
from training.settings import ds_config, nvme


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakSampler:
    def __init__(self):
        self.peak, self._stop = rss(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, rss())


def main() -> None:
    model, out_path, *rest = sys.argv[1:]
    name = rest[0] if rest else "zero3"
    vocab = int(rest[1]) if len(rest) > 1 else None
    swap = Path(rest[2]) if len(rest) > 2 else Path(out_path).parent / "swap"
    dist = distributed.setup()
    import deepspeed

    deepspeed.init_distributed(dist_backend=dist.backend)
    # a folder's config ignores the vocabulary; a preset keeps its own unless one is given
    model_cfg = preflight.model_config(model, vocab or PRESETS.get(model, {}).get("vocab_size"))
    raw = ds_config.load_json(ds_config.CONFIG_DIR / f"{name}.json")
    cfg = ds_config.resolve(
        raw,
        world=dist.world,
        swap=nvme.auto_values(str(swap), swap, model_cfg),
        hidden_size=model_cfg.hidden_size,
    )
    torch.manual_seed(0)
    distributed.barrier()
    before = rss()
    kernel_peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sampler = PeakSampler()
    start = time.perf_counter()
    net = build_for_engine(model, vocab_size=vocab, backend="deepspeed", ds_config=cfg)
    seconds = time.perf_counter() - start
    peak = sampler.stop()
    kernel_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if kernel_peak > kernel_peak_before:  # the kernel saw a higher peak than the sampler did
        peak = max(peak, kernel_peak)
    params = sum(getattr(p, "ds_numel", p.numel()) for p in net.parameters())
    mine = {"before": before, "peak": peak, "after": rss(), "seconds": seconds}
    ranks = distributed.all_gather_object(mine)
    if dist.is_main:
        result = {"params": params, "fp32_bytes": 4 * params, "ranks": ranks}
        Path(out_path).write_text(json.dumps(result, indent=1))
    distributed.teardown()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
    distributed.exit_process(0)
