"""Resume on another world size or ZeRO stage: real runs, compared with an uninterrupted one.

The runs (conftest.py, `resumed_runs`): one uninterrupted 2-rank ZeRO-2 run saves after every
step. Runs resumed from its step-3 checkpoint on 1 rank (ZeRO-2 and ZeRO-1) and on 2 ranks
(ZeRO-3) take step 4 and save; a 1-rank ZeRO-3 run resumed from the 2-rank ZeRO-3 one takes step
5. The global batch is the same everywhere (2 ranks x micro 2 = 1 rank x micro 2 x accum 2), so
the loader serves the same samples and each resumed step must match the uninterrupted run's: its
loss, and after it the fp32 weights, both Adam moments and the step count. On CPU they agree bit
for bit; the bounds below allow bf16 reduction-order noise and still catch a lost moment (~40%
off after a step) or weight decay applied to the norms (~3e-4).

Pipeline checkpoints (`pipeline_runs`, below): a 2-rank pp=2 run resumes on 1 rank without
pipelining and back, across the renaming of pipeline parameters to the model's."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess

import pytest
from conftest import (
    UNIVERSAL_ARGS,
    assert_same_state,
    checkpoint_states,
    launch,
    loss_at,
    read_metrics,
    step_dir,
)

from training.checkpoints import layout as ckpt
from training.checkpoints import universal_copy
from training.checkpoints.universal_copy import Topology, ensure, plan
from training.errors import CheckpointError

pytestmark = pytest.mark.slow  # every test reads real multi-rank runs (resumed_runs, pipeline_runs)


def args(data, out, *extra):
    return ["--data", str(data), "--out", str(out), *UNIVERSAL_ARGS, *extra]


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid  # exited and reaped: no such process now


@pytest.fixture
def runs(resumed_runs):
    return resumed_runs


@pytest.mark.parametrize("name", ["z2_1rank", "z3_2rank", "z1_1rank"])
def test_zero2_two_ranks_resumes_anywhere(runs, name):
    """2 ranks ZeRO-2 -> 1 rank ZeRO-2, 2 ranks ZeRO-3, 1 rank ZeRO-1."""
    ref, run = runs["ref"], runs[name]
    log = runs["logs"][name]
    assert "universal: saved on 2 ranks, ZeRO-2" in log
    # a change of world is kept in the run's history, with the accumulation that kept the batch
    # (z3_2rank's own resume keeps 2 ranks; its continuation on one, from step 4, does not)
    worlds = [
        (r["step"], r["from"], r["to"], r["global_batch"], r["grad_accum"])
        for r in read_metrics(run, "world")
    ]
    assert worlds == [(4 if name == "z3_2rank" else 3, 2, 1, 4, 2)], worlds
    assert read_metrics(run)[0]["step"] == 4  # the first step it took
    assert abs(loss_at(run, 4) - loss_at(ref, 4)) <= 1e-3 * loss_at(ref, 4)
    assert_same_state(step_dir(ref, 4), step_dir(run, 4))
    # data position and token count carried over
    ts_ref = ckpt.load_trainer_state(ref / "checkpoints", ckpt.tag_for(4))
    ts = ckpt.load_trainer_state(run / "checkpoints", ckpt.tag_for(4))
    assert ts["data"]["consumed_samples"] == ts_ref["data"]["consumed_samples"]
    assert ts["tokens"] == ts_ref["tokens"]


def test_zero3_two_ranks_resumes_on_one(runs):
    log = runs["logs"]["z3_1rank"]
    assert "universal: saved on 2 ranks, ZeRO-3" in log
    run = runs["z3_2rank"]
    assert [r["step"] for r in read_metrics(run)][-1] == 5
    assert abs(loss_at(run, 5) - loss_at(runs["ref"], 5)) <= 1e-3 * loss_at(runs["ref"], 5)
    assert_same_state(step_dir(runs["ref"], 5), step_dir(run, 5))


def test_conversion_is_made_once_and_cached(runs):
    logs = runs["logs"]
    converted = [
        n for n in ("z2_1rank", "z3_2rank", "z1_1rank") if "universal: converted" in logs[n]
    ]
    reused = [n for n in ("z2_1rank", "z3_2rank", "z1_1rank") if "universal: reusing" in logs[n]]
    assert len(converted) == 1 and len(reused) == 2, (converted, reused)
    root = runs["ref"] / "checkpoints"
    u = root / "step_00000003_universal"
    assert ckpt.is_complete(u)
    assert (u / "zero" / "optimizer_state.pt").is_file()
    # the copy is not a checkpoint tag: resume and export never pick it as "latest"
    assert "step_00000003_universal" not in ckpt.complete_tags(root)
    assert not list(root.glob(".*partial*"))


def test_a_crash_never_leaves_a_copy_that_looks_valid(runs, tmp_path):
    root = tmp_path / "checkpoints"
    shutil.copytree(step_dir(runs["ref"], 2), root / "step_00000002")
    # a crashed conversion's leftovers: a hidden temporary folder, and a copy of an older save;
    # a conversion still running elsewhere (a live process) keeps its folder
    host = socket.gethostname()
    crashed = root / f".step_00000002_universal.partial-{host}-{_dead_pid()}"
    running = root / f".step_00000002_universal.partial-{host}-{os.getppid()}"
    for d in (crashed, running):
        (d / "zero").mkdir(parents=True)
    stale = root / "step_00000002_universal"
    shutil.copytree(runs["ref"] / "checkpoints" / "step_00000003_universal", stale)
    assert ensure(root, "step_00000002", log=lambda m: None) == "step_00000002_universal"
    assert list(root.glob(".*partial*")) == [running]
    shutil.rmtree(running)
    assert_same_state(root / "step_00000002", stale)  # re-made from step 2, not kept from 3

    # a file of the copy changed on disk: found by its CRC and made again
    f = stale / "zero" / "norm.weight" / "fp32.pt"
    raw = bytearray(f.read_bytes())
    raw[-40] ^= 0xFF
    f.write_bytes(raw)
    msgs = []
    ensure(root, "step_00000002", log=msgs.append)
    assert "converted" in msgs[0]
    ckpt.verify(stale)

    # a conversion that fails half way leaves nothing behind
    shutil.rmtree(stale)
    (bad,) = (root / "step_00000002").glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt")
    bad.write_bytes(b"not a checkpoint")
    ckpt.write_listing(root / "step_00000002")  # re-seal, so only the conversion can notice
    with pytest.raises(CheckpointError, match="unreadable"):
        ensure(root, "step_00000002", log=lambda m: None)
    assert not stale.exists() and not list(root.glob(".*partial*"))


def test_resume_rules_and_flag(runs, tiny_data, tmp_path, capsys):
    saved = ckpt.load_trainer_state(runs["ref"] / "checkpoints", "step_00000003")
    z2 = Topology("deepspeed", 2, 2)
    assert plan(saved, z2, "auto") is False
    assert plan(saved, z2, "always") is True
    assert plan(saved, Topology("deepspeed", 1, 2), "auto") is True
    assert plan(saved, Topology("deepspeed", 2, 3), "auto") is True
    with pytest.raises(CheckpointError, match="ZeRO-0"):
        plan(saved, Topology("deepspeed", 2, 0), "auto")
    with pytest.raises(CheckpointError, match="--backend deepspeed"):
        plan(saved, Topology("ddp", 2, 0), "auto")

    # --universal never: one clear line, exit 2, before any process group
    from training.train import main

    src = str(step_dir(runs["ref"], 3))
    argv = args(tiny_data, tmp_path / "r", "--resume", src, "--universal", "never")
    code = main([*argv, "--ds_config", "ds_configs/zero3.json"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "saved on 2 ranks, ZeRO-2; this run is 1 rank, ZeRO-3" in err
    assert "--universal never forbids" in err


def test_manual_conversion_command(runs, tmp_path, capsys):
    root = tmp_path / "run" / "checkpoints"
    shutil.copytree(step_dir(runs["ref"], 5), root / "step_00000005")
    assert universal_copy.main([str(tmp_path / "run")]) == 0
    assert "step_00000005_universal" in capsys.readouterr().out
    assert_same_state(root / "step_00000005", root / "step_00000005_universal", tol=0)
    listing = json.loads((root / "step_00000005_universal" / "complete.json").read_text())
    assert listing["source_tag"] == "step_00000005"
    assert universal_copy.main([str(tmp_path / "run" / "7")]) == 2
    assert "no checkpoint step_00000007" in capsys.readouterr().err


# ------------------------------------------------------------------------------ pipeline
PP2 = ["--ds_config", "ds_configs/pipeline.json", "--micro-batch", "2"]
Z1 = ["--ds_config", "ds_configs/zero1.json", "--micro-batch", "2", "--grad-accum", "4"]
# After a step, the pipeline (fp32 gradient accumulation) and ZeRO-1 without it differ by bf16
# rounding of the gradients: measured 1e-4 on the weights, 2e-3 / 5e-3 on the moments.
BF16_STEP = {"fp32": 1e-3, "exp_avg": 2e-2, "exp_avg_sq": 2e-2}


@pytest.fixture(scope="module")
def pipeline_runs(tiny_data, tmp_path_factory) -> dict:
    """`ref`: pp=2 on 2 ranks (ds_configs/pipeline.json, 4 micro-batches of 2), saving every step,
    to step 5. `run`: resumed from ref's step 3 on 1 rank without pipelining (ZeRO-1, micro 2 x
    accum 4: the same 8 sequences a step) to step 4, then the same --out re-run pipelined on 2
    ranks to step 5. Both resumes go through a universal copy; `logs` holds their output."""
    base = tmp_path_factory.mktemp("pipeline_universal")
    ref, run = base / "pp2", base / "z1"
    launch(args(tiny_data, ref, *PP2, "--save-every", "1", "--keep-last", "10", "--stop-at", "5"))
    resume = ["--resume", str(step_dir(ref, 3)), "--stop-at", "4", "--save-every", "0"]
    one = launch(args(tiny_data, run, *Z1, *resume), nproc=1)
    two = launch(args(tiny_data, run, *PP2, "--stop-at", "5", "--save-every", "0"))
    return {
        "ref": ref,
        "run": run,
        "logs": {"z1": one.stdout + one.stderr, "pp2": two.stdout + two.stderr},
    }


def test_pipeline_two_stages_resumes_on_one_rank_and_back(pipeline_runs):
    ref, run, logs = pipeline_runs["ref"], pipeline_runs["run"], pipeline_runs["logs"]
    assert "universal: saved on 2 ranks, ZeRO-1, 2 pipeline stages" in logs["z1"]
    assert "universal: saved on 1 rank, ZeRO-1" in logs["pp2"]
    assert [r["step"] for r in read_metrics(run)] == [4, 5]
    # The first step after each move runs the carried-over weights on the same samples.
    for step in (4, 5):
        assert abs(loss_at(run, step) - loss_at(ref, step)) <= 1e-3 * loss_at(ref, step)
    # Weights, both moments and the step count carried over, then one step each way.
    assert_same_state(step_dir(ref, 4), step_dir(run, 4), tol=BF16_STEP)
    assert_same_state(step_dir(ref, 5), step_dir(run, 5), tol=BF16_STEP)
    for step in (4, 5):
        ts_ref = ckpt.load_trainer_state(ref / "checkpoints", ckpt.tag_for(step))
        ts = ckpt.load_trainer_state(run / "checkpoints", ckpt.tag_for(step))
        assert ts["data"]["consumed_samples"] == ts_ref["data"]["consumed_samples"]
        assert ts["tokens"] == ts_ref["tokens"]
    assert ts["pipeline_stages"] == 2 and ts["world"] == 2


def test_pipeline_universal_copy_uses_the_model_names(pipeline_runs, tmp_path):
    ref, run = pipeline_runs["ref"], pipeline_runs["run"]
    u = ref / "checkpoints" / "step_00000003_universal"
    names = {d.name for d in (u / "zero").iterdir() if d.is_dir()}
    assert names == set(
        checkpoint_states(step_dir(run, 4))
    )  # what the unpipelined model calls them
    assert {"tok_embeddings.weight", "layers.0.attention.wq.weight", "norm.weight"} <= names
    assert_same_state(step_dir(ref, 3), u, tol=0)  # the pipeline's state, renamed, exactly
    # The sealed copy of this very checkpoint is reused wherever the two travel together.
    root = tmp_path / "checkpoints"
    shutil.copytree(step_dir(ref, 3), root / "step_00000003")
    shutil.copytree(u, root / "step_00000003_universal")
    msgs = []
    ensure(root, "step_00000003", log=msgs.append)
    assert "reusing" in msgs[0]
    saved = ckpt.load_trainer_state(ref / "checkpoints", "step_00000003")
    assert plan(saved, Topology("deepspeed", 1, 1), "auto") is True
    assert plan(saved, Topology("deepspeed", 2, 1, 2), "auto") is False
