"""What every run shows: the rank-0 logger that writes the console (with a progress bar),
metrics.jsonl, TensorBoard and (when asked) W&B, and the loss curve drawn at the end."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


class RunLogger:
    """Rank-0 sink for metrics. Other ranks get a logger that does nothing."""

    def __init__(
        self,
        run_dir: Path,
        enabled: bool,
        total_steps: int,
        start_step: int,
        wandb: bool = False,
        run_name: str | None = None,
        config: dict | None = None,
        wandb_project: str | None = None,
    ):
        self.enabled = enabled
        self.run_dir = run_dir
        self._bar = self._tb = self._wandb = None
        self._jsonl = None
        if not enabled:
            return
        # A resumed run adds to its history, less the steps it is about to redo; a run from
        # step 0 starts a new one (an earlier run left in the folder would otherwise mix into
        # every reader's numbers).
        dropped = keep_records_up_to(run_dir / "metrics.jsonl", start_step) if start_step else 0
        if not start_step:
            (run_dir / "metrics.jsonl").write_text("")
        # Always appending (O_APPEND), a line at a time: a background evaluation appends its
        # records to the same file (loop/followups.py), and no line may land over another.
        self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        try:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides the redone steps' events that an earlier launch wrote.
            purge = start_step + 1 if start_step > 0 else None
            self._tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge)
        except ImportError:  # tensorboard is optional at run time
            self._tb = None
        if wandb:
            self._wandb = _start_wandb(run_dir, wandb_project, run_name, config)
        from tqdm.auto import tqdm  # rank 0 only

        self._bar = tqdm(
            total=total_steps,
            initial=start_step,
            unit="step",
            dynamic_ncols=True,
            disable=not _tty(),
        )
        if dropped:
            self.console(
                f"metrics.jsonl: {dropped} lines after step {start_step} dropped (this run "
                "redoes those steps)"
            )

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {"time": round(time.time(), 3), **record}
        self._jsonl.write(json.dumps(record) + "\n")
        step, kind = record.get("step", 0), record.get("kind", "train")
        scalars = {
            f"{kind}/{k}": v
            for k, v in record.items()
            if isinstance(v, (int, float)) and k not in ("step", "time")
        }
        if self._tb:
            for name, v in scalars.items():
                self._tb.add_scalar(name, v, step)
        if self._wandb:
            self._wandb.log(scalars, step=step)
        self.console(_fmt(record))

    def console(self, line: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None and not self._bar.disable:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def advance(self, n: int = 1, **postfix) -> None:
        if self._bar is not None:
            self._bar.update(n)
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        if self._tb:
            self._tb.close()
        if self._wandb:
            self._wandb.finish()
        self._jsonl.close()
        plot_loss_curve(self.run_dir / "metrics.jsonl", self.run_dir / "loss.png")


def keep_records_up_to(path: Path, step: int) -> int:
    """Drop the records of `path` (metrics.jsonl) logged after `step`, and any line cut by a kill,
    so that a run resumed at `step` holds each step once. The file is replaced whole (written
    beside it, then renamed over it), so a kill leaves the old or the new one. Returns how many
    lines were dropped."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None  # a line cut by a kill
        at = record.get("step") if isinstance(record, dict) else None
        if record is None or (isinstance(at, (int, float)) and at > step):
            dropped += 1
        else:
            kept.append(line + "\n")
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return dropped


def _start_wandb(run_dir: Path, project: str | None, name: str | None, config: dict | None):
    """A W&B run in `project` (default zerostack) named `name` (default the run folder's)."""
    import wandb  # optional (requirements-extras.txt): only with --wandb

    os.environ.setdefault("WANDB_DIR", str(run_dir))
    return wandb.init(
        project=project or "zerostack",
        name=name or run_dir.resolve().name,
        config=config,
        dir=str(run_dir),
    )


def _tty() -> bool:
    return sys.stderr.isatty()


def _fmt(r: dict) -> str:
    kind = r.get("kind", "train")
    parts = [f"{kind} step {r.get('step', 0)}"]
    for k, fmt in (
        ("loss", ".4f"),
        ("val_loss", ".4f"),
        ("ppl", ".2f"),
        ("bpb", ".4f"),
        ("accuracy", ".2f"),  # preference pairs (training/objectives/)
        ("margin", ".3f"),
        ("val_accuracy", ".2f"),
        ("val_margin", ".3f"),
        ("lr", ".3e"),
        ("grad_norm", ".3f"),
        ("tokens_per_s", ",.0f"),
        ("mfu", ".1%"),
        ("peak_mem_gb", ".2f"),
        ("skipped", "d"),
        ("loss_scale", ".0f"),
    ):
        if k in r and r[k] is not None:
            parts.append(f"{k} {format(r[k], fmt)}")
    if r.get("note"):
        parts.append(r["note"])
    return " | ".join(parts)


def plot_loss_curve(metrics_path: Path, out_png: Path) -> None:
    """Train (and validation) loss against step, from metrics.jsonl; beside it, when the run
    has task scores (records of kind "tasks", `python -m training.evaluate`), each score that
    lies in [0, 1] (accuracies) against the step of its checkpoint."""
    if not metrics_path.is_file():
        return
    train, val, tasks = [], [], {}
    for line in metrics_path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill
        if r.get("kind") == "train" and r.get("loss") is not None:
            train.append((r["step"], r["loss"]))
        elif r.get("kind") == "eval" and "val_loss" in r:
            val.append((r["step"], r["val_loss"]))
        elif r.get("kind") == "tasks":
            for k, v in r.items():
                if "/" in k and isinstance(v, (int, float)):
                    tasks.setdefault(k, {})[r["step"]] = v  # the last of a step stands
    if not train:
        return
    import matplotlib  # heavy, and only once at the end

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scores = {
        k: sorted(s.items()) for k, s in tasks.items() if all(0 <= v <= 1 for v in s.values())
    }
    fig, axes = plt.subplots(1, 2 if scores else 1, figsize=(11 if scores else 6, 3.5), dpi=100)
    ax = axes[0] if scores else axes
    ax.plot(*zip(*train), label="train")
    if val:
        ax.plot(*zip(*val), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    if scores:
        for name, points in sorted(scores.items()):
            axes[1].plot(*zip(*points), "o-", label=name)
        axes[1].set_xlabel("step")
        axes[1].set_ylabel("task score")
        axes[1].grid(alpha=0.3)
        axes[1].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
