"""One layer's causal attention, forward and backward, under each CPU kernel of our model.

    python benchmarks/bench_attention.py [--seqs 256,512,1024,2048] [--tokens 2048] [--heads 12]
                                         [--kv-heads 12] [--head-dim 64] [--out docs/bench_attention.md]

SDPA (PyTorch's flash kernel both ways), `explicit` (softmax(QK^T)V written out) and `amx`
(SDPA's forward, zerostack's backward: models/cpu_attention.py), bf16, one thread (what each of
two ranks gets), q laid out as the model makes it. Each sequence length holds `--tokens` tokens
a batch. Kernels alternate round by round so drift in the host's speed hits them alike; the
table keeps each one's median. Also prints the attention FLOPs' rate (causal: half of 4 t^2 d a
head forward, twice that backward), beside the bf16 matmul ceiling measured in the same run.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

from models import cpu_attention
from models.llama import explicit_attention


def kernels() -> dict:
    import torch.nn.functional as F

    out = {
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1]
        ),
        "explicit": lambda q, k, v: explicit_attention(q, k, v, None),
    }
    why = cpu_attention.available()
    if why is None:
        out["amx"] = cpu_attention.causal_attention
    else:
        print(f"amx: not on this host ({why})")
    return out


def time_once(fn, q, k, v, grad) -> tuple[float, float]:
    t0 = time.perf_counter()
    out = fn(q, k, v)
    t1 = time.perf_counter()
    torch.autograd.grad(out, (q, k, v), grad)
    return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3


def ceiling_gflops(n: int = 2048, iters: int = 10) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16)
    b = torch.randn(n, n, dtype=torch.bfloat16)
    a @ b
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", default="256,512,1024,2048")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default="docs/bench_attention.md")
    a = p.parse_args()
    torch.set_num_threads(1)
    fns = kernels()
    ceiling = ceiling_gflops()
    rows = []
    for t in (int(s) for s in a.seqs.split(",")):
        b = max(1, a.tokens // t)
        torch.manual_seed(0)
        q = torch.randn(b, t, a.heads, a.head_dim, dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(b, a.kv_heads, t, a.head_dim, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        grad = torch.randn(b, a.heads, t, a.head_dim, dtype=torch.bfloat16)
        times = {name: [] for name in fns}
        for r in range(a.rounds + 1):
            for name, fn in fns.items():
                ms = time_once(fn, q, k, v, grad)
                if r:  # the first round warms up
                    times[name].append(ms)
        flops = 2 * b * a.heads * t * t * a.head_dim  # causal forward: half of 4 t^2 d
        for name, ts in times.items():
            fwd = statistics.median(x[0] for x in ts)
            bwd = statistics.median(x[1] for x in ts)
            rows.append((t, b, name, fwd, bwd, 3 * flops / (fwd + bwd) / 1e6))
            print(f"seq {t:5d} x {b}: {name:8s} forward {fwd:7.1f} ms  backward {bwd:7.1f} ms")
    write(rows, a, ceiling)


def write(rows, a, ceiling: float) -> None:
    best = {}
    for t, _, name, fwd, bwd, _ in rows:
        best.setdefault(t, {})[name] = fwd + bwd
    lines = [
        "# Attention kernels on a CPU",
        "",
        f"`python benchmarks/bench_attention.py` on {platform.processor() or platform.machine()}, "
        f"one thread, torch {torch.__version__}: one layer's causal attention, forward and "
        f"backward, {a.heads} query heads and {a.kv_heads} kv heads of {a.head_dim}, "
        f"{a.tokens} tokens a batch, bf16; the median of {a.rounds} rounds, kernels "
        "alternating. GFLOP/s counts the causal attention FLOPs (forward + backward = 3x the "
        f"forward's 2 b h t^2 d); this run's bf16 matmul ceiling (2048^3): {ceiling:,.0f} GFLOP/s.",
        "",
        "| sequence | batch | kernel | forward (ms) | backward (ms) | total (ms) | vs SDPA | GFLOP/s |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for t, b, name, fwd, bwd, rate in rows:
        lines.append(
            f"| {t} | {b} | {name} | {fwd:.1f} | {bwd:.1f} | {fwd + bwd:.1f} | "
            f"{best[t]['sdpa'] / (fwd + bwd):.2f}x | {rate:,.0f} |"
        )
    Path(a.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
