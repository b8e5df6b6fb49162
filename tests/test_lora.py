"""LoRA through peft (models/lora.py): the --lora spec, its refusals before any work, the memory
plan of a run that trains only adapters, and real 2-rank runs: ZeRO-3 trains only the adapters,
resumes exactly after a stop, and exports both ways (an adapter folder peft loads on the base,
a merged folder stock transformers loads); DDP keeps the base weights bit for bit."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import launch, read_metrics, refused
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from models import ModelError, ZeroStackForCausalLM, build_model, get_config, save_llama
from models.lora import (
    LoraSpec,
    apply_lora,
    is_adapter,
    parse_lora,
    stored_lora,
    targets,
    to_llama_adapter,
)
from training.checkpoints import layout as ckpt
from training.checkpoints.hf_export import export_report
from training.checkpoints.weights import load_lora_model
from training.checkpoints.zero_files import ZeroFiles
from training.memory.plan import plan
from training.memory.shape import shape_of_config, shape_of_run, with_lora

LORA = ["--lora", "r=4,alpha=16,dropout=0.0"]
RUN = [
    "--seq-len", "64", "--micro-batch", "2", "--log-every", "1", "--eval-every", "0",
    "--eval-samples", "8", "--lr", "1e-2", "--warmup", "1", "--steps", "6", "--save-every", "3",
    "--precision", "fp32", "--no-compile",
]  # fmt: skip


@pytest.fixture(scope="session")
def lora_base(tmp_path_factory) -> Path:
    """A pretrained-shaped Llama folder (the tiny preset's shapes, vocabulary 512) to adapt."""
    torch.manual_seed(11)
    model = build_model("tiny", vocab_size=512)
    out = tmp_path_factory.mktemp("lora") / "base"
    save_llama(dict(model.named_parameters()), model.config, out)
    return out


# ------------------------------------------------------------------------------ the spec
def test_spec_parses_with_defaults_and_target_lists():
    assert parse_lora("default") == LoraSpec()
    spec = parse_lora("r=8,alpha=16,targets=q_proj,v_proj")
    assert spec == LoraSpec(r=8, alpha=16.0, dropout=0.05, targets=("q_proj", "v_proj"))
    for bad, why in [("rank=4", "unknown key 'rank'"), ("r=x", "not a number"), ("r=0", "r >= 1")]:
        with pytest.raises(ModelError, match=why):
            parse_lora(bad)


def test_default_targets_and_llama_names():
    with torch.device("meta"):
        ours = ZeroStackForCausalLM(get_config("tiny", vocab_size=512))
    assert targets(ours, LoraSpec()) == ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]
    with pytest.raises(ModelError, match="targets=q_proj matches no linear layer"):
        targets(ours, LoraSpec(targets=("q_proj",)))
    sd = {"base_model.model.layers.1.feed_forward.w1.lora_A.weight": torch.zeros(1)}
    renamed, names = to_llama_adapter(sd, ["w1", "wq"])
    assert list(renamed) == ["base_model.model.model.layers.1.mlp.gate_proj.lora_A.weight"]
    assert names == ["gate_proj", "q_proj"]


@pytest.mark.parametrize("in_base_dtype", [True, False])
def test_adapters_on_a_16_bit_base_keep_no_fp32_activations(in_base_dtype):
    """For DeepSpeed (fp32 masters of what it trains), adapters take a bf16 base's dtype, as a
    ZeRO-3 base is built: peft's fp32 adapters make each adapted layer keep an fp32 copy of
    its input for backward (twice a bf16 activation's bytes). Other engines keep fp32."""
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=512).to(torch.bfloat16)
    model = apply_lora(model, LoraSpec(dropout=0.0), seed=0, in_base_dtype=in_base_dtype)
    trained = {p.dtype for p in model.parameters() if p.requires_grad}
    assert trained == {torch.bfloat16 if in_base_dtype else torch.float32}
    seen = set()  # the dtype of what each lora_A takes in: the layer's input, cast or not
    for name, m in model.named_modules():
        if name.endswith("lora_A.default"):
            m.register_forward_pre_hook(lambda m, args: seen.add(args[0].dtype))
    model(input_ids=torch.randint(0, 512, (2, 16))).logits.sum().backward()
    assert seen == {torch.bfloat16 if in_base_dtype else torch.float32}


