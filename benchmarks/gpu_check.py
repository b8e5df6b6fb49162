"""The GPU check: every way to train, on one GPU, in a few minutes, with one row of results each.

    bash benchmarks/gpu_check.sh                  # on the GPU machine, .whl/ carried (docs/gpu.md)
    python -m benchmarks.gpu_check --out DIR      # the same, the wheels already importable
    python -m benchmarks.gpu_check --tiny --rows zero2 --out DIR    # a CPU-sized dry run

Prepares pystdlib, then runs the rows of `plan` in order: the quickstart job, its export
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
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WARMUP_STEPS = 3  # steps left out of tokens/s and MFU (allocation, kernel selection)
# The engines measured at the large preset: row name -> the trainer's engine flags.
ENGINES = {
    "zero2": ["--ds-config", "ds_configs/zero2.json"],
    "zero3": ["--ds-config", "ds_configs/zero3.json"],
    "ddp": ["--backend", "ddp"],
    "fsdp": ["--backend", "fsdp"],
    "zero2_offload": ["--ds-config", "ds_configs/zero2_offload.json"],
    "zero3_offload": ["--ds-config", "ds_configs/zero3_offload.json"],
    "zero1": ["--ds-config", "ds_configs/zero1.json"],
    "zero0": ["--ds-config", "ds_configs/zero0.json"],
}
# Seconds each row may take at most; the offload rows build DeepSpeed's CPU Adam on first use.
BUDGETS = {"prepare": 90, "quickstart": 120, "export": 60, "lora": 75, "async_save": 150}
BUDGETS |= {"evaluate": 60, "zero2_offload": 90, "zero3_offload": 75}
ENGINE_BUDGET = 45
DEADLINE_S = 480  # the whole check: one 10-minute command, with room for the install


@dataclass
class Command:
    """One process of a row: `train` is training/train.py under torchrun on one device,
    `module` is `python -m MODULE ARGS`."""

    kind: str
    args: list[str]
    module: str = ""

    def argv(self) -> list[str]:
        if self.kind == "train":
            launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1"]
            return [*launch, "--master_port", str(_port()), "training/train.py", *self.args]
        return [sys.executable, "-m", self.module, *self.args]


@dataclass
class Row:
    """A row of the check: what it shows, its processes, then an optional check of what they
    wrote (`check`: "logits" or "async"); `figures` names the run folder whose metrics.jsonl
    gives tokens/s, MFU and peak memory; `after` a row it needs; `needs` a module it imports."""

    name: str
    what: str
    budget_s: int
    commands: list[Command]
    figures: str = ""
    check: str = ""
    after: str = ""
    needs: str = ""
    paths: dict = field(default_factory=dict)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------ the plan
def sizes(a) -> dict:
    """The job's sizes: the GPU's (350M, seq 1024) or --tiny's (CPU-sized, for a dry run)."""
    if a.tiny:
        return {"large": "tiny", "small": "tiny", "seq": 64, "micro": 2, "steps": 2}
    return {"large": a.model, "small": "small", "seq": a.seq_len, "micro": a.micro_batch}


def train_flags(a, model: str, out: Path, seq: int, micro: int, steps: int) -> list[str]:
    """The flags every training row shares: a short job, logged every step, no saves."""
    return [
        *("--data", str(a.work / "data"), "--model", model, "--out", str(out)),
        *("--seq-len", str(seq), "--micro-batch", str(micro), "--steps", str(steps)),
        *("--warmup", "2", "--log-every", "1", "--eval-every", "0", "--eval-samples", "4"),
        *("--save-every", "-1", "--resume", "never", "--precision", a.precision),
    ]


