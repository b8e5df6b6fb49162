"""Memory planning: `python -m training.memory_plan` (training/memory/plan.py) against what real
engines hold."""

from __future__ import annotations

import json

import pytest
from conftest import launch

from training.memory import plan_command as memory_plan
from training.memory.plan import plan
from training.memory.shape import model_shape
from training.settings import ds_config

STAGES = ["zero0", "zero1", "zero2", "zero3"]
# ZeRO-3 last: its model stays partitioned in the process (transformers' zero.Init hook)
# +muon: --optimizer muon (first: an AdamW engine built before any Muon one stands DeepSpeed's
# Muon modules in for the process)
CONFIGS = ["zero1+muon", "zero0", "zero1", "zero2", "fp32", "zero2_offload", "zero3+muon",
           "zero3", "zero3_offload"]  # fmt: skip


# How far the plan's model states (parameters, gradients, optimizer states, reduce buckets; not
# activations or the runtime) may be from what a real engine holds on a rank. Measured
# (2026-11-26, `small`, 2 ranks): ZeRO 0-3, fp32 and ZeRO-3 with offload within 0-1.3%; ZeRO-2
# with CPU offload was 9.8% under until the plan counted DeepSpeed's two gradient staging buffers
# of the largest parameter (host and device). Muon (2026-11-29): ZeRO-1 bf16 within 0.4% with
# one momentum for the blocks' matrices (12.0% over with Adam's two); ZeRO-3 bf16 and ZeRO-2
# fp32 hold what AdamW holds (12.4% under when planned with one).
STATES_WITHIN: dict[str, float] = {}
STATES_WITHIN_DEFAULT = 0.02


@pytest.mark.slow
def test_plan_matches_measured_model_states(tiny_data, tmp_path):
    """ZeRO 0-3 on 2 ranks, `small` (13M parameters here): the planned parameters + gradients +
    optimizer states + reduce buckets are within 2% of the bytes each rank really holds
    (`engine.state_bytes()`, the count benchmarks/compare reports beside the plan), ZeRO-2 with
    CPU offload too. About 60 s on 2 cores: one 2-rank launch builds an engine of the 13M model
    for each config in turn, since the plan's counts differ config by config."""
    out = tmp_path / "plan_vs_measured.json"
    launch(
        [str(tiny_data), "small", str(out), *CONFIGS], script="tests/scripts/plan_vs_measured.py"
    )
    results = json.loads(out.read_text())
    for name in CONFIGS:  # ZeRO 0-3 (and fp32, and the offload configs, which move the bytes)
        planned = results[name]["plan"]["model_states"]
        within = STATES_WITHIN.get(name, STATES_WITHIN_DEFAULT)
        for rank, measured in enumerate(results[name]["measured"]):
            assert abs(planned - measured["total"]) <= within * measured["total"], (
                name,
                rank,
                planned,
                measured,
            )
    # and category by category where the stages differ: sharded optimizer states (ZeRO-1+),
    # gradients (ZeRO-2+) and parameters (ZeRO-3) on 2 ranks are half of ZeRO-0's (measured
    # within 1.5%: DeepSpeed pads each partition)
    for name, category in (("zero1", "optimizer"), ("zero2", "grads"), ("zero3", "params")):
        planned = results[name]["plan"]["per_rank"][category]["device"]
        measured = results[name]["measured"][0][category]
        assert abs(planned - measured) <= 0.05 * measured, (name, category, planned, measured)
        assert measured < 0.6 * results["zero0"]["measured"][0][category]


def _plan(capsys, *args) -> tuple[int, str, str]:
    code = memory_plan.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_command_says_what_fits(capsys):
    code, out, err = _plan(
        capsys,
        "--model",
        "small",
        "--ds_config",
        "ds_configs/zero2.json",
        "--world",
        "2",
        "--host-mem",
        "64",
        "--json",
    )
    assert code == 0, err
    plan = json.loads(out)
    assert plan["stage"] == 2 and plan["world"] == 2 and plan["fits"]
    assert plan["deepspeed_estimate"]["function"] == "estimate_zero2_model_states_mem_needs"
    assert plan["cheapest_fit"]["config"] == "ds_configs/zero0.json"

    # 7B on 8 GPUs of 24 GiB: ZeRO-2 does not fit; ZeRO-3 with recomputation does
    code, out, err = _plan(
        capsys,
        "--model",
        "7B",
        "--ds_config",
        "ds_configs/zero2.json",
        "--world",
        "8",
        "--device",
        "cuda",
        "--device-mem",
        "24",
        "--host-mem",
        "512",
        "--micro-batch",
        "1",
        "--seq-len",
        "2048",
    )
    assert code == 0, err
    assert "does NOT fit" in out
    assert "cheapest config that fits: ds_configs/zero3.json with --activation-checkpointing" in out

    code, out, err = _plan(capsys, "--model", "small", "--ds_config", "ds_configs/nope.json")
    assert code == 2 and err.strip().count("\n") == 0 and "config file not found" in err


