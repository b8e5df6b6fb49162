"""The MoE user's path: train tiny-moe with the train command on 2 ranks under ZeRO-2 (the
shipped config), see the routers in metrics.jsonl, export, and load the export in stock
transformers as Mixtral with the checkpoint's logits and greedy tokens; and an HF Mixtral folder
trains through --model like any HF folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY_RUN, launch, read_metrics
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

from training.checkpoints import layout as ckpt
from training.checkpoints.hf_export import export_report
from training.checkpoints.weights import load_model

MOE_RUN = [a if a != "tiny" else "tiny-moe" for a in TINY_RUN]


@pytest.fixture(scope="module")
def moe_run(tiny_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("moe") / "run"
    launch(["--data", str(tiny_data), "--out", str(run), *MOE_RUN, "--steps", "3",
            "--ds_config", "ds_configs/zero2.json"])  # fmt: skip
    return run


@pytest.mark.slow  # 2 ranks launched
def test_moe_run_logs_its_routers(moe_run):
    rows = read_metrics(moe_run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        # 2 layers x 4 experts; 2 ranks x 2 sequences x 64 tokens, 2 experts each: 512 a layer
        assert 0 <= r["moe_expert_tokens_min"] <= 128 <= r["moe_expert_tokens_max"] <= 512
        assert r["moe_aux_loss"] >= 2.0 - 1e-3  # k=2 at perfect balance, more otherwise
        assert r["moe_z_loss"] > 0
    resolved = json.loads((moe_run / "resolved_config.json").read_text())
    from models import flops_per_token, get_config

    active = flops_per_token(get_config("tiny-moe", vocab_size=512), 64)
    assert resolved["flops_per_token"] == pytest.approx(active)  # MFU on the active parameters


@pytest.mark.slow  # 2 ranks launched
def test_moe_export_loads_as_mixtral_with_the_same_logits_and_tokens(moe_run, tmp_path):
    assert_exports_as_mixtral(moe_run, tmp_path / "hf")


def assert_exports_as_mixtral(run, hf) -> None:
    """`run`'s last checkpoint exports to a folder stock transformers loads as Mixtral with our
    model's logits, load-balancing loss and greedy tokens."""
    report = export_report(run, hf)
    assert json.loads((hf / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    root, tag = ckpt.locate(run)
    ours = load_model(root, tag, ckpt.load_trainer_state(root, tag))
    assert type(ours).__name__ == "ZeroStackMoeForCausalLM"
    theirs = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    assert type(theirs).__name__ == "MixtralForCausalLM"
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = ours(input_ids=ids)
        b = theirs(input_ids=ids, output_router_logits=True)
    assert (a.logits - b.logits).abs().max().item() < 1e-4
    # the same load-balancing loss: transformers' function on each layer alone, averaged
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    per_layer = [load_balancing_loss_func((g,), 4, 2) for g in b.router_logits]
    torch.testing.assert_close(a.aux_loss, torch.stack(per_layer).mean())
    gen = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    assert (ours.generate(ids[:1, :8], **gen) == theirs.generate(ids[:1, :8], **gen)).all()
    assert report.generated and report.max_logit_diff < 1e-4


HF_MOE = {  # stock configs: output_router_logits is off, as transformers writes them
    "mixtral": lambda **kw: MixtralConfig(num_local_experts=4, **kw),
    "qwen3_moe": lambda **kw: Qwen3MoeConfig(
        num_experts=4, moe_intermediate_size=88, head_dim=16, **kw
    ),
}


def hf_moe_folder(kind: str, folder: Path, vocab_size: int = 512, weights: bool = False) -> Path:
    """A random-initialised Mixtral or Qwen3-MoE folder (built with transformers, no download):
    its config alone, or with `weights` its weights too."""
    config = HF_MOE[kind](
        vocab_size=vocab_size, hidden_size=64, intermediate_size=88, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
        max_position_embeddings=256,
    )  # fmt: skip
    if weights:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    else:
        config.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", sorted(HF_MOE))
def test_hf_moe_next_token_loss_adds_the_weighted_aux_loss(kind, tmp_path):
    """A stock Mixtral or Qwen3-MoE folder built for training: its training loss is the
    cross-entropy plus router_aux_loss_coef x transformers' load-balancing loss (the same folder
    with the coefficient at 0 gives the cross-entropy alone), while its config, and so the run's
    record and export, keep output_router_logits off; in eval mode the loss is the
    cross-entropy alone, as our model's."""
    from models import build_model
    from training.engines.base import next_token_loss

    folder = hf_moe_folder(kind, tmp_path / kind, weights=True)
    model = build_model(folder).train()
    off = build_model(folder, overrides={"router_aux_loss_coef": 0.0}).train()
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    y = torch.roll(x, -1, dims=1)
    loss, ce = next_token_loss(model, x, y), next_token_loss(off, x, y)
    out = model(input_ids=x)
    coef = model.config.router_aux_loss_coef
    assert out.aux_loss is not None and out.aux_loss.item() >= 2.0 - 1e-4
    torch.testing.assert_close(loss - ce, coef * out.aux_loss, rtol=1e-4, atol=1e-7)
    assert loss.item() != ce.item()
    loss.backward()  # the aux loss trains the routers
    gates = [p.grad for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
    assert gates and all(g is not None and g.abs().sum() > 0 for g in gates)
    model.eval()
    with torch.no_grad():
        assert model(input_ids=x).aux_loss is None  # eval: no router logits asked for
    assert model.config.output_router_logits is False
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved.get("output_router_logits", False) is False
    assert model.config.to_dict()["output_router_logits"] is False  # what the record keeps


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(HF_MOE))
def test_hf_moe_folder_trains(tiny_data, tmp_path, kind):
    """A stock Mixtral or Qwen3-MoE folder trains as the dense HF folders do, with its
    load-balancing loss in the loss the trainer steps on; the run's record keeps the folder's
    config as it was (output_router_logits off)."""
    folder = hf_moe_folder(kind, tmp_path / kind)
    run = tmp_path / "run"
    args = [a if a != "tiny" else str(folder) for a in TINY_RUN]
    launch(["--data", str(tiny_data), "--out", str(run), *args, "--steps", "2"], nproc=1)
    rows = read_metrics(run)
    assert len(rows) == 2 and all(r["loss"] > 0 for r in rows)
    resolved = json.loads((run / "resolved_config.json").read_text())
    assert resolved["model_config"]["output_router_logits"] is False


@pytest.mark.slow  # 2 ranks launched
def test_expert_parallel_step_has_the_one_process_gradient(tmp_path):
    """2 ranks, each holding 2 of the 4 experts (AutoEP, ZeRO-2, fp32), each a half of the
    batch: every gradient, experts' included, is the one-process whole-batch gradient within
    fp32 rounding."""
    out = tmp_path / "grads.json"
    launch([str(out)], nproc=2, script="tests/scripts/moe_ep_grads.py")
    diffs = json.loads(out.read_text())
    assert any(".experts.w1" in k for k in diffs) and len(diffs) == 22
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] < 1e-5, (worst, diffs[worst])


@pytest.mark.parametrize(
    "ep, world, experts, words",
    [
        (3, 4, 6, "autoep_size=3 does not divide the 4 data-parallel ranks"),
        (4, 4, 2, "cannot share the model's 2 experts"),
        (2, 2, 3, "cannot share the model's 3 experts"),
        (0, 2, 4, "autoep_size must be a positive integer"),
        (2, 2, None, "expert_parallel is enabled for a model without experts"),
    ],
)
def test_bad_expert_layouts_are_one_line(ep, world, experts, words):
    from models import get_config
    from training.errors import ConfigError
    from training.settings import parallel

    cfg = {"expert_parallel": {"enabled": True, "autoep_size": ep}}
    name = "tiny" if experts is None else "tiny-moe"
    model = get_config(name, **({"num_experts": experts} if experts else {}))
    with pytest.raises(ConfigError, match=words) as e:
        out = parallel.layout(cfg, world, "ds.json")  # the shape, before the model is known
        parallel.check_experts(parallel.expert_size(cfg), out.data, model, "ds.json")
    assert "\n" not in str(e.value)


@pytest.mark.slow  # 2 ranks launched
def test_train_command_with_expert_parallelism_trains_as_replicated_experts(
    moe_run, tiny_data, tmp_path
):
    """ds_configs/moe_ep2.json: the same run as moe_run (ZeRO-2, experts on every rank) with
    2 experts on each rank: the same losses within bf16 rounding, the routers logged; its
    checkpoint, each rank's experts in its own files, exports as Mixtral (the checkpoint's logits
    and greedy tokens)."""
    run = tmp_path / "run"
    launch(["--data", str(tiny_data), "--out", str(run), *MOE_RUN, "--steps", "3",
            "--ds_config", "ds_configs/moe_ep2.json"])  # fmt: skip
    ep, replicated = read_metrics(run), read_metrics(moe_run)
    for a, b in zip(ep, replicated, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)
        assert 0 < a["moe_expert_tokens_min"] <= a["moe_expert_tokens_max"] <= 512
    # the memory plan counts half the experts' weights on each rank, as the engine holds them
    from training.memory.plan import plan
    from training.memory.shape import shape_of_run

    resolved = json.loads((run / "resolved_config.json").read_text())
    planned = plan(shape_of_run(resolved), resolved["ds_config"], 2).per_rank["params"]["device"]
    for measured in read_metrics(run, "state_bytes")[0]["per_rank"]:
        assert abs(planned - measured["params"]) <= 0.02 * measured["params"]
    assert_exports_as_mixtral(run, tmp_path / "hf")


@pytest.mark.slow
def test_expert_parallelism_under_zero3_trains_as_under_zero2(moe_run, tiny_data, tmp_path):
    """moe_ep2.json with ZeRO-3 (DeepSpeed partitions each rank's experts over its expert
    data-parallel group): the losses of moe_run within bf16 rounding. A real 2-rank run (over
    a minute here); its checkpoint's expert partitions are not joined, so export says so in
    one line."""
    cfg = json.loads(Path("ds_configs/moe_ep2.json").read_text())
    cfg["zero_optimization"] = {"stage": 3, "overlap_comm": "auto"}
    path = tmp_path / "moe_ep2_zero3.json"
    path.write_text(json.dumps(cfg))
    run = tmp_path / "run"
    launch(["--data", str(tiny_data), "--out", str(run), *MOE_RUN, "--steps", "3",
            "--ds_config", str(path)])  # fmt: skip
    for a, b in zip(read_metrics(run), read_metrics(moe_run), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)
    from training.errors import ExportError

    with pytest.raises(ExportError, match="expert-parallel checkpoint of ZeRO-3") as e:
        export_report(run, tmp_path / "hf")
    assert "\n" not in str(e.value)


@pytest.mark.slow  # 2 ranks launched
def test_router_losses_over_a_sequence_parallel_group_add_up_to_the_whole_sequences(tmp_path):
    """Under Ulysses each rank routes its slice of the sequences; the load-balancing loss is a
    product of two means over the whole sequences, so each rank's share must use the group's
    counts (ours: per layer, padding left out; transformers': layers pooled). Before, each slice
    took its own loss: the sum over the ranks was off by a factor near the group's size."""
    out = tmp_path / "router_group.json"
    launch([str(out)], nproc=2, script="tests/scripts/router_group.py")
    got = json.loads(out.read_text())
    assert got["ours_loss"] < 1e-12 and got["ours_grad"] < 1e-12 and got["ours_counts_equal"]
    assert got["pooled_loss"] < 1e-6 and got["pooled_grad"] < 1e-6
    assert got["slices_alone_loss"] > 0.1  # what the shares replace is far off


@pytest.mark.parametrize("kind", sorted(HF_MOE))
def test_hf_moe_load_balancing_leaves_padding_out(kind, tmp_path):
    """A padded batch (targets ignored past each row's end): the HF MoE folder's training loss
    takes transformers' load-balancing loss over the real tokens only (its own function given
    them as the attention mask), where transformers alone counts the padding too; a batch
    without padding keeps transformers' loss exactly. DPO's call without labels passes the
    same mask (router_inputs)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from models import build_model
    from models.llama import IGNORE_INDEX
    from models.moe import real_tokens, router_inputs, router_loss

    model = build_model(hf_moe_folder(kind, tmp_path / kind, weights=True)).train()
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    y = torch.roll(x, -1, dims=1)
    y[1, 10:] = IGNORE_INDEX  # the second row ends at token 11: padding after
    real = real_tokens(y)
    out = model(input_ids=x, labels=x, shift_labels=y)
    logits = model(input_ids=x, output_router_logits=True).router_logits
    c = model.config
    experts = logits[0].shape[-1]
    want = load_balancing_loss_func(logits, experts, c.num_experts_per_tok, real.long())
    every = load_balancing_loss_func(logits, experts, c.num_experts_per_tok)
    torch.testing.assert_close(out.aux_loss, want, rtol=1e-5, atol=1e-7)
    assert abs(out.aux_loss.item() - every.item()) > 1e-4  # the padding did count before
    plain = model(input_ids=x, labels=x)  # no padding: transformers' own
    stock = type(model).forward(model, input_ids=x, labels=x, output_router_logits=True)
    assert torch.equal(plain.loss, stock.loss) and torch.equal(plain.aux_loss, stock.aux_loss)
    no_labels = model(input_ids=x, **router_inputs(model, y))
    torch.testing.assert_close(no_labels.aux_loss, want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(router_loss(model, no_labels), c.router_aux_loss_coef * want)
