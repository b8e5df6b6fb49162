"""Where documents come from: the built-in `pystdlib` corpus, local files, or an HF hub dataset.

Every source yields non-empty `str` documents in a stable order. `resolve_source` turns the
user's SOURCE string into a `Source` and fails with one clear line (DataError) before any work.
"""

from __future__ import annotations

import glob
import io
import json
import os
import platform
import re
import socket
import sysconfig
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from data.manifest import DataError

PYSTDLIB = "pystdlib"
LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")
_GLOB_CHARS = re.compile(r"[*?\[]")
# Hub names have an owner: "Skylion007/openwebtext", optionally ":config".
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?$")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
# datasets 4+ refuses loading scripts with this error; the hub keeps a parquet copy of such
# datasets at this revision (CONFIG/SPLIT/NNNN.parquet), which needs no script.
_SCRIPT_ERROR = "Dataset scripts are no longer supported"
CONVERTED_REVISION = "refs/convert/parquet"
_CONVERTED_NOTE = "partial-"  # the converter's split name when it kept only the first 5 GB


@dataclass(frozen=True)
class Source:
    """A resolved SOURCE. kind is 'pystdlib', 'files' or 'hub'; key identifies it in manifests."""

    kind: str
    key: str
    description: str
    text_field: str = "text"
    files: tuple[Path, ...] = ()
    approx_bytes: int | None = None  # bytes of text (UTF-8), when knowable cheaply
    data_files: tuple[str, ...] = ()  # a scripted dataset's converted parquet files

    def documents(self) -> Iterator[str]:
        """Yield every non-empty document, in a stable order."""
        if self.kind == "pystdlib":
            docs = map(read_python, self.files)
        elif self.kind == "files":
            docs = (d for f in self.files for d in _read_local(f, self.text_field))
        elif self.data_files:
            docs = iter_hf_dataset("parquet", self.text_field, data_files=list(self.data_files))
        else:
            path, _, config = self.key.partition(":")
            docs = iter_hf_dataset(path, text_field=self.text_field, name=config or None)
        return (d for d in docs if d)


def iter_documents(
    source: str | Source, text_field: str = "text", max_docs: int | None = None
) -> Iterator[str]:
    """Yield the documents (str) of SOURCE: 'pystdlib', a local path/glob or a hub name."""
    src = source if isinstance(source, Source) else resolve_source(source, text_field)
    for i, doc in enumerate(src.documents()):
        if max_docs is not None and i >= max_docs:
            return
        yield doc


def resolve_source(source: str, text_field: str = "text") -> Source:
    """Turn a SOURCE string into a Source, or raise DataError saying what is wrong with it."""
    source = str(source)
    if source == PYSTDLIB:
        return _pystdlib()
    expanded = os.path.expanduser(source)
    if os.path.exists(expanded) or _GLOB_CHARS.search(source):
        return _local(source, expanded, text_field)
    looks_like_path = source.startswith(("/", "./", "../", "~", ".")) or Path(
        source
    ).suffix in LOCAL_SUFFIXES + (".json", ".csv", ".gz")
    if looks_like_path:
        raise DataError(f"no such file or folder: {source}")
    if _HUB_NAME.match(source):
        return _hub(source, text_field)
    raise DataError(
        f"unknown source {source!r}: expected {PYSTDLIB!r}, an existing file, folder or glob "
        f"({', '.join(LOCAL_SUFFIXES)}), or an HF hub dataset name such as Skylion007/openwebtext"
    )


# --- pystdlib ---------------------------------------------------------------------------------


