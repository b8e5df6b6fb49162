"""Causal attention for training on CPUs: SDPA's flash forward, and a backward of our own.

PyTorch's CPU flash backward runs two of its five products per block (the recomputed scores
and dP = dO V^T, fp32 outputs) outside oneDNN, so it takes far longer than its FLOPs say
(measured in docs/benchmarks.md). `kernels/attention_backward_cpu.cpp` runs all
five through oneDNN's brgemm (AMX where the CPU has it), from the logsumexp the forward saved.

The C++ is built on first use with the host's compiler into torch's extension cache (~10 s,
once per machine; ranks wait on one build) and registered as `torch.ops.zerostack`, so
compiled blocks call it as one opaque op. `available()` says whether this host can: a CPU
with AMX (where it was measured) and a C++ compiler. `--attention sdpa` or `explicit` keeps a
run off it.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import torch

from models.compile import cxx_compiler

SOURCE = Path(__file__).parent / "kernels" / "attention_backward_cpu.cpp"
# Queries and keys a block: 128 where the sequence divides into it, else 64 (the sizes measured
# in docs/bench_attention.md).
BLOCK, SMALL_BLOCK = 128, 64


@functools.cache
def available() -> str | None:
    """None if the kernel runs here, else why not (one line)."""
    if not _has_amx():
        return "this CPU has no AMX (the kernel was measured only with it)"
    if shutil.which(cxx_compiler()) is None:
        return "no C++ compiler to build it"
    try:
        _load()
    except Exception as e:  # a failed build says why in its first line
        return f"its build failed: {str(e).strip().splitlines()[0][:200]}"
    if not torch.ops.zerostack.attention_backward_packs():
        return "this CPU's oneDNN packs no bf16 operands"
    return None


def _has_amx() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:  # not Linux
        return False
    return "amx_bf16" in flags


@functools.cache
def _load() -> None:
    from torch.utils.cpp_extension import load

    # AVX-512 with bf16 conversions: every CPU with AMX has them (not -march=native, so a build
    # in a shared cache runs on any AMX host)
    flags = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma"]
    load("zerostack_attention", [str(SOURCE)], extra_cflags=flags, is_python_module=False)
    torch.library.register_fake("zerostack::attention_backward")(_backward_shapes)


def _backward_shapes(dout, q, k, v, out, lse, scale, q_block, kv_block):
    return (
        q.new_empty(q.shape),
        k.new_empty(k.shape),
        v.new_empty(v.shape),
    )


def fits(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether these q, k (b, heads, t, d) fit the kernel: bf16 self-attention on a CPU whose
    length divides into blocks. (Whether the host runs it at all is `available()`, asked once
    when the kernel is picked.)"""
    t = q.shape[2]
    return (
        q.dtype == torch.bfloat16
        and q.device.type == "cpu"
        and k.shape[2] == t
        and t % SMALL_BLOCK == 0
        and q.shape[3] % 2 == 0
    )


@torch.library.custom_op("zerostack::causal_attention", mutates_args=(), device_types="cpu")
def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, True, scale=q.shape[-1] ** -0.5
    )
    return out.contiguous(), lse.contiguous()


@_attention.register_fake
def _(q, k, v):
    b, h, t, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, t), dtype=torch.float32)


def _setup(ctx, inputs, output):
    q, k, v = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)


def _grads(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    scale = q.shape[-1] ** -0.5
    t = q.shape[2]
    block = BLOCK if t % BLOCK == 0 else SMALL_BLOCK
    return torch.ops.zerostack.attention_backward(dout, q, k, v, out, lse, scale, block, block)


_attention.register_autograd(_grads, setup_context=_setup)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v under a causal mask, as SDPA computes it: q (b, heads, t, d),
    k and v (b, kv_heads, t, d); `fits(q, k)` must hold, and `available()`."""
    return _attention(q, k, v)[0]
