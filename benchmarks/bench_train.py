"""Training throughput of every ds_config against a plain PyTorch loop of the same model.

    python benchmarks/bench_train.py [--steps 30] [--configs zero0,zero2,...]

Each ds_config runs as a real 2-rank job of training/train.py (1 thread per rank on a 2-core
CPU). The reference is the loop people write by hand: one process, all cores, the same model,
the same global batch, bf16 autocast and fused AdamW. Prints and writes a markdown table:
tokens/s, MFU against the measured matmul peak, peak memory per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from launch.launcher_argv import launcher_command
from training.runtime.distributed import free_port

REPO = Path(__file__).resolve().parent.parent

DEFAULT_CONFIGS = ["zero0", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "fp32"]


def run_config(name: str, a, out_root: Path) -> dict:
    out = out_root / name
    program = [
        "training/train.py",
        "--ds_config",
        f"ds_configs/{name}.json",
        "--data",
        a.data,
        "--model",
        a.model,
        "--out",
        str(out),
        "--seq-len",
        str(a.seq_len),
        "--micro-batch",
        str(a.micro_batch),
        "--steps",
        str(a.steps),
        "--log-every",
        str(a.log_every),
        "--eval-every",
        "0",
        "--eval-samples",
        "16",
        "--save-every",
        "-1",
        "--resume",
        "never",
    ]
    cmd = launcher_command("torchrun", a.ranks, program, port=free_port())
    stages = json.loads((REPO / "ds_configs" / f"{name}.json").read_text()).get("pipeline", {})
    if stages.get("stages", 1) > 1:  # ranks / stages replicas: as many micro-batches per step
        cmd += ["--grad-accum", str(stages["stages"])]  # keep the same global batch
    cmd += a.extra
    t = time.time()
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if p.returncode != 0:
        print(p.stdout[-2000:], p.stderr[-4000:], file=sys.stderr)
        return {"name": name, "error": f"exit {p.returncode}"}
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["kind"] == "train"][1:]  # the first interval holds warm-up
    tps = sum(r["tokens_per_s"] for r in train) / len(train)
    ceiling = json.loads((out / "resolved_config.json").read_text())["peak_flops_per_rank"]
    return {
        "name": name,
        "tokens_per_s": tps,
        "mfu": sum(r["mfu"] for r in train) / len(train),
        "ceiling": ceiling,
        "peak_mem_gb": max(r["peak_mem_gb"] for r in train),
        "loss": train[-1]["loss"],
        "wall_s": time.time() - t,
    }


def run_reference(a, threads: int, kernel: str) -> dict:
    """nanoGPT-style loop in a child process (its own thread count and RSS). kernel: our model's
    attention kernel (sdpa is what such loops use; the first row takes the trainer's pick)."""
    code = f"""
import json, resource, sys, time, torch
torch.set_num_threads({threads})
from data import BatchLoader, TokenDataset, load_manifest
from models import build_model, flops_per_token, set_attention_kernel
from training.runtime.flops import measure_flops, model_shapes
m = load_manifest({a.data!r})
torch.manual_seed(1234)
model = build_model({a.model!r}, vocab_size=m.vocab_size)
set_attention_kernel(model, {kernel!r})
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
ds = TokenDataset({a.data!r}, "train", {a.seq_len})
loader = BatchLoader(ds, {a.micro_batch * a.ranks}, 0, 1, 1234)
# This run's own ceiling, on the model's matmul shapes, with this process's threads.
shapes = model_shapes(model.config, {a.micro_batch * a.ranks * a.seq_len})
peak = measure_flops(torch.device("cpu"), torch.bfloat16, shapes)
fpt = flops_per_token(model.config, {a.seq_len}, n_params=sum(p.numel() for p in model.parameters()))
times = []
for step in range({a.steps}):
    t = time.perf_counter()
    x, y = loader.next_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=x, labels=y, shift_labels=y).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(); opt.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - t)
tokens = {a.micro_batch * a.ranks * a.seq_len}
tps = tokens / (sum(times[3:]) / len(times[3:]))
print(json.dumps({{"tokens_per_s": tps, "mfu": tps * fpt / peak, "ceiling": peak, "loss": loss.item(),
    "peak_mem_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}}))
"""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=env
    )
    if p.returncode != 0:
        print(p.stderr[-4000:], file=sys.stderr)
        return {"name": "plain PyTorch", "error": f"exit {p.returncode}"}
    return {
        "name": f"plain PyTorch loop (1 process, {threads} threads, {kernel} attention)",
        **json.loads(p.stdout.strip().splitlines()[-1]),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default="data_cache/pystdlib")
    p.add_argument("--model", default="small")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS))
    p.add_argument("--runs", default="runs/bench")
    p.add_argument(
        "--results", default="", help="raw JSON (benchmarks/results/bench_train_MODEL.json)"
    )
    p.add_argument("extra", nargs="*", help="more train.py flags, after --")
    a = p.parse_args()
    if not (Path(a.data) / "manifest.json").is_file():
        print(
            f"error: {a.data} is not a prepared dataset; run "
            f"`python -m data.prepare --source pystdlib --out {a.data}` first",
            file=sys.stderr,
        )
        return 2
    # The first row is the yardstick: the same model and attention kernel as the trainer's runs,
    # so the ratio is DeepSpeed's own cost; the second is the loop as people write it (SDPA).
    from benchmarks.provenance import code_record, host_record
    from models import pick_attention_kernel

    host = host_record()
    ours = pick_attention_kernel("auto", "cpu", a.seq_len)
    rows = [run_reference(a, os.cpu_count() or 1, k) for k in (ours, "sdpa")]
    print(rows, flush=True)
    for name in a.configs.split(","):
        rows.append(run_config(name, a, Path(a.runs)))
        print(rows[-1], flush=True)
    # the raw rows beside the table, with the host and the code they ran on
    host["loadavg_after"] = list(os.getloadavg())
    raw = Path(a.results or REPO / "benchmarks" / "results" / f"bench_train_{a.model}.json")
    raw.parent.mkdir(parents=True, exist_ok=True)
    args = {k: v for k, v in vars(a).items() if k not in ("data", "runs", "results")}
    doc = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "args": args}
    raw.write_text(json.dumps({**doc, "host": host, "code": code_record(), "rows": rows}, indent=1))
    print(f"raw rows: {raw}")
    if not a.results:  # the committed results folder: redraw docs/bench_train.md from it
        from benchmarks import docs_tables

        docs_tables.write(names=["bench_train"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
