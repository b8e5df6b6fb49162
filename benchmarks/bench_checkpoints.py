"""Time and peak memory of universal conversion and Hugging Face export on a real checkpoint.

    python -m benchmarks.bench_checkpoints --data DATA_DIR --preset 125M [--config zero2] [--ranks 2]

Trains the preset for one step (seq 32, micro 1) with the given DeepSpeed config and saves, then
runs each tool in a process of its own timed (wall seconds, peak RSS):

    zerostack universal   python -m training.universal RUN --force
    ds_to_universal       DeepSpeed's converter (1 extract and 1 merge worker), for comparison
    zerostack export      python -m training.export RUN --out HF  (reload check included)
    imports only          python -c "import torch, deepspeed, transformers, models, training.export"

The figure of merit is peak RSS over the fp32 weight size (4 bytes a parameter), shown raw and
with the imports-only baseline taken off (what the tool itself holds). Prints a markdown table.

    python -m benchmarks.bench_checkpoints --data DATA_DIR --preset 125M --stall [--steps 6]

The training stall per save instead: the same run (seq 32, micro 1, a save every 2 steps;
`--seq-len`, `--micro-batch` and `--save-every` change them, so that saves can come further apart
than a background write takes) with synchronous saves and with --async-save. From the run's metrics.jsonl: the time the step loop
was blocked per save (the "checkpoint" records' stall_s; for a background save the host copy,
its seal comes at a later boundary and is counted too), the background write time, the step
time of the steps a background write overlapped against the others, and each run's peak RSS
(the largest rank). Prints a markdown table with the host class and writes the raw
numbers to benchmarks/results/checkpoint_stall.json (checkpoint_stall_PRESET_CONFIG.json
with other settings), with the load average before and after each run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import host
from launch.launcher_argv import launcher_command

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


def timed(cmd: list[str], workdir: Path) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of cmd; its output is shown only when it fails."""
    log = workdir / "cmd.log"
    with log.open("w") as f:
        wall, rss, rc = host.timed(cmd, REPO, stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{log.read_text()[-5000:]}")
    return wall, rss


def stall(args, work: Path) -> int:
    """Sync vs --async-save: the loop's stall per save, the write time, the overlapped steps."""
    results = {}
    for mode in args.modes.split(","):
        results[mode] = stall_run(args, work / mode, mode)
    run = work / mode
    n_params = json.loads((run / "resolved_config.json").read_text())["n_params"]
    from benchmarks.provenance import today

    out = {
        "date": today(),
        "host": host.host_class(),
        "preset": args.preset,
        "n_params": n_params,
        "config": args.config,
        "ranks": args.ranks,
        "steps": args.steps,
        "save_every": args.save_every,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "results": results,
    }
    default = (args.save_every, args.seq_len, args.micro_batch) == (2, 32, 1)
    name = (
        "checkpoint_stall.json" if default else f"checkpoint_stall_{args.preset}_{args.config}.json"
    )
    dest = REPO / "benchmarks" / "results" / name
    dest.write_text(json.dumps(out, indent=1))
    print_stall(out)
    return 0


def stall_run(args, run: Path, mode: str) -> dict:
    """One run saving every --save-every steps, synchronously or with --async-save (`mode`):
    its stall, write and step times per save, read from its metrics."""
    shutil.rmtree(run, ignore_errors=True)
    train = launcher_command("torchrun", args.ranks, [
        "training/train.py", "--data", args.data, "--out", str(run),
        "--model", args.preset, "--ds_config", f"ds_configs/{args.config}.json",
        "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
        "--steps", str(args.steps), "--save-every", str(args.save_every), "--keep-last", "2",
        "--eval-every", "0", "--eval-samples", "2", "--log-every", "1",
        *(["--async-save"] if mode == "async" else []),
    ], python=PY)  # fmt: skip
    load_before = os.getloadavg()[0]
    wall, rss = timed(train, run.parent)
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    saves = [r for r in records if r.get("kind") == "checkpoint"]
    steps = {r["step"]: r for r in records if r.get("kind") == "train"}
    # a step's time: the interval between train records (log-every 1)
    times = sorted((r["step"], r["time"]) for r in steps.values())
    dt = {b[0]: b[1] - a[1] for a, b in zip(times, times[1:])}
    saved_at = {r["step"] for r in saves}
    overlapped = [dt[s + 1] for s in saved_at if s + 1 in dt]  # the step after a save started
    others = [v for s, v in dt.items() if s - 1 not in saved_at]
    return {
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "wall_s": wall,
        "peak_rss_bytes": rss,
        "saves": saves,
        "stall_per_save_s": sum(r["stall_s"] for r in saves) / len(saves),
        "write_s": [r.get("write_s") for r in saves],
        "staged_bytes": max((r.get("staged_bytes", 0) for r in saves), default=0),
        **{
            f"{k}_per_save_s": sum(r.get(k, 0) for r in saves) / len(saves)
            for k in ("stage_s", "wait_s", "seal_s")
        },
        "step_s_after_save": sum(overlapped) / len(overlapped) if overlapped else None,
        "step_s_other": sum(others) / len(others) if others else None,
    }


def print_stall(out: dict) -> None:
    """The stall runs as a markdown table, under a line naming the job and the host."""
    print(
        f"\n{out['preset']} ({out['n_params'] / 1e6:.0f}M params), {out['config']}, "
        f"{out['ranks']} ranks; {out['host']}\n"
    )
    print(
        "| saves | loop stall per save s | of which copy / wait / seal | background write s | "
        "step s (interval holding a save) | step s (others) | peak RSS MiB |"
    )
    print("|---|---|---|---|---|---|---|")
    for mode, r in out["results"].items():
        writes = [w for w in r["write_s"] if w is not None]
        w = f"{sum(writes) / len(writes):.2f}" if writes else "-"
        after = f"{r['step_s_after_save']:.2f}" if r["step_s_after_save"] else "-"
        other = f"{r['step_s_other']:.2f}" if r["step_s_other"] else "-"
        parts = (
            " / ".join(f"{r[k + '_per_save_s']:.2f}" for k in ("stage_s", "wait_s", "seal_s"))
            if mode == "async"
            else "-"
        )
        print(
            f"| {mode} | {r['stall_per_save_s']:.2f} | {parts} | {w} | {after} | {other} | "
            f"{r['peak_rss_bytes'] / 2**20:,.0f} |"
        )


def parser() -> argparse.ArgumentParser:
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--data", required=True, help="a folder written by `python -m data.prepare`")
    a.add_argument("--preset", default="125M")
    a.add_argument("--config", default="zero2", help="a ds_configs/ name")
    a.add_argument("--ranks", type=int, default=2)
    a.add_argument("--workdir", default=None, help="default: a temporary folder, removed after")
    a.add_argument("--stall", action="store_true", help="sync vs --async-save stall per save")
    a.add_argument("--steps", type=int, default=6, help="--stall: steps per run")
    a.add_argument("--modes", default="sync,async", help="--stall: which saves to run")
    a.add_argument("--save-every", type=int, default=2, help="--stall: steps between saves")
    a.add_argument("--seq-len", type=int, default=32, help="--stall: tokens per sample")
    a.add_argument("--micro-batch", type=int, default=1, help="--stall: samples per rank and step")
    return a


def main() -> int:
    args = parser().parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_ckpt_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        return stall(args, work) if args.stall else conversions(args, work)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


def conversions(args, work: Path) -> int:
    """Time and peak memory of the universal conversion (ours and DeepSpeed's) and of the export,
    on a one-step run's checkpoint (made once in --workdir)."""
    run = work / "run"
    if not (run / "checkpoints" / "latest").is_file():
        train = launcher_command("torchrun", args.ranks, [
            "training/train.py", "--data", args.data, "--out", str(run),
            "--model", args.preset, "--ds_config", f"ds_configs/{args.config}.json",
            "--seq-len", "32", "--micro-batch", "1", "--steps", "1", "--eval-samples", "2",
            "--log-every", "1",
        ], python=PY)  # fmt: skip
        timed(train, work)
    n_params = json.loads((run / "resolved_config.json").read_text())["n_params"]
    fp32 = 4 * n_params
    tag = (run / "checkpoints" / "latest").read_text().strip()
    ckpt_bytes = sum(f.stat().st_size for f in (run / "checkpoints" / tag).iterdir())

    rows = []
    base = timed([PY, "-c", "import torch, deepspeed, transformers, models, training.export"], work)
    rows.append(("imports only", *base))
    rows.append(
        (
            "zerostack universal",
            *timed([PY, "-m", "training.universal", str(run), "--force"], work),
        )
    )
    dsu = work / "dsu" / tag
    shutil.rmtree(dsu.parent, ignore_errors=True)
    rows.append(
        (
            "ds_to_universal",
            *timed(
                [
                    PY,
                    "-m",
                    "deepspeed.checkpoint.ds_to_universal",
                    "--input_folder",
                    str(run / "checkpoints" / tag),
                    "--output_folder",
                    str(dsu),
                    "--num_extract_workers",
                    "1",
                    "--num_merge_workers",
                    "1",
                ],  # fmt: skip
                work,
            ),
        )
    )
    hf = work / "hf"
    shutil.rmtree(hf, ignore_errors=True)
    rows.append(
        (
            "zerostack export",
            *timed([PY, "-m", "training.export", str(run), "--out", str(hf)], work),
        )
    )

    print(
        f"\n{args.preset}: {n_params / 1e6:.1f}M params, fp32 weights {fp32 / 2**20:.0f} MiB, "
        f"checkpoint {ckpt_bytes / 2**20:.0f} MiB ({args.config}, {args.ranks} ranks)\n"
    )
    print("| step | wall s | peak RSS MiB | RSS / fp32 | (RSS - imports) / fp32 |")
    print("|---|---|---|---|---|")
    for name, wall, rss in rows:
        extra = (rss - base[1]) / fp32
        print(f"| {name} | {wall:.1f} | {rss / 2**20:.0f} | {rss / fp32:.2f} | {extra:.2f} |")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
