"""Background work on sealed checkpoints (training/loop/followups.py): exports, universal copies
and lm-eval task scores made by separate processes while training goes on; refused in one line
before any work when they cannot be done; never a cause of a different run."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY_RUN, launch, read_metrics, refused
from test_reliability import Job as LaunchedJob

from training.checkpoints import integrity, layout
from training.loop.followups import Followups, Job, output_of


class Lines:
    """A logger that keeps what it was given."""

    def __init__(self):
        self.records, self.lines = [], []

    def log(self, record):
        self.records.append(record)

    def console(self, line):
        self.lines.append(line)


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--save-every", "2", "--export-every", "3"], "--export-every 3: must be a multiple of"),
        (["--save-every", "-1", "--export-every", "2"], "--save-every -1 saves no checkpoint"),
        (["--backend", "ddp", "--universal-every", "2"], "universal copies are for --backend"),
        (["--eval-tasks-limit", "5"], "--eval-tasks-limit needs --eval-tasks"),
        (["--eval-tasks", ","], "--eval-tasks: give task names"),
        (["--eval-tasks", "pystdlib_continuation,no_such_task_xyz"], "no_such_task_xyz"),
    ],
)
def test_background_work_that_cannot_be_done_is_refused_before_any_work(
    capsys, monkeypatch, tmp_path, tiny_data, extra, says
):
    argv = ["--data", str(tiny_data), "--out", str(tmp_path / "run"), *TINY_RUN, *extra]
    line = refused(capsys, monkeypatch, tmp_path, argv)
    assert says in line, line


def test_a_job_still_queued_is_replaced_by_a_newer_checkpoint_and_its_checkpoint_kept(tmp_path):
    """One job at a time; a queued one of the same kind gives way to the newer checkpoint; the
    checkpoints a job will read are kept from pruning until it has run."""
    run = tmp_path / "run"
    jobs = [Job("export", 2), Job("universal", 4)]
    f = Followups(run, jobs, Lines(), last_step=10)
    f.queue.extend([(jobs[0], 2), (jobs[1], 4)])  # as if a job were running ahead of them
    f.poll = lambda: None  # noqa: E731 (nothing runs: the queue alone is under test)
    f.sealed(6)
    assert [(j.kind, s) for j, s in f.queue] == [("universal", 4), ("export", 6)]
    assert any("export of step_00000002 skipped" in x for x in f.logger.lines)
    f.sealed(10)  # the run's last step is due for every job
    assert [(j.kind, s) for j, s in f.queue] == [("export", 10), ("universal", 10)]
    assert f.busy() == {"step_00000010"}

    root = run / "checkpoints"
    for step in (2, 4, 6):
        folder = root / layout.tag_for(step)
        folder.mkdir(parents=True)
        (folder / "weights.pt").write_bytes(b"w" * step)
        (folder / layout.COMPLETE).write_text(json.dumps(integrity.listing(folder)))
    layout._prune(root, keep_last=1, busy={"step_00000002"})
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000006"]


@pytest.mark.slow  # a real export process
def test_a_failing_job_is_logged_with_why_and_the_run_goes_on(tmp_path):
    """A real `python -m training.export` on a checkpoint that was never sealed: it fails, and
    the failure is one record with the command's own last line."""
    run = tmp_path / "run"
    (run / "checkpoints" / layout.tag_for(3)).mkdir(parents=True)
    logger = Lines()
    f = Followups(run, [Job("export", 3)], logger, last_step=3)
    f.sealed(3)
    assert f.running is not None
    f.finish()
    (rec,) = [r for r in logger.records if r["kind"] == "followup"]
    assert rec["ok"] is False and rec["job"] == "export" and rec["step"] == 3
    assert "step_00000003" in rec["why"], rec
    assert not output_of(run, "export", 3).exists()
    assert Path(rec["log"]).is_file()


