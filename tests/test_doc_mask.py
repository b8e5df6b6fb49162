"""Document-aware packing (--doc-mask): in a packed window, attention stays inside each document
and rotary positions restart at each, so the logits are those of each document run alone."""

from __future__ import annotations

import pytest
import torch
from conftest import launch, read_metrics

from data import prepare
from models import build_model, set_attention_kernel, set_document_mask
from models.llama import document_positions
from training.train import main

EOS = 2
# Three documents, each ended by EOS as data/shards.py writes them; the last is cut by the window.
DOCS = [[5, 6, 7, 8, EOS], [9, 10, EOS], [11, 12, 13, 14, 15, 16]]


def test_documents_and_positions_restart_after_each_separator():
    ids = torch.tensor([sum(DOCS, []), [EOS, *range(20, 33)]])
    docs, positions = document_positions(ids, EOS)
    assert docs[0].tolist() == [0] * 5 + [1] * 3 + [2] * 6
    assert positions[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 5]
    assert docs[1].tolist() == [0] + [1] * 13  # a window may start with a document's last EOS
    assert positions[1].tolist() == [0, *range(13)]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model("tiny", vocab_size=300).eval()  # fp32, grouped-query attention


# sdpa: each document alone; explicit: the dense mask; flex: FlexAttention (a CPU runs its forward)
@pytest.mark.parametrize("kernel", ["sdpa", "explicit", "flex"])
def test_a_packed_window_gives_each_document_its_own_logits(model, kernel):
    set_attention_kernel(model, kernel)
    window = torch.tensor([sum(DOCS, [])])
    with torch.no_grad():
        alone = torch.cat([model(input_ids=torch.tensor([d])).logits[0] for d in DOCS])
        plain = model(input_ids=window).logits[0]
        set_document_mask(model, EOS)
        try:
            packed = model(input_ids=window).logits[0]
        finally:
            set_document_mask(model, None)
            set_attention_kernel(model, "sdpa")  # the module's model trains next: not flex on a CPU
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)
    assert not torch.allclose(plain, alone, atol=1e-2)  # without it, documents see each other


def test_the_mask_trains_the_same_numbers_as_documents_alone(model):
    """Loss and gradients of a packed window of documents equal the sum over the documents run
    alone (the separator's target is the next document's first token either way)."""
    window = torch.tensor([sum(DOCS, [])])
    set_document_mask(model, EOS)
    try:
        model.zero_grad()
        model(input_ids=window, labels=window).loss.backward()
        packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    finally:
        set_document_mask(model, None)
    model.zero_grad()
    flat, n = window[0], window.shape[1] - 1
    start = 0
    for d in DOCS:  # each document alone, scored against the same targets, as one mean
        ids = flat[start : start + len(d)][None]
        targets = flat[start + 1 : start + len(d) + 1]
        targets = torch.cat([targets, torch.full((len(d) - len(targets),), -100)])
        logits = model(input_ids=ids).logits[0]
        (torch.nn.functional.cross_entropy(logits, targets, reduction="sum") / n).backward()
        start += len(d)
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    model.zero_grad()


def test_generation_and_padding_are_unchanged(model):
    ids = torch.tensor([[5, 6, EOS, 7, 8]])
    with torch.no_grad():
        before = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        set_document_mask(model, EOS)
        try:
            after = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        finally:
            set_document_mask(model, None)
    assert torch.equal(before, after)


def test_foreign_models_and_pipelines_are_refused_in_one_line(
    tiny_data, tmp_path, capsys, monkeypatch
):
    # As rank 0 of 2 (a pipeline of 2 stages needs them): preflight refuses before any group.
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", "29999")
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=600, bos_token_id=1, eos_token_id=2)
    ).save_pretrained(tmp_path / "gpt2")
    base = ["--data", str(tiny_data), "--out", str(tmp_path / "run"), "--doc-mask"]
    for extra, expected in (
        (["--model", str(tmp_path / "gpt2")], "is a gpt2 model; document masking is our model's"),
        (
            ["--model", "tiny", "--ds_config", "ds_configs/pipeline.json"],
            "does not reach the pipeline's stages",
        ),
        (["--model", "tiny", "--attention", "amx"], "the amx kernel is causal only"),
    ):
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert [line for line in err.splitlines() if "doc-mask" in line] == [err.splitlines()[-1]]
        assert expected in err.splitlines()[-1], err
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="GPT2LMHeadModel does not have it"):
        set_document_mask(GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2"), EOS)


@pytest.mark.slow
def test_doc_mask_reaches_the_model_on_every_engine(tiny_data, tmp_path):
    """One fp32 step on one rank each, on short documents (several per window): with --doc-mask,
    DeepSpeed, DDP and FSDP2 take the same first loss, and it differs from the run without the
    flag (the same weights and batch)."""
    corpus = tmp_path / "short.jsonl"
    docs = [f"def f{i}(x):\\n    return x * {i} + {i % 7}\\n" for i in range(400)]
    corpus.write_text("".join(f'{{"text": "{d}"}}\n' for d in docs))
    data = prepare(
        str(corpus),
        tmp_path / "data",
        tokenizer=tiny_data / "tokenizer",
        val_fraction=0.1,
        progress=False,
    )
    common = [
        "--data", str(data), "--model", "tiny", "--seq-len", "128", "--micro-batch", "2",
        "--steps", "1", "--log-every", "1", "--eval-every", "0", "--eval-samples", "2",
        "--save-every", "-1",
    ]  # fmt: skip
    deepspeed = ["--backend", "deepspeed", "--ds_config", "ds_configs/fp32.json"]
    loss = {}
    for name, extra in {
        "plain": deepspeed,
        "deepspeed": [*deepspeed, "--doc-mask"],
        "ddp": ["--backend", "ddp", "--precision", "fp32", "--doc-mask"],
        "fsdp": ["--backend", "fsdp", "--precision", "fp32", "--doc-mask"],
    }.items():
        launch([*common, "--out", str(tmp_path / name), *extra], nproc=1)
        loss[name] = read_metrics(tmp_path / name)[0]["loss"]
    for name in ("ddp", "fsdp"):
        assert loss[name] == pytest.approx(loss["deepspeed"], rel=1e-5), loss
    assert abs(loss["deepspeed"] - loss["plain"]) > 1e-4, loss
