"""Reading prepared data: memory-mapped samples and deterministic, resumable per-rank batches.

The order of training samples is a pure function of (seed, global position): position p is
sample permutation(seed, epoch = p // len(ds))[p % len(ds)]. A loader's whole state is the
number of samples consumed by all ranks together, so a run resumes exactly, on any world size.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import torch

from data.manifest import DataError, Manifest, load_manifest


class TokenDataset:
    """Fixed-length windows over one split's token stream (documents joined by EOS).

    `ds[i]` is an int64 array of seq_len + 1 tokens: [i * seq_len, i * seq_len + seq_len + 1),
    so consecutive windows share one token and every token is a target exactly once.
    """

    def __init__(self, data_dir: str | os.PathLike, split: str, seq_len: int, verify: bool = False):
        if seq_len < 1:
            raise DataError(f"seq_len must be at least 1, got {seq_len}")
        self.manifest: Manifest = load_manifest(data_dir, verify=verify)
        self.split = split
        self.seq_len = seq_len
        info = self.manifest.split(split)
        self.info = info
        self.num_tokens = info.tokens
        # Bytes per token turns loss in nats/token into bits per byte: loss / ln 2 / this.
        self.bytes_per_token = info.bytes / info.tokens if info.tokens else float("nan")
        d = self.manifest.data_dir
        self._shards = [
            np.memmap(d / s.file, dtype=self.manifest.dtype, mode="r", shape=(s.tokens,))
            for s in info.shards
            if s.tokens
        ]
        self._starts = np.cumsum([0] + [len(s) for s in self._shards])
        self._len = max(0, (self.num_tokens - 1) // seq_len)
        if self._len == 0:
            raise DataError(
                f"split {split!r} of {d} has {self.num_tokens} tokens: too few for one sample of "
                f"seq_len + 1 = {seq_len + 1}; use a smaller seq_len or more data"
            )

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self._len:
            raise IndexError(f"sample {i} out of range [0, {self._len})")
        return self.tokens(i * self.seq_len, i * self.seq_len + self.seq_len + 1)

    def tokens(self, start: int, end: int) -> np.ndarray:
        """Tokens [start, end) of the split's stream as int64, across shard boundaries."""
        k = int(np.searchsorted(self._starts, start, side="right")) - 1
        off = start - self._starts[k]
        if end - self._starts[k] <= len(self._shards[k]):  # the common case: one shard
            return self._shards[k][off : off + end - start].astype(np.int64)
        parts = []
        while start < end:
            k = int(np.searchsorted(self._starts, start, side="right")) - 1
            stop = min(end, int(self._starts[k + 1]))
            parts.append(self._shards[k][start - self._starts[k] : stop - self._starts[k]])
            start = stop
        return np.concatenate(parts).astype(np.int64)

    def order(self, seed: int) -> EpochOrder:
        """The training order of this split's samples for `seed` (see EpochOrder)."""
        return EpochOrder(len(self), (seed,))

    def document(self, j: int) -> np.ndarray:
        """The token ids of document j of this split (its EOS excluded), for inspection."""
        d = self.manifest.data_dir
        for s in self.info.shards:
            if j < s.documents:
                offsets = np.load(d / s.index_file, mmap_mode="r")
                shard = np.memmap(d / s.file, dtype=self.manifest.dtype, mode="r")
                return shard[offsets[j] : offsets[j + 1] - 1].astype(np.int64)
            j -= s.documents
        raise IndexError(f"document out of range: split has {self.info.documents}")


