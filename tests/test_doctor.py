"""`python -m launch.doctor`: the environment check, on real ranks."""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import PY, REPO, launch


@pytest.mark.slow
def test_doctor_on_two_ranks_runs_the_collectives(tiny_data, tmp_path):
    r = launch(
        ["--out", str(tmp_path / "run"), "--data", str(tiny_data)],
        script="launch/doctor.py",
        forked=False,  # the doctor names the launcher that started it
    )
    out = r.stdout
    assert "zerostack doctor: 2 ranks on 1 host" in out
    for line in (
        "ok    launcher      torchrun: world of 2",
        "ok    versions      torch 2.13.0",
        "ok    backend       gloo on cpu",
        "ok    process group gloo, 2 ranks",
        "ok    all-reduce    sum of 1..2 over 2 ranks = 3",
        "ok    broadcast     rank 0's tensor arrived intact",
        "ok    data          " + str(tiny_data),
        "verdict: ready to train",
    ):
        assert line in out, (line, out)
    assert "GiB free, writable" in out
    assert out.count("zerostack doctor") == 1  # rank 0 speaks for everyone


def test_doctor_says_what_is_wrong(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "MASTER_ADDR", "MASTER_PORT")}
    p = subprocess.run(
        [
            PY,
            "-m",
            "launch.doctor",
            "--out",
            str(tmp_path / "file" / "run"),
            "--data",
            str(tmp_path / "nodata"),
        ],
        cwd=REPO,
        env={**env, "WORLD_SIZE": "2"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 1, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert any(x.startswith("FAIL  launcher") and "WORLD_SIZE set but not RANK" in x for x in lines)
    assert any(x.startswith("FAIL  disk") and "is not a folder" in x for x in lines)
    assert any(x.startswith("FAIL  data") and "no such dataset folder" in x for x in lines)
    assert any(x.startswith("skip  process group") for x in lines)
    assert "verdict: something is wrong" in p.stdout
