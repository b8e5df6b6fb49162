"""Checkpoints of expert-parallel runs (AutoEP, ds_configs/moe_ep2.json): exact resume on the same
layout, universal resume on experts replicated (ep2 x dp1 -> ep1 x dp2 -> 1 rank), and export
to stock transformers' Mixtral.

`ep_runs` (slow tier: five real runs of tiny-moe, each a minute or more on 2 shared cores): an
ep2 run saving every step to step 4; from its step 2 an ep2 run that must repeat step 3 bit for
bit; from the same step a 2-rank ZeRO-2 run with every expert on every rank (ep1 x dp2) to step
3, continued on 1 rank (2 accumulation steps: the same global batch) to step 4. The universal
steps must match the uninterrupted run's loss and, after step 3, its weights and both Adam
moments within the bf16 bounds of tests/test_universal.py, which catch an expert joined in the
wrong order or a gate and up projection swapped."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import (
    TINY_RUN,
    assert_same_state,
    checkpoint_states,
    launch,
    loss_at,
    read_metrics,
    step_dir,
)
from safetensors.torch import load_file
from test_moe_training import assert_exports_as_mixtral

from training.checkpoints import layout as ckpt
from training.checkpoints.universal_copy import Topology, plan
from training.errors import CheckpointError

pytestmark = pytest.mark.slow

MOE = [a if a != "tiny" else "tiny-moe" for a in TINY_RUN] + ["--steps", "4", "--peak-tflops", "1"]
EP2 = ["--ds_config", "ds_configs/moe_ep2.json"]
BF16_STEP = {"fp32": 1e-3, "exp_avg": 2e-2, "exp_avg_sq": 2e-2}  # as tests/test_universal.py


@pytest.fixture(scope="module")
def ep_runs(tiny_data, tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("ep_checkpoints")
    ref, exact, moved = base / "ep2", base / "ep2_again", base / "replicated"

    def run(out, *extra, nproc=2):
        p = launch(["--data", str(tiny_data), "--out", str(out), *MOE, *extra], nproc=nproc)
        return p.stdout + p.stderr

    run(ref, *EP2, "--save-every", "1", "--keep-last", "10")
    resume = ["--resume", str(step_dir(ref, 2)), "--stop-at", "3", "--save-every", "1"]
    run(exact, *EP2, *resume)
    logs = {"dp2": run(moved, "--ds_config", "ds_configs/zero2.json", *resume)}
    one = ["--grad-accum", "2", "--stop-at", "4", "--save-every", "0"]
    logs["one"] = run(moved, "--ds_config", "ds_configs/zero2.json", *one, nproc=1)
    return {"ref": ref, "exact": exact, "moved": moved, "logs": logs}


def test_ep2_resumes_exactly_on_ep2(ep_runs):
    ref, exact = ep_runs["ref"], ep_runs["exact"]
    assert [r["step"] for r in read_metrics(exact) if r["kind"] == "train"] == [3]
    assert loss_at(exact, 3) == loss_at(ref, 3)  # bitwise on CPU
    assert_same_state(step_dir(ref, 3), step_dir(exact, 3), tol=0)
    # each rank's files hold its own 2 of the 4 experts; read back, all 4 under our names
    s = checkpoint_states(step_dir(ref, 3))
    assert s["layers.0.feed_forward.experts.gate_up_proj"][0].shape == (4, 176, 64)
    assert "layers.0.feed_forward.gate.weight" in s


def test_ep2_resumes_with_replicated_experts_then_on_one_rank(ep_runs):
    ref, moved, logs = ep_runs["ref"], ep_runs["moved"], ep_runs["logs"]
    assert "universal: saved on 2 ranks, ZeRO-2, 2 expert-parallel" in logs["dp2"]
    assert "universal: saved on 2 ranks, ZeRO-2" in logs["one"]
    assert [r["step"] for r in read_metrics(moved) if r["kind"] == "train"] == [3, 4]
    for step in (3, 4):
        assert abs(loss_at(moved, step) - loss_at(ref, step)) <= 1e-3 * loss_at(ref, step)
    assert_same_state(step_dir(ref, 3), step_dir(moved, 3), tol=BF16_STEP)


def test_a_universal_resume_into_expert_parallelism_is_one_line(ep_runs):
    state = ckpt.load_trainer_state(ep_runs["moved"] / "checkpoints", ckpt.tag_for(3))
    now = Topology("deepspeed", 2, 2, expert_parallel=2)
    with pytest.raises(CheckpointError, match="resumes only its own layout") as e:
        plan(state, now)
    assert "\n" not in str(e.value)


def test_ep2_checkpoint_exports_as_mixtral(ep_runs, tmp_path):
    """The export is the checkpoint's (logits, greedy tokens), and its experts are the ones each
    rank saved in its own bf16 expert files: none swapped between ranks, gate and up in place."""
    hf = tmp_path / "hf"
    assert_exports_as_mixtral(ep_runs["ref"], hf)
    exported = load_file(hf / "model.safetensors")
    folder = step_dir(ep_runs["ref"], 4)
    for layer, e in itertools.product(range(2), range(4)):
        saved = torch.load(folder / f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt")
        for w in ("w1", "w2", "w3"):
            theirs = exported[f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight"]
            ours = saved[f"layers.{layer}.feed_forward.experts.{w}.{e}"].float()
            assert (theirs.float() - ours).abs().max() <= 1e-2 * ours.abs().max(), (layer, e, w)
