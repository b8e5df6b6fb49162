"""Reading a DeepSpeed ZeRO checkpoint's optimizer files one parameter at a time.

ZeRO-1/2 (and the pipeline engine, one set per stage) keep, per data-parallel rank, a slice of
each parameter group's flat fp32 weights and Adam moments plus a map of where every parameter
sits in it; ZeRO-3 keeps each parameter cut evenly across the ranks. Under tensor parallelism
(AutoTP) each tensor-parallel rank has its own set of files (mp_rank_XX) holding its slice of
the split weights: column-split ones join along dim 0, row-split ones along dim 1, and the
rest are the same on every rank, as the layout AutoTP records in the checkpoint says.
`ZeroFiles` puts any parameter back together from any of these. The files are memory-mapped,
and the pages under each piece go back to the kernel once it is copied out, so memory stays
near one parameter (one tensor-parallel parameter: its slices and their join) whatever the
model's size. The universal converter (universal.py) and export (weights.py)
read checkpoints through it.

ZeRO-Infinity (ZeRO-3 with offload_optimizer on nvme) saves, for every ZeRO-3 sub-group whose
partition is big enough for DeepSpeed to swap (1 MiB and up), an empty tensor in the optimizer
file and the states as copies of its raw swap files instead:
offloaded_tensors/rankRR/{ID}.tensor.swp (fp32 master partition), exp_avg-{ID}.tensor.swp and
exp_avg_sq-{ID}.tensor.swp, headerless arrays of the partition's elements (the files' tails are
padding to DeepSpeed's I/O alignment). ID is "FIRST_LAST", the DeepSpeed ids of the sub-group's
first and last parameters, which number the model's parameters in state_dict order. Smaller
sub-groups stay in the optimizer file as usual. Those swap files are mapped here like the rest.
"""

from __future__ import annotations

import ctypes
import gc
import math
import os
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from training.checkpoints.expert_files import ExpertLayout, model_params
from training.errors import CheckpointError
from training.runtime import safe_load

STATE_KEYS = ("fp32", "exp_avg", "exp_avg_sq")
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"  # deepspeed.checkpoint.constants
_OPTIM = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_MODEL12 = re.compile(r"mp_rank_(\d+)_model_states\.pt")
_MODEL3 = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")
_LAYER_TP = re.compile(r"-model_(\d+)-model_states\.pt$")


