"""The reference model's log-probabilities, computed once per run, before the first step, by the
starting model over every pair of the training and validation sets, and stored in the run
folder (reference/{train,val}.npy, float64, one row per pair: chosen, rejected), so no second
model is ever in memory and a resume reads the very numbers the run started with.

With LoRA the starting model is the frozen base with fresh adapters, whose up-projections are
zero: its log-probs are the base's with the adapters off (peft's disable_adapter), so the same
one pass serves, instead of a second forward through the base at every step.

The reference pass runs in eval mode, so the policy trains with dropout off (as TRL's
`disable_dropout_in_model`): with dropout on, the policy at step 1 would not be the model that
computed the reference. What the numbers belong to is stored beside them (the data, the model's
config, the precision) and a resume that differs in any of them is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

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


def _is_dropout(name: str) -> bool:
    return "dropout" in name or name.endswith("pdrop")  # GPT-2: attn_pdrop, resid_pdrop, ...


def disable_dropout(model: nn.Module) -> int:
    """Turn every dropout of `model` off for training: nn.Dropout modules, the dropout rates
    attention reads from a module's attributes (Llama-style `attention_dropout`) and from the
    config at each forward (GPT-Neo). Returns how many modules and config fields had one."""
    off = 0
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            module.p, off = 0.0, off + 1
            continue
        for name, value in list(vars(module).items()):
            if isinstance(value, float) and value > 0 and _is_dropout(name):
                setattr(module, name, 0.0)
                off += 1
    config = _config(model)
    for name, value in (config.to_dict() if config is not None else {}).items():
        if isinstance(value, float) and value > 0 and _is_dropout(name):
            setattr(config, name, 0.0)
            off += 1
    return off


def _config(model: nn.Module):
    """The model's config (with LoRA, the base's), or None for a model without one."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    return config if hasattr(config, "to_dict") else None


# Config keys that do not change what the model computes in eval mode: paths, versions, the
# dtype (the precision is kept on its own), outputs asked for, and dropout.
_NOT_THE_MODEL = {"transformers_version", "architectures", "dtype", "torch_dtype", "use_cache",
                  "return_dict", "output_hidden_states", "output_attentions"}  # fmt: skip


def model_identity(model: nn.Module) -> str | None:
    """A hash of the model's config, less what does not change its numbers; with LoRA, the
    base's (the reference is the base with the adapters off). None for a model without one."""
    config = _config(model)
    if config is None:
        return None
    kept = {
        k: v
        for k, v in config.to_dict().items()
        if not (k.startswith("_") or k in _NOT_THE_MODEL or _is_dropout(k))
    }
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


def _fingerprint(dataset) -> str:
    """What the stored numbers belong to: the split's shards and the sequence length."""
    shards = [s.sha256 for s in dataset.info.shards]
    key = json.dumps({"shards": shards, "seq_len": dataset.seq_len, "pairs": len(dataset)})
    return hashlib.sha256(key.encode()).hexdigest()


def _checksum(reference: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(reference, dtype=np.float64).tobytes()).hexdigest()


def _store(
    folder: Path, split: str, reference: np.ndarray, fingerprint: str, made_by: dict | None = None
) -> None:
    """Write a split's reference log-probs and what they belong to (rank 0 only): the data's
    fingerprint, and `made_by` (the model's identity and the precision they were computed in)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{split}.npy"
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, reference)
    os.replace(tmp, path)
    info = {"fingerprint": fingerprint, "pairs": len(reference), "sha256": _checksum(reference)}
    info.update(made_by or {})
    (folder / f"{split}.json").write_text(json.dumps(info))


def source_folder(resumed_root: Path) -> Path:
    """Where the run a checkpoint root (RUN/checkpoints) belongs to keeps its reference."""
    run = resumed_root.parent if resumed_root.name == "checkpoints" else resumed_root
    return run / FOLDER


def read_back(source: Path, split: str, dataset, made_by: dict | None = None) -> np.ndarray:
    """The reference log-probs the resumed run stored for `split` in `source`, checked against
    the data (its fingerprint), against `made_by` (this run's model identity and precision; a
    file written before they were stored is not held to them) and against the checksum."""
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
    _check_made_by(path, meta, made_by or {})
    stored = np.load(path)
    if meta.get("sha256", _checksum(stored)) != _checksum(stored):  # runs before checksums: none
        raise CheckpointError(
            f"{path} does not match the checksum in {info.name}: the stored reference "
            "log-probs were changed or damaged; restore them, or start afresh in a new --out"
        )
    return stored


def _check_made_by(path: Path, meta: dict, made_by: dict) -> None:
    """Refuse stored log-probs computed by another model, or in another precision, than this
    run's: the policy would not start from its reference."""
    model, precision = meta.get("model"), meta.get("precision")
    if model is not None and made_by.get("model") not in (None, model):
        raise CheckpointError(
            f"{path} was computed by another model (config sha256 {model[:12]}) than this "
            f"run's --model (config sha256 {made_by['model'][:12]}); resume with the model "
            "that run started from, or start afresh in a new --out"
        )
    if precision is not None and made_by.get("precision") not in (None, precision):
        raise CheckpointError(
            f"{path} was computed in {precision}, this run trains in {made_by['precision']}; "
            f"resume with --precision {precision}, or start afresh in a new --out"
        )


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
    precision: str | None = None,
) -> None:
    """Set the engine's objective to the preference loss and give each split (`datasets`: name
    -> PairDataset) its reference log-probs: computed now on a fresh run, read back on a resume
    from `resumed_from` (the reference folder of the run the checkpoint belongs to: this one,
    or another whose checkpoint starts this --out, into which rank 0 then copies them). The
    objective's `note` says which (the run's banner shows it), and that dropout is off (the
    reference pass runs without it). `precision`: what the run trains in, stored with the
    reference and checked on a resume."""
    folder = Path(run_dir) / FOLDER
    dropped = disable_dropout(engine.module)
    made_by = {"model": model_identity(engine.module), "precision": precision}
    said = []
    for split, ds in datasets.items():
        if resumed_from is not None:
            ds.reference = read_back(resumed_from, split, ds, made_by)
            copied = resumed_from.resolve() != folder.resolve()
            if is_main and copied:  # with what the source says made them, as it says it
                meta = json.loads((resumed_from / f"{split}.json").read_text())
                kept = {k: meta[k] for k in made_by if k in meta}
                _store(folder, split, ds.reference, _fingerprint(ds), kept)
            said.append(
                f"{split}: {len(ds)} read back" + (f" from {resumed_from}" if copied else "")
            )
            continue
        ds.reference = compute(engine, ds, micro_batch, device)
        if is_main:
            _store(folder, split, ds.reference, _fingerprint(ds), made_by)
        said.append(f"{split}: {len(ds)} computed")
    engine.objective = PreferenceLoss(kind, beta)
    engine.objective.note = f"reference log-probs of the starting model: {', '.join(said)}; " + (
        f"dropout off ({dropped} rates set to 0)" if dropped else "no dropout"
    )
