"""The on-disk format of a prepared dataset: manifest.json, token shards, document indexes.

A prepared folder holds:
    manifest.json              written last; a folder without it is not a dataset
    tokenizer/                 loads with transformers.AutoTokenizer.from_pretrained
    {split}_{k:05d}.bin        raw little-endian uint16/uint32 token ids (np.memmap-able)
    {split}_{k:05d}.idx.npy    int64 document boundaries in that shard (n_docs + 1 offsets)
Every document is stored as its tokens followed by one EOS token.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from data.files import sha256_file

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"
SPLITS = ("train", "val")
_SPLIT_ALIASES = {"validation": "val", "valid": "val", "eval": "val"}


class DataError(ValueError):
    """Bad input to the data pipeline; the message is one line saying what and where."""


@dataclass
class ShardInfo:
    """One token shard and its document index."""

    file: str
    tokens: int
    documents: int
    sha256: str
    index_file: str
    index_sha256: str


@dataclass
class SplitInfo:
    """Counts for one split; bytes are UTF-8 bytes of the documents (EOS excluded)."""

    documents: int = 0
    tokens: int = 0
    bytes: int = 0
    shards: list[ShardInfo] = field(default_factory=list)


@dataclass
class Manifest:
    """What manifest.json says; `data_dir` is where it was loaded from."""

    format_version: int
    source: str
    source_detail: str
    vocab_size: int
    eos_id: int
    bos_id: int | None
    pad_id: int | None
    dtype: str
    tokenizer_sha256: str
    args: dict[str, Any]
    splits: dict[str, SplitInfo]
    data_dir: Path | None = None

    @property
    def tokenizer_dir(self) -> Path:
        return Path(self.data_dir) / TOKENIZER_DIR

    def split(self, name: str) -> SplitInfo:
        """The SplitInfo for 'train' or 'val' (also accepts 'validation')."""
        key = _SPLIT_ALIASES.get(name, name)
        if key not in self.splits:
            raise DataError(
                f"unknown split {name!r} in {self.data_dir}: have {sorted(self.splits)}"
            )
        return self.splits[key]

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("data_dir")
        return out


def dtype_for_vocab(vocab_size: int, dtype: str = "auto") -> str:
    """Shard dtype for a vocabulary: uint16 when every id fits, else uint32; checks a forced one."""
    if dtype == "auto":
        return "uint16" if vocab_size <= 2**16 else "uint32"
    if dtype not in ("uint16", "uint32"):
        raise DataError(f"unknown shard dtype {dtype!r}: use auto, uint16 or uint32")
    limit = 2**16 if dtype == "uint16" else 2**32
    if vocab_size > limit:
        raise DataError(
            f"vocab size {vocab_size} does not fit in {dtype} shards (at most {limit} ids); "
            "use --dtype uint32 or auto"
        )
    return dtype


def sha256_dir(path: Path) -> str:
    """One checksum over every file of a folder (names and contents, in sorted order)."""
    h = hashlib.sha256()
    for p in sorted(q for q in Path(path).rglob("*") if q.is_file()):
        h.update(p.relative_to(path).as_posix().encode() + b"\0")
        h.update(sha256_file(p).encode())
    return h.hexdigest()


def write_manifest(data_dir: Path, manifest: Manifest) -> None:
    """Write manifest.json atomically (temp file + rename), so a reader never sees half of it."""
    tmp = Path(data_dir) / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest.to_json(), indent=2) + "\n")
    os.replace(tmp, Path(data_dir) / MANIFEST)


def _from_json(obj: dict[str, Any], data_dir: Path) -> Manifest:
    splits = {
        name: SplitInfo(
            documents=s["documents"],
            tokens=s["tokens"],
            bytes=s["bytes"],
            shards=[ShardInfo(**sh) for sh in s["shards"]],
        )
        for name, s in obj["splits"].items()
    }
    fields = {k: v for k, v in obj.items() if k != "splits"}
    return Manifest(**fields, splits=splits, data_dir=data_dir)


def load_manifest(data_dir: str | os.PathLike, verify: bool = False) -> Manifest:
    """Read DIR/manifest.json and check every shard's size (always) and sha256 (verify=True).

    Raises DataError, one line naming the file, for a missing folder or manifest, an unknown
    format version, or a shard whose length or checksum does not match the manifest.
    """
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"no such dataset folder: {data_dir} (run python -m data.prepare first)")
    path = data_dir / MANIFEST
    if not path.is_file():
        raise DataError(
            f"{path} is missing: {data_dir} is not a prepared dataset (or its preparation did "
            "not finish); run python -m data.prepare"
        )
    try:
        obj = json.loads(path.read_text())
        version = obj.get("format_version")
        if version != FORMAT_VERSION:
            raise DataError(
                f"{path}: format version {version}, this code reads {FORMAT_VERSION}; "
                "prepare the data again"
            )
        manifest = _from_json(obj, data_dir)
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DataError(f"{path} is not a valid manifest ({type(e).__name__}: {e})") from None
    itemsize = np.dtype(manifest.dtype).itemsize
    for split in manifest.splits.values():
        for sh in split.shards:
            _check_file(data_dir / sh.file, sh.tokens * itemsize, sh.sha256 if verify else None)
            idx_bytes = None  # .npy has a header, so only existence and checksum are checked
            _check_file(data_dir / sh.index_file, idx_bytes, sh.index_sha256 if verify else None)
    if verify and sha256_dir(manifest.tokenizer_dir) != manifest.tokenizer_sha256:
        raise DataError(f"{manifest.tokenizer_dir}: checksum does not match {path}")
    return manifest


def _check_file(path: Path, size: int | None, sha256: str | None) -> None:
    if not path.is_file():
        raise DataError(f"{path}: listed in the manifest but missing")
    if size is not None and path.stat().st_size != size:
        raise DataError(
            f"{path}: {path.stat().st_size} bytes, the manifest says {size}; "
            "the shard is truncated or from another run, prepare the data again"
        )
    if sha256 is not None and sha256_file(path) != sha256:
        raise DataError(f"{path}: sha256 does not match the manifest; the file is corrupted")