class ZeroFiles:
    """The optimizer files of one DeepSpeed ZeRO checkpoint folder, read parameter by parameter.

    Files are memory-mapped, and the pages of each parameter are handed back to the kernel once
    it is copied out, so resident memory stays near one parameter whatever the model size."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        names = [p.name for p in self.folder.iterdir()]
        optim = {}
        for n in names:
            if m := _OPTIM.fullmatch(n):
                optim[(int(m.group(2)), int(m.group(1)))] = self.folder / n  # (mp, dp)
        if not optim:
            raise CheckpointError(
                f"{self.folder}: no ZeRO optimizer files (*_optim_states.pt); ZeRO-0 checkpoints "
                "have no partitioned state to convert"
            )
        self.mp = 1 + max(mp for mp, _ in optim)
        self.dp = 1 + max(dp for _, dp in optim)
        missing = [(m, d) for m in range(self.mp) for d in range(self.dp) if (m, d) not in optim]
        if missing:
            raise CheckpointError(f"{self.folder}: optimizer files of ranks {missing} are missing")
        self.optim_files = [[optim[(m, d)] for d in range(self.dp)] for m in range(self.mp)]
        z3 = sorted(n for n in names if _MODEL3.fullmatch(n))
        self.stage = 3 if z3 else 2  # 1 and 2 share one file layout
        if self.stage == 3:
            self.model_files_by_mp = [
                self.folder / f"zero_pp_rank_0_mp_rank_{m:02d}_model_states.pt"
                for m in range(self.mp)
            ]
        else:
            self.model_files_by_mp = [
                self.folder / f"mp_rank_{m:02d}_model_states.pt" for m in range(self.mp)
            ]
        for f in self.model_files_by_mp:
            if not f.is_file():
                raise CheckpointError(f"{self.folder}: {f.name} is missing")
        self._first = None
        top = load_mapped(self.model_files_by_mp[0])
        self._experts = ExpertLayout.of(self.folder, top)
        if self._experts is not None and (self.stage == 3 or self.mp > 1):
            raise CheckpointError(
                f"{self.folder}: an expert-parallel checkpoint of ZeRO-3 or tensor parallelism, "
                "whose expert partitions are not joined here (it resumes on its own layout); "
                "export and universal copies read expert-parallel ZeRO-1/2 checkpoints"
            )
        # mp_rank_XX is a tensor-parallel rank under AutoTP, a pipeline stage under the
        # pipeline engine (one layer_XX file per layer beside them), and stage x tensor-parallel
        # rank (stage-major) with tensor-parallel stages, whose layer files then read
        # layer_XX-model_YY. (DeepSpeed's recorded tp_degree is not the test: under Ulysses it
        # reports the sequence-parallel size.)
        layers = [n for n in names if n.startswith("layer_") and n.endswith("-model_states.pt")]
        piped_tp = {int(m.group(1)) for n in layers if (m := _LAYER_TP.search(n))}
        self.tensor_parallel = (1 + max(piped_tp, default=0)) if layers else self.mp
        self._tp_layouts = []
        if self.tensor_parallel > 1:
            if self.stage == 3:
                raise CheckpointError(
                    f"{self.folder}: ZeRO-3 files of {self.mp} tensor-parallel ranks; only "
                    "AutoTP with ZeRO 0-2 is readable"
                )
            for first in range(0, self.mp, self.tensor_parallel):  # one record per stage
                top = load_mapped(self.model_files_by_mp[first])
                self._tp_layouts.append(
                    _TensorLayout(self.folder, top.get(UNIVERSAL_CHECKPOINT_INFO))
                )

    def params(self, keys=STATE_KEYS) -> Iterator[tuple[str, Mapping[str, torch.Tensor], object]]:
        """Yield (name, states, step) for every trained parameter, in the order the model
        declares them. `states[key]` (key: fp32, exp_avg or exp_avg_sq) gathers that state as a
        full-shape fp32 tensor when asked, so only what is asked for is ever in memory."""
        if self.stage == 3:
            yield from self._params_stage3(keys)
        elif self._tp_layouts:
            done = set()  # a tied weight that an earlier pipeline stage also holds
            for stage, layout in enumerate(self._tp_layouts):
                first = stage * self.tensor_parallel
                mps = range(first, first + self.tensor_parallel)
                yield from self._params_tensor_parallel(keys, mps, layout, done)
        elif self._experts is not None:  # AutoEP's names and slices: ours, whole
            yield from model_params(self._params_stage12(keys))
        else:
            yield from self._params_stage12(keys)

    def _params_stage12(self, keys):
        done = set()
        for mp in range(self.mp):
            shapes = load_mapped(self.model_files_by_mp[mp])["param_shapes"]
            sds = [load_mapped(f)["optimizer_state_dict"] for f in self.optim_files[mp]]
            for g, group in enumerate(shapes):
                flats = {k: [_flat(sd, g, k) for sd in sds] for k in keys}
                step = sds[0]["base_optimizer_state"]["state"][g].get("step")
                for name, shape in group.items():
                    if name in done:  # a tied weight that an earlier pipeline stage also holds
                        continue
                    if self._experts is not None and self._experts.is_expert(name):
                        yield name, self._expert_states(flats, sds, g, name, shape), step
                    else:
                        yield name, _States(flats, self._pieces(sds, g, name, shape), shape), step
                    done.add(name)
            del sds

    def _params_tensor_parallel(self, keys, mps=None, layout=None, done=None):
        """AutoTP: every tensor-parallel rank's file set (`mps`: those of one tensor-parallel
        group, all by default) holds every parameter (its slice, or the whole of a replicated
        one); join the slices along the dimension `layout` says the split was made."""
        mps = list(mps if mps is not None else range(self.mp))
        layout, done = layout or self._tp_layouts[0], done if done is not None else set()
        shapes = {mp: load_mapped(self.model_files_by_mp[mp])["param_shapes"] for mp in mps}
        sds = {
            mp: [load_mapped(f)["optimizer_state_dict"] for f in self.optim_files[mp]] for mp in mps
        }
        for g, group in enumerate(shapes[mps[0]]):
            flats = {mp: {k: [_flat(sd, g, k) for sd in sds[mp]] for k in keys} for mp in mps}
            step = sds[mps[0]][0]["base_optimizer_state"]["state"][g].get("step")
            for name in group:
                if name in done:
                    continue
                done.add(name)
                slices = []
                for mp in mps:
                    local = shapes[mp][g].get(name) if g < len(shapes[mp]) else None
                    if local is None:
                        raise CheckpointError(
                            f"{self.folder}: tensor-parallel rank {mp} holds no {name}; the "
                            "checkpoint is corrupt"
                        )
                    pieces = self._pieces(sds[mp], g, name, local)
                    slices.append(_States(flats[mp], pieces, local))
                dim = layout.split_dim(name, [s.shape for s in slices])
                yield name, (slices[0] if dim is None else _Joined(slices, dim)), step

    def _expert_states(self, flats, sds, g: int, name: str, shape) -> Mapping:
        """An AutoEP expert stack: each expert rank's slice of experts (itself partitioned
        across that rank's expert-data-parallel ranks), joined along the expert dimension."""
        slices = [
            _States(flats, self._pieces(sds, g, name, shape, self._experts.ranks_of(e, len(sds))),
                    shape)
            for e in range(self._experts.ep_size)
        ]  # fmt: skip
        return _Joined(slices, 0)

    def _pieces(self, sds, g: int, name: str, shape, ranks=None) -> list[tuple[int, int, int]]:
        """Where `name` lies in each data-parallel rank's flat group g: (rank, start, numel),
        among `ranks` (all by default)."""
        pieces = [
            (r, fa.start, fa.numel)
            for r, sd in enumerate(sds)
            if (ranks is None or r in ranks)
            and (fa := sd["param_slice_mappings"][g].get(name)) is not None
        ]
        numel = sum(n for _, _, n in pieces)
        if numel != math.prod(shape):
            raise CheckpointError(
                f"{self.folder}: {name} has {numel} of its {math.prod(shape)} "
                "elements in the optimizer files; the checkpoint is corrupt"
            )
        return pieces

    def _params_stage3(self, keys):
        top = load_mapped(self.model_files_by_mp[0])
        shapes = top["param_shapes"]
        sds = [load_mapped(f)["optimizer_state_dict"] for f in self.optim_files[0]]
        world = len(sds)
        swapped = (
            _SwapFiles(self.folder, top) if (self.folder / "offloaded_tensors").is_dir() else None
        )
        for g, group in enumerate(shapes):
            local = sum(math.ceil(math.prod(s) / world) for s in group.values())
            flats = {
                k: [
                    sd["fp32_flat_groups"][g]
                    if k == "fp32"
                    else sd["optimizer_state_dict"]["state"][g][k]
                    for sd in sds
                ]
                for k in keys
            }
            if swapped is not None:
                for k, per_rank in flats.items():
                    for r, t in enumerate(per_rank):
                        if t.numel() == 0 and local > 0:  # DeepSpeed swapped this sub-group
                            per_rank[r] = swapped.read(r, k, list(group), local, t.dtype)
            step = sds[0]["optimizer_state_dict"]["state"][g].get("step")
            offset = 0
            for name, shape in group.items():
                numel = math.prod(shape)
                part = math.ceil(numel / world)  # each rank holds `part`, the last ones padded
                if offset + part > min(f[0].numel() for f in flats.values()):
                    raise CheckpointError(
                        f"{self.folder}: {name} lies past the end of the optimizer files; "
                        "the checkpoint is corrupt"
                    )
                sizes = [max(0, min(part, numel - r * part)) for r in range(world)]
                pieces = [(r, offset, n) for r, n in enumerate(sizes)]
                yield name, _States(flats, pieces, shape), step
                offset += part

    def global_state(self) -> dict:
        """zero/optimizer_state.pt: what both loader families read besides the parameters."""
        top = load_mapped(self.optim_files[0][0])
        sd = top["optimizer_state_dict"]
        if self.stage == 3:
            inner = sd["optimizer_state_dict"]
            out = {
                k: v for k, v in sd.items() if k not in ("optimizer_state_dict", "fp32_flat_groups")
            }
        else:
            inner = sd["base_optimizer_state"]
            skip = (
                "base_optimizer_state",
                "single_partition_of_fp32_groups",
                "param_slice_mappings",
            )
            out = {k: v for k, v in sd.items() if k not in skip}
        step = inner["state"][0].get("step") if inner["state"] else None
        out["param_groups"] = inner["param_groups"]  # ZeRO-1/2 reads these ...
        out["optimizer_state_dict"] = {
            "state": {0: {"step": step}},
            "param_groups": inner["param_groups"],
        }  # ... ZeRO-3 these
        out.setdefault("ds_version", top.get("ds_version"))
        return out


