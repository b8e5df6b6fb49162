"""The matmul ceiling MFU is measured against: the best matmul FLOP/s this process reaches on
its device, measured and cached per machine, dtype and thread count."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

from training.runtime import distributed
from training.runtime.distributed import accelerator


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _device_key(device: torch.device, dtype: torch.dtype, threads: int) -> str:
    if device.type == "cpu":
        return f"cpu|{cpu_name()}|{dtype}|threads={threads}|torch={torch.__version__}"
    return f"{device.type}|{accelerator().get_device_name(device.index)}|{dtype}"


def measure_peak_flops(
    device: torch.device, dtype: torch.dtype = torch.bfloat16, seconds: float = 2.0
) -> float:
    """Best matmul FLOP/s this process reaches on `device` (its current thread count on CPU).

    The best over square sizes 256 to 4096: which size is fastest depends on caches and
    threads (on a 2-core EPYC, 512-768 on one thread at ~445 GFLOP/s but only ~250 at 2048), and
    a ceiling taken at one size would flatter every MFU. Sizes stop growing once one product
    takes 50 ms, so a dtype without fast kernels (fp16 on most CPUs) is measured in seconds."""
    sync = (lambda: None) if device.type == "cpu" else torch.accelerator.synchronize
    sizes = [256, 512, 768, 1024, 1536, 2048, 3072, 4096]
    best = 0.0
    for size in sizes:
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        a @ b  # warm-up: kernel selection, page faults
        sync()
        end = time.perf_counter() + seconds / len(sizes)
        while True:
            t = time.perf_counter()
            a @ b
            sync()
            took = time.perf_counter() - t
            best = max(best, 2 * size**3 / took)
            if time.perf_counter() >= end:
                break
        if took > 0.05:
            break
    return best


def peak_flops(device: torch.device, dtype: torch.dtype, cache_dir: Path | None = None) -> float:
    """Per-process peak FLOP/s, measured once per machine/dtype/thread count and cached."""
    threads = torch.get_num_threads()
    key = _device_key(device, dtype, threads) + "|probe=2"  # 2: best over sizes
    cache = (cache_dir or Path.home() / ".cache" / "zerostack") / "peak_flops.json"
    table = {}
    if cache.is_file():
        try:
            table = json.loads(cache.read_text())
        except json.JSONDecodeError:
            table = {}
    if key not in table:
        table[key] = measure_peak_flops(device, dtype)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(table, indent=1))
        tmp.replace(cache)
    return float(table[key])


def peak_flops_per_rank(
    device: torch.device, dtype: torch.dtype, override_tflops: float | None = None
) -> float:
    """The per-rank peak a run's MFU divides by: --peak-tflops when given, else rank 0's
    measurement (cached) shared with every rank. All ranks call."""
    if override_tflops:
        return override_tflops * 1e12
    mine = peak_flops(device, dtype) if distributed.rank() == 0 else None
    return distributed.broadcast_object(mine)