def pystdlib_root() -> Path:
    """The running interpreter's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def _pystdlib() -> Source:
    root = pystdlib_root()
    files: list[Path] = []
    # os.walk with pruning: rglob would also crawl site-packages, which can be huge.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise DataError(f"empty corpus: no .py files under the standard library folder {root}")
    return Source(
        kind="pystdlib",
        key=PYSTDLIB,
        description=f"CPython {platform.python_version()} standard library ({len(files)} files)",
        files=tuple(files),
        approx_bytes=sum(f.stat().st_size for f in files),
    )


def read_python(path: Path) -> str:
    """The file's exact text ("\\r\\n" kept), decoded as its PEP 263 coding cookie says."""
    data = path.read_bytes()
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        return data.decode(encoding)
    except (SyntaxError, UnicodeDecodeError, LookupError):
        return data.decode("utf-8", errors="replace")  # a few test files are broken on purpose


# --- local files ------------------------------------------------------------------------------


def _local(source: str, expanded: str, text_field: str) -> Source:
    if _is_dataset_repo(Path(expanded)):
        # A local copy of a hub dataset repository that holds its loading script: `datasets`
        # decides what it can read, exactly as for the hub.
        path = os.path.abspath(expanded)
        return _dataset(path, path, None, text_field)
    if os.path.isdir(expanded):
        files = sorted(
            p for p in Path(expanded).rglob("*") if p.is_file() and p.suffix in LOCAL_SUFFIXES
        )
        if not files:
            raise DataError(
                f"empty corpus: no {', '.join(LOCAL_SUFFIXES)} files under the folder {source}"
            )
    else:
        matches = sorted(Path(p) for p in glob.glob(expanded, recursive=True))
        files = [p for p in matches if p.is_file()]
        if not files:
            raise DataError(f"no such file or folder: {source} (the glob matches no files)")
        bad = [p for p in files if p.suffix not in LOCAL_SUFFIXES]
        if bad:
            raise DataError(
                f"unsupported file type: {bad[0]} (expected {', '.join(LOCAL_SUFFIXES)})"
            )
    for f in files:
        _check_local(f, text_field)
    if all(f.stat().st_size == 0 for f in files):
        raise DataError(f"empty corpus: every file of {source} is empty ({len(files)} files)")
    key = os.path.abspath(expanded)  # the same files however the path was spelled
    return Source(
        kind="files",
        key=key,
        description=f"{len(files)} local files ({', '.join(sorted({f.suffix for f in files}))})",
        text_field=text_field,
        files=tuple(files),
        approx_bytes=sum(_text_bytes(f, text_field) for f in files),
    )


def _is_dataset_repo(folder: Path) -> bool:
    """FOLDER/FOLDER.py is how `datasets` finds a loading script; a folder that also holds text
    files is a corpus that happens to contain code."""
    if not (folder / f"{folder.name}.py").is_file():
        return False
    return not any(p.suffix in (".txt", ".jsonl") for p in folder.rglob("*"))


def _text_bytes(path: Path, text_field: str) -> int:
    """About how many bytes of text a file holds: its size, or for parquet (compressed) the
    text column's uncompressed size from the footer, less the 4-byte length of each value."""
    if path.suffix != ".parquet":
        return path.stat().st_size
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    col = meta.schema.names.index(text_field)
    total = 0
    for g in range(meta.num_row_groups):
        chunk = meta.row_group(g).column(col)
        total += chunk.total_uncompressed_size - 4 * chunk.num_values
    return max(total, 0)


def _check_text(path: Path) -> None:
    """A .txt file must be text: more than 10% of its first 8000 bytes undecodable as UTF-8 or
    control characters means a binary file (a stray NUL in real text is kept)."""
    with open(path, "rb") as f:
        head = f.read(8000).decode("utf-8", errors="replace")
    bad = sum(c == "\ufffd" or (c < " " and c not in "\t\n\r\f\v\b\x1b") for c in head)
    if bad > 0.1 * len(head):
        raise DataError(
            f"{path}: this is not text ({bad} of its first {len(head)} characters are binary); "
            "remove it from --source"
        )


