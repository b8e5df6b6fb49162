"""Shared fixtures: a small real dataset prepared once per session, and a launcher for real
multi-process training runs of the train entry point."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    args: list[str],
    nproc: int = 2,
    env: dict | None = None,
    timeout: float = 600,
    script: str = "training/train.py",
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run `script` under torchrun with `nproc` ranks (a real gloo group on CPU)."""
    cmd = [
        PY,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),
        script,
        *args,
    ]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    # A new session, so a timeout kills the ranks too, not just the launcher.
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(
            f"{' '.join(cmd)} timed out after {timeout}s:\n{out[-3000:]}\n{err[-3000:]}"
        ) from None
    p = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check and p.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}"
        )
    return p


def read_metrics(run_dir: Path, kind: str = "train") -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == kind]


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A real corpus (a slice of the Python standard library) tokenized with a small trained
    tokenizer: shared by every training test."""
    from data import prepare

    out = tmp_path_factory.mktemp("data") / "pystdlib-tiny"
    prepare("pystdlib", out, vocab_size=512, max_docs=300, num_proc=1, val_fraction=0.05)
    return out
