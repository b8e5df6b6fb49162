"""Reading preference data (data/preference.py): one pair per sample, both sides padded as chat
examples are, with the reference model's log-probabilities of the two answers when the run has
computed them (training/objectives/reference.py).

`ds[i]` is an int64 array (2, 2, seq_len + 2): side 0 chosen, side 1 rejected, each a row of
tokens and a row of targets (data/examples.py) and one more column: the bits of that side's
float64 reference log-probability in its first row (NaN before there is one), so a pair's
numbers travel through the readers' stacking with its tokens. reader._to_xy unpacks a batch of
B pairs into x and y of 2B rows, chosen and rejected interleaved (a pair's two rows are always
in the same micro-batch), and the 2B reference log-probabilities.
"""

from __future__ import annotations

import os

import numpy as np

from data.examples import ExampleDataset
from data.manifest import DataError


def is_pairs(manifest) -> bool:
    """Whether a prepared folder holds preference pairs."""
    return bool((getattr(manifest, "chat", None) or {}).get("pairs"))


class PairDataset(ExampleDataset):
    """A split of preference data, pair by pair (examples 2i and 2i + 1)."""

    masked = False  # the objective averages over pairs, not over trained tokens
    pairs = True

    def __init__(self, data_dir: str | os.PathLike, split: str, seq_len: int, verify: bool = False):
        super().__init__(data_dir, split, seq_len, verify)
        if not is_pairs(self.manifest):
            raise DataError(f"{data_dir} is not preference data (no 'pairs' in its manifest)")
        self.reference: np.ndarray | None = None  # (pairs, 2) float64, set by the run

    def __len__(self) -> int:
        return len(self._bounds) // 2

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"pair {i} out of range [0, {len(self)})")
        out = np.zeros((2, 2, self.seq_len + 2), dtype=np.int64)
        for side in (0, 1):
            out[side, :, :-1] = ExampleDataset.__getitem__(self, 2 * i + side)
        ref = np.full(2, np.nan) if self.reference is None else self.reference[i]
        out[:, 0, -1] = np.asarray(ref, dtype=np.float64).view(np.int64)
        return out

    def order(self, seed: int):
        from data.reader import EpochOrder

        return EpochOrder(len(self), (seed,))
