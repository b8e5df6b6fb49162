"""Reading checkpoint files without running code from them.

`torch.load(weights_only=False)` unpickles whatever a file names, so a run folder someone hands a
user ("here is my checkpoint, resume or export it") could run code on their machine; the
integrity listing does not help, since whoever plants a file rewrites the listing too. So every
file zerostack reads is one of:

- JSON: the trainer state, the RNG states, listings and records (layout.py);
- safetensors: exported and imported weights;
- a torch.save file read with `weights_only=True`: tensors and plain containers, plus only the
  classes `allowed()` names (DeepSpeed's ZeRO files hold a few of its own);
- torch.distributed.checkpoint's `.metadata` (FSDP2), a plain pickle, which `check_folder`
  unpickles with an unpickler that knows only DCP's own metadata classes.

`check_folder` reads the classes every pickled file of a checkpoint names, without loading any
of it, and refuses the checkpoint in one line before any rank starts (layout.load_trainer_state
runs it for resume, conversion and export alike). At load time, DeepSpeed's `load_checkpoint`
calls torch.load itself with weights_only=False: `weights_only()` makes torch force weights-only
loading for its duration (TORCH_FORCE_WEIGHTS_ONLY_LOAD, honoured even over an explicit
weights_only=False) with the allow-list registered, so a file changed after the check is still
refused.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import pathlib
import pickle
import re
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint import metadata as dcp_meta

from training.errors import CheckpointError


def _deepspeed_classes() -> list:
    """DeepSpeed 0.19's own classes in its checkpoint files, each plain data (no hook runs
    code from the file's contents when it is rebuilt)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [
        # ZeRO-1/2 optim_states: `param_slice_mappings`, where each parameter sits in the flat
        # partition (a namedtuple of two ints)
        fragment_address,
        # ZeRO-1/2/3 optim_states: `zero_stage` (an int enum)
        ZeroStageEnum,
        # ZeRO-1/2/3 optim_states: `loss_scaler`, the scaler object itself (bf16 and fp32:
        # LossScaler, a static scale of 1; fp16: DynamicLossScaler, its scale and counters)
        LossScaler,
        DynamicLossScaler,
    ]


def _numpy_classes() -> list:
    """numpy's RNG state in trainer_state.pt files written before the state became JSON (an
    uint32 array; an array of Python objects would name further classes, which stay refused)."""
    return [
        np.dtype,
        np.ndarray,
        np._core.multiarray._reconstruct,
        type(np.dtype(np.uint32)),  # numpy.dtypes.UInt32DType: the state's words
    ]


def allowed() -> list:
    """Every class a checkpoint file may name beyond torch's own weights-only defaults."""
    return _deepspeed_classes() + _numpy_classes()


@functools.cache
def _dcp_classes() -> dict[str, object]:
    """What torch.distributed.checkpoint's `.metadata` pickle names: its own dataclasses
    (where each tensor's chunks lie in which file) and torch's size/dtype types."""
    classes = [
        dcp_meta.Metadata,
        dcp_meta.TensorStorageMetadata,
        dcp_meta.BytesStorageMetadata,
        dcp_meta.ChunkStorageMetadata,
        dcp_meta.TensorProperties,
        dcp_meta.MetadataIndex,
        dcp_meta.StorageMeta,
        dcp_meta._MEM_FORMAT_ENCODING,  # an enum: how a tensor's memory format is stored
        dcp_fs._StorageInfo,
        torch.Size,
        pathlib.PosixPath,  # StorageMeta.checkpoint_id, the folder it was saved to
    ]
    named = {f"{c.__module__}.{c.__qualname__}": c for c in classes}
    kinds = (torch.dtype, torch.layout, torch.memory_format)  # torch.float32, torch.strided
    named.update({f"torch.{k}": v for k, v in vars(torch).items() if isinstance(v, kinds)})
    named["collections.OrderedDict"] = collections.OrderedDict
    # how torch pickles a layout: a lookup of torch's layouts by name (torch allows it too)
    named["torch.serialization._get_layout"] = torch.serialization._get_layout
    return named


