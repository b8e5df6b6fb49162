"""Preference tuning of a mixture-of-experts model: the DPO and IPO losses carry the router
losses, our model's (load-balancing and z-loss, per layer, padding left out) and an HF MoE
folder's (transformers' load-balancing loss), against a plain computation and in a real run."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import launch, read_metrics
from test_moe import plain_router_losses
from test_moe_training import hf_moe_folder

from data.examples import IGNORE_INDEX
from data.pairs import PairDataset
from data.reader import _to_xy
from models import build_model
from training.objectives import PreferenceLoss
from training.objectives.dpo import preference_loss, sequence_logps

SEQ = 64
BETA = 0.3


def pair_batch(pairs, n: int = 4):
    """n pairs of the prepared preference data with made-up reference log-probs: (vocabulary,
    x, y, reference)."""
    ds = PairDataset(pairs["data"], "train", SEQ)
    ds.reference = -np.random.default_rng(0).uniform(5, 60, size=(len(ds), 2))
    x, y, reference = _to_xy(np.stack([ds[i] for i in range(n)]))
    return ds.manifest.vocab_size, x, y, reference


def plain_real_tokens(y: torch.Tensor) -> torch.Tensor:
    """Row by row: the tokens up to the one the row's last trained target names (the padding
    after it is not a token of the example)."""
    real = torch.zeros_like(y, dtype=torch.bool)
    for row in range(len(y)):
        last = max(t for t in range(y.shape[1]) if y[row, t] != IGNORE_INDEX)
        real[row, : last + 2] = True
    return real


@pytest.mark.parametrize("kind", ["dpo", "ipo"])
def test_preference_loss_adds_our_models_router_losses(pairs, kind):
    vocab, x, y, reference = pair_batch(pairs)
    torch.manual_seed(0)
    model = build_model("tiny-moe", vocab_size=vocab).train()
    seen = []  # each layer's router logits in the objective's forward
    hooks = [
        m.register_forward_hook(lambda mod, i, out: seen.append(mod.router_logits.detach()))
        for m in model.moe_layers()
    ]
    loss = PreferenceLoss(kind, BETA)(model, x, y, reference=reference)
    for h in hooks:
        h.remove()
    with torch.no_grad():
        logps, lengths = sequence_logps(model(input_ids=x).logits, y)
        want, _ = preference_loss(kind, BETA, logps, reference, lengths)
    assert (y == IGNORE_INDEX).any(dim=1).all()  # every row padded or prompted
    aux, z = plain_router_losses(seen, 2, plain_real_tokens(y).reshape(-1))
    c = model.config
    router = c.router_aux_loss_coef * aux + c.router_z_loss_coef * z
    assert router > 1e-3
    assert loss.item() == pytest.approx(want.item() + router, rel=1e-6, abs=1e-7)
    model.zero_grad()
    loss.backward()
    assert model.layers[0].feed_forward.gate.weight.grad.abs().sum() > 0
    # eval (validation): the preference loss alone, comparable with a dense model's
    model.eval()
    with torch.no_grad():
        val = PreferenceLoss(kind, BETA)(model, x, y, reference=reference)
    assert val.item() == pytest.approx(want.item(), rel=1e-6, abs=1e-7)


def test_preference_loss_adds_an_hf_moe_folders_aux_loss(pairs, tmp_path):
    """A stock Mixtral folder: router_aux_loss_coef x transformers' load-balancing loss of the
    same forward (its own formula, as its next-token training adds it), over the pairs' real
    tokens (their padding given as its attention mask)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from models.moe import real_tokens

    vocab, x, y, reference = pair_batch(pairs)
    folder = hf_moe_folder("mixtral", tmp_path / "mixtral", vocab_size=vocab, weights=True)
    model = build_model(folder).train()
    loss = PreferenceLoss("dpo", BETA)(model, x, y, reference=reference)
    with torch.no_grad():
        out = model(input_ids=x, output_router_logits=True)
        logps, lengths = sequence_logps(out.logits, y)
        want, _ = preference_loss("dpo", BETA, logps, reference, lengths)
        aux = load_balancing_loss_func(out.router_logits, 4, 2, real_tokens(y).long())
        assert not bool(real_tokens(y).all())  # the pairs are padded: the mask matters
    router = model.config.router_aux_loss_coef * aux.item()
    assert router > 1e-3
    assert loss.item() == pytest.approx(want.item() + router, rel=1e-6, abs=1e-7)


@pytest.mark.slow
def test_dpo_run_of_an_moe_model_steps_on_its_router_losses(pairs, tmp_path):
    """2 ranks, 2 steps of DPO on tiny-moe: at step 1 the policy is the reference, so the DPO
    loss is log 2 and the logged loss is log 2 plus the weighted router losses logged beside it."""
    run = tmp_path / "run"
    launch(["--data", str(pairs["data"]), "--out", str(run), "--model", "tiny-moe",
            "--seq-len", "64", "--micro-batch", "2", "--log-every", "1", "--eval-every", "0",
            "--eval-samples", "8", "--lr", "3e-3", "--warmup", "1", "--steps", "2",
            "--save-every", "0", "--precision", "fp32", "--objective", "dpo"])  # fmt: skip
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2]
    first = rows[0]
    router = 0.001 * first["moe_aux_loss"] + 0.001 * first["moe_z_loss"]  # the preset's coefs
    assert router > 3e-3
    assert first["loss"] == pytest.approx(math.log(2) + router, abs=1e-5)
