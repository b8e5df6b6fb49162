"""MFU against a matmul ceiling measured in the same run (training/runtime/flops.py), never a
cached one: a host's speed moves from day to day."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import TINY_RUN, launch, read_metrics
from torch.utils.cpp_extension import _get_build_directory

from models import get_config
from training.runtime.flops import (
    Ceiling,
    ceiling_drift,
    measure_flops,
    model_shapes,
    run_ceiling,
    vendor_peak,
)

CPU, BF16 = torch.device("cpu"), torch.bfloat16


def test_probe_shapes_follow_the_model():
    c = get_config("small")  # hidden 384, SwiGLU 1024, vocabulary 8192
    shapes = model_shapes(c, tokens=8 * 256)
    assert (1024, 384, 8192) in shapes  # the head, tokens capped at 1024 rows
    assert (1024, 384, 1024) in shapes and (8192, 1024, 384) in shapes  # MLP, head's gradient
    assert model_shapes(c, tokens=64)[0] == (64, 384, 384)


def test_peak_tflops_overrides_and_cpu_has_no_vendor_peak():
    ceiling = run_ceiling(CPU, BF16, model_shapes(get_config("tiny"), 128), override_tflops=2.5)
    assert ceiling.per_rank == 2.5e12 and ceiling.source == "--peak-tflops"
    assert "--peak-tflops" in ceiling.describe(BF16)
    assert ceiling_drift(ceiling, CPU, BF16) is None  # nothing measured: nothing to re-probe


def test_a_known_gpu_gets_its_vendor_peak_by_its_product_name(monkeypatch):
    """On a GPU the ceiling is the vendor's table, looked up by the product name torch's device
    module gives (DeepSpeed's accelerator names only "cuda:0"; asking it for a product name
    crashed every CUDA run at its first step). This host has no GPU: torch.cuda answers as an
    H200's does."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")
    assert vendor_peak(torch.device("cuda", 0), BF16) == ("H200", 989e12)
    assert vendor_peak(torch.device("cuda", 0), torch.float32) is None  # no tensor-core table
    assert vendor_peak(CPU, BF16) is None


def test_end_probe_warns_when_the_ceiling_moved(monkeypatch):
    """The end's probe measures this host again, on the start's shapes, in the run's dtype and
    fp32, the faster standing: a real probe against a start no CPU reaches (1 EFLOP/s a rank;
    a short probe on a busy shared host reads anywhere from 0.3 to 100 GFLOP/s here, so no
    start taken from an earlier probe is safely above or below it) must flag each MFU as an
    interval. Then the rule itself on planted probes: 5% apart is quiet, 20% warns."""
    from training.runtime import flops

    shapes = model_shapes(get_config("tiny"), 128)
    start = Ceiling(1e18, "measured", (1e18,), tuple(shapes))
    record = ceiling_drift(start, CPU, BF16)
    assert record["kind"] == "ceiling" and record["when"] == "end"
    assert record["shapes_mkn"] == [list(s) for s in shapes]
    rates, end = record["rates_flops"], record["per_rank_flops"]
    assert set(rates) == {"bf16", "fp32"} and end == max(rates.values())
    assert record["dtype"] == max(rates, key=rates.get)
    # FLOP/s of one CPU rank: above 10 MFLOP/s (the slowest seen: 300 MFLOP/s) and below 10 TFLOP/s
    assert 1e7 < end < 1e13, rates
    assert record["change"] == pytest.approx(end / start.per_rank - 1)
    assert "WARNING" in record["warning"] and "interval" in record["warning"]
    for moved, warns in ((1.05, False), (0.8, True)):
        planted = {"bf16": (moved * 100e9,), "fp32": (10e9,)}
        monkeypatch.setattr(flops, "probe_ranks", lambda *a, planted=planted: planted)
        start = Ceiling(100e9, "measured", (100e9,), tuple(shapes), "bf16")
        record = ceiling_drift(start, CPU, BF16)
        assert record["per_rank_flops"] == moved * 100e9
        assert ("warning" in record) is warns, record
    assert "x1.00 to x1.25" in record["warning"]


