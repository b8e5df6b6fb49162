"""`python -m training.evaluate RUN_OR_FOLDER`: lm-evaluation-harness on a run's checkpoint or
on any HF model folder.

A run folder's latest sealed checkpoint (or `--checkpoint STEP`) is exported to a temporary
folder with the export code (verified, one fp32 copy of the weights at a time) and evaluated
there; its scores go to RUN/eval/step_N.json, to RUN/metrics.jsonl as a record of kind "tasks"
at the checkpoint's step, and to TensorBoard. A model folder is evaluated as it is. With no
`--tasks` the shipped local tasks run (local_tasks.py), offline. Every check (tasks known, a
sealed checkpoint or a loadable folder) comes before any work, each refusal one line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from data.files import scratch_folder
from training.checkpoints import layout as ckpt
from training.errors import BAD_INPUT, CheckpointError, EvalError, ExportError
from training.evaluation import harness
from training.evaluation.local_tasks import LOCAL_TASKS, HeldOut, write_local_tasks
from training.loop.logger import plot_loss_curve


@dataclass
class Target:
    """What to evaluate: a run's checkpoint (run_dir, root, tag, step) or a model folder."""

    path: Path
    run_dir: Path | None = None
    root: Path | None = None
    tag: str | None = None
    step: int | None = None
    data_dir: str | None = None


def resolve_target(path: str, checkpoint: str | None) -> Target:
    """A run folder (its latest sealed checkpoint, or `checkpoint`), a checkpoint folder, or a
    model folder; EvalError in one line when it is none of them or has no sealed checkpoint."""
    p = Path(path)
    if (p / "config.json").is_file() and checkpoint is None:
        harness.check_model_folder(p)
        return Target(p)
    if not p.exists():
        raise EvalError(f"{p}: no such run or model folder")
    if checkpoint is None and not (
        (p / "checkpoints").is_dir() or p.name == "checkpoints" or p.name.startswith("step_")
    ):
        raise EvalError(
            f"{p}: neither a run folder nor a model folder (no checkpoints/, no config.json)"
        )
    try:
        root, tag = ckpt.locate(p / checkpoint if checkpoint else p)
        ckpt.verify(root / tag)
        state = ckpt.load_trainer_state(root, tag)
    except CheckpointError as e:
        raise EvalError(str(e)) from None
    run_dir, data_dir = root.parent, state.get("data_dir")
    if not any((d / "tokenizer").is_dir() for d in (run_dir, Path(data_dir or run_dir))):
        raise EvalError(
            f"{root / tag}: no tokenizer for its export (neither {run_dir}/tokenizer nor its "
            "data folder's); the harness needs one"
        )
    return Target(root / tag, run_dir, root, tag, int(state["step"]), data_dir)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m training.evaluate",
        description="Evaluate a run's checkpoint or a model folder with lm-evaluation-harness.",
    )
    p.add_argument("path", help="RUN_DIR, RUN_DIR/checkpoints/step_N, or a model folder")
    p.add_argument(
        "--tasks",
        default=None,
        help=f"comma-separated lm-eval task names (default: {','.join(LOCAL_TASKS)})",
    )
    p.add_argument("--checkpoint", default=None, help="a run's step N (default: its latest)")
    p.add_argument(
        "--include-path",
        action="append",
        default=[],
        help="a folder of your own lm-eval task YAML (repeatable)",
    )
    p.add_argument(
        "--batch-size", default="auto", help="auto: 8 on a CPU, lm-eval's search on a GPU"
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument(
        "--data",
        default=None,
        help="a prepared data folder whose held-out pystdlib documents the shipped tasks use "
        "(default: the run's own, else the default preparation's)",
    )
    p.add_argument("--limit", type=int, default=None, help="at most N items per task")
    p.add_argument(
        "--out", default=None, help="results JSON (default for a run: RUN/eval/step_N.json)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        return _main(a)
    except (EvalError, ExportError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return BAD_INPUT


def _main(a) -> int:
    import logging

    # lm-eval warns once per item cut to the model's length: hundreds of lines, no decision.
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    names = [t.strip() for t in (a.tasks or ",".join(LOCAL_TASKS)).split(",") if t.strip()]
    if a.batch_size != "auto" and not (a.batch_size.isdigit() and int(a.batch_size) > 0):
        raise EvalError(f"--batch-size {a.batch_size}: give a positive number or auto")
    includes = [Path(d) for d in a.include_path]
    for d in includes:
        if not d.is_dir():
            raise EvalError(f"--include-path {d}: no such folder")
    if a.data and not (Path(a.data) / "manifest.json").is_file():
        raise EvalError(f"--data {a.data}: not a prepared data folder (no manifest.json)")
    target = resolve_target(a.path, a.checkpoint)
    # A run's export goes beside its checkpoints (a large model may not fit in /tmp).
    near = None
    if target.run_dir is not None:
        near = target.run_dir / "eval"
        near.mkdir(exist_ok=True)
    # named after this process, so that the next evaluation can tell a killed one's leftovers
    work = scratch_folder(near / "export") if near else Path(tempfile.mkdtemp(prefix="export-"))
    try:
        local = write_local_tasks(work / "tasks", HeldOut.of_data(a.data or target.data_dir))
        tm = harness.task_manager(names, [local, *includes])
        folder = target.path
        if target.run_dir is not None:
            from training.checkpoints.hf_export import export_report

            print(f"exporting {target.root / target.tag} for the harness ...", flush=True)
            folder = export_report(target.root / target.tag, work / "hf").folder
            harness.check_model_folder(folder)
        device, dtype, batch = harness.choose(a.device, a.dtype, a.batch_size)
        print(f"evaluating {', '.join(names)} on {device} in {dtype}, batch {batch}", flush=True)
        results = harness.evaluate(
            folder, names, tm, device=device, dtype=dtype, batch_size=batch, limit=a.limit
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(harness.table(results))
    record(target, results, a.out, dict(device=device, dtype=dtype, batch_size=batch))
    return 0


def record(target: Target, results: dict, out: str | None, setup: dict) -> Path | None:
    """Write the results JSON (and, for a run, its metrics.jsonl record and TensorBoard
    scalars); returns the JSON's path."""
    flat = harness.scores(results)
    doc = {
        "model": str(target.path),
        "step": target.step,
        "scores": flat,
        **setup,
        "harness": results,
    }
    if out is None and target.run_dir is None:
        return None
    path = Path(out) if out else target.run_dir / "eval" / f"step_{target.step}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=2, default=str))
    os.replace(tmp, path)  # whole or absent, whatever kills us
    print(f"wrote {path}")
    if target.run_dir is not None:
        log_scores(target.run_dir, target.step, flat)
        plot_loss_curve(target.run_dir / "metrics.jsonl", target.run_dir / "loss.png")
    return path


def log_scores(run_dir: Path, step: int, flat: dict[str, float]) -> None:
    """One metrics.jsonl record of kind "tasks" at `step`, and the same as TensorBoard
    scalars `tasks/TASK/METRIC`."""
    line = json.dumps({"time": round(time.time(), 3), "step": step, "kind": "tasks", **flat})
    with open(run_dir / "metrics.jsonl", "a") as f:  # one write: whole lines beside a live run
        f.write(line + "\n")
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return
    with SummaryWriter(str(run_dir / "tensorboard")) as tb:
        for k, v in flat.items():
            tb.add_scalar(f"tasks/{k}", v, step)
