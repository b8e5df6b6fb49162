"""Prepare a corpus for training: tokenizer, token shards, train/val split and manifest.json.

    python -m data.prepare --source pystdlib --out data_cache/pystdlib
    python -m data.prepare --source path/to/owt/ --out data_cache/owt --num-proc 8
    python -m data.prepare --source Skylion007/openwebtext --out data_cache/owt --num-proc 16
    python -m data.prepare --source chats.jsonl --tokenizer HF_DIR --out data_cache/sft

Chat and instruction JSONL (data/chat.py) is rendered with the tokenizer's chat template and
written with a per-token loss mask; so are preference pairs (prompt, chosen, rejected:
data/preference.py), each pair as two consecutive examples.

Documents stream from the source through a pool of tokenizer processes into shards, with a
bounded number of batches in flight, so memory stays flat whatever the corpus size. Everything
is written to a temporary folder that is renamed to --out once manifest.json is in it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import types
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from data.files import scratch_folder, why_unwritable
from data.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    TOKENIZER_DIR,
    DataError,
    Manifest,
    load_manifest,
    sha256_dir,
    small_val_warning,
    write_manifest,
)
from data.shards import DEFAULT_VAL_FRACTION, auto_val_fraction, unit_hash, write_splits
from data.sources import Source, resolve_source

DEFAULT_SHARD_TOKENS = 2**28  # 512 MB per uint16 shard


def prepare(
    source: str,
    out: str | os.PathLike,
    *,
    vocab_size: int = 8192,
    tokenizer: str | os.PathLike | None = None,
    num_proc: int = 1,
    val_fraction: float | None = None,
    max_docs: int | None = None,
    text_field: str = "text",
    seed: int = 0,
    sample_bytes: int = 32_000_000,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    dtype: str = "auto",
    progress: bool = True,
    chat: bool | None = None,
    chat_template: str | os.PathLike | None = None,
    train_on: str = "assistant",
    seq_len: int = 2048,
    too_long: str = "truncate",
    val_source: str | os.PathLike | None = None,
) -> Path:
    """Tokenize SOURCE into the dataset folder `out` and return it.

    SOURCE is 'pystdlib', a local file/folder/glob (.txt, .jsonl, .parquet) or an HF hub name.
    Trains a SentencePiece tokenizer of `vocab_size` on `sample_bytes` of text, or reuses the HF
    tokenizer folder `tokenizer`. A complete folder prepared with the same arguments is reused
    as is. Bad input raises DataError before any work.

    Chat data (`chat`; None: local JSONL whose first row has a chat shape, see data/chat.py)
    needs `tokenizer`, renders with its chat template or `chat_template` (a Jinja file), and
    trains on the tokens `train_on` names; examples over seq_len + 1 tokens are truncated or
    dropped (`too_long`), and counted in the manifest's `chat`. `val_source` (chat data): the
    validation split is that JSONL's rows, and every row of SOURCE trains.
    """
    from data.chat import is_chat_source
    from data.preference import is_preference_source

    out = Path(out)
    if (why := why_unwritable(out)) is not None:
        raise DataError(f"--out: {why}")
    pairs = is_preference_source(str(source))  # prompt, chosen, rejected (data/preference.py)
    chat = (pairs or is_chat_source(str(source))) if chat is None else chat
    if val_fraction is None:  # "auto": 0.5%, or enough of a small corpus (shards.py)
        val_fraction = _auto_val_fraction(out, source, max_docs, chat)
    _check_options(vocab_size, num_proc, val_fraction, max_docs, sample_bytes, shard_tokens)
    _check_dtype(tokenizer, vocab_size, dtype)
    if chat:
        return _prepare_chat(
            source, out, tokenizer, chat_template, train_on, seq_len, too_long,
            val_fraction=val_fraction, seed=seed, shard_tokens=shard_tokens, dtype=dtype,
            progress=progress, val_source=val_source, pairs=pairs,
        )  # fmt: skip
    _refuse_chat_flags(source, chat_template, val_source)
    src = resolve_source(source, text_field)
    args = _canonical(
        {
            "source": src.key,
            "source_detail": src.description,
            "vocab_size": None if tokenizer else vocab_size,
            "tokenizer": sha256_dir(Path(tokenizer)) if tokenizer else None,
            "val_fraction": val_fraction,
            "max_docs": max_docs,
            "text_field": text_field,
            "seed": seed,
            "sample_bytes": None if tokenizer else sample_bytes,
            "shard_tokens": shard_tokens,
            "dtype": dtype,
        }
    )
    return _prepare_text(source, src, out, args, tokenizer, num_proc, progress)


def _refuse_chat_flags(source, chat_template, val_source) -> None:
    """The chat-only options refused for a text corpus."""
    if chat_template is not None or val_source is not None:
        flag = "--chat-template" if chat_template is not None else "--val-source"
        raise DataError(
            f"{flag} is for chat data, and {source} is a text corpus (its first row has no "
            "'messages', 'prompt'/'completion' or 'instruction'/'output'); drop it or use --chat"
        )


def _prepare_text(
    source, src: Source, out: Path, args: dict, tokenizer, num_proc: int, progress: bool
) -> Path:
    """prepare() for a text corpus, with the options `args` records (the folder is made from
    exactly what its manifest will say): the tokenizer trained on a sample of it (or the one
    given copied), every document's tokens in shards, the manifest, the folder published."""
    from data.manifest import dtype_for_vocab
    from data.tokenizer import copy_hf_tokenizer, encoder, special_ids, train_tokenizer

    max_docs, seed, val_fraction = args["max_docs"], args["seed"], args["val_fraction"]
    vocab_size, sample_bytes = args["vocab_size"], args["sample_bytes"]
    dtype, shard_tokens = args["dtype"], args["shard_tokens"]
    if _reuse(out, args) is not None:
        _log(progress, f"reusing {out}: already prepared with the same arguments")
        return out
    if next(_documents(src, max_docs), None) is None:
        raise DataError(f"empty corpus: {source} yields no non-empty documents")
    tmp = scratch_folder(out)
    try:
        tok_dir = tmp / TOKENIZER_DIR
        if tokenizer is None:
            _log(progress, f"training a {vocab_size}-token SentencePiece BPE on {src.description}")
            sample = _tokenizer_sample(src, max_docs, sample_bytes, seed)
            train_tokenizer(sample, vocab_size, tok_dir, sample_bytes=sample_bytes)
        else:
            copy_hf_tokenizer(tokenizer, tok_dir)
        ids = special_ids(tok_dir)
        out_dtype = dtype_for_vocab(ids["vocab_size"], dtype)
        encoder(tok_dir)  # fail here, not in a worker, if tokenizer.json does not load
        total = src.approx_bytes if max_docs is None else None
        splits = write_splits(
            _documents(src, max_docs),
            tmp,
            tok_dir,
            ids["eos_id"],
            out_dtype,
            num_proc=num_proc,
            val_fraction=val_fraction,
            seed=seed,
            shard_tokens=shard_tokens,
            progress=progress,
            total_bytes=total,
        )
        manifest = _manifest(source, src.description, ids, out_dtype, tok_dir, args, splits)
        write_manifest(tmp, manifest)  # last file: its presence marks the folder complete
        _publish(tmp, out, args)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    manifest.data_dir = out
    if val_fraction > 0 and (warning := small_val_warning(manifest)):
        print(warning, file=sys.stderr, flush=True)  # even with --quiet: it changes the figures
    for name, s in splits.items():
        _log(
            progress,
            f"{name}: {s.documents} documents, {s.tokens} tokens, {s.bytes} bytes, "
            f"{len(s.shards)} shards",
        )
    return out


