"""The GPU check: every way to train, on one GPU, in a few minutes, with one row of results each.

    bash benchmarks/gpu_check.sh                  # on the GPU machine, .whl/ carried (docs/gpu.md)
    python -m benchmarks.gpu_check --out DIR      # the same, the wheels already importable
    python -m benchmarks.gpu_check --tiny --rows zero2 --out DIR    # a CPU-sized dry run

Prepares pystdlib, then runs the rows of gpu_plan.plan in order: the quickstart job, its export
reloaded by stock transformers (logits compared with our model's on the device), each ZeRO
stage, the offload configs, DDP and FSDP2 at 350M in bf16, LoRA on the export, a background
save resumed and compared step by step with a synchronous run, and lm-eval on the export when
it is installed. Each row has a time budget and the whole check a deadline (--budget): a row
that fails or runs out of time is recorded with its one-line reason and the next one runs.
Writes DIR/gpu_check.json, DIR/gpu_check.md and DIR/logs/ROW.log; the runs themselves go to
--work (outside DIR: checkpoints of 350M would not come back)."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.gpu_plan import DEADLINE_S, REPO, Command, Row, plan
from launch.supervise import run_marked

WARMUP_STEPS = 3  # steps left out of tokens/s and MFU (allocation, kernel selection)


# ------------------------------------------------------------------------------ running
def run_command(cmd: Command, timeout: float, log) -> str:
    """Run one process with its output appended to `log`; "" when it succeeded, else the one
    line that says why (the trainer's `error: ` line, else the last line of its output)."""
    argv = cmd.argv()
    log.write(f"$ {' '.join(argv)}\n")
    log.flush()
    # a row's ranks that outlived a timeout would hold the GPU: killed with it (supervise.py)
    p, timed_out = run_marked(argv, cwd=REPO, timeout=timeout, merge_stderr=True)
    log.write(p.stdout)
    if timed_out:
        return f"timed out after {timeout:.0f} s"
    return "" if p.returncode == 0 else failure_line(p.stdout, p.returncode)


def failure_line(output: str, code: int) -> str:
    """The line of a failed process that says why, shortened to fit a table."""
    lines = [x.strip() for x in output.splitlines() if x.strip()]
    said = [x for x in lines if x.startswith("error: ")]
    raised = [x for x in lines if x.split(":")[0].endswith(("Error", "Exception"))]
    line = (said or raised or lines or [f"exit {code}"])[-1]
    return f"{line[:300]} (exit {code})"


def start_op_builds(rows: list[Row], out: Path) -> subprocess.Popen | None:
    """Build the DeepSpeed ops the rows load in one background process from the check's start
    (its output in logs/ops_build.log); a row that needs them waits for it (wait_for_ops)."""
    names = sorted({r.ops for r in rows if r.ops})
    if not names:
        return None
    (out / "logs").mkdir(parents=True, exist_ok=True)
    log = open(out / "logs" / "ops_build.log", "w")
    argv = [sys.executable, str(REPO / "tests" / "scripts" / "build_ops.py"), *names]
    return subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


def wait_for_ops(build: subprocess.Popen | None, deadline: float) -> dict:
    """The seconds a row waited for the background build (on the check's deadline at most)."""
    if build is None:
        return {}
    t = time.monotonic()
    try:
        build.wait(timeout=max(1.0, deadline - t))
    except subprocess.TimeoutExpired:
        pass
    return {"ops_wait_s": round(time.monotonic() - t, 1), "ops_build_exit": build.poll()}


def run_row(row: Row, a, deadline: float, done: dict, build=None) -> dict:
    """Run a row within its budget and the check's deadline; its result, never an exception."""
    result = {"name": row.name, "what": row.what, "budget_s": row.budget_s}
    why_not = skip_reason(row, deadline, done)
    if why_not:
        return {**result, "status": "skipped", "reason": why_not}
    if row.ops:  # the wait is not the row's: its budget starts once the op is built
        result |= wait_for_ops(build, deadline)
    t = time.monotonic()
    for path in (row.figures, *[v for k, v in row.paths.items() if k in ("sync", "bg")]):
        if path:
            shutil.rmtree(path, ignore_errors=True)  # a rerun starts afresh, never resumes
    (a.out / "logs").mkdir(parents=True, exist_ok=True)
    reason, detail = "", {}
    with open(a.out / "logs" / f"{row.name}.log", "w") as log:
        for cmd in row.commands:
            own = row.budget_s * a.slack - (time.monotonic() - t)
            check_left = deadline - time.monotonic()
            reason = run_command(cmd, min(own, check_left), log)
            if reason.startswith("timed out") and check_left < own:
                reason += " (the check's deadline)"
            if reason:
                break
    try:
        if not reason and row.check:
            detail = CHECKS[row.check](row, deadline - time.monotonic())
            reason = detail.pop("failed", "")
        if row.figures and Path(row.figures, "metrics.jsonl").is_file():
            detail |= run_figures(Path(row.figures))
    except Exception as e:  # a check that cannot read what a row wrote fails that row alone
        reason = reason or f"{type(e).__name__}: {e}"
    status = "failed" if reason else "ok"
    wall = time.monotonic() - t
    return {**result, "status": status, "reason": reason, "wall_s": round(wall, 1), **detail}


def skip_reason(row: Row, deadline: float, done: dict) -> str:
    after = row.after or ("prepare" if row.name != "prepare" else "")
    if after and done.get(after, "ok") != "ok":  # a row left out by --rows is not waited for
        return f"needs the {after} row, which did not succeed"
    if row.needs and importlib.util.find_spec(row.needs) is None:
        from benchmarks.gpu_wheels import LEFT_OUT

        return f"{row.needs} is not installed: {LEFT_OUT.get(row.needs, 'not carried')}"
    if deadline - time.monotonic() < 15:
        return "the check's deadline came first"
    return ""


def run_figures(run_dir: Path) -> dict:
    """tokens/s and MFU (medians after the warm-up steps) and peak memory of a run folder."""
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    train = [r for r in records if r.get("kind") == "train"]
    if not train:
        return {}
    timed = train[WARMUP_STEPS:] or train
    record = run_dir / "resolved_config.json"
    # which attention kernel ran (for SDPA, which of flash / efficient / cuDNN / math)
    attention = json.loads(record.read_text()).get("attention") if record.is_file() else None
    return {
        "attention": attention,
        "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in timed), 1),
        "mfu": round(statistics.median(r["mfu"] for r in timed), 4),
        "peak_mem_gb": round(max(r["peak_mem_gb"] for r in train), 2),
        "final_loss": round(train[-1]["loss"], 4),
    }


# ------------------------------------------------------------------------------ the checks
def check_logits(row: Row, left: float) -> dict:
    """The export read by stock transformers and by our model on the device, compared."""
    p = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_logits", row.paths["hf"]],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=max(10.0, left),
    )
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if not lines:
        return {"failed": failure_line(p.stdout + p.stderr, p.returncode)}
    got = json.loads(lines[-1])
    if not got["ok"]:
        got["failed"] = (
            f"fp32 logits differ by {got['max_diff_fp32']:.3g} (tolerance {got['tol_fp32']:.3g})"
        )
    return {"logits": got}