def _check_local(path: Path, text_field: str) -> None:
    """Cheap up-front check that a file is text or has the text field, so errors come early."""
    if path.suffix == ".txt":
        _check_text(path)
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            names = pq.read_schema(path).names
        except Exception as e:  # pyarrow raises several types for a bad file
            raise DataError(f"{path}: not a readable parquet file ({e})") from None
        if text_field not in names:
            raise DataError(
                f"{path}: no column {text_field!r} (columns: {', '.join(names)}); pass --text-field"
            )
    elif path.suffix == ".jsonl":
        first = next(jsonl_lines(path), None)
        if first is not None:
            row = json_row(first[1], path, first[0])
            if text_field not in row:
                raise DataError(
                    f"{path}: first record has no field {text_field!r} "
                    f"(fields: {', '.join(row)}); pass --text-field"
                )


def jsonl_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of each non-empty line of a JSONL file; DataError naming the line
    that is not UTF-8 (a binary file given as JSONL)."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise DataError(
                    f"{path}:{lineno}: not UTF-8 text (a binary file given as JSONL?)"
                ) from None
            if line.strip():
                yield lineno, line


def json_row(line: str, path: Path, lineno: int) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{lineno}: not valid JSON ({e})") from None
    if not isinstance(row, dict):
        raise DataError(f"{path}:{lineno}: expected a JSON object per line")
    return row


def _read_local(path: Path, text_field: str) -> Iterator[str]:
    if path.suffix == ".txt":
        yield path.read_bytes().decode("utf-8", errors="replace")  # exact: no newline translation
    elif path.suffix == ".jsonl":
        for lineno, line in jsonl_lines(path):
            row = json_row(line, path, lineno)
            if not isinstance(row.get(text_field), str):
                raise DataError(f"{path}:{lineno}: field {text_field!r} missing or not text")
            yield row[text_field]
    else:  # .parquet goes through `datasets`, the same code that reads hub datasets
        yield from iter_hf_dataset("parquet", text_field=text_field, data_files=[str(path)])


# --- HF hub -----------------------------------------------------------------------------------


def iter_hf_dataset(
    path: str,
    text_field: str = "text",
    name: str | None = None,
    data_files: list[str] | None = None,
    split: str = "train",
) -> Iterator[str]:
    """Stream the text field of a `datasets` dataset: a hub name, a local folder or a builder."""
    import datasets

    # Streaming reads record batches lazily, so a 40 GB corpus needs no 40 GB of disk or RAM.
    ds = datasets.load_dataset(path, name, data_files=data_files, split=split, streaming=True)
    features = getattr(ds, "features", None)
    if features is not None and text_field not in features:
        raise DataError(
            f"dataset {path}: no column {text_field!r} (columns: {', '.join(features)}); "
            "pass --text-field"
        )
    for batch in ds.iter(batch_size=256):
        if text_field not in batch:  # streamed json has no schema up front
            raise DataError(
                f"dataset {path}: no field {text_field!r} (fields: {', '.join(batch)}); "
                "pass --text-field"
            )
        yield from batch[text_field]


def _hub(source: str, text_field: str) -> Source:
    name, _, config = source.partition(":")
    if not _hub_offline_mode() and not _hub_reachable():
        raise DataError(
            f"cannot reach the Hugging Face hub to load {name!r} (offline?), and no local path "
            f"{source!r} exists; {_OFFLINE_HINT} (or set HF_HUB_OFFLINE=1 to use a cached copy)"
        )
    return _dataset(source, name, config or None, text_field)


def _dataset(source: str, path: str, config: str | None, text_field: str) -> Source:
    """A `datasets` dataset (hub name or repository folder), streamed; one published with a
    loading script is read from its converted parquet instead (see `_scripted`)."""
    try:
        _first_document(iter_hf_dataset(path, text_field=text_field, name=config), source)
    except RuntimeError as e:
        if _SCRIPT_ERROR not in str(e):
            raise DataError(f"cannot load hub dataset {source!r}: {_first_line(e)}") from None
        return _scripted(source, path, config, text_field)
    return Source(
        kind="hub",
        key=source,
        description=f"HF hub dataset {source} (streamed)",
        text_field=text_field,
    )