def _check_dtype(tokenizer, vocab_size: int, dtype: str) -> None:
    """Fail now, before any work, if the vocabulary cannot fit the shard dtype."""
    from data.manifest import dtype_for_vocab
    from data.tokenizer import check_hf_tokenizer

    if tokenizer is None:
        dtype_for_vocab(vocab_size, dtype)
    else:
        dtype_for_vocab(check_hf_tokenizer(tokenizer)["vocab_size"], dtype)


def _prepare_chat(
    source,
    out,
    tokenizer,
    template_file,
    train_on,
    seq_len,
    too_long,
    *,
    val_fraction,
    seed,
    shard_tokens,
    dtype,
    progress,
    val_source=None,
    pairs=False,
) -> Path:
    """prepare() for chat/instruction JSONL (data/chat.py), or preference pairs with `pairs`
    (data/preference.py); the same folder layout, each shard with its loss mask."""
    from data.chat import chat_files, chat_template_of
    from data.manifest import dtype_for_vocab
    from data.tokenizer import check_hf_tokenizer, copy_hf_tokenizer, special_ids

    _check_chat_options(source, tokenizer, train_on, too_long, seq_len)
    out = Path(out)
    _check_options(8192, 1, val_fraction, None, 1, shard_tokens)
    vocab = check_hf_tokenizer(tokenizer)["vocab_size"]
    dtype_for_vocab(vocab, dtype)
    files = chat_files(str(source))
    val_files = chat_files(str(val_source)) if val_source is not None else []
    template = chat_template_of(tokenizer, template_file)
    args = _canonical(
        {
            "source": os.path.abspath(os.path.expanduser(str(source))),
            "files": [str(f) for f in files],
            "val_files": [str(f) for f in val_files],
            "tokenizer": sha256_dir(Path(tokenizer)) if Path(tokenizer).is_dir() else tokenizer,
            "chat_template": template,
            "train_on": train_on,
            "seq_len": seq_len,
            "too_long": too_long,
            "val_fraction": val_fraction,
            "seed": seed,
            "shard_tokens": shard_tokens,
            "dtype": dtype,
            **({"pairs": True, "train_on": "completion"} if pairs else {}),
        }
    )
    if _reuse(out, args) is not None:
        _log(progress, f"reusing {out}: already prepared with the same arguments")
        return out
    tmp = scratch_folder(out)
    try:
        tok_dir = tmp / TOKENIZER_DIR
        copy_hf_tokenizer(tokenizer, tok_dir, chat_template=template)
        ids = special_ids(tok_dir)
        out_dtype = dtype_for_vocab(ids["vocab_size"], dtype)
        val = None if val_source is None else str(val_source)
        splits, counts = _write_examples(str(source), tmp, tok_dir, out_dtype, args, val, progress)
        kind = "preference pairs" if pairs else "chat data"
        detail = f"{kind}: {len(files)} JSONL files"
        manifest = _manifest(source, detail, ids, out_dtype, tok_dir, args, splits)
        manifest.chat = asdict(counts)
        write_manifest(tmp, manifest)  # last file: its presence marks the folder complete
        _publish(tmp, out, args)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _log(progress, _chat_counts_line(counts))
    return out


