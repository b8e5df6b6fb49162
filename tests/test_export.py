"""Export to Hugging Face and import back: real checkpoints of real 2-rank runs.

Each export is reloaded here with stock transformers (no zerostack code) and compared with our
model holding the checkpoint's weights: logits on a fixed batch, and greedy generation."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from conftest import PY, REPO, launch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from training.checkpoints import layout as ckpt
from training.checkpoints.hf_export import export, export_report, main
from training.checkpoints.weights import load_model

pytestmark = pytest.mark.slow  # every test exports the checkpoints of real runs (resumed_runs)

COMMON = [
    "--model", "tiny", "--seq-len", "64", "--micro-batch", "2", "--log-every", "1",
    "--eval-every", "0", "--eval-samples", "8", "--lr", "3e-3", "--warmup", "2",
]  # fmt: skip


def train(data, out, *extra, nproc=2):
    return launch(["--data", str(data), "--out", str(out), *COMMON, *extra], nproc=nproc)


@pytest.fixture(scope="module")
def runs(resumed_runs):
    """ZeRO-2 on 2 ranks, ZeRO-1 on 1 rank, ZeRO-3 on 2 ranks (parameters partitioned): the
    checkpoints tests/test_universal.py made (conftest.py)."""
    return {
        "zero2": resumed_runs["ref"],
        "zero1": resumed_runs["z1_1rank"],
        "zero3": resumed_runs["z3_2rank"] / "checkpoints" / "step_00000004",
    }


def greedy(model, ids, n=12):
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3"])
def test_export_reloads_in_stock_transformers(runs, tmp_path, name):
    run = runs[name]
    hf = tmp_path / "hf"
    report = export_report(run, hf)
    files = set(report.files)
    assert {"config.json", "model.safetensors", "generation_config.json", "README.md"} <= files
    assert {"tokenizer.json", "tokenizer_config.json"} <= files
    assert json.loads((hf / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]

    # trainer side: our model with the checkpoint's fp32 weights; export side: stock HF
    root, tag = ckpt.locate(run)
    ours = load_model(root, tag, ckpt.load_trainer_state(root, tag))
    theirs = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    assert type(theirs).__name__ == "LlamaForCausalLM"
    tok = AutoTokenizer.from_pretrained(hf)
    ids = tok("def fibonacci(n):\n", return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        a, b = ours(input_ids=ids).logits, theirs(input_ids=ids).logits
    assert (a - b).abs().max().item() < 1e-4
    assert greedy(ours, ids) == greedy(theirs, ids) == greedy(theirs, ids)
    assert report.generated and report.max_logit_diff < 1e-4

    # the weights are the checkpoint's fp32 masters, as DeepSpeed's own reconstruction gives
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from models import to_llama_state_dict

    ref = get_fp32_state_dict_from_zero_checkpoint(str(root), tag=tag)
    ref.pop("output.weight", None)  # tied: stored once, as the embedding
    written = load_file(hf / "model.safetensors")
    ref = to_llama_state_dict(ref)
    assert written.keys() == ref.keys()
    assert all(torch.equal(written[k], ref[k]) for k in ref)
    assert all(t.abs().sum() > 0 for t in written.values())  # nothing near-empty under ZeRO-3

    card = (hf / "README.md").read_text()
    assert f"steps: {ckpt.load_trainer_state(root, tag)['step']}" in card
    if name == "zero2":  # the uninterrupted run: 6 steps of 2 x 2 x 64 tokens, evaluated at the end
        assert "tokens trained: 1,536" in card and "validation loss" in card


def test_sharded_bf16_export(runs, tmp_path):
    fp32, bf16 = tmp_path / "fp32", tmp_path / "bf16"
    export(runs["zero2"], fp32)
    report = export_report(runs["zero2"], bf16, dtype="bfloat16", max_shard_size="100KB")
    shards = sorted(f for f in report.files if f.endswith(".safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((bf16 / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    full = load_file(fp32 / "model.safetensors")
    parts = {k: v for s in shards for k, v in load_file(bf16 / s).items()}
    assert parts.keys() == full.keys()
    assert all(parts[k].dtype == torch.bfloat16 for k in parts)
    assert all(torch.equal(parts[k], full[k].bfloat16()) for k in full)
    m = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.float32)
    assert torch.equal(m.model.norm.weight, full["model.norm.weight"].bfloat16().float())


def test_export_import_export_is_bit_identical(runs, tiny_data, tmp_path):
    """Continued pretraining from an export: bf16 ZeRO-2 on 2 ranks, one step at lr 0 (the
    optimizer runs but moves nothing), exported again: every tensor bit-identical. It holds in
    bf16 because the trainer puts the folder's fp32 values into DeepSpeed's master weights."""
    first, second, run = tmp_path / "first", tmp_path / "second", tmp_path / "imported"
    export(runs["zero3"], first)
    train(tiny_data, run, "--model", str(first), "--ds_config", "ds_configs/zero2.json",
          "--steps", "1", "--lr", "0", "--warmup", "0")  # fmt: skip
    export(run, second)
    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_quickstart_commands(runs, tmp_path):
    """`python -m training.export RUN --out HF`, then `python -m training.sample HF`."""
    hf = tmp_path / "hf"
    cmd = [PY, "-m", "training.export", str(runs["zero2"]), "--out", str(hf)]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "greedy generation identical" in p.stdout
    cmd = [PY, "-m", "training.sample", str(hf), "--prompt", "def ", "--greedy",
           "--max-new-tokens", "12"]  # fmt: skip
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith("def ") and len(p.stdout.rstrip("\n")) > len("def ")
    assert "not valid" not in p.stderr  # no generation-flag warnings on the quickstart path


def one_line_error(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    return err


def test_bad_input_gets_one_clear_line(runs, tmp_path, capsys):
    import shutil

    out = str(tmp_path / "hf")
    empty_run = tmp_path / "empty_run"
    empty_run.mkdir()
    assert "holds no complete checkpoint" in one_line_error(capsys, [str(empty_run), "--out", out])
    err = one_line_error(
        capsys, [str(runs["zero2"] / "checkpoints" / "step_00000009"), "--out", out]
    )
    assert "no checkpoint step_00000009" in err and "step_00000006" in err
    assert "no checkpoint step_00000007" in one_line_error(
        capsys, [str(runs["zero2"] / "7"), "--out", out]
    )

    run = tmp_path / "run"
    shutil.copytree(runs["zero2"], run)
    # bf16_zero_pp_rank_... in bf16, zero_pp_rank_... in fp32 (what auto picks on an AVX2 host)
    (f,) = (run / "checkpoints" / "step_00000006").glob(
        "*zero_pp_rank_1_mp_rank_00_optim_states.pt"
    )
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one flipped bit, same size
    f.write_bytes(raw)
    err = one_line_error(capsys, [str(run), "--out", out])
    assert "corrupt checkpoint" in err and "sha256" in err and f.name in err
    f.write_bytes(raw[:1000])  # truncated
    err = one_line_error(capsys, [str(run), "--out", out])
    assert "truncated" in err and f.name in err
    assert not (tmp_path / "hf").exists()

    target = tmp_path / "taken"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    err = one_line_error(capsys, [str(runs["zero2"]), "--out", str(target)])
    assert "exists and is not empty" in err and "--overwrite" in err
    assert (target / "keep.txt").read_text() == "mine"
    assert main([str(runs["zero2"]), "--out", str(target), "--overwrite"]) == 0
    assert not (target / "keep.txt").exists() and (target / "config.json").is_file()
