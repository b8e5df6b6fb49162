"""Running a launcher so that all of its ranks end with it. torchrun starts each rank in a
session of its own, and a rank can outlive the launcher (holding the output pipes open, or a
GPU), so every process of a launch carries a mark in its environment, and a launch that runs
out of time is killed by its process group and by that mark."""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from pathlib import Path

MARK = "ZEROSTACK_LAUNCH_MARK"  # inherited by every process the launch starts


def start_marked(
    argv: list[str], *, cwd: Path, env: dict | None = None, merge_stderr: bool = False
) -> tuple[subprocess.Popen, str]:
    """The launch started in a new session with a fresh mark; returns (process, mark)."""
    mark = uuid.uuid4().hex
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {}), MARK: mark}
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    return proc, mark


def run_marked(
    argv: list[str],
    *,
    cwd: Path,
    timeout: float,
    env: dict | None = None,
    merge_stderr: bool = False,
) -> tuple[subprocess.CompletedProcess, bool]:
    """Run a launch to its end or `timeout` seconds; returns (what it printed and its code,
    whether it timed out). A launch that times out is killed whole, its ranks included."""
    proc, mark = start_marked(argv, cwd=cwd, env=env, merge_stderr=merge_stderr)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_launch(proc, mark)
        out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err or ""), timed_out


def kill_launch(proc: subprocess.Popen, mark: str) -> None:
    """SIGKILL the launcher's process group and every process that carries its mark."""
    import psutil

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in psutil.process_iter():
        try:
            if p.environ().get(MARK) == mark:
                p.kill()
        except psutil.Error:
            continue
