"""Tensor parallelism (DeepSpeed AutoTP, ds_configs/tp2.json) and sequence parallelism (Ulysses,
ds_configs/sp2.json) end to end: real 2- and 4-rank runs of the tiny preset against one rank
with the same global batch on the same samples, the layout each rank reports, and the
combinations refused in one line before any work."""

from __future__ import annotations

import json

import pytest
from conftest import TINY_RUN, ds_variant, launch, read_metrics, refused

STEPS = ["--steps", "10", "--save-every", "-1"]
SHAPES = "tests/scripts/shapes_train.py"
TP2 = ["--ds_config", "ds_configs/tp2.json"]
SP2 = ["--ds_config", "ds_configs/sp2.json"]


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    """Global batch 2 sequences of 64 tokens everywhere (micro-batch 2, one data-parallel
    replica): 1 rank against tp2 and sp2 on 2 ranks, in bf16 (the shipped configs) and in fp32,
    where sp2 runs ZeRO-3 (its gradient averaging differs from ZeRO 0-2's)."""
    base = tmp_path_factory.mktemp("parallel")
    fp32 = {"bf16": None}
    plans = {
        "one": (1, ["--ds_config", "ds_configs/zero2.json"]),
        "tp2": (2, ["--ds_config", "ds_configs/tp2.json"]),
        "sp2": (2, ["--ds_config", "ds_configs/sp2.json"]),
        "one_fp32": (1, ["--ds_config", "ds_configs/fp32.json"]),
        "tp2_fp32": (2, ds_variant(base, "tp2_fp32", "tp2.json", **fp32)),
        "sp2_z3_fp32": (
            2,
            ds_variant(
                base,
                "sp2_z3",
                "sp2.json",
                bf16=None,
                zero_optimization={"stage": 3, "reduce_bucket_size": "auto"},
            ),
        ),
    }
    out = {}
    for name, (nproc, cfg) in plans.items():
        shapes = base / f"{name}_shapes"
        shapes.mkdir()
        args = ["--data", str(tiny_data), "--out", str(base / name), *TINY_RUN, *STEPS, *cfg]
        launch(args, nproc=nproc, script=SHAPES, env={"ZEROSTACK_TEST_SHAPES_DIR": str(shapes)})
        out[name] = base / name
    return out


def close(a, b, rel):
    return abs(a - b) <= rel * abs(b)


def losses(run):
    return [r["loss"] for r in read_metrics(run)]


def shapes(run, rank):
    return json.loads((run.parent / f"{run.name}_shapes" / f"rank{rank}.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, ref, rel",
    [("tp2", "one", 2e-2), ("tp2_fp32", "one_fp32", 1e-4)],
)
def test_tp2_follows_one_rank_and_halves_the_split_layers(runs, name, ref, rel):
    got, want = read_metrics(runs[name]), read_metrics(runs[ref])
    assert len(got) == len(want) == 10
    for a, b in zip(got, want, strict=True):
        assert close(a["loss"], b["loss"], rel), (losses(runs[name]), losses(runs[ref]))
        assert close(a["grad_norm"], b["grad_norm"], 10 * rel), (a, b)
        assert a["tokens"] == b["tokens"] == 2 * 64 * a["step"]  # one replica: the same batch
    assert got[-1]["loss"] < got[0]["loss"] - 0.3  # it trains
    whole = shapes(runs[ref], 0)["params"]
    for rank in (0, 1):
        mine = shapes(runs[name], rank)["params"]
        for param, dims in whole.items():
            # column splits (wq, wk, wv, w1, w3) halve the output features, row splits (wo, w2)
            # the inputs; the norms stay whole on every rank
            split = [i for i, (a, b) in enumerate(zip(mine[param], dims, strict=True)) if a != b]
            if param.endswith("norm.weight"):
                assert mine[param] == dims
            else:
                assert len(split) == 1 and mine[param][split[0]] * 2 == dims[split[0]], param
                assert split[0] == (1 if param.split(".")[-2] in ("wo", "w2") else 0), param
    resolved = json.loads((runs[name] / "resolved_config.json").read_text())
    assert resolved["parallel"] == {
        "world": 2,
        "pipeline": 1,
        "tensor": 2,
        "sequence": 1,
        "data": 1,
    }
    assert [r["tensor_parallel"] for r in resolved["ranks"]] == [0, 1]
    assert len({r["first_batch_sha1"] for r in resolved["ranks"]}) == 1  # a TP pair reads alike
    # whole on both ranks, and bit-identical: the embedding, each block's 2 norms, the final norm
    (same,) = read_metrics(runs[name], "replicas")
    assert same["differ"] == [] and same["checked"] == 6, same


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, ref, rel",
    [("sp2", "one", 2e-2), ("sp2_z3_fp32", "one_fp32", 1e-4)],
)
def test_sp2_follows_data_parallel_on_half_the_sequence(runs, name, ref, rel):
    got, want = read_metrics(runs[name]), read_metrics(runs[ref])
    for a, b in zip(got, want, strict=True):
        assert close(a["loss"], b["loss"], rel), (losses(runs[name]), losses(runs[ref]))
        # ZeRO-3 averages over all ranks, ZeRO-2 over replicas: a wrong scale shows here first
        assert close(a["grad_norm"], b["grad_norm"], 10 * rel), (a, b)
        assert a["tokens"] == b["tokens"]
    assert close(
        read_metrics(runs[name], "eval")[-1]["val_loss"],
        read_metrics(runs[ref], "eval")[-1]["val_loss"],
        rel,
    )
    # Each rank's blocks see half of every sequence; the reference sees all 64 positions.
    assert shapes(runs[ref], 0)["hidden"] == [2, 64, 64]
    assert shapes(runs[name], 0)["hidden"] == shapes(runs[name], 1)["hidden"] == [2, 32, 64]
    resolved = json.loads((runs[name] / "resolved_config.json").read_text())
    assert resolved["parallel"]["sequence"] == 2 and resolved["parallel"]["data"] == 1
    assert [r["sequence_parallel"] for r in resolved["ranks"]] == [0, 1]
    # ZeRO-2: all 20 parameters whole and bit-identical on both ranks; ZeRO-3: shards, none
    (same,) = read_metrics(runs[name], "replicas")
    assert same["differ"] == [] and same["checked"] == (0 if "z3" in name else 20), same