class _States(Mapping):
    """One parameter's optimizer states: key -> full tensor, gathered from the mapped files on
    each access (pieces: (rank, start, numel) in each rank's flat tensor) and not kept."""

    def __init__(self, flats: dict, pieces: list[tuple[int, int, int]], shape):
        self._flats, self._pieces, self._shape = flats, pieces, shape

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._shape)

    def __getitem__(self, key: str) -> torch.Tensor:
        f = self._flats[key]
        return _gather([f[r].narrow(0, start, n) for r, start, n in self._pieces]).view(self._shape)

    def __iter__(self):
        return iter(self._flats)

    def __len__(self) -> int:
        return len(self._flats)


class _Joined(Mapping):
    """One tensor-parallel parameter's states: its ranks' slices joined along `dim`."""

    def __init__(self, slices: list[_States], dim: int):
        self._slices, self._dim = slices, dim

    @property
    def shape(self) -> torch.Size:
        shape = list(self._slices[0].shape)
        shape[self._dim] = sum(s.shape[self._dim] for s in self._slices)
        return torch.Size(shape)

    def __getitem__(self, key: str) -> torch.Tensor:
        return torch.cat([s[key] for s in self._slices], dim=self._dim)

    def __iter__(self):
        return iter(self._slices[0])

    def __len__(self) -> int:
        return len(self._slices[0])


