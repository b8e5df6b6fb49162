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


# The precision names flags use, read by the probe and by the native engines alike.
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


@dataclass(frozen=True)
class Ceiling:
    """The peak one rank's MFU divides by, and where it came from. Measured on a CPU, it is the
    faster of the run's dtype and fp32 on the model's shapes: the path a product can take (a
    compiled bf16 graph on a CPU without bf16 units was seen to beat the eager bf16 probe, by
    computing in fp32), so no step can honestly beat it."""

    per_rank: float  # FLOP/s
    source: str  # "measured", "--peak-tflops", "vendor table (NAME)"
    ranks: tuple[float, ...] = ()  # each rank's own measurement (measured only)
    shapes: tuple[tuple[int, int, int], ...] = field(default=())
    dtype: str = ""  # the dtype whose rate is the ceiling (measured only)
    rates: dict = field(default_factory=dict)  # {dtype: mean FLOP/s per rank}, each probed

    @property
    def measured(self) -> bool:
        return self.source == "measured"

    def describe(self, dtype: torch.dtype) -> str:
        """One line for the console: MFU is against what."""
        what = self.dtype or str(dtype).removeprefix("torch.")
        line = f"MFU against {self.per_rank / 1e9:,.0f} GFLOP/s per rank ({what} matmul, "
        if not self.measured:
            return line + f"{self.source})"
        spread = f"ranks {min(self.ranks) / 1e9:,.0f}-{max(self.ranks) / 1e9:,.0f}"
        others = ", ".join(f"{k} {v / 1e9:,.0f}" for k, v in self.rates.items() if k != what)
        line += f"measured now on all ranks at once, {spread}, {len(self.shapes)} shapes"
        return line + (f"; {others})" if others else ")")

    def as_record(self) -> dict:
        return {
            "per_rank_flops": self.per_rank,
            "source": self.source,
            "ranks_flops": list(self.ranks),
            "shapes_mkn": [list(s) for s in self.shapes],
            "dtype": self.dtype,
            "rates_flops": dict(self.rates),
        }


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo) with its family and model numbers (a virtual
    machine's name can be as short as "AMD EPYC": the numbers say Zen 3 or Zen 4), else what
    `platform` knows."""
    try:
        fields = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if not key.strip():
                break  # the first processor's block is enough
            fields.setdefault(key.strip(), value.strip())
        name = fields.get("model name")
        if name:
            if "cpu family" in fields and "model" in fields:
                name += f" (family {fields['cpu family']} model {fields['model']})"
            return name
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
    """This process's matmul FLOP/s in `dtype` on `shapes` (measure_rates)."""
    return measure_rates(device, [dtype], shapes, seconds)[dtype_name(dtype)]


def measure_rates(
    device: torch.device,
    dtypes: list[torch.dtype],
    shapes: list[tuple[int, int, int]],
    seconds: float = PROBE_SECONDS,
) -> dict[str, float]:
    """This process's matmul FLOP/s on `shapes`, per dtype: each product timed in rounds, the
    dtypes interleaved in every round (a host that changes speed meanwhile moves them alike),
    each shape's median kept, the best shape's returned (the ceiling: a model whose matmuls all
    ran at the best shape's speed would score 100%). A dtype without fast kernels (bf16 on a CPU
    with only AVX2: 30x slower than fp32) keeps to its first round once the time is spent."""
    sync = (lambda: None) if device.type == "cpu" else torch.accelerator.synchronize
    cases = []
    # A product whose warm-up says it would take longer than this is probed on fewer rows: a
    # dtype without fast kernels would otherwise spend seconds a shape (its rate is the same).
    budget = seconds / (4 * len(shapes) * len(dtypes))
    for dtype in dtypes:
        for m, k, n in shapes:
            a = torch.randn(m, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            rows = min(m, 64)
            a[:rows] @ b  # warm-up on a slice: kernel selection, b's page faults
            sync()
            t = time.perf_counter()
            a[:rows] @ b
            sync()
            guess = (time.perf_counter() - t) * m / rows
            if guess > budget:
                m = max(rows, int(m * budget / guess))
                a = a[:m].contiguous()
            # Tiny products repeat within one timing, so the clock's resolution does not decide.
            cases.append((dtype_name(dtype), (m, k, n), a, b, max(1, int(5e7 // (2 * m * k * n)))))
    sync()
    times: list[list[float]] = [[] for _ in cases]
    fewest, enough = PROBE_ROUNDS
    cheap = PROBE_MIN_SECONDS / len(cases)  # a timing this short still reaches `fewest` rounds
    start, rounds = time.perf_counter(), 0
    while True:
        spent = time.perf_counter() - start
        if rounds >= enough and spent >= PROBE_MIN_SECONDS:
            break
        over = spent >= seconds
        todo = [
            i
            for i, took in enumerate(times)
            if not took or not over or (len(took) < fewest and took[-1] * cases[i][4] < cheap)
        ]
        if not todo:
            break
        rounds += 1
        for i in todo:
            a, b, reps = cases[i][2:]
            t = time.perf_counter()
            for _ in range(reps):
                a @ b
            sync()
            times[i].append((time.perf_counter() - t) / reps)
    rates: dict[str, float] = {}
    for (name, (m, k, n), *_), took in zip(cases, times):
        rates[name] = max(rates.get(name, 0.0), 2 * m * k * n / statistics.median(took))
    return rates


def device_product_name(device: torch.device) -> str:
    """The product name of an accelerator ("NVIDIA H200"), from torch's module for its type
    (torch.cuda, torch.xpu, ...); DeepSpeed's accelerator names only the device ("cuda:0")."""
    module = torch.get_device_module(device.type)
    get = getattr(module, "get_device_name", None)
    return get(device.index) if get else device.type


def vendor_peak(device: torch.device, dtype: torch.dtype) -> tuple[str, float] | None:
    """(name, FLOP/s) from VENDOR_PEAKS for a known accelerator in bf16/fp16, else None."""
    if device.type == "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return None
    name = device_product_name(device)
    return next(((key, peak) for key, peak in VENDOR_PEAKS if key in name), None)


def probe_ranks(
    device: torch.device, dtypes: list[torch.dtype], shapes: list[tuple[int, int, int]]
) -> dict[str, tuple[float, ...]]:
    """Every rank measures at once (one rank per core, as training runs: a probe taken while
    the other ranks still start up reads up to twice the shared peak); {dtype: each rank's
    FLOP/s}. All ranks call."""
    distributed.barrier()
    gathered = distributed.all_gather_object(measure_rates(device, dtypes, shapes))
    return {name: tuple(g[name] for g in gathered) for name in gathered[0]}


def run_ceiling(
    device: torch.device,
    dtype: torch.dtype,
    shapes: list[tuple[int, int, int]],
    override_tflops: float | None = None,
    probed: dict[str, tuple[float, ...]] | None = None,
) -> Ceiling:
    """The ceiling of this run: --peak-tflops, else a known accelerator's vendor peak, else
    measured now by every rank at once (their mean: the sum over ranks is the world's ceiling),
    in the run's dtype and, on a CPU, in fp32 too: the faster is the ceiling. `probed` reuses
    what probe_ranks measured on these shapes at the start (the precision's choice). All ranks
    call."""
    if override_tflops:
        return Ceiling(override_tflops * 1e12, "--peak-tflops")
    known = vendor_peak(device, dtype)
    if known:
        return Ceiling(known[1], f"vendor table ({known[0]})")
    wanted = list(dict.fromkeys([dtype] + ([torch.float32] if device.type == "cpu" else [])))
    names = [dtype_name(d) for d in wanted]
    if probed is None or any(n not in probed for n in names):
        probed = probe_ranks(device, wanted, shapes)
    means = {n: sum(probed[n]) / len(probed[n]) for n in names}
    best = max(names, key=lambda n: means[n])
    return Ceiling(means[best], "measured", tuple(probed[best]), tuple(shapes), best, means)


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
