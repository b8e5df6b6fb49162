"""What Muon's Newton-Schulz costs a step, by the dtype it computes in: torch's own
(`torch.optim._muon._zeropower_via_newtonschulz`, bf16) against zerostack's copy in fp32
(training/engines/muon.py, what an fp32 run on a CPU takes), over the matrices Muon updates in a
step of a preset (engines/optim.py: muon_split), one thread as each CPU rank runs.

    python -m benchmarks.bench_muon                  # small, 5 rounds
    python -m benchmarks.bench_muon --model tiny --rounds 3

Writes each round's seconds and the medians (with min and max) and the host to
benchmarks/results/muon_newton_schulz.json (--results)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RAW = "muon_newton_schulz.json"
COEFFICIENTS, STEPS, EPS = (3.4445, -4.7750, 2.0315), 5, 1e-7


def matrices(model_name: str) -> list[torch.Tensor]:
    """A random gradient of each matrix Muon updates in `model_name` (its shapes)."""
    from models import build_model
    from training.engines.optim import muon_split

    model = build_model(model_name, vocab_size=8192)
    names = set(muon_split(model)[0])
    gen = torch.Generator().manual_seed(0)
    shapes = [p.shape for n, p in model.named_parameters() if n in names]
    return [torch.randn(s, generator=gen) for s in shapes]


def one_step(orthogonalize, grads: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    for g in grads:
        orthogonalize(g, COEFFICIENTS, STEPS, EPS)
    return time.perf_counter() - start


def measure(model_name: str, rounds: int) -> dict:
    """Seconds of one step's Newton-Schulz in each dtype, interleaved rounds after a warm-up."""
    from torch.optim._muon import _zeropower_via_newtonschulz as torchs

    from training.engines.muon import newton_schulz

    stock = getattr(torchs, "stock", torchs)
    arms = {"bf16 (stock)": stock, "fp32": lambda *a: newton_schulz(*a, dtype=torch.float32)}
    grads = matrices(model_name)
    for fn in arms.values():
        one_step(fn, grads[:2])
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, fn in arms.items():
            seconds[name].append(one_step(fn, grads))
    return {
        "matrices": len(grads),
        "shapes": sorted({tuple(g.shape) for g in grads}),
        "seconds": seconds,
        "median": {k: statistics.median(v) for k, v in seconds.items()},
        "min": {k: min(v) for k, v in seconds.items()},
        "max": {k: max(v) for k, v in seconds.items()},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_muon", description=__doc__)
    p.add_argument("--model", default="small", help="a preset")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--results", default=None, help="the raw file (default: the results folder)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    from benchmarks.provenance import code_record, host_record
    from training.runtime.flops import cpu_name

    doc = {
        "command": " ".join(["python -m benchmarks.bench_muon", *(argv or sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": {
            **host_record(),
            "cpu": cpu_name(),
            "capability": torch.backends.cpu.get_cpu_capability(),
        },
        "code": code_record(),
        "model": a.model,
        "threads": 1,
        **measure(a.model, a.rounds),
    }
    path = Path(a.results or REPO / "benchmarks" / "results" / RAW)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    med = doc["median"]
    print(f"{a.model}: {doc['matrices']} matrices a step; median s: {med}")
    print(f"fp32 / bf16: {med['fp32'] / med['bf16 (stock)']:.2f}  -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
