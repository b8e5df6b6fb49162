"""The suite's rank server (tests/forked_ranks.py): its ranks train as launched ones do, bit for
bit, and a run that outlives its time is killed whole."""

from __future__ import annotations

import os
import time

import pytest
from conftest import TINY_RUN, _forked, launch, loss_at


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
    assert p.returncode == -9  # SIGKILL, both ranks reaped by the server
    for rank in ("0", "1"):
        with pytest.raises(ProcessLookupError):
            os.kill(int((tmp_path / rank).read_text()), 0)
