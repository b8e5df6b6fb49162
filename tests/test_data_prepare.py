"""prepare: documents -> tokenizer + shards + manifest; exact, deterministic, reusable, checked."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from data import DataError, TokenDataset, load_manifest, prepare
from data.prepare import main
from data.shards import split_of
from data.sources import read_python, resolve_source

REPO = Path(__file__).resolve().parent.parent
OPTS = dict(vocab_size=512, val_fraction=0.1, seed=3, progress=False)
TRICKY = [
    "def f(x):\n\tif x:\n        return  x\r\n\n\n   \n",
    "naïve café 中文 🎉 \u2581 \x00 </s> <s> spaced    out   ",
    " ",
]


@pytest.fixture(scope="module")
def docs():
    files = resolve_source("pystdlib").files
    code = [read_python(f)[:6000] for f in files[:: max(1, len(files) // 60)][:60]]
    return [d for d in code if d] + TRICKY


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, docs):
    root = tmp_path_factory.mktemp("corpus")
    (root / "txt").mkdir()
    for i, d in enumerate(docs):
        # newline="" so "\r\n" stays as written
        with open(root / "txt" / f"doc{i:04d}.txt", "w", encoding="utf-8", newline="") as f:
            f.write(d)
    with open(root / "docs.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    pq.write_table(pa.table({"text": pa.array(docs, pa.string())}), root / "owt.parquet")
    return root


@pytest.fixture(scope="module")
def out_txt(tmp_path_factory, corpus):
    return prepare(str(corpus / "txt"), tmp_path_factory.mktemp("p") / "txt", **OPTS)


def shard_sums(out):
    m = load_manifest(out)
    return {n: [s.sha256 for s in sp.shards] for n, sp in m.splits.items()}, m.tokenizer_sha256


def test_manifest_counts_documents_tokens_and_bytes(out_txt, docs):
    m = load_manifest(out_txt, verify=True)
    assert (m.format_version, m.vocab_size, m.eos_id, m.dtype) == (1, 512, 2, "uint16")
    is_val = [split_of(i, 0.1, 3) for i in range(len(docs))]
    assert m.splits["val"].documents == sum(is_val) > 0
    assert m.splits["train"].documents + m.splits["val"].documents == len(docs)
    assert m.splits["train"].bytes + m.splits["val"].bytes == sum(len(d.encode()) for d in docs)
    for sp in m.splits.values():
        assert sp.tokens == sum(s.tokens for s in sp.shards)
        assert sp.tokens == sum(int(np.load(out_txt / s.index_file)[-1]) for s in sp.shards)
    assert m.tokenizer_dir == out_txt / "tokenizer"


def test_stored_ids_decode_to_the_documents_and_match_autotokenizer(out_txt, docs):
    tok = AutoTokenizer.from_pretrained(out_txt / "tokenizer")
    sets = {name: TokenDataset(out_txt, name, 16) for name in ("train", "val")}
    seen = {"train": 0, "val": 0}
    for i, text in enumerate(docs):
        name = "val" if split_of(i, 0.1, 3) else "train"
        ids = sets[name].document(seen[name]).tolist()
        seen[name] += 1
        assert tok.decode(ids) == text
        assert tok.encode(text) == ids
    # Documents are joined by EOS in the stream the reader windows over.
    stream = sets["train"].tokens(0, sets["train"].num_tokens)
    assert (stream == 2).sum() == seen["train"] and stream[-1] == 2


def test_parquet_in_openwebtext_schema_gives_the_same_shards_as_txt(out_txt, corpus, tmp_path):
    out = prepare(str(corpus / "owt.parquet"), tmp_path / "pq", **OPTS)
    assert shard_sums(out) == shard_sums(out_txt)


def test_cli_on_jsonl_gives_the_same_shards_as_txt(out_txt, corpus, tmp_path):
    cmd = [sys.executable, "-m", "data.prepare", "--source", str(corpus / "docs.jsonl")]
    cmd += ["--out", str(tmp_path / "js"), "--vocab-size", "512", "--val-fraction", "0.1"]
    p = subprocess.run(cmd + ["--seed", "3", "--quiet"], cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == str(tmp_path / "js")
    assert "Warning" not in p.stderr
    assert shard_sums(tmp_path / "js") == shard_sums(out_txt)


def test_two_processes_and_small_shards_give_the_same_token_stream(out_txt, corpus, tmp_path):
    out = prepare(str(corpus / "txt"), tmp_path / "np2", num_proc=2, **OPTS)
    assert shard_sums(out) == shard_sums(out_txt)
    small = prepare(str(corpus / "txt"), tmp_path / "small", shard_tokens=2000, **OPTS)
    assert len(load_manifest(small).splits["train"].shards) > 3
    a, b = TokenDataset(out_txt, "train", 64), TokenDataset(small, "train", 64)
    assert len(a) == len(b)
    assert np.array_equal(a.tokens(0, a.num_tokens), b.tokens(0, b.num_tokens))
    assert all(np.array_equal(a[i], b[i]) for i in range(len(a)))


def test_reusing_an_hf_tokenizer_folder(out_txt, corpus, tmp_path):
    out = prepare(str(corpus / "txt"), tmp_path / "re", tokenizer=out_txt / "tokenizer", **OPTS)
    assert shard_sums(out)[0] == shard_sums(out_txt)[0]


def test_rerun_with_same_arguments_reuses_the_folder(out_txt, corpus):
    before = {p: p.stat().st_mtime_ns for p in out_txt.rglob("*")}
    assert prepare(str(corpus / "txt"), out_txt, **OPTS) == out_txt
    assert {p: p.stat().st_mtime_ns for p in out_txt.rglob("*")} == before
    with pytest.raises(DataError, match="other arguments \\(seed differ\\)"):
        prepare(str(corpus / "txt"), out_txt, **{**OPTS, "seed": 4})


def test_out_folder_that_is_not_a_dataset_is_left_alone(corpus, tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="not a prepared dataset"):
        prepare(str(corpus / "txt"), tmp_path / "busy", **OPTS)
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"


def test_vocab_too_large_for_the_dtype_fails_before_any_work(corpus, tmp_path):
    with pytest.raises(DataError, match="does not fit in uint16"):
        prepare(str(corpus / "txt"), tmp_path / "o", vocab_size=70000, dtype="uint16")
    assert list(tmp_path.iterdir()) == []


def test_corpus_of_empty_documents_and_missing_tokenizer_fail_before_any_work(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"text": ""}\n{"text": ""}\n')
    with pytest.raises(DataError, match="empty corpus"):
        prepare(str(tmp_path / "c.jsonl"), tmp_path / "o", **OPTS)
    with pytest.raises(DataError, match="no such tokenizer folder"):
        prepare(str(tmp_path / "c.jsonl"), tmp_path / "o", tokenizer=tmp_path / "t", **OPTS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


def test_cli_bad_input_is_one_line(tmp_path, capsys):
    assert main(["--source", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: no such file or folder: {tmp_path / 'missing'}\n"


def test_shard_checks_length_always_and_checksum_on_verify(out_txt, tmp_path):
    import shutil

    copy = Path(shutil.copytree(out_txt, tmp_path / "copy"))
    shard = copy / load_manifest(copy).splits["train"].shards[0].file
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    load_manifest(copy)  # same length: only the checksum can tell
    with pytest.raises(DataError, match=f"{shard}: sha256 does not match"):
        load_manifest(copy, verify=True)
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(DataError, match=f"{shard}: .* bytes, the manifest says"):
        TokenDataset(copy, "train", 16)
    (copy / "manifest.json").unlink()
    with pytest.raises(DataError, match="manifest.json is missing"):
        load_manifest(copy)
    with pytest.raises(DataError, match="no such dataset folder"):
        load_manifest(tmp_path / "nowhere")


def test_a_killed_run_leaves_no_dataset(corpus, tmp_path, monkeypatch):
    import data.prepare as dp

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(dp, "write_manifest", boom)
    with pytest.raises(KeyboardInterrupt):
        prepare(str(corpus / "txt"), tmp_path / "o", **OPTS)
    assert list(tmp_path.iterdir()) == []
    assert os.listdir(tmp_path) == []


def test_a_small_validation_split_is_flagged_even_when_quiet(out_txt, corpus, tmp_path, capsys):
    small = prepare(
        str(corpus / "txt"), tmp_path / "s", tokenizer=out_txt / "tokenizer", progress=False
    )  # ~60 documents at the default 0.5%: one validation document
    err = capsys.readouterr().err
    assert "small-sample figures" in err and "--val-fraction 0.3" in err, err
    assert load_manifest(small).splits["val"].documents < 20
    prepare(str(corpus / "txt"), tmp_path / "ok", **{**OPTS, "val_fraction": 0.4})
    assert "small-sample" not in capsys.readouterr().err


def test_the_default_split_holds_about_20_documents_of_a_small_corpus():
    from data.shards import auto_val_fraction, split_of

    for n in (100, 300, 1790, 4000, 10**6):
        f = auto_val_fraction(n)
        held = sum(split_of(i, f, 0) for i in range(n))
        assert held >= min(20, n * 0.1) and f <= 0.1, (n, f, held)
        assert f == 0.005 or held <= 22, (n, f, held)  # a large corpus keeps 0.5%
    assert auto_val_fraction(None) == 0.005  # a stream of unknown length


def test_the_built_in_corpus_by_default_validates_on_20_documents_and_an_old_split_stays(
    out_txt, tmp_path, capsys
):
    tok = {"tokenizer": out_txt / "tokenizer", "progress": False, "max_docs": 300}
    new = prepare("pystdlib", tmp_path / "new", **tok)
    assert load_manifest(new).splits["val"].documents >= 20
    assert "small-sample" not in capsys.readouterr().err
    old = prepare("pystdlib", tmp_path / "old", **tok, val_fraction=0.005)  # the former default
    before = load_manifest(old).splits["val"].documents
    assert prepare("pystdlib", old, **tok) == old  # no --val-fraction: reused as it is
    assert load_manifest(old).splits["val"].documents == before < 20
