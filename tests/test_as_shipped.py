"""The trainer as a user's long runs get it: blocks compiled (the default from 100 steps on, a
CPU with a C++ compiler: training/preflight/switches.py) and the precision the host picks from
the shipped configs' "auto" (bf16 here if it measured at least as fast as fp32, else fp32).
Most of the suite runs short runs eager (their default too, below 100 steps); these runs ask
for --compile so that exact resume after a kill and ZeRO-2 against DDP hold on the path a
user's run takes."""

from __future__ import annotations

import json
import os
import signal

import pytest
from conftest import TINY_RUN, launch, read_metrics
from test_reliability import Job, rank_exit_codes

SHIPPED = [a for a in TINY_RUN if a != "--no-compile"] + ["--compile"]
STEPS = 8


def run_args(data, out, *extra) -> list[str]:
    return ["--data", str(data), "--out", str(out), *SHIPPED, "--steps", str(STEPS), *extra]


def losses(run) -> list[float]:
    return [r["loss"] for r in read_metrics(run)]


@pytest.mark.slow
def test_compiled_kill_9_and_rerun_end_where_the_uninterrupted_run_ends(tiny_data, tmp_path):
    """The shipped zero2.json with compiled blocks: a rank killed after the step-4 checkpoint,
    the same command again resumes (recompiling) and every later step's loss is the
    uninterrupted run's, bit for bit."""
    whole = tmp_path / "whole"
    launch(run_args(tiny_data, whole, "--save-every", "4"))
    record = json.loads((whole / "resolved_config.json").read_text())
    assert record["switches"]["compile"]["on"] and record["compiled"] == "2 x Block"
    assert record["precision_choice"]["asked"] == "auto"

    out = tmp_path / "killed"
    args = run_args(tiny_data, out, "--save-every", "4", "--dist-timeout", "120")
    job = Job.torchrun(args)
    job.wait_for(r"saved checkpoint step_00000004")
    os.kill(job.rank_pid(1), signal.SIGKILL)
    job.finish(timeout=200)
    assert 4 in rank_exit_codes(job.output)  # rank 0: lost a rank
    r = launch(args)
    assert "resumed from step_0000000" in r.stdout + r.stderr
    resumed = {x["step"]: x["loss"] for x in read_metrics(out)}
    reference = {x["step"]: x["loss"] for x in read_metrics(whole)}
    assert resumed == reference  # steps 1-8, each once, exactly


@pytest.mark.slow
def test_compiled_zero2_follows_ddp(tiny_data, tmp_path):
    """ZeRO-2 (the shipped zero2.json) and DDP, both compiled, both in what "auto" picked here:
    the same trajectory within the rounding of that precision (the bound
    tests/test_engines.py holds eager)."""
    runs = {}
    for name, extra in (
        ("zero2", ["--ds_config", "ds_configs/zero2.json"]),
        ("ddp", ["--backend", "ddp"]),
    ):
        runs[name] = tmp_path / name
        launch(run_args(tiny_data, runs[name], "--save-every", "-1", *extra))
    records = {n: json.loads((r / "resolved_config.json").read_text()) for n, r in runs.items()}
    assert all(rec["compiled"] == "2 x Block" for rec in records.values())
    assert records["zero2"]["precision"] == records["ddp"]["precision"]
    ref, ddp = losses(runs["zero2"]), losses(runs["ddp"])
    assert len(ref) == STEPS and ref[-1] < ref[0] - 0.3, ref  # it learns
    for step, (a, b) in enumerate(zip(ddp, ref), 1):
        assert abs(a - b) <= 1e-3 * b, (step, ddp, ref)