def _eval_processes(run: Path) -> list[int]:
    """Processes running `training.evaluate` on a checkpoint of `run` (their command lines)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        line = b" ".join(argv).decode(errors="replace")
        if "training.evaluate" in line and str(run) in line:
            found.append(int(proc.name))
    return found


def _args(data, out, *extra) -> list[str]:
    return [
        "--data", str(data), "--out", str(out), *TINY_RUN, "--steps", "6", "--save-every", "2",
        "--precision", "fp32", *extra,
    ]  # fmt: skip


@pytest.mark.slow
def test_exports_universal_copies_and_task_scores_come_while_training_and_a_kill_mid_evaluation_resumes_exactly(  # noqa: E501
    tiny_data, tmp_path
):
    """A 2-rank run with every kind of background work: each export loads in stock
    transformers with the checkpoint's logits, the universal copy is there, task scores are
    logged at their steps. The same run with rank 0 (the evaluation's parent) killed while an
    evaluation runs leaves no evaluation behind, resumes bit for bit, and the re-run scores
    what the kill cut short. About 70 s on 2 cores: one run carries every kind of background
    process (export, universal copy, lm-eval) so that each is started only once in the suite."""
    from transformers import AutoModelForCausalLM

    from training.checkpoints.weights import load_model

    work = ["--export-every", "2", "--universal-every", "6", "--eval-tasks-every", "6",
            "--eval-tasks-limit", "4", "--keep-last", "1"]  # fmt: skip
    whole = tmp_path / "whole"
    launch(_args(tiny_data, whole, *work))
    done = {(r["job"], r["step"]): r for r in read_metrics(whole, "followup")}
    assert all(r["ok"] for r in done.values()), done
    # export 4 may give way to export 6 while export 2 runs: one job at a time
    assert {("export", 2), ("export", 6), ("universal", 6), ("tasks", 6)} <= set(done), done
    assert (whole / "checkpoints" / "step_00000006_universal").is_dir()
    assert [r["step"] for r in read_metrics(whole, "tasks")] == [6]
    assert json.loads((whole / "eval" / "step_6.json").read_text())["step"] == 6
    # The last export against the checkpoint it came from (ours, from its own files).
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    hf = AutoModelForCausalLM.from_pretrained(whole / "exports" / "step_00000006").eval()
    root, tag = whole / "checkpoints", "step_00000006"
    ours = load_model(root, tag, layout.load_trainer_state(root, tag)).eval()
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, ours(ids).logits, atol=1e-4)
    # pruned once the jobs that read them were done
    assert sorted(p.name for p in (whole / "checkpoints").glob("step_*[0-9]")) == ["step_00000006"]

    killed = tmp_path / "killed"
    args = _args(
        tiny_data, killed, "--eval-tasks-every", "2", "--eval-tasks-limit", "4",
        "--dist-timeout", "120",
    )  # fmt: skip
    job = LaunchedJob.torchrun(args)
    rank0 = job.rank_pid(0)  # the evaluation's parent: killed, it takes the evaluation along
    job.wait_for(r"background tasks of step_00000002 started")
    os.kill(rank0, signal.SIGKILL)
    assert _eval_processes(killed) or not (killed / "eval" / "step_2.json").exists()
    job.finish(timeout=200)
    deadline = time.time() + 30
    while _eval_processes(killed) and time.time() < deadline:
        time.sleep(0.5)
    assert not _eval_processes(killed)  # it died with the trainer
    assert not (killed / "eval" / "step_2.json").exists()  # cut short, not finished
    r = launch(args)
    resumed_at = int(re.search(r"resumed from step_(\d+)", r.stdout + r.stderr).group(1))
    assert resumed_at in (2, 4), r.stdout
    # the kill's cut is caught up: the latest checkpoint's scores
    assert f"background tasks of {layout.tag_for(resumed_at)} started" in r.stdout
    resumed = {x["step"]: x["loss"] for x in read_metrics(killed)}
    assert resumed == {x["step"]: x["loss"] for x in read_metrics(whole)}  # bit for bit
    scored = {x["step"] for x in read_metrics(killed, "tasks")}
    assert {resumed_at, 6} <= scored, scored


def test_background_work_that_does_not_fit_beside_the_ranks_is_refused(tiny_data, tmp_path):
    """The job's memory (8 bytes a parameter) is planned on rank 0's host: a host the run fits
    with less than that to spare refuses --export-every in one line naming the flags; without
    them the same run passes."""
    from training.errors import ConfigError
    from training.memory import plan
    from training.preflight import prepare_run
    from training.preflight.followup_checks import BYTES_PER_PARAM
    from training.settings import flags as cli

    argv = ["--data", str(tiny_data), "--out", str(tmp_path / "run"), "--model", "125M"]
    argv += ["--seq-len", "512", "--micro-batch", "1", "--precision", "fp32"]
    prepared = prepare_run(cli.parse(argv), world=2)
    p = plan.plan(
        prepared.shape, prepared.ds_config, 2, seq_len=512, ranks_per_host=2, device_type="cpu"
    )
    need = 2 * (p.total("device") + p.total("host"))
    spare = BYTES_PER_PARAM * prepared.shape.params / 2  # room for half the job
    host = f"{(need + spare) / plan.HEADROOM / 2**30:.4f}"
    prepare_run(cli.parse([*argv, "--host-mem-gib", host]), world=2)
    with pytest.raises(ConfigError) as e:
        prepare_run(cli.parse([*argv, "--host-mem-gib", host, "--export-every", "100"]), 2)
    line = str(e.value)
    assert "\n" not in line and "does not fit on rank 0's host" in line, line
    assert "drop --export-every, --universal-every and --eval-tasks" in line