class _TensorLayout:
    """How AutoTP split each parameter, from the universal_checkpoint_info DeepSpeed writes
    into an AutoTP checkpoint's model-states files: row-split patterns join along dim 1,
    replicated ones are taken from rank 0, the rest (column splits) join along dim 0. Each
    joined shape is checked against the whole shape AutoTP recorded."""

    def __init__(self, folder: Path, info):
        need = ("parameter_with_row_parallelism_patterns", "tp_replicated_parameter_patterns")
        if not isinstance(info, dict) or not all(k in info for k in need):
            raise CheckpointError(
                f"{folder}: a tensor-parallel checkpoint without AutoTP's record of how it split "
                "each weight (universal_checkpoint_info, which zerostack's saves erased before "
                "they kept it), so its slices cannot be joined"
            )
        fused = info.get("parameter_with_sub_params") or []
        unsupported = info.get("autotp_unsupported_parameter_patterns") or {}
        if fused or unsupported:
            what = ", ".join([*fused, *unsupported][:3])
            raise CheckpointError(
                f"{folder}: AutoTP split fused weights ({what}), which are not joined here"
            )
        self._row = [re.compile(p) for p in info["parameter_with_row_parallelism_patterns"]]
        self._replicated = [re.compile(p) for p in info["tp_replicated_parameter_patterns"]]
        params = (info.get("affine_map") or {}).get("params") or {}
        self._whole = {p: tuple(m["logical_shape"]) for p, m in params.items()}
        self._folder = folder

    def split_dim(self, name: str, shapes: list[torch.Size]) -> int | None:
        """The dimension the slices of `name` (shapes: per tensor-parallel rank) join along,
        None for a replicated parameter."""
        if any(p.match(name) for p in self._replicated):
            dim = None
        else:
            dim = 1 if any(p.match(name) for p in self._row) else 0
        if dim is None:
            whole = tuple(shapes[0])
        else:
            whole = list(shapes[0])
            whole[dim] = sum(s[dim] for s in shapes)
            whole = tuple(whole)
        recorded = self._whole.get(rf"^{re.escape(name)}$")
        if recorded is not None and recorded != whole:
            raise CheckpointError(
                f"{self._folder}: {name}: its tensor-parallel slices {[tuple(s) for s in shapes]} "
                f"do not make the shape {list(recorded)} AutoTP recorded"
            )
        return dim


