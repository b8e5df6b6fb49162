"""Tokenizers: train a SentencePiece BPE tokenizer and save it in Hugging Face form, or reuse one.

The SentencePiece model is converted to a `tokenizers` BPE (same vocab, merges in score order,
byte fallback) and saved with `save_pretrained`, so stock `AutoTokenizer.from_pretrained(dir)`
loads it. prepare encodes with that same saved tokenizer.json, so the trainer's tokenizer and
the stored token ids cannot disagree. Normalisation is off so any text round-trips exactly.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from data.manifest import DataError

UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
SP_MODEL = "sentencepiece.model"  # kept for reference; AutoTokenizer reads tokenizer.json
_SPACE = "\u2581"  # SentencePiece's visible space; the converted vocabulary uses " " instead
# SentencePiece (split_by_whitespace + allow_whitespace_only_pieces) trains on "words" that are a
# run of spaces followed by non-spaces; no vocabulary piece crosses such a boundary, so splitting
# the same way before BPE gives the same ids and lets `tokenizers` cache words (much faster).
_WORD = " *[^ ]+| +"
_CHUNK_CHARS = 4000  # SentencePiece skips "sentences" longer than max_sentence_length


def train_tokenizer(
    docs: Iterable[str],
    vocab_size: int,
    out_dir: str | os.PathLike,
    *,
    sample_bytes: int = 32_000_000,
) -> Path:
    """Train a SentencePiece BPE (byte fallback) on at most `sample_bytes` of `docs`; save to out_dir.

    Returns out_dir, which then holds tokenizer.json + tokenizer_config.json (AutoTokenizer) and
    the SentencePiece model. Ids: <unk>=0, <s>=1, </s>=2 (EOS, separates documents), <pad>=3.
    """
    import sentencepiece as spm

    if vocab_size < 300:
        raise DataError(f"vocab size {vocab_size} is too small: at least 300 (256 byte pieces + 4)")
    sentences = list(_sentences(docs, sample_bytes))
    if not sentences:
        raise DataError("empty corpus: no text to train the tokenizer on")
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=model,
            model_type="bpe",
            vocab_size=vocab_size,
            # Exact round-trip of any text (code included): no normalisation, no dummy prefix,
            # keep runs of spaces, bytes for characters outside the vocabulary.
            normalization_rule_name="identity",
            add_dummy_prefix=False,
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            byte_fallback=True,
            character_coverage=0.9995,
            max_sentence_length=4 * _CHUNK_CHARS + 16,  # bytes; chunks are <= _CHUNK_CHARS chars
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=3,
            unk_piece=UNK,
            bos_piece=BOS,
            eos_piece=EOS,
            pad_piece=PAD,
            num_threads=1,  # its output depends on the thread count; ours must not
            minloglevel=2,
        )
    except RuntimeError as e:
        raise DataError(
            f"SentencePiece could not train a {vocab_size}-token vocabulary on "
            f"{sum(map(len, sentences))} characters: {str(e).strip().splitlines()[-1]}; "
            "lower --vocab-size or raise --sample-bytes"
        ) from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / SP_MODEL).write_bytes(model.getvalue())
    save_hf_tokenizer(sp_to_tokenizers(model.getvalue()), out)
    return out


def _sentences(docs: Iterable[str], sample_bytes: int) -> Iterator[str]:
    """Cut documents into chunks at line ends (SentencePiece trains on short 'sentences')."""
    seen = 0
    for doc in docs:
        start = 0
        while start < len(doc):
            end = min(len(doc), start + _CHUNK_CHARS)
            if end < len(doc):
                cut = doc.rfind("\n", start, end)
                end = cut + 1 if cut > start else end
            yield doc[start:end]
            start = end
        seen += len(doc.encode("utf-8"))
        if seen >= sample_bytes:
            return


def sp_to_tokenizers(model_proto: bytes) -> Any:
    """Convert a SentencePiece BPE model (bytes) to an equivalent `tokenizers.Tokenizer`."""
    from sentencepiece import sentencepiece_model_pb2 as pb
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    proto = pb.ModelProto()
    proto.ParseFromString(model_proto)
    normal = 1  # ModelProto.SentencePiece.Type.NORMAL
    pieces = [p.piece for p in proto.pieces]
    vocab = {p: i for i, p in enumerate(pieces)}
    kind = [p.type for p in proto.pieces]
    # SentencePiece BPE merges the adjacent pair whose result has the highest score, and scores
    # fall with the id; ranking merges by the id of the result reproduces its choices.
    merges = []
    for piece, pid in vocab.items():
        if kind[pid] != normal:
            continue
        pairs = []
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            li, ri = vocab.get(left), vocab.get(right)
            if li is not None and ri is not None and kind[li] == kind[ri] == normal:
                pairs.append((pid, li, ri, left, right))
        merges += sorted(pairs)
    merges.sort()

    # Real spaces in the pieces, not U+2581: then a literal U+2581 in a document is just a rare
    # character (byte fallback) and decodes to itself, where SentencePiece would return a space.
    def plain(piece: str) -> str:
        return piece.replace(_SPACE, " ")

    bpe = models.BPE(
        vocab={plain(p): i for p, i in vocab.items()},
        merges=[(plain(m[3]), plain(m[4])) for m in merges],
        unk_token=UNK,
        byte_fallback=True,
        fuse_unk=True,
    )
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(_WORD), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return tok


def save_hf_tokenizer(tok: Any, out_dir: Path) -> None:
    """Save a `tokenizers.Tokenizer` so AutoTokenizer loads it with our special tokens."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        # A document that contains the text "</s>" must not become an EOS id: treat it as text.
        split_special_tokens=True,
        clean_up_tokenization_spaces=False,
    )
    hf.save_pretrained(str(out_dir))
    # transformers 5 writes its new class name; the old one loads in 5 and in 4.x alike.
    cfg_path = Path(out_dir) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def load_tokenizer(path: str | os.PathLike) -> Any:
    """Load a tokenizer folder, or a hub name (`org/name[@revision]`, through the HF cache, so
    offline once cached), with `transformers.AutoTokenizer` (the trainer's tokenizer). A local
    folder wins over a hub name spelled the same; no repository code is ever run."""
    from transformers import AutoTokenizer

    if is_hub_name(path):
        repo, _, revision = os.fspath(path).partition("@")
        try:
            return AutoTokenizer.from_pretrained(repo, revision=revision or None)
        except (OSError, ValueError) as e:
            raise DataError(
                f"--tokenizer {path}: not a local folder, and the hub or its cache cannot give "
                f"it ({_first_line(e)})"
            ) from None
    path = Path(path)
    if not path.is_dir():
        raise DataError(f"no such tokenizer folder: {path}")
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise DataError(
            f"{path}: not a loadable Hugging Face tokenizer folder ({_first_line(e)})"
        ) from None


