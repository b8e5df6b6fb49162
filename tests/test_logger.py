"""Rank 0's logger: a resumed run's metrics hold each step once (the records and TensorBoard events
of the steps it redoes are dropped when it starts, and a line cut by a kill goes with them), and
W&B gets the project and run name asked for."""

from __future__ import annotations

import json
import sys
import types

import pytest
from conftest import TINY_RUN, launch, read_metrics

from training.loop.logger import RunLogger, keep_records_up_to


def test_keep_records_up_to_drops_later_steps_and_cut_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [{"kind": k, "step": s} for s in range(1, 6) for k in ("train", "eval")]
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"kind": "train", "st')
    assert keep_records_up_to(path, 3) == 5  # steps 4 and 5, twice each, and the cut line
    assert [json.loads(x) for x in path.read_text().splitlines()] == records[:6]
    assert keep_records_up_to(path, 3) == 0 and not (tmp_path / "metrics.jsonl.tmp").exists()
    assert keep_records_up_to(tmp_path / "absent.jsonl", 3) == 0


@pytest.mark.slow
def test_resumed_run_logs_each_step_once(tiny_data, tmp_path):
    run = tmp_path / "run"
    args = ["--data", str(tiny_data), "--out", str(run), *TINY_RUN, "--steps", "10"]
    args += ["--save-every", "4", "--keep-last", "5", "--eval-every", "5"]
    launch(args, nproc=1)  # saves at 4, 8 and 10; evaluates at 5 and 10
    first = {r["step"]: r for r in read_metrics(run)}
    before = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    later = sum(r.get("step", 0) > 8 for r in before)  # train 9 and 10, eval 10, and the like
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 1')  # a line cut by a kill, no newline
    # Roll back to step 8 in the same folder: steps 9 and 10 are trained, logged and evaluated again.
    p = launch([*args, "--resume", str(run / "checkpoints" / "step_00000008")], nproc=1)
    assert later >= 3 and f"{later + 1} lines after step 8 dropped" in p.stdout

    lines = (run / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines]  # every line whole
    for kind, steps in (("train", list(range(1, 11))), ("eval", [5, 10])):
        assert [r["step"] for r in records if r["kind"] == kind] == steps
    train = {r["step"]: r for r in read_metrics(run)}
    assert all(train[s] == first[s] for s in range(1, 9))  # the first launch's, untouched
    assert all(train[s]["time"] > first[10]["time"] for s in (9, 10))  # the second launch's

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard")).Reload().Scalars("train/loss")
    assert [e.step for e in events] == list(range(1, 11))


def test_wandb_gets_the_project_and_run_name(tmp_path, monkeypatch):
    """W&B itself is an optional extra (not installed here): a stand-in module records what the
    logger hands it."""
    calls = []

    class Run:
        def log(self, data, step):
            calls.append(("log", data, step))

        def finish(self):
            calls.append(("finish",))

    def init(**kw):
        calls.append(("init", kw))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    run = tmp_path / "my-run"
    run.mkdir()
    for project, name, want in ((None, None, ("zerostack", "my-run")), ("p", "n", ("p", "n"))):
        calls.clear()
        log = RunLogger(run, True, 10, 0, wandb=True, wandb_project=project, run_name=name)
        log.log({"kind": "train", "step": 3, "loss": 2.5})
        log.close()
        kw = calls[0][1]
        assert (kw["project"], kw["name"]) == want and kw["dir"] == str(run)
        assert calls[1:] == [("log", {"train/loss": 2.5}, 3), ("finish",)]
    log = RunLogger(run, True, 10, 0, wandb=False)  # no --wandb: W&B untouched
    log.close()
    assert calls[-1] == ("finish",)
