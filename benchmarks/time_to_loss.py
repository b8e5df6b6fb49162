"""Wall time to a target validation loss: the trainer's recipes against the loops people run.

    python -m benchmarks.time_to_loss                       # small, target 5.6, 3 rounds
    python -m benchmarks.time_to_loss --target 5.4 --rounds 2 --max-minutes 15

Every arm trains the same model (one set of initial weights, saved once from the seed) from
scratch on the same prepared data, sequence length and global batch, on the same ranks, and is
scored every --eval-every steps on the same first --eval-samples validation windows. A run stops
when its validation loss reaches --target, or at --max-minutes (then "not reached", with its best
loss); --steps is the schedules' horizon (cosine, WSD, nanoGPT's and the Trainer's decays span
it). The arms run in interleaved rounds (round 1: every arm, round 2: every arm, ...), so a busy
spell of the host falls on every arm alike:

- zerostack: training/train.py as a user runs it: AdamW, cosine, ds_configs/zero2.json, --lr and
  --warmup left at their defaults;
- zerostack_muon: the same with --optimizer muon (Muon's default --muon-lr); "not available"
  where the trainer has no --optimizer flag;
- zerostack_wsd: the same with --schedule wsd (its default decay steps and shape);
- nanogpt: nanoGPT's loop and recipe (benchmarks/time_to_loss_peers.py), compiled;
- hf_trainer: the Hugging Face Trainer's defaults with DeepSpeed ZeRO-2 (same file).

Each run's time is from its launch (start-up included) and from its first step (without);
its tokens and steps to the target and its validation curve (step, seconds, loss) are kept.
Writes every round and each arm's medians (with min and max) and the host to
benchmarks/results/time_to_loss.json (--results); `python -m benchmarks.docs_tables` draws the
table in docs/benchmarks.md from it."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RAW = "time_to_loss.json"
ARMS = ["zerostack", "zerostack_muon", "zerostack_wsd", "nanogpt", "hf_trainer"]
TRAINER_ARMS = {
    "zerostack": [],
    "zerostack_muon": ["--optimizer", "muon"],
    "zerostack_wsd": ["--schedule", "wsd"],
}
PEERS = ("nanogpt", "hf_trainer")
# Two ranks of one thread: what the quickstart runs on a CPU host (quickstart.sh: "else 2 CPU
# ranks"), and what a 2-core user gets from `torchrun --nproc_per_node 2`.
RANKS = 2
JOB = (  # the flags of the job, kept with its results
    "model", "layers", "seq_len", "micro_batch", "grad_accum", "ranks", "steps", "target",
    "max_minutes", "rounds", "eval_every", "eval_samples", "seed", "peer_precision", "eager",
)  # fmt: skip


def muon_available() -> bool:
    """Whether the trainer has `--optimizer muon`."""
    from training.settings.run_config import OptimConfig

    field = OptimConfig.__dataclass_fields__.get("optimizer")
    return field is not None and "muon" in str(field.type)


def job_flags(a, init: str) -> list[str]:
    """The trainer's flags every arm shares: the same model, data, batch, horizon and scoring."""
    return [
        *("--data", str(a.data), "--model", init, "--seq-len", str(a.seq_len)),
        *("--micro-batch", str(a.micro_batch), "--grad-accum", str(a.grad_accum)),
        *("--steps", str(a.steps), "--seed", str(a.seed)),
        *("--eval-every", str(a.eval_every), "--eval-samples", str(a.eval_samples)),
    ]


def arm_command(arm: str, a, init: str, out: Path) -> list[str]:
    """The launch of one arm's run on a.ranks ranks, writing out/metrics.jsonl."""
    from launch.launcher_argv import launcher_command
    from training.runtime.distributed import free_port

    flags = [*job_flags(a, init), "--out", str(out)]
    if arm in TRAINER_ARMS:
        program = ["training/train.py", *flags, *TRAINER_ARMS[arm]]
        program += ["--log-every", "1", "--save-every", "-1", "--resume", "never"]
        program += ["--no-compile"] if a.eager else []
    else:
        program = ["-m", "benchmarks.time_to_loss_peers", arm, *flags]
        program += ["--precision", a.peer_precision]
        program += [] if a.eager or arm == "hf_trainer" else ["--compile"]
    return launcher_command("torchrun", a.ranks, program, port=free_port())


