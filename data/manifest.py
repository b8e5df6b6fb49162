"""The on-disk format of a prepared dataset: manifest.json, token shards, document indexes.

A prepared folder holds:
    manifest.json              written last; a folder without it is not a dataset
    tokenizer/                 loads with transformers.AutoTokenizer.from_pretrained
    {split}_{k:05d}.bin        raw little-endian uint16/uint32 token ids (np.memmap-able)
    {split}_{k:05d}.idx.npy    int64 document boundaries in that shard (n_docs + 1 offsets)
    {split}_{k:05d}.mask.bin   chat data only: one uint8 per token, 1 where the loss trains
Every document is stored as its tokens followed by one EOS token; an example of chat data
(`manifest.chat` set, data/chat.py) as its chat template renders it, with no EOS added.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from data.files import sha256_file

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# what verify_shards found, so the next start hashes only what changed; an older version kept
# it in the data folder as DIR/.verified.json
STAMP = ".verified.json"
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
    mask_file: str | None = None  # chat data: the loss mask (one uint8 per token)
    mask_sha256: str | None = None


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
    # Chat/instruction data (data/chat.py): seq_len, train_on, too_long and the example counts
    # (kept, truncated, dropped, trained tokens); None for a text corpus.
    chat: dict[str, Any] | None = None
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
        if out["chat"] is None:  # a text corpus's manifest reads as it always has
            out.pop("chat")
        for split in out["splits"].values():
            for sh in split["shards"]:
                if sh["mask_file"] is None:
                    sh.pop("mask_file"), sh.pop("mask_sha256")
        return out


MIN_VAL_DOCUMENTS = 20  # below this a validation loss is a small-sample figure


def small_val_warning(manifest: Manifest) -> str | None:
    """One line when the validation split is too small for its loss and bits per byte to mean
    much (a small corpus at the default 0.5%), saying which --val-fraction would fix it."""
    val = manifest.splits.get("val", SplitInfo())
    if val.documents >= MIN_VAL_DOCUMENTS:
        return None
    total = sum(s.documents for s in manifest.splits.values())
    fraction = min(0.5, MIN_VAL_DOCUMENTS / max(total, 1))
    return (
        f"warning: the validation split of {manifest.data_dir} has {val.documents} of {total} "
        f"documents ({val.tokens} tokens), so its loss and bits/byte are small-sample figures; "
        f"prepare with --val-fraction {fraction:.2g} for about {MIN_VAL_DOCUMENTS}"
    )


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


# What each field of manifest.json holds (a hand-edited or damaged manifest is refused naming
# the field, before anything reads it): the top level, each split, each shard.
_NAT, _TEXT, _OPT_NAT, _OPT_TEXT = (
    "a whole number >= 0",
    "text",
    "a whole number or null",
    "text or null",
)
TOP_FIELDS = {
    "format_version": _NAT, "source": _TEXT, "source_detail": _TEXT, "vocab_size": _NAT,
    "eos_id": _NAT, "bos_id": _OPT_NAT, "pad_id": _OPT_NAT, "dtype": _TEXT,
    "tokenizer_sha256": _TEXT, "args": "an object", "splits": "an object", "chat": "an object or null",
}  # fmt: skip
SPLIT_FIELDS = {"documents": _NAT, "tokens": _NAT, "bytes": _NAT, "shards": "a list"}
SHARD_FIELDS = {
    "file": _TEXT, "tokens": _NAT, "documents": _NAT, "sha256": _TEXT, "index_file": _TEXT,
    "index_sha256": _TEXT, "mask_file": _OPT_TEXT, "mask_sha256": _OPT_TEXT,
}  # fmt: skip
OPTIONAL = {"chat", "mask_file", "mask_sha256"}


def _holds(value: Any, kind: str) -> bool:
    nat = type(value) is int and value >= 0
    return {
        _NAT: nat,
        _OPT_NAT: value is None or nat,
        _TEXT: isinstance(value, str),
        _OPT_TEXT: value is None or isinstance(value, str),
        "an object": isinstance(value, dict),
        "an object or null": value is None or isinstance(value, dict),
        "a list": isinstance(value, list),
    }[kind]


def _check_fields(obj: Any, fields: dict[str, str], where: str) -> None:
    if not isinstance(obj, dict):
        raise DataError(f"{where} must be an object, got {type(obj).__name__}")
    for key, kind in fields.items():
        if key not in obj:
            if key in OPTIONAL:
                continue
            raise DataError(f"{where} has no {key!r}")
        if not _holds(obj[key], kind):
            raise DataError(f"{where}: {key} must be {kind}, got {json.dumps(obj[key])[:40]}")
    unknown = sorted(set(obj) - set(fields))
    if unknown:
        raise DataError(f"{where}: unknown field {unknown[0]!r}")


def check_schema(obj: Any, path: Path) -> None:
    """manifest.json's fields and their types, and shard files named inside the folder;
    DataError naming the first field that is wrong."""
    _check_fields(obj, TOP_FIELDS, str(path))
    chat = obj.get("chat")
    if chat is not None and not _holds(chat.get("longest"), _NAT):  # what check_fits reads
        raise DataError(f"{path}: chat.longest must be {_NAT}, got {chat.get('longest')!r}")
    if obj["dtype"] not in ("uint16", "uint32"):
        raise DataError(f"{path}: dtype must be uint16 or uint32, got {obj['dtype']!r}")
    for name, split in obj["splits"].items():
        _check_fields(split, SPLIT_FIELDS, f"{path}: split {name!r}")
        for k, shard in enumerate(split["shards"]):
            where = f"{path}: split {name!r} shard {k}"
            _check_fields(shard, SHARD_FIELDS, where)
            for key in ("file", "index_file", "mask_file"):
                f = shard.get(key)
                if f is not None and (Path(f).name != f or f in ("", ".", "..")):
                    raise DataError(f"{where}: {key} {f!r} is not a file name in the folder")


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
        version = obj.get("format_version") if isinstance(obj, dict) else None
        if version != FORMAT_VERSION:
            raise DataError(
                f"{path}: format version {version}, this code reads {FORMAT_VERSION}; "
                "prepare the data again"
            )
        check_schema(obj, path)
        manifest = _from_json(obj, data_dir)
        np.dtype(manifest.dtype)
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise DataError(f"{path} is not a valid manifest ({type(e).__name__}: {e})") from None
    itemsize = np.dtype(manifest.dtype).itemsize
    for split in manifest.splits.values():
        for sh in split.shards:
            _check_file(data_dir / sh.file, sh.tokens * itemsize, sh.sha256 if verify else None)
            idx_bytes = None  # .npy has a header, so only existence and checksum are checked
            _check_file(data_dir / sh.index_file, idx_bytes, sh.index_sha256 if verify else None)
            if sh.mask_file is not None:
                _check_file(data_dir / sh.mask_file, sh.tokens, sh.mask_sha256 if verify else None)
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


def verify_shards(data_dir: str | os.PathLike, log=None) -> Manifest:
    """load_manifest's checks plus every shard's and index's sha256, hashed in parallel threads
    and only once per file: a stamp (a per-user cache file, ~/.cache/zerostack/verified/, one per
    folder) keeps each verified file's size, mtime and ctime, and a file whose stat still
    matches is not read again. Raises DataError naming the first damaged file."""
    manifest = load_manifest(data_dir)
    d = Path(data_dir)
    expected = {
        name: sha
        for split in manifest.splits.values()
        for sh in split.shards
        for name, sha in (
            (sh.file, sh.sha256),
            (sh.index_file, sh.index_sha256),
            (sh.mask_file, sh.mask_sha256),
        )
        if name is not None
    }
    stamp = _stamp_path(d)
    with _locked(stamp):  # ranks of one host starting together hash once, not once each
        seen = _read_stamp(stamp)
        todo = [f for f in expected if seen.get(f) != _fingerprint(d / f, expected[f])]
        gb = sum((d / f).stat().st_size for f in todo) / 1e9
        if gb >= 1 and log is not None:  # say why the start takes a while; small data is instant
            log(f"verifying the sha256 of {len(todo)} data files in {d} ({gb:.1f} GB, once)")
        with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
            got = dict(zip(todo, pool.map(lambda f: sha256_file(d / f), todo)))
        bad = next((f for f in todo if got[f] != expected[f]), None)
        if bad is not None:
            raise DataError(
                f"{d / bad}: sha256 does not match {d / MANIFEST}; the file is damaged, "
                "prepare the data again"
            )
        if sha256_dir(manifest.tokenizer_dir) != manifest.tokenizer_sha256:
            raise DataError(f"{manifest.tokenizer_dir}: checksum does not match {d / MANIFEST}")
        if todo:
            _write_stamp(stamp, {f: _fingerprint(d / f, sha) for f, sha in expected.items()})
    return manifest


def _fingerprint(path: Path, sha256: str) -> list:
    # ctime changes on every write and cannot be set back by a user, unlike mtime.
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, sha256]


def _stamp_path(data_dir: Path) -> Path:
    """The stamp of `data_dir`, in the user's cache: the data folder is the user's input, and a
    run (refused or not) leaves it as it was."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "zerostack"
    key = hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:16]
    return cache / "verified" / f"{key}.json"


@contextlib.contextmanager
def _locked(stamp: Path):
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        f = open(stamp.with_name(stamp.name + ".lock"), "a")
    except OSError:  # nowhere to keep a lock: verify without one
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _read_stamp(stamp: Path) -> dict:
    try:
        obj = json.loads(stamp.read_text())
        return obj if isinstance(obj, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_stamp(stamp: Path, obj: dict) -> None:
    tmp = stamp.with_name(f"{stamp.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(obj))
        os.replace(tmp, stamp)
    except OSError:  # a read-only cache only costs a re-hash next time
        tmp.unlink(missing_ok=True)
