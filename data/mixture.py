"""Weighted mixtures of prepared datasets: `--data A:0.7,B:0.3`.

The training order of a mixture is, like a single folder's, a pure function of (seed, global
position), so a run resumes exactly and on any world size from `consumed_samples` alone:

- Positions come in blocks of BLOCK. Block b holds exactly C_s(b + 1) - C_s(b) positions of
  source s, where C_s(N) is source s's share of the first N positions (the largest-remainder
  apportionment of N by the weights), so after any whole block every source is within one
  sample of its exact share. Within the block the sources' positions are shuffled by a
  Generator seeded from (seed, block).
- The k-th position that falls to source s reads that source's sample k of its own epoch order
  (reader.EpochOrder, keyed by (seed, source)): every sample of a source once per pass over it.

All sources must share one tokenizer (checked from the manifests); evaluation reports each
source's validation loss and bits per byte, and the mixture's (training/loop/validation.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path

import numpy as np

from data.manifest import MANIFEST, DataError, Manifest, load_manifest, verify_shards

BLOCK = 4096  # positions per block: each source's share is exact to one sample at its end
_MIX_KEY = 0x6D6978  # "mix": keeps the block shuffles apart from every epoch permutation


@dataclass(frozen=True)
class Part:
    """One source of a mixture: its folder, its name in metrics and its weight (normalised)."""

    folder: str
    name: str
    weight: Fraction


def parse_spec(spec: str) -> list[Part]:
    """`--data` -> its parts. SPEC is a folder, or FOLDER:WEIGHT[,FOLDER:WEIGHT...] with
    positive relative weights (normalised to sum 1; a part without ':WEIGHT' weighs 1).
    Raises DataError, naming the part, for a bad weight or a folder given twice."""
    spec = str(spec)
    if os.path.isdir(spec) or not any(c in spec for c in ",:"):
        return [Part(spec, Path(spec).name, Fraction(1))]
    raw = []
    for item in spec.split(","):
        folder, sep, weight = item.strip().rpartition(":")
        if not sep:
            folder, weight = item.strip(), "1"
        if not folder:
            raise DataError(f"--data {spec}: part {item!r} names no folder")
        raw.append((folder, _weight(weight, item)))
    folders = [os.path.realpath(f) for f, _ in raw]
    dup = next((f for f, r in zip(raw, folders) if folders.count(r) > 1), None)
    if dup is not None:
        raise DataError(f"--data {spec}: {dup[0]} is given more than once")
    total = sum(w for _, w in raw)
    parts = [Part(f, _name(f, i, raw), w / total) for i, (f, w) in enumerate(raw)]
    small = next((p for p in parts if p.weight * BLOCK < 1), None)
    if small is not None:
        raise DataError(
            f"--data {spec}: the weight of {small.folder} is {float(small.weight):.2g} of the "
            f"total, below the smallest share the mixture keeps (1/{BLOCK}); raise it or drop it"
        )
    return parts


def _weight(text: str, item: str) -> Fraction:
    try:
        w = Fraction(text.strip())
    except (ValueError, ZeroDivisionError):
        raise DataError(f"--data: weight {text!r} of {item!r} is not a number") from None
    if w <= 0:
        raise DataError(f"--data: weight {text!r} of {item!r} must be positive")
    return w


def _name(folder: str, i: int, raw: list) -> str:
    """The folder's last name, or with its position when two parts share that name."""
    name = Path(folder).name or folder
    same = [f for f, _ in raw if (Path(f).name or f) == name]
    return name if len(same) == 1 else f"{name}-{i}"


def fingerprint(spec: str) -> str:
    """One sha256 for what `--data SPEC` trains on: each part's manifest.json (which lists every
    shard's checksum) with its weight. The same data moved to another path keeps it."""
    h = hashlib.sha256()
    for part in parse_spec(spec):
        manifest = Path(part.folder) / MANIFEST
        try:
            h.update(hashlib.sha256(manifest.read_bytes()).hexdigest().encode())
        except OSError as e:
            raise DataError(f"--data: cannot read {manifest}: {e.strerror or e}") from None
        h.update(f":{part.weight};".encode())
    return h.hexdigest()