def _write_examples(source: str, tmp: Path, tok_dir: Path, dtype: str, args: dict, val, progress):
    """Chat examples (data/chat.py) or, when `args` say pairs, preference pairs
    (data/preference.py) into `tmp`'s shards, with the options `args` record; returns (splits,
    counts)."""
    names = ("seq_len", "too_long", "val_fraction", "seed", "shard_tokens")
    kw = {k: args[k] for k in names}
    if args.get("pairs"):
        from data.preference import write_preference_splits

        return write_preference_splits(source, tmp, tok_dir, dtype, val_source=val, **kw)
    from data.chat import write_chat_splits

    return write_chat_splits(
        source, tmp, tok_dir, dtype, train_on=args["train_on"], progress=progress,
        val_source=val, **kw
    )  # fmt: skip


def _check_chat_options(source, tokenizer, train_on: str, too_long: str, seq_len: int) -> None:
    """What chat data needs: the model's tokenizer, and --train-on, --too-long and --seq-len in
    their domains."""
    from data.chat import TOO_LONG, TRAIN_ON

    if tokenizer is None:
        raise DataError(
            f"{source} is chat data: give the model's tokenizer with --tokenizer HF_DIR"
        )
    if train_on not in TRAIN_ON:
        raise DataError(f"--train-on must be one of {', '.join(TRAIN_ON)}, got {train_on!r}")
    if too_long not in TOO_LONG:
        raise DataError(f"--too-long must be one of {', '.join(TOO_LONG)}, got {too_long!r}")
    if seq_len < 1:
        raise DataError(f"--seq-len must be at least 1, got {seq_len}")


