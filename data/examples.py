"""Reading chat data (data/chat.py): one example per sample, padded, with its loss mask
(`ExampleDataset`); or several whole examples per sample, each ended by the data's EOS, for a
model that keeps them apart with a document mask (`PackedExamples`, `--doc-mask`).

One example per sample: no example sees another's tokens and any model can take it. Packed:
fewer, fuller samples; our model's document mask (models/llama.py `set_document_mask`) makes
attention block-diagonal and restarts positions at each EOS, so every trained token's loss is
the one it has alone. The training order is reader.EpochOrder's over the samples: a pure
function of (seed, global position), so BatchLoader resumes exactly, on any world size, as for
a text corpus.
"""

from __future__ import annotations

import os

import numpy as np

from data.manifest import DataError, Manifest, load_manifest

IGNORE_INDEX = -100  # a target the loss skips (transformers' and models/llama.py's value)


class ExampleDataset:
    """`ds[i]` is a (2, seq_len + 1) int64 array: example i's tokens padded (with the pad id, or
    EOS) to seq_len + 1, and its targets: the token where the loss mask trains it, IGNORE_INDEX
    elsewhere (the prompt, the padding). reader._to_xy turns it into (x, y)."""

    masked = True  # the loop weighs the loss by trained tokens (training/loop/loop.py)

    def __init__(self, data_dir: str | os.PathLike, split: str, seq_len: int, verify: bool = False):
        if seq_len < 1:
            raise DataError(f"seq_len must be at least 1, got {seq_len}")
        self.manifest: Manifest = load_manifest(data_dir, verify=verify)
        if self.manifest.chat is None:
            raise DataError(f"{data_dir} is a text corpus, not chat data")
        check_fits(self.manifest, seq_len)
        self.split, self.seq_len = split, seq_len
        self.info = self.manifest.split(split)
        self.num_tokens = self.info.tokens
        self.bytes_per_token = self.info.bytes / self.info.tokens if self.info.tokens else 1.0
        self.pad = (
            self.manifest.pad_id if self.manifest.pad_id is not None else self.manifest.eos_id
        )
        d, dtype = self.manifest.data_dir, self.manifest.dtype
        self._tokens, self._masks, bounds = [], [], []
        for k, s in enumerate(sh for sh in self.info.shards if sh.tokens):
            self._tokens.append(np.memmap(d / s.file, dtype=dtype, mode="r", shape=(s.tokens,)))
            self._masks.append(np.memmap(d / s.mask_file, dtype=np.uint8, mode="r"))
            offsets = np.load(d / s.index_file)
            bounds.append(np.stack([np.full(len(offsets) - 1, k), offsets[:-1], offsets[1:]], 1))
        self._bounds = np.concatenate(bounds) if bounds else np.zeros((0, 3), np.int64)
        if len(self._bounds) == 0:
            raise DataError(f"split {split!r} of {d} holds no example")

    def __len__(self) -> int:
        return len(self._bounds)

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self._bounds):
            raise IndexError(f"example {i} out of range [0, {len(self._bounds)})")
        k, start, end = (int(v) for v in self._bounds[i])
        out = np.full((2, self.seq_len + 1), self.pad, dtype=np.int64)
        out[1] = IGNORE_INDEX
        tokens = self._tokens[k][start:end].astype(np.int64)
        out[0, : end - start] = tokens
        out[1, : end - start] = np.where(self._masks[k][start:end] > 0, tokens, IGNORE_INDEX)
        return out

    def order(self, seed: int):
        """The training order of the examples for `seed` (reader.EpochOrder)."""
        from data.reader import EpochOrder

        return EpochOrder(len(self), (seed,))


def check_fits(manifest: Manifest, seq_len: int) -> None:
    """Every example of chat data fits a sample of seq_len + 1 tokens; DataError if not."""
    longest = int(manifest.chat["longest"])
    if longest > seq_len + 1:
        raise DataError(
            f"--seq-len {seq_len}: {manifest.data_dir} holds examples of up to {longest} tokens "
            f"(seq_len + 1 = {seq_len + 1}); train with --seq-len {longest - 1}, or prepare "
            f"with --seq-len {seq_len}"
        )


class PackedExamples(ExampleDataset):
    """Whole examples in corpus order, as many as fit seq_len + 1 tokens per sample, each
    followed by the data's EOS unless it ends with it (the separator the document mask reads);
    an example's first token is never a target (it would be predicted from another example).
    The rest of a sample is padding, as in ExampleDataset."""

    def __init__(self, data_dir: str | os.PathLike, split: str, seq_len: int, verify: bool = False):
        super().__init__(data_dir, split, seq_len, verify)
        self.separator = self.manifest.eos_id
        problem = separator_problem(self)
        if problem:
            raise DataError(problem)
        ends = np.array([self._tokens[k][e - 1] for k, _, e in self._bounds]) == self.separator
        need = (self._bounds[:, 2] - self._bounds[:, 1]) + ~ends  # with its separator
        packs, start, used = [], 0, 0
        for i, n in enumerate(need.tolist()):
            if used + n > seq_len + 1 and i > start:
                packs.append((start, i))
                start, used = i, 0
            used += n
        packs.append((start, len(need)))
        self._packs = np.array(packs, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._packs)

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range [0, {len(self)})")
        first, last = (int(v) for v in self._packs[i])
        out = np.full((2, self.seq_len + 1), self.pad, dtype=np.int64)
        out[1] = IGNORE_INDEX
        pos = 0
        for j in range(first, last):
            k, start, end = (int(v) for v in self._bounds[j])
            tokens = self._tokens[k][start:end].astype(np.int64)
            targets = np.where(self._masks[k][start:end] > 0, tokens, IGNORE_INDEX)
            targets[0] = IGNORE_INDEX
            out[0, pos : pos + len(tokens)] = tokens
            out[1, pos : pos + len(tokens)] = targets
            pos += len(tokens)
            if tokens[-1] != self.separator and pos <= self.seq_len:
                out[0, pos] = self.separator  # not a target: the example's end is not trained
                pos += 1
        return out

    @property
    def examples(self) -> int:
        return len(self._bounds)


def separator_problem(ds: ExampleDataset) -> str | None:
    """One line when the data's EOS occurs inside an example (not as its last token): it could
    not then mark where packed examples end. None when it can."""
    eos = ds.manifest.eos_id
    for k, shard in enumerate(ds._tokens):
        ends = ds._bounds[ds._bounds[:, 0] == k][:, 2] - 1
        inside = np.setdiff1d(np.flatnonzero(np.asarray(shard) == eos), ends)
        if len(inside):
            return (
                f"--doc-mask: {ds.manifest.data_dir} ({ds.split}) holds the data's EOS (id {eos}) "
                f"inside an example (token {int(inside[0])} of shard {k}), so it cannot mark where "
                "packed examples end; train without --doc-mask (one padded example per sample)"
            )
    return None
