"""A hung rank: a step far longer than the run's recent steps makes every rank write its Python
stacks into the run folder, and the run ends with its own, restartable exit code."""

from __future__ import annotations

import json

import pytest
from conftest import TINY_RUN, launch

HANG_TRAIN = "tests/scripts/hang_train.py"


@pytest.mark.slow
def test_a_rank_hung_in_a_collective_leaves_every_ranks_stacks(tiny_data, tmp_path):
    """One 2-rank run to its hung step 6, then the 4 s limit and the 3 s grace (near a minute on
    2 cores): the watch needs a few steps' history before it judges."""
    out = tmp_path / "run"
    extra = ["--steps", "12", "--save-every", "0", "--hang-factor", "5", "--hang-floor-s", "4"]
    extra += ["--dist-timeout", "300"]  # the soft limit must come first
    r = launch(
        ["--data", str(tiny_data), "--out", str(out), *TINY_RUN, *extra],
        env={"ZEROSTACK_TEST_HANG_STEP": "6"},
        check=False,
        script=HANG_TRAIN,
    )
    text = r.stdout + r.stderr
    ended = json.loads((out / "exit.json").read_text())
    assert (ended["code"], ended["meaning"]) == (6, "hung"), text[-3000:]
    assert "step 6 ran" in ended["reason"]
    hung = (out / "hang" / "rank1.txt").read_text()
    waiting = (out / "hang" / "rank0.txt").read_text()
    assert "step 6 has run" in hung and "step 6 has run" in waiting
    # where each rank was: rank 1 in the barrier nobody joins, rank 0 in the step's collective
    assert "wait_for_a_peer_that_never_comes" in hung and "barrier" in hung
    assert "training/engines/ds.py" in waiting, waiting  # in the step, in DeepSpeed's collective
    assert "torch/distributed" in waiting or "deepspeed/comm" in waiting, waiting
    assert "wait_for_a_peer_that_never_comes" not in waiting