def read_records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(x) for x in lines if x.strip().endswith("}")]  # a line half written: later


def first_step_time(records: list[dict], tokens_per_step: int) -> float | None:
    """When the first step began: a peer's `start` record, or the trainer's first train record
    less that step's time (its tokens over its tokens/s)."""
    for r in records:
        if r.get("kind") == "start":
            return r["time"]
        if r.get("kind") == "train" and r.get("tokens_per_s"):
            return r["time"] - tokens_per_step / r["tokens_per_s"]
    return None


def stop(p: subprocess.Popen) -> None:
    """The run's whole process group: SIGTERM, then SIGKILL after 30 s."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(p.pid, sig)
            p.wait(wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def run_arm(arm: str, rnd: int, a, init: str) -> dict:
    """One run of `arm` until its validation loss reaches a.target, it ends, or a.max_minutes
    pass; returns its row (times in seconds from the launch)."""
    row = {"arm": arm, "round": rnd}
    if arm == "zerostack_muon" and not muon_available():
        return {**row, "not_available": "the trainer has no --optimizer muon"}
    out = Path(a.runs) / f"{arm}.{rnd}"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if a.eager:
        env["TORCH_COMPILE_DISABLE"] = "1"  # DeepSpeed's Muon compiles its Newton-Schulz
    started = time.time()
    with open(out / "console.log", "w") as console:
        p = subprocess.Popen(
            arm_command(arm, a, init, out),
            cwd=REPO,
            env=env,
            stdout=console,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, stopped as one
        )
        reached, deadline = None, started + a.max_minutes * 60
        while reached is None and p.poll() is None and time.time() < deadline:
            time.sleep(0.5)
            evals = [r for r in read_records(out / "metrics.jsonl") if r.get("kind") == "eval"]
            reached = next((r for r in evals if r["val_loss"] <= a.target), None)
        stop(p)
    row["run_s"] = round(time.time() - started, 2)  # stopping included
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # the trainer's save on SIGTERM
    records = read_records(out / "metrics.jsonl")
    evals = [r for r in records if r.get("kind") == "eval"]
    reached = next((r for r in evals if r["val_loss"] <= a.target), None)
    tokens_per_step = a.ranks * a.micro_batch * a.grad_accum * a.seq_len
    first = first_step_time(records, tokens_per_step)
    row["curve"] = [[r["step"], round(r["time"] - started, 2), r["val_loss"]] for r in evals]
    row["startup_s"] = None if first is None else round(first - started, 2)
    row["best_val_loss"] = min((r["val_loss"] for r in evals), default=None)
    row["reached"] = reached is not None
    if not evals and p.returncode not in (0, -signal.SIGTERM, -signal.SIGKILL):
        tail = (out / "console.log").read_text().splitlines()
        err = [x for x in tail if x.startswith("error: ")]
        row["error"] = err[0][len("error: ") :] if err else f"exit {p.returncode}"
        print("\n".join(tail[-40:]), file=sys.stderr)
    if reached:
        row["wall_to_target_s"] = round(reached["time"] - started, 2)
        row["train_to_target_s"] = round(reached["time"] - (first or started), 2)
        row["steps_to_target"] = reached["step"]
        row["tokens_to_target"] = reached["step"] * tokens_per_step
    return row


def interleaved(arms: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, arm) in run order: round 1's every arm, then round 2's, ..."""
    return [(r, arm) for r in range(1, rounds + 1) for arm in arms]


def run_rounds(a, arms: list[str], init: str, run=run_arm, after=None) -> list[dict]:
    """Every arm once a round, the rounds one after another; an arm not available is asked
    once. `after(rows)` is called after each run (the raw file is rewritten then, so a job cut
    short keeps every run it finished)."""
    rows: list[dict] = []
    for rnd, arm in interleaved(arms, a.rounds):
        if any(r["arm"] == arm and "not_available" in r for r in rows):
            continue
        print(f"round {rnd}/{a.rounds}: {arm} ...", flush=True)
        row = run(arm, rnd, a, init)
        print(f"  {_said(row)}", flush=True)
        rows.append(row)
        if after:
            after(rows)
    return rows


