"""Soak: a long run stays flat. A benchmark, not a test (it takes minutes per engine).

    python -m benchmarks.soak [--steps 3000] [--engines zero2,fsdp2] [--results FILE]

Each engine trains the tiny preset as a real 2-rank job of training/train.py for --steps steps,
saving every --save-every steps (keeping the last 2, so old checkpoints are deleted all along)
and evaluating every --eval-every. From outside, about once a second, it samples each rank's
resident memory (RSS), open file descriptors, threads and /dev/shm mappings, and the /dev/shm
files named after the run. The run's first part is warm-up (every kind of event, a save, a
deletion and an evaluation, has happened once by then); the figures compare the median of the
samples just after it with the median of the last ones before the final step. It holds when
every rank's RSS grew by at most 5%, no rank holds more file descriptors or shared-memory
mappings at the end than at the start, and no /dev/shm file of the run outlives it. The raw
rows go to benchmarks/results/soak.json (or --results), and docs/reliability.md's table is drawn
from the committed file by python -m benchmarks.docs_tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from launch.launcher_argv import launcher_command
from training.runtime.distributed import free_port

REPO = Path(__file__).resolve().parent.parent
ENGINES = {
    "zero2": ["--backend", "deepspeed", "--ds_config", "ds_configs/zero2.json"],
    "fsdp2": ["--backend", "fsdp"],
}
MAX_RSS_GROWTH = 0.05


@dataclass
class Sample:
    step: int
    rss: list[int]  # bytes, per rank
    fds: list[int]
    threads: list[int]
    shm_maps: list[int]  # /dev/shm mappings per rank (unlinked segments included)
    shm_files: int  # /dev/shm files named after this run


@dataclass
class Soak:
    engine: str
    steps: int
    seconds: float
    exit_code: int
    samples: list[Sample] = field(default_factory=list)
    shm_left: list[str] = field(default_factory=list)  # the run's /dev/shm files after exit


def rank_processes(launcher: psutil.Process) -> dict[int, psutil.Process]:
    """{rank: process} of the training ranks torchrun started (their helpers left out)."""
    ranks = {}
    for p in launcher.children(recursive=True):
        try:
            env = p.environ()
            if "training/train.py" in " ".join(p.cmdline()) and "RANK" in env:
                ranks.setdefault(int(env["RANK"]), p)
        except psutil.Error:
            continue
    return ranks


def shm_maps(p: psutil.Process) -> int:
    """Distinct /dev/shm files a process has mapped."""
    try:
        with open(f"/proc/{p.pid}/maps") as f:
            return len({line.split(None, 5)[-1] for line in f if "/dev/shm/" in line})
    except OSError:
        return 0


def run_shm_files(port: int) -> list[str]:
    """/dev/shm files named after this run: DeepSpeed names its segments after the port."""
    try:
        return sorted(n for n in os.listdir("/dev/shm") if f"_{port}_" in n)
    except OSError:
        return []


def last_step(metrics: Path) -> int:
    """The step of the last complete train record in metrics.jsonl (0 before the first)."""
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if r.get("kind") == "train":
            return r["step"]
    return 0


def take_sample(ranks: dict[int, psutil.Process], port: int, step: int) -> Sample | None:
    order = [ranks[r] for r in sorted(ranks)]
    try:
        return Sample(
            step=step,
            rss=[p.memory_info().rss for p in order],
            fds=[p.num_fds() for p in order],
            threads=[p.num_threads() for p in order],
            shm_maps=[shm_maps(p) for p in order],
            shm_files=len(run_shm_files(port)),
        )
    except psutil.Error:
        return None  # a rank exited between listing and reading: the run is ending


def soak(engine: str, a, out_root: Path) -> Soak:
    """One 2-rank run of `engine`, sampled from outside about once a second."""
    out, port = out_root / engine, free_port()
    program = [
        "training/train.py", *ENGINES[engine],
        "--data", str(a.data), "--out", str(out), "--model", "tiny", "--seq-len", "64",
        "--micro-batch", "2", "--steps", str(a.steps), "--warmup", "20", "--lr", "3e-3",
        "--log-every", "10", "--save-every", str(a.save_every), "--keep-last", "2",
        "--eval-every", str(a.eval_every), "--eval-samples", "8", "--resume", "never",
    ]  # fmt: skip
    cmd = launcher_command("torchrun", a.ranks, program, port=port)
    log = open(out_root / f"{engine}.log", "w")
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    result = Soak(engine, a.steps, 0.0, 0)
    launcher = psutil.Process(proc.pid)
    while proc.poll() is None:
        time.sleep(a.interval)
        ranks = rank_processes(launcher)
        if len(ranks) == a.ranks:
            s = take_sample(ranks, port, last_step(out / "metrics.jsonl"))
            if s is not None and s.step > 0:
                result.samples.append(s)
    result.exit_code, result.seconds = proc.wait(), time.time() - t0
    result.shm_left = run_shm_files(port)
    log.close()
    return result


def window(samples: list[Sample], lo: int, hi: int) -> list[Sample]:
    return [s for s in samples if lo <= s.step <= hi]


def median_of(samples: list[Sample], what: str) -> list[float]:
    """Per rank, the median of `what` over `samples`."""
    per_rank = zip(*(getattr(s, what) for s in samples))
    return [statistics.median(v) for v in per_rank]


def summarize(r: Soak, warm: int) -> dict:
    """Start (just after warm-up) against end (the last tenth before the final step), per rank."""
    span = max(r.steps // 10, 20)
    start = window(r.samples, warm, warm + span)
    end = window(r.samples, r.steps - span, r.steps - 1)
    if r.exit_code or not start or not end:
        return {"engine": r.engine, "error": f"exit {r.exit_code}, {len(r.samples)} samples"}
    s = {k: median_of(start, k) for k in ("rss", "fds", "threads", "shm_maps")}
    e = {k: median_of(end, k) for k in ("rss", "fds", "threads", "shm_maps")}
    growth = [(b - a) / a for a, b in zip(s["rss"], e["rss"])]
    checks = {
        "rss": max(growth) <= MAX_RSS_GROWTH,
        "fds": all(b <= a for a, b in zip(s["fds"], e["fds"])),
        "shm_maps": all(b <= a for a, b in zip(s["shm_maps"], e["shm_maps"])),
        "shm_left": not r.shm_left,
    }
    return {
        "engine": r.engine,
        "start": s,
        "end": e,
        "rss_growth": growth,
        "checks": checks,
        "ok": all(checks.values()),
        "between": [between(r, q) for q in (0.25, 0.5, 0.75)],
        "samples": len(r.samples),
        "seconds": r.seconds,
    }


def between(r: Soak, q: float) -> tuple[int, list[float]]:
    """The RSS (MiB per rank) of the sample nearest to fraction q of the run."""
    target = int(r.steps * q)
    s = min(r.samples, key=lambda x: abs(x.step - target))
    return s.step, [v / 2**20 for v in s.rss]


def ensure_data(path: Path) -> Path:
    if not (path / "manifest.json").is_file():
        from data import prepare

        print(f"preparing a small corpus into {path} (once)", flush=True)
        prepare("pystdlib", path, vocab_size=512, max_docs=1000, num_proc=1, val_fraction=0.05)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Soak: RSS, open files and /dev/shm over a long run.")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--engines", default="zero2,fsdp2", help=f"of {', '.join(ENGINES)}")
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    p.add_argument("--data", type=Path, default=REPO / "data_cache" / "soak-pystdlib")
    p.add_argument("--runs", type=Path, default=REPO / "runs" / "soak")
    p.add_argument("--results", type=Path, help="raw JSON (default: the committed results)")
    a = p.parse_args(argv)
    engines = a.engines.split(",")
    if unknown := [e for e in engines if e not in ENGINES]:
        p.error(f"--engines: unknown {', '.join(unknown)}; known: {', '.join(ENGINES)}")
    ensure_data(a.data)
    a.runs.mkdir(parents=True, exist_ok=True)
    # Warm-up: past the third save (the first deletion) and the second evaluation.
    warm = max(3 * a.save_every, 2 * a.eval_every) + 10
    if warm + max(a.steps // 10, 20) >= a.steps - max(a.steps // 10, 20):
        p.error(f"--steps {a.steps} is too short for a warm-up of {warm} steps")
    rows = []
    for engine in engines:
        r = soak(engine, a, a.runs)
        row = summarize(r, warm)
        row["shm_left"] = r.shm_left
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)
    save(rows, a, warm)
    return 0 if all(r.get("ok") for r in rows) else 1


def save(rows: list[dict], a, warm: int) -> None:
    """The raw rows, then docs/reliability.md's table drawn from them (the committed results
    only: a --results elsewhere leaves the docs alone)."""
    from benchmarks.host import host_class
    from benchmarks.provenance import code_record, today
    from benchmarks.reliability_tables import soak_table

    raw = a.results or REPO / "benchmarks" / "results" / "soak.json"
    args = {k: getattr(a, k) for k in ("steps", "save_every", "eval_every", "ranks", "engines")}
    doc = {"date": today(), "host": host_class(), "code": code_record(), "args": args}
    raw.write_text(json.dumps({**doc, "warm": warm, "rows": rows}, indent=1, default=str))
    print(soak_table(rows, a, warm, f"{doc['host']}, {doc['date']}"))
    if not a.results:
        from benchmarks import docs_tables

        docs_tables.write(names=["soak"])


if __name__ == "__main__":
    sys.exit(main())