def plan(a) -> list[Row]:
    """The check's rows in the order they run (most wanted first, as the deadline may cut the
    last): the commands, their budgets and what each row shows."""
    z, runs = sizes(a), a.work / "runs"
    steps = z.get("steps", a.steps)
    data = ["--source", "pystdlib", "--out", str(a.work / "data"), "--quiet"]
    data += ["--vocab-size", str(512 if a.tiny else 8192), "--max-docs", str(a.max_docs)]
    data += ["--num-proc", str(1 if a.tiny else 8)]
    rows = [
        Row(
            "prepare",
            "pystdlib prepared",
            BUDGETS["prepare"],
            [Command("module", data, "data.prepare")],
        )
    ]
    quick = runs / "quickstart"
    quick_args = ["--config", "examples/quickstart.yaml", "--data", str(a.work / "data")]
    quick_args += ["--out", str(quick), "--steps", str(2 if a.tiny else 50), "--resume", "never"]
    if a.tiny:
        quick_args += ["--model", "tiny", "--seq-len", "64", "--save-every", "0"]
    rows.append(
        Row(
            "quickstart",
            f"examples/quickstart.yaml ({z['small']}, ZeRO-2), 1 device",
            BUDGETS["quickstart"],
            [Command("train", quick_args)],
            figures=str(quick),
        )
    )
    hf = quick / "hf"
    export = Command("module", [str(quick), "--out", str(hf), "--overwrite"], "training.export")
    rows.append(
        Row(
            "export",
            "quickstart exported, reloaded by stock transformers: logits against ours on the device",
            BUDGETS["export"],
            [export],
            check="logits",
            after="quickstart",
            paths={"hf": str(hf)},
        )
    )
    for name in ("zero2", "zero3"):
        rows.append(engine_row(a, name, z, steps, runs))
    rows.append(async_row(a, z, runs))
    lora = runs / "lora"
    lora_args = train_flags(a, str(hf), lora, z["seq"], z["micro"], steps) + ["--lora", "default"]
    lora_args[lora_args.index("--save-every") + 1] = "0"  # its export needs the last step saved
    lora_export = Command("module", [str(lora), "--out", str(lora / "hf")], "training.export")
    rows.append(
        Row(
            "lora",
            "LoRA (default) on the export, ZeRO-2, then its merged export",
            BUDGETS["lora"],
            [Command("train", lora_args), lora_export],
            figures=str(lora),
            after="export",
        )
    )
    for name in ("ddp", "fsdp", "zero2_offload", "zero3_offload", "zero1", "zero0"):
        rows.append(engine_row(a, name, z, steps, runs))
    scored = ["--data", str(a.work / "data"), "--limit", "20", "--out", str(runs / "eval.json")]
    rows.append(
        Row(
            "evaluate",
            "training.evaluate: the shipped offline tasks on the export",
            BUDGETS["evaluate"],
            [Command("module", [str(hf), *scored], "training.evaluate")],
            after="export",
            needs="lm_eval",
        )
    )
    return [r for r in rows if not a.rows or r.name in a.rows or r.name == "prepare"]


def engine_row(a, name: str, z: dict, steps: int, runs: Path) -> Row:
    out = runs / name
    args = [*train_flags(a, z["large"], out, z["seq"], z["micro"], steps), *ENGINES[name]]
    what = f"{z['large']}, {name}, seq {z['seq']}, micro-batch {z['micro']}, {steps} steps"
    return Row(
        name, what, BUDGETS.get(name, ENGINE_BUDGET), [Command("train", args)], figures=str(out)
    )


def async_row(a, z: dict, runs: Path) -> Row:
    """A synchronous run, then the same run with background saves stopped after the first
    save and resumed: the check compares their losses step by step and their checkpoints'
    files."""
    steps, every = (4, 2) if a.tiny else (8, 4)
    sync, bg = runs / "async_sync", runs / "async_bg"

    def flags(out: Path) -> list[str]:
        args = train_flags(a, z["small"], out, z["seq"], z["micro"], steps)
        args[args.index("--save-every") + 1] = str(every)
        return [*args, "--keep-last", "0"]

    commands = [
        Command("train", flags(sync)),
        Command("train", [*flags(bg), "--async-save", "--stop-at", str(every)]),
        Command("train", [*flags(bg), "--async-save", "--resume", "auto"]),
    ]
    what = f"--async-save stopped at step {every} and resumed, against synchronous saves ({z['small']}, ZeRO-2)"
    paths = {"sync": str(sync), "bg": str(bg), "step": every}
    return Row(
        "async_save",
        what,
        BUDGETS["async_save"],
        commands,
        figures=str(bg),
        check="async",
        paths=paths,
    )


