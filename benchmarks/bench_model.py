"""Forward+backward speed of our model against transformers.LlamaForCausalLM of the same shape, same weights.

    python benchmarks/bench_model.py [--preset small] [--batch 8] [--seq 256] [--iters 20] [--autocast] [--threads N]

Both models run in bf16 (bf16 weights, as DeepSpeed's bf16 mode trains; or fp32 weights under
torch.autocast with --autocast) on the same batch, in the same process. Iterations alternate between the two
models so that drift in the machine's speed (other jobs, thermal) hits both alike. Prints the median and the
best wall ms/iter (the best is the least disturbed by other jobs), the median CPU time of the process per
iteration (with one thread, what the step costs when nothing else runs), tokens/s, MFU (model FLOPs from
models.presets.flops_per_token over a measured bf16 matmul ceiling) and the ratio llama_ms / ours_ms
(above 1: ours is faster). On a 2-core machine shared with other jobs, --threads 1 is the steadier measure,
and it is what each of two ranks gets.
"""

import argparse
import contextlib
import os
import statistics
import time

import torch
from transformers import LlamaForCausalLM

from models import (
    ZeroStackForCausalLM,
    flops_per_token,
    get_config,
    to_llama_config,
    to_llama_state_dict,
)


def matmul_ceiling(dtype: torch.dtype, n: int = 2048, iters: int = 10) -> tuple[float, float]:
    """FLOPs per wall second and per CPU second of an n^3 matmul in dtype, best of iters (other jobs only
    slow it down)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(2):
        a @ b
    wall = cpu = float("inf")
    for _ in range(iters):
        t, c = time.perf_counter(), time.process_time()
        a @ b
        wall, cpu = min(wall, time.perf_counter() - t), min(cpu, time.process_time() - c)
    return 2 * n**3 / wall, 2 * n**3 / cpu


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="small")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--autocast", action="store_true", help="fp32 weights under torch.autocast(bf16)"
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    return p


def main() -> None:
    args = parser().parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    config = get_config(args.preset)
    ours = ZeroStackForCausalLM(config)
    llama = LlamaForCausalLM(to_llama_config(config))
    llama.load_state_dict(to_llama_state_dict(ours.state_dict()))
    if not args.autocast:
        ours, llama = ours.to(torch.bfloat16), llama.to(torch.bfloat16)
    models = {"ours": ours.train(), "llama": llama.train()}

    x = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    y = torch.roll(x, -1, dims=1)

    def step(model):
        ctx = (
            torch.autocast("cpu", dtype=torch.bfloat16)
            if args.autocast
            else contextlib.nullcontext()
        )
        t, c = time.perf_counter(), time.process_time()
        with ctx:
            loss = model(input_ids=x, labels=y, shift_labels=y).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t, time.process_time() - c, loss.item()

    peak_before = matmul_ceiling(torch.bfloat16)
    for _ in range(args.warmup):
        for model in models.values():
            step(model)
    times = {name: [] for name in models}
    cpu = {name: [] for name in models}
    losses = {}
    for _ in range(args.iters):
        for name, model in models.items():
            dt, dc, losses[name] = step(model)
            times[name].append(dt)
            cpu[name].append(dc)

    tokens = args.batch * args.seq
    flops = flops_per_token(config, args.seq) * tokens
    peak_after = matmul_ceiling(torch.bfloat16)
    peak, peak_cpu = (max(a, b) for a, b in zip(peak_before, peak_after, strict=True))
    mode = "fp32 weights + autocast bf16" if args.autocast else "bf16 weights"
    print(f"preset {args.preset}, batch {args.batch} x seq {args.seq}, {mode}")
    print(
        f"{torch.get_num_threads()} threads; load average {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} cores; bf16 matmul ceiling {peak / 1e9:.0f} GFLOP/s "
        f"({peak_cpu / 1e9:.0f} per CPU second); "
        f"{flops / tokens / 1e6:.1f} MFLOP/token"
    )
    med = {name: statistics.median(ts) for name, ts in times.items()}
    best = {name: min(ts) for name, ts in times.items()}
    cpu_med = {name: statistics.median(ts) for name, ts in cpu.items()}
    for name in models:
        print(
            f"{name:>6}: median {med[name] * 1e3:7.1f} ms/iter, best {best[name] * 1e3:7.1f}, "
            f"CPU {cpu_med[name] * 1e3:7.1f}  {tokens / med[name]:6.0f} tok/s  "
            f"MFU {flops / best[name] / peak:5.1%} (best), {flops / cpu_med[name] / peak_cpu:5.1%} (CPU)  "
            f"loss {losses[name]:.4f}"
        )
    print(
        f"ratio llama/ours: median {med['llama'] / med['ours']:.3f}, "
        f"best {best['llama'] / best['ours']:.3f}, CPU time {cpu_med['llama'] / cpu_med['ours']:.3f}"
        "  (above 1: ours is faster)"
    )


if __name__ == "__main__":
    main()
