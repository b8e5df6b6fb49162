"""Compiling each transformer block (models/compile.py): on by default on a CPU
(training/preflight/switches.py: compile_by_default), under real engines, ZeRO-3 included."""

from __future__ import annotations

import json
import types

import pytest
from conftest import TINY_RUN, launch, read_metrics

from models import build_model, compile_blocks
from training.preflight import compile_by_default
from training.preflight.switches import COMPILE_PAYS_AFTER
from training.settings import ds_config


def test_the_blocks_forward_is_what_gets_compiled():
    model = build_model("tiny", vocab_size=512)
    assert compile_blocks(model) == (model.config.num_hidden_layers, "Block")
    # one compiled function for the class, bound to each block: hooks stay outside the graph
    forwards = [b.forward for b in model.layers]
    assert all(isinstance(f, types.MethodType) for f in forwards)
    assert len({id(f.__func__) for f in forwards}) == 1
    assert "forward" not in vars(model)  # the model itself stays eager
    assert not any(getattr(b, "_compiled_call_impl", None) for b in model.layers)


def test_compile_by_default_where_it_was_measured():
    load = lambda name: ds_config.load_json(f"ds_configs/{name}.json")  # noqa: E731

    def on(name, device="cpu", ckpt=False, ours=True, steps=200):
        value, why = compile_by_default(load(name), device, ckpt, ours=ours, steps=steps)
        assert why.startswith("auto: "), why
        return value

    assert on("zero2") and on("zero3")
    assert not on("zero2", "cuda")
    assert not on("zero2", ckpt=True)
    assert not on("pipeline")
    assert not on("zero3_offload")
    assert not on("zero2", ours=False)
    # A run too short to pay the first step's compile back stays eager (COMPILE_PAYS_AFTER).
    assert not on("zero2", steps=20) and on("zero2", steps=COMPILE_PAYS_AFTER)
    assert "20 steps" in compile_by_default(load("zero2"), "cpu", False, steps=20)[1]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["zero2", "zero3", "fsdp"])
def test_compiled_blocks_train_like_eager(tiny_data, tmp_path, engine):
    """2 ranks by default (compiled) and with --no-compile: the same losses within rounding,
    the record says what was compiled, the console what the first step cost. ZeRO-3 and FSDP2
    compile too: their hooks run outside the compiled forward, so nothing recompiles per
    block (FSDP2 here holding its weights across the micro-steps)."""
    losses, logs = {}, {}
    # A 4-step run is too short for compiling by default (COMPILE_PAYS_AFTER): --compile asks.
    for name, extra in (("eager", ["--no-compile"]), ("compiled", ["--compile"])):
        out = tmp_path / name
        run = [a for a in TINY_RUN if a != "--no-compile"]  # the default, as a user gets it
        args = ["--data", str(tiny_data), "--out", str(out), *run, "--steps", "4"]
        args += ["--grad-accum", "2"]
        args += (
            ["--backend", "fsdp"]
            if engine == "fsdp"
            else ["--ds_config", f"ds_configs/{engine}.json"]
        )
        env = {"TORCH_LOGS": "recompiles"}
        logs[name] = launch([*args, "--save-every", "-1", *extra], env=env, as_shipped=True)
        losses[name] = [r["loss"] for r in read_metrics(out)]
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=2e-3)
    record = json.loads((tmp_path / "compiled" / "resolved_config.json").read_text())
    assert record["compiled"] == "2 x Block"
    assert record["switches"]["compile"] == {"on": True, "why": "--compile"}
    eager = json.loads((tmp_path / "eager" / "resolved_config.json").read_text())
    assert eager["switches"]["compile"] == {"on": False, "why": "--no-compile"}
    assert json.loads((tmp_path / "eager" / "resolved_config.json").read_text())["compiled"] is None
    assert "torch.compile (2 x Block): the first step took" in logs["compiled"].stdout
    # at most the one recompile for evaluation's no-grad forward, per rank
    assert logs["compiled"].stderr.count("Recompiling function") <= 2 * 2
