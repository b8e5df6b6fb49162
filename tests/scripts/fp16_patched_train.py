"""Runs training/train.py with the accelerator's fp16 check patched, in this process only.

This CPU has no fp16 kernels, so DeepSpeed (and our trainer) refuse fp16 here; the patch lets the
tests exercise the loss-scaling logic (overflow skips, scale changes, scaler state in
checkpoints) on a few steps of the tiny preset. Never used outside tests."""

import torch
from deepspeed.accelerator import get_accelerator

from training.runtime import distributed
from training.train import main


def patch_fp16() -> None:
    """The accelerator says it has fp16 (preflight and DeepSpeed ask it when the run starts)."""
    acc = get_accelerator()
    acc.is_fp16_supported = lambda: True
    acc.supported_dtypes = lambda: [torch.float, torch.bfloat16, torch.float16]


if __name__ == "__main__":
    patch_fp16()
    distributed.exit_process(main())
