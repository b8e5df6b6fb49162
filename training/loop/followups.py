"""Work on sealed checkpoints while training goes on: an export stock `transformers` loads
(`--export-every`), a universal copy (`--universal-every`) and lm-evaluation-harness tasks
(`--eval-tasks`, `--eval-tasks-every`).

Each job is the command a user would run by hand (`python -m training.export`,
`training.universal`, `training.evaluate`), started by rank 0 in a separate process at nice 19
with one thread, so the step loop never waits for it and its memory is the command's own
(bounded as the foreground command's is). One job runs at a time; the others queue, and a
job of one kind that is still queued when a newer checkpoint comes due for it is replaced by
the newer one. A job's checkpoint is kept from pruning until the job is done. A failure is
logged (`kind: followup`, the log's last line as why) and never affects the run. The child dies
with the trainer (PR_SET_PDEATHSIG); a re-run starts again, at its first step, the jobs of the
latest sealed checkpoint that are due and have no result yet.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from training.checkpoints import layout

KINDS = ("export", "universal", "tasks")
# What the child leaves out of the trainer's environment: it is one process, not a rank.
_LAUNCH_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "GROUP_RANK",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK", "CROSS_SIZE",
    "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK", "PMI_SIZE",
)  # fmt: skip
# Run before the command: die with the trainer (Linux), lowest CPU priority, then exec.
_WRAP = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)  # the trainer is already gone\n"
    "os.nice(19)\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n"
)


@dataclass(frozen=True)
class Job:
    """One kind of work, due on the checkpoints of steps that are multiples of `every` and on
    the run's last one."""

    kind: str  # export | universal | tasks
    every: int
    tasks: tuple[str, ...] = ()  # kind "tasks": the task names
    limit: int | None = None  # kind "tasks": at most this many items per task


@dataclass
class Running:
    job: Job
    step: int
    proc: subprocess.Popen
    log: Path
    started: float


def output_of(run_dir: Path, kind: str, step: int) -> Path:
    """Where a job's result lands: what tells a re-run it was done."""
    tag = layout.tag_for(step)
    if kind == "export":
        return run_dir / "exports" / tag / "config.json"
    if kind == "universal":
        return run_dir / "checkpoints" / (tag + layout.UNIVERSAL_SUFFIX)
    return run_dir / "eval" / f"step_{step}.json"  # what training.evaluate writes


def command(run_dir: Path, job: Job, step: int) -> list[str]:
    """The job's command line: the same a user would run by hand."""
    ckpt = str(run_dir / "checkpoints" / layout.tag_for(step))
    if job.kind == "export":
        out = run_dir / "exports" / layout.tag_for(step)
        return ["-m", "training.export", ckpt, "--out", str(out), "--overwrite"]
    if job.kind == "universal":
        return ["-m", "training.universal", ckpt]
    limit = ["--limit", str(job.limit)] if job.limit else []
    return ["-m", "training.evaluate", ckpt, "--tasks", ",".join(job.tasks), *limit]


