"""Universal checkpoints: resume a DeepSpeed checkpoint on another world size, ZeRO stage,
pipeline, tensor-parallel (AutoTP) or sequence-parallel (Ulysses) layout.

ZeRO files are partitioned for the world that wrote them. The universal format holds every
parameter whole (fp32 weights, both Adam moments, the step) under zero/<name>/, and DeepSpeed's
`load_universal` cuts it again for any world. DeepSpeed's own converter (ds_to_universal) needs
`universal_checkpoint_info` in the files and writes one layout for the ZeRO-1/2 family and
another for ZeRO-3 that the other family cannot load. This converter writes the one layout both
families load, and streams: it reads the files through zero_files.py, one state of one
parameter in memory at a time.

    python -m training.universal RUN_DIR[/STEP] [--force]

On resume, train.py asks `plan` whether the checkpoint loads natively and, when it does not, has
rank 0 call `ensure`: the copy is written once into a hidden temporary folder, sealed with a
complete.json, renamed to checkpoints/step_N_universal, and reused by later resumes.

The copy names every parameter as the unpipelined model does (`layers.0.attention.wq.weight`),
whatever wrote it: a pipeline checkpoint's `1.attention.wq.weight` is renamed here, and the
pipeline engine looks its parameters up under the model's names when it loads a copy
(training/engines/pipeline_engine.py). So one copy resumes pipelined or not, on any number of stages.

An AutoTP checkpoint's slices are joined into whole parameters (zero_files.py, from the layout
AutoTP records in the files), and DeepSpeed's loader cuts whole parameters again for the
tensor-parallel rank that loads them: tp2 resumes on one rank, on ZeRO-3 and back. Ulysses keeps
whole parameters; only the replicas change, so a sequence-parallel checkpoint converts as a plain
one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from data.files import scratch_folder
from models.pipeline import pipeline_state_dict_to_model
from training.checkpoints import layout as ckpt
from training.checkpoints.layout import UNIVERSAL_SUFFIX
from training.checkpoints.zero_files import STATE_KEYS, ZeroFiles
from training.errors import CheckpointError

MODES = ("auto", "always", "never")


@dataclass(frozen=True)
class Topology:
    """What a DeepSpeed checkpoint's files depend on."""

    backend: str
    world: int
    zero_stage: int
    pipeline_stages: int = 1
    tensor_parallel: int = 1  # AutoTP: each rank's files hold its slice of the split weights
    sequence_parallel: int = 1  # Ulysses: whole weights, but other groups and replicas
    expert_parallel: int = 1  # AutoEP: each expert rank's files hold its experts, its names
    # The run swaps its optimizer states to NVMe (ZeRO-Infinity). Not part of a checkpoint's
    # layout (resume.py reads that from the checkpoint's offloaded_tensors/): what the resuming
    # run can load.
    optimizer_on_nvme: bool = field(default=False, compare=False)

    @classmethod
    def of_checkpoint(cls, state: dict) -> Topology:
        return cls(
            state.get("backend", "deepspeed"),
            int(state.get("world", 1)),
            int(state.get("zero_stage", 0)),
            int(state.get("pipeline_stages", 1)),
            int(state.get("tensor_parallel", 1)),
            int(state.get("sequence_parallel", 1)),
            int(state.get("expert_parallel", 1)),
        )

    def __str__(self) -> str:
        extra = "".join(
            f", {n} {what}"
            for n, what in (
                (self.tensor_parallel, "tensor-parallel"),
                (self.sequence_parallel, "sequence-parallel"),
                (self.expert_parallel, "expert-parallel"),
                (self.pipeline_stages, "pipeline stages"),
            )
            if n > 1
        )
        ranks = "rank" if self.world == 1 else "ranks"
        return f"{self.world} {ranks}, ZeRO-{self.zero_stage}{extra}"


def plan(saved: dict, now: Topology, mode: str = "auto") -> bool:
    """Whether to resume checkpoint state `saved` (its trainer_state) through a universal copy.

    auto: only when the world size, ZeRO stage, pipeline stages, tensor- or sequence-parallel
    size differ; always: every time;
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
        # The same holds across sequence-parallel sizes (whole weights); not across AutoTP's.
        same = ("zero_stage", "pipeline_stages", "tensor_parallel")
        if all(getattr(was, k) == getattr(now, k) for k in same):
            if mode == "always":
                raise CheckpointError(
                    f"--universal always: checkpoint {tag} is ZeRO-0, which has no universal "
                    "form; it resumes as it is on any world size (use --universal auto)"
                )
            return False
        change = (
            "moving into or out of ZeRO-0"
            if was.zero_stage != now.zero_stage
            else "changing a ZeRO-0 checkpoint's layout"
        )
        raise CheckpointError(
            f"checkpoint {tag} was saved on {was}; this run is {now}: {change} is not "
            "supported. Resume with the checkpoint's layout, or export it and start from the "
            "folder with --model"
        )
    universal = mode == "always" or was != now
    if universal and now.expert_parallel > 1:
        # the copy holds our model's whole experts; AutoEP's loader reads its own names only
        raise CheckpointError(
            f"checkpoint {tag} was saved on {was}; this run is {now}: an expert-parallel run "
            "resumes only its own layout's checkpoints. Resume it with experts on every rank "
            "(e.g. ds_configs/zero2.json)"
        )
    return universal


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
    tmp = scratch_folder(dst)
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
    pipelined = any(src.glob("layer_*-model_states.pt"))
    n = 0
    for name, states, step in files.params(STATE_KEYS):
        d = zero / (model_name(name, states.shape) if pipelined else name)
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


def model_name(pipeline_name: str, shape) -> str:
    """The unpipelined model's name of a pipeline parameter (`1.feed_forward.w1.weight` ->
    `layers.0.feed_forward.w1.weight`; the tied embedding -> `tok_embeddings.weight`)."""
    meta = torch.empty(tuple(shape), device="meta")  # the final norm and the head differ by rank
    return next(iter(pipeline_state_dict_to_model({pipeline_name: meta})))


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
        f"{root / utag}: resume from {tag} on any world size, ZeRO stage 1-3, pipeline, "
        "tensor- or sequence-parallel layout (train.py picks it up)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
