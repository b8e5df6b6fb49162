"""Native PyTorch FSDP2 (`fully_shard`): each block is sharded on its own, then the root (the
embeddings, final norm and head), so only one block's full weights exist at a time. A model
built on the meta device (construct.py: presets and Llama folders) is sharded first and only
then made real: each rank allocates its shards and sets their values one parameter at a time,
so no rank ever holds the whole model. Parameters, gradients and optimizer states stay sharded
in fp32; the forward runs on bf16 (or fp16) copies
and gradients are reduced in fp32 (`MixedPrecisionPolicy`). Gradients are reduce-scattered after
every micro-step, as ZeRO-2/3 do, so only shards ever accumulate: skipping the sync would hold
whole unsharded gradients between micro-steps, which is the memory FSDP exists to save.

On one CPU host with accumulation, that memory is traded for communication (`hold`, the
trainer's --hold-weights): the micro-steps of one optimizer step keep the gathered weights
and accumulate whole gradients locally, and the step's last micro-step reduce-scatters once
(per block and step one all-gather and one reduce-scatter, DDP's volume, instead of two
all-gathers and a reduce-scatter per micro-step). The losses match the sharded path; the whole
gradients are counted in the model states. GPUs, several hosts, CPU offload and models whose
whole gradients would not fit never get it by default (docs/benchmarks.md has the A/B).

On one CPU host the all-gathers and reduce-scatters go through DeepSpeed's shared-memory kernel,
as ZeRO-3's do (training/runtime/shm.py: `fsdp_comms`, FSDP2's own custom-collective hooks);
anywhere else, or with --shm-collectives off, they stay on the process group's backend.

Checkpoints go through `torch.distributed.checkpoint` (DCP): every rank writes its own shards
and the metadata says where each piece of each tensor lives, so a checkpoint saved on N ranks
loads on M. `load_full_state_dict` reads one back into whole fp32 tensors without any process
group, for export.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from models import transformer_blocks
from training.engines.native import NativeEngine
from training.runtime import patches
from training.runtime.shm import fsdp_comms

DCP_DIR = "dcp"  # the sharded checkpoint inside a step folder


class FSDPEngine(NativeEngine):
    name = "fsdp"

    def __init__(
        self,
        *,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        hold: bool = False,
        **native,
    ):
        """`hold`: micro-steps keep weights gathered and gradients whole (see the module's note;
        resolved by the trainer's --hold-weights, training/preflight/switches.py)."""
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        super().__init__(**native)
        self.hold = hold
        self._save_group = None  # --async-save's DCP collectives (made at the first save)

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
        self.blocks = _blocks(model)  # before fully_shard renames their classes
        for block in self.blocks:
            # Free a block's gathered weights after its forward (gather again for backward), or
            # keep them until backward: memory against one all-gather per block.
            fully_shard(block, reshard_after_forward=self.reshard_after_forward, **kwargs)
        # The root's weights (embeddings, head) are needed first thing in backward anyway.
        fully_shard(model, reshard_after_forward=False, **kwargs)
        deferred = model.__dict__.pop("deferred_init", None)
        if deferred is not None:  # built on the meta device: only this rank's shards are made
            model.to_empty(device="cpu" if self.cpu_offload else self.device)
            deferred(model)
        comms = fsdp_comms()  # on one CPU host: DeepSpeed's shared-memory kernel, not gloo
        if comms is not None:
            for module in (*self.blocks, model):
                module.set_custom_all_gather(comms[0])
                module.set_custom_reduce_scatter(comms[1])
        return model

    def _no_sync(self):
        return self._held() if self.hold else contextlib.nullcontext()

    def forward_backward(self, x, y, boundary: bool, num_items=None, reference=None):
        if not (self.hold and boundary):
            return super().forward_backward(x, y, boundary, num_items, reference)
        # The step's last micro-step finds the weights the held ones kept: keep them through its
        # backward too, which then reshards and reduce-scatters (one all-gather per block a step).
        for block in self.blocks:
            block.set_reshard_after_forward(False, recurse=False)
        try:
            return super().forward_backward(x, y, boundary, num_items, reference)
        finally:
            for block in self.blocks:
                block.set_reshard_after_forward(self.reshard_after_forward, recurse=False)

    @contextlib.contextmanager
    def _held(self):
        """A non-final micro-step: keep weights gathered, accumulate whole gradients, no
        reduce-scatter. The final micro-step runs with the settings restored, so it reshards
        and reduce-scatters what all micro-steps accumulated."""
        model = self.model
        model.set_requires_gradient_sync(False)
        model.set_reshard_after_backward(False)
        model.set_reshard_after_forward(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
            model.set_reshard_after_backward(True)
            for block in self.blocks:
                block.set_reshard_after_forward(self.reshard_after_forward, recurse=False)
            model.set_reshard_after_forward(False, recurse=False)  # the root's, as wrapped

    def state_bytes(self) -> dict[str, int]:
        counts = super().state_bytes()
        # Held micro-steps accumulate whole fp32 gradients where no parameter points to them.
        held = sum(g.untyped_storage().nbytes() for g in _held_grads(self.model))
        counts["grads"] += held
        counts["total"] += held
        return counts

    def _state(self) -> dict:
        """What a checkpoint holds, as DTensor shards under the model's own names."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        if self.scaler:
            state["scaler"] = self.scaler.state_dict()
        return state

    def save(self, root, tag: str, client_state: dict, writer=None) -> None:
        path = Path(root) / tag / DCP_DIR
        if writer is None:
            dcp.save(self._state(), checkpoint_id=str(path))
            return
        # --async-save: the writer stages the shards (DTensors over host copies of the local
        # shards, counted in staged_bytes, as DDP's files are) and runs DCP's own synchronous
        # save of the copy in its thread, then fsyncs and hashes this rank's files for the seal.
        # Not DCP's async_save: its future says nothing of which files are this rank's or of
        # their hashes (the seal would read every file again), and the loop could not poll it
        # as it polls the other engines' writers. Its thread runs the same synchronous save on
        # a group of its own, as here: DCP's collectives (plans, write results) never meet the
        # step's on one group.
        if self._save_group is None:  # all ranks save: a collective call is safe here
            self._save_group = dist.new_group(backend="gloo")
        group, rank = self._save_group, dist.get_rank()

        def write(staged) -> list[Path]:
            storage = _OwnFiles(str(path))
            dcp.save(staged, storage_writer=storage, process_group=group)
            # the metadata is written by rank 0 before any rank's save returns
            return [path / f for f in storage.files] + ([path / ".metadata"] if rank == 0 else [])

        writer.call(self._state(), write, f"{tag}/{DCP_DIR}")

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


class _OwnFiles(dcp.FileSystemWriter):
    """DCP's file writer, remembering the files this rank wrote (to fsync and hash them)."""

    def write_data(self, plan, planner):
        done = super().write_data(plan, planner)
        self.files = sorted({r.storage_data.relative_path for r in done.wait()})
        return done


def _held_grads(model) -> list[torch.Tensor]:
    """The whole gradients FSDP2 accumulates across held micro-steps (its private state: none
    found means none counted)."""
    out = []
    if not patches.verified("fsdp2_held_grads"):
        return out
    for m in model.modules():
        state = getattr(m, "_get_fsdp_state", lambda: None)()
        group = getattr(state, "_fsdp_param_group", None)
        for fp in getattr(group, "fsdp_params", []):
            g = getattr(fp, "unsharded_accumulated_grad", None)
            if g is not None:
                out.append(g)
    return out


def _blocks(model) -> list[torch.nn.Module]:
    """The repeated transformer blocks (models/blocks.py), each sharded on its own."""
    blocks = transformer_blocks(model)
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