@pytest.mark.slow
def test_tp2_x_dp2_on_four_ranks_shards_data_between_tp_groups(tiny_data, tmp_path):
    out = tmp_path / "tp2dp2"
    args = ["--data", str(tiny_data), "--out", str(out), *TINY_RUN, "--steps", "2"]
    launch([*args, "--ds_config", "ds_configs/tp2.json", "--save-every", "-1"], nproc=4)
    resolved = json.loads((out / "resolved_config.json").read_text())
    assert resolved["parallel"] == {
        "world": 4,
        "pipeline": 1,
        "tensor": 2,
        "sequence": 1,
        "data": 2,
    }
    ranks = resolved["ranks"]
    assert [(r["data_parallel"], r["tensor_parallel"]) for r in ranks] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    sha = [r["first_batch_sha1"] for r in ranks]
    assert sha[0] == sha[1] and sha[2] == sha[3] and sha[0] != sha[2]
    assert read_metrics(out)[-1]["tokens"] == 2 * 2 * 2 * 64  # 2 replicas x micro 2 x 2 steps
    # The 6 whole parameters on all 4 ranks, and each of the 14 split ones' 2 slices on the 2
    # ranks holding it (one per replica): bit-identical
    (same,) = read_metrics(out, "replicas")
    assert same["differ"] == [] and same["checked"] == 6 + 14 * 2, same


@pytest.mark.slow
def test_tp2_continues_a_folder_from_its_exact_weights(tiny_data, tmp_path):
    """bf16 from a folder: the fp32 master weights are set from the folder's, each rank taking
    its slice of the split layers (a whole matrix copied into a slice would move the weights
    and the losses from the second step on)."""
    from models import build_model

    folder = tmp_path / "init"
    build_model("tiny", vocab_size=512).save_pretrained(folder)
    common = ["--data", str(tiny_data), *TINY_RUN, "--model", str(folder), "--steps", "4"]
    common += ["--save-every", "-1"]
    launch([*common, "--out", str(tmp_path / "one"), "--ds_config", "ds_configs/zero1.json"], 1)
    launch([*common, "--out", str(tmp_path / "tp2"), *TP2], 2)
    got, want = losses(tmp_path / "tp2"), losses(tmp_path / "one")
    assert all(close(a, b, 2e-3) for a, b in zip(got, want, strict=True)), (got, want)


# ------------------------------------------------------------------------------ guardrails
@pytest.fixture
def base(tiny_data, tmp_path):
    return ["--data", str(tiny_data), "--out", str(tmp_path / "run"), "--model", "tiny"]


