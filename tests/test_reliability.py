"""Reliability with real processes and real signals: a rank killed or frozen, preemption signals
to a rank and to the launcher, non-finite steps, corrupt checkpoints, a full disk, and the
restart loop of launch/local.sh. Each interrupted run is resumed and must end exactly where an
uninterrupted run ends."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import (
    PY,
    REPO,
    TINY_RUN,
    free_port,
    launch,
    rank_exit_codes,
    read_metrics,
    shm_has_room,
)

from launch.launcher_argv import launcher_command

STEPS = 12
COMMON = TINY_RUN


def args(data, out, *extra, steps=STEPS, save_every=4):
    return [
        "--data",
        str(data),
        "--out",
        str(out),
        *COMMON,
        "--steps",
        str(steps),
        "--save-every",
        str(save_every),
        *extra,
    ]


class Job:
    """A launcher (torchrun by default) and its ranks in their own session; output is read by a
    thread so the test can wait for a line, then signal the launcher or one rank."""

    def __init__(self, cmd: list[str], env: dict | None = None):
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.ranks: set[int] = set()  # pids handed out by rank_pid, killed with the job
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @classmethod
    def torchrun(cls, train_args: list[str], env: dict | None = None, nproc: int = 2) -> Job:
        program = ["training/train.py", *train_args]
        return cls(launcher_command("torchrun", nproc, program, port=free_port(), python=PY), env)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 300) -> re.Match:
        end = time.time() + timeout
        while time.time() < end:
            m = re.search(pattern, self.output)
            if m:
                return m
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        self.kill()
        raise AssertionError(f"never saw {pattern!r}:\n{self.output[-5000:]}")

    def rank_pid(self, rank: int) -> int:
        """The pid of training rank `rank` (its RANK in the environment), below the launcher."""
        end = time.time() + 60
        while time.time() < end:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                try:
                    if "training/train.py" in " ".join(p.cmdline()):
                        if p.environ().get("RANK") == str(rank):
                            self.ranks.add(p.pid)
                            return p.pid
                except psutil.Error:
                    continue
            time.sleep(0.2)
        raise AssertionError(f"no process for rank {rank}")

    def finish(self, timeout: float = 300) -> int:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"still running after {timeout}s:\n{self.output[-5000:]}"
            ) from None
        self._reader.join(10)
        return self.proc.returncode

    def kill(self) -> None:
        # A rank the test stopped may have outlived its launcher in a session of its own.
        for pid in [self.proc.pid, *self.ranks]:
            try:
                (os.killpg if pid == self.proc.pid else os.kill)(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


def launch_with_file_limit(train_args: list[str], limit_files) -> str:
    """A 2-rank trainer launch whose every process starts with `limit_files()` applied (an
    RLIMIT_FSIZE: a disk that fills up); returns its output."""
    program = ["training/train.py", *train_args]
    cmd = launcher_command("torchrun", 2, program, port=free_port(), python=PY)
    p = subprocess.run(
        cmd,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=limit_files,
        start_new_session=True,
    )
    return p.stdout + p.stderr


def final_loss(run: Path) -> float:
    return read_metrics(run)[-1]["loss"]


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory) -> Path:
    """The uninterrupted run every interrupted one must match."""
    out = tmp_path_factory.mktemp("reliability") / "reference"
    launch(args(tiny_data, out))
    assert [r["step"] for r in read_metrics(out)] == list(range(1, STEPS + 1))
    return out


# ------------------------------------------------------------------------------ dead ranks
@pytest.mark.slow
def test_kill_9_of_one_rank_stops_the_other_and_rerun_is_exact(tiny_data, reference, tmp_path):
    out = tmp_path / "killed"
    run = args(tiny_data, out, "--dist-timeout", "120")
    job = Job.torchrun(run)
    job.wait_for(r"saved checkpoint step_00000004")
    os.kill(job.rank_pid(1), signal.SIGKILL)
    killed_at = time.time()
    job.finish(timeout=200)
    waited = time.time() - killed_at
    assert waited < 60, waited  # well inside --dist-timeout: nobody waits for a dead peer
    line = job.wait_for(r"error: rank 1 is not responding[^\n]*").group(0)
    assert "Re-run the same command to resume from step_0000000" in line, line
    assert 4 in rank_exit_codes(job.output)  # rank 0: lost a rank

    latest = (out / "checkpoints" / "latest").read_text()
    r = launch(run)
    assert f"resumed from {latest}" in r.stdout + r.stderr
    assert final_loss(out) == final_loss(reference)


@pytest.mark.slow
def test_a_frozen_rank_is_named_after_the_timeout(tiny_data, tmp_path):
    """SIGSTOP: the rank is alive but answers nothing. A peer waiting in a gloo collective gives
    up after --dist-timeout; one waiting in the shared-memory all-reduce (which cannot time out)
    is freed sooner by the watchdog (tests/test_distributed.py pins that case down)."""
    job = Job.torchrun(args(tiny_data, tmp_path / "frozen", "--dist-timeout", "10", steps=400))
    job.wait_for(r"train step 2 ")
    os.kill(job.rank_pid(1), signal.SIGSTOP)
    frozen_at = time.time()
    try:
        job.wait_for(r"error: rank 1 is not responding", timeout=120)
    finally:
        job.kill()
    assert 5 < time.time() - frozen_at < 90


@pytest.mark.slow
def test_the_watchdog_names_a_rank_frozen_before_a_shared_memory_all_reduce(tmp_path):
    """DeepSpeed's shared-memory all-reduce spins until every rank arrives: rank 0 waits in it
    for a rank that froze. The watchdog names rank 1 after its grace and roll call, well
    inside --dist-timeout, and rank 0 exits 4."""
    if not shm_has_room():
        pytest.skip("/dev/shm cannot hold DeepSpeed's segments here (the route stays off)")
    program = ["tests/scripts/shm_frozen_peer.py", str(tmp_path), "120"]
    job = Job(launcher_command("torchrun", 2, program, port=free_port(), python=PY))
    frozen = int(job.wait_for(r"rank 1 pid (\d+) ready").group(1))
    job.ranks.add(frozen)
    started = time.time()
    try:
        line = job.wait_for(r"error: rank 1 is not responding[^\n]*", timeout=100).group(0)
        waited = time.time() - started
        os.kill(frozen, signal.SIGKILL)  # so the launcher ends now, not 30 s later
        job.finish(timeout=60)
    finally:
        job.kill()
    assert 5 < waited < 60, waited
    assert "rank 0 stops too" in line, line
    assert 4 in rank_exit_codes(job.output), job.output
    assert "rank 0 got past" not in job.output


# ------------------------------------------------------------------------------ preemption
@pytest.mark.slow
def test_sigterm_to_a_rank_then_to_the_launcher_saves_and_resumes_exactly(tiny_data, tmp_path):
    # A tiny step takes ~15 ms: a longer run than the shared reference's leaves room for the
    # second signal to land before the run ends.
    steps = 3 * STEPS
    reference = tmp_path / "reference"
    launch(args(tiny_data, reference, steps=steps))
    out = tmp_path / "preempted"
    run = args(tiny_data, out, "--save-every", "100", steps=steps)

    job = Job.torchrun(run)  # 1: SIGTERM to rank 1 only; rank 0 must stop at the same step
    job.wait_for(r"train step 2 ")
    os.kill(job.rank_pid(1), signal.SIGTERM)
    m = job.wait_for(r"stopped by SIGTERM \(received by rank 1\) after step (\d+)")
    job.finish()
    first = int(m.group(1))
    assert 2 <= first < steps
    assert rank_exit_codes(job.output) == [75, 75]
    assert (out / "checkpoints" / "latest").read_text() == f"step_{first:08d}"

    job = Job.torchrun(run)  # 2: SIGTERM to torchrun, which passes it to both ranks
    job.wait_for(f"resumed from step_{first:08d}")
    job.wait_for(rf"train step {first + 2} ")
    os.kill(job.proc.pid, signal.SIGTERM)
    m = job.wait_for(r"stopped by SIGTERM \(received by rank \d\) after step (\d+)")
    job.finish()
    second = int(m.group(1))
    assert first < second < steps
    assert (out / "checkpoints" / "latest").read_text() == f"step_{second:08d}"

    r = launch(run)  # 3: the rest
    assert f"resumed from step_{second:08d}" in r.stdout + r.stderr
    got, want = read_metrics(out), read_metrics(reference)
    assert sorted({x["step"] for x in got}) == list(range(1, steps + 1))
    final = {x["step"]: x["loss"] for x in got}  # the last record of each step wins
    assert [final[s] for s in range(1, steps + 1)] == [x["loss"] for x in want]


def test_stop_signals_in_one_process():
    """The handler itself: the first stop signal is kept, later ones are ignored, and a second
    Ctrl-C exits at once with 130."""
    code = (
        "import os, signal, sys, time\n"
        "from training.runtime import signals\n"
        "s = signals.install(rank=0)\n"
        "os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.1)\n"
        "os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.1)\n"
        "print('requested', s.requested, signals.name(s.signum), flush=True)\n"
        "os.kill(os.getpid(), signal.SIGINT); time.sleep(0.1)\n"
        "print('still here', flush=True)\n"
        "os.kill(os.getpid(), signal.SIGINT); time.sleep(5)\n"
        "print('not reached', flush=True)\n"
    )
    p = subprocess.run([PY, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 130, p.stderr
    assert "requested True SIGUSR1" in p.stdout and "still here" in p.stdout
    assert "not reached" not in p.stdout
    assert "second Ctrl-C: stopping now, without saving" in p.stderr


# ------------------------------------------------------------------------------ non-finite
NAN_TRAIN = "tests/scripts/nan_train.py"  # the trainer with NaN input embeddings on some steps


@pytest.mark.slow
def test_nan_steps_are_skipped_counted_and_stop_the_run(tiny_data, tmp_path):
    out = tmp_path / "nan"
    env = {"ZEROSTACK_TEST_NAN_STEPS": "3,5,6,7"}  # on rank 1 only: all ranks must skip
    r = launch(
        # no rollback: this test is of the stop after --max-bad-steps (test_spikes.py rolls back)
        args(tiny_data, out, "--max-bad-steps", "3", "--rollback-after", "0", save_every=2),
        env=env,
        check=False,
        script=NAN_TRAIN,
    )
    text = r.stdout + r.stderr
    assert rank_exit_codes(r) == [3, 3], text[-3000:]
    assert (
        "error: 3 consecutive steps (steps 5-7) had a non-finite loss or gradient norm, so the "
        "run stopped; the last good checkpoint is step_00000004" in text
    )
    bad = read_metrics(out, "nonfinite")
    assert [(x["step"], x["in_a_row"], x["total"]) for x in bad] == [
        (3, 1, 1),
        (5, 1, 2),
        (6, 2, 3),
        (7, 3, 4),
    ]
    assert all(x["update_skipped"] and not x["loss_finite"] for x in bad)
    train = {x["step"]: x for x in read_metrics(out)}
    assert train[3]["loss"] is None and train[4]["loss"] is not None
    assert train[4]["skipped"] == 1 and train[4]["nonfinite"] == 1
    assert train[6]["skipped"] == 3
    assert train[6]["skipped_by"] == {"non-finite loss": 3}
    # no checkpoint inside the bad run: step 6 was not saved, step 4 stays the latest
    assert (out / "checkpoints" / "latest").read_text() == "step_00000004"
    assert not (out / "checkpoints" / "step_00000006").exists()


@pytest.mark.slow
def test_deepspeeds_bf16_skip_of_a_finite_loss_is_counted_with_its_reason(tiny_data, tmp_path):
    """NaN gradients behind a finite loss: DeepSpeed's bf16 overflow check skips the update on
    its own (check_grad_overflow, DeepSpeed 0.19.3 on; without a line of its own), and the run
    counts and logs it under its reason."""
    out = tmp_path / "grad"
    extra = ["--precision", "bf16", "--stop-at", "4", "--rollback-after", "0"]
    env = {"ZEROSTACK_TEST_NAN_STEPS": "3", "ZEROSTACK_TEST_NAN_IN": "grad"}
    launch(args(tiny_data, out, *extra), env=env, script=NAN_TRAIN)
    (bad,) = read_metrics(out, "nonfinite")
    assert (bad["step"], bad["loss_finite"], bad["update_skipped"]) == (3, True, True)
    train = {x["step"]: x for x in read_metrics(out)}
    assert train[2]["skipped"] == 0
    assert train[4]["skipped"] == 1 and train[4]["skipped_by"] == {"non-finite gradient norm": 1}


def _tensors(obj, prefix=""):
    import torch

    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if k not in ("zerostack", "rng"):
                yield from _tensors(v, f"{prefix}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}[{i}]")


def _state(folder: Path) -> dict:
    """Every tensor of every engine file of a checkpoint: weights, master weights, moments."""
    import torch

    out = {}
    for f in sorted(folder.glob("*.pt")):
        if f.name != "trainer_state.pt":
            obj = torch.load(f, weights_only=False, map_location="cpu")
            out.update({f"{f.name}{k}": v for k, v in _tensors(obj)})
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


FP32_ZERO0 = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 0}}


@pytest.mark.slow
@pytest.mark.parametrize("config", ["zero0", "zero2", "zero3", "fp32_zero0", "ddp"])
def test_a_skipped_step_leaves_weights_and_optimizer_untouched(tiny_data, tmp_path, config):
    if config == "fp32_zero0":  # a plain torch optimizer under DeepSpeed, no ZeRO wrapper
        (tmp_path / "c.json").write_text(json.dumps(FP32_ZERO0))
        engine = ["--ds_config", str(tmp_path / "c.json")]
    elif config == "ddp":  # a native engine skips by its own rule, in the same loop
        engine = ["--backend", "ddp"]
    else:
        engine = ["--ds_config", f"ds_configs/{config}.json"]
    out = tmp_path / "run"
    extra = [*engine, "--stop-at", "3", "--keep-last", "0"]
    launch(
        args(tiny_data, out, *extra, save_every=1),
        env={"ZEROSTACK_TEST_NAN_STEPS": "3"},
        script=NAN_TRAIN,
    )
    s1, s2, s3 = (_state(out / "checkpoints" / f"step_0000000{i}") for i in (1, 2, 3))
    assert len(s2) > 10
    assert not _same(s1, s2)  # a normal step changes the state ...
    assert _same(s2, s3)  # ... the NaN step changed nothing at all
    assert read_metrics(out, "nonfinite")[0]["update_skipped"]


# ------------------------------------------------------------------------------ integrity
def _copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("tensorboard"))
    return dst


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _snapshot(folder: Path) -> dict:
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in folder.rglob("*")
        if p.is_file()
    }


@pytest.mark.slow
def test_a_corrupted_byte_is_found_on_load(tiny_data, reference, tmp_path):
    from training.checkpoints import integrity

    out = _copy_run(reference, tmp_path / "corrupt")
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_00000012"
    listed = json.loads((ckpts / "step_00000012" / "complete.json").read_text())
    assert set(listed["sha256"]) == set(listed["files"]) and len(listed["files"]) >= 5
    (victim,) = (ckpts / "step_00000012").glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert integrity.verify(ckpts / "step_00000012") is None
    _flip_byte(victim)  # same size: only the checksum can tell
    assert f"{victim.name} does not match its sha256" in (integrity.verify(ckpts / "step_00000012"))

    # Named on the command line: refused in one line, nothing touched.
    before = _snapshot(out)
    r = launch(
        args(tiny_data, out, "--resume", str(ckpts / "step_00000012"), steps=16), check=False
    )
    errors = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "refusing to resume from a corrupt checkpoint" in errors[0]
    assert victim.name in errors[0]
    assert rank_exit_codes(r) == [2, 2]
    assert _snapshot(out) == before

    # Resumed automatically: the previous complete checkpoint is used instead, and the run
    # still ends exactly where the reference ended.
    r = launch(args(tiny_data, out))
    text = r.stdout + r.stderr
    assert "does not match its sha256" in text
    assert "trying the previous checkpoint step_00000008" in text
    assert "resumed from step_00000008" in text
    assert final_loss(out) == final_loss(reference)


@pytest.mark.slow
def test_disk_full_during_a_save_keeps_the_previous_checkpoint(tiny_data, reference, tmp_path):
    """A file-size limit makes every checkpoint write fail the way a full disk does."""
    import resource

    out = _copy_run(reference, tmp_path / "full")
    limit = 200_000  # smaller than the engine's files, larger than logs and metrics

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    text = launch_with_file_limit(args(tiny_data, out, steps=16), small_files)
    # The limit also cuts DeepSpeed's shared-memory segments short: the all-reduce route must
    # see that and stay off (with a short segment its kernel faults).
    assert "world 2 (gloo) |" in text, text[-4000:]
    assert set(rank_exit_codes(text)) == {5}, text[-4000:]
    # rank 0 says it, for itself or relaying the rank that failed first
    line = re.search(r"error: (rank 1 stopped: )?could not write checkpoint step_00000016.*", text)
    line = line.group(0)
    assert "the previous checkpoint step_00000012 is intact" in line, line
    assert (out / "checkpoints" / "latest").read_text() == "step_00000012"
    assert not (out / "checkpoints" / "step_00000016" / "complete.json").exists()


# ------------------------------------------------------------------------------ restarts
@pytest.mark.slow
def test_local_launcher_restarts_after_a_dead_rank_and_passes_sigterm_on(tiny_data, tmp_path):
    """launch/local.sh (the deepspeed launcher) with MAX_RESTARTS: a rank is killed, the
    launcher stops the job, the script starts it again and it resumes. Then SIGTERM to the
    script reaches the ranks, which save and exit 75, and the script does not restart. About
    60 s on 2 cores: the deepspeed launcher starts the job twice, and the dead rank is found by
    the watchdog's roll call, the path a user's job takes."""
    out = tmp_path / "restarted"
    env = {
        "MAX_RESTARTS": "2",
        "MASTER_PORT": str(free_port()),
        "VENV": str(Path(PY).parent.parent),
    }
    job = Job(["bash", "launch/local.sh", "2", *args(tiny_data, out, steps=200)], env=env)
    job.wait_for(r"saved checkpoint step_00000004")
    os.kill(job.rank_pid(1), signal.SIGKILL)
    job.wait_for(r"error: rank 1 is not responding")  # rank 0, before the launcher stops it
    job.wait_for(r"restarting \(1 of 2\)", timeout=120)
    resumed = int(job.wait_for(r"resumed from step_(\d+)").group(1))
    job.wait_for(rf"train step {resumed + 2} ")
    os.kill(job.proc.pid, signal.SIGTERM)
    stopped = int(job.wait_for(r"stopped by SIGTERM \(received by rank \d\) after step (\d+)")[1])
    assert job.finish() == 75, job.output[-4000:]
    assert "restarting (2 of 2)" not in job.output
    assert (out / "checkpoints" / "latest").read_text() == f"step_{stopped:08d}"
    assert resumed < stopped < 200


@pytest.mark.slow
def test_restart_loop_stops_on_bad_input(tiny_data, tmp_path):
    env = {"MAX_RESTARTS": "3", "VENV": str(Path(PY).parent.parent)}
    p = subprocess.run(
        ["bash", "launch/local.sh", "1", *args(tiny_data, tmp_path / "r", "--lr", "-1")],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2
    assert "restarting" not in p.stdout + p.stderr
    assert "--lr must be 0 or more" in p.stderr
