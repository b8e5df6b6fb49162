"""zerostack data: corpora -> tokenizer -> token shards -> deterministic per-rank batches.

    from data import prepare, TokenDataset, BatchLoader, eval_batches, load_manifest, DataError
    from data import load_data, open_split, Mixture    # --data FOLDER or A:0.7,B:0.3

Names load lazily, so `import data.prepare` (e.g. in tokenizer worker processes) does not pull
in torch, and `from data import TokenDataset` does not pull in transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DataError": "data.manifest",
    "Manifest": "data.manifest",
    "load_manifest": "data.manifest",
    "verify_shards": "data.manifest",
    "load_data": "data.mixture",
    "open_split": "data.mixture",
    "Mixture": "data.mixture",
    "TokenDataset": "data.reader",
    "ExampleDataset": "data.examples",
    "BatchLoader": "data.reader",
    "eval_batches": "data.reader",
    "prepare": "data.prepare",
    "iter_documents": "data.sources",
    "train_tokenizer": "data.tokenizer",
    "load_tokenizer": "data.tokenizer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name == "prepare":  # the module is callable as the function (see data/prepare.py)
        return importlib.import_module("data.prepare")
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'data' has no attribute {name!r}")
