"""`python -m benchmarks.time_to_loss`: the arms run in interleaved rounds, each stops at the
target or says it did not reach it, the raw file holds every round, the medians and the ratios,
and the docs table is drawn from it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from conftest import REPO

from benchmarks import docs_tables
from benchmarks import time_to_loss as ttl

ROW_KEYS = {"arm", "round", "curve", "startup_s", "best_val_loss", "reached"}
REACHED_KEYS = {"wall_to_target_s", "train_to_target_s", "steps_to_target", "tokens_to_target"}


def job(**changes) -> SimpleNamespace:
    a = ttl.parser().parse_args(["--rounds", "2", "--results", "x.json"])
    a.argv = ["--rounds", "2"]
    return SimpleNamespace(**{**vars(a), **changes})


def fake_run(arm: str, rnd: int, a, init: str) -> dict:
    """A run that reaches the target in `round` x 10 seconds, except the Trainer's."""
    if arm == "zerostack_muon":
        return {"arm": arm, "round": rnd, "not_available": "no --optimizer muon"}
    row = {"arm": arm, "round": rnd, "curve": [[10, 5.0 * rnd, 5.5]], "startup_s": 2.0}
    if arm == "hf_trainer":
        return {**row, "best_val_loss": 5.5, "reached": False}
    wall = 10.0 * rnd + (20 if arm == "nanogpt" else 0)
    row.update(best_val_loss=5.1, reached=True, wall_to_target_s=wall)
    return {**row, "train_to_target_s": wall - 2, "steps_to_target": 20, "tokens_to_target": 99}


def test_rounds_interleave_every_arm_and_ask_an_absent_one_once():
    rows = ttl.run_rounds(job(rounds=3), ttl.ARMS, "init", run=fake_run)
    order = [(r["round"], r["arm"]) for r in rows]
    others = [arm for arm in ttl.ARMS if arm != "zerostack_muon"]
    assert order == [(1, "zerostack"), (1, "zerostack_muon"), (1, "zerostack_wsd")] + [
        (1, "nanogpt"),
        (1, "hf_trainer"),
        *[(rnd, arm) for rnd in (2, 3) for arm in others],
    ]
    assert ttl.interleaved(["a", "b"], 2) == [(1, "a"), (1, "b"), (2, "a"), (2, "b")]


def test_the_raw_file_holds_rounds_medians_ratios_and_renders(tmp_path):
    a = job()
    rows = ttl.run_rounds(a, ttl.ARMS, "init", run=fake_run)
    path = tmp_path / ttl.RAW
    doc = ttl.save(rows, a, ttl.ARMS, path, {"class": "a test host; shared", "cores": 2})
    assert json.loads(path.read_text()) == doc
    assert {"command", "date", "host", "job", "order", "rounds", "summary", "ratios"} <= set(doc)
    assert doc["order"][:2] == [[1, "zerostack"], [1, "zerostack_muon"]]
    assert doc["order"][-1] == [2, "hf_trainer"]
    s = doc["summary"]
    assert s["zerostack"]["wall_to_target_s"] == {"median": 15.0, "min": 10.0, "max": 20.0}
    assert s["zerostack"]["reached"] == 2 and s["hf_trainer"]["reached"] == 0
    assert s["zerostack_muon"] == {"not_available": "no --optimizer muon"}
    assert doc["ratios"]["zerostack"] == {"nanogpt": 15.0 / 35.0, "hf_trainer": None}
    table = ttl.section(tmp_path)
    assert "| zerostack | 2/2 | 15 (10-20) | 13 (8-18) | 99 | 20 | 0.43x |  | a test host," in table
    assert "| zerostack_muon | not available |" in table
    assert "| hf_trainer | 0/2 (best 5.500) |" in table
    assert "No raw result committed yet" in ttl.section(tmp_path / "none")
    section = next(x for x in docs_tables.SECTIONS if x.name == "time_to_loss")
    docs = docs_tables.render_all(REPO, tmp_path, [section])
    assert "| zerostack | 2/2 | 15 (10-20) |" in docs["docs/benchmarks.md"]


def test_muon_not_available_is_reported_without_a_launch(monkeypatch, tmp_path):
    monkeypatch.setattr(ttl, "muon_available", lambda: False)
    row = ttl.run_arm("zerostack_muon", 1, job(runs=str(tmp_path)), "init")
    assert row == {"arm": "zerostack_muon", "round": 1, "not_available": row["not_available"]}
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_every_arm_runs_to_a_loose_target(tiny_data, tmp_path):
    """Tiny, one rank, 25 steps (the trainer's default warmup of 20 and WSD's decay of 5),
    uncompiled: each arm reaches a loss a few steps of nanoGPT's recipe reach, or says it did
    not, with its curve; the table is drawn from the file."""
    raw = tmp_path / "results" / ttl.RAW
    argv = ["--model", "tiny", "--data", str(tiny_data), "--seq-len", "64", "--ranks", "1"]
    argv += ["--micro-batch", "2", "--steps", "25", "--eval-every", "2", "--eval-samples", "8"]
    argv += ["--target", "6.2", "--rounds", "1", "--max-minutes", "2", "--eager"]
    assert ttl.main([*argv, "--runs", str(tmp_path / "runs"), "--results", str(raw)]) == 0
    d = json.loads(raw.read_text())
    assert d["order"] == [[1, arm] for arm in ttl.ARMS]
    assert d["job"]["target"] == 6.2 and d["tokens_per_step"] == 128
    assert {"class", "cpu", "torch", "capability", "cores"} <= set(d["host"])
    for row in d["rounds"]:
        if "not_available" in row:
            continue
        assert ROW_KEYS <= set(row) and "error" not in row, row
        assert row["curve"] and row["startup_s"] > 0
        assert row["best_val_loss"] == min(v for _, _, v in row["curve"])
        if row["reached"]:
            assert REACHED_KEYS <= set(row) and any(v <= 6.2 for _, _, v in row["curve"])
            assert row["tokens_to_target"] == 128 * row["steps_to_target"]
            assert row["wall_to_target_s"] > row["train_to_target_s"] > 0
        else:
            assert row["best_val_loss"] > 6.2
    assert d["summary"]["nanogpt"]["reached"] == 1  # its warmup is 1 step at this horizon
    assert "| nanogpt | 1/1 |" in ttl.section(raw.parent)
