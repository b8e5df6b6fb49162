"""training.sample: the sampling rule (temperature, top-k, top-p) on crafted distributions, and
generation from a small stock Llama folder built here (random weights, a word-level tokenizer)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from training.sample import filter_logits, generate, main

VOCAB = ["<unk>", "</s>", *"abcdefghijklmnop"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A stock LlamaForCausalLM folder with a word-level (one letter a word) tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("hf")
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    fast.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def kept(logits: torch.Tensor) -> list[int]:
    return torch.isfinite(logits).nonzero().flatten().tolist()


def test_top_p_keeps_the_smallest_set_that_reaches_p():
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])  # by rank: 1, 3, 4, 2, 0
    logits = probs.log()
    assert kept(filter_logits(logits, top_p=0.4)) == [1]  # 0.4 reaches 0.4 alone
    assert kept(filter_logits(logits, top_p=0.41)) == [1, 3]
    assert kept(filter_logits(logits, top_p=0.7)) == [1, 3]  # 0.7 reached exactly
    assert kept(filter_logits(logits, top_p=0.71)) == [1, 3, 4]
    assert kept(filter_logits(logits, top_p=0.96)) == [0, 1, 2, 3, 4]
    assert kept(filter_logits(logits, top_p=0.01)) == [1]  # the most likely always stays
    kept_probs = filter_logits(logits, top_p=0.71).softmax(-1)  # renormalized over the nucleus
    torch.testing.assert_close(kept_probs[[1, 3, 4]], torch.tensor([0.4, 0.3, 0.15]) / 0.85)


def test_top_k_then_top_p_and_temperature_per_row():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [4.0, 0.0, 0.0, 0.0]])
    out = filter_logits(logits, top_k=2)
    assert torch.isfinite(out).tolist() == [[False, True, False, True], [True, True, True, True]]
    # ties at the k-th value stay (the second row's three zeros), as the k-th is not unique
    out = filter_logits(logits, temperature=2.0, top_k=3, top_p=0.5)
    assert kept(out[0]) == [1] and kept(out[1]) == [0]
    torch.testing.assert_close(filter_logits(logits, temperature=2.0), logits / 2)
    assert torch.equal(filter_logits(logits), logits)  # the defaults change nothing


def test_top_k_1_samples_the_greedy_continuation(hf_dir):
    greedy = generate(hf_dir, "abc", max_new_tokens=12, greedy=True)
    for seed in (0, 1):
        assert generate(hf_dir, "abc", 12, temperature=1.5, top_k=1, seed=seed) == greedy
        assert generate(hf_dir, "abc", 12, temperature=1.5, top_p=1e-6, seed=seed) == greedy
    # and the filters are what makes it so: unfiltered sampling at this temperature wanders
    sampled = {generate(hf_dir, "abc", 12, temperature=1.5, top_k=0, seed=s) for s in range(4)}
    assert sampled != {greedy}
    # a fixed seed is reproducible
    assert generate(hf_dir, "abc", 12, top_p=0.9, seed=3) == generate(
        hf_dir, "abc", 12, top_p=0.9, seed=3
    )


@pytest.mark.parametrize(
    "flags, named",
    [(["--top-p", "0"], "--top-p"), (["--top-k", "-1"], "--top-k"),
     (["--temperature", "0"], "--temperature"), (["--top-p", "nan"], "--top-p")],
)  # fmt: skip
def test_bad_sampling_values_are_refused_in_one_line(hf_dir, flags, named, capsys):
    assert main([str(hf_dir), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {named} ")


def test_help_is_whole():
    out = subprocess.run(
        [sys.executable, "-m", "training.sample", "--help"], capture_output=True, text=True
    ).stdout
    text = " ".join(out.split())
    assert "Generate text from an exported model folder with stock transformers: greedily" in text
    assert "--top-k" in text and "--top-p" in text and "nucleus sampling" in text


@pytest.fixture(scope="module")
def chat_dir(tiny_data, tmp_path_factory):
    """A stock LlamaForCausalLM folder (random weights) with a ChatML-templated tokenizer."""
    from conftest import chat_tokenizer
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = chat_tokenizer(tiny_data, tmp_path_factory.mktemp("chat") / "hf")
    config = LlamaConfig(
        vocab_size=len(AutoTokenizer.from_pretrained(out)), hidden_size=32,
        intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def test_chat_renders_the_template_and_returns_the_reply(chat_dir, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.sample import end_of_turn

    tok = AutoTokenizer.from_pretrained(chat_dir)
    model = AutoModelForCausalLM.from_pretrained(chat_dir).eval()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    ids = torch.tensor([tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]])
    assert tok.decode(ids[0]).endswith("<|im_start|>assistant\n")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn(tok, messages) == [im_end]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                             do_sample=False, eos_token_id=[tok.eos_token_id, im_end],
                             pad_token_id=tok.eos_token_id)  # fmt: skip
    want = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    got = generate(chat_dir, "hi", max_new_tokens=8, greedy=True, chat=True, system="Be brief.")
    assert got == want
    assert main([str(chat_dir), "--chat", "--system", "Be brief.", "--prompt", "hi", "--greedy",
                 "--max-new-tokens", "8"]) == 0  # fmt: skip
    assert capsys.readouterr().out == want + "\n"


def test_chat_without_a_template_is_refused_in_one_line(hf_dir, capsys):
    assert main([str(hf_dir), "--chat", "--prompt", "abc"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no chat template" in err[0], err
