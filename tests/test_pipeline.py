"""Pipeline parallelism end to end: real 2- and 4-rank runs of the tiny preset through
ds_configs/pipeline.json, against ZeRO-0 on one rank with the same global batch; resume, export,
and the guardrails that refuse what cannot be pipelined."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, TINY_RUN, launch, read_metrics, refused

COMMON = [
    *TINY_RUN,
    "--steps",
    "6",
]
PIPE = ["--ds_config", "ds_configs/pipeline.json"]


def train(data, out, *extra, nproc=2):
    launch(["--data", str(data), "--out", str(out), *COMMON, *extra], nproc=nproc, timeout=900)
    return out


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    """Global batch 8 sequences everywhere: ZeRO-0 on 1 rank as 4 micro-batches of 2; pp=2 on
    2 ranks as the config's 4 micro-batches of 2 through both stages (evaluated and saved at steps
    3 and 6)."""
    base = tmp_path_factory.mktemp("pipeline")
    zero0 = ["--ds_config", "ds_configs/zero0.json", "--grad-accum", "4", "--save-every", "-1"]
    return {
        "zero0": train(tiny_data, base / "zero0", *zero0, nproc=1),
        "pp2": train(tiny_data, base / "pp2", *PIPE, "--save-every", "3", "--eval-every", "3"),
    }


def close(a, b, rel):
    return abs(a - b) <= rel * abs(b)


@pytest.mark.slow
def test_pp2_follows_zero0_on_one_rank(runs):
    pp, ref = read_metrics(runs["pp2"]), read_metrics(runs["zero0"])
    assert [r["step"] for r in pp] == [1, 2, 3, 4, 5, 6]
    # Step 1 runs the initial weights: the stages hold exactly the unpipelined model's, so the
    # loss agrees to bf16 rounding, and so does the gradient norm, tied embedding included.
    assert close(pp[0]["loss"], ref[0]["loss"], 1e-4), (pp[0], ref[0])
    assert close(pp[0]["grad_norm"], ref[0]["grad_norm"], 5e-3), (pp[0], ref[0])
    # Then ZeRO-0 accumulates gradients in bf16 and the pipeline in fp32: bf16 drift only.
    for a, b in zip(pp, ref, strict=True):
        assert close(a["loss"], b["loss"], 2e-2), (
            [r["loss"] for r in pp],
            [r["loss"] for r in ref],
        )
        assert a["tokens"] == b["tokens"] == 8 * 64 * a["step"]
    assert pp[-1]["loss"] < pp[0]["loss"] - 0.3
    resolved = json.loads((runs["pp2"] / "resolved_config.json").read_text())
    assert resolved["ds_config"]["train_batch_size"] == 8
    assert resolved["pipeline"]["stages"] == 2 and resolved["pipeline"]["data_parallel"] == 1
    layers = [name for stage in resolved["pipeline"]["layers"] for name in stage]
    assert layers == ["EmbeddingPipe", "BlockPipe", "BlockPipe", "NormPipe", "EmbeddingPipe"]
    assert close(
        read_metrics(runs["pp2"], "eval")[-1]["val_loss"],
        read_metrics(runs["zero0"], "eval")[-1]["val_loss"],
        2e-2,
    )


@pytest.mark.slow
def test_pp2_resume_is_exact(runs, tiny_data, tmp_path):
    split = tmp_path / "split"
    args = [*PIPE, "--save-every", "0", "--eval-every", "3"]
    train(tiny_data, split, *args, "--stop-at", "3")
    saved = json.loads((split / "checkpoints" / "step_00000003" / "trainer_state.json").read_text())
    assert saved["pipeline_stages"] == 2 and saved["backend"] == "deepspeed"
    assert sorted(p.name for p in (split / "checkpoints" / "step_00000003").glob("layer_*")) == [
        f"layer_0{i}-model_states.pt"
        for i in range(4)  # the tied head is saved once, as layer 0
    ]
    train(tiny_data, split, *args)
    a, b = read_metrics(runs["pp2"]), read_metrics(split)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]  # bitwise on CPU
    assert [r["grad_norm"] for r in a] == [r["grad_norm"] for r in b]
    # Evaluation mid-run (eval_batch between train_batch calls) leaves training as it was.
    evals = [(r["step"], r["val_loss"]) for r in read_metrics(runs["pp2"], "eval")]
    assert len(evals) == 2 and evals == [
        (r["step"], r["val_loss"]) for r in read_metrics(split, "eval")
    ]


@pytest.mark.slow
def test_pp2_x_dp2_on_four_ranks_trains_matches_and_exports(runs, tiny_data, tmp_path):
    """2 stages x 2 data-parallel replicas (4 micro-batches of 2 split over the replicas, so the
    same 8 sequences per step), partitioned by blocks, with activation checkpointing."""
    out = train(
        tiny_data,
        tmp_path / "pp2dp2",
        *PIPE,
        "--grad-accum",
        "2",
        "--pipeline-partition",
        "blocks",
        "--activation-checkpointing",
        "--save-every",
        "0",
        nproc=4,
    )
    resolved = json.loads((out / "resolved_config.json").read_text())
    assert resolved["pipeline"]["data_parallel"] == 2
    assert [stage.count("BlockPipe") for stage in resolved["pipeline"]["layers"]] == [1, 1]
    assert resolved["ds_config"]["pipeline"]["activation_checkpoint_interval"] == 1
    four, two, ref = read_metrics(out), read_metrics(runs["pp2"]), read_metrics(runs["zero0"])
    for a, b, c in zip(four, two, ref, strict=True):
        assert a["tokens"] == c["tokens"]
        assert close(a["loss"], b["loss"], 2e-3), (
            [r["loss"] for r in four],
            [r["loss"] for r in two],
        )
        assert close(a["loss"], c["loss"], 2e-2)

    # Export the 4-rank checkpoint (fp32 masters spread over 2 replicas x 2 stages) and the
    # 2-rank one: the same HF folder an unpipelined run gives, loaded by stock transformers.
    from transformers import AutoModelForCausalLM

    from data import TokenDataset, eval_batches
    from training.checkpoints.hf_export import main as export_main

    hf = {}
    for name, run in (("four", out), ("two", runs["pp2"])):
        assert export_main([str(run), "--out", str(tmp_path / f"hf_{name}")]) == 0
        hf[name] = AutoModelForCausalLM.from_pretrained(tmp_path / f"hf_{name}").eval()
    assert type(hf["four"]).__name__ == "LlamaForCausalLM"
    assert hf["four"].config.tie_word_embeddings
    a, b = hf["four"].state_dict(), hf["two"].state_dict()
    assert sorted(a) == sorted(b)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 0.02  # bf16 drift, same layout
    # The exported weights are the run's: their validation loss is the run's last evaluation
    # (same windows), up to the run's bf16 forward.
    val = TokenDataset(tiny_data, "val", 64)
    with torch.no_grad():
        losses = [
            F.cross_entropy(hf["four"](input_ids=x).logits.flatten(0, 1), y.flatten()).item()
            for x, y in eval_batches(val, 2, 0, 1, max_samples=8)
        ]
    ran = read_metrics(out, "eval")[-1]["val_loss"]
    assert close(sum(losses) / len(losses), ran, 1e-3), (losses, ran)


@pytest.mark.slow
def test_fp32_pipeline_exports_from_layer_files_and_imports_exactly(tiny_data, tmp_path):
    """fp32 without ZeRO keeps its weights in the per-layer files only: export reads them, and
    the export is exact (fp32 end to end). A bf16 ZeRO-1 pipeline run started from that folder
    keeps its fp32 weights as fp32 masters (each stage sets its own), not their bf16 copy."""
    from safetensors.torch import load_file

    from training.checkpoints.hf_export import main as export_main

    cfg = json.loads((REPO / "ds_configs" / "pipeline.json").read_text())
    del cfg["bf16"], cfg["data_types"]
    cfg["zero_optimization"]["stage"] = 0
    (tmp_path / "fp32_pipe.json").write_text(json.dumps(cfg))
    fp32_cfg = ["--ds_config", str(tmp_path / "fp32_pipe.json"), "--steps", "2"]
    fp32 = train(tiny_data, tmp_path / "fp32", *fp32_cfg)
    step = fp32 / "checkpoints" / "step_00000002"
    assert not list(step.glob("*optim_states.pt")) and list(step.glob("layer_*"))
    assert export_main([str(fp32), "--out", str(tmp_path / "hf_fp32")]) == 0

    from transformers import AutoModelForCausalLM

    from data import TokenDataset, eval_batches

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_fp32").eval()
    val = TokenDataset(tiny_data, "val", 64)
    with torch.no_grad():
        losses = [
            F.cross_entropy(hf(input_ids=x).logits.flatten(0, 1), y.flatten()).item()
            for x, y in eval_batches(val, 2, 0, 1, max_samples=8)
        ]
    assert close(sum(losses) / len(losses), read_metrics(fp32, "eval")[-1]["val_loss"], 1e-5)

    # One step at a learning rate too small to move an fp32 weight, then export again.
    imported = tmp_path / "imported"
    common = [*PIPE, "--model", str(tmp_path / "hf_fp32"), "--steps", "1", "--lr", "1e-12"]
    train(tiny_data, imported, *common, "--save-every", "0")
    assert export_main([str(imported), "--out", str(tmp_path / "hf_back")]) == 0
    a = load_file(tmp_path / "hf_fp32" / "model.safetensors")
    b = load_file(tmp_path / "hf_back" / "model.safetensors")
    assert sorted(a) == sorted(b)
    # bf16 masters would be off by up to ~1e-4 here
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-8


# ------------------------------------------------------------------------------ guardrails
@pytest.fixture
def base(tiny_data, tmp_path):
    return ["--data", str(tiny_data), "--out", str(tmp_path / "run"), "--model", "tiny"]


def test_zero2_with_pipelining_is_refused(capsys, monkeypatch, tmp_path, base):
    cfg = json.loads((REPO / "ds_configs" / "pipeline.json").read_text())
    cfg["zero_optimization"]["stage"] = 2
    (tmp_path / "z2.json").write_text(json.dumps(cfg))
    err = refused(capsys, monkeypatch, tmp_path, [*base, "--ds_config", str(tmp_path / "z2.json")])
    assert "ZeRO stage 0 or 1" in err and "ZeRO-2" in err


def test_more_stages_than_blocks_is_refused(capsys, monkeypatch, tmp_path, base):
    err = refused(capsys, monkeypatch, tmp_path, [*base, *PIPE, "--pipeline-stages", "3"], world=3)
    assert "pipeline.stages=3 is more than the model's 2 blocks" in err


def test_world_not_divisible_by_stages_is_refused(capsys, monkeypatch, tmp_path, base):
    err = refused(capsys, monkeypatch, tmp_path, [*base, *PIPE], world=3)
    assert "world size 3 is not divisible by pipeline.stages=2" in err


def test_a_model_that_cannot_be_cut_is_refused(capsys, monkeypatch, tmp_path, base):
    from transformers import GPT2Config

    folder = tmp_path / "gpt2"
    GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512).save_pretrained(folder)
    argv = [*base[:-1], str(folder), *PIPE]
    err = refused(capsys, monkeypatch, tmp_path, argv)
    assert "pipelining needs our model" in err and "'gpt2'" in err


def test_unknown_partition_is_refused(capsys, monkeypatch, tmp_path, base):
    cfg = json.loads((REPO / "ds_configs" / "pipeline.json").read_text())
    cfg["pipeline"]["partition"] = "type:Block"
    (tmp_path / "p.json").write_text(json.dumps(cfg))
    err = refused(capsys, monkeypatch, tmp_path, [*base, "--ds_config", str(tmp_path / "p.json")])
    assert "pipeline.partition must be one of parameters, blocks, uniform" in err


def test_compile_with_pipelining_is_refused(capsys, monkeypatch, tmp_path, base):
    err = refused(capsys, monkeypatch, tmp_path, [*base, *PIPE, "--compile"])
    assert "--compile does not reach the pipeline's stages" in err
