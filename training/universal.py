"""Universal checkpoints: resume a DeepSpeed checkpoint on another world size, ZeRO stage or
pipeline layout.

ZeRO files are partitioned for the world that wrote them. The universal format holds every
parameter whole (fp32 weights, both Adam moments, the step) under zero/<name>/, and DeepSpeed's
`load_universal` cuts it again for any world. DeepSpeed's own converter (ds_to_universal) needs
`universal_checkpoint_info` in the files and writes one layout for the ZeRO-1/2 family and
another for ZeRO-3 that the other family cannot load. This converter writes the one layout both
families load, and streams: it maps the files instead of reading them and keeps one parameter in
memory at a time.

    python -m training.universal RUN_DIR[/STEP] [--force]

On resume, train.py asks `plan` whether the checkpoint loads natively and, when it does not, has
rank 0 call `ensure`: the copy is written once into a hidden temporary folder, sealed with a
complete.json, renamed to checkpoints/step_N_universal, and reused by later resumes.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import hashlib
import json
import math
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from training import checkpoint as ckpt
from training.checkpoint import UNIVERSAL_SUFFIX, CheckpointError

MODES = ("auto", "always", "never")
STATE_KEYS = ("fp32", "exp_avg", "exp_avg_sq")
_OPTIM = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_MODEL12 = re.compile(r"mp_rank_(\d+)_model_states\.pt")
_MODEL3 = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")


@dataclass(frozen=True)
class Topology:
    """What a DeepSpeed checkpoint's files depend on."""

    backend: str
    world: int
    zero_stage: int
    pipeline_stages: int = 1

    @classmethod
    def of_checkpoint(cls, state: dict) -> Topology:
        return cls(
            state.get("backend", "deepspeed"),
            int(state.get("world", 1)),
            int(state.get("zero_stage", 0)),
            int(state.get("pipeline_stages", 1)),
        )

    def __str__(self) -> str:
        pp = f", {self.pipeline_stages} pipeline stages" if self.pipeline_stages > 1 else ""
        ranks = "rank" if self.world == 1 else "ranks"
        return f"{self.world} {ranks}, ZeRO-{self.zero_stage}{pp}"


def plan(saved: dict, now: Topology, mode: str = "auto") -> bool:
    """Whether to resume checkpoint state `saved` (its trainer_state) through a universal copy.

    auto: only when world size, ZeRO stage or pipeline stages differ; always: every time;
    never: refuse a changed topology. Raises CheckpointError (one line) for resumes that cannot
    work: another backend, or a change into or out of ZeRO-0."""
    if mode not in MODES:
        raise CheckpointError(f"--universal {mode}: choose one of {', '.join(MODES)}")
    was = Topology.of_checkpoint(saved)
    tag = ckpt.tag_for(int(saved.get("step", 0)))
    if was.backend != now.backend:
        raise CheckpointError(
            f"checkpoint {tag} was written by the {was.backend} backend; resume it with --backend "
            f"{was.backend}, or export it and start a new run from the folder with --model"
        )
    if now.backend != "deepspeed":
        return False  # DDP/FSDP2 checkpoints hold whole state dicts that load on any world size
    if mode == "never":
        if was != now:
            raise CheckpointError(
                f"checkpoint {tag} was saved on {was}; this run is {now}. Resuming needs a "
                "universal conversion, which --universal never forbids"
            )
        return False
    if was.zero_stage == 0 or now.zero_stage == 0:
        # ZeRO-0 keeps whole, unpartitioned optimizer state that DeepSpeed's universal loader
        # does not read; every rank holds all of it, so only the world size may change.
        if (was.zero_stage, was.pipeline_stages) == (now.zero_stage, now.pipeline_stages):
            if mode == "always":
                raise CheckpointError(
                    f"--universal always: checkpoint {tag} is ZeRO-0, which has no universal "
                    "form; it resumes as it is on any world size (use --universal auto)"
                )
            return False
        raise CheckpointError(
            f"checkpoint {tag} was saved on {was}; this run is {now}: moving into or out of "
            "ZeRO-0 is not supported. Resume with the checkpoint's stage, or export it and "
            "start from the folder with --model"
        )
    return mode == "always" or was != now


def universal_tag(tag: str) -> str:
    return tag + UNIVERSAL_SUFFIX


def ensure(root: Path, tag: str, *, force: bool = False, log=print) -> str:
    """The universal copy of checkpoint root/tag, made if missing or stale; returns its tag.

    The copy is written into a hidden folder and renamed into place once complete.json seals
    it, so a crash leaves either no copy or a whole one. Single process (rank 0 on resume)."""
    root = Path(root)
    src, utag = root / tag, universal_tag(tag)
    dst = root / utag
    source_id = hashlib.sha1((src / ckpt.COMPLETE).read_bytes()).hexdigest()
    if not force and _sealed_for(dst, source_id):
        log(f"universal: reusing {dst}")
        return utag
    ckpt.verify(src)
    host = socket.gethostname()
    for stale in root.glob(f".{utag}.tmp-*"):  # left by a crashed conversion on this host
        other_host, _, pid = stale.name.rpartition("-")
        if other_host.endswith(f"tmp-{host}") and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".{utag}.tmp-{host}-{os.getpid()}"
    t0 = time.perf_counter()
    try:
        n = convert(src, tmp)
        ckpt.write_listing(tmp, {"source": source_id, "source_tag": tag})
        shutil.rmtree(dst, ignore_errors=True)
        try:
            tmp.rename(dst)
        except OSError:  # another process finished the same conversion first
            if not _sealed_for(dst, source_id):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"universal: converted {src} -> {dst} ({n} tensors, {time.perf_counter() - t0:.1f} s)")
    return utag


