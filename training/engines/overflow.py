"""DeepSpeed's ZeRO-1/2 overflow test with one reduction per tensor instead of six.

Before each step of ZeRO-1/2 in bf16 (`bf16.check_grad_overflow`, on by default) and fp16,
DeepSpeed asks whether any gradient of the rank's partition is NaN or infinite, one gradient at
a time: amax, amin, two isfinite, logical_and, logical_not and an add, each a kernel launch. On
an H200 at 350M that left the GPU idle most of a ZeRO-2 step (benchmarks/results/gpu/
h200_2026-11-28_2/profile/). Here each gradient gets one `aminmax` (NaN propagates through it,
and +-inf shows at one end), and the partition's flat buffer, when DeepSpeed keeps one, is one
tensor; one isfinite over all of them answers. The answer is the same tensor DeepSpeed's returns
(a one-element bool on the device, no host sync), and DeepSpeed's has_overflow reduces it across
ranks as before."""

from __future__ import annotations

import types

import torch

from training.runtime import patches


def partition_overflow(optimizer) -> torch.Tensor:
    """Whether any gradient of this rank's partition is not finite: shape [1], bool."""
    ends = []
    for i in range(len(optimizer.bit16_groups)):
        grads = optimizer.averaged_gradients[i]
        flat = getattr(grads, "flat_partition", None)  # the compact buffer's whole partition
        for g in [flat] if flat is not None else grads:
            if g is None:
                continue
            if g.is_sparse:  # only the stored entries can be non-finite
                g = g._values()
            if g.numel():
                ends += torch.aminmax(g)
    if not ends:
        return torch.zeros(1, dtype=torch.bool, device=optimizer.device)
    by_dtype: dict[torch.dtype, list] = {}
    for e in ends:  # gradients of one dtype (the usual case) are stacked without a cast
        by_dtype.setdefault(e.dtype, []).append(e)
    finite = [torch.isfinite(torch.stack(same)).all() for same in by_dtype.values()]
    return torch.stack(finite).all().logical_not().reshape(1)


def fuse_overflow_test(optimizer) -> bool:
    """Give a ZeRO-1/2 optimizer the fused test in place of its per-gradient one (this object
    only); whether it did. Other optimizers, and DeepSpeed outside the patch's range, keep
    their own."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not isinstance(optimizer, DeepSpeedZeroOptimizer) or optimizer.cpu_offload:
        return False  # offload tracks overflow per gradient as it arrives, on the host
    if not patches.verified("zero_overflow_fused"):
        return False
    own = type(optimizer).has_overflow_partitioned_grads_serial
    optimizer._stock_overflow_test = types.MethodType(own, optimizer)
    optimizer.has_overflow_partitioned_grads_serial = types.MethodType(
        partition_overflow, optimizer
    )
    return True