def test_world_not_divisible_by_the_layout_is_refused(capsys, monkeypatch, tmp_path, base):
    err = refused(capsys, monkeypatch, tmp_path, [*base, *TP2], world=3)
    assert "world size 3 is not divisible by tensor_parallel.autotp_size=2" in err
    err = refused(capsys, monkeypatch, tmp_path, [*base, *SP2], world=3)
    assert "world size 3 is not divisible by sequence_parallel_size=2" in err


def test_tp_with_sp_with_pipeline_or_zero3_is_refused(capsys, monkeypatch, tmp_path, base):
    both = ds_variant(tmp_path, "both", "tp2.json", sequence_parallel_size=2)
    err = refused(capsys, monkeypatch, tmp_path, [*base, *both], world=4)
    assert "do not compose" in err
    piped = ds_variant(tmp_path, "piped", "pipeline.json", sequence_parallel_size=2)
    err = refused(capsys, monkeypatch, tmp_path, [*base, *piped], world=4)
    assert "sequence_parallel_size with pipeline.stages > 1" in err
    z3 = ds_variant(tmp_path, "z3", "tp2.json", zero_optimization={"stage": 3})
    err = refused(capsys, monkeypatch, tmp_path, [*base, *z3])
    assert "tensor_parallel with ZeRO-3" in err


def test_heads_and_sequence_that_do_not_divide_are_refused(capsys, monkeypatch, tmp_path, base):
    tp3 = ds_variant(tmp_path, "tp3", "tp2.json", tensor_parallel={"autotp_size": 3})
    err = refused(capsys, monkeypatch, tmp_path, [*base, *tp3], world=3)
    assert "autotp_size=3 does not divide the model's num_attention_heads=4" in err
    sp3 = ds_variant(tmp_path, "sp3", "sp2.json", sequence_parallel_size=3)
    err = refused(capsys, monkeypatch, tmp_path, [*base, *sp3, "--seq-len", "63"], world=3)
    assert "sequence_parallel_size=3 does not divide the model's num_attention_heads=4" in err
    err = refused(capsys, monkeypatch, tmp_path, [*base, *SP2, "--seq-len", "63"])
    assert "--seq-len 63 is not divisible by sequence_parallel_size=2" in err


def test_sp_with_native_backend_or_document_masks_is_refused(capsys, monkeypatch, tmp_path, base):
    err = refused(capsys, monkeypatch, tmp_path, [*base, *SP2, "--backend", "ddp"])
    assert "sequence_parallel_size is DeepSpeed's" in err
    err = refused(capsys, monkeypatch, tmp_path, [*base, *SP2, "--doc-mask"])
    assert "--doc-mask with sequence_parallel_size > 1" in err


def test_a_model_whose_tp_plan_deepspeed_cannot_apply_is_refused(
    capsys, monkeypatch, tmp_path, base
):
    """Phi-3's plan splits its fused projections in a style AutoTP refuses inside
    deepspeed.initialize, after every rank started: refused before, naming the style."""
    from transformers import Phi3Config

    folder = tmp_path / "phi3"
    Phi3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
    ).save_pretrained(folder)
    err = refused(capsys, monkeypatch, tmp_path, [*base[:-1], str(folder), *TP2])
    assert "rowwise_split_input" in err and "partition_config" in err


def test_qk_norm_with_an_own_tp_plan_that_does_not_sum_its_gradients_is_refused(
    capsys, monkeypatch, tmp_path, base
):
    """A config's own AutoTP plan that splits the heads must sum the per-head norms' gradients
    over the group, as the model's plan does: refused without it, let through with it."""
    from training.preflight import prepare_run
    from training.settings import flags

    split = [
        {"patterns": [r".*\.w[qkv]\.weight$", r".*\.w[13]\.weight$"], "partition_type": "column"},
        {"patterns": [r".*\.w[o2]\.weight$"], "partition_type": "row"},
    ]
    summed = [{"patterns": [f".*{n}.weight$"], "partition_type": "skip", "grad_allreduce": True}
              for n in ("q_norm", "k_norm")]  # fmt: skip

    def plan(name, specs):
        own = {"autotp_size": 2, "partition_config": {"layer_specs": specs}}
        return [*base, *ds_variant(tmp_path, name, "tp2.json", tensor_parallel=own), "--qk-norm"]

    err = refused(capsys, monkeypatch, tmp_path, plan("unsummed", split))
    assert "--qk-norm with this tensor_parallel plan: it splits wq by heads but does not" in err
    assert "q_norm's gradients" in err
    prepare_run(flags.parse(plan("summed", summed + split)), 2, 0)  # no refusal