def check_async(row: Row, left: float) -> dict:
    """The background-save run, resumed, against the synchronous one: the losses up to the
    first step after the resume (bitwise, else within a relative 1e-3: a GPU kernel may sum in
    another order), and the files of the checkpoint both saved before the resume. Later steps
    are reported, not judged: on an H200 two runs of the same code had gradient norms apart
    from step 2, and by step 6 losses 1.1e-3 apart, resumed or not."""
    sync, bg = (losses(Path(row.paths[k])) for k in ("sync", "bg"))
    if sorted(sync) != sorted(bg):
        return {"failed": f"steps differ: synchronous {sorted(sync)}, background {sorted(bg)}"}
    diffs = {s: abs(sync[s] - bg[s]) / max(abs(sync[s]), 1e-9) for s in sync}
    judged = [d for s, d in diffs.items() if s <= row.paths["step"] + 1]
    worst = max(judged, default=0.0)
    detail = {"steps": len(sync), "judged_steps": len(judged), "max_rel_loss_diff": worst}
    detail["bitwise"] = max(diffs.values(), default=0.0) == 0.0
    detail["max_rel_loss_diff_later"] = max(diffs.values(), default=0.0)
    files = [checkpoint_files(Path(row.paths[k]), row.paths["step"]) for k in ("sync", "bg")]
    detail["checkpoint_files_equal"] = files[0] == files[1]
    if worst > 1e-3:
        detail["failed"] = (
            f"losses through the first step after the resume differ by up to {worst:.2e} "
            "(relative) from the synchronous run"
        )
    elif not files[0] or files[0] != files[1]:
        detail["failed"] = (
            f"step {row.paths['step']}'s checkpoint files differ: {files[0]} against {files[1]}"
        )
    return detail


def losses(run_dir: Path) -> dict[int, float]:
    """{step: loss} of a run folder's train records (a resumed run's last word on each step)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line) if line else {}
        if r.get("kind") == "train":
            out[r["step"]] = r["loss"]
    return out


def checkpoint_files(run_dir: Path, step: int) -> list[str]:
    """The file names (not their bytes: timestamps differ) of step's checkpoint."""
    found = sorted((run_dir / "checkpoints").glob(f"step_*{step}"))
    folder = next((f for f in found if int(f.name.split("_")[-1]) == step), None)
    if folder is None:
        return []
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def check_profile(row: Row, left: float) -> dict:
    """The profiler's summary and op table, copied beside the logs; on a GPU the op table must
    hold the device's own times (the CUDA activity was recorded)."""
    prof = Path(row.paths["run"]) / "profile"
    if not (prof / "summary.json").is_file():
        return {"failed": "the profiler wrote no summary.json"}
    logs = Path(row.paths["logs"])
    logs.mkdir(parents=True, exist_ok=True)
    for name in ("summary.md", "ops_rank0.txt"):
        shutil.copyfile(prof / name, logs / f"profile_{name}")
    summary = json.loads((prof / "summary.json").read_text())
    first, last = summary["steps"]
    rank0 = summary["per_rank"][0]
    shares = {k: round(v / rank0["wall_s"], 3) for k, v in list(rank0["seconds"].items())[:4]}
    detail = {"profile": {"step_s": round(rank0["wall_s"] / (last - first + 1), 4)} | shares}
    if row.paths["gpu"] and "CUDA" not in (prof / "ops_rank0.txt").read_text():
        detail["failed"] = "the op table has no CUDA times: the profiler did not record the device"
    return detail


