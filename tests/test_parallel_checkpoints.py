"""Checkpoints of tensor-parallel (AutoTP) and sequence-parallel (Ulysses) runs: exact resume on
the same layout, universal resume on another, and export to a stock Hugging Face folder.

Real 2-rank runs of the tiny preset (slow tier). `tp_runs`: a tp2 run (ds_configs/tp2.json, one
data-parallel replica, micro-batch 2) saving every step; from its step 2, a tp2 run that must
repeat step 3 bit for bit, a 1-rank ZeRO-1 run (micro-batch 2: the same 2 sequences) through a
universal copy, and that run continued on tp2 again (the way back). `sp_runs`: from the tp2
run's step 2, an sp2 run (ds_configs/sp2.json) to step 3, and from that, a plain data-parallel
ZeRO-2 run on 2 ranks (micro-batch 1 each: the same 2 sequences) to step 4; both through a
universal copy, both compared with the tp2 run (the three layouts train the same model on the
same samples). A universal step must match the uninterrupted run's loss and, after it, its
fp32 weights and both Adam moments within bf16 noise (the bounds of tests/test_universal.py,
which still catch a lost moment or a weight joined on the wrong axis).

Exports are checked twice: the export's own reload check (stock transformers against our model
holding the merged weights) and, independently of the merge, the stock model's loss on the next
step's batch against the loss the parallel run logged for that step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_state, launch, loss_at, read_metrics, step_dir
from transformers import AutoModelForCausalLM

from data import BatchLoader
from data.mixture import open_split
from training.checkpoints import layout as ckpt
from training.checkpoints.hf_export import export_report
from training.checkpoints.universal_copy import Topology, plan
from training.errors import CheckpointError

ARGS = [
    "--model", "tiny", "--seq-len", "64", "--log-every", "1", "--eval-every", "0",
    "--eval-samples", "8", "--lr", "3e-3", "--warmup", "2", "--steps", "4",
    "--peak-tflops", "1",  # no matmul-ceiling measurement: MFU is not what these tests check
]  # fmt: skip
TP2 = ["--ds_config", "ds_configs/tp2.json", "--micro-batch", "2"]
SP2 = ["--ds_config", "ds_configs/sp2.json", "--micro-batch", "2"]
BF16_STEP = {"fp32": 1e-3, "exp_avg": 2e-2, "exp_avg_sq": 2e-2}  # as tests/test_universal.py


def run(data, out, *extra, nproc=2):
    p = launch(["--data", str(data), "--out", str(out), *ARGS, *extra], nproc=nproc)
    return p.stdout + p.stderr


@pytest.fixture(scope="module")
def tp_runs(tiny_data, tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("tp_checkpoints")
    ref, exact, moved = base / "tp2", base / "tp2_again", base / "one_rank"
    run(tiny_data, ref, *TP2, "--save-every", "1", "--keep-last", "10")
    resume = ["--resume", str(step_dir(ref, 2)), "--stop-at", "3", "--save-every", "0"]
    run(tiny_data, exact, *TP2, *resume)
    one = ["--ds_config", "ds_configs/zero1.json", "--micro-batch", "2"]
    logs = {"one": run(tiny_data, moved, *one, *resume, nproc=1)}
    logs["back"] = run(tiny_data, moved, *TP2, "--stop-at", "4", "--save-every", "0")
    return {"ref": ref, "exact": exact, "moved": moved, "logs": logs}


@pytest.fixture(scope="module")
def sp_runs(tp_runs, tiny_data, tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("sp_checkpoints")
    sp, dp = base / "sp2", base / "dp"
    resume = ["--resume", str(step_dir(tp_runs["ref"], 2)), "--stop-at", "3", "--save-every", "0"]
    logs = {"sp": run(tiny_data, sp, *SP2, *resume)}
    resume = ["--resume", str(step_dir(sp, 3)), "--stop-at", "4", "--save-every", "0"]
    plain = ["--ds_config", "ds_configs/zero2.json", "--micro-batch", "1"]
    logs["dp"] = run(tiny_data, dp, *plain, *resume)
    return {"sp": sp, "dp": dp, "logs": logs}


@pytest.mark.slow
def test_tp2_resumes_exactly_on_tp2(tp_runs):
    ref, exact = tp_runs["ref"], tp_runs["exact"]
    assert [r["step"] for r in read_metrics(exact)] == [3]
    assert loss_at(exact, 3) == loss_at(ref, 3)  # bitwise on CPU
    assert_same_state(step_dir(ref, 3), step_dir(exact, 3), tol=0)
    # the split layers are stored as two halves, one per tensor-parallel rank
    for mp in (0, 1):
        shapes = ckpt_shapes(step_dir(ref, 3), mp)
        assert shapes["layers.0.attention.wq.weight"] == (32, 64)  # column split: half the rows
        assert shapes["layers.0.attention.wo.weight"] == (64, 32)  # row split: half the columns
        assert shapes["layers.0.attention_norm.weight"] == (64,)  # replicated


def ckpt_shapes(folder: Path, mp: int) -> dict:
    from training.checkpoints.zero_files import load_mapped

    groups = load_mapped(folder / f"mp_rank_{mp:02d}_model_states.pt")["param_shapes"]
    return {n: tuple(s) for g in groups for n, s in g.items()}


@pytest.mark.slow
def test_tp2_resumes_on_one_rank_and_back(tp_runs):
    ref, moved, logs = tp_runs["ref"], tp_runs["moved"], tp_runs["logs"]
    assert "universal: saved on 2 ranks, ZeRO-1, 2 tensor-parallel" in logs["one"]
    assert "universal: saved on 1 rank, ZeRO-1" in logs["back"]
    assert [r["step"] for r in read_metrics(moved)] == [3, 4]
    for step in (3, 4):
        assert abs(loss_at(moved, step) - loss_at(ref, step)) <= 1e-3 * loss_at(ref, step)
    # whole weights and moments on 1 rank equal the tp2 run's halves joined, after one step ...
    assert_same_state(step_dir(ref, 3), step_dir(moved, 3), tol=BF16_STEP)
    # ... and cut again into halves on the way back
    assert_same_state(step_dir(ref, 4), step_dir(moved, 4), tol=BF16_STEP)
    ts = ckpt.load_trainer_state(moved / "checkpoints", ckpt.tag_for(4))
    ts_ref = ckpt.load_trainer_state(ref / "checkpoints", ckpt.tag_for(4))
    assert ts["data"]["consumed_samples"] == ts_ref["data"]["consumed_samples"]
    assert ts["tensor_parallel"] == 2 and ts["world"] == 2


@pytest.mark.slow
def test_sp2_resumes_from_tp2_and_on_plain_data_parallel(tp_runs, sp_runs):
    ref, sp, dp, logs = tp_runs["ref"], sp_runs["sp"], sp_runs["dp"], sp_runs["logs"]
    assert "universal: saved on 2 ranks, ZeRO-1, 2 tensor-parallel" in logs["sp"]
    assert "universal: saved on 2 ranks, ZeRO-2, 2 sequence-parallel" in logs["dp"]
    assert [r["step"] for r in read_metrics(sp)] == [3]
    assert [r["step"] for r in read_metrics(dp)] == [4]
    # tp2, sp2 and plain data parallelism train the same model on the same samples
    for run_dir, step in ((sp, 3), (dp, 4)):
        assert abs(loss_at(run_dir, step) - loss_at(ref, step)) <= 1e-3 * loss_at(ref, step)
        assert_same_state(step_dir(ref, step), step_dir(run_dir, step), tol=BF16_STEP)


def next_batch_loss(model, checkpoint: Path, data: Path) -> float:
    """`model`'s loss on the batch the run trained on right after `checkpoint` (one
    data-parallel replica, micro-batch 2)."""
    state = ckpt.load_trainer_state(checkpoint.parent, checkpoint.name)
    loader = BatchLoader(
        open_split(str(data), "train", state["seq_len"]),
        2,
        0,
        1,
        state["seed"],
        state["data"]["consumed_samples"],
    )
    x, y = loader.next_batch()
    with torch.no_grad():
        logits = model(input_ids=x).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()).item()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tp", "sp"])
def test_export_from_a_parallel_checkpoint(kind, tp_runs, sp_runs, tiny_data, tmp_path):
    # the checkpoint, and a run that trained the next step from its weights
    if kind == "tp":
        src, after, step = step_dir(tp_runs["ref"], 2), tp_runs["ref"], 3
    else:
        src, after, step = step_dir(sp_runs["sp"], 3), sp_runs["dp"], 4
    hf = tmp_path / "hf"
    report = export_report(src, hf)
    assert report.max_logit_diff < 1e-4 and report.generated
    theirs = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    assert type(theirs).__name__ == "LlamaForCausalLM"
    assert theirs.model.layers[0].self_attn.q_proj.weight.shape == (64, 64)  # whole, not a half
    # independent of the merge: the loss the runs logged for the next step (bf16 forward there)
    logged = loss_at(after, step)
    loss = next_batch_loss(theirs, src, tiny_data)
    assert abs(loss - logged) <= 1e-2 * logged, (loss, logged)


def test_layout_is_part_of_the_topology():
    tp2 = {"backend": "deepspeed", "world": 2, "zero_stage": 1, "tensor_parallel": 2, "step": 4}
    sp2 = {**tp2, "zero_stage": 2, "tensor_parallel": 1, "sequence_parallel": 2}
    assert str(Topology.of_checkpoint(tp2)) == "2 ranks, ZeRO-1, 2 tensor-parallel"
    assert str(Topology.of_checkpoint(sp2)) == "2 ranks, ZeRO-2, 2 sequence-parallel"
    # a checkpoint from before the sizes were recorded was neither
    assert Topology.of_checkpoint({"world": 2, "zero_stage": 1}) == Topology("deepspeed", 2, 1)
    # same world and stage, another layout: universal; the same layout: native
    assert plan(tp2, Topology("deepspeed", 2, 1)) is True
    assert plan(tp2, Topology("deepspeed", 2, 1, tensor_parallel=2)) is False
    assert plan(sp2, Topology("deepspeed", 2, 2)) is True
    assert plan(sp2, Topology("deepspeed", 2, 2, sequence_parallel=2)) is False
    with pytest.raises(CheckpointError, match="2 ranks, ZeRO-1, 2 tensor-parallel; this run is 2"):
        plan(tp2, Topology("deepspeed", 2, 1), mode="never")
    # ZeRO-0 keeps whole weights: another sequence-parallel size loads as it is, AutoTP's not
    z0 = {**sp2, "zero_stage": 0}
    assert plan(z0, Topology("deepspeed", 4, 0)) is False
    with pytest.raises(CheckpointError, match="changing a ZeRO-0 checkpoint's layout"):
        plan({**tp2, "zero_stage": 0}, Topology("deepspeed", 2, 0))
