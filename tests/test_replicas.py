"""Parameters kept whole beside split ones, and the replica check (training/engines/replicas.py).

Under tensor parallelism the per-head norms of `--qk-norm` (q_norm, k_norm) are whole on every
rank but applied to the rank's own heads only: real fp32 runs with them under tp2 (AutoTP, 2
ranks) and pp2 x tp2 (4 ranks) end with every whole parameter bit-identical on the ranks that
hold it, per the replica record the trainer writes, and follow ZeRO-1 on one rank with the same
global batch. A planted one-ulp difference in one rank's copy is what the check reports."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_RUN, ds_variant, launch, read_metrics

# 8 sequences of 64 tokens a step everywhere: one replica, 4 micro-batches of 2
STEPS = ["--steps", "4", "--grad-accum", "4", "--save-every", "0", "--qk-norm"]
DRIFT = "tests/scripts/replica_drift_train.py"


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    """ZeRO-1 on 1 rank, tp2 on 2 ranks and pp2 x tp2 on 4, all with --qk-norm in fp32."""
    base = tmp_path_factory.mktemp("replicas")
    plans = {
        "zero1": (1, "zero1.json"),
        "tp2": (2, "tp2.json"),
        "pptp": (4, "pipeline_tp2.json"),
    }
    out = {}
    for name, (nproc, cfg) in plans.items():
        args = ["--data", str(tiny_data), "--out", str(base / name), *TINY_RUN, *STEPS]
        launch([*args, *ds_variant(base, name, cfg, bf16=None)], nproc=nproc, timeout=600)
        out[name] = base / name
    return out


def close(a, b, rel):
    return abs(a - b) <= rel * abs(b)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp2", "pptp"])
def test_qk_norm_under_tensor_parallelism_keeps_its_replicas_and_follows_zero1(runs, name):
    (same,) = read_metrics(runs[name], "replicas")
    assert same["step"] == 4
    assert same["differ"] == [], same
    # the embedding, each of the 2 blocks' 4 norms (q_norm and k_norm among them), the final
    # norm: whole on both ranks of a tensor-parallel group (the embedding on all 4 of pp2 x tp2)
    assert same["checked"] == 10, same
    assert not read_metrics(runs["zero1"], "replicas")  # one rank: nothing to compare
    got, want = read_metrics(runs[name]), read_metrics(runs["zero1"])
    assert len(got) == len(want) == 4
    # Step 1 runs the initial weights: the loss up to the order of fp32 sums (4.2e-6, as in
    # tests/test_pipeline_tensor.py); then the same updates within tp2's fp32 bound (1e-4).
    assert close(got[0]["loss"], want[0]["loss"], 4.2e-6), (got[0], want[0])
    for a, b in zip(got, want, strict=True):
        assert close(a["loss"], b["loss"], 1e-4), ([r["loss"] for r in got], want)
        assert close(a["grad_norm"], b["grad_norm"], 1e-3), (a, b)


@pytest.mark.slow
def test_the_replica_check_finds_one_ulp_on_one_rank(tiny_data, tmp_path):
    """2 ranks of ZeRO-2 in fp32: rank 1's final norm moved by one ulp in one element after the
    last step is the one parameter the record names, and the console says so."""
    out = tmp_path / "run"
    args = ["--data", str(tiny_data), "--out", str(out), *TINY_RUN, "--steps", "2"]
    args += [*ds_variant(tmp_path, "fp32", "zero2.json", bf16=None), "--save-every", "0"]
    env = {"ZEROSTACK_TEST_DRIFT_PARAM": "norm.weight", "ZEROSTACK_TEST_DRIFT_STEP": "2"}
    p = launch(args, nproc=2, script=DRIFT, env=env)
    (found,) = read_metrics(out, "replicas")
    assert found["differ"] == ["norm.weight"], found
    assert found["checked"] == len(read_params()), found  # every parameter: whole on both
    lines = [line for line in p.stdout.splitlines() if line.startswith("replicas step 2")]
    assert len(lines) == 1 and "warning: " in lines[0] and "of which 1 differ" in lines[0], lines
    assert lines[0].endswith("differ between them: norm.weight"), lines


def read_params() -> list[str]:
    """The tiny preset's parameter names (the tied head shares the embedding's)."""
    from models.llama import ZeroStackForCausalLM
    from models.presets import get_config

    model = ZeroStackForCausalLM(get_config("tiny", vocab_size=512))
    return [name for name, _ in model.named_parameters()]


def test_a_digest_changes_with_one_ulp_or_a_swap_and_not_otherwise():
    from training.engines.replicas import digest

    w = torch.randn(1000)
    assert torch.equal(digest(w), digest(w.clone()))
    moved = w.clone()
    moved[517] = torch.nextafter(moved[517], torch.tensor(torch.inf))
    assert (digest(moved) != digest(w)).all()
    swapped = w.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert digest(swapped)[0] == digest(w)[0] and digest(swapped)[1] != digest(w)[1]
    half = w.bfloat16()
    assert torch.equal(digest(half), digest(half.clone())) and not torch.equal(
        digest(half), digest(half + 1)
    )


def test_the_pipeline_stages_split_and_sum_what_the_model_plan_says():
    """pipeline_tensor.py splits (and sums the gradients of) what AutoTP does for our model."""
    from models.config import ZeroStackConfig
    from training.engines import pipeline_tensor as pt

    styles = {"colwise": pt.COLUMN, "rowwise": pt.ROW, "replicated_with_grad_allreduce": pt.SUMMED}
    plan = ZeroStackConfig.base_model_tp_plan
    assert {tuple(k.removeprefix("layers.*.").split(".")): v for k, v in plan.items()} == {
        pair: style for style, pairs in styles.items() for pair in pairs
    }


# engine flags -> how many parameter copies more than one rank holds (tiny: 20 parameters)
ENGINES = {
    "zero2_bf16": (["--ds_config", "ds_configs/zero2.json", "--precision", "bf16"], 20),
    "ddp": (["--backend", "ddp"], 20),
    "fsdp": (["--backend", "fsdp"], 0),  # shards only
    "zero3": (["--ds_config", "ds_configs/zero3.json"], 0),  # shards only
    "pipeline": (["--ds_config", "ds_configs/pipeline.json", "--grad-accum", "4"], 1),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ENGINES))
def test_every_engine_ends_with_its_whole_copies_identical(tiny_data, tmp_path, name):
    """2 ranks, 3 steps: no engine leaves two copies of a parameter apart (the pipeline's one
    shared copy is the tied embedding on its first and last stage)."""
    flags, checked = ENGINES[name]
    out = tmp_path / name
    args = ["--data", str(tiny_data), "--out", str(out), *TINY_RUN, "--steps", "3", *flags]
    launch([*args, "--save-every", "0"], nproc=2)
    (same,) = read_metrics(out, "replicas")
    assert same["differ"] == [], same
    assert same["checked"] == checked, same
