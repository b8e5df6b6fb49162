"""`accelerate launch` runs our trainer with our ds_configs (launch/accelerate.yaml), and the
ranks shard the data: on a CPU accelerate alone would believe in a world of one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import PY, REPO, free_port, read_metrics

pytestmark = pytest.mark.slow  # a real 2-rank accelerate launch


def test_accelerate_launch_shards_the_data(tiny_data, tmp_path):
    out = tmp_path / "acc"
    cmd = [
        str(Path(PY).parent / "accelerate"),
        "launch",
        "--config_file",
        "launch/accelerate.yaml",
        "--main_process_port",
        str(free_port()),
        "--deepspeed_config_file",
        "ds_configs/zero3.json",
        "training/train.py",
        *["--data", str(tiny_data), "--out", str(out), "--model", "tiny", "--seq-len", "64"],
        *["--micro-batch", "2", "--log-every", "1", "--eval-every", "0", "--eval-samples", "8"],
        *["--steps", "2", "--save-every", "-1", "--peak-tflops", "1", "--no-compile"],
    ]
    p = subprocess.Popen(
        cmd,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        log, _ = p.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        raise
    assert p.returncode == 0, log[-5000:]
    resolved = json.loads((out / "resolved_config.json").read_text())
    # accelerate's deepspeed_config_file became the trainer's config
    assert resolved["ds_config_file"] == "ds_configs/zero3.json"
    assert resolved["ds_config"]["zero_optimization"]["stage"] == 3
    # accelerate's own state agrees with the process group ...
    assert resolved["world"] == 2
    assert resolved["accelerate"]["num_processes"] == 2
    assert resolved["accelerate"]["distributed_type"] == "DEEPSPEED"
    # ... and the two ranks read different data
    ranks = resolved["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["first_batch_sha1"] != ranks[1]["first_batch_sha1"]
    assert resolved["ds_config"]["train_batch_size"] == 4  # 2 per rank x 2 ranks
    assert len(read_metrics(out)) == 2
