"""The run's precision chosen by the host when the config or --precision says auto
(training/preflight/precision.py), the warning for an explicit choice that is slow here, and an
MFU above 100% warned of, never hidden (training/runtime/flops.py, training/loop/loop.py)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_RUN, launch, read_metrics

from models import get_config
from training.errors import ConfigError
from training.loop.loop import LiveCeiling
from training.loop.timer import StepTimer
from training.preflight.precision import apply, asked, decide
from training.runtime.flops import model_shapes, run_ceiling

G = 1e9
# Rates per rank (FLOP/s) as measured on each host class by the run's own probe.
AVX2 = {"bf16": 3.5 * G, "fp32": 60 * G}  # AMD Zen 3: no bf16 units, ~17-30x slower
AVX512_BF16 = {"bf16": 340 * G, "fp32": 85 * G}  # AMD Zen 4: AVX512-BF16, no AMX (~4x)
AMX = {"bf16": 900 * G, "fp32": 90 * G}  # Intel Sapphire Rapids: AMX tiles (~10x)


@pytest.mark.parametrize("rates, picked", [(AVX2, "fp32"), (AVX512_BF16, "bf16"), (AMX, "bf16")])
def test_a_cpu_picks_bf16_only_where_it_measured_at_least_as_fast(rates, picked):
    p = decide("auto", "cpu", rates=rates)
    assert p.name == picked and p.asked == "auto" and p.warning is None
    # The reason carries both measured rates.
    assert f"bf16 {rates['bf16'] / G:,.1f} vs fp32 {rates['fp32'] / G:,.1f}" in p.why
    assert p.as_record()["rates_flops"] == rates
    if picked == "fp32":
        assert "17.1x slower" in p.why


def test_a_gpu_decides_by_what_it_supports():
    assert decide("auto", "cuda", bf16_supported=True).name == "bf16"  # A100, H100
    v100 = decide("auto", "cuda", bf16_supported=False)  # V100, T4
    assert v100.name == "fp16" and "dynamic loss scaling" in v100.why
    # fp16 then runs with DeepSpeed's dynamic loss scaling unless the config sets a scale
    cfg = apply({"bf16": {"enabled": "auto"}}, "fp16")
    assert cfg["fp16"] == {"enabled": True, "loss_scale": 0} and cfg["bf16"]["enabled"] is False
    given = apply({"bf16": {"enabled": "auto"}, "fp16": {"loss_scale": 128}}, "fp16")
    assert given["fp16"]["loss_scale"] == 128
    assert apply({"bf16": {"enabled": "auto"}}, "fp32") == {"bf16": {"enabled": False}}


def test_an_explicit_choice_slow_here_runs_as_asked_and_is_warned_about():
    slow = decide("bf16", "cpu", rates=AVX2)
    assert slow.name == "bf16" and slow.warning
    assert "17x slower than fp32" in slow.warning and "3.5 vs fp32 60.0" in slow.warning
    assert "--precision auto" in slow.warning and "ds_configs/fp32.json" in slow.warning
    assert decide("bf16", "cpu", rates=AMX).warning is None  # fast here: nothing to say
    fp16 = decide("fp16", "cpu", rates={"fp16": 0.5 * G, "fp32": 60 * G})  # no fp16 kernels
    assert fp16.name == "fp16" and "fp16 runs 120x slower" in fp16.warning
    assert decide("fp32", "cpu").warning is None
    assert decide("bf16", "cuda", bf16_supported=True).warning is None


def test_what_was_asked_comes_from_the_flag_else_the_config():
    assert asked(None, {"bf16": {"enabled": "auto"}}) == "auto"
    assert asked(None, {"bf16": {"enabled": True}}) == "bf16"
    assert asked(None, {"fp16": {"enabled": True}}) == "fp16"
    assert asked(None, {}) == "fp32"
    assert asked("fp32", {"bf16": {"enabled": "auto"}}) == "fp32"  # the flag wins
    with pytest.raises(ConfigError, match="pick one"):
        asked(None, {"bf16": {"enabled": "auto"}, "fp16": {"enabled": True}}, "x.json")
    with pytest.raises(ConfigError, match="x.json: fp16.enabled and bf16.enabled"):
        asked(None, {"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "x.json")


def test_the_ceiling_is_the_faster_of_the_run_dtype_and_fp32_on_a_cpu():
    """bf16 on an AVX2 host: a compiled graph was seen to beat the eager bf16 probe by computing
    in fp32, so the ceiling is the fp32 rate (planted probe results, as every rank reported)."""
    shapes = model_shapes(get_config("tiny"), 128)
    probed = {"bf16": (3 * G, 4 * G), "fp32": (60 * G, 62 * G)}
    c = run_ceiling(torch.device("cpu"), torch.bfloat16, shapes, probed=probed)
    assert c.per_rank == 61 * G and c.dtype == "fp32" and c.ranks == (60 * G, 62 * G)
    assert "fp32 matmul" in c.describe(torch.bfloat16) and "bf16 4" in c.describe(torch.bfloat16)
    amx = {"bf16": (900 * G, 900 * G), "fp32": (90 * G, 90 * G)}
    assert run_ceiling(torch.device("cpu"), torch.bfloat16, shapes, probed=amx).dtype == "bf16"


class _Log:
    def __init__(self):
        self.records = []

    def log(self, record):
        self.records.append(record)


@pytest.mark.parametrize("reprobe", [lambda: 50 * G, None])
def test_a_step_above_the_ceiling_is_surfaced_not_hidden(reprobe):
    """A planted probe that reads below what the steps do (a slow spell; the wrong dtype's path;
    or a given --peak-tflops): a re-probe that is no higher leaves the ceiling where it was, and
    the steps' own rates never raise it; the first step above it warns (once), and its MFU
    reads above 100%."""
    ceiling, log = LiveCeiling(100 * G, reprobe, ranks=2, flops_per_token=6e6), _Log()
    mfus = []
    for step, flops in enumerate([80 * G, 150 * G, 120 * G, 400 * G], start=1):
        ceiling.check(flops, log, step, StepTimer())
        mfus.append(flops / ceiling.peak_flops)  # what _log_train divides
    assert ceiling.peak_flops == 100 * G
    assert mfus == pytest.approx([0.8, 1.5, 1.2, 4.0])
    assert [(r["step"], r["when"]) for r in log.records] == [(2, "beaten")]
    assert "6,000,000" in log.records[0]["warning"]


@pytest.mark.slow
def test_auto_on_an_avx2_host_trains_in_fp32_and_says_why(tiny_data, tmp_path):
    """Real 2-rank runs on a simulated AVX2-only host (oneDNN held to AVX2 and ATen's dispatch to
    AVX2, which reproduces bf16 matmuls 20-60x slower than fp32): the shipped zero2.json
    (precision auto) records its pick and both rates and trains in fp32; an explicit bf16 runs
    as asked and says once that it is slow. (On this host as it is, tests/test_train.py checks
    the record of every shipped config.)"""
    emulated = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = tmp_path / "auto"
    args = ["--data", str(tiny_data), "--out", str(out), *TINY_RUN, "--steps", "2"]
    r = launch(["--ds_config", "ds_configs/zero2.json", *args], env=emulated)
    record = json.loads((out / "resolved_config.json").read_text())
    choice, rates = record["precision_choice"], record["precision_choice"]["rates_flops"]
    assert choice["asked"] == "auto" and set(rates) == {"bf16", "fp32"}
    assert record["precision"] == choice["picked"] == "fp32" and rates["fp32"] > 5 * rates["bf16"]
    assert record["ds_config"]["bf16"]["enabled"] is False
    assert "fp32 (auto: measured bf16" in r.stdout  # the banner says why, with both rates
    first = read_metrics(out, "precision")[0]  # the run's first log line
    assert first["picked"] == "fp32" and first["step"] == 0 and "GFLOP/s" in first["why"]
    assert record["peak_flops"]["dtype"] == "fp32"  # MFU against the path the products take
    out = tmp_path / "asked"
    args = ["--data", str(tiny_data), "--out", str(out), *TINY_RUN, "--steps", "1"]
    r = launch(["--precision", "bf16", *args], env=emulated)
    assert json.loads((out / "resolved_config.json").read_text())["precision"] == "bf16"
    assert (r.stdout + r.stderr).count("warning: bf16 runs") == 1