class _Log:
    def __init__(self):
        self.records = []

    def log(self, record):
        self.records.append(record)


def test_a_step_faster_than_the_ceiling_measures_it_again():
    """A step above a measured ceiling may show it was measured in a slow spell of the host:
    the loop measures again and divides by the higher figure from then on."""
    from training.loop.loop import LiveCeiling
    from training.loop.timer import StepTimer

    probes = iter([400e9, 100e9])
    ceiling, log = LiveCeiling(100e9, lambda: next(probes), ranks=2), _Log()
    ceiling.check(200e9, log, 5, StepTimer())  # measured again: 400e9
    assert ceiling.peak_flops == 400e9 and log.records[0]["when"] == "raised"
    assert log.records[0]["per_rank_flops"] == 200e9
    assert "against 200" in log.records[0]["note"]
    ceiling.check(300e9, log, 6, StepTimer())  # below the ceiling now: no probe
    assert ceiling.peak_flops == 400e9 and len(log.records) == 1


def test_a_planted_flop_count_bug_warns_and_never_moves_the_ceiling():
    """A FLOP count per token twice the model's (the planted bug) makes a step at 60% of a given
    ceiling read 120%: the ceiling stays, one warning names the count, and later steps above it
    neither warn again nor move it (tests/test_precision.py: with a re-probe too)."""
    from training.loop.loop import LiveCeiling
    from training.loop.timer import StepTimer

    true_fpt, tokens_per_s, peak = 1e6, 600e3, 1e12
    ceiling, log = LiveCeiling(peak, ranks=2, flops_per_token=2 * true_fpt), _Log()
    for step in (1, 2, 3):
        ceiling.check(tokens_per_s * 2 * true_fpt, log, step, StepTimer())
        assert ceiling.peak_flops == peak
    assert tokens_per_s * 2 * true_fpt / ceiling.peak_flops == pytest.approx(1.2)  # the row's MFU
    (warned,) = log.records
    assert warned["when"] == "beaten" and warned["step"] == 1
    assert warned["flops_per_token"] == 2 * true_fpt
    assert "WARNING" in warned["warning"] and "2,000,000" in warned["warning"]
    right = LiveCeiling(peak, ranks=2, flops_per_token=true_fpt)
    right.check(tokens_per_s * true_fpt, log, 1, StepTimer())  # the right count: 60%, silent
    assert len(log.records) == 1


@pytest.mark.slow
def test_stale_cached_peak_is_ignored(tiny_data, tmp_path):
    """A peak cached 10x too low (the old ~/.cache/zerostack/peak_flops.json) must not feed MFU:
    the run measures its own ceiling, logs it, and its MFU divides by that."""
    torch.set_num_threads(1)  # as each rank runs
    shapes = model_shapes(get_config("tiny", vocab_size=512), 2 * 64)
    fresh = measure_flops(CPU, BF16, shapes, seconds=0.5)
    home = tmp_path / "home"
    cache = home / ".cache" / "zerostack" / "peak_flops.json"
    cache.parent.mkdir(parents=True)
    stale = fresh / 10
    cache.write_text(json.dumps({"any": stale}))  # what the old cache held, 10x too low
    out = tmp_path / "run"
    args = ["--data", str(tiny_data), "--out", str(out), *TINY_RUN, "--steps", "3"]
    # DeepSpeed's built ops stay where they are (a fresh HOME would rebuild them: a minute): the
    # folder torch builds in, which is a subfolder of its default root when the variable is unset
    ops = os.path.dirname(_get_build_directory("deepspeed_shm_comm", verbose=False))
    env = {"HOME": str(home), "TORCH_EXTENSIONS_DIR": ops, "OMP_NUM_THREADS": "1"}
    # The same run profiles steps 2-3 (--profile; one launch serves both checks).
    launch([*args, "--save-every", "-1", "--profile", "2:3"], env=env)

    record = json.loads((out / "resolved_config.json").read_text())
    peak = record["peak_flops"]
    assert peak["source"] == "measured" and len(peak["ranks_flops"]) == 2
    assert record["peak_flops_per_rank"] == pytest.approx(sum(peak["ranks_flops"]) / 2)
    assert record["peak_flops_per_rank"] > 3 * stale  # fresh, not the planted value
    start, *_, end = read_metrics(out, "ceiling")
    assert start["when"] == "start" and "MFU against" in start["note"]
    assert end["when"] == "end" and end["per_rank_flops"] > 0  # a warning if the host moved
    assert ("warning" in end) == (abs(end["change"]) > 0.10)
    ceilings = read_metrics(out, "ceiling")
    raised = [r for r in ceilings if r["when"] == "raised"]
    against = max([record["peak_flops_per_rank"] * 2] + [r["per_rank_flops"] * 2 for r in raised])
    # A step above a ceiling measured again is warned of once, naming the FLOP count it used;
    # only then may a row's MFU read above 100%.
    beaten = [r for r in ceilings if r["when"] == "beaten"]
    assert len(beaten) <= 1 and all(
        b["flops_per_token"] == record["flops_per_token"] for b in beaten
    ), beaten
    for row in read_metrics(out):
        # The start's ceiling, or a higher one measured when a step beat it.
        assert record["peak_flops_per_rank"] * 2 <= row["mfu_peak_flops"] <= against
        assert row["mfu"] == pytest.approx(
            row["tokens_per_s"] * record["flops_per_token"] / row["mfu_peak_flops"]
        )
        assert 0 < row["mfu"] and (row["mfu"] <= 1 or beaten), (row, ceilings)
    _check_profile(out / "profile")


