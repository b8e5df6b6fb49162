"""A resume that changes the recipe (sequence length, global batch, data) is the user's decision:
refused in one line naming what changed, before any work, unless asked for with
--allow-recipe-change; a context extension asked for trains on and is recorded in the run."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import TINY_RUN, launch, read_metrics
from training.checkpoints import layout

# TINY_RUN trains 64-token sequences, 2 per step on 1 rank; the tiny preset has 256 positions.
TAIL = ["--steps", "4", "--save-every", "0"]


pytestmark = pytest.mark.slow  # checkpoints of real runs, resumed


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory):
    """A 1-rank run of 2 steps, saved at its end (step 2)."""
    out = tmp_path_factory.mktemp("recipe") / "run"
    launch(["--data", str(tiny_data), "--out", str(out), *TINY_RUN, "--steps", "2"], nproc=1)
    return out


def tree(path):
    return {
        str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def changed_data(tiny_data, tmp_path):
    """The same shards under a manifest that says something else: other data, as a resume
    sees it (a re-prepared folder at the same path looks the same)."""
    copy = tmp_path / "other"
    shutil.copytree(tiny_data, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["source_detail"] += " (re-prepared)"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


CASES = {  # name: (flags over TINY_RUN, what the line says)
    "longer sequences": (
        ["--seq-len", "128"],
        "was trained with sequence length 64, this run asks for --seq-len 128: resume with the "
        "checkpoint's --seq-len, or change it on purpose with --allow-recipe-change seq_len",
    ),
    "past the positions": (
        ["--seq-len", "512"],
        "--seq-len 512, beyond its model's 256 positions",
    ),
    "longer than the validation split": (
        ["--seq-len", "200000", "--allow-recipe-change", "seq_len"],
        "the val split of",
    ),
    "another global batch": (
        ["--grad-accum", "2"],
        "global batch 2, this run asks for --global-batch 4",
    ),
    "other data": (None, "was trained with data sha256"),
    "allowed, but not this": (
        ["--grad-accum", "2", "--allow-recipe-change", "seq_len"],
        "--allow-recipe-change global_batch",
    ),
    "an unknown part": (
        ["--allow-recipe-change", "seq_len,lr"],
        "--allow-recipe-change seq_len,lr: lr is not a part of the recipe",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_resume_that_changes_the_recipe_is_refused(
    case, trained, tiny_data, tmp_path, capsys, monkeypatch
):
    from training.train import main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    extra, says = CASES[case]
    data = tiny_data if extra is not None else changed_data(tiny_data, tmp_path)
    argv = ["--data", str(data), "--out", str(trained), *TINY_RUN, *TAIL, *(extra or [])]
    before, data_before = tree(trained), tree(data)
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "\n" not in err, err
    assert says in err, err
    assert tree(trained) == before and tree(data) == data_before  # nothing started


def test_a_context_extension_asked_for_trains_on_and_is_recorded(trained, tiny_data, tmp_path):
    """--seq-len 128 --allow-recipe-change seq_len over a 64-token checkpoint: it resumes at
    step 2, says so, records the change in the record and in metrics.jsonl, and its checkpoint
    holds the new recipe (so the next resume needs no flag)."""
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    argv = ["--data", str(tiny_data), "--out", str(out), *TINY_RUN, "--steps", "3"]
    p = launch([*argv, "--seq-len", "128", "--allow-recipe-change", "seq_len"], nproc=1)
    assert (
        "recipe changed at step 2 (--allow-recipe-change): seq_len 64 -> 128" in p.stdout + p.stderr
    )
    record = json.loads((out / "resolved_config.json").read_text())
    assert record["resume"]["recipe_changes"] == {"seq_len": {"from": 64, "to": 128}}
    [change] = read_metrics(out, "recipe_change")
    assert change["step"] == 2 and change["changes"]["seq_len"] == {"from": 64, "to": 128}
    assert read_metrics(out)[-1]["step"] == 3
    state = layout.load_trainer_state(out / "checkpoints", "step_00000003")
    assert state["seq_len"] == 128 and state["global_batch"] == 2
