"""The matmul ceiling MFU is measured against, taken fresh in every run.

A host's matmul speed moves from day to day (docs/benchmarks.md has how far), so a ceiling
cached from another day makes MFU fiction (an MFU against a stale cache once read twice the
fresh probe's). So every run
measures its own: after a barrier, on every rank at once (one rank per core, as training runs:
a probe taken while the other ranks still start up reads up to twice the shared peak), on the
matmul shapes of the model it trains, the median of repeated probes. The run probes again at
its end (`ceiling_drift`) and says so when the host changed speed. `--peak-tflops` overrides;
on a GPU whose vendor peak is known (bf16/fp16 dense tensor-core FLOP/s) that is the default,
as torchtitan and nanoGPT report MFU.
"""

from __future__ import annotations

import math
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from training.runtime import distributed
from training.runtime.distributed import accelerator

# Dense bf16/fp16 tensor-core peaks (FLOP/s) by a substring of the device name, most specific
# first; the figures torchtitan uses (vendor datasheets, no sparsity).
VENDOR_PEAKS: list[tuple[str, float]] = [
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("H20", 148e12),
    ("GH200", 989e12),
    ("B200", 2.25e15),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("MI300X", 1307e12),
    ("MI325X", 1307e12),
    ("MI250X", 191.5e12),
]
PROBE_SECONDS = 2.0  # the most one probe of all shapes may take (past its first 3 rounds)
PROBE_ROUNDS = (3, 15)  # timings of each shape: at least; enough once PROBE_MIN_SECONDS passed
# A median over a few milliseconds of small products would be decided by one scheduler
# hiccup on a shared host.
PROBE_MIN_SECONDS = 0.3
PROBE_ROWS = 1024  # tokens per probed product: larger adds time, not speed
DRIFT_WARN = 0.10  # the end's ceiling this far from the start's: the host changed speed


@dataclass(frozen=True)
class Ceiling:
    """The peak one rank's MFU divides by, and where it came from."""

    per_rank: float  # FLOP/s
    source: str  # "measured", "--peak-tflops", "vendor table (NAME)"
    ranks: tuple[float, ...] = ()  # each rank's own measurement (measured only)
    shapes: tuple[tuple[int, int, int], ...] = field(default=())

    @property
    def measured(self) -> bool:
        return self.source == "measured"

    def describe(self, dtype: torch.dtype) -> str:
        """One line for the console: MFU is against what."""
        what = str(dtype).removeprefix("torch.")
        line = f"MFU against {self.per_rank / 1e9:,.0f} GFLOP/s per rank ({what} matmul, "
        if not self.measured:
            return line + f"{self.source})"
        spread = f"ranks {min(self.ranks) / 1e9:,.0f}-{max(self.ranks) / 1e9:,.0f}"
        return line + f"measured now on all ranks at once, {spread}, {len(self.shapes)} shapes)"

    def as_record(self) -> dict:
        return {
            "per_rank_flops": self.per_rank,
            "source": self.source,
            "ranks_flops": list(self.ranks),
            "shapes_mkn": [list(s) for s in self.shapes],
        }


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def model_shapes(config, tokens: int) -> list[tuple[int, int, int]]:
    """(m, k, n) of the products a step of `config` spends its matmul time in: the forward's
    (tokens x hidden into hidden, MLP width and vocabulary; the MLP's way back) and the weight
    gradients' (out x tokens x in). Tokens are capped at PROBE_ROWS."""
    h = config.hidden_size
    inner = getattr(config, "intermediate_size", None) or 4 * h
    vocab = config.vocab_size
    m = max(1, min(tokens, PROBE_ROWS))
    shapes = [(m, h, h), (m, h, inner), (m, inner, h), (m, h, vocab), (inner, m, h), (vocab, m, h)]
    return list(dict.fromkeys(shapes))


def measure_flops(
    device: torch.device,
    dtype: torch.dtype,
    shapes: list[tuple[int, int, int]],
    seconds: float = PROBE_SECONDS,
) -> float:
    """This process's matmul FLOP/s on `shapes`: each shape timed in rounds, its median kept,
    the best shape's median returned (the ceiling: a model whose matmuls all ran at the best
    shape's speed would score 100%)."""
    sync = (lambda: None) if device.type == "cpu" else torch.accelerator.synchronize
    pairs = []
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        a @ b  # warm-up: kernel selection, page faults
        # Tiny products repeat within one timing, so the clock's resolution does not decide.
        pairs.append((a, b, max(1, int(5e7 // (2 * m * k * n)))))
    sync()
    times: list[list[float]] = [[] for _ in shapes]
    fewest, enough = PROBE_ROUNDS
    start, rounds = time.perf_counter(), 0
    while True:
        spent = time.perf_counter() - start
        settled = rounds >= enough and spent >= PROBE_MIN_SECONDS
        if rounds >= fewest and (spent >= seconds or settled):
            break
        rounds += 1
        for (a, b, reps), took in zip(pairs, times):
            t = time.perf_counter()
            for _ in range(reps):
                a @ b
            sync()
            took.append((time.perf_counter() - t) / reps)
    return max(2 * m * k * n / statistics.median(t) for (m, k, n), t in zip(shapes, times))


def vendor_peak(device: torch.device, dtype: torch.dtype) -> tuple[str, float] | None:
    """(name, FLOP/s) from VENDOR_PEAKS for a known accelerator in bf16/fp16, else None."""
    if device.type == "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return None
    name = accelerator().get_device_name(device.index)
    return next(((key, peak) for key, peak in VENDOR_PEAKS if key in name), None)


def run_ceiling(
    device: torch.device,
    dtype: torch.dtype,
    shapes: list[tuple[int, int, int]],
    override_tflops: float | None = None,
) -> Ceiling:
    """The ceiling of this run: --peak-tflops, else a known accelerator's vendor peak, else
    measured now by every rank at once (their mean: the sum over ranks is the world's
    ceiling). All ranks call."""
    if override_tflops:
        return Ceiling(override_tflops * 1e12, "--peak-tflops")
    known = vendor_peak(device, dtype)
    if known:
        return Ceiling(known[1], f"vendor table ({known[0]})")
    distributed.barrier()  # all ranks probe together, as they will train
    ranks = distributed.all_gather_object(measure_flops(device, dtype, shapes))
    return Ceiling(sum(ranks) / len(ranks), "measured", tuple(ranks), tuple(shapes))


def ceiling_drift(start: Ceiling, device: torch.device, dtype: torch.dtype) -> dict | None:
    """Probe again at the end of a run whose ceiling was measured; returns the metrics record
    (kind "ceiling", with a `warning` when the host's speed moved more than DRIFT_WARN), or
    None when the start's ceiling was not measured. All ranks call."""
    if not start.measured:
        return None
    end = run_ceiling(device, dtype, list(start.shapes))
    change = end.per_rank / start.per_rank - 1
    record = {"kind": "ceiling", "when": "end", **end.as_record(), "change": change}
    moved = f"{start.per_rank / 1e9:,.0f} -> {end.per_rank / 1e9:,.0f} GFLOP/s per rank"
    record["note"] = f"matmul ceiling re-measured at the end: {moved} ({change:+.1%})"
    if abs(change) > DRIFT_WARN and math.isfinite(change):
        low, high = sorted((1.0, start.per_rank / end.per_rank))
        record["warning"] = record["note"] = (
            f"WARNING: the matmul ceiling moved {change:+.0%} during the run ({moved}): the "
            f"host changed speed, so each MFU logged against the start's ceiling is an interval, "
            f"x{low:.2f} to x{high:.2f} of the logged figure"
        )
    return record