class EpochOrder:
    """Global position p -> sample permutation(key, p // n)[p % n]: every one of n samples once
    per epoch, each epoch shuffled by a numpy Generator seeded from (*key, epoch)."""

    def __init__(self, n: int, key: tuple[int, ...]):
        self.n, self.key = n, tuple(key)
        self._perms: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a batch spans at most two epochs
                self._perms.pop(min(self._perms))
            rng = np.random.default_rng([*self.key, epoch])
            self._perms[epoch] = rng.permutation(self.n)
        return self._perms[epoch]

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        epochs, within = np.divmod(np.asarray(positions, dtype=np.int64), self.n)
        out = np.empty(len(epochs), dtype=np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self.permutation(int(e))[within[sel]]
        return out


def _check_rank(micro_batch: int, rank: int, world: int) -> None:
    if micro_batch < 1:
        raise DataError(f"micro_batch must be at least 1, got {micro_batch}")
    if not 0 <= rank < world:
        raise DataError(f"rank {rank} is outside world size {world}")


def _to_xy(samples: np.ndarray) -> tuple[torch.Tensor, ...]:
    t = torch.from_numpy(samples)
    if t.dim() == 4:  # preference pairs (data/pairs.py): (x, y, reference log-probs), 2B rows
        rows = t.reshape(-1, 2, t.shape[-1])
        reference = rows[:, 0, -1].contiguous().view(torch.float64)
        return rows[:, 0, :-2].contiguous(), rows[:, 1, 1:-1].contiguous(), reference
    if t.dim() == 3:  # chat data: rows of tokens and of targets (data/examples.py)
        return t[:, 0, :-1].contiguous(), t[:, 1, 1:].contiguous()
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


class BatchLoader:
    """Endless training batches for one rank, in a global order fixed by (seed, epoch).

    Each `next_batch` covers the next micro_batch * world global positions; rank r takes
    [start + r * micro_batch, start + (r + 1) * micro_batch). The ranks' batches are disjoint
    and together cover every sample of an epoch once. `dataset` is a TokenDataset or a
    data.mixture.Mixture: each says how global positions map to its samples (`order(seed)`).
    """

    def __init__(
        self,
        dataset: TokenDataset,
        micro_batch: int,
        rank: int,
        world: int,
        seed: int,
        consumed_samples: int = 0,
    ):
        _check_rank(micro_batch, rank, world)
        self.dataset = dataset
        self.micro_batch, self.rank, self.world = micro_batch, rank, world
        self.seed = seed
        self.consumed_samples = consumed_samples
        self._order = None  # the dataset's order for this seed (TokenDataset or Mixture)
        # [start, end) spans of global positions never read: the batches of steps a rollback
        # left behind (training/loop/rollback.py), or --skip-samples
        self.skips: list[tuple[int, int]] = []

    def skip(self, spans) -> None:
        """Never read the global positions of `spans` ([start, end) pairs) from now on."""
        merged = sorted({(int(a), int(b)) for a, b in [*self.skips, *spans] if b > a})
        self.skips = merged

    @property
    def epoch(self) -> int:
        """The epoch of the next global position."""
        return self.consumed_samples // len(self.dataset)

    def sample_indices(self, positions: np.ndarray) -> np.ndarray:
        """Dataset indices of global positions."""
        if self._order is None:
            self._order = self.dataset.order(self.seed)
        return self._order(positions)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y): LongTensors [micro_batch, seq_len], y = x shifted by one token (chat data:
        -100 where the loss mask does not train)."""
        self._jump_skips()
        start = self.consumed_samples + self.rank * self.micro_batch
        idx = self.sample_indices(np.arange(start, start + self.micro_batch))
        self.consumed_samples += self.micro_batch * self.world
        return _to_xy(np.stack([self.dataset[int(i)] for i in idx]))

    def _jump_skips(self) -> None:
        # A batch that would touch a skipped span starts after it instead (every rank alike).
        width = self.micro_batch * self.world
        moved = True
        while moved:
            moved = False
            for a, b in self.skips:
                c = self.consumed_samples
                if c < b and a < c + width:
                    self.consumed_samples, moved = b, True

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint stores: samples consumed by all ranks together, the seed, and the
        spans skipped (when there are any)."""
        out = {"consumed_samples": self.consumed_samples, "seed": self.seed}
        if self.skips:
            out["skip"] = [list(s) for s in self.skips]
        return out

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from `state_dict()`, saved on this or any other world size / micro batch."""
        self.consumed_samples = int(state["consumed_samples"])
        self.skip(state.get("skip", []))  # with the spans this run already skips
        if int(state.get("seed", self.seed)) != self.seed:
            self.seed = int(state["seed"])  # the checkpoint's order wins, so resume is exact
            self._order = None


def parse_spans(text: str) -> list[tuple[int, int]]:
    """'100:104,200:208' -> [(100, 104), (200, 208)]; DataError in one line when malformed."""
    spans = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        a, sep, b = part.partition(":")
        try:
            span = (int(a), int(b))
        except ValueError:
            span = None
        if not sep or span is None or not 0 <= span[0] < span[1]:
            raise DataError(
                f"--skip-samples: {part!r} is not START:END with 0 <= START < END (integers)"
            )
        spans.append(span)
    return spans


def eval_batches(
    dataset: TokenDataset,
    micro_batch: int,
    rank: int,
    world: int,
    max_samples: int | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Evaluation batches in fixed order (samples 0, 1, 2, ...), ranks disjoint within a step.

    Covers the first min(len(dataset), max_samples) samples. Every rank yields the same number
    of batches, ceil(n / (micro_batch * world)), so collectives cannot hang: the last step
    wraps around to the first samples to fill up (a few samples count twice; none is dropped).
    """
    _check_rank(micro_batch, rank, world)
    n = len(dataset) if max_samples is None else min(len(dataset), max_samples)
    if n < 1:
        raise DataError(f"max_samples must be at least 1, got {max_samples}")
    step = micro_batch * world
    for start in range(0, n, step):
        pos = start + rank * micro_batch + np.arange(micro_batch)
        yield _to_xy(np.stack([dataset[int(i)] for i in pos % n]))
