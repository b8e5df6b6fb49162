"""Chat and instruction data: JSONL rows -> conversations -> token ids and a per-token loss mask.

A row is one example, in one of three shapes:
    {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
    {"prompt": "...", "completion": "..."}                    -> user, assistant
    {"instruction": "...", "input": "...", "output": "..."}   -> user (input optional), assistant
Each is rendered with the tokenizer's own chat template (`apply_chat_template`, the text the
model will see at inference) and tokenized as `apply_chat_template(tokenize=True)` does. The
loss mask says which tokens train (`--train-on`): every assistant turn (`assistant`), the last
one only (`completion`), or every token (`all`). An assistant turn's tokens are those whose text
lies between the conversation rendered up to its generation prompt and rendered through it:
its content and the template's end-of-turn marker, so the model learns to stop.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from data.manifest import SPLITS, DataError, SplitInfo
from data.shards import ShardWriter, split_of
from data.sources import json_row, jsonl_lines

ROLES = ("system", "user", "assistant")
TRAIN_ON = ("assistant", "completion", "all")
TOO_LONG = ("truncate", "drop")
_BATCH = 512  # examples handed to the shard writer at a time


def chat_files(source: str) -> list[Path]:
    """The .jsonl files of SOURCE: a file, a folder (searched recursively) or a glob."""
    path = Path(os.path.expanduser(source))
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.jsonl") if p.is_file())
    else:
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
    if not files:
        raise DataError(f"no chat data at {source}: expected a .jsonl file, a folder or a glob")
    bad = next((p for p in files if p.suffix != ".jsonl"), None)
    if bad is not None:
        raise DataError(f"{bad}: chat data is read from .jsonl files only")
    return files


def first_row(source: str) -> dict | None:
    """The first row of SOURCE when it is local JSONL whose first row is a JSON object; None
    otherwise (not local JSONL, empty, not text, not JSON: read as a text source, which says
    what is wrong)."""
    try:
        files = chat_files(source)
        first = next(jsonl_lines(files[0]), None)
        row = first and json_row(first[1], files[0], first[0])
    except DataError:
        return None
    return row if isinstance(row, dict) and row else None


def is_chat_source(source: str) -> bool:
    """Whether SOURCE is local JSONL whose first row has one of the chat shapes."""
    row = first_row(source)
    if row is None:
        return False
    return "messages" in row or {"prompt", "completion"} <= row.keys() or "instruction" in row


def rows(files: list[Path]) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """("FILE:ROW", its messages) of every non-empty line, in order."""
    for path in files:
        for lineno, line in jsonl_lines(path):
            where = f"{path}:{lineno}"
            yield where, to_messages(json_row(line, path, lineno), where)


def to_messages(row: dict[str, Any], where: str) -> list[dict[str, str]]:
    """One row in any of the three shapes -> its conversation; DataError naming `where`."""
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{where}: 'messages' must be a non-empty list")
        out = []
        for k, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                raise DataError(f"{where}: message {k} needs a 'role' and a text 'content'")
            if m.get("role") not in ROLES:
                raise DataError(
                    f"{where}: message {k} has role {m.get('role')!r}; roles are {', '.join(ROLES)}"
                )
            out.append({"role": m["role"], "content": m["content"]})
        if out[0]["role"] == "assistant":
            raise DataError(f"{where}: the conversation starts with the assistant")
        return out
    if "prompt" in row or "completion" in row:
        prompt, completion = _texts(row, where, "prompt", "completion")
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    if "instruction" in row or "output" in row:
        instruction, output = _texts(row, where, "instruction", "output")
        extra = row.get("input") or ""
        if not isinstance(extra, str):
            raise DataError(f"{where}: 'input' must be text")
        user = f"{instruction}\n\n{extra}" if extra else instruction
        return [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
    raise DataError(
        f"{where}: not a chat example: expected 'messages', 'prompt'/'completion' or "
        f"'instruction'/'output' (found {', '.join(sorted(row)) or 'no fields'})"
    )


def _texts(row: dict, where: str, *names: str) -> list[str]:
    for name in names:
        if not isinstance(row.get(name), str):
            raise DataError(f"{where}: field {name!r} missing or not text")
    return [row[n] for n in names]


def chat_template_of(tokenizer: str | os.PathLike, template_file: str | None) -> str:
    """The template to render with: `template_file`'s text, else the tokenizer's own; DataError
    (one line, saying how to give one) when there is neither."""
    from data.tokenizer import load_tokenizer

    if template_file is not None:
        try:
            return Path(template_file).read_text()
        except OSError as e:
            raise DataError(f"--chat-template {template_file}: {e.strerror}") from None
    template = getattr(load_tokenizer(tokenizer), "chat_template", None)
    if not template:
        raise DataError(
            f"--tokenizer {tokenizer} has no chat template; give one with --chat-template "
            "FILE (a Jinja template as in tokenizer_config.json's chat_template)"
        )
    return template


class Renderer:
    """Conversations -> (token ids, loss mask) with the tokenizer folder's template."""

    def __init__(self, tokenizer_dir: str | os.PathLike, train_on: str):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        self.train_on = train_on

    def render(self, messages: list[dict[str, str]], where: str) -> tuple[np.ndarray, np.ndarray]:
        """(int64 ids, uint8 mask) of one conversation; the mask's first entry is 0 (the first
        token is never a target)."""
        text = self._text(messages, where, generation_prompt=False)
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], dtype=np.int64)
        starts = np.asarray([a for a, _ in enc["offset_mapping"]], dtype=np.int64)
        mask = np.zeros(len(ids), dtype=np.uint8)
        if self.train_on == "all":
            mask[:] = 1
        else:
            for begin, end in self._trained_spans(messages, text, where):
                mask[(starts >= begin) & (starts < end)] = 1
        mask[:1] = 0
        return ids, mask

    def _trained_spans(self, messages, text: str, where: str) -> list[tuple[int, int]]:
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not turns:
            raise DataError(f"{where}: no assistant message to train on (or use --train-on all)")
        if self.train_on == "completion":
            turns = turns[-1:]
        spans = []
        for i in turns:
            before = self._text(messages[:i], where, generation_prompt=True)
            through = self._text(messages[: i + 1], where, generation_prompt=False)
            if not (through.startswith(before) and text.startswith(through)):
                raise DataError(
                    f"{where}: the chat template does not render a conversation's beginning as "
                    "a prefix of the whole, so its assistant turns cannot be found; use "
                    "--train-on all or another --chat-template"
                )
            spans.append((len(before), len(through)))
        return spans

    def _text(self, messages, where: str, generation_prompt: bool) -> str:
        try:
            return self.tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as e:  # the template's own raise_exception(), or a Jinja error
            raise DataError(f"{where}: the chat template refused it ({e})") from None


