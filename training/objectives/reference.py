"""The reference model's log-probabilities, computed once per run, before the first step, by the
starting model over every pair of the training and validation sets, and stored in the run
folder (reference/{train,val}.npy, float64, one row per pair: chosen, rejected), so no second
model is ever in memory and a resume reads the very numbers the run started with.

With LoRA the starting model is the frozen base with fresh adapters, whose up-projections are
zero: its log-probs are the base's with the adapters off (peft's disable_adapter), so the same
one pass serves, instead of a second forward through the base at every step.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from data import eval_batches
from training.errors import CheckpointError
from training.objectives.dpo import PreferenceLoss, sequence_logps

FOLDER = "reference"


def _logps_only(model, x, y, num_items=None, reference=None) -> torch.Tensor:
    """An objective that returns each row's summed answer log-prob (the reference pass)."""
    return sequence_logps(model(input_ids=x).logits, y)[0]


def compute(engine, dataset, micro_batch: int, device) -> np.ndarray:
    """(pairs, 2) float64: every pair's answer log-probs under the engine's model, in eval mode,
    each rank computing its share of the pairs. All ranks call; all get the whole array."""
    n, rank, world = len(dataset), engine.dp_rank, engine.dp_world
    out = torch.zeros(n, 2, dtype=torch.float64, device=device)
    own, engine.objective = engine.objective, _logps_only
    engine.eval()
    try:
        for k, (x, y, _) in enumerate(eval_batches(dataset, micro_batch, rank, world)):
            pos = k * micro_batch * world + rank * micro_batch + np.arange(micro_batch)
            logps = engine.eval_loss(x.to(device), y.to(device)).view(-1, 2).double()
            keep = pos < n  # the last step wraps around to fill up: those pairs are another's
            out[torch.as_tensor(pos[keep], device=device)] = logps[
                torch.as_tensor(keep, device=device)
            ]
    finally:
        engine.objective = own
        engine.train()
    if dist.is_initialized() and world > 1:
        dist.all_reduce(out)  # each pair was computed by exactly one rank
    return out.cpu().numpy()


def _fingerprint(dataset) -> str:
    """What the stored numbers belong to: the split's shards and the sequence length."""
    shards = [s.sha256 for s in dataset.info.shards]
    key = json.dumps({"shards": shards, "seq_len": dataset.seq_len, "pairs": len(dataset)})
    return hashlib.sha256(key.encode()).hexdigest()


def _checksum(reference: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(reference, dtype=np.float64).tobytes()).hexdigest()


def _store(folder: Path, split: str, reference: np.ndarray, fingerprint: str) -> None:
    """Write a split's reference log-probs and what they belong to (rank 0 only)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{split}.npy"
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, reference)
    os.replace(tmp, path)
    info = {"fingerprint": fingerprint, "pairs": len(reference), "sha256": _checksum(reference)}
    (folder / f"{split}.json").write_text(json.dumps(info))


def source_folder(resumed_root: Path) -> Path:
    """Where the run a checkpoint root (RUN/checkpoints) belongs to keeps its reference."""
    run = resumed_root.parent if resumed_root.name == "checkpoints" else resumed_root
    return run / FOLDER


def read_back(source: Path, split: str, dataset) -> np.ndarray:
    """The reference log-probs the resumed run stored for `split` in `source`, checked against
    the data (its fingerprint) and against the checksum written with them."""
    path, info = source / f"{split}.npy", source / f"{split}.json"
    if not (path.is_file() and info.is_file()):
        raise CheckpointError(
            f"{path} is missing: a resumed preference run reads the reference log-probs its "
            "first launch computed there; keep that run's reference/ folder beside its "
            "checkpoints, or start the run afresh in a new --out"
        )
    meta = json.loads(info.read_text())
    if meta["fingerprint"] != _fingerprint(dataset):
        raise CheckpointError(
            f"{path} was computed on other data than --data {dataset.manifest.data_dir} "
            f"({split}); resume with the run's own data"
        )
    stored = np.load(path)
    if meta.get("sha256", _checksum(stored)) != _checksum(stored):  # runs before checksums: none
        raise CheckpointError(
            f"{path} does not match the checksum in {info.name}: the stored reference "
            "log-probs were changed or damaged; restore them, or start afresh in a new --out"
        )
    return stored


def attach(
    engine,
    datasets: dict,
    run_dir: Path,
    *,
    kind: str,
    beta: float,
    resumed_from: Path | None,
    micro_batch: int,
    device,
    is_main: bool,
) -> None:
    """Set the engine's objective to the preference loss and give each split (`datasets`: name
    -> PairDataset) its reference log-probs: computed now on a fresh run, read back on a resume
    from `resumed_from` (the reference folder of the run the checkpoint belongs to: this one,
    or another whose checkpoint starts this --out, into which rank 0 then copies them). The
    objective's `note` says which (the run's banner shows it)."""
    folder = Path(run_dir) / FOLDER
    said = []
    for split, ds in datasets.items():
        if resumed_from is not None:
            ds.reference = read_back(resumed_from, split, ds)
            copied = resumed_from.resolve() != folder.resolve()
            if is_main and copied:
                _store(folder, split, ds.reference, _fingerprint(ds))
            said.append(
                f"{split}: {len(ds)} read back" + (f" from {resumed_from}" if copied else "")
            )
            continue
        ds.reference = compute(engine, ds, micro_batch, device)
        if is_main:
            _store(folder, split, ds.reference, _fingerprint(ds))
        said.append(f"{split}: {len(ds)} computed")
    engine.objective = PreferenceLoss(kind, beta)
    engine.objective.note = f"reference log-probs of the starting model: {', '.join(said)}"
