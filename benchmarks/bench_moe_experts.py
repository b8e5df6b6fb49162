"""What the experts of one MoE layer cost a training step, by how they run: one grouped matmul
per projection for every expert's tokens (`torch._grouped_mm`, models/moe.py `Experts.forward`)
against a matmul per expert (`Experts.loop_forward`, the path of devices without a grouped
matmul), at 8, 16 and 64 experts. Forward and backward of the layer's experts on the same
tokens and routing, one thread as each CPU rank runs, the arms interleaved round after round.

    python -m benchmarks.bench_moe_experts                     # fp32, 3 rounds
    python -m benchmarks.bench_moe_experts --dtype bf16 --rounds 5

Writes each round's seconds, the medians (with min and max), the check that both arms give
the same output and gradients, and the host to benchmarks/results/moe_experts.json
(--results); the table in docs/benchmarks.md is drawn from it by
`python -m benchmarks.docs_tables`."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RAW = "moe_experts.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def layer(num_experts: int, hidden: int, width: int, tokens: int, top_k: int):
    """A layer's experts with random weights, and its tokens routed uniformly at random."""
    from models import get_config
    from models.moe import Experts

    config = get_config(
        "tiny-moe",
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        hidden_size=hidden,
        intermediate_size=width,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
    )
    gen = torch.Generator().manual_seed(num_experts)
    experts = Experts(config)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    x = torch.randn(tokens, hidden, generator=gen).requires_grad_()
    scores = torch.rand(tokens, num_experts, generator=gen)
    weight, index = scores.topk(top_k, dim=-1)
    return experts, x, index, weight.softmax(dim=-1)


def step(fn, experts, x, index, weight, dtype) -> tuple[float, list[torch.Tensor]]:
    """Seconds of one forward and backward of `fn`, and what it gave (output, gradients)."""
    x.grad = None
    experts.zero_grad()
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        out = fn(x, index, weight)
    out.float().square().mean().backward()
    seconds = time.perf_counter() - start
    return seconds, [out.detach(), x.grad, experts.gate_up_proj.grad, experts.down_proj.grad]


def measure(experts_counts, hidden, width, tokens, top_k, dtype, rounds) -> list[dict]:
    rows = []
    for n in experts_counts:
        experts, x, index, weight = layer(n, hidden, width, tokens, top_k)
        arms = {"grouped": experts.forward, "loop": experts.loop_forward}
        got = {name: step(fn, experts, x, index, weight, dtype)[1] for name, fn in arms.items()}
        gap = max(
            ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
            for a, b in zip(got["grouped"], got["loop"], strict=True)
        )
        seconds: dict[str, list[float]] = {name: [] for name in arms}
        for _ in range(rounds):
            for name, fn in arms.items():
                seconds[name].append(step(fn, experts, x, index, weight, dtype)[0])
        med = {k: statistics.median(v) for k, v in seconds.items()}
        rows.append(
            {
                "experts": n,
                "seconds": seconds,
                "median": med,
                "min": {k: min(v) for k, v in seconds.items()},
                "max": {k: max(v) for k, v in seconds.items()},
                "loop_over_grouped": med["loop"] / med["grouped"],
                "max_relative_gap": gap,
            }
        )
        print(f"{n} experts: median s {med}, loop / grouped {rows[-1]['loop_over_grouped']:.2f}")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_moe_experts", description=__doc__)
    p.add_argument("--experts", default="8,16,64", help="expert counts, comma-separated")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--width", type=int, default=512, help="each expert's intermediate size")
    p.add_argument("--tokens", type=int, default=4096, help="tokens a step (micro-batch x seq)")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--results", default=None, help="the raw file (default: the results folder)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    from benchmarks.provenance import code_record, host_record
    from models.moe import grouped_mm_runs

    dtype = DTYPES[a.dtype]
    if not grouped_mm_runs(torch.device("cpu"), dtype):
        print(f"error: torch._grouped_mm does not run on this CPU in {a.dtype}", file=sys.stderr)
        return 2
    counts = [int(n) for n in a.experts.split(",")]
    doc = {
        "command": " ".join(["python -m benchmarks.bench_moe_experts", *(argv or sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": host_record(),
        "code": code_record(),
        "torch": torch.__version__,
        "shape": {"hidden": a.hidden, "width": a.width, "tokens": a.tokens, "top_k": a.top_k},
        "dtype": a.dtype,
        "threads": 1,
        "rounds": a.rounds,
        "rows": measure(counts, a.hidden, a.width, a.tokens, a.top_k, dtype, a.rounds),
    }
    doc["host_after"] = host_record()["loadavg"]
    path = Path(a.results or REPO / "benchmarks" / "results" / RAW)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