def load_data(spec: str, seq_len: int | None = None, verify: bool = False, log=None) -> Manifest:
    """The manifest a run uses for `--data SPEC`: a folder's own, or a mixture's first source's
    with `source` naming the whole mixture. Checks every folder's shards (sizes; with `verify`
    also their sha256, once per folder, see manifest.verify_shards: `log` hears when that
    takes a while), that every split of every folder holds one window of `seq_len` + 1
    tokens, and that all sources share one tokenizer. Raises DataError with one line."""
    parts = parse_spec(spec)
    load = (lambda f: verify_shards(f, log)) if verify else load_manifest
    manifests = [load(p.folder) for p in parts]
    for m in manifests if seq_len is not None else ():
        _check_windows(m, seq_len)
    first = manifests[0]
    for p, m in zip(parts[1:], manifests[1:]):
        if (m.chat is None) != (first.chat is None):
            raise DataError(
                f"--data: {p.folder} and {parts[0].folder} mix chat data and a text corpus; "
                "a mixture takes one kind"
            )
        if _token_ids(m) != _token_ids(first):
            raise DataError(
                f"--data: {p.folder} and {parts[0].folder} were prepared with different "
                f"tokenizers; prepare them with one: python -m data.prepare ... --tokenizer "
                f"{parts[0].folder}/tokenizer"
            )
    if len(parts) == 1:
        return first
    desc = ", ".join(f"{p.folder} ({float(p.weight):.3g})" for p in parts)
    return replace(first, source=f"mixture: {desc}", source_detail=desc)


def _check_windows(m: Manifest, seq_len: int) -> None:
    if m.chat is not None:  # one example per sample (data/examples.py)
        from data.examples import check_fits

        check_fits(m, seq_len)
        empty = next((name for name, split in m.splits.items() if not split.documents), None)
        if empty is not None:
            raise DataError(
                f"the {empty} split of {m.data_dir} holds no example; prepare it with a larger "
                "--val-fraction or more examples"
            )
        return
    for name, split in m.splits.items():
        if split.tokens < seq_len + 1:
            raise DataError(
                f"--seq-len {seq_len}: the {name} split of {m.data_dir} has {split.tokens} "
                f"tokens, too few for one window of seq_len + 1; use --seq-len "
                f"{max(2, split.tokens - 1)} or less, or more data"
            )


def _token_ids(m: Manifest) -> tuple:
    """What fixes the token ids: tokenizer.json's content (a copy re-saved through
    `--tokenizer` differs only in its other files), the vocabulary size and EOS."""
    path = m.tokenizer_dir / "tokenizer.json"
    try:
        text = json.dumps(json.loads(path.read_text()), sort_keys=True)
    except (OSError, ValueError):  # no readable tokenizer.json: the folder's checksum decides
        text = m.tokenizer_sha256
    return hashlib.sha256(text.encode()).hexdigest(), m.vocab_size, m.eos_id


def open_split(spec: str, split: str, seq_len: int, pack: bool = False):
    """The reader's dataset for `--data SPEC`: a TokenDataset for one folder (for chat data an
    ExampleDataset, or PackedExamples with `pack`: --doc-mask; for preference data a
    PairDataset), else a Mixture."""
    from data.examples import ExampleDataset, PackedExamples
    from data.pairs import PairDataset, is_pairs
    from data.reader import TokenDataset

    parts = parse_spec(spec)
    manifest = load_manifest(parts[0].folder)
    chat = manifest.chat is not None
    kind = (PackedExamples if pack else ExampleDataset) if chat else TokenDataset
    kind = PairDataset if is_pairs(manifest) else kind
    sets = [kind(p.folder, split, seq_len) for p in parts]
    return sets[0] if len(parts) == 1 else Mixture(parts, sets)


