"""Mixture of experts on this machine: the MoE preset against the dense preset of the same active
parameters, and expert parallelism against experts replicated, on 2 and 4 ranks.

    python -m benchmarks.bench_moe [--moe tiny-moe --dense tiny] [--rounds 3] [--steps 12]

`tiny` is `tiny-moe` with one MLP as wide as the two experts a token uses (176 = 2 x 88), so
both do the same matmul work per token; the MoE holds twice the MLP weights and routes. Every
arm is a real torchrun job of training/train.py on the built-in corpus with the same global
batch (2 ranks x micro-batch 4, 4 ranks x 2), so the loss after the last step is after the same
tokens. Arms run interleaved, round after round, so load from other work on the host falls on
all of them alike; only ratios inside one run mean anything. Writes the raw rounds and their
medians (with the lowest and highest) to benchmarks/results/moe.json; the table in
docs/benchmarks.md is drawn from it by `python -m benchmarks.docs_tables`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from benchmarks.bench_train import run_config

REPO = Path(__file__).resolve().parent.parent

# (arm, model flag, ds_config, ranks)
ARMS = [
    ("dense", "dense", "zero2", 2),
    ("moe, experts replicated", "moe", "zero2", 2),
    ("moe, expert-parallel ep2", "moe", "moe_ep2", 2),
    ("moe, experts replicated", "moe", "zero2", 4),
    ("moe, expert-parallel ep2 x dp2", "moe", "moe_ep2", 4),
]


def run_arm(arm: tuple, a, out: Path) -> dict:
    name, which, config, ranks = arm
    args = SimpleNamespace(
        data=a.data,
        model=a.moe if which == "moe" else a.dense,
        seq_len=a.seq_len,
        micro_batch=a.global_batch // ranks,
        steps=a.steps,
        log_every=a.log_every,
        ranks=ranks,
        extra=["--no-compile", "--peak-tflops", "1", "--seed", "1234"],
    )
    row = run_config(config, args, out)
    return row | {"arm": name, "model": args.model, "config": config, "ranks": ranks}


def summary(rounds: list[list[dict]]) -> list[dict]:
    """Per arm: the median tokens/s and final loss over the rounds, with their lowest and
    highest, and the median tokens/s against the first arm's (the dense model on 2 ranks)."""
    out = []
    for i, first in enumerate(rounds[0]):
        rows = [r[i] for r in rounds if "error" not in r[i]]
        tps = [r["tokens_per_s"] for r in rows]
        loss = [r["loss"] for r in rows]
        keep = {k: first[k] for k in ("arm", "model", "config", "ranks")}
        out.append(
            keep
            | {
                "rounds": len(rows),
                "tokens_per_s": statistics.median(tps),
                "tokens_per_s_spread": [min(tps), max(tps)],
                "loss": statistics.median(loss),
                "loss_spread": [min(loss), max(loss)],
            }
        )
    base = out[0]["tokens_per_s"]
    for row in out:
        row["vs_dense"] = row["tokens_per_s"] / base
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default="data_cache/pystdlib")
    p.add_argument("--moe", default="tiny-moe")
    p.add_argument("--dense", default="tiny")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--log-every", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step, all ranks")
    p.add_argument("--runs", default="runs/bench_moe")
    p.add_argument("--results", default=str(REPO / "benchmarks" / "results" / "moe.json"))
    p.add_argument("--note", default="", help="what else loaded the host, for the table")
    a = p.parse_args()
    if not (Path(a.data) / "manifest.json").is_file():
        print(
            f"error: {a.data} is not a prepared dataset (python -m data.prepare)", file=sys.stderr
        )
        return 2
    from benchmarks.provenance import code_record, host_record

    host = host_record()
    rounds = []
    for k in range(a.rounds):
        rounds.append([run_arm(arm, a, Path(a.runs) / f"round{k}" / str(i))
                       for i, arm in enumerate(ARMS)])  # fmt: skip
        print(json.dumps(rounds[-1]), flush=True)
    host["loadavg_after"] = list(os.getloadavg())
    host["note"] = a.note
    args = {k: v for k, v in vars(a).items() if k not in ("runs", "results")}
    doc = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "args": args}
    record = {**doc, "host": host, "code": code_record(), "rounds": rounds}
    record["summary"] = summary(rounds)
    Path(a.results).write_text(json.dumps(record, indent=1))
    print(f"raw rounds: {a.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
