"""One short job under every engine: DDP, FSDP2 and each ds_config, compared on the same work.

    python -m benchmarks.compare                      # the default job: `small` on pystdlib
    python -m benchmarks.compare --steps 10 --engines ddp,fsdp,zero2 --out /tmp/cmp

Every engine trains the same preset on the same data with the same global batch, steps, seed and
schedule, each as a real multi-rank run of training/train.py under torchrun. A few-line
nanoGPT-style DDP loop of the same model (`reference`, in reference.py, uncompiled; `reference_compiled`
is the same loop under torch.compile, as nanoGPT's train.py runs by default) runs beside them as
the speed reference. Writes OUT/comparison.md (tokens/s, MFU, peak memory per rank, model-state bytes per
rank, final train and validation loss, and ZeRO-2 in bf16 against fp32), OUT/comparison_memory.png
and OUT/comparison_loss.png, and every round's raw figures with the host (its class, cores and
load) to benchmarks/results/compare_MODEL.json (--results). Timings are medians over the steps
after warm-up, then the median of the rounds (--repeats), shown with their spread; other jobs on
the machine move them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from benchmarks.compare.report import save_raw, write_report
from benchmarks.compare.runs import (
    FLOORS,
    LOOPS,
    NATIVE,
    REPO,
    VARIANTS,
    WARMUP_STEPS,
    ds_config_names,
    initial_weights,
    over_rounds,
    run_engine,
    run_reference,
)
from benchmarks.provenance import busy_cpu_seconds, host_record

# `--peer`: the workload of the peer comparison: a 16.9M Llama (`small` with 6
# layers), sequence 256, micro-batch 8 per rank, no accumulation, 2 ranks x 1 thread, bf16;
# the four engines, the plain one-process loop, the nanoGPT-style loop and the HF Trainer with
# DeepSpeed (each also as people run it), alternated round by round.
PEER = {
    "model": "small",
    "layers": 6,
    "micro_batch": 8,
    "grad_accum": 1,
    "steps": 10,
    "repeats": 2,
    "engines": "zero2,ddp,fsdp,zero3,zero2_eager",
    "no_reference": False,
    "hf_trainer": True,
    "stock_peers": True,
    "plain": True,
    "section": True,
    "out": "runs/compare_peer",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = parser()
    if "--peer" in argv:
        p.set_defaults(**PEER)
    a = p.parse_args(argv)
    a.argv = _flags_worth_showing(argv)
    if a.steps <= WARMUP_STEPS:
        print(f"error: --steps must be more than {WARMUP_STEPS} (the warm-up)", file=sys.stderr)
        return 2
    known = NATIVE + list(VARIANTS) + ds_config_names() + list(LOOPS)
    unknown = set(a.engines.split(",")) - set(known)
    if unknown:
        print(
            f"error: unknown engines {sorted(unknown)}; choose from ddp, fsdp, "
            f"{', '.join(ds_config_names())}",
            file=sys.stderr,
        )
        return 2
    if not (Path(a.data) / "manifest.json").is_file():
        from data import prepare

        print(f"preparing the built-in corpus into {a.data} (once)", flush=True)
        prepare("pystdlib", a.data, num_proc=os.cpu_count() or 1)
    Path(a.runs).mkdir(parents=True, exist_ok=True)
    a.init = initial_weights(a)

    names = ([] if a.no_reference else ["reference"]) + (["plain"] if a.plain else [])
    names += ["hf_trainer"] if a.hf_trainer else []
    names += ["reference_sdpa", "reference_compiled", "hf_stock"] if a.stock_peers else []
    names = list(dict.fromkeys(names + a.engines.split(",")))  # a loop may be named twice
    # The floors' runs go first and back to back: the host's speed drifts over minutes, and a
    # ratio is only as good as the closeness in time of its two runs.
    paired = [n for run, against, _ in FLOORS for n in (against, run) if n in names]
    paired = list(dict.fromkeys(paired))  # reference, ddp, zero2
    order = paired + [n for n in names if n not in paired]
    host, results = run_rounds(a, names, order)
    rows = [over_rounds(results[name]) for name in names]
    wall = time.time() - host.pop("started")
    host.update(loadavg_after=list(os.getloadavg()), wall_s=wall)
    host["busy_cores"] = (busy_cpu_seconds() - host.pop("busy_cpu_s_before")) / wall
    raw = Path(
        a.results or REPO / "benchmarks" / "results" / f"compare_{a.model}{a.layers or ''}.json"
    )
    save_raw(results, rows, a, host, raw)
    print(f"raw rounds: {raw}", flush=True)
    if rows and rows[0]["name"] == "reference":
        print(f"reference: {rows[0]}", flush=True)
    md = write_report(rows, a, Path(a.out))
    print(md.read_text())
    if a.section:
        redraw_section(raw)
    return 0


def run_rounds(a, names: list[str], order: list[str]) -> tuple[dict, dict[str, list[dict]]]:
    """Every row `a.repeats` times in `order`, round-robin so a busy spell does not hit one
    engine only; returns the host's record (with its start time) and each row's rounds."""
    results: dict[str, list[dict]] = {name: [] for name in names}
    host = {**host_record(), "busy_cpu_s_before": busy_cpu_seconds(), "started": time.time()}
    for repeat in range(a.repeats):
        for name in order:
            if results[name] and "error" in results[name][0]:
                continue  # refused or failed: once is enough
            print(f"running {name} ({repeat + 1}/{a.repeats}) ...", flush=True)
            if name in LOOPS:
                results[name].append(run_reference(a, repeat, name))
            else:
                results[name].append(run_engine(name, a, repeat))
    return host, results


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.compare", description=__doc__.split("\n")[0]
    )
    p.add_argument("--data", default="data_cache/pystdlib", help="prepared data (made if absent)")
    p.add_argument("--model", default="small")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--eval-samples", type=int, default=32)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument(
        "--engines",
        default=",".join(NATIVE + ds_config_names()),
        help="comma-separated: ddp, fsdp, ds_configs names, and the variants fsdp_shard and "
        "zero3_shard (--hold-weights off), zero2_mean (--grad-sum off), zero2_eager, "
        "zero3_eager and ddp_eager (--no-compile), zero3_gloo and fsdp_gloo "
        "(--shm-collectives off), zero2_fp32, zero2_bf16, ddp_fp32 and ddp_bf16 (--precision), "
        "and the loops by name (reference_compiled: nanoGPT's default torch.compile; "
        "reference_fp32: nanoGPT's fp32 on a CPU) (default: all but the variants)",
    )
    p.add_argument("--no-reference", action="store_true", help="skip the nanoGPT-style loop")
    p.add_argument(
        "--repeats", type=int, default=1, help="run everything N times, take the median tokens/s"
    )
    p.add_argument(
        "--results",
        default="",
        help="the raw rounds as JSON (default: benchmarks/results/compare_MODEL[LAYERS].json)",
    )
    p.add_argument(
        "--out",
        default="runs/compare/report",
        help="where comparison.md and the PNGs go (the docs render from --results instead)",
    )
    p.add_argument("--runs", default="runs/compare", help="where the runs' folders go")
    p.add_argument("--layers", type=int, default=0, help="override the preset's layer count")
    p.add_argument("--plain", action="store_true", help="add the loop in one process, all cores")
    p.add_argument(
        "--hf-trainer",
        action="store_true",
        help="add the Hugging Face Trainer with DeepSpeed ZeRO-2 on the same job "
        "(benchmarks/peer_hf.py)",
    )
    p.add_argument(
        "--stock-peers",
        action="store_true",
        help="add the peers as people run them: the nanoGPT-style loop with SDPA attention and "
        "the HF Trainer with DeepSpeed on transformers' own Llama",
    )
    p.add_argument(
        "--section",
        action="store_true",
        help="redraw docs/benchmarks.md's engines table from the raw rounds "
        "(python -m benchmarks.docs_tables; the peer workload's file)",
    )
    p.add_argument(
        "--peer",
        action="store_true",
        help="the peer workload: ZeRO-2/DDP/FSDP2/ZeRO-3, the plain loop, the nanoGPT-style "
        "loop and the HF Trainer with DeepSpeed (also as people run them: --stock-peers), "
        "`small` with 6 layers, micro-batch 8, no "
        "accumulation, 2 rounds, the table into docs/benchmarks.md (explicit flags still win)",
    )
    return p


def redraw_section(raw: Path) -> None:
    """docs/benchmarks.md's engines table, drawn from the committed raw rounds of the peer
    workload; a run written elsewhere leaves the docs alone and says so."""
    from benchmarks import docs_tables

    if raw.resolve() != (docs_tables.RESULTS / "compare_small6.json").resolve():
        print(f"--section: {raw} is not the peer workload's committed file; docs left alone")
        return
    docs_tables.write(names=["engines_peer"])


def _flags_worth_showing(argv: list[str]) -> list[str]:
    """argv without the flags that only say where files live (for the report's command)."""
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x in ("--out", "--runs", "--data"):
            skip = True
        elif not x.startswith(("--out=", "--runs=", "--data=")):
            out.append(x)
    return out
