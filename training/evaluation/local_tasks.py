"""The shipped local tasks: lm-eval task YAML (tasks/*.yaml beside this file) over JSONL made
here from held-out documents of the built-in corpus `pystdlib`, so evaluation runs offline.

- `pystdlib_continuation` (multiple choice, 4 choices, chance 0.25): the first lines of a
  function; which of four continuations is its real next lines (the others: those lines with
  their words shuffled, twice, and the same lines of another held-out function).
- `pystdlib_docstring_code` (rolling loglikelihood): documented functions (signature, docstring
  and their first lines of code), scored as bits per byte, byte and word perplexity.

Held out means: the documents the data preparation puts in the validation split
(data/shards.py `split_of`) for the run's own data folder when it was prepared from pystdlib,
else for the default preparation (`--val-fraction` auto, seed 0: about 20 documents), so no run
trained on pystdlib with those settings has seen them.
"""

from __future__ import annotations

import ast
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
LOCAL_TASKS = ("pystdlib_continuation", "pystdlib_docstring_code")
CONTEXT_LINES, CONTINUATION_LINES, CHOICES = 3, 2, 4
MAX_ITEMS = 200  # per task: enough for a steady score, a minute on a CPU for a small model


@dataclass(frozen=True)
class HeldOut:
    """Which pystdlib documents are held out: those `split_of(i, val_fraction, seed)` puts in
    validation among the first `max_docs` (None: all)."""

    val_fraction: float | None = None  # None: what `data.prepare` picks for pystdlib by default
    seed: int = 0
    max_docs: int | None = None

    @property
    def fraction(self) -> float:
        if self.val_fraction is not None:
            return self.val_fraction
        from data.shards import auto_val_fraction
        from data.sources import resolve_source

        docs = len(resolve_source("pystdlib").files)
        return auto_val_fraction(min(docs, self.max_docs) if self.max_docs else docs)

    @classmethod
    def of_data(cls, data_dir: str | Path | None) -> HeldOut:
        """The held-out documents of a prepared data folder if it was prepared from pystdlib
        (its manifest's arguments), else the default preparation's."""
        try:
            args = json.loads((Path(data_dir) / "manifest.json").read_text())["args"]
        except (TypeError, OSError, ValueError, KeyError):
            return cls()
        if args.get("source") != "pystdlib" or not args.get("val_fraction"):
            return cls()
        return cls(args["val_fraction"], args.get("seed", 0), args.get("max_docs"))


def heldout_documents(held: HeldOut) -> list[str]:
    """The held-out pystdlib documents, in corpus order."""
    from data.shards import split_of
    from data.sources import resolve_source

    docs, fraction = [], held.fraction
    for i, doc in enumerate(resolve_source("pystdlib").documents()):
        if held.max_docs is not None and i >= held.max_docs:
            break
        if split_of(i, fraction, held.seed):
            docs.append(doc)
    return docs


def functions(doc: str) -> list[tuple[list[str], int]]:
    """Every function of a document as (its source lines dedented, the line after its
    docstring, 0 when it has none); functions too short to cut are left out."""
    try:
        tree = ast.parse(doc)
    except (SyntaxError, ValueError):
        return []
    lines = doc.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.decorator_list:
            continue
        src = [line for line in lines[node.lineno - 1 : node.end_lineno] if line.strip()]
        indent = src[0][: len(src[0]) - len(src[0].lstrip())]
        if not all(line.startswith(indent) for line in src):
            continue  # a string or continuation line left of the def: not cut cleanly
        src = [line[len(indent) :] for line in src]
        if len(src) < CONTEXT_LINES + CONTINUATION_LINES:
            continue
        body0 = node.body[0]
        doc_end = 0
        if isinstance(body0, ast.Expr) and isinstance(getattr(body0, "value", None), ast.Constant):
            if isinstance(body0.value.value, str) and len(node.body) > 1:
                doc_end = len([x for x in lines[node.lineno - 1 : body0.end_lineno] if x.strip()])
        out.append((src, doc_end))
    return out


def shuffled(text: str, rng: random.Random) -> str:
    """`text` with its words (runs of letters, digits and _) in a random order, everything
    between them left in place: the same bytes, nearly the same tokens, so a model can tell it
    from the real text only by what it learned of code."""
    parts = re.split(r"(\w+)", text)
    words = parts[1::2]
    rng.shuffle(words)
    parts[1::2] = words
    return "".join(parts)


def continuation_items(funcs: list[tuple[list[str], int]], rng: random.Random) -> list[dict]:
    """Multiple-choice items: the first CONTEXT_LINES lines of a function; as choices its real
    next CONTINUATION_LINES lines, two copies of them with their words shuffled, and the same
    lines of another function."""
    cut = CONTEXT_LINES + CONTINUATION_LINES
    conts = ["\n".join(src[CONTEXT_LINES:cut]) + "\n" for src, _ in funcs]
    items = []
    for k, (src, _) in enumerate(funcs):
        real = conts[k]
        fakes = {shuffled(real, rng) for _ in range(8)} - {real}
        others = sorted({c for c in conts if c != real} - fakes)
        if len(fakes) < CHOICES - 2 or not others:
            continue
        choices = [*rng.sample(sorted(fakes), CHOICES - 2), rng.choice(others)]
        label = rng.randrange(CHOICES)
        choices.insert(label, real)
        items.append(
            {"context": "\n".join(src[:CONTEXT_LINES]) + "\n", "choices": choices, "label": label}
        )
    return items


def documented_functions(funcs: list[tuple[list[str], int]]) -> list[dict]:
    """Loglikelihood items: each documented function's signature, docstring and next
    CONTINUATION_LINES + 1 lines of code, as one text."""
    items = []
    for src, doc_end in funcs:
        if doc_end and doc_end < len(src):
            items.append({"text": "\n".join(src[: doc_end + CONTINUATION_LINES + 1]) + "\n"})
    return items


def write_local_tasks(folder: Path, held: HeldOut, max_items: int = MAX_ITEMS) -> Path:
    """Write the shipped tasks' JSONL and YAML (data paths made absolute) into `folder`; returns
    it, ready as an lm-eval include path."""
    funcs = [f for doc in heldout_documents(held) for f in functions(doc)]
    rng = random.Random(0)
    data = {
        "pystdlib_continuation": continuation_items(funcs, rng),
        "pystdlib_docstring_code": documented_functions(funcs),
    }
    folder.mkdir(parents=True, exist_ok=True)
    for name, items in data.items():
        items = random.Random(1).sample(items, min(max_items, len(items)))
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(x) + "\n" for x in items))
        yaml = (TASKS_DIR / f"{name}.yaml").read_text()
        (folder / f"{name}.yaml").write_text(yaml.replace(f"{name}.jsonl", str(path)))
    return folder