class Mixture:
    """Several TokenDatasets (one split each) read as one, in proportion to their weights.

    Indices are the sources' samples one after another (source 0's first), so `mix[i]` is a
    window of one source; `order(seed)` is the training order over them (module docstring).
    """

    def __init__(self, parts: list[Part], datasets: list):
        self.parts, self.datasets = list(parts), list(datasets)
        self.seq_len = datasets[0].seq_len
        self.manifest = datasets[0].manifest
        self.masked = getattr(datasets[0], "masked", False)
        self._offsets = np.cumsum([0] + [len(d) for d in datasets])
        # The tokens a mixture's batch holds come from the sources in proportion to the weights.
        self.bytes_per_token = sum(float(p.weight) * d.bytes_per_token for p, d in self.sources())

    def sources(self) -> list[tuple[Part, object]]:
        return list(zip(self.parts, self.datasets))

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def __getitem__(self, i: int) -> np.ndarray:
        s = int(np.searchsorted(self._offsets, i, side="right")) - 1
        if not 0 <= s < len(self.datasets):
            raise IndexError(f"sample {i} out of range [0, {len(self)})")
        return self.datasets[s][int(i - self._offsets[s])]

    def order(self, seed: int) -> MixtureOrder:
        return MixtureOrder([len(d) for d in self.datasets], [p.weight for p in self.parts], seed)


class MixtureOrder:
    """Global position -> mixture index, for one seed (the module docstring says how)."""

    def __init__(self, sizes: list[int], weights: list[Fraction], seed: int):
        from data.reader import EpochOrder

        self.weights, self.seed = list(weights), seed
        self.offsets = np.cumsum([0] + list(sizes))
        self.orders = [EpochOrder(n, (seed, _MIX_KEY, s + 1)) for s, n in enumerate(sizes)]
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def shares(self, n: int) -> np.ndarray:
        """How many of the first n positions each source gets: largest remainder of n * weight."""
        exact = [w * n for w in self.weights]
        base = [math.floor(x) for x in exact]
        # The positions left go to the largest fractional parts, ties to the earlier source.
        by_rest = sorted(range(len(base)), key=lambda s: (-(exact[s] - base[s]), s))
        for s in by_rest[: n - sum(base)]:
            base[s] += 1
        return np.array(base, dtype=np.int64)

    def block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(source of each position of block b, that source's own position there)."""
        if b not in self._blocks:
            if len(self._blocks) >= 2:  # a batch spans at most two blocks
                self._blocks.pop(min(self._blocks))
            start, end = self.shares(b * BLOCK), self.shares((b + 1) * BLOCK)
            src = np.repeat(np.arange(len(start)), end - start)
            src = src[np.random.default_rng([self.seed, _MIX_KEY, b]).permutation(BLOCK)]
            own = np.empty(BLOCK, dtype=np.int64)
            for s in range(len(start)):
                mask = src == s
                own[mask] = start[s] + np.arange(int(mask.sum()))
            self._blocks[b] = (src, own)
        return self._blocks[b]

    def sources_of(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, position within that source) of each global position."""
        blocks, within = np.divmod(np.asarray(positions, dtype=np.int64), BLOCK)
        src = np.empty(len(blocks), dtype=np.int64)
        own = np.empty(len(blocks), dtype=np.int64)
        for b in np.unique(blocks):
            sel = blocks == b
            bsrc, bown = self.block(int(b))
            src[sel], own[sel] = bsrc[within[sel]], bown[within[sel]]
        return src, own

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        src, own = self.sources_of(positions)
        out = np.empty(len(src), dtype=np.int64)
        for s in np.unique(src):
            sel = src == s
            out[sel] = self.offsets[s] + self.orders[int(s)](own[sel])
        return out