class _SwapFiles:
    """A ZeRO-Infinity checkpoint's offloaded_tensors/: the swap files of its swapped
    sub-groups, mapped read-only."""

    def __init__(self, folder: Path, model_states: dict):
        self.root = folder / "offloaded_tensors"
        # DeepSpeed numbers parameters as ZeRO-3 partitions them at construction, which is the
        # model's state_dict order, less buffers and the second name of a tied weight.
        skip = set(model_states.get("buffer_names") or ()) | set(
            model_states.get("shared_params") or {}
        )
        names = [n for n in model_states["module"] if n not in skip]
        self.ids = {n: i for i, n in enumerate(names)}

    def read(self, rank: int, key: str, names: list[str], numel: int, dtype) -> torch.Tensor:
        """One rank's partition of one sub-group (its parameters: names) for state key."""
        if unknown := [n for n in (names[0], names[-1]) if n not in self.ids]:
            raise CheckpointError(
                f"{self.root}: {unknown[0]} is not among the model's parameters; the checkpoint "
                "is corrupt"
            )
        sub_group = f"{self.ids[names[0]]}_{self.ids[names[-1]]}"
        prefix = "" if key == "fp32" else f"{key}-"
        path = self.root / f"rank{rank:02d}" / f"{prefix}{sub_group}.tensor.swp"
        itemsize = torch.empty(0, dtype=dtype).element_size()
        size = path.stat().st_size if path.is_file() else None
        if size is None or size < numel * itemsize:
            what = "is missing" if size is None else f"holds {size} bytes"
            raise CheckpointError(
                f"{path} {what}, and ZeRO-Infinity's {key} partition of parameters "
                f"{names[0]}..{names[-1]} needs {numel * itemsize}; the checkpoint is incomplete"
            )
        out = torch.from_file(str(path), shared=False, size=numel, dtype=dtype)  # private map
        _note_mapped(path)
        return out


def _flat(sd: dict, group: int, key: str) -> torch.Tensor:
    if key == "fp32":
        return sd["single_partition_of_fp32_groups"][group]
    return sd["base_optimizer_state"]["state"][group][key]


def load_mapped(path: Path):
    """torch.load(path) weights-only with the file memory-mapped (tensors are read when
    touched); an unreadable file, or one naming a class outside safe_load's allow-list, is a
    CheckpointError naming it."""
    obj = safe_load.load(path, mmap=True)
    _note_mapped(path)
    return obj


def _note_mapped(path: Path) -> None:
    """Every file this module maps: its pages are handed back to the kernel once copied out."""
    _MAPPED[os.path.realpath(path)] = None
    _FILE_MAPS.clear()  # mappings change with every load: look again when asked


_MAPPED: dict[str, None] = {}
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_MADV_DONTNEED = 4


def _gather(pieces: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate mapped file pieces into a new tensor, then let the kernel drop their pages."""
    out = torch.cat(pieces) if pieces else torch.empty(0)
    for p in pieces:
        drop_pages(p)
    return out


def release_freed_memory() -> None:
    """Hand memory freed by Python and torch back to the OS (glibc keeps freed heap pages in
    its arenas, where they still count as resident), so a later phase does not stack on top."""
    gc.collect()
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


def drop_pages(t: torch.Tensor) -> None:
    """Release the resident pages under `t`, which must view a read-only file mapping (a
    torch.load(mmap=True) result): reading them again faults them back in from the file.

    Without this, every page of a mapped checkpoint that was read stays in the process's RSS
    until the file is closed, which is the whole checkpoint."""
    if _LIBC is None or t.numel() == 0:
        return
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    start -= start % _PAGE
    end += -end % _PAGE
    if _is_file_mapping(start):
        _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)


_FILE_MAPS: list[tuple[int, int]] = []


def _is_file_mapping(addr: int) -> bool:
    """True when addr lies in a private file mapping of a checkpoint this module opened.
    MADV_DONTNEED on anonymous memory would zero it, so never guess."""
    for lo, hi in _FILE_MAPS:
        if lo <= addr < hi:
            return True
    _FILE_MAPS.clear()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip() in _MAPPED and parts[1].startswith("r"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                _FILE_MAPS.append((lo, hi))
    return any(lo <= addr < hi for lo, hi in _FILE_MAPS)
