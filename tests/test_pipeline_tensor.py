"""3D parallelism end to end (ds_configs/pipeline_tp2.json: pipeline stages split over
tensor-parallel groups, ZeRO-1 over the replicas): real 4-rank pp2 x tp2 runs of the tiny preset
in fp32 against ZeRO-1 on one rank with the same global batch; exact resume, export, and the
layouts refused in one line before any work."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_RUN, ds_variant, launch, read_metrics, refused

STEPS = ["--steps", "10", "--grad-accum", "4"]
COLUMN = ("wq", "wk", "wv", "w1", "w3")  # split along output features (dim 0)
ROW = ("wo", "w2")  # split along input features (dim 1)


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    """Global batch 8 sequences of 64 tokens everywhere (4 micro-batches of 2, one replica), in
    fp32: ZeRO-1 on 1 rank, pp2 x tp2 on 4 ranks (saved at steps 5 and 10), and pp2 x tp2
    resumed from its step 5 in another folder. Each 4-rank launch takes minutes on 2 shared
    cores (4 processes, DeepSpeed's start-up and process groups each): hence the slow tier."""
    base = tmp_path_factory.mktemp("pipeline_tensor")
    pptp = ds_variant(base, "pptp", "pipeline_tp2.json", bf16=None)
    zero1 = ds_variant(base, "zero1", "zero1.json", bf16=None)

    def run(name, cfg, *extra, nproc=4):
        args = ["--data", str(tiny_data), "--out", str(base / name), *TINY_RUN, *STEPS, *cfg]
        launch([*args, *extra], nproc=nproc, timeout=900)
        return base / name

    out = {
        "zero1": run("zero1", zero1, "--save-every", "0", nproc=1),
        "pptp": run("pptp", pptp, "--save-every", "5"),
    }
    step5 = out["pptp"] / "checkpoints" / "step_00000005"
    out["resumed"] = run("resumed", pptp, "--resume", str(step5), "--save-every", "0")
    return out


def close(a, b, rel):
    return abs(a - b) <= rel * abs(b)


@pytest.mark.slow
def test_pp2_x_tp2_follows_zero1_on_one_rank(runs):
    got, want = read_metrics(runs["pptp"]), read_metrics(runs["zero1"])
    assert [r["step"] for r in got] == list(range(1, 11))
    # Step 1 runs the initial weights: each stage holds exactly its slices of the whole model's,
    # so the loss is ZeRO-1's up to the order of fp32 sums (tp2 against one rank holds 4.2e-6).
    assert close(got[0]["loss"], want[0]["loss"], 4.2e-6), (got[0], want[0])
    assert close(got[0]["grad_norm"], want[0]["grad_norm"], 1e-5), (got[0], want[0])
    for a, b in zip(got, want, strict=True):  # then the same updates: fp32 rounding only
        assert close(a["loss"], b["loss"], 1e-4), (
            [r["loss"] for r in got],
            [r["loss"] for r in want],
        )
        assert close(a["grad_norm"], b["grad_norm"], 1e-3), (a, b)
        assert a["tokens"] == b["tokens"] == 8 * 64 * a["step"]
    assert got[-1]["loss"] < got[0]["loss"] - 0.3  # it trains
    resolved = json.loads((runs["pptp"] / "resolved_config.json").read_text())
    assert resolved["parallel"] == {
        "world": 4,
        "pipeline": 2,
        "tensor": 2,
        "sequence": 1,
        "data": 1,
    }
    coords = [(r["pipeline_stage"], r["tensor_parallel"]) for r in resolved["ranks"]]
    assert coords == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len({r["first_batch_sha1"] for r in resolved["ranks"]}) == 1  # one replica's data
    # bit-identical on the ranks holding them whole: the tied embedding (first and last stage),
    # each block's 2 norms and the final norm (the 2 ranks of a stage's tensor-parallel group)
    (same,) = read_metrics(runs["pptp"], "replicas")
    assert same["differ"] == [] and same["checked"] == 6, same


@pytest.mark.slow
def test_each_stage_holds_half_of_every_split_layer(runs):
    """The layer files of block 1 (stage 0) and block 2 (stage 1): one per tensor-parallel
    rank, each with half of every projection; the norms whole on both."""
    from training.runtime import safe_load

    step = runs["pptp"] / "checkpoints" / "step_00000005"
    for layer in (1, 2):
        parts = [
            safe_load.load(step / f"layer_{layer:02d}-model_{t:02d}-model_states.pt")
            for t in (0, 1)
        ]
        for name, mine in parts[0].items():
            kind = name.split(".")[-2]
            assert mine.shape == parts[1][name].shape, name
            if kind in COLUMN or kind in ROW:
                dim = 0 if kind in COLUMN else 1
                whole = torch.cat([p[name] for p in parts], dim)
                assert whole.shape[dim] == 2 * mine.shape[dim], name
                assert not torch.equal(parts[0][name], parts[1][name]), name
            else:
                assert torch.equal(mine, parts[1][name]), name  # replicated


@pytest.mark.slow
def test_the_memory_plan_counts_a_pp2_x_tp2_rank(runs):
    """What the memory plan counts for a pp2 x tp2 rank (its stage's layers, half of each
    block's projections, ZeRO-1 over its one replica) against what the fullest rank held
    (`state_bytes` in metrics.jsonl): the parameters within 2% (counting the whole model on
    every rank is 2.2x over), the fp32 master weights and Adam moments too, plus one buffer the
    size of the tied embedding in fp32 the walk files under them. (This fp32 run is measured
    after the pipeline's step, where ZeRO-1 has freed the gradients and the reduce bucket; bf16's
    BF16_Optimizer keeps its fp32 gradients, and the bf16 `small` rows of docs/parallelism.md
    match the plan to the byte.)"""
    from training.memory.plan import plan
    from training.memory.shape import shape_of_run

    resolved = json.loads((runs["pptp"] / "resolved_config.json").read_text())
    measured = read_metrics(runs["pptp"], "state_bytes")[0]
    shape = shape_of_run(resolved)
    per_rank = plan(shape, resolved["ds_config"], resolved["world"]).per_rank
    planned = per_rank["params"]["device"]
    assert abs(planned - measured["params_bytes"]) <= 0.02 * planned, (planned, measured)
    planned = per_rank["optimizer"]["device"]
    embedding = 4 * shape.vocab * shape.hidden
    assert planned <= measured["optimizer_bytes"] <= 1.01 * (planned + embedding), measured


@pytest.mark.slow
def test_pp2_x_tp2_resume_is_exact(runs):
    a, b = read_metrics(runs["pptp"]), read_metrics(runs["resumed"])
    assert [r["step"] for r in b] == [6, 7, 8, 9, 10]
    assert [r["loss"] for r in a[5:]] == [r["loss"] for r in b]  # bitwise on CPU
    assert [r["grad_norm"] for r in a[5:]] == [r["grad_norm"] for r in b]
    assert read_metrics(runs["resumed"], "replicas")[0]["differ"] == []


@pytest.mark.slow
def test_pp2_x_tp2_exports_the_model_zero1_trains(runs, tiny_data, tmp_path):
    """The 3D checkpoint's slices joined per stage into the same stock-transformers folder
    ZeRO-1's gives, and its logits are the run's: its validation loss is the run's last."""
    from transformers import AutoModelForCausalLM

    from data import TokenDataset, eval_batches
    from training.checkpoints.hf_export import main as export_main

    hf = {}
    for name in ("pptp", "zero1"):
        assert export_main([str(runs[name]), "--out", str(tmp_path / name)]) == 0
        hf[name] = AutoModelForCausalLM.from_pretrained(tmp_path / name).eval()
    assert type(hf["pptp"]).__name__ == "LlamaForCausalLM"
    a, b = hf["pptp"].state_dict(), hf["zero1"].state_dict()
    assert sorted(a) == sorted(b)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4
    val = TokenDataset(tiny_data, "val", 64)
    with torch.no_grad():
        losses = [
            F.cross_entropy(hf["pptp"](input_ids=x).logits.flatten(0, 1), y.flatten()).item()
            for x, y in eval_batches(val, 2, 0, 1, max_samples=8)
        ]
    ran = read_metrics(runs["pptp"], "eval")[-1]["val_loss"]
    assert close(sum(losses) / len(losses), ran, 1e-5), (losses, ran)


# (ranks, shipped config, batch flags giving the same 8 sequences a step) in fp32
MOVES = {
    "one_rank": (1, "zero1.json", ["--grad-accum", "4"]),
    "tp2": (2, "tp2.json", ["--grad-accum", "4"]),
    "pp2": (2, "pipeline.json", ["--grad-accum", "4"]),
    "zero2_x2": (2, "fp32.json", ["--grad-accum", "2"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MOVES))
def test_pp2_x_tp2_resumes_universally(runs, tiny_data, tmp_path, name):
    """pp2 x tp2's step 5 resumed through a universal copy (each stage's slices joined, every
    parameter whole under the model's names) on another layout for steps 6 and 7: the same
    losses as the 3D run's own, so weights, moments and step count carried over."""
    nproc, cfg, batch = MOVES[name]
    step5 = runs["pptp"] / "checkpoints" / "step_00000005"
    args = ["--data", str(tiny_data), "--out", str(tmp_path / name), *TINY_RUN, *STEPS, *batch]
    args += [*ds_variant(tmp_path, name, cfg, bf16=None), "--resume", str(step5)]
    p = launch([*args, "--stop-at", "7", "--save-every", "0"], nproc=nproc, timeout=900)
    assert "universal: saved on 4 ranks, ZeRO-1, 2 tensor-parallel, 2 pipeline stages" in (
        p.stdout + p.stderr
    )
    got, ref = read_metrics(tmp_path / name), read_metrics(runs["pptp"])
    assert [r["step"] for r in got] == [6, 7]
    for a, b in zip(got, ref[5:7], strict=True):
        assert close(a["loss"], b["loss"], 1e-5), (a, b)
        assert a["tokens"] == b["tokens"]
    if nproc > 1:  # each rank loaded its part: the whole copies alike
        assert read_metrics(tmp_path / name, "replicas")[0]["differ"] == []


@pytest.fixture
def base(tiny_data, tmp_path):
    return ["--data", str(tiny_data), "--out", str(tmp_path / "run"), "--model", "tiny"]


def test_3d_layouts_that_do_not_divide_are_refused(capsys, monkeypatch, tmp_path, base):
    pptp = ["--ds_config", "ds_configs/pipeline_tp2.json"]
    err = refused(capsys, monkeypatch, tmp_path, [*base, *pptp], world=6)
    assert (
        "world size 6 is not divisible by pipeline.stages=2 x tensor_parallel.autotp_size=2" in err
    )
    tp3 = ds_variant(tmp_path, "tp3", "pipeline_tp2.json", tensor_parallel={"autotp_size": 3})
    err = refused(capsys, monkeypatch, tmp_path, [*base, *tp3], world=6)
    assert "autotp_size=3 does not divide the model's num_attention_heads=4" in err
    tp4 = ds_variant(tmp_path, "tp4", "pipeline_tp2.json", tensor_parallel={"autotp_size": 4})
    err = refused(capsys, monkeypatch, tmp_path, [*base, *tp4], world=8)
    assert "autotp_size=4 does not divide the model's num_key_value_heads=2" in err
    err = refused(capsys, monkeypatch, tmp_path, [*base, *pptp, "--pipeline-stages", "3"], world=6)
    assert "pipeline.stages=3 is more than the model's 2 blocks" in err
    sp = ds_variant(tmp_path, "sp", "pipeline.json", sequence_parallel_size=2)
    err = refused(capsys, monkeypatch, tmp_path, [*base, *sp], world=4)
    assert "sequence_parallel_size with pipeline.stages > 1" in err
