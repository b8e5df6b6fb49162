"""The trained tokenizer: exact round-trip of any text, and AutoTokenizer == what prepare uses."""

import pytest
import sentencepiece as spm
from transformers import AutoTokenizer

from data.manifest import DataError
from data.sources import read_python, resolve_source
from data.tokenizer import encoder, load_tokenizer, train_tokenizer

TRICKY = [
    "def f(x):\n\tif x:\n        return  x\n\n\n   \n",
    "  leading spaces, trailing spaces   ",
    "    ",
    "\n",
    "a\r\nb\rc\x0cd\x00e\x1b[0m",
    "naïve café, Straße, Ελληνικά, русский, 中文字符, 日本語, 한국어, emoji 🎉🐍 and \u200b zero width",
    "text with special-token strings </s> <s> <pad> <unk> inside",
    "\u2581 the SentencePiece space symbol itself, ▁▁ twice",
    "digits 1234567890 3.14159 0xDEADBEEF",
    "\t\t\tindent with tabs\n\t\t\t\n",
    "x" * 3000 + " " * 50 + "y",
]


@pytest.fixture(scope="module")
def code_docs():
    files = resolve_source("pystdlib").files
    return [read_python(f)[:8000] for f in files[:: max(1, len(files) // 80)][:80]]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, code_docs):
    return train_tokenizer(code_docs, 512, tmp_path_factory.mktemp("tok"), sample_bytes=10**6)


def test_saved_folder_loads_with_stock_autotokenizer(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    assert len(tok) == 512
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2, 3)
    assert tok.eos_token == "</s>"


@pytest.mark.parametrize("text", TRICKY)
def test_any_text_round_trips_exactly(tok_dir, text):
    tok = load_tokenizer(tok_dir)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert encoder(tok_dir).decode(ids, skip_special_tokens=False) == text


def test_autotokenizer_encodes_like_prepare_and_sentencepiece(tok_dir, code_docs):
    auto = AutoTokenizer.from_pretrained(tok_dir)
    prep = encoder(tok_dir)
    sp = spm.SentencePieceProcessor(model_file=str(tok_dir / "sentencepiece.model"))
    for text in code_docs + TRICKY:
        ids = prep.encode(text, add_special_tokens=False).ids
        assert auto.encode(text) == ids
        assert auto(text)["input_ids"] == ids
        if "\u2581" not in text:  # SentencePiece reads a literal U+2581 as a space; we do not
            assert sp.encode(text) == ids  # the converted tokenizer is the SentencePiece model


def test_special_token_text_in_a_document_is_not_a_control_token(tok_dir):
    ids = load_tokenizer(tok_dir).encode("a </s> b <s>")
    assert not {0, 1, 2, 3} & set(ids)


def test_byte_fallback_covers_unseen_characters(tok_dir):
    tok = load_tokenizer(tok_dir)
    ids = tok.encode("𝔘𝔫𝔦𝔠𝔬𝔡𝔢")
    assert tok.unk_token_id not in ids
    assert all(tok.convert_ids_to_tokens(i).startswith("<0x") for i in ids)


def test_vocab_too_large_for_the_sample_is_one_clear_error(tmp_path):
    with pytest.raises(DataError, match="vocab-size"):
        train_tokenizer(["tiny corpus"] * 3, 5000, tmp_path / "t")


def test_empty_sample_and_tiny_vocab_are_errors(tmp_path):
    with pytest.raises(DataError, match="empty corpus"):
        train_tokenizer([], 512, tmp_path / "t")
    with pytest.raises(DataError, match="too small"):
        train_tokenizer(["x"], 100, tmp_path / "t")


def test_load_tokenizer_missing_folder(tmp_path):
    with pytest.raises(DataError, match="no such tokenizer folder"):
        load_tokenizer(tmp_path / "nope")
