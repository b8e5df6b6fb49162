"""A build of DeepSpeed's ops killed mid-way leaves torch's `lock` file, and every later run
that needs the op waits on it forever in silence: the trainer removes such a lock before any
work, and says so; a build in progress keeps its lock (training/runtime/build_locks.py)."""

from __future__ import annotations

import os
import subprocess
import time

from training import train
from training.runtime import build_locks


def lock(path, age_s: float):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_only_locks_older_than_any_build_are_stale(tmp_path):
    old = lock(tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock", 3600)
    lock(tmp_path / "cpu_adam" / "lock", 60)  # a build running now
    assert build_locks.stale_locks(tmp_path) == [old]


def test_a_lock_goes_unless_a_build_works_beside_it(tmp_path):
    ended = lock(tmp_path / "py311_cpu" / "cpu_adam" / "lock", 5 * 60)  # killed 5 min ago
    taken = lock(tmp_path / "py311_cpu" / "fused_adam" / "lock", 1)  # ninja not started yet
    slow = lock(tmp_path / "py311_cpu" / "async_io" / "lock", 3600)  # a starved build, going on
    ninja = subprocess.Popen(["sleep", "60"], cwd=slow.parent)  # works in the op's folder
    try:
        # the trainer: a 5-minute-old lock may be another host's build in a shared folder
        [line] = build_locks.clear_stale(tmp_path)
        assert line.startswith(f"warning: {ended}, 5 min old") and ended.exists()
        # the test suite, on one host
        [line] = build_locks.clear_stale(tmp_path, after_s=build_locks.UNATTENDED_AFTER_S)
    finally:
        ninja.kill()
        ninja.wait()
    assert not ended.exists() and taken.exists() and slow.exists()
    assert line.startswith(f"note: removed {ended}, 5 min old") and "'cpu_adam'" in line
    [line] = build_locks.clear_stale(tmp_path)  # the slow build is over now
    assert line.startswith(f"note: removed {slow}, 60 min old") and taken.exists()


def test_the_trainer_removes_a_stale_lock_before_any_work(tiny_data, tmp_path, monkeypatch, capsys):
    root = tmp_path / "extensions"
    old = lock(root / "py311_cpu" / "deepspeed_shm_comm" / "lock", 3600)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    monkeypatch.setattr(train, "run_guarded", lambda *a, **k: 0)  # preflight only
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    argv = ["--data", str(tiny_data), "--out", str(tmp_path / "run"), "--model", "tiny",
            "--seq-len", "64", "--steps", "1"]  # fmt: skip
    assert train.main(argv) == 0
    out = capsys.readouterr()
    noted = [x for x in (out.out + out.err).splitlines() if x.startswith("note: removed")]
    assert any(str(old) in x for x in noted), noted
    assert not old.exists()
