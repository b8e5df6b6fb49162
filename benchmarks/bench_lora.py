"""LoRA against full fine-tuning: tokens/s and peak memory per rank, same model, data and batch.

    python benchmarks/bench_lora.py [--data data_cache/pystdlib] [--model small] [--steps 10]

The base is the preset's freshly initialised weights saved as a Llama folder (what matters here
is the cost of a step, not what it learns). Both runs are real 2-rank jobs of training/train.py
under `--config` (default zero2), `--no-compile`, the trainer's own precision choice; LoRA adds
`--lora LORA` (default r=16 on every projection). Writes raw JSON to
benchmarks/results/lora.json and prints a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.bench_train import run_config
from benchmarks.host import host_class


def base_folder(model: str, data: str, out: Path) -> Path:
    import torch

    from data import load_manifest
    from models import build_model, save_llama

    torch.manual_seed(1234)
    m = build_model(model, vocab_size=load_manifest(data).vocab_size)
    save_llama(dict(m.named_parameters()), m.config, out)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default="data_cache/pystdlib")
    p.add_argument("--model", default="small")
    p.add_argument("--config", default="zero2")
    p.add_argument("--lora", default="r=16,alpha=32,dropout=0.05")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--log-every", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--runs", default="runs/bench_lora")
    p.add_argument("--json", default="benchmarks/results/lora.json")
    a = p.parse_args()
    runs = Path(a.runs)
    a.model = str(base_folder(a.model, a.data, runs / "base").resolve())
    rows = []
    for name, extra in (("full", []), ("lora", ["--lora", a.lora])):
        a.extra = ["--no-compile", *extra]
        row = run_config(a.config, a, runs / name)
        resolved = json.loads((runs / name / a.config / "resolved_config.json").read_text())
        states = [
            json.loads(x)
            for x in (runs / name / a.config / "metrics.jsonl").read_text().splitlines()
            if '"state_bytes"' in x
        ]
        row |= {
            "name": name,
            "params": resolved["n_params"],
            "trainable": resolved["trainable_params"],
            "precision": resolved["precision"],
            "model_states_mb": states[0]["per_rank"][0]["total"] / 2**20 if states else None,
        }
        rows.append(row)
        print(row, flush=True)
    host = host_class()
    from benchmarks.provenance import today

    record = {"date": today(), "host": host, "args": vars(a), "rows": rows}
    Path(a.json).write_text(json.dumps(record, indent=1))
    print(f"\n{host}; {a.config}, {a.ranks} ranks, seq {a.seq_len}, micro-batch {a.micro_batch}")
    print("| run | trainable / all params | tokens/s | peak memory / rank (GB) | final loss |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['name']} | {r['trainable'] / 1e6:.2f}M / {r['params'] / 1e6:.2f}M | "
            f"{r['tokens_per_s']:,.0f} | {r['peak_mem_gb']:.2f} | {r['loss']:.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
