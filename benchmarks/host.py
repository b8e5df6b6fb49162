"""The host class a benchmark ran on (a figure without it means nothing: the same job runs 20x
apart on CPUs with and without bf16 units), and a command's wall time and peak memory on it."""

from __future__ import annotations

import os
import subprocess
import time

import torch

from training.runtime.flops import cpu_name, device_product_name

# What holds a CPU's kernels below its hardware: ATen's dispatch level and oneDNN's ISA (how an
# AVX2-only host is emulated on a newer one)
EMULATION_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def host_class() -> str:
    """The CPU's model, ATen's vector level, whether oneDNN runs bf16 natively, and any variable
    that holds them below the hardware's."""
    held = [f"{k}={os.environ[k]}" for k in EMULATION_VARS if os.environ.get(k)]
    line = f"{cpu_name()}, {torch.backends.cpu.get_cpu_capability()}, bf16 units {bf16_units()}"
    line += f" (emulated: {' '.join(held)})" if held else ""
    gpus = accelerators()  # a GPU host: the CPU alone does not say what ran
    return f"{line}; {gpus}" if gpus else line


def bf16_units() -> str:
    """Whether the CPU has bf16 units: "yes" where oneDNN runs bf16 on its own bf16
    instructions (AVX512-BF16, AMX), "emulated" where it runs bf16 without them (AVX512 CPUs before Cooper Lake: several times
    slower than fp32), "no" where it does not run bf16 (AVX2, or held there)."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "no"
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:  # not Linux: oneDNN's word
        return "yes"
    flags = set(text.split())
    return "yes" if {"avx512_bf16", "amx_bf16"} & flags else "emulated"


def accelerators() -> str | None:
    """ "1x NVIDIA H200": this host's accelerators, by product name; None on a CPU-only host."""
    if not torch.accelerator.is_available():
        return None
    device = torch.accelerator.current_accelerator()
    return f"{torch.accelerator.device_count()}x {device_product_name(device)}"


def timed(cmd: list[str], cwd, stdout=None, stderr=None) -> tuple[float, int, int]:
    """(wall seconds, peak RSS bytes, exit code) of cmd. The peak is the kernel's ru_maxrss of
    the child as wait4 reports it: the largest resident set of the process or any descendant it
    waited for (the ranks under a launcher), what GNU time's %M reads, without needing it."""
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, cwd=cwd, stdout=stdout, stderr=stderr)
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    return time.monotonic() - t0, usage.ru_maxrss * 1024, p.returncode