_OFFLINE_HINT = (
    "download it where there is network (e.g. the parquet files of the dataset) and pass "
    "the local folder or file as --source"
)


def _first_document(docs: Iterator[str], source: str) -> None:
    """Start the stream, so a dataset that cannot load fails now, in one line."""
    try:
        first = next(docs, None)
    except (DataError, RuntimeError):
        raise
    except Exception as e:  # datasets/hub raise many types; all mean "cannot load it"
        raise DataError(
            f"cannot load hub dataset {source!r}: {_first_line(e)}; {_OFFLINE_HINT}"
        ) from None
    if first is None:
        raise DataError(f"empty corpus: hub dataset {source!r} has no documents")


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _scripted(source: str, repo: str, config: str | None, text_field: str) -> Source:
    """A dataset published with a loading script, which `datasets` 4+ no longer runs: read the
    parquet copy the hub converted it into (revision refs/convert/parquet) instead. `repo` is a
    hub name or a local copy of the repository."""
    files, partial = converted_parquet(repo, config)
    _first_document(iter_hf_dataset("parquet", text_field, data_files=files), source)
    note = ", partial: the hub converted only its first 5 GB" if partial else ""
    return Source(
        kind="hub",
        key=source,
        description=f"{source} as the hub's converted parquet ({len(files)} files{note})",
        text_field=text_field,
        data_files=tuple(files),
    )


def converted_parquet(repo: str, config: str | None, split: str = "train") -> tuple[list, bool]:
    """The parquet files of `split` of a dataset's converted revision, CONFIG/SPLIT/NNNN.parquet
    (SPLIT is 'partial-train' when the hub converted only the first 5 GB), and whether they are
    partial. `repo` is a hub name (listed at revision refs/convert/parquet) or a local folder.
    Raises DataError saying what to do when there is no such copy."""
    hub_id = "OWNER/NAME" if os.path.isdir(repo) else repo
    todo = (
        f"{repo} is published with a loading script, which datasets 4+ no longer runs, and "
        f"{{why}}; download its parquet copy (hf download {hub_id} "
        f"--repo-type dataset --revision {CONVERTED_REVISION} --local-dir DIR) and pass "
        "--source DIR, or install datasets<4 to run the script"
    )
    if os.path.isdir(repo):
        rel = sorted(p.relative_to(repo).as_posix() for p in Path(repo).rglob("*.parquet"))
        prefix = f"{Path(repo)}/"
    else:
        base = f"datasets/{repo}@{CONVERTED_REVISION.replace('/', '%2F')}"
        try:
            from huggingface_hub import HfFileSystem

            found = HfFileSystem().glob(f"{base}/*/*/*.parquet")
        except Exception as e:  # offline, no such revision, no access: all say the same
            raise DataError(
                todo.format(why=f"its converted copy cannot be listed ({_first_line(e)})")
            ) from None
        rel = sorted(f[len(base) + 1 :] for f in found)
        prefix = f"hf://{base}/"
    layout = [r.split("/") for r in rel if r.count("/") == 2]
    configs = sorted({c for c, _, _ in layout})
    if not configs:
        raise DataError(todo.format(why="it holds no converted copy (CONFIG/SPLIT/*.parquet)"))
    named = [c for c in ("default", "plain_text") if c in configs]
    if config is None and len(configs) > 1 and not named:
        raise DataError(
            f"{repo}: its converted parquet has several configs ({', '.join(configs)}); pass "
            f"--source {repo}:CONFIG"
        )
    config = config or (named or configs)[0]
    for name in (split, _CONVERTED_NOTE + split):
        files = [prefix + "/".join(x) for x in layout if x[0] == config and x[1] == name]
        if files:
            return files, name != split
    raise DataError(todo.format(why=f"it holds no {config}/{split}/*.parquet converted copy"))


def _hub_offline_mode() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def _hub_reachable(timeout: float = 3.0) -> bool:
    # One quick TCP connect, so an offline machine gets an answer now, not after retries.
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
        return True
    except OSError:
        return False