def _check_profile(folder: Path) -> None:
    """--profile 2:3 on 2 ranks of ZeRO-2: every rank's time by kind of work, gathered to rank 0."""
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["steps"] == [2, 3] and len(summary["per_rank"]) == 2
    for rank in summary["per_rank"]:
        seconds = rank["seconds"]
        assert seconds["matrix products"] > 0  # the model's linears
        assert seconds.get("communication", 0) > 0  # ZeRO-2's gradient all-reduce
        assert seconds.get("optimizer", 0) > 0  # AdamW
        # Self times of one thread's ops, plus what no op covers: the wall time, no more.
        assert sum(seconds.values()) == pytest.approx(rank["wall_s"], rel=0.05)
    assert "aten::mm" in (folder / "ops_rank0.txt").read_text()
    assert json.loads((folder / "trace_rank0.json").read_text())["traceEvents"]
    assert "| matrix products |" in (folder / "summary.md").read_text()


@pytest.mark.slow
def test_fsdp_hold_across_micro_steps_trains_alike(tiny_data, tmp_path):
    """The one-CPU-host speed lever of issue 17 (engines/fsdp.py, on by default there;
    --hold-weights off turns it off): weights held gathered and whole gradients accumulated
    across micro-steps, one all-gather and one reduce-scatter per block and step. Same losses
    and gradient norms as the sharded path, and the whole gradients it holds are counted in the
    model states. (Belongs with tests/test_engines.py.)"""
    runs = {}
    for hold in ("off", "auto"):
        out = tmp_path / f"hold_{hold}"
        args = ["--data", str(tiny_data), "--out", str(out), *TINY_RUN, "--steps", "4"]
        args += ["--backend", "fsdp", "--grad-accum", "3", "--save-every", "-1"]
        launch([*args, "--hold-weights", hold], env={"OMP_NUM_THREADS": "1"})
        runs[hold] = out
    sharded, held = (read_metrics(runs[h]) for h in ("off", "auto"))
    assert [r["loss"] for r in held] == pytest.approx([r["loss"] for r in sharded], rel=1e-6)
    assert [r["grad_norm"] for r in held] == pytest.approx(
        [r["grad_norm"] for r in sharded], rel=1e-5
    )
    flags = [
        json.loads((runs[k] / "resolved_config.json").read_text())["held_across_micro_steps"]
        for k in ("off", "auto")
    ]
    assert flags == [False, True]
    (s,), (h,) = (read_metrics(runs[k], "state_bytes") for k in ("off", "auto"))
    assert h["grads_bytes"] == pytest.approx(2 * s["grads_bytes"], rel=0.02)  # whole, not halves