# ------------------------------------------------------------------------------ running
def run_command(cmd: Command, timeout: float, log) -> str:
    """Run one process with its output appended to `log`; "" when it succeeded, else the one
    line that says why (the trainer's `error: ` line, else the last line of its output)."""
    argv = cmd.argv()
    log.write(f"$ {' '.join(argv)}\n")
    log.flush()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # its own process group: a timeout ends torchrun's ranks too, freeing the GPU for the next row
    p = subprocess.Popen(
        argv,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = p.communicate(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        log.write(out)
        return f"timed out after {timeout:.0f} s"
    log.write(out)
    return "" if p.returncode == 0 else failure_line(out, p.returncode)


def failure_line(output: str, code: int) -> str:
    """The line of a failed process that says why, shortened to fit a table."""
    lines = [x.strip() for x in output.splitlines() if x.strip()]
    said = [x for x in lines if x.startswith("error: ")]
    raised = [x for x in lines if x.split(":")[0].endswith(("Error", "Exception"))]
    line = (said or raised or lines or [f"exit {code}"])[-1]
    return f"{line[:300]} (exit {code})"


def run_row(row: Row, a, deadline: float, done: dict) -> dict:
    """Run a row within its budget and the check's deadline; its result, never an exception."""
    result = {"name": row.name, "what": row.what, "budget_s": row.budget_s}
    why_not = skip_reason(row, deadline, done)
    if why_not:
        return {**result, "status": "skipped", "reason": why_not}
    t = time.monotonic()
    for path in (row.figures, *[v for k, v in row.paths.items() if k in ("sync", "bg")]):
        if path:
            shutil.rmtree(path, ignore_errors=True)  # a rerun starts afresh, never resumes
    (a.out / "logs").mkdir(parents=True, exist_ok=True)
    reason, detail = "", {}
    with open(a.out / "logs" / f"{row.name}.log", "w") as log:
        for cmd in row.commands:
            spent = time.monotonic() - t
            left = min(row.budget_s * a.slack - spent, deadline - time.monotonic())
            reason = run_command(cmd, left, log)
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
    return {
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
    """The background-save run, resumed, against the synchronous one: the loss of every step
    (bitwise, else within a relative 1e-3: a GPU kernel may sum in another order) and the files
    of the checkpoint both saved before the resume."""
    sync, bg = (losses(Path(row.paths[k])) for k in ("sync", "bg"))
    if sorted(sync) != sorted(bg):
        return {"failed": f"steps differ: synchronous {sorted(sync)}, background {sorted(bg)}"}
    diffs = {s: abs(sync[s] - bg[s]) / max(abs(sync[s]), 1e-9) for s in sync}
    worst = max(diffs.values(), default=0.0)
    detail = {"steps": len(sync), "bitwise": worst == 0.0, "max_rel_loss_diff": worst}
    files = [checkpoint_files(Path(row.paths[k]), row.paths["step"]) for k in ("sync", "bg")]
    detail["checkpoint_files_equal"] = files[0] == files[1]
    if worst > 1e-3:
        detail["failed"] = f"losses differ by up to {worst:.2e} (relative) from the synchronous run"
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


CHECKS = {"logits": check_logits, "async": check_async}


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
    for row in rows:
        print(f"gpu_check: {row.name} (budget {row.budget_s} s) ...", flush=True)
        result = run_row(row, a, deadline, done)
        done[row.name] = result["status"]
        doc["rows"].append(result)
        doc["wall_s"] = round(time.monotonic() - start, 1)
        print(
            f"gpu_check: {row.name} {result['status']} {result.get('wall_s', '')} s {result.get('reason', '')}",
            flush=True,
        )
        (a.out / "gpu_check.json").write_text(json.dumps(doc, indent=1))
        (a.out / "gpu_check.md").write_text(render(doc))
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
    p.add_argument("--steps", type=int, default=10)
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