class Followups:
    """Rank 0's background jobs. `sealed(step)` after each sealed checkpoint, `poll()` at each
    step boundary, `finish()` at the run's end (waits) and `stop()` at a stop signal."""

    def __init__(self, run_dir: Path, jobs: list[Job], logger, last_step: int, keep_last: int = 0):
        self.run_dir, self.jobs, self.logger, self.last_step = run_dir, jobs, logger, last_step
        self.keep_last = keep_last  # --keep-last: what a save left for a job is pruned after it
        self.queue: deque[tuple[Job, int]] = deque()
        self.running: Running | None = None

    def due(self, job: Job, step: int) -> bool:
        return step % job.every == 0 or step == self.last_step

    def catch_up(self) -> None:
        """Queue the jobs of the latest sealed checkpoint that are due and have no result (a run
        stopped or killed while they ran)."""
        latest = layout.find_latest(self.run_dir / "checkpoints")
        if latest is None:
            return
        step = int(latest.removeprefix("step_"))
        for job in self.jobs:
            if self.due(job, step) and not output_of(self.run_dir, job.kind, step).exists():
                self.queue.append((job, step))
        self.poll()

    def sealed(self, step: int) -> None:
        for job in self.jobs:
            if not self.due(job, step):
                continue
            older = [q for q in self.queue if q[0] is job]
            for q in older:  # still waiting: the newer checkpoint replaces it
                self.queue.remove(q)
                self.logger.console(
                    f"background {job.kind} of {layout.tag_for(q[1])} skipped: "
                    f"{layout.tag_for(step)} came due before it could start"
                )
            self.queue.append((job, step))
        self.poll()

    def busy(self) -> set[str]:
        """Checkpoint tags a job reads or will read: not pruned until it is done."""
        tags = {layout.tag_for(step) for _, step in self.queue}
        if self.running is not None:
            tags.add(layout.tag_for(self.running.step))
        return tags

    def poll(self) -> None:
        """Collect a finished job and start the next: never waits."""
        if self.running is not None and self.running.proc.poll() is not None:
            self._done(self.running)
            self.running = None
            layout.prune(self.run_dir / "checkpoints", self.keep_last, self.busy())
        if self.running is None and self.queue:
            self.running = self._start(*self.queue.popleft())

    def finish(self, stop_requested=lambda: False) -> None:
        """The run's end: wait for every job (the last checkpoint's included), unless
        `stop_requested()` turns true meanwhile (a SIGTERM): then `stop`."""
        if self.running is None and not self.queue:
            return
        self.logger.console(
            "waiting for background work: "
            + ", ".join(f"{j.kind} of {layout.tag_for(s)}" for j, s in self._pending())
        )
        while self.running is not None:
            try:
                self.running.proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                if stop_requested():
                    self.stop()
                    return
            self.poll()

    def stop(self) -> None:
        """A stop signal: end the job in flight and drop the queue; a re-run starts again what
        its latest checkpoint still lacks."""
        pending = self._pending()
        self.queue.clear()
        r, self.running = self.running, None
        if r is not None and r.proc.poll() is None:
            r.proc.terminate()
            try:
                r.proc.wait(10)
            except subprocess.TimeoutExpired:
                r.proc.kill()
                r.proc.wait()
        if pending:
            self.logger.console(
                "stopped background work ("
                + ", ".join(f"{j.kind} of {layout.tag_for(s)}" for j, s in pending)
                + "); a re-run starts what its latest checkpoint lacks"
            )

    def _pending(self) -> list[tuple[Job, int]]:
        head = [(self.running.job, self.running.step)] if self.running else []
        return head + list(self.queue)

    def _start(self, job: Job, step: int) -> Running:
        log = self.run_dir / "followups" / f"{layout.tag_for(step)}.{job.kind}.log"
        log.parent.mkdir(exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
        env["OMP_NUM_THREADS"] = "1"  # beside the ranks' threads, not among them
        argv = [sys.executable, "-c", _WRAP, str(os.getpid()), *command(self.run_dir, job, step)]
        with open(log, "w") as f:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,  # a Ctrl-C on the terminal is the trainer's to handle
            )  # fmt: skip
        self.logger.console(f"background {job.kind} of {layout.tag_for(step)} started (log: {log})")
        return Running(job, step, proc, log, time.monotonic())

    def _done(self, r: Running) -> None:
        seconds = time.monotonic() - r.started
        code = r.proc.returncode
        out = output_of(self.run_dir, r.job.kind, r.step)
        ok = code == 0 and out.exists()
        why = None if ok else (_last_line(r.log) or f"exit code {code}")
        tag = layout.tag_for(r.step)
        note = (
            f"background {r.job.kind} of {tag} done in {seconds:.1f} s"
            if ok
            else f"background {r.job.kind} of {tag} FAILED after {seconds:.1f} s ({why}); the "
            f"run goes on (log: {r.log})"
        )
        self.logger.log(
            {
                "kind": "followup",
                "job": r.job.kind,
                "step": r.step,
                "ok": ok,
                "seconds": round(seconds, 2),
                "out": str(out.parent if r.job.kind == "export" else out),
                **({"why": why, "log": str(r.log)} if not ok else {}),
                "note": note,
            }
        )


def _last_line(log: Path) -> str | None:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines()]
    except OSError:
        return None
    lines = [ln for ln in lines if ln]
    return lines[-1][:300] if lines else None
