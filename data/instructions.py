"""An instruction set from Python source, for a fine-tuning job that runs offline: each
documented function's signature and docstring is the prompt, its body the completion.

    python -m data.instructions --source pystdlib --out data_cache/pyfuncs

writes OUT/train.jsonl and OUT/val.jsonl in the {"prompt", "completion"} shape (data/chat.py).
A whole file goes to one of the two (shards.split_of over files), so no function of a
validation file is seen in training, nor any of its neighbours.

    python -m data.instructions --source pystdlib --out data_cache/pyprefs --pairs

writes preference pairs instead (data/preference.py): the same prompt, the function's own body
as "chosen" and the body of the next documented function of the same file as "rejected" (real
code of the same style and module, but not what the docstring asks for).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from data.manifest import DataError
from data.shards import split_of
from data.sources import read_python, resolve_source


def functions(text: str, max_chars: int) -> Iterator[dict[str, str]]:
    """{"prompt": def line(s) and docstring, "completion": the rest of the body} of every
    function with a docstring and a body after it, both dedented to the def, together at most
    `max_chars` long."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):  # a few standard library files are broken on purpose
        return
    lines = text.splitlines(keepends=True)
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if ast.get_docstring(node) is None or len(node.body) < 2:
            continue
        indent = node.col_offset
        cut = node.body[0].end_lineno  # the docstring's last line

        def dedent(part: list[str], indent: int = indent) -> str:
            return "".join(ln[indent:] if ln[:indent].isspace() else ln for ln in part)

        prompt = dedent(lines[node.lineno - 1 : cut])
        completion = dedent(lines[cut : node.end_lineno])
        if completion.strip() and len(prompt) + len(completion) <= max_chars:
            yield {"prompt": prompt, "completion": completion}


def preference_pairs(rows: list[dict[str, str]]) -> Iterator[dict[str, str]]:
    """One file's functions -> {"prompt", "chosen": its body, "rejected": the next function's
    body} for each whose neighbour's body differs (a file with one function gives none)."""
    for k, row in enumerate(rows):
        other = rows[(k + 1) % len(rows)]["completion"]
        if len(rows) > 1 and other != row["completion"]:
            yield {"prompt": row["prompt"], "chosen": row["completion"], "rejected": other}


def build(
    source: str,
    out: str | Path,
    *,
    val_fraction: float = 0.05,
    seed: int = 0,
    max_chars: int = 1500,
    pairs: bool = False,
) -> dict[str, int]:
    """Write OUT/train.jsonl and OUT/val.jsonl from SOURCE ('pystdlib' or local .py files);
    return how many examples (`pairs`: preference pairs) each holds."""
    src = resolve_source(source) if source == "pystdlib" else None
    files = list(src.files) if src else sorted(Path(source).rglob("*.py"))
    if not files:
        raise DataError(f"no Python files in {source}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    counts = {"train": 0, "val": 0}
    with open(out / "train.jsonl", "w") as train, open(out / "val.jsonl", "w") as val:
        for i, path in enumerate(files):
            name = "val" if split_of(i, val_fraction, seed) else "train"
            rows = list(functions(read_python(path), max_chars))
            for row in preference_pairs(rows) if pairs else rows:
                (val if name == "val" else train).write(json.dumps(row) + "\n")
                counts[name] += 1
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m data.instructions", description=__doc__.split("\n")[0]
    )
    p.add_argument("--source", default="pystdlib", help="pystdlib, or a folder of .py files")
    p.add_argument("--out", required=True, help="folder for train.jsonl and val.jsonl")
    p.add_argument("--val-fraction", type=float, default=0.05, help="of the files")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-chars", type=int, default=1500, help="longest example kept")
    p.add_argument(
        "--pairs", action="store_true", help="preference pairs: chosen and rejected bodies"
    )
    a = p.parse_args(argv)
    try:
        counts = build(
            a.source,
            a.out,
            val_fraction=a.val_fraction,
            seed=a.seed,
            max_chars=a.max_chars,
            pairs=a.pairs,
        )
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    what = "pairs" if a.pairs else "examples"
    print(f"{a.out}: {counts['train']} training and {counts['val']} validation {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
