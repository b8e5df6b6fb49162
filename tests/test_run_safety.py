"""Nothing a user owns is deleted or rewritten by mistake: one run per run folder (a lock by host
and pid, a dead process's lock taken over), damaged checkpoints named and moved aside (never
deleted), a run folder whose every checkpoint is damaged refused, a launch that changes nothing
rewriting nothing, and an export that refuses to replace a run or data folder. Real files,
compared by hash before and after."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from conftest import PY, REPO, free_port, launch, rank_exit_codes
from test_reliability import Job, args

from launch.launcher_argv import launcher_command
from training.errors import ConfigError
from training.runtime import runlock


def hashes(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def dead_pid() -> int:
    p = subprocess.Popen([PY, "-c", "pass"])
    p.wait()
    return p.pid


# ------------------------------------------------------------------------------ the run lock
def test_the_run_lock_refuses_a_live_holder_and_takes_over_a_dead_ones(tmp_path):
    said = []
    run = tmp_path / "run"
    lock = runlock.acquire(run, said.append)
    held = json.loads((run / "run.lock").read_text())
    assert (held["host"], held["pid"]) == (socket.gethostname(), os.getpid())
    with pytest.raises(ConfigError, match=r"is in use by another run \(pid \d+ on .*still running"):
        runlock.acquire(run, said.append)  # this process is alive: a second launch is refused
    lock.release()
    assert not (run / "run.lock").exists() and not run.exists()  # made, and nothing written

    run.mkdir()
    gone = {"host": socket.gethostname(), "pid": dead_pid(), "since": 1.0}
    (run / "run.lock").write_text(json.dumps(gone))
    lock = runlock.acquire(run, said.append)
    assert len(said) == 1 and said[0].startswith(
        f"taking over the stale lock {run / 'run.lock'} of pid {gone['pid']} (started 19"
    ), said
    assert said[0].endswith("no longer running)")
    assert json.loads((run / "run.lock").read_text())["pid"] == os.getpid()
    lock.release()
    assert run.is_dir()  # it existed before: kept

    (run / "run.lock").write_text(json.dumps({**gone, "host": "another-host"}))
    with pytest.raises(ConfigError, match="cannot be checked from here; if that job is gone"):
        runlock.acquire(run, said.append)


def test_an_elastic_round_takes_over_the_lock_an_earlier_round_left_on_a_lost_host(
    tmp_path, monkeypatch
):
    """Under an elastic launch (launch/torchrun.sh with NNODES=MIN:MAX) the rank 0 of a round
    after a lost host takes over the lock the lost host's rank 0 left; another job's is refused."""
    run = tmp_path / "run"
    run.mkdir()
    job = "train-7"  # torchrun's --rdzv-id
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", job)
    lost = {"host": "lost-host", "pid": os.getpid(), "since": 1.0, "elastic_job": job}
    for other in (
        {k: v for k, v in lost.items() if k != "elastic_job"},
        {**lost, "elastic_job": "x"},
    ):
        (run / "run.lock").write_text(json.dumps(other))
        with pytest.raises(ConfigError, match="cannot be checked from here"):
            runlock.acquire(run, print)
    (run / "run.lock").write_text(json.dumps(lost))
    said = []
    lock = runlock.acquire(run, said.append)
    assert said == [
        f"taking over the lock {run / 'run.lock'} of pid {os.getpid()} on lost-host (started "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(1.0))}), left by an earlier round "
        f"of this elastic job ({job})"
    ]
    held = json.loads((run / "run.lock").read_text())
    assert (held["host"], held["pid"], held["elastic_job"]) == (
        socket.gethostname(),
        os.getpid(),
        job,
    )
    lock.release()


def test_a_dead_writers_scratch_folder_goes_a_live_or_remote_ones_stays(tmp_path):
    """Every writer that publishes by rename (data.prepare, export, universal copies, the
    evaluation's export) fills `.NAME.partial-HOST-PID` first. A kill leaves it behind (SIGKILL
    and PDEATHSIG skip `finally`); the next writer of the same NAME deletes it once its process
    is gone, and never touches a live writer's or another host's (a shared disk)."""
    from data.files import scratch_folder

    out = tmp_path / "step_00000010"
    host = socket.gethostname()
    dead = subprocess.Popen(["true"])
    dead.wait()
    left = {
        "dead": tmp_path / f".step_00000010.partial-{host}-{dead.pid}",
        "live": tmp_path / f".step_00000010.partial-{host}-{os.getppid()}",
        "remote": tmp_path / f".step_00000010.partial-{host}x-{dead.pid}",
        "other": tmp_path / f".step_00000020.partial-{host}-{dead.pid}",
    }
    for d in left.values():
        (d / "model.safetensors").parent.mkdir(parents=True)
    tmp = scratch_folder(out)
    assert tmp.is_dir() and tmp.name == f".step_00000010.partial-{host}-{os.getpid()}"
    assert not left["dead"].exists()
    assert all(left[k].exists() for k in ("live", "remote", "other"))


def test_a_data_folder_is_never_a_run_folder(tiny_data):
    before = hashes(tiny_data)
    with pytest.raises(ConfigError, match="is a data folder"):
        runlock.acquire(tiny_data, print)
    assert hashes(tiny_data) == before


HOLD = "tests/scripts/hold_save_train.py"


@pytest.mark.slow
def test_a_second_launch_on_a_busy_run_folder_is_refused(tiny_data, tmp_path):
    out = tmp_path / "run"
    run = args(tiny_data, out, steps=4, save_every=2)
    cmd = launcher_command("torchrun", 1, [HOLD, *run], port=free_port(), python=PY)
    job = Job(cmd, env={"ZEROSTACK_TEST_HOLD_SAVE": "2:600"})
    job.wait_for(r"holding save of step_00000002 open")
    holder = json.loads((out / "run.lock").read_text())["pid"]  # rank 0 holds it
    job.ranks.add(holder)
    assert "hold_save_train.py" in " ".join(psutil.Process(holder).cmdline())
    try:
        before = hashes(out)
        second = launch(run, nproc=1, check=False)
        errors = [x for x in second.stderr.splitlines() if x.startswith("error:")]
        assert len(errors) == 1, second.stderr[-3000:]
        assert f"--out {out} is in use by another run (pid {holder} on" in errors[0]
        assert rank_exit_codes(second) == [2]
        assert hashes(out) == before  # nothing of the first run touched
    finally:
        os.kill(holder, signal.SIGKILL)  # dies holding the lock
        job.kill()
    third = launch(run, nproc=1)
    text = third.stdout + third.stderr
    assert f"taking over the stale lock {out / 'run.lock'} of pid {holder}" in text
    assert (out / "checkpoints" / "latest").read_text() == "step_00000004"
    assert not (out / "run.lock").exists()


# ------------------------------------------------------------------------------ damaged
def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _model_states(folder: Path) -> Path:
    return next(folder.glob("*model_states.pt"))


@pytest.mark.slow
def test_damaged_checkpoints_are_named_kept_and_never_trained_over(tiny_data, tmp_path):
    out = tmp_path / "run"
    run = args(tiny_data, out, "--keep-last", "0", steps=6, save_every=2)
    launch(run, nproc=1)
    ckpts = out / "checkpoints"

    # A launch with nothing to do rewrites nothing: not the record, not TensorBoard's files.
    before = hashes(out)
    r = launch(run, nproc=1)
    assert "already trained 6 steps" in r.stdout + r.stderr
    assert hashes(out) == before

    # The latest checkpoint damaged: named, skipped, and set aside (not deleted) when its step
    # is saved again.
    victim = _model_states(ckpts / "step_00000006")
    _truncate(victim)
    damaged = hashes(ckpts / "step_00000006")
    r = launch(run, nproc=1)
    text = r.stdout + r.stderr
    named = (
        f"warning: skipping the damaged checkpoint step_00000006: {ckpts / 'step_00000006'}: "
        f"corrupt checkpoint: {victim.name} is"
    )
    assert named in text, text[-3000:]
    assert "resumed from step_00000004" in text
    assert hashes(ckpts / "damaged" / "step_00000006") == damaged
    assert "moved the damaged checkpoint" in text
    assert (ckpts / "latest").read_text() == "step_00000006"

    # Every checkpoint damaged: refused, each damaged file named, nothing written.
    for tag in ("step_00000002", "step_00000004", "step_00000006"):
        _truncate(_model_states(ckpts / tag))
    before = hashes(out)
    r = launch(run, nproc=1, check=False)
    errors = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: every checkpoint in {ckpts} is "), (
        r.stderr[-3000:]
    )
    for tag in ("step_00000002", "step_00000004", "step_00000006"):
        assert f"{ckpts / tag}: corrupt checkpoint: {_model_states(ckpts / tag).name}" in errors[0]
    assert hashes(out) == before


# ------------------------------------------------------------------------------ export
@pytest.mark.slow  # the user's export command
def test_export_never_replaces_a_run_or_data_folder(tiny_data, tmp_path):
    """--overwrite refuses an --out that is, contains or lies inside a run or data folder (an
    earlier export inside a run, RUN/hf, may still be replaced); nothing is touched."""
    from training.checkpoints.hf_export import check_target
    from training.errors import ExportError

    runs = tmp_path / "runs"
    run = runs / "a"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_00000002")
    (run / "resolved_config.json").write_text("{}")
    hf = run / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"x")
    before = hashes(tmp_path), hashes(tiny_data)
    for target, why in [
        (run, "is a run folder"),
        (runs, "contains a run folder"),
        (run / "checkpoints", "lies inside a run folder"),
        (tiny_data, "is a data folder"),
        (tiny_data.parent, "contains a data folder"),
    ]:
        with pytest.raises(ExportError, match=why):
            check_target(target, overwrite=True)
    p = subprocess.run(  # the user's command: refused before it reads the checkpoint
        [PY, "-m", "training.export", str(run), "--out", str(run), "--overwrite"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2, p.stderr[-2000:]
    assert (
        p.stderr.strip()
        == f"error: --out {run} is a run folder; refusing to replace it: pick a new --out"
    )
    assert (hashes(tmp_path), hashes(tiny_data)) == before
    check_target(hf, overwrite=True)  # an earlier export inside the run: may be replaced
