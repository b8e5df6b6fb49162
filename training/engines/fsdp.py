"""Native PyTorch FSDP2 (`fully_shard`): each block is sharded on its own, then the root (the
embeddings, final norm and head), so only one block's full weights exist at a time. Parameters,
gradients and optimizer states stay sharded in fp32; the forward runs on bf16 (or fp16) copies
and gradients are reduced in fp32 (`MixedPrecisionPolicy`). Gradients are reduce-scattered after
every micro-step, as ZeRO-2/3 do, so only shards ever accumulate: skipping the sync would hold
whole unsharded gradients between micro-steps, which is the memory FSDP exists to save.

Checkpoints go through `torch.distributed.checkpoint` (DCP): every rank writes its own shards
and the metadata says where each piece of each tensor lives, so a checkpoint saved on N ranks
loads on M. `load_full_state_dict` reads one back into whole fp32 tensors without any process
group, for export.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from training.engines.native import NativeEngine

DCP_DIR = "dcp"  # the sharded checkpoint inside a step folder


class FSDPEngine(NativeEngine):
    name = "fsdp"

    def __init__(self, *, reshard_after_forward: bool = True, cpu_offload: bool = False, **native):
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        super().__init__(**native)

    def _wrap(self, model):
        if not dist.is_initialized():
            raise RuntimeError("--backend fsdp needs torch.distributed (run it under torchrun)")
        mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        low = None if self.precision == "fp32" else self.dtype
        kwargs = {
            "mesh": mesh,
            "mp_policy": MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32),
        }
        if self.cpu_offload:
            # Shards, gradients and the optimizer step live in host memory. Pinned memory needs
            # an accelerator, so a CPU-only run does without it.
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=self.device.type != "cpu")
        for block in _blocks(model):
            # Free a block's gathered weights after its forward (gather again for backward), or
            # keep them until backward: memory against one all-gather per block.
            fully_shard(block, reshard_after_forward=self.reshard_after_forward, **kwargs)
        # The root's weights (embeddings, head) are needed first thing in backward anyway.
        fully_shard(model, reshard_after_forward=False, **kwargs)
        return model

    def _state(self) -> dict:
        """What a checkpoint holds, as DTensor shards under the model's own names."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        if self.scaler:
            state["scaler"] = self.scaler.state_dict()
        return state

    def save(self, root, tag: str, client_state: dict) -> None:
        dcp.save(self._state(), checkpoint_id=str(Path(root) / tag / DCP_DIR))

    def load(self, root, tag: str) -> None:
        path = Path(root) / tag / DCP_DIR
        if not (path / ".metadata").is_file():
            raise RuntimeError(f"{path.parent} holds no FSDP checkpoint ({DCP_DIR}/ missing)")
        state = self._state()
        dcp.load(state, checkpoint_id=str(path))  # fills the shards this rank owns, any world
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        if self.scaler:
            self.scaler.load_state_dict(state["scaler"])


def _blocks(model) -> list[torch.nn.Module]:
    """The repeated transformer blocks: ours (`layers`), or an HF model's `_no_split_modules`."""
    names = set(getattr(model, "_no_split_modules", None) or ["Block"])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"{type(model).__name__}: found no transformer blocks to shard")
    return blocks


def load_full_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """Whole fp32 model tensors from the DCP checkpoint in `folder`, in this process alone."""
    path = Path(folder) / DCP_DIR
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    model = {
        key.removeprefix("model."): torch.empty(m.size, dtype=m.properties.dtype)
        for key, m in meta.items()
        if key.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # "no process group: loading in one process" is the point
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": model}, checkpoint_id=str(path), no_dist=True)
    return {k: v.float() for k, v in model.items()}