@dataclass
class ChatCounts:
    """What manifest.json's `chat` records: how the examples fared against --seq-len."""

    seq_len: int
    train_on: str
    too_long: str
    examples: int = 0  # kept
    truncated: int = 0
    dropped_too_long: int = 0
    dropped_untrained: int = 0  # no token left to train on (e.g. truncated inside the prompt)
    longest: int = 0  # tokens of the longest kept example
    trained_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))


def write_chat_splits(
    source: str,
    out: Path,
    tokenizer_dir: Path,
    dtype: str,
    *,
    seq_len: int,
    train_on: str,
    too_long: str,
    val_fraction: float,
    seed: int,
    shard_tokens: int,
    progress: bool = False,
    val_source: str | None = None,
) -> tuple[dict[str, SplitInfo], ChatCounts]:
    """Render every row of SOURCE's JSONL and write train/val shards with their loss masks.
    Row i (counting every row, kept or not) goes to val per `split_of`; with `val_source`,
    SOURCE's rows all train and VAL_SOURCE's all validate. An example keeps at most
    seq_len + 1 tokens (seq_len targets): longer ones are truncated or dropped (`too_long`)."""
    from tqdm import tqdm

    renderer = Renderer(tokenizer_dir, train_on)
    writers = {name: ShardWriter(out, name, dtype, shard_tokens) for name in SPLITS}
    counts = ChatCounts(seq_len, train_on, too_long)
    pending: dict[str, list] = {name: [] for name in SPLITS}
    bar = tqdm(desc="render", unit=" examples", disable=not progress, mininterval=0.5)
    with bar:
        for i, (name, where, messages) in enumerate(_split_rows(source, val_source)):
            ids, mask = renderer.render(messages, where)
            kept = _fit(ids, mask, seq_len + 1, counts, renderer.tok)
            bar.update(1)
            if kept is None:
                continue
            name = name or ("val" if split_of(i, val_fraction, seed) else "train")
            pending[name].append(kept)
            counts.trained_tokens[name] += int(kept[1].sum())
            if len(pending[name]) >= _BATCH:
                _flush(writers[name], pending[name])
    for name in SPLITS:
        _flush(writers[name], pending[name])
    if counts.examples == 0:
        raise DataError(f"no example of {source} is left to train on ({_summary(counts)})")
    return {name: w.close() for name, w in writers.items()}, counts


def _split_rows(source: str, val_source: str | None):
    """(split or None: split_of decides, "FILE:ROW", messages) of every row."""
    if val_source is None:
        yield from ((None, where, msgs) for where, msgs in rows(chat_files(source)))
        return
    for name, src in (("train", source), ("val", val_source)):
        yield from ((name, where, msgs) for where, msgs in rows(chat_files(src)))


def _fit(ids, mask, limit: int, counts: ChatCounts, tok):
    """(ids, mask, UTF-8 bytes) of the example cut to `limit` tokens, or None when dropped;
    counted in `counts`."""
    if len(ids) > limit:
        if counts.too_long == "drop":
            counts.dropped_too_long += 1
            return None
        ids, mask = ids[:limit], mask[:limit]
        counts.truncated += 1
    if not mask.any():
        counts.dropped_untrained += 1
        return None
    counts.examples += 1
    counts.longest = max(counts.longest, len(ids))
    return ids, mask, len(tok.decode(ids.tolist()).encode("utf-8"))


def _flush(writer: ShardWriter, examples: list) -> None:
    if not examples:
        return
    writer.add(
        np.concatenate([ids for ids, _, _ in examples]),
        np.array([len(ids) for ids, _, _ in examples], dtype=np.int64),
        np.array([n for _, _, n in examples], dtype=np.int64),
        masks=np.concatenate([m for _, m, _ in examples]),
    )
    examples.clear()


def _summary(counts: ChatCounts) -> str:
    return (
        f"{counts.truncated} truncated, {counts.dropped_too_long} dropped as longer than "
        f"seq_len + 1 = {counts.seq_len + 1} tokens, {counts.dropped_untrained} with no token to "
        f"train on under --train-on {counts.train_on}"
    )