def load(path: str | Path, *, mmap: bool = False, map_location="cpu"):
    """torch.load of a checkpoint file with weights_only=True and `allowed()` classes. A file
    that names any other class (or is damaged) is a CheckpointError naming it."""
    try:
        with torch.serialization.safe_globals(allowed()):
            return torch.load(path, map_location=map_location, mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(refusal(path, [refused_name(e)])) from None
    except Exception as e:  # a truncated or foreign file: torch raises many kinds
        raise CheckpointError(
            f"{path}: unreadable ({type(e).__name__}: {_first_line(e)})"
        ) from None


def refusal(path, names: list[str]) -> str:
    """The one line for a file that names classes or functions outside the allow-list."""
    return (
        f"{path}: refusing to load it: it names {', '.join(names[:3])}, which is not plain data "
        "(unpickling it could run code); use checkpoints only from people you trust, and save "
        "them again with zerostack"
    )


def check_folder(folder: Path) -> None:
    """Raise CheckpointError naming the first pickled file under checkpoint `folder` (torch
    .pt/.bin, DCP .metadata) that names anything outside the allow-list. Reads no tensor data."""
    files = Path(folder).rglob("*")
    check_files(f for f in files if f.suffix in (".pt", ".bin") or f.name.endswith(".metadata"))


def check_model_folder(folder: Path) -> None:
    """The same for a Hugging Face folder's pickled weights, read only where it has no
    safetensors (what models/factory.py and transformers then load, weights-only)."""
    if not any(Path(folder).glob("*.safetensors")):
        check_files(Path(folder).glob("*.bin"))


def check_files(paths) -> None:
    for f in sorted(paths):
        if f.is_file() and (bad := unsafe_globals(f)):
            raise CheckpointError(refusal(f, bad))


@contextlib.contextmanager
def weights_only() -> Iterator[None]:
    """Inside: every torch.load in this process (DeepSpeed's own included) runs weights-only,
    with `allowed()` classes. A file outside them raises pickle.UnpicklingError."""
    saved = {k: os.environ.get(k) for k in ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", _NO)}
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    os.environ.pop(_NO, None)  # torch refuses both at once
    try:
        with torch.serialization.safe_globals(allowed()):
            yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_NO = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


def unsafe_globals(path: Path) -> list[str]:
    """The classes and functions file `path` names that a load here would refuse, read from its
    pickle without loading it: a torch.save zip (checked against `allowed()`), a DCP
    `.metadata` pickle (against DCP's classes). Anything else named `.pt` that is not a zip
    archive is refused as a whole (torch.save has written zips since torch 1.6)."""
    path = Path(path)
    if path.name.endswith(".metadata"):
        try:
            with open(path, "rb") as f:
                _DCPUnpickler(f).load()
        except pickle.UnpicklingError as e:
            return [refused_name(e)]
        except Exception as e:  # not a pickle at all
            return [f"unreadable ({type(e).__name__}: {_first_line(e)})"]
        return []
    if not zipfile.is_zipfile(path):
        return [f"a file torch.save does not write ({path.name} is not a zip archive)"]
    ok = {f"{c.__module__}.{c.__qualname__}" for c in allowed()}
    found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    return [g for g in found if g not in ok]


class _DCPUnpickler(pickle.Unpickler):
    """pickle.Unpickler that rebuilds only DCP's metadata classes (the pickle docs' "restricting
    globals")."""

    def find_class(self, module: str, name: str):
        known = _dcp_classes().get(f"{module}.{name}")
        if known is None:
            raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")
        return known


def refused_name(e: Exception) -> str:
    """The global torch's (or our) weights-only unpickler refused, from its message."""
    text = str(e)
    if m := re.search(r"GLOBAL ([\w.]+)", text):  # "Unsupported global: GLOBAL builtins.open"
        return m.group(1)
    if m := re.search(r"but got <class '([\w.]+)'>", text):  # "Can only build Tensor, ..."
        return m.group(1)
    return "a class outside the allow-list"


def _first_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else repr(e)