def test_plan_counts_no_gradients_or_optimizer_states_for_frozen_weights():
    cfg = get_config("small", vocab_size=32000)
    full = shape_of_config(cfg, "small")
    lora = with_lora(full, cfg, parse_lora("r=16"))
    assert 0 < lora.trainable < full.params / 20 and lora.params == full.params + lora.trainable
    ds = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
    p_full, p_lora = plan(full, ds, 2), plan(lora, ds, 2)
    assert p_lora.model_states < 0.5 * p_full.model_states
    assert p_lora.per_rank["optimizer"]["device"] == 12 * lora.trainable // 2
    assert p_lora.per_rank["grads"]["device"] == 2 * lora.trainable // 2


# ------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    "extra, says",
    [
        (["--lora", "r=4,rank=2"], "--lora r=4,rank=2: unknown key 'rank'"),
        (["--lora", "targets=c_attn"], "targets=c_attn matches no linear layer"),
        (["--lora", "r=4", "--backend", "fsdp"], "--lora with --backend fsdp is not supported"),
    ],
)
def test_bad_lora_is_one_line_before_work(
    capsys, monkeypatch, tmp_path, tiny_data, lora_base, extra, says
):
    argv = ["--data", str(tiny_data), "--out", str(tmp_path / "run"), "--model", str(lora_base)]
    assert says in refused(capsys, monkeypatch, tmp_path, [*argv, *extra])


def test_lora_on_a_fresh_preset_is_refused(capsys, monkeypatch, tmp_path, tiny_data):
    argv = ["--data", str(tiny_data), "--out", str(tmp_path / "run"), "--model", "tiny", *LORA]
    assert "give --model FOLDER" in refused(capsys, monkeypatch, tmp_path, argv)


# ------------------------------------------------------------------------------ real runs
@pytest.fixture(scope="module")
def zero3_runs(tiny_data, lora_base, tmp_path_factory) -> dict:
    """2 ranks ZeRO-3: `ref` uninterrupted for 6 steps, `stopped` stopped at step 3 and then
    resumed to step 6 by the same command."""
    base = tmp_path_factory.mktemp("lora_runs")

    def args(out):
        return ["--data", str(tiny_data), "--out", str(out), "--model", str(lora_base),
                "--ds_config", "ds_configs/zero3.json", *RUN, *LORA]  # fmt: skip

    launch(args(base / "ref"))
    launch([*args(base / "stopped"), "--stop-at", "3"])
    launch(args(base / "stopped"))
    return {"ref": base / "ref", "stopped": base / "stopped"}


def _adapters(run: Path) -> dict[str, torch.Tensor]:
    root, tag = ckpt.locate(run)
    model = load_lora_model(root, tag, ckpt.load_trainer_state(root, tag))
    return {n: p.detach().clone() for n, p in model.named_parameters() if is_adapter(n)}


def test_a_checkpoint_holds_the_spec_as_fields_and_old_ones_read_back():
    spec = LoraSpec(r=8, alpha=16.0, dropout=0.0, targets=("q_proj", "v_proj"))
    assert stored_lora(json.loads(json.dumps(spec.as_record()))) == spec
    assert stored_lora(spec.as_text()) == spec  # a checkpoint written with the --lora text
    assert stored_lora(None) is None
    for bad, why in [({"rank": 4}, "unknown fields"), ({"r": "x"}, "does not read back")]:
        with pytest.raises(ModelError, match=why):
            stored_lora(bad)