def _said(row: dict) -> str:
    if "not_available" in row:
        return f"not available: {row['not_available']}"
    if row.get("reached"):
        return f"reached in {row['wall_to_target_s']:.0f} s, step {row['steps_to_target']}"
    if row.get("error"):
        return f"failed: {row['error']}"
    return f"not reached (best {row.get('best_val_loss')})"


def _spread(xs: list[float]) -> dict | None:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else None


def medians(rows: list[dict], arms: list[str]) -> dict[str, dict]:
    """Per arm: how many rounds reached the target, and the median (min, max) over those
    rounds of the wall time with and without start-up, tokens and steps to it."""
    out = {}
    for arm in arms:
        mine = [r for r in rows if r["arm"] == arm]
        if mine and "not_available" in mine[0]:
            out[arm] = {"not_available": mine[0]["not_available"]}
            continue
        hit = [r for r in mine if r.get("reached")]
        best = [r["best_val_loss"] for r in mine if r.get("best_val_loss") is not None]
        out[arm] = {"rounds": len(mine), "reached": len(hit)}
        out[arm]["best_val_loss"] = min(best) if best else None
        failed = [r["error"] for r in mine if r.get("error")]
        if failed:
            out[arm]["error"] = failed[0]
        for key in ("wall_to_target_s", "train_to_target_s", "tokens_to_target", "steps_to_target"):
            out[arm][key] = _spread([r[key] for r in hit])
        out[arm]["startup_s"] = _spread([r["startup_s"] for r in mine if r.get("startup_s")])
    return out


def ratios(summary: dict[str, dict]) -> dict[str, dict[str, float | None]]:
    """Each zerostack arm's median wall time to the target over nanoGPT's and the Trainer's
    (below 1: faster); None where either did not reach it."""

    def wall(arm):
        return ((summary.get(arm) or {}).get("wall_to_target_s") or {}).get("median")

    out = {}
    for arm in TRAINER_ARMS:
        if arm in summary and wall(arm):
            out[arm] = {peer: (wall(arm) / wall(peer) if wall(peer) else None) for peer in PEERS}
    return out


def host() -> dict:
    """The host class (CPU model, ATen's vector level, bf16 units), cores, load, torch."""
    import torch

    from benchmarks.provenance import host_record
    from training.runtime.flops import cpu_name

    return {
        **host_record(),
        "cpu": cpu_name(),
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),
    }


def save(rows: list[dict], a, arms: list[str], path: Path, host_info: dict) -> dict:
    """The raw rounds, each arm's medians and the ratios as JSON at `path`; returns them."""
    from benchmarks.provenance import code_record

    summary = medians(rows, arms)
    doc = {
        "command": " ".join(["python -m benchmarks.time_to_loss", *a.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": host_info,
        "code": code_record(),
        "data": Path(a.data).name,
        "job": {k: getattr(a, k) for k in JOB},
        "tokens_per_step": a.ranks * a.micro_batch * a.grad_accum * a.seq_len,
        "order": [[r["round"], r["arm"]] for r in rows],
        "rounds": rows,
        "summary": summary,
        "ratios": ratios(summary),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parser().parse_args(argv)
    a.argv = _worth_showing(argv)
    arms = a.arms.split(",")
    unknown = set(arms) - set(ARMS)
    if unknown:
        print(f"error: unknown arms {sorted(unknown)}; choose from {', '.join(ARMS)}")
        return 2
    if not (Path(a.data) / "manifest.json").is_file():
        from data import prepare

        print(f"preparing the built-in corpus into {a.data} (once)", flush=True)
        prepare("pystdlib", a.data, num_proc=os.cpu_count() or 1)
    Path(a.runs).mkdir(parents=True, exist_ok=True)
    from benchmarks.compare.runs import initial_weights

    init = initial_weights(a)  # one set of initial weights, loaded by every arm
    host_info = host()
    path = Path(a.results or REPO / "benchmarks" / "results" / RAW)
    rows = run_rounds(a, arms, init, after=lambda rows: save(rows, a, arms, path, host_info))
    doc = save(rows, a, arms, path, host_info)
    print(f"raw rounds: {path}")
    print(render(doc))
    print("the table in docs/benchmarks.md: python -m benchmarks.docs_tables")
    return 0


def _worth_showing(argv: list[str]) -> list[str]:
    """argv without the flags that only say where files live (for the table's command)."""
    out, skip = [], False
    for x in argv:
        if not skip and x.split("=")[0] not in ("--runs", "--results", "--data"):
            out.append(x)
        skip = not skip and x in ("--runs", "--results", "--data")
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.time_to_loss", description=__doc__.split("\n")[0]
    )
    p.add_argument("--target", type=float, default=5.6, help="the validation loss to reach")
    p.add_argument("--rounds", type=int, default=3, help="every arm once a round")
    p.add_argument("--max-minutes", type=float, default=10.0, help="a run's limit")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated: {', '.join(ARMS)}")
    p.add_argument("--data", default="data_cache/pystdlib", help="prepared data (made if absent)")
    p.add_argument("--model", default="small", help="a preset")
    p.add_argument("--layers", type=int, default=0, help="override the preset's layer count")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4, help="per rank (the quickstart's)")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--ranks", type=int, default=RANKS)
    p.add_argument("--steps", type=int, default=300, help="the schedules' horizon")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-samples", type=int, default=64, help="validation windows scored")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--peer-precision",
        choices=["fp32", "bf16"],
        default="fp32",
        help="nanoGPT's and the Trainer's precision (fp32: as each runs on a CPU by default)",
    )
    p.add_argument(
        "--eager",
        action="store_true",
        help="compile nothing (the trainer's --no-compile, nanoGPT's compile off): quick checks",
    )
    p.add_argument("--runs", default="runs/time_to_loss", help="where the runs' folders go")
    p.add_argument(
        "--results", default="", help=f"the raw JSON (default: benchmarks/results/{RAW})"
    )
    return p


