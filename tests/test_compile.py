"""--compile: torch.compile of each transformer block (models/compile.py), under a real engine."""

from __future__ import annotations

import json

import pytest
from conftest import TINY_RUN, launch, read_metrics

from models import build_model, compile_blocks


def test_the_blocks_are_what_gets_compiled():
    model = build_model("tiny", vocab_size=512)
    assert compile_blocks(model) == (model.config.num_hidden_layers, "Block")
    assert all(hasattr(b, "_compiled_call_impl") and b._compiled_call_impl for b in model.layers)
    assert not getattr(model, "_compiled_call_impl", None)  # the model itself stays eager


@pytest.mark.slow
def test_compiled_blocks_train_like_eager(tiny_data, tmp_path):
    """ZeRO-2 on 2 ranks with and without --compile: the same losses within rounding, the
    record says what was compiled, and the console says what the first step cost."""
    losses, logs = {}, {}
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        out = tmp_path / name
        args = ["--data", str(tiny_data), "--out", str(out), *TINY_RUN, "--steps", "4"]
        logs[name] = launch([*args, "--save-every", "-1", "--peak-tflops", "1", *extra])
        losses[name] = [r["loss"] for r in read_metrics(out)]
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=2e-3)
    record = json.loads((tmp_path / "compiled" / "resolved_config.json").read_text())
    assert record["compiled"] == "2 x Block"
    assert "torch.compile (2 x Block): the first step took" in logs["compiled"].stdout