def is_ready(root: Path, tag: str) -> bool:
    """Whether checkpoint root/tag already has a sealed, current universal copy."""
    src = Path(root) / tag
    try:
        source_id = hashlib.sha1((src / ckpt.COMPLETE).read_bytes()).hexdigest()
    except OSError:
        return False
    return _sealed_for(Path(root) / universal_tag(tag), source_id)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sealed_for(folder: Path, source_id: str) -> bool:
    try:
        listing = json.loads((folder / ckpt.COMPLETE).read_text())
        if listing.get("source") != source_id:
            return False
        ckpt.verify(folder)
        return True
    except (OSError, ValueError, CheckpointError):
        return False


def convert(src: Path, out: Path) -> int:
    """Write the universal form of the DeepSpeed checkpoint folder `src` into `out` (created).
    Returns the number of parameters written."""
    files = ZeroFiles(src)
    zero = out / "zero"
    zero.mkdir(parents=True)
    n = 0
    for name, states, step in files.params(STATE_KEYS):
        d = zero / name
        d.mkdir()
        for key in states:  # one state of one parameter in memory at a time
            torch.save({"param": states[key]}, d / f"{key}.pt")
        torch.save(step, d / "step.pt")
        n += 1
    if n == 0:
        raise CheckpointError(f"{src}: holds no optimizer state to convert")
    torch.save(files.global_state(), zero / "optimizer_state.pt")
    # The ZeRO-1/2 loader looks for mp_rank_XX_model_states.pt, ZeRO-3's for
    # zero_pp_rank_0_mp_rank_XX_model_states.pt; both only read step counters and client state.
    for mp, f in enumerate(files.model_files_by_mp):
        for name in (
            f"mp_rank_{mp:02d}_model_states.pt",
            f"zero_pp_rank_0_mp_rank_{mp:02d}_model_states.pt",
        ):
            shutil.copyfile(f, out / name)
    return n


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

    def params(self, keys=STATE_KEYS) -> Iterator[tuple[str, Mapping[str, torch.Tensor], object]]:
        """Yield (name, states, step) for every trained parameter, in the order the model
        declares them. `states[key]` (key: fp32, exp_avg or exp_avg_sq) gathers that state as a
        full-shape fp32 tensor when asked, so only what is asked for is ever in memory."""
        if self.stage == 3:
            yield from self._params_stage3(keys)
        else:
            yield from self._params_stage12(keys)

    def _params_stage12(self, keys):
        done = set()
        for mp in range(self.mp):
            shapes = _load(self.model_files_by_mp[mp])["param_shapes"]
            sds = [_load(f)["optimizer_state_dict"] for f in self.optim_files[mp]]
            for g, group in enumerate(shapes):
                flats = {k: [_flat(sd, g, k) for sd in sds] for k in keys}
                step = sds[0]["base_optimizer_state"]["state"][g].get("step")
                for name, shape in group.items():
                    if name in done:  # a tied weight that an earlier pipeline stage also holds
                        continue
                    pieces = [
                        (r, fa.start, fa.numel)
                        for r, sd in enumerate(sds)
                        if (fa := sd["param_slice_mappings"][g].get(name)) is not None
                    ]
                    numel = sum(n for _, _, n in pieces)
                    if numel != math.prod(shape):
                        raise CheckpointError(
                            f"{self.folder}: {name} has {numel} of its {math.prod(shape)} "
                            "elements in the optimizer files; the checkpoint is corrupt"
                        )
                    yield name, _States(flats, pieces, shape), step
                    done.add(name)
            del sds

    def _params_stage3(self, keys):
        shapes = _load(self.model_files_by_mp[0])["param_shapes"]
        sds = [_load(f)["optimizer_state_dict"] for f in self.optim_files[0]]
        world = len(sds)
        for g, group in enumerate(shapes):
            flats = {
                k: [
                    sd["fp32_flat_groups"][g]
                    if k == "fp32"
                    else sd["optimizer_state_dict"]["state"][g][k]
                    for sd in sds
                ]
                for k in keys
            }
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
        top = _load(self.optim_files[0][0])
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

    def __getitem__(self, key: str) -> torch.Tensor:
        f = self._flats[key]
        return _gather([f[r].narrow(0, start, n) for r, start, n in self._pieces]).view(self._shape)

    def __iter__(self):
        return iter(self._flats)

    def __len__(self) -> int:
        return len(self._flats)


def _flat(sd: dict, group: int, key: str) -> torch.Tensor:
    if key == "fp32":
        return sd["single_partition_of_fp32_groups"][group]
    return sd["base_optimizer_state"]["state"][group][key]


def _load(path: Path):
    try:
        obj = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as e:  # a truncated or foreign file: torch raises many kinds
        raise CheckpointError(
            f"{path}: unreadable ({type(e).__name__}: {str(e).splitlines()[0]})"
        ) from None
    _MAPPED[os.path.realpath(path)] = None
    _FILE_MAPS.clear()  # mappings change with every load: look again when asked
    return obj


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Convert a DeepSpeed checkpoint to the universal format, beside it "
        "(train.py does this by itself when a resume needs it)."
    )
    p.add_argument(
        "path", help="RUN_DIR (latest checkpoint), RUN_DIR/checkpoints/step_N or RUN_DIR/N"
    )
    p.add_argument("--force", action="store_true", help="convert again even if a copy exists")
    a = p.parse_args(argv)
    try:
        root, tag = ckpt.locate(a.path)
        state = ckpt.load_trainer_state(root, tag)
        if state.get("backend", "deepspeed") != "deepspeed":
            raise CheckpointError(
                f"{root / tag}: a {state['backend']} checkpoint; it loads on any world size as it is"
            )
        utag = ensure(root, tag, force=a.force)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"{root / utag}: resume from {tag} on any world size or ZeRO stage 1-3 (train.py picks it up)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
