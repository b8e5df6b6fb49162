"""The spike guard's false positives and cost on clean runs. A benchmark, not a test (minutes).

    python -m benchmarks.spike_rate [--steps 600] [--rounds 3] [--out benchmarks/results/...]

False positives: real 2-rank runs of training/train.py on the built-in corpus with nothing
poisoned and the guard at its defaults, a metrics line every step: every `spike` record is a
false positive. The logged trajectory (each step's loss, the mean over ranks, and global
gradient norm: the figures the guard judges) is then replayed through the guard itself
(engines/spike_guard.py) at lower thresholds, to show the margin the default keeps.

Cost: the same short run with the guard on and off (--spike-sigmas 0), in interleaved rounds
on the same host; the ratio of their median step times within each round is what counts on a
shared host."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from launch.launcher_argv import launcher_command
from training.engines.spike_guard import SpikeGuard
from training.runtime.distributed import free_port

REPO = Path(__file__).resolve().parent.parent
RUNS = {  # what is trained: the shipped presets on the built-in corpus, ZeRO-2 (the default)
    "tiny": ["--model", "tiny", "--seq-len", "64", "--micro-batch", "2", "--lr", "3e-3"],
    "quickstart": ["--config", "examples/quickstart.yaml"],
}
SIGMAS = (3.0, 4.0, 5.0, 6.0)
WINDOW = 128


def train(data: Path, out: Path, args: list[str], ranks: int = 2) -> list[dict]:
    """One real run; returns its metrics records."""
    program = ["training/train.py", "--data", str(data), "--out", str(out), *args]
    cmd = launcher_command("torchrun", ranks, program, port=free_port(), python=sys.executable)
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def replay(rows: list[dict], sigmas: float, window: int = WINDOW) -> list[int]:
    """The steps the guard flags in a logged trajectory (valid while nothing was skipped)."""
    guard = SpikeGuard(sigmas, window, window // 2, torch.device("cpu"))
    flagged = []
    for r in rows:
        guard.begin(torch.tensor(r["loss"]))
        guard.gate(torch.tensor(r["grad_norm"]))
        if bool(guard.spiked):
            flagged.append(r["step"])
        guard.commit()
    return flagged


def false_positives(name: str, data: Path, steps: int, root: Path) -> dict:
    extra = ["--steps", str(steps), "--log-every", "1", "--eval-every", "0", "--save-every", "-1"]
    records = train(data, root / name, [*RUNS[name], *extra])
    rows = [r for r in records if r["kind"] == "train"]
    spikes = [r["step"] for r in records if r["kind"] == "spike"]
    return {
        "run": name,
        "args": [*RUNS[name], *extra],
        "steps": len(rows),
        "spikes_at_default": spikes,
        "replayed": {str(s): replay(rows, s) for s in SIGMAS} if not spikes else None,
        "trajectory": [[r["step"], r["loss"], r["grad_norm"]] for r in rows],
    }


def cost(data: Path, rounds: int, steps: int, root: Path) -> dict:
    """Median tokens/s (steps after the 5th) with the guard on and off, interleaved rounds."""
    base = [*RUNS["tiny"], "--steps", str(steps), "--log-every", "1", "--eval-every", "0"]
    base += ["--save-every", "-1", "--eval-samples", "8"]
    out = []
    for i in range(rounds):
        pair = {}
        for mode, flag in (("on", []), ("off", ["--spike-sigmas", "0"]))[:: 1 if i % 2 else -1]:
            rows = [r for r in train(data, root / f"cost{i}{mode}", [*base, *flag]) if "mfu" in r]
            tps = [r["tokens_per_s"] for r in rows[5:]]
            pair[mode] = statistics.median(tps)
        out.append({"round": i, **pair, "on_over_off": pair["on"] / pair["off"]})
    return {"rounds": out, "median_ratio": statistics.median(r["on_over_off"] for r in out)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="The spike guard's false positives and cost.")
    p.add_argument("--steps", type=int, default=600, help="steps of the tiny run")
    p.add_argument("--quickstart-steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cost-steps", type=int, default=60)
    p.add_argument("--data", type=Path, default=REPO / "data_cache" / "pystdlib")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/spike_guard.json")
    a = p.parse_args(argv)
    if not (a.data / "manifest.json").is_file():
        p.error(f"--data {a.data}: prepare it first (python -m data.prepare --source pystdlib)")
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        fp = [
            false_positives("tiny", a.data, a.steps, root),
            false_positives("quickstart", a.data, a.quickstart_steps, root),
        ]
        spent = cost(a.data, a.rounds, a.cost_steps, root)
    result = {
        "host": {"machine": platform.machine(), "processor": platform.processor()},
        "torch": torch.__version__,
        "rule": {"sigmas": 6.0, "window": WINDOW, "warmup": WINDOW // 2},
        "false_positives": fp,
        "cost": spent,
        "seconds": round(time.time() - started),
    }
    a.out.write_text(json.dumps(result, indent=1))
    for r in fp:
        print(r["run"], r["steps"], "steps; default flags", r["spikes_at_default"], r["replayed"])
    print("guard on / off tokens/s:", [round(r["on_over_off"], 3) for r in spent["rounds"]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