def _chat_counts_line(counts) -> str:
    if hasattr(counts, "pairs"):
        return (
            f"{counts.pairs} pairs ({counts.truncated} truncated, {counts.dropped_too_long} "
            f"dropped as too long, {counts.dropped_untrained} with a prompt filling the sequence, "
            f"{counts.dropped_same} the same once cut); trained tokens: {counts.trained_tokens}"
        )
    return (
        f"{counts.examples} examples ({counts.truncated} truncated, {counts.dropped_too_long} "
        f"dropped as too long, {counts.dropped_untrained} with nothing to train on); trained "
        f"tokens: {counts.trained_tokens}"
    )


def _manifest(source, detail: str, ids: dict, dtype: str, tok_dir: Path, args, splits) -> Manifest:
    """The manifest of a prepared folder, text or chat alike."""
    return Manifest(
        format_version=FORMAT_VERSION,
        source=str(source),
        source_detail=detail,
        vocab_size=ids["vocab_size"],
        eos_id=ids["eos_id"],
        bos_id=ids["bos_id"],
        pad_id=ids["pad_id"],
        dtype=dtype,
        tokenizer_sha256=sha256_dir(tok_dir),
        args=args,
        splits=splits,
    )


def _check_options(vocab_size, num_proc, val_fraction, max_docs, sample_bytes, shard_tokens):
    if num_proc < 1:
        raise DataError(f"--num-proc must be at least 1, got {num_proc}")
    if not 0.0 <= val_fraction <= 0.5:
        raise DataError(f"--val-fraction must be in [0, 0.5], got {val_fraction}")
    if max_docs is not None and max_docs < 1:
        raise DataError(f"--max-docs must be at least 1, got {max_docs}")
    if sample_bytes < 1:
        raise DataError(f"--sample-bytes must be positive, got {sample_bytes}")
    if shard_tokens < 1:
        raise DataError(f"--shard-tokens must be positive, got {shard_tokens}")
    if vocab_size < 300:
        raise DataError(f"--vocab-size {vocab_size} is too small: at least 300")


def _canonical(obj: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(obj, sort_keys=True))