CHECKS = {"logits": check_logits, "async": check_async, "profile": check_profile}


# ------------------------------------------------------------------------------ the whole check
PROBE = """import json, os, platform, torch
gpu = torch.cuda.is_available()
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
  "device": torch.cuda.get_device_name(0) if gpu else "cpu: " + (platform.processor() or platform.machine()),
  "gpus": torch.cuda.device_count() if gpu else 0, "cpus": os.cpu_count(),
  "python": platform.python_version()}))"""


def environment() -> dict:
    """The device and the versions the rows ran on (torch asked in a child: the driver keeps
    no CUDA context of its own on the GPU it measures)."""
    p = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    env = (
        json.loads(p.stdout)
        if p.returncode == 0
        else {"probe_error": failure_line(p.stderr, p.returncode)}
    )
    for name in ("deepspeed", "transformers", "peft", "pydantic", "lm_eval"):
        try:
            env[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            env[name] = None
    return env


def run_check(a) -> dict:
    """Every row of the plan, in order, each recorded as it finishes: the JSON and the table
    are rewritten after each row, so a check cut short still leaves what it found."""
    from benchmarks.gpu_report import render

    start, a.out = time.monotonic(), Path(a.out)
    deadline = start + a.budget
    a.out.mkdir(parents=True, exist_ok=True)
    rows = plan(a)
    doc = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(["python -m benchmarks.gpu_check", *a.argv]),
        "environment": environment(),
        "budget_s": a.budget,
        "plan": [{"name": r.name, "budget_s": r.budget_s} for r in rows],
        "rows": [],
    }
    print(
        f"gpu_check: {doc['environment'].get('device')}, {len(rows)} rows, {a.budget} s", flush=True
    )
    done: dict[str, str] = {}
    build = start_op_builds(rows, a.out)
    for row in rows:
        print(f"gpu_check: {row.name} (budget {row.budget_s} s) ...", flush=True)
        result = run_row(row, a, deadline, done, build)
        done[row.name] = result["status"]
        doc["rows"].append(result)
        doc["wall_s"] = round(time.monotonic() - start, 1)
        print(
            f"gpu_check: {row.name} {result['status']} {result.get('wall_s', '')} s {result.get('reason', '')}",
            flush=True,
        )
        (a.out / "gpu_check.json").write_text(json.dumps(doc, indent=1))
        (a.out / "gpu_check.md").write_text(render(doc))
    if build is not None and build.poll() is None:
        build.kill()
    return doc


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--out",
        default=os.environ.get("OUT") or "gpu_check_out",
        help="results folder (default: $OUT, else gpu_check_out)",
    )
    p.add_argument(
        "--work",
        default=str(Path(tempfile.gettempdir()) / "zerostack_gpu_check"),
        help="data and run folders (large; not copied back)",
    )
    p.add_argument(
        "--rows", default="", help="comma-separated row names (default: all; prepare always runs)"
    )
    p.add_argument("--budget", type=int, default=DEADLINE_S, help="seconds for the whole check")
    p.add_argument("--model", default="350M", help="the engines' preset")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument(
        "--steps", type=int, default=30, help="engine rows' steps (10 left tokens/s 20%% apart)"
    )
    p.add_argument("--precision", default="bf16", help="the trainer's --precision")
    p.add_argument("--max-docs", type=int, default=4000, help="pystdlib documents prepared")
    p.add_argument("--tiny", action="store_true", help="CPU-sized: tiny preset, 2 steps, seq 64")
    p.add_argument(
        "--slack", type=float, default=1.0, help="every row's budget times this (a slow host)"
    )
    return p


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else argv
    a = parser().parse_args(argv)
    a.argv, a.rows = argv, [r for r in a.rows.split(",") if r]
    a.work, a.out = Path(a.work), Path(a.out)
    if a.tiny:
        a.precision, a.max_docs = "auto", min(a.max_docs, 300)
    return a


def main(argv: list[str] | None = None) -> int:
    doc = run_check(parse(argv))
    failed = [r["name"] for r in doc["rows"] if r["status"] == "failed"]
    print(
        f"gpu_check: done in {doc['wall_s']} s; failed: {', '.join(failed) or 'none'}", flush=True
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