@pytest.mark.slow
def test_zero3_trains_only_the_adapters_and_resumes_exactly(zero3_runs):
    ref = read_metrics(zero3_runs["ref"])
    assert ref[-1]["loss"] < ref[0]["loss"]
    # Only the adapters are in the optimizer: its fp32 masters are exactly the adapter weights.
    root, tag = ckpt.locate(zero3_runs["ref"])
    trained = [name for name, _, _ in ZeroFiles(root / tag).params(("fp32",))]
    assert trained and all(is_adapter(n) for n in trained)
    assert len(trained) == 2 * 7 * get_config("tiny").num_hidden_layers  # A and B, 7 targets
    resumed = read_metrics(zero3_runs["stopped"])
    assert [(r["step"], r["loss"]) for r in resumed if r["step"] > 3] == [
        (r["step"], r["loss"]) for r in ref if r["step"] > 3
    ]
    a, b = _adapters(zero3_runs["ref"]), _adapters(zero3_runs["stopped"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    state = json.loads((root / tag / "trainer_state.json").read_text())
    assert isinstance(state["lora"], dict)  # the spec's fields, read back as given
    assert stored_lora(state["lora"]) == parse_lora(LORA[LORA.index("--lora") + 1])


@pytest.mark.slow
def test_zero3_plan_matches_measured_state_bytes(zero3_runs):
    resolved = json.loads((zero3_runs["ref"] / "resolved_config.json").read_text())
    shape = shape_of_run(resolved)
    assert shape.trainable == resolved["trainable_params"] < shape.params / 10
    planned = plan(shape, resolved["ds_config"], resolved["world"]).per_rank
    (measured,) = read_metrics(zero3_runs["ref"], "state_bytes")
    for category in ("grads", "optimizer"):
        want = measured["per_rank"][0][category]
        assert abs(planned[category]["device"] - want) <= 0.25 * want, (category, planned)


@pytest.mark.slow
def test_zero3_exports_an_adapter_and_a_merged_model(zero3_runs, lora_base, tmp_path):
    from peft import PeftModel

    adapter = export_report(zero3_runs["ref"], tmp_path / "adapter", adapter_only=True)
    merged = export_report(zero3_runs["ref"], tmp_path / "merged")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(adapter.files)
    assert adapter.max_logit_diff < 1e-4 and merged.max_logit_diff < 1e-4
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(lora_base.resolve())
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    # Stock transformers on each folder: peft's adapter on the base equals the merged model,
    # and both differ from the base (the adapters trained).
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(lora_base).eval()
        before = base(input_ids=ids).logits
        peft_logits = PeftModel.from_pretrained(base, tmp_path / "adapter")(input_ids=ids).logits
        full = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        merged_logits = full(input_ids=ids).logits
    assert (peft_logits - merged_logits).abs().max() < 1e-4
    assert (merged_logits - before).abs().max() > 1e-3
    assert all(
        v.abs().sum() > 0
        for k, v in load_file(tmp_path / "adapter" / "adapter_model.safetensors").items()
        if "lora_B" in k
    )


@pytest.mark.slow
def test_ddp_trains_adapters_on_unchanged_base_weights(tiny_data, lora_base, tmp_path):
    out = tmp_path / "ddp"
    argv = ["--data", str(tiny_data), "--out", str(out), "--model", str(lora_base),
            "--backend", "ddp", *RUN, "--steps", "3", *LORA]  # fmt: skip
    launch(argv)
    root, tag = ckpt.locate(out)
    saved = torch.load(root / tag / "model.pt", weights_only=True)
    base = build_model(str(lora_base))
    seed = json.loads((out / "resolved_config.json").read_text())["flags"]["seed"]
    fresh = apply_lora(base, parse_lora(LORA[1]), seed=seed).state_dict()  # the run's own init
    assert saved.keys() == fresh.keys()
    for name, value in saved.items():
        same = torch.equal(value, fresh[name].detach())
        assert same != is_adapter(name), name  # the base as it was, the adapters trained


@pytest.mark.slow
def test_lora_on_the_default_config_in_the_runs_own_precision(tiny_data, lora_base, tmp_path):
    """LoRA as a user runs it by default: zero2.json and precision auto (bf16 on a CPU with bf16
    units, as here; fp32 on one without). The adapters train (each lora_B leaves its zero
    init) and export for peft, and nothing else is trainable."""
    i = RUN.index("--precision")
    run = RUN[:i] + RUN[i + 2 :]
    out = tmp_path / "zero2"
    launch(["--data", str(tiny_data), "--out", str(out), "--model", str(lora_base), *run,
            "--steps", "3", *LORA])  # fmt: skip
    record = json.loads((out / "resolved_config.json").read_text())
    assert Path(record["ds_config_file"]).name == "zero2.json"
    assert record["precision_choice"]["asked"] == "auto"
    assert record["trainable_params"] < record["n_params"] / 10  # the adapters alone
    losses = [r["loss"] for r in read_metrics(out)]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    export_report(out, tmp_path / "adapter", adapter_only=True)
    weights = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    lora_b = [v for k, v in weights.items() if "lora_B" in k]
    assert lora_b and all(v.abs().sum() > 0 for v in lora_b)


def test_zero0_masters_are_named_as_the_adapters():
    """ZeRO-0 keeps fp32 masters grouped as the optimizer holds them: a LoRA run's are the
    adapters alone, in one group (checkpoints/weights.py reads them by these names)."""
    from training.checkpoints.weights import _group_names

    (group,) = _group_names(get_config("tiny", vocab_size=512), "r=4")
    assert len(group) == 2 * 7 * get_config("tiny").num_hidden_layers
    assert all(is_adapter(name) for name, _ in group)