def is_hub_name(spec: str | os.PathLike) -> bool:
    """`org/name` or `org/name@revision` that is not a local path (as models/hub.py decides)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    spec = os.fspath(spec)
    if spec.count("/") != 1 or spec.startswith((".", "/", "~")) or Path(spec).exists():
        return False
    try:
        validate_repo_id(spec.partition("@")[0])
    except HFValidationError:
        return False
    return True


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def check_hf_tokenizer(src: str | os.PathLike) -> dict[str, int | None]:
    """Check an existing HF tokenizer (folder or hub name) can be reused (fast, has EOS); return
    its ids."""
    if is_hub_name(src):
        if not load_tokenizer(src).is_fast:
            raise DataError(f"--tokenizer {src}: not a fast tokenizer (it has no tokenizer.json)")
        return _checked_ids(src)
    if not Path(src).is_dir():
        raise DataError(f"no such tokenizer folder: {src}")
    if not (Path(src) / "tokenizer.json").is_file():
        raise DataError(f"{src}: no tokenizer.json there (need a fast HF tokenizer folder)")
    return _checked_ids(src)


def _checked_ids(src: str | os.PathLike) -> dict[str, int | None]:
    ids = special_ids(src)
    if ids["eos_id"] is None:
        raise DataError(f"{src}: tokenizer has no eos_token; documents need an EOS separator")
    return ids


def copy_hf_tokenizer(
    src: str | os.PathLike, out_dir: Path, *, chat_template: str | None = None
) -> None:
    """Reuse an existing HF tokenizer folder: check it, then save a copy into out_dir. With
    `chat_template` (chat data, data/chat.py) the copy carries that template (None: its own)
    and reads special tokens as the template writes them, as `apply_chat_template` does at
    inference; a text corpus's copy reads them as text."""
    check_hf_tokenizer(src)
    tok = load_tokenizer(src)
    chat = chat_template is not None
    if chat:
        tok.chat_template = chat_template
    # same rule as our own tokenizers: document text is text
    tok.split_special_tokens = not chat
    tok.init_kwargs["split_special_tokens"] = not chat
    tok.save_pretrained(str(out_dir))


def encoder(tokenizer_dir: str | os.PathLike) -> Any:
    """The `tokenizers.Tokenizer` prepare encodes with: exactly what AutoTokenizer wraps.

    Encode with `add_special_tokens=False`; special-token text inside documents stays text.
    """
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    tok.encode_special_tokens = True
    return tok


def special_ids(tokenizer_dir: str | os.PathLike) -> dict[str, int | None]:
    """vocab_size (len of the tokenizer, added tokens included) and eos/bos/pad ids."""
    tok = load_tokenizer(tokenizer_dir)
    return {
        "vocab_size": len(tok),
        "eos_id": tok.eos_token_id,
        "bos_id": tok.bos_token_id,
        "pad_id": tok.pad_token_id,
    }
