"""Native PyTorch DDP: fp32 weights on every rank, the forward under autocast (bf16, or fp16
with a GradScaler), gradients all-reduced once per optimizer step (`no_sync` on the other
micro-steps). The checkpoint is two plain files written by rank 0."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from training.engines.native import NativeEngine

MODEL_FILE = "model.pt"  # the model's own state dict, fp32: what export reads
OPTIM_FILE = "optim.pt"
BUCKET_MB = 25.0  # --ddp-bucket-mb's default


class DDPEngine(NativeEngine):
    name = "ddp"

    def __init__(self, *, bucket_mb: float | None = None, **native):
        self.bucket_mb = bucket_mb or BUCKET_MB
        super().__init__(**native)

    def _wrap(self, model):
        if not dist.is_initialized():
            raise RuntimeError("--backend ddp needs torch.distributed (run it under torchrun)")
        return DistributedDataParallel(
            model,
            device_ids=[self.device.index] if self.device.type != "cpu" else None,
            # Gradients live in the all-reduce buckets: no copy in and out, no second buffer.
            gradient_as_bucket_view=True,
            # Every parameter is used every step, so no unused-parameter search. (static_graph
            # would save little more and fails an internal assert when the first step starts
            # under no_sync, which accumulation does.)
            find_unused_parameters=False,
            bucket_cap_mb=self.bucket_mb,
            # the model has no buffers that change in training; torch before 2.13 names it
            # broadcast_buffers (still accepted, deprecated after)
            **_no_buffer_sync(),
        )

    def _no_sync(self):
        return self.model.no_sync()

    def _autocast(self):
        if self.precision == "fp32":
            return super()._autocast()
        return torch.autocast(self.device.type, dtype=self.dtype)

    @property
    def module(self):
        return self.model.module

    def save(self, root, tag: str, client_state: dict, writer=None) -> None:
        folder = Path(root) / tag
        write = writer.save if writer is not None else torch.save
        if dist.get_rank() == 0:  # every rank holds the same weights and optimizer state
            folder.mkdir(parents=True, exist_ok=True)
            write(self.module.state_dict(), folder / MODEL_FILE)
            write(
                {
                    "optimizer": self.optimizer.state_dict(),
                    "scaler": self.scaler.state_dict() if self.scaler else None,
                },
                folder / OPTIM_FILE,
            )
        dist.barrier()

    def load(self, root, tag: str) -> None:
        folder = Path(root) / tag
        if not (folder / MODEL_FILE).is_file():
            raise RuntimeError(f"{folder} holds no DDP checkpoint ({MODEL_FILE} missing)")
        # Tensors and plain containers only (optimizer and scaler state dicts are just that):
        # weights_only, so a file planted in the folder cannot run code.
        model = torch.load(folder / MODEL_FILE, map_location=self.device, weights_only=True)
        self.module.load_state_dict(model)
        extra = torch.load(folder / OPTIM_FILE, map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(extra["optimizer"])
        if self.scaler and extra.get("scaler"):
            self.scaler.load_state_dict(extra["scaler"])


def load_full_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    sd = torch.load(Path(folder) / MODEL_FILE, map_location="cpu", weights_only=True)
    return {k: v.float() for k, v in sd.items()}


def _no_buffer_sync() -> dict:
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    if "forward_sync_buffers" in params:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}
