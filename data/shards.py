"""Documents -> token shards: parallel encoding, the train/val assignment, shard writing.

Documents stream through a pool of encoder processes with a bounded number of batches in
flight, and come back in input order, so memory stays flat and the output does not depend on
the number of processes.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from data.manifest import MIN_VAL_DOCUMENTS, SPLITS, ShardInfo, SplitInfo

_BATCH_CHARS = 1 << 20  # text sent to a worker at a time
_BATCH_DOCS = 1024

_MASK64 = (1 << 64) - 1


def unit_hash(seed: int, i: int) -> float:
    """A deterministic pseudo-random number in [0, 1) for (seed, i) (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + (i + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53)


def split_of(index: int, val_fraction: float, seed: int) -> bool:
    """True when document `index` goes to the validation split.

    Documents are grouped in blocks of round(1 / val_fraction); one document per block, at a
    position drawn from (seed, block), is validation. The fraction is exact to one document
    and the choice needs no corpus size, so it works on a stream.
    """
    if val_fraction <= 0.0:
        return False
    block = max(2, round(1.0 / val_fraction))
    b, pos = divmod(index, block)
    return pos == int(unit_hash(seed, b) * block)


DEFAULT_VAL_FRACTION = 0.005  # a large corpus's validation share
MAX_AUTO_VAL_FRACTION = 0.1  # what "auto" takes from a small corpus at most


def auto_val_fraction(documents: int | None) -> float:
    """--val-fraction's default: 0.5% of a large corpus, but enough of a small one for about
    MIN_VAL_DOCUMENTS validation documents (a steady loss and bits/byte), at most 10%.
    `documents`: the corpus's count (an upper bound: empty ones are skipped), None when it is
    not known without reading the corpus (then 0.5%). One block of `split_of` per validation
    document, with one to spare."""
    if not documents:
        return DEFAULT_VAL_FRACTION
    block = documents // (MIN_VAL_DOCUMENTS + 1)
    if block >= round(1 / DEFAULT_VAL_FRACTION):
        return DEFAULT_VAL_FRACTION
    return 1.0 / max(block, round(1 / MAX_AUTO_VAL_FRACTION))


def mask_name(shard: str) -> str:
    """The loss mask beside a shard of chat data: `train_00000.bin` -> `train_00000.mask.bin`."""
    return shard.replace(".bin", ".mask.bin")


class ShardWriter:
    """Appends whole documents to `{split}_{k:05d}.bin`, starting a new shard at `shard_tokens`."""

    def __init__(self, out: Path, split: str, dtype: str, shard_tokens: int):
        self.out, self.split, self.dtype, self.shard_tokens = Path(out), split, dtype, shard_tokens
        self.info = SplitInfo()
        self._file = None
        self._lengths: list[np.ndarray] = []
        self._tokens = 0

    def add(
        self,
        tokens: np.ndarray,
        lengths: np.ndarray,
        nbytes: np.ndarray,
        masks: np.ndarray | None = None,
    ) -> None:
        """Write documents: `tokens` is their concatenation, `lengths` their token counts;
        `masks` (chat data, data/chat.py), one uint8 per token: 1 where the loss trains."""
        self.info.documents += len(lengths)
        self.info.tokens += len(tokens)
        self.info.bytes += int(nbytes.sum())
        ends = np.cumsum(lengths)
        done_docs, done_tokens = 0, 0
        while done_docs < len(lengths):
            if self._file is None:
                self._open()
            room = self.shard_tokens - self._tokens
            # As many whole documents as fit; at least one, so a huge document gets a shard.
            k = int(np.searchsorted(ends, done_tokens + room, side="right")) - done_docs
            k = max(k, 1) if self._tokens == 0 else k
            if k > 0:
                end_tok = int(ends[done_docs + k - 1])
                mask = None if masks is None else masks[done_tokens:end_tok]
                self._write(tokens[done_tokens:end_tok], lengths[done_docs : done_docs + k], mask)
                done_docs, done_tokens = done_docs + k, end_tok
            if self._tokens >= self.shard_tokens or k == 0:
                self._close_shard()

    def close(self) -> SplitInfo:
        """Finish the last shard; return the split's counts and shard list."""
        if self._file is not None:
            self._close_shard()
        return self.info

    def _open(self) -> None:
        name = f"{self.split}_{len(self.info.shards):05d}.bin"
        self._name = name
        self._file = open(self.out / name, "wb")
        self._sha = hashlib.sha256()
        self._mask_file, self._mask_sha = None, None
        self._lengths, self._tokens = [], 0

    def _write(self, tokens: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None) -> None:
        data = np.ascontiguousarray(tokens, dtype=self.dtype).tobytes()  # little-endian hosts
        self._file.write(data)
        self._sha.update(data)
        if mask is not None:
            if self._mask_file is None:
                self._mask_file = open(self.out / mask_name(self._name), "wb")
                self._mask_sha = hashlib.sha256()
            bits = np.ascontiguousarray(mask, dtype=np.uint8).tobytes()
            self._mask_file.write(bits)
            self._mask_sha.update(bits)
        self._lengths.append(np.asarray(lengths, dtype=np.int64))
        self._tokens += len(tokens)

    def _close_shard(self) -> None:
        self._file.close()
        self._file = None
        if self._mask_file is not None:
            self._mask_file.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        index_file = self._name.replace(".bin", ".idx.npy")
        np.save(self.out / index_file, offsets)
        idx_sha = hashlib.sha256((self.out / index_file).read_bytes()).hexdigest()
        self.info.shards.append(
            ShardInfo(
                file=self._name,
                tokens=self._tokens,
                documents=len(lengths),
                sha256=self._sha.hexdigest(),
                index_file=index_file,
                index_sha256=idx_sha,
                **(
                    {"mask_file": mask_name(self._name), "mask_sha256": self._mask_sha.hexdigest()}
                    if self._mask_file is not None
                    else {}
                ),
            )
        )
        self._mask_file = None


def write_splits(
    docs: Iterable[str],
    out: Path,
    tokenizer_dir: Path,
    eos_id: int,
    dtype: str,
    *,
    num_proc: int = 1,
    val_fraction: float = 0.0,
    seed: int = 0,
    shard_tokens: int = 2**28,
    progress: bool = False,
    total_bytes: int | None = None,
) -> dict[str, SplitInfo]:
    """Encode `docs` with tokenizer_dir/tokenizer.json and write train/val shards into `out`.

    Returns {"train": SplitInfo, "val": SplitInfo}. Document i goes to val per `split_of`.
    """
    from tqdm import tqdm

    writers = {name: ShardWriter(out, name, dtype, shard_tokens) for name in SPLITS}
    init = (str(tokenizer_dir), eos_id, dtype)
    # Workers start before the progress bar's monitor thread, so the fork copies one thread.
    with _pool(num_proc, init) as pool:
        bar = tqdm(
            total=total_bytes,
            unit="B",
            unit_scale=True,
            desc="tokenize",
            disable=not progress,
            file=sys.stderr,
            mininterval=0.5,
        )
        first = 0
        with bar:
            for n, (flat, lengths, nbytes) in _encoded(docs, pool, init, 2 * num_proc):
                is_val = np.array([split_of(first + i, val_fraction, seed) for i in range(n)])
                first += n
                ends = np.cumsum(lengths)
                starts = ends - lengths
                for name, mask in (("train", ~is_val), ("val", is_val)):
                    if mask.all():
                        writers[name].add(flat, lengths, nbytes)
                    elif mask.any():
                        parts = [flat[s:e] for s, e in zip(starts[mask], ends[mask])]
                        writers[name].add(np.concatenate(parts), lengths[mask], nbytes[mask])
                bar.update(int(nbytes.sum()))
                tokens = sum(w.info.tokens for w in writers.values())
                bar.set_postfix_str(f"{first} docs, {tokens / 1e6:.1f}M tokens", refresh=False)
    return {name: w.close() for name, w in writers.items()}


_worker: dict[str, Any] = {}


def _init_worker(tokenizer_dir: str, eos_id: int, dtype: str) -> None:
    from data.tokenizer import encoder

    _worker.update(tok=encoder(tokenizer_dir), eos=eos_id, dtype=np.dtype(dtype))


def _encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Documents -> (all tokens, each document followed by EOS; tokens per doc; bytes per doc)."""
    tok, eos = _worker["tok"], _worker["eos"]
    ids = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
    flat = np.empty(int(lengths.sum()), dtype=_worker["dtype"])
    pos = 0
    for x in ids:
        flat[pos : pos + len(x)] = x
        flat[pos + len(x)] = eos
        pos += len(x) + 1
    nbytes = np.fromiter((len(t.encode("utf-8")) for t in texts), dtype=np.int64, count=len(texts))
    return flat, lengths, nbytes


def _batches(docs: Iterable[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    chars = 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc)
        if chars >= _BATCH_CHARS or len(batch) >= _BATCH_DOCS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


@contextlib.contextmanager
def _pool(num_proc: int, init: tuple) -> Iterator[Any]:
    """A pool of `num_proc` encoder processes, or None to encode in this process."""
    if num_proc == 1:
        yield None
        return
    # fork where there is one: workers need only the tokenizer file, and spawn would re-import
    # the caller's main module (the trainer, torch...) in every worker.
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    with multiprocessing.get_context(method).Pool(num_proc, _init_worker, init) as pool:
        yield pool
        pool.close()  # normal end: let workers exit; on errors the `with` terminates them
        pool.join()


def _encoded(docs: Iterable[str], pool: Any, init: tuple, in_flight: int):
    """(number of docs, encoded batch) in input order, at most `in_flight` batches queued."""
    if pool is None:
        _init_worker(*init)
        for b in _batches(docs):
            yield len(b), _encode(b)
        return
    pending: deque = deque()
    for b in _batches(docs):
        pending.append((len(b), pool.apply_async(_encode, (b,))))
        if len(pending) >= in_flight:
            n, res = pending.popleft()
            yield n, res.get()
    while pending:
        n, res = pending.popleft()
        yield n, res.get()
