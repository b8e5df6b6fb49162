"""The suite's rank server (tests/forked_ranks.py): its ranks train as launched ones do, bit for
bit, and a run that outlives its time is killed whole."""

from __future__ import annotations

import os
import time

import pytest
from conftest import TINY_RUN, _forked, launch, loss_at, rank_exit_codes


@pytest.mark.slow
def test_forked_ranks_train_as_torchrun_ranks_bit_for_bit(tiny_data, tmp_path):
    args = ["--data", str(tiny_data), *TINY_RUN, "--steps", "3"]
    launch([*args, "--out", str(tmp_path / "forked")])
    launch([*args, "--out", str(tmp_path / "torchrun")], forked=False)
    for step in (1, 2, 3):
        assert loss_at(tmp_path / "forked", step) == loss_at(tmp_path / "torchrun", step)


@pytest.mark.slow
def test_a_forked_run_past_its_time_is_killed_whole(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(
        "import os, pathlib, time\n"
        f"pathlib.Path('{tmp_path}', os.environ['RANK']).write_text(str(os.getpid()))\n"
        "time.sleep(600)\n"
    )
    t = time.monotonic()
    p, timed_out = _forked([str(script)], 2, 5, ["sleeper"])
    assert timed_out and time.monotonic() - t < 60
    assert p.returncode == 1 and set(rank_exit_codes(p)) == {-9}  # SIGKILL, reaped by the server
    for rank in ("0", "1"):
        with pytest.raises(ProcessLookupError):
            os.kill(int((tmp_path / rank).read_text()), 0)


@pytest.mark.slow
def test_a_failed_rank_stops_the_others_as_under_torchrun(tmp_path):
    """Rank 1 fails at once, rank 0 would sleep for 10 minutes: as torchrun's agent does, the
    server stops rank 0 (SIGTERM) in seconds, and the failures are rank 1's code and rank 0's
    SIGTERM."""
    script = tmp_path / "fails.py"
    script.write_text(
        "import os, pathlib, sys, time\n"
        f"pathlib.Path('{tmp_path}', os.environ['RANK']).write_text(str(os.getpid()))\n"
        "print('rank', os.environ['RANK'], 'says so on stderr', file=sys.stderr)\n"
        "sys.exit(3) if os.environ['RANK'] == '1' else time.sleep(600)\n"
    )
    for forked in (True, False):
        t = time.monotonic()
        p = launch([], script=str(script), check=False, forked=forked, timeout=120)
        assert time.monotonic() - t < 60 and p.returncode == 1, (forked, p.stderr[-2000:])
        assert rank_exit_codes(p) == [-15, 3], (forked, p.stderr[-2000:])
        assert "rank 1 says so on stderr" in p.stderr and "rank 1 says" not in p.stdout
        with pytest.raises(ProcessLookupError):
            os.kill(int((tmp_path / "0").read_text()), 0)
