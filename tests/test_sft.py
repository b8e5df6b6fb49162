"""Fine-tuning on chat data: the masked loss by hand, and the loss weighed by trained tokens: one
step over micro-batches of very different trained-token counts, on 2 ranks, has the gradient of
the same examples in one batch (DeepSpeed ZeRO-2 and ZeRO-3, DDP, FSDP2; fp32), through the
loop's own code."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, launch, refused

from data import ExampleDataset
from data.examples import IGNORE_INDEX
from models.llama import causal_lm_loss
from training.engines.construct import build_for_engine

SEQ = 64


def tiny_model(vocab: int):
    torch.manual_seed(0)
    return build_for_engine("tiny", vocab_size=vocab, backend="ddp", ds_config={})


def batch(ds: ExampleDataset, indices) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.from_numpy(np.stack([ds[int(i)] for i in indices]))
    return t[:, 0, :-1], t[:, 1, 1:]


def spread(ds: ExampleDataset, indices) -> float:
    """Most trained tokens of one example over fewest."""
    counts = [int((ds[int(i)][1] != IGNORE_INDEX).sum()) for i in indices]
    return max(counts) / min(counts)


def test_masked_loss_is_the_mean_over_trained_tokens_by_hand(chat_data):
    ds = ExampleDataset(chat_data, "train", SEQ)
    model = tiny_model(ds.manifest.vocab_size)
    x, y = batch(ds, range(4))
    trained = y != IGNORE_INDEX
    assert 0 < trained.sum() < trained.numel() // 2  # prompts and padding hold most positions
    out = model(input_ids=x, labels=y, shift_labels=y)
    logits = out.logits.detach().float()
    logp = F.log_softmax(logits, -1)
    by_hand = [-logp[b, t, y[b, t]] for b, t in trained.nonzero().tolist()]
    assert torch.allclose(out.loss, torch.stack(by_hand).mean(), rtol=1e-5)
    # prompt and padding positions get no gradient at all
    leaf = logits.clone().requires_grad_()
    causal_lm_loss(leaf, shift_labels=y).backward()
    assert (leaf.grad[~trained] == 0).all() and (leaf.grad[trained].abs().sum(-1) > 0).all()


@pytest.mark.slow
def test_token_weighted_step_equals_the_whole_batch(chat_data, tmp_path):
    """2 ranks x 2 micro-batches of 1 example = the same 4 examples in one batch."""
    # ZeRO-3 last: the script builds every engine in one process, and its build leaves
    # DeepSpeed state behind that the others would inherit
    runs = ["ddp:1:2", "fsdp:1:2", "zero2:1:2", "zero3:1:2"]  # all in fp32
    out = tmp_path / "grads.pt"
    ds = ExampleDataset(chat_data, "train", SEQ)
    # an order whose first 4 examples hold very different numbers of trained tokens
    seed = next(s for s in range(100) if spread(ds, ds.order(s)(np.arange(4))) >= 4)
    x, y = batch(ds, ds.order(seed)(np.arange(4)))
    launch([str(chat_data), str(out), str(seed), *runs], script="tests/scripts/sft_grads.py")
    got = torch.load(out)
    model = tiny_model(ds.manifest.vocab_size)
    for run in runs:
        r = got[run]
        assert set(r["init"]) == {k for k, _ in model.named_parameters()}, run
        model.load_state_dict(r["init"], strict=False)  # the weights this engine started from
        model.zero_grad()
        whole = model(input_ids=x, labels=y, shift_labels=y).loss
        whole.backward()
        ref = {k: p.grad.clone() for k, p in model.named_parameters()}
        assert r["loss"] == pytest.approx(whole.item(), rel=1e-5), run
        for k in ref:
            assert torch.allclose(r["grads"][k], ref[k], rtol=1e-4, atol=1e-7), (run, k)
    # the mean of the examples' own means, what weighing by micro-batch gives, differs: the
    # data tells the two apart
    model.zero_grad()
    sum(model(input_ids=x[i : i + 1], labels=y[i : i + 1], shift_labels=y[i : i + 1]).loss
        for i in range(4)).div(4).backward()  # fmt: skip
    gap = max(
        (p.grad - ref[k]).abs().max() / ref[k].abs().max() for k, p in model.named_parameters()
    )
    assert gap > 1e-2


def test_refused_with_the_pipeline(chat_data, capsys, monkeypatch, tmp_path):
    cfg = REPO / "ds_configs" / "pipeline.json"
    argv = ["--data", str(chat_data), "--out", str(tmp_path / "run"), "--model", "tiny",
            "--seq-len", str(SEQ), "--ds_config", str(cfg)]  # fmt: skip
    err = refused(capsys, monkeypatch, tmp_path, argv)
    assert "chat data with the pipeline engine" in err, err


@pytest.mark.slow
def test_chat_run_resumes_exactly_and_exports_its_template(chat_data, tmp_path, capsys):
    """The user's path on chat data: train on 2 ranks with accumulation, stop, resume to the
    same losses as a run straight through, the held-out loss below the starting model's
    (--eval-on-start), export, and chat with the export."""
    from conftest import CHATML, TINY_RUN, read_metrics
    from transformers import AutoTokenizer

    from training.export import main as export
    from training.sample import main as sample

    def run(out, *extra):
        args = ["--data", str(chat_data), "--out", str(out), *TINY_RUN, "--grad-accum", "2"]
        launch([*args, "--steps", "4", "--eval-every", "2", "--eval-on-start", *extra])

    straight, split = tmp_path / "straight", tmp_path / "split"
    run(straight, "--save-every", "-1")
    run(split, "--stop-at", "2", "--save-every", "0")
    run(split, "--save-every", "0")  # resumes from step 2
    a, b = read_metrics(straight), read_metrics(split)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    evals = [
        [(r["step"], r["val_loss"]) for r in read_metrics(run, "eval")] for run in (straight, split)
    ]
    assert evals[0] == evals[1]  # step 0 (--eval-on-start: not again on the resume), 2, 4
    assert [step for step, _ in evals[1]] == [0, 2, 4] and evals[1][2][1] < evals[1][0][1]
    hf = tmp_path / "hf"
    assert export([str(split), "--out", str(hf)]) == 0
    assert AutoTokenizer.from_pretrained(hf).chat_template == CHATML  # what training rendered
    argv = [str(hf), "--chat", "--prompt", "Question 1?", "--greedy", "--max-new-tokens", "4"]
    assert sample(argv) == 0
