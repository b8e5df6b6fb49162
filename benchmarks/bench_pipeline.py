"""What the pipeline bubble costs: pp=2 against ZeRO-0/1 data parallelism on the same ranks.

    python benchmarks/bench_pipeline.py [--model small] [--global-batch 16] [--steps 12]

Every run is a real job of training/train.py on `--ranks` ranks with the same global batch,
sequence length, seed and schedule: ZeRO-0 and ZeRO-1 as `ranks` data-parallel replicas, then
ds_configs/pipeline.json (2 stages, ranks / 2 replicas) with the global batch cut into 1, 2, 4,
8 ... micro-batches. A pipeline of p stages and m micro-batches keeps each stage idle for
(p - 1) of every (m + p - 1) micro-batch slots, so in theory its step takes (m + p - 1) / m of a
data-parallel step doing the same work; the table sets the measured ratio beside that.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from launch.launcher_argv import launcher_command
from training.runtime.distributed import free_port

REPO = Path(__file__).resolve().parent.parent
WARMUP = 3  # steps left out of the timings


def run(name: str, a, cfg: str, micro: int, accum: int) -> dict:
    out = Path(a.runs) / name
    program = ["training/train.py", "--ds_config", cfg]
    cmd = launcher_command("torchrun", a.ranks, program, port=free_port())
    cmd += ["--data", a.data, "--model", a.model, "--out", str(out), "--seq-len", str(a.seq_len)]
    cmd += ["--micro-batch", str(micro), "--grad-accum", str(accum), "--steps", str(a.steps)]
    cmd += ["--log-every", "1", "--eval-every", "0", "--eval-samples", "8", "--save-every", "-1"]
    cmd += ["--resume", "never", "--warmup", "2"]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if p.returncode != 0:
        print(p.stdout[-2000:], p.stderr[-3000:], file=sys.stderr)
        return {"name": name, "error": f"exit {p.returncode}"}
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["kind"] == "train"]
    tokens = a.global_batch * a.seq_len
    step_s = statistics.median(tokens / r["tokens_per_s"] for r in train[WARMUP:])
    return {
        "name": name,
        "micro": micro,
        "accum": accum,
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "loss": train[-1]["loss"],
        "peak_mem_gb": max(r["peak_mem_gb"] for r in train),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default="data_cache/pystdlib")
    p.add_argument("--model", default="small")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step")
    p.add_argument("--micro-batches", default="1,2,4,8", help="pipeline micro-batches per step")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--runs", default="runs/bench_pipeline")
    a = p.parse_args()
    if not (Path(a.data) / "manifest.json").is_file():
        print(
            f"error: {a.data} is not a prepared dataset; run "
            f"`python -m data.prepare --source pystdlib --out {a.data}` first",
            file=sys.stderr,
        )
        return 2
    stages, dp = 2, a.ranks // 2
    rows = []
    for zero in ("zero0", "zero1"):
        rows.append(run(zero, a, f"ds_configs/{zero}.json", a.global_batch // a.ranks, 1))
        print(rows[-1], flush=True)
    for m in map(int, a.micro_batches.split(",")):
        if a.global_batch % (m * dp):
            continue
        rows.append(run(f"pp2_m{m}", a, "ds_configs/pipeline.json", a.global_batch // (m * dp), m))
        rows[-1]["m"] = m
        print(rows[-1], flush=True)

    dp_s = min(r["step_s"] for r in rows[:2] if "error" not in r)
    load = os.getloadavg()[0]
    lines = [
        f"`python benchmarks/bench_pipeline.py --model {a.model}` on {a.ranks} ranks, "
        f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}, load average {load:.1f}. "
        f"Global batch {a.global_batch} x {a.seq_len} tokens per step; median over steps "
        f"{WARMUP + 1}-{a.steps}. The pipeline rows are {stages} stages x {dp} data-parallel.",
        "",
        "| run | micro-batch x count | s / step | tokens/s | step vs best ZeRO | "
        "theory (m + p - 1) / m | peak memory / rank (GB) | loss |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error']} |" + " |" * 6)
            continue
        theory = f"{(r['m'] + stages - 1) / r['m']:.2f}x" if "m" in r else ""
        lines.append(
            f"| {r['name']} | {r['micro']} x {r['accum']} | {r['step_s']:.3f} | "
            f"{r['tokens_per_s']:,.0f} | {r['step_s'] / dp_s:.2f}x | {theory} | "
            f"{r['peak_mem_gb']:.2f} | {r['loss']:.3f} |"
        )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
