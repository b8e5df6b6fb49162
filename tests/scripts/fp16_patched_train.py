"""Runs training/train.py with the accelerator's fp16 check patched, in this process only.

This CPU has no fp16 kernels, so DeepSpeed (and our trainer) refuse fp16 here; the patch lets the
tests exercise the loss-scaling logic (overflow skips, scale changes, scaler state in
checkpoints) on a few steps of the tiny preset. Never used outside tests."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from deepspeed.accelerator import get_accelerator  # noqa: E402

acc = get_accelerator()
acc.is_fp16_supported = lambda: True
acc.supported_dtypes = lambda: [torch.float, torch.bfloat16, torch.float16]

from training.runtime import distributed  # noqa: E402
from training.train import main  # noqa: E402

distributed.exit_process(main())
