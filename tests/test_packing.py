"""Chat examples packed several to a sample (--doc-mask, data/examples.py PackedExamples): fewer
samples, the same trained tokens, and with our model's document mask each trained token's loss
is the one it has alone."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import TINY_RUN, chat_rows, chat_tokenizer, launch, read_metrics

from data.examples import IGNORE_INDEX, ExampleDataset, PackedExamples
from data.reader import _to_xy

SEQ = 192


def segments(row_tokens: np.ndarray, row_targets: np.ndarray, sep: int):
    """(tokens, trained targets) of each example in a packed sample, split at its separators."""
    out, start = [], 0
    for pos in np.flatnonzero(row_tokens == sep).tolist() + [len(row_tokens)]:
        if pos > start:
            out.append(row_targets[start:pos][row_targets[start:pos] != IGNORE_INDEX].tolist())
        start = pos + 1
    return [s for s in out if s]


def test_packed_samples_hold_every_trained_token_once_in_fewer_samples(chat_data):
    one = ExampleDataset(chat_data, "train", SEQ)
    packed = PackedExamples(chat_data, "train", SEQ)
    assert packed.examples == len(one) and len(packed) < len(one) / 2
    alone = [one[i][1][one[i][1] != IGNORE_INDEX].tolist() for i in range(len(one))]
    together = [s for i in range(len(packed)) for s in segments(*packed[i], packed.separator)]
    assert together == [a for a in alone if a]  # corpus order, each example whole, once
    for i in range(len(packed)):
        sample = packed[i]
        assert sample.shape == (2, SEQ + 1)


def test_with_the_document_mask_a_packed_example_has_its_own_losses(chat_data):
    """Our model, its document mask on: the per-token losses of the trained tokens in a packed
    sample equal those of each example alone, unpacked and causal."""
    from models import ZeroStackForCausalLM, get_config, set_document_mask

    one = ExampleDataset(chat_data, "train", SEQ)
    packed = PackedExamples(chat_data, "train", SEQ)
    torch.manual_seed(0)
    model = ZeroStackForCausalLM(get_config("tiny", vocab_size=one.manifest.vocab_size)).eval()

    def token_losses(x, y):
        with torch.no_grad():
            logits = model(input_ids=x).logits.float()
        lp = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), y, ignore_index=IGNORE_INDEX, reduction="none"
        )
        return lp[y != IGNORE_INDEX]

    n = int(packed._packs[0][1] - packed._packs[0][0])
    assert n >= 3
    alone = torch.cat([token_losses(*_to_xy(one[i][None])) for i in range(n)])
    set_document_mask(model, packed.separator)
    together = token_losses(*_to_xy(packed[0][None]))
    assert torch.allclose(together, alone, atol=1e-5), (together - alone).abs().max()
    set_document_mask(model, None)  # without the mask the examples see each other: it differs
    assert not torch.allclose(token_losses(*_to_xy(packed[0][None])), alone, atol=1e-3)


def test_an_eos_inside_examples_refuses_packing_in_one_line(tiny_data, tmp_path):
    """A tokenizer whose EOS is the template's end of turn: multi-turn examples hold it inside,
    so it cannot separate them; --doc-mask is refused before any work, naming the folder."""
    from transformers import AutoTokenizer

    from data import prepare
    from training.errors import ConfigError
    from training.preflight import prepare_run
    from training.settings import flags as cli

    tok_dir = chat_tokenizer(tiny_data, tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    tok.eos_token = "<|im_end|>"
    tok.save_pretrained(str(tok_dir))
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(30)))
    data = prepare(src, tmp_path / "sft", tokenizer=tok_dir, seq_len=64, val_fraction=0.2,
                   progress=False)  # fmt: skip
    argv = ["--data", str(data), "--out", str(tmp_path / "run"), *TINY_RUN, "--seq-len", str(SEQ)]
    with pytest.raises(ConfigError) as e:
        prepare_run(cli.parse([*argv, "--doc-mask"]), world=2)
    line = str(e.value)
    assert "\n" not in line and "inside an example" in line and str(data) in line, line


@pytest.mark.slow
def test_packed_chat_training_resumes_exactly(chat_data, tmp_path):
    """2 ranks, DeepSpeed ZeRO-2, packed chat data with the document mask: stopped at step 2 and
    resumed, steps 3-4 are the uninterrupted run's, bit for bit; fewer samples than examples."""

    def args(out, *extra):
        return ["--data", str(chat_data), "--out", str(out), *TINY_RUN, "--seq-len", str(SEQ),
                "--steps", "4", "--precision", "fp32", "--doc-mask", "--save-every", "2",
                *extra]  # fmt: skip

    whole = tmp_path / "whole"
    launch(args(whole))
    part = tmp_path / "part"
    launch(args(part, "--stop-at", "2"))
    launch(args(part))
    ref = {r["step"]: r["loss"] for r in read_metrics(whole)}
    assert {r["step"]: r["loss"] for r in read_metrics(part)} == ref
    assert len(ref) == 4 and all(np.isfinite(v) for v in ref.values())