def test_an_moe_run_is_planned_with_its_experts_where_they_live():
    """small-moe on 2 CPU ranks: with expert parallelism (ds_configs/moe_ep2.json) each rank
    holds half the experts' weights, so a memory between the two plans takes the expert-parallel
    run and refuses the one with every expert on every rank, before any work."""
    from training.memory.shape import model_shape
    from training.memory.verdict import check_run
    from training.settings import ds_config

    shape = model_shape("small-moe", vocab_size=512)
    assert 0 < shape.experts < shape.params
    ep, replicated = (
        ds_config.load_json(f"ds_configs/{name}.json") for name in ("moe_ep2", "zero2")
    )

    def verdict(cfg, gib):
        kw = dict(config_name="c", seq_len=256, activation_checkpointing=False)
        return check_run(shape, cfg, 2, host_mem_gib=gib, **kw)

    a, b = verdict(ep, 64).plan, verdict(replicated, 64).plan
    w = 2  # bf16 (moe_ep2 and zero2 ask for it where the host has it)
    assert a.per_rank["params"]["device"] == w * (shape.params - shape.experts // 2)
    assert b.per_rank["params"]["device"] == w * shape.params
    between = (a.total() + b.total()) / 2 * 2 / 0.9 / 2**30  # 2 ranks, 90% headroom
    assert verdict(ep, between).fits and not verdict(replicated, between).fits
    assert "does not fit this machine" in verdict(replicated, between).refusal()


def _config(name: str) -> dict:
    return {**ds_config.load_json(ds_config.CONFIG_DIR / f"{name}.json"), "bf16": {"enabled": True}}


def test_plan_counts_a_rank_of_a_3d_layout():
    """pp2 x tp2 (ds_configs/pipeline_tp2.json) on `small`: a rank holds its pipeline stage's
    layers with the blocks' attention and MLP projections halved (the embedding, the norms and
    the tied head whole, as pipeline_tensor.py keeps them), and ZeRO-1 divides the optimizer
    states over the data-parallel ranks only: the arithmetic from the model's shapes."""
    from models import get_config

    c = get_config("small")
    h, layers, vocab = c.hidden_size, c.num_hidden_layers, c.vocab_size
    kv = c.num_key_value_heads * h // c.num_attention_heads
    proj = 2 * h * h + 2 * h * kv + 3 * h * c.intermediate_size  # wq wo, wk wv, w1 w2 w3
    norms = 2 * h
    shape = model_shape("small")
    assert shape.tied and shape.params == vocab * h + layers * (proj + norms) + h
    # `parameters` partition: embedding + 4 blocks | 4 blocks + norm + the tied head's copy
    last = layers // 2 * (proj + norms) + h + vocab * h
    split = layers // 2 * (proj // 2 + norms) + h + vocab * h

    def states(name: str, world: int) -> dict:
        per = plan(shape, _config(name), world).per_rank
        return {k: per[k]["device"] for k in ("params", "grads", "optimizer")}

    # bf16 with fp32 gradient accumulation at ZeRO-1: DeepSpeed's BF16_Optimizer, whose fp32
    # gradients are whole on every rank
    assert states("pipeline_tp2", 4) == {"params": 2 * split, "grads": 4 * split,
                                         "optimizer": 12 * split}  # fmt: skip
    assert states("pipeline_tp2", 8)["optimizer"] == 12 * split // 2  # pp2 x tp2 x dp2
    assert states("pipeline", 2)["params"] == 2 * last
    tp_only = shape.params - layers * proj // 2
    assert states("tp2", 2) == {"params": 2 * tp_only, "grads": 2 * tp_only,
                                "optimizer": 12 * tp_only}  # fmt: skip
    # the layout divides the model: pp2 x tp2 holds about 0.4 of a whole replica's parameters
    assert states("pipeline_tp2", 4)["params"] < 0.45 * states("zero1", 1)["params"]


def test_tensor_parallel_plan_keeps_qk_norms_whole():
    """QK-norm's per-head weights are whole on every tensor-parallel rank (the model's plan
    replicates them, with their gradients summed over the group): the plan counts them whole,
    from the model itself and from a run's record, where it used to halve them."""
    from models import get_config
    from training.memory.rank_share import rank_params
    from training.memory.shape import shape_of_config, shape_of_run

    c = get_config("small", qk_norm=True)
    h, layers, d = c.hidden_size, c.num_hidden_layers, c.head_dim
    kv = c.num_key_value_heads * d
    proj = 2 * h * h + 2 * h * kv + 3 * h * c.intermediate_size
    shape = shape_of_config(c, "small")
    assert shape.block_whole == 2 * h + 2 * d
    want = shape.params - layers * proj // 2  # every vector whole, the projections halved
    assert rank_params(shape, _config("tp2")) == want
    record = {"model_config": c.to_dict(), "n_params": shape.params, "flags": {"model": "small"}}
    assert rank_params(shape_of_run(record), _config("tp2")) == want