# docs/benchmarks.md


def _s(spread: dict | None, fmt: str) -> str:
    if not spread:
        return ""
    lo, mid, hi = (fmt.format(spread[k]) for k in ("min", "median", "max"))
    return mid if lo == hi else f"{mid} ({lo}-{hi})"


def render(d: dict) -> str:
    """The table of a raw file: per arm the rounds that reached the target, the median (min-max)
    wall time with and without start-up, tokens and steps, and the zerostack arms' ratios."""
    j = d["job"]
    where = f"{d['host']['class'].split(';')[0].strip()}, {d['date'][:10]}"
    layers = f" with {j['layers']} layers" if j["layers"] else ""
    intro = (
        f"`{d['command']}`: `{j['model']}`{layers}"
        f" from the same initial weights, {d['tokens_per_step']:,} tokens a step on {j['ranks']} "
        f"rank(s), to validation loss {j['target']} on {j['eval_samples']} windows scored every "
        f"{j['eval_every']} steps, limit {j['max_minutes']:g} min, horizon {j['steps']} steps, "
        f"{j['rounds']} interleaved rounds; median (min-max) over the rounds that reached it."
    )
    head = ["arm", "reached", "wall to target (s)", "without start-up (s)", "tokens", "steps"]
    head += ["vs nanoGPT", "vs HF Trainer", "host, date"]
    lines = []
    for arm, s in d["summary"].items():
        r = d["ratios"].get(arm, {})
        if "not_available" in s:
            lines.append([arm, "not available", "", "", "", "", "", "", where])
            continue
        reached = f"{s['reached']}/{s['rounds']}"
        if s["reached"] < s["rounds"] and s["best_val_loss"] is not None:
            reached += f" (best {s['best_val_loss']:.3f})"
        elif s.get("error"):
            reached += f" (failed: {s['error']})"
        ratio = [f"{r[p]:.2f}x" if r.get(p) else "" for p in PEERS]
        lines.append(
            [
                arm,
                reached,
                _s(s["wall_to_target_s"], "{:,.0f}"),
                _s(s["train_to_target_s"], "{:,.0f}"),
                _s(s["tokens_to_target"], "{:,.0f}"),
                _s(s["steps_to_target"], "{:.0f}"),
                *ratio,
                where,
            ]
        )
    from benchmarks.result_tables import table

    return intro + "\n\n" + table(head, lines, {2, 3, 4, 5, 6, 7})


def section(results: Path) -> str:
    """docs/benchmarks.md's time-to-loss table from results/time_to_loss.json."""
    path = results / RAW
    if not path.is_file():
        from benchmarks.result_tables import not_yet

        return not_yet("python -m benchmarks.time_to_loss", RAW)
    return render(json.loads(path.read_text()))


if __name__ == "__main__":
    sys.exit(main())
