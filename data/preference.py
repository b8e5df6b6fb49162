"""Preference data: JSONL rows of a prompt and two answers, one preferred -> pairs of token ids
with a loss mask on the answer only, for DPO-family objectives (training/objectives/).

A row has one of TRL's two shapes:
    {"prompt": "...", "chosen": "...", "rejected": "..."}          -> user, assistant
    {"chosen": [messages], "rejected": [messages]}                  conversational: the turns
        both share are the prompt, and "prompt": [messages] may name them instead
Each side is rendered with the chat template as chat data is (data/chat.py) and masked so only
the answer's tokens (the last assistant turn, its end-of-turn marker included) count. A pair is
written as two consecutive examples of one split, chosen then rejected, so a reader takes both
or neither (data/pairs.py). A side longer than seq_len + 1 tokens is truncated or makes the
pair dropped (`--too-long`); a pair with no answer token left on a side (a prompt longer than
the sequence), or whose kept tokens are the same on both sides, is dropped and counted.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from data.chat import Renderer, _flush, chat_files, first_row, to_messages
from data.manifest import SPLITS, DataError, SplitInfo
from data.shards import ShardWriter, split_of
from data.sources import json_row

_BATCH = 512  # pairs handed to the shard writer at a time


def is_preference_source(source: str) -> bool:
    """Whether SOURCE is local JSONL whose first row has 'chosen' (a preference row)."""
    row = first_row(source)
    return row is not None and "chosen" in row


def to_pair(row: dict[str, Any], where: str) -> tuple[list[dict], list[dict]]:
    """One row -> (chosen conversation, rejected conversation), the same prompt turns then one
    assistant answer each; DataError naming `where` for a row that is not a preference pair."""
    missing = [k for k in ("chosen", "rejected") if k not in row]
    if missing:
        raise DataError(f"{where}: a preference row needs 'chosen' and 'rejected' ({missing[0]!r} "
                        "is missing)")  # fmt: skip
    chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
    if isinstance(chosen, str) and isinstance(rejected, str):
        if not isinstance(prompt, str):
            raise DataError(f"{where}: text 'chosen' and 'rejected' need a text 'prompt'")
        prompt_turns = [{"role": "user", "content": prompt}]
        answers = [[{"role": "assistant", "content": a}] for a in (chosen, rejected)]
    elif isinstance(chosen, list) and isinstance(rejected, list):
        c, r = (to_messages({"messages": m}, where) if m else m for m in (chosen, rejected))
        if prompt is None:  # implicit prompt: the turns both sides share
            k = 0
            while k < min(len(c), len(r)) - 1 and c[k] == r[k]:
                k += 1
            prompt_turns, answers = c[:k], [c[k:], r[k:]]
        else:
            if isinstance(prompt, str):
                prompt_turns = [{"role": "user", "content": prompt}]
            else:
                prompt_turns = to_messages({"messages": prompt}, where)
            answers = [c, r]
    else:
        raise DataError(
            f"{where}: 'chosen' and 'rejected' must both be text or both be message lists"
        )
    for name, answer in zip(("chosen", "rejected"), answers):
        if len(answer) != 1 or answer[0]["role"] != "assistant":
            raise DataError(f"{where}: {name!r} must be one assistant answer after the prompt")
    if not prompt_turns:
        raise DataError(f"{where}: no prompt: give 'prompt' or turns both sides share")
    if answers[0] == answers[1]:
        raise DataError(f"{where}: 'chosen' and 'rejected' are the same, nothing to prefer")
    return prompt_turns + answers[0], prompt_turns + answers[1]


def pair_rows(files: list[Path]) -> Iterator[tuple[str, tuple[list[dict], list[dict]]]]:
    """("FILE:ROW", (chosen, rejected)) of every non-empty line, in order."""
    for path in files:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    where = f"{path}:{lineno}"
                    yield where, to_pair(json_row(line, path, lineno), where)


@dataclass
class PairCounts:
    """What manifest.json's `chat` records for preference data (`pairs` set marks it)."""

    seq_len: int
    too_long: str
    train_on: str = "completion"  # the answer's tokens only
    pairs: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    examples: int = 0  # sequences kept: two per pair
    truncated: int = 0  # pairs with a side cut to seq_len + 1 tokens
    dropped_too_long: int = 0
    dropped_untrained: int = 0  # no answer token left on a side: the prompt fills the sequence
    dropped_same: int = 0  # both sides' kept tokens equal once cut
    longest: int = 0
    trained_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))


