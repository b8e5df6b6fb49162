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
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.host import host_class
from benchmarks.provenance import today
from launch.launcher_argv import launcher_command
from training.engines.spike_guard import SpikeGuard
from training.runtime.distributed import free_port

REPO = Path(__file__).resolve().parent.parent
RUNS = {  # what is trained: the shipped presets on the built-in corpus, ZeRO-2 (the default)
    "tiny": ["--model", "tiny", "--seq-len", "64", "--micro-batch", "2", "--lr", "3e-3"],
    "quickstart": ["--config", "examples/quickstart.yaml"],
}
SIGMAS = (3.0, 4.0, 5.0, 6.0, 8.0)
WINDOW = 128
DEFAULT_SIGMAS = 8.0  # --spike-sigmas's default, what the live runs judge by


def train(data: Path, out: Path, args: list[str], ranks: int = 2) -> list[dict]:
    """One real run; returns its metrics records."""
    program = ["training/train.py", "--data", str(data), "--out", str(out), *args]
    cmd = launcher_command("torchrun", ranks, program, port=free_port(), python=sys.executable)
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def replay(rows, sigmas: float, window: int = WINDOW, log_norm: bool = True) -> list[int]:
    """The steps the guard flags in a logged trajectory of (step, loss, grad_norm) (exact
    while nothing was skipped); `log_norm` False: OLMo-core's linear rule for the norm."""
    guard = SpikeGuard(sigmas, window, window // 2, torch.device("cpu"), log_norm=log_norm)
    flagged = []
    for step, loss, norm in rows:
        guard.begin(torch.tensor(loss))
        guard.gate(torch.tensor(norm))
        if bool(guard.spiked):
            flagged.append(step)
        guard.commit()
    return flagged


def false_positives(name: str, data: Path, steps: int, root: Path) -> dict:
    extra = ["--steps", str(steps), "--log-every", "1", "--eval-every", "0", "--save-every", "-1"]
    records = train(data, root / name, [*RUNS[name], *extra])
    spiked = {r["step"]: r for r in records if r["kind"] == "spike"}
    spikes = sorted(spiked)
    # a skipped step's train row has no norm (DeepSpeed reports none): its spike record has both
    rows = [
        {**r, **{k: spiked[r["step"]][k] for k in ("loss", "grad_norm")}}
        if r["step"] in spiked
        else r
        for r in records
        if r["kind"] == "train"
    ]
    trajectory = [[r["step"], r["loss"], r["grad_norm"]] for r in rows]
    return {
        "run": name,
        "args": [*RUNS[name], *extra],
        "steps": len(rows),
        "judged": max(0, len(rows) - WINDOW // 2),
        "spikes_at_default": spikes,
        **replays(trajectory),
        "trajectory": trajectory,
    }


def replays(trajectory) -> dict:
    """The steps each threshold flags, the norm in log space (ours) and linear (OLMo-core's)."""
    return {
        "replayed_log_norm": {str(s): replay(trajectory, s) for s in SIGMAS},
        "replayed_linear_norm": {str(s): replay(trajectory, s, log_norm=False) for s in SIGMAS},
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
    p.add_argument("--replay", action="store_true", help="only redo the replays of --out")
    p.add_argument("--cost-only", action="store_true", help="keep --out's false positives")
    a = p.parse_args(argv)
    if a.replay:  # a pure function of the recorded trajectories
        result = json.loads(a.out.read_text())
        for r in result["false_positives"]:
            r.pop("replayed", None)  # an older version's, of the log rule only
            r.update(judged=max(0, r["steps"] - WINDOW // 2), **replays(r["trajectory"]))
        a.out.write_text(json.dumps(result, indent=1))
        return 0
    if not (a.data / "manifest.json").is_file():
        p.error(f"--data {a.data}: prepare it first (python -m data.prepare --source pystdlib)")
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        fp = (
            json.loads(a.out.read_text())["false_positives"]
            if a.cost_only
            else [
                false_positives("tiny", a.data, a.steps, root),
                false_positives("quickstart", a.data, a.quickstart_steps, root),
            ]
        )
        spent = cost(a.data, a.rounds, a.cost_steps, root)
    result = {
        "date": today(),
        "host": host_class(),
        "torch": torch.__version__,
        "rule": {"sigmas": DEFAULT_SIGMAS, "window": WINDOW, "warmup": WINDOW // 2},
        "false_positives": fp,
        "cost": spent,
        "seconds": round(time.time() - started),
    }
    a.out.write_text(json.dumps(result, indent=1))
    for r in fp:
        print(r["run"], r["steps"], "steps; flagged", r["spikes_at_default"])
    print("guard on / off tokens/s:", [round(r["on_over_off"], 3) for r in spent["rounds"]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
