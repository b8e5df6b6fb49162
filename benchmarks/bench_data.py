"""Data pipeline speed on the built-in corpus: prepare (MB/s, tokens/s) and reader (tokens/s).

    python benchmarks/bench_data.py [--vocab-size 8192] [--num-proc 1 2] [--json out.json]

Prepare is timed end to end (tokenizer training + tokenization + shards) for each --num-proc,
and the tokenization stage alone with the tokenizer already trained. The reader is timed on
BatchLoader.next_batch, the call the trainer makes each micro step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path

from data import BatchLoader, TokenDataset, load_manifest, prepare
from data.shards import write_splits
from data.sources import resolve_source

TRAINING_TOKENS_PER_S = 40_000  # the small model on a 2-core CPU consumes 20-40k tokens/s


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (the tokenizer workers): unlike wall
    time, it does not depend on what else the machine is running."""
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def bench_prepare(root: Path, vocab_size: int, num_procs: list[int]) -> tuple[list[dict], Path]:
    rows, first = [], None
    for n in num_procs:
        out = root / f"pystdlib-np{n}"
        t, c = time.perf_counter(), cpu_seconds()
        prepare("pystdlib", out, vocab_size=vocab_size, num_proc=n, progress=False)
        total_s, total_cpu = time.perf_counter() - t, cpu_seconds() - c
        m = load_manifest(out)
        nbytes = sum(s.bytes for s in m.splits.values())
        ntok = sum(s.tokens for s in m.splits.values())
        # The tokenization stage alone, with this run's tokenizer.
        stage = root / f"stage-np{n}"
        stage.mkdir()
        t, c = time.perf_counter(), cpu_seconds()
        write_splits(
            resolve_source("pystdlib").documents(),
            stage,
            m.tokenizer_dir,
            m.eos_id,
            m.dtype,
            num_proc=n,
            val_fraction=0.005,
        )
        tok_s, tok_cpu = time.perf_counter() - t, cpu_seconds() - c
        rows.append(
            {
                "num_proc": n,
                "prepare_s": round(total_s, 1),
                "prepare_cpu_s": round(total_cpu, 1),
                "tokenize_s": round(tok_s, 1),
                "tokenize_cpu_s": round(tok_cpu, 1),
                "tokenize_MB_per_s": round(nbytes / tok_s / 1e6, 2),
                "tokenize_tokens_per_s": round(ntok / tok_s),
                "MB": round(nbytes / 1e6, 1),
                "tokens": ntok,
                "bytes_per_token": round(nbytes / ntok, 3),
            }
        )
        first = first or out
    return rows, first


def bench_reader(data: Path, shapes: list[tuple[int, int]], seconds: float = 2.0) -> list[dict]:
    rows = []
    for seq_len, micro in shapes:
        loader = BatchLoader(TokenDataset(data, "train", seq_len), micro, rank=0, world=2, seed=0)
        loader.next_batch()  # warm the page cache and the epoch permutation
        steps, t = 0, time.perf_counter()
        while time.perf_counter() - t < seconds:
            loader.next_batch()
            steps += 1
        tps = steps * micro * seq_len / (time.perf_counter() - t)
        rows.append(
            {
                "seq_len": seq_len,
                "micro_batch": micro,
                "tokens_per_s": round(tps),
                "x_training": round(tps / TRAINING_TOKENS_PER_S),
            }
        )
    return rows


def table(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = [" | ".join(keys), " | ".join("---" for _ in keys)]
    lines += [" | ".join(str(r[k]) for k in keys) for r in rows]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--num-proc", type=int, nargs="+", default=[1, 2])
    p.add_argument("--json", default=None, help="also write the figures here")
    a = p.parse_args()
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
    with tempfile.TemporaryDirectory() as tmp:
        prep, data = bench_prepare(Path(tmp), a.vocab_size, a.num_proc)
        print(f"prepare pystdlib, vocab {a.vocab_size}\n{table(prep)}\n")
        reader = bench_reader(data, [(256, 8), (1024, 8), (1024, 32)])
        print(f"reader (BatchLoader.next_batch, one rank of 2)\n{table(reader)}")
    if a.json:
        Path(a.json).write_text(json.dumps({"prepare": prep, "reader": reader}, indent=2) + "\n")


if __name__ == "__main__":
    main()
