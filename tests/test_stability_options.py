"""The stability options of our model: QK-norm (exported as a stock Qwen3ForCausalLM) and the
z-loss (its gradient, and a run that logs it)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_RUN, launch, read_metrics
from transformers import AutoModelForCausalLM

from models import ZeroStackForCausalLM, get_config, save_llama
from models.llama import causal_lm_loss


def test_qk_norm_exports_as_a_stock_qwen3_with_the_same_logits(tmp_path):
    torch.manual_seed(0)
    model = ZeroStackForCausalLM(get_config("tiny", vocab_size=97, qk_norm=True)).eval()
    with torch.no_grad():  # norms that are not all ones, so a dropped norm shows in the logits
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    save_llama(model.state_dict(), model.config, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(theirs).__name__ == "Qwen3ForCausalLM"
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, stock = model(input_ids=ids).logits, theirs(input_ids=ids).logits
    assert (ours - stock).abs().max() < 1e-4


def test_the_z_loss_adds_its_term_and_its_exact_gradient():
    torch.manual_seed(0)
    logits = torch.randn(2, 7, 11, dtype=torch.float64) * 3
    labels = torch.randint(0, 11, (2, 7))
    labels[0, 3] = -100
    ours = logits.clone().requires_grad_()
    z = [1e-2, None]
    loss = causal_lm_loss(ours, labels, z_loss=z)
    loss.backward()
    ref_in = logits.clone().requires_grad_()
    targets = F.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
    rows, valid = ref_in.reshape(-1, 11), targets != -100
    ce = F.cross_entropy(rows, targets, ignore_index=-100, reduction="sum")
    z_term = 1e-2 * (torch.logsumexp(rows, 1)[valid] ** 2).sum() / valid.sum()
    ref = ce / valid.sum() + z_term
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-5 and abs(z[1].item() - z_term.item()) < 1e-6
    assert (ours.grad - ref_in.grad).abs().max() < 1e-6
    plain = logits.clone().requires_grad_()
    causal_lm_loss(plain, labels).backward()
    assert (plain.grad - ref_in.grad).abs().max() > 1e-4  # the z-loss changes the gradient


@pytest.mark.slow
def test_a_run_with_qk_norm_and_z_loss_logs_it_and_exports_to_qwen3(tiny_data, tmp_path):
    """A 3-step 2-rank run and its export, reloaded by stock transformers (near a minute)."""
    from training.checkpoints.hf_export import export

    out = tmp_path / "run"
    extra = ["--qk-norm", "--z-loss", "1e-3", "--steps", "3", "--save-every", "0"]
    launch(["--data", str(tiny_data), "--out", str(out), *TINY_RUN, *extra])
    rows = read_metrics(out)
    assert all(0 < r["z_loss"] < r["loss"] for r in rows)  # logged, and part of the loss
    hf = export(out, tmp_path / "hf")  # reloaded by stock transformers, logits compared
    assert json.loads((hf / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