def _reuse(out: Path, args: dict[str, Any]) -> Manifest | None:
    """The existing dataset at `out` if it was prepared with `args`; None if `out` is free."""
    if (out / MANIFEST).is_file():
        manifest = load_manifest(out)
        if manifest.args == args:
            return manifest
        diff = sorted(k for k in args if manifest.args.get(k) != args[k])
        raise DataError(
            f"{out} holds a dataset prepared with other arguments ({', '.join(diff)} differ); "
            "choose another --out or delete it"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(
            f"{out} exists and is not a prepared dataset (no {MANIFEST}); choose another --out "
            "or delete it"
        )
    return None


def _auto_val_fraction(out: Path, source, max_docs: int | None, chat: bool) -> float:
    """--val-fraction not given: a folder already prepared keeps its own (its split never
    changes under it); else `auto_val_fraction` of the corpus's document count where it is
    known without reading it (the built-in corpus, or --max-docs), else 0.5%."""
    if (out / MANIFEST).is_file():
        try:
            prior = load_manifest(out).args.get("val_fraction")
        except DataError:
            prior = None
        if prior is not None:
            return prior
    if chat:
        return DEFAULT_VAL_FRACTION
    count = len(resolve_source(source).files) if str(source) == "pystdlib" else None
    if max_docs is not None:
        count = min(count, max_docs) if count else max_docs
    return auto_val_fraction(count)


def _publish(tmp: Path, out: Path, args: dict[str, Any]) -> None:
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    try:
        os.rename(tmp, out)
    except OSError:
        # Another process published the same dataset first: keep theirs if it is the same.
        if _reuse(out, args) is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _documents(src: Source, max_docs: int | None) -> Iterator[str]:
    for i, doc in enumerate(src.documents()):
        if max_docs is not None and i >= max_docs:
            return
        yield doc


def _tokenizer_sample(src: Source, max_docs: int | None, sample_bytes: int, seed: int):
    """Documents spread over the corpus, about `sample_bytes` of them (or the first ones when the
    size is unknown), so training the tokenizer needs bounded memory."""
    rate = 1.0
    if src.approx_bytes and max_docs is None:
        rate = min(1.0, sample_bytes / src.approx_bytes)
    for i, doc in enumerate(_documents(src, max_docs)):
        if rate >= 1.0 or unit_hash(seed, i) < rate:
            yield doc


def _log(enabled: bool, msg: str) -> None:
    if enabled:
        print(msg, file=sys.stderr, flush=True)


# --- command line -----------------------------------------------------------------------------


def _size(text: str) -> int:
    """'32000000', '32M', '1.5G', '32e6' -> bytes."""
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:].upper(), 1)
    try:
        return int(float(text[:-1] if mult > 1 else text) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 32M)") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m data.prepare", description=__doc__.split("\n")[0])
    p.add_argument(
        "--source",
        required=True,
        help="pystdlib, a local file/folder/glob (.txt .jsonl .parquet), or a hub name",
    )
    p.add_argument("--out", required=True, help="dataset folder to write")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--tokenizer", default=None, help="reuse this HF tokenizer folder instead")
    p.add_argument("--num-proc", type=int, default=1)
    p.add_argument(
        "--val-fraction",
        type=float,
        default=None,
        help="share of documents held out for validation (default: 0.005, or enough of a small "
        "corpus for about 20 documents, at most 0.1; an existing folder keeps its own)",
    )
    p.add_argument("--max-docs", type=int, default=None)
    p.add_argument("--text-field", default="text", help="jsonl field / parquet or hub column")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--sample-bytes",
        type=_size,
        default=32_000_000,
        help="text used to train the tokenizer (e.g. 32M)",
    )
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS)
    p.add_argument("--dtype", default="auto", choices=["auto", "uint16", "uint32"])
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    chat = p.add_argument_group("chat and instruction JSONL (needs --tokenizer)")
    chat.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="read SOURCE as chat data (default: when its first JSONL row has a chat shape)",
    )
    chat.add_argument("--chat-template", default=None, help="a Jinja chat template file")
    chat.add_argument(
        "--val-source", default=None, help="JSONL of the validation split (else --val-fraction)"
    )
    chat.add_argument(
        "--train-on",
        default="assistant",
        choices=["assistant", "completion", "all"],
        help="tokens the loss trains on: every assistant turn, the last one, or all",
    )
    chat.add_argument(
        "--seq-len", type=int, default=2048, help="longest example: seq_len + 1 tokens"
    )
    chat.add_argument(
        "--too-long",
        default="truncate",
        choices=["truncate", "drop"],
        help="what becomes of a longer example",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    try:
        out = prepare(
            a.source,
            a.out,
            vocab_size=a.vocab_size,
            tokenizer=a.tokenizer,
            num_proc=a.num_proc,
            val_fraction=a.val_fraction,
            max_docs=a.max_docs,
            text_field=a.text_field,
            seed=a.seed,
            sample_bytes=a.sample_bytes,
            shard_tokens=a.shard_tokens,
            dtype=a.dtype,
            progress=not a.quiet,
            chat=a.chat,
            chat_template=a.chat_template,
            train_on=a.train_on,
            seq_len=a.seq_len,
            too_long=a.too_long,
            val_source=a.val_source,
        )
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


class _CallableModule(types.ModuleType):
    """`data.prepare` is this module and also a function: `from data import prepare` then
    `prepare(source, out)` works whichever of the two `data.prepare` names at that moment."""

    def __call__(self, *args: Any, **kwargs: Any) -> Path:
        return prepare(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