def write_preference_splits(
    source: str,
    out: Path,
    tokenizer_dir: Path,
    dtype: str,
    *,
    seq_len: int,
    too_long: str,
    val_fraction: float,
    seed: int,
    shard_tokens: int,
    val_source: str | None = None,
) -> tuple[dict[str, SplitInfo], PairCounts]:
    """Render every row's two sides and write train/val shards, each pair as two consecutive
    examples (chosen, rejected). A bad row stops it (DataError
    naming FILE:ROW, and prepare removes its scratch folder); row i goes to val per `split_of`,
    or by file with `val_source`."""
    renderer = Renderer(tokenizer_dir, "completion")
    writers = {name: ShardWriter(out, name, dtype, shard_tokens) for name in SPLITS}
    counts = PairCounts(seq_len, too_long)
    pending: dict[str, list] = {name: [] for name in SPLITS}
    for i, (name, where, (chosen, rejected)) in enumerate(_split_pairs(source, val_source)):
        sides = [renderer.render(chosen, where), renderer.render(rejected, where)]
        kept = _fit_pair(sides, seq_len + 1, counts, renderer.tok)
        if kept is None:
            continue
        name = name or ("val" if split_of(i, val_fraction, seed) else "train")
        pending[name].extend(kept)
        counts.pairs[name] += 1
        counts.trained_tokens[name] += int(kept[0][1].sum() + kept[1][1].sum())
        if len(pending[name]) >= 2 * _BATCH:
            _flush(writers[name], pending[name])
    for name in SPLITS:
        _flush(writers[name], pending[name])
    if counts.examples == 0:
        raise DataError(
            f"no pair of {source} is left to train on ({counts.dropped_too_long} dropped as too "
            f"long, {counts.dropped_untrained} with a prompt of seq_len + 1 = {seq_len + 1} tokens "
            f"or more, {counts.dropped_same} the same once cut)"
        )
    return {name: w.close() for name, w in writers.items()}, counts


def _split_pairs(source: str, val_source: str | None):
    """(split or None: split_of decides, "FILE:ROW", (chosen, rejected)) of every row."""
    if val_source is None:
        yield from ((None, where, pair) for where, pair in pair_rows(chat_files(source)))
        return
    for name, src in (("train", source), ("val", val_source)):
        yield from ((name, where, pair) for where, pair in pair_rows(chat_files(src)))


def _fit_pair(sides, limit: int, counts: PairCounts, tok):
    """The pair's two (ids, mask, UTF-8 bytes), cut to `limit` tokens, or None when dropped."""
    if any(len(ids) > limit for ids, _ in sides):
        if counts.too_long == "drop":
            counts.dropped_too_long += 1
            return None
        counts.truncated += 1
        sides = [(ids[:limit], mask[:limit]) for ids, mask in sides]
    if not all(mask.any() for _, mask in sides):
        counts.dropped_untrained += 1
        return None
    (ci, cm), (ri, rm) = sides
    if np.array_equal(ci, ri) and np.array_equal(cm, rm):
        counts.dropped_same += 1
        return None
    counts.examples += 2
    counts.longest = max(counts.longest, len(ci), len(ri))
    return [(ids, mask, len(tok.decode(ids.tolist()).encode("utf-8"))) for ids, mask in sides]
