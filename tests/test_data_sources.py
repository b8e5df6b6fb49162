"""Sources: the built-in corpus, local files, the hub path (on local parquet), and bad input."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data import sources
from data.manifest import DataError
from data.sources import iter_documents, iter_hf_dataset, resolve_source

REPO = Path(__file__).resolve().parent.parent
DOCS = ["first document\n", "second\twith tab", "  third, ünïcödé 🐍\n\n", "4"]


def write_corpus(root, docs=DOCS):
    """The same documents as .txt files, one .jsonl and an OpenWebText-schema parquet."""
    (root / "txt").mkdir(parents=True)
    for i, d in enumerate(docs):
        (root / "txt" / f"doc{i:03d}.txt").write_text(d, encoding="utf-8")
    with open(root / "docs.jsonl", "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d, "id": 1}) + "\n")
    # Skylion007/openwebtext's parquet files hold one string column, "text".
    (root / "owt" / "plain_text").mkdir(parents=True)
    table = pa.table({"text": pa.array(docs, pa.string())})
    pq.write_table(table, root / "owt" / "plain_text" / "train-00000-of-00001.parquet")
    return root


def test_pystdlib_is_found_at_run_time_in_stable_order():
    src = resolve_source("pystdlib")
    assert src.kind == "pystdlib" and len(src.files) > 500
    assert not any("site-packages" in f.parts for f in src.files)
    assert src.approx_bytes > 5_000_000  # the real standard library, not a stub
    assert list(src.files) == list(resolve_source("pystdlib").files)
    docs = list(iter_documents("pystdlib", max_docs=5))
    assert len(docs) == 5 and all(isinstance(d, str) and d for d in docs)


def test_txt_jsonl_parquet_folder_and_glob_give_the_same_documents(tmp_path):
    root = write_corpus(tmp_path)
    assert list(iter_documents(str(root / "txt"))) == DOCS
    assert list(iter_documents(str(root / "txt" / "doc*.txt"))) == DOCS
    assert list(iter_documents(str(root / "docs.jsonl"))) == DOCS
    assert list(iter_documents(str(root / "owt"))) == DOCS  # folder of parquet
    assert list(iter_documents(str(root / "txt"), max_docs=2)) == DOCS[:2]


def test_hub_code_path_reads_a_local_dataset_in_openwebtext_schema(tmp_path):
    root = write_corpus(tmp_path)
    # The function a hub name goes through, given a local dataset folder instead of a name.
    assert list(iter_hf_dataset(str(root / "owt"))) == DOCS
    with pytest.raises(DataError, match="no column 'body'"):
        next(iter_hf_dataset(str(root / "owt"), text_field="body"))


def test_text_field_is_configurable(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"content": "a"}\n\n{"content": "b"}\n')
    assert list(iter_documents(str(path), text_field="content")) == ["a", "b"]
    with pytest.raises(DataError, match="no field 'text'.*--text-field"):
        resolve_source(str(path))
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "p.parquet")
    with pytest.raises(DataError, match="no column 'text' \\(columns: body\\)"):
        resolve_source(str(tmp_path / "p.parquet"))


@pytest.mark.parametrize(
    "source, message",
    [
        ("missing/corpus.txt", "no such file or folder: missing/corpus.txt"),
        ("./nothing-here", "no such file or folder"),
        ("nope/*.jsonl", "the glob matches no files"),
        ("pystdlb", "unknown source 'pystdlb'"),
    ],
)
def test_bad_source_is_one_clear_line(source, message):
    with pytest.raises(DataError, match=message) as e:
        resolve_source(source)
    assert "\n" not in str(e.value)


def test_empty_corpus_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty corpus"):
        resolve_source(str(tmp_path / "empty"))
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    with pytest.raises(DataError, match="empty corpus"):
        resolve_source(str(tmp_path / "blank"))


def test_unsupported_file_type(tmp_path):
    (tmp_path / "a.csv").write_text("text\nx\n")
    with pytest.raises(DataError, match="unsupported file type"):
        resolve_source(str(tmp_path / "*.csv"))


def test_hub_name_offline_says_so_and_suggests_a_local_path(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(sources, "_hub_reachable", lambda timeout=3.0: False)
    t = time.perf_counter()
    with pytest.raises(DataError, match="cannot reach the Hugging Face hub.*local") as e:
        resolve_source("Skylion007/openwebtext")
    assert time.perf_counter() - t < 1.0  # an answer now, not after the hub client's retries
    assert "\n" not in str(e.value)


def test_hub_name_in_offline_mode_fails_through_datasets_with_one_line(tmp_path):
    # HF_HUB_OFFLINE is read when the hub client is imported, so this runs the real CLI.
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "data.prepare", "--source", "nobody/no-such-set"]
    p = subprocess.run(
        cmd + ["--out", str(tmp_path / "o")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2
    err = p.stderr.strip()
    assert err.startswith("error: cannot load hub dataset 'nobody/no-such-set'")
    assert "local" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()


def scripted_repo(root, layout):
    """A local copy of a hub dataset repository that publishes a loading script (which datasets
    4+ refuses), with `layout` {relative parquet path: documents} as in refs/convert/parquet."""
    root.mkdir(parents=True)
    (root / f"{root.name}.py").write_text("import datasets  # a loading script\n")
    for rel, docs in layout.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"text": pa.array(docs, pa.string())}), root / rel)
    return root


def test_a_scripted_dataset_is_read_from_its_converted_parquet(tmp_path):
    repo = scripted_repo(
        tmp_path / "openwebtext",
        {
            "plain_text/partial-train/0000.parquet": DOCS[:2],
            "plain_text/partial-train/0001.parquet": DOCS[2:],
            "plain_text/validation/0000.parquet": ["not training text"],
        },
    )
    with pytest.raises(RuntimeError, match="Dataset scripts are no longer supported"):
        next(iter_hf_dataset(str(repo)))  # what datasets 4+ does with it
    src = resolve_source(str(repo))
    assert "converted parquet (2 files, partial" in src.description
    assert list(src.documents()) == DOCS  # the train split only, in file order


def test_a_scripted_dataset_without_a_converted_copy_says_what_to_do(tmp_path):
    bare = scripted_repo(tmp_path / "owt", {})
    with pytest.raises(DataError, match="loading script.*--revision refs/convert/parquet") as e:
        resolve_source(str(bare))
    assert "\n" not in str(e.value)
    two = scripted_repo(
        tmp_path / "two", {"en/train/0.parquet": ["a"], "fr/train/0.parquet": ["b"]}
    )
    with pytest.raises(DataError, match=r"several configs \(en, fr\); pass --source"):
        resolve_source(str(two))


def test_a_folder_of_text_with_a_same_named_py_file_stays_a_corpus(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    (corpus / "corpus.py").write_text("print('not a loading script')\n")
    assert resolve_source(str(corpus)).kind == "files"


def test_a_binary_file_is_not_text(tmp_path):
    (tmp_path / "model.txt").write_bytes(bytes(range(256)) * 40)
    with pytest.raises(DataError, match="model.txt: this is not text") as e:
        resolve_source(str(tmp_path / "model.txt"))
    assert "\n" not in str(e.value)


def test_parquet_size_is_the_text_not_the_compressed_file(tmp_path):
    docs = [f"the same line again, {i}\n" * 200 for i in range(50)]  # compresses ~100x
    pq.write_table(pa.table({"text": docs}), tmp_path / "c.parquet", compression="zstd")
    text = sum(len(d.encode()) for d in docs)
    assert (tmp_path / "c.parquet").stat().st_size < text / 20
    assert abs(resolve_source(str(tmp_path / "c.parquet")).approx_bytes - text) < 0.05 * text
