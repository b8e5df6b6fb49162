"""One layer's causal attention, forward and backward, under each CPU kernel of our model.

    python benchmarks/bench_attention.py [--seqs 256,512,1024,2048] [--tokens 2048] [--heads 12]
                                         [--kv-heads 12] [--head-dim 64] [--results FILE]

SDPA (PyTorch's flash kernel both ways), `explicit` (softmax(QK^T)V written out) and `amx`
(SDPA's forward, zerostack's backward: models/cpu_attention.py), bf16, one thread (what each of
two ranks gets), q laid out as the model makes it. Each sequence length holds `--tokens` tokens
a batch. Kernels alternate round by round so drift in the host's speed hits them alike; the
table keeps each one's median. Also prints the attention FLOPs' rate (causal: half of 4 t^2 d a
head forward, twice that backward), beside the bf16 matmul ceiling measured in the same run.
Writes the raw rows to benchmarks/results/attention_kernels.json, from which
`python -m benchmarks.docs_tables` draws docs/bench_attention.md's table.
"""

from __future__ import annotations

import argparse
import json
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
    p.add_argument("--results", default="", help="raw JSON (default: the committed results)")
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
    """The raw rows, the host and the run's matmul ceiling; then the doc's table from them."""
    from benchmarks.host import host_class
    from benchmarks.provenance import code_record

    default = Path(__file__).resolve().parent / "results" / "attention_kernels.json"
    raw = Path(a.results or default)
    doc = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": host_class(),
        "torch": torch.__version__,
        "code": code_record(),
        "args": {k: v for k, v in vars(a).items() if k != "results"},
        "ceiling_gflops": ceiling,
        "rows": [
            dict(zip(("seq", "batch", "kernel", "forward_ms", "backward_ms", "gflops"), r))
            for r in rows
        ],
    }
    raw.write_text(json.dumps(doc, indent=1))
    print(f"wrote {raw}")
    if not a.results:
        from benchmarks import docs_tables

        docs_tables.write(names=["attention_kernels"])


if __name__ == "__main__":
    main()
