"""Every measured figure in a table of the README or docs/ is drawn from a committed raw result:
it sits inside a section that `python -m benchmarks.docs_tables` writes. A table outside those
sections whose cells read as measurements (tokens/s, times, bytes, percentages, ratios) fails,
naming the file and line, unless it is listed below as arithmetic or a specification. A
measured-looking figure in prose (a speed, a timing, a speed-up, an MFU) must name its raw file
under benchmarks/results/ in the same paragraph, or be listed as no measurement."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import REPO

from benchmarks.docs_tables import SECTIONS

# A number with a unit a benchmark reports: a speed, a time, a size, a share or a ratio (a
# ratio's x written against its number: `2 x h` is a product).
MEASURED = re.compile(
    r"(?<![\w.`/-])[0-9][0-9,]*(\.[0-9]+)?"
    r"(x|%|\s?(tokens/s|[GT]FLOP/s|GB/s|ms|s|min|GiB|MiB|KiB|GB|MB|KB))(?![\w/`])"
)
# A header that names such a unit for the plain numbers of its column.
UNIT_HEADER = re.compile(
    r"tokens/s|FLOP/s|\bMFU\b|\((ms|s|GB|GiB|MiB|MB)\)|\b(GB|GiB|MiB|ms)\b|\bs / step\b"
    r"|\bvs \w|\bseconds\b|\bnoticed after\b",
    re.I,
)
NUMBER = re.compile(r"^[~<>]?-?[0-9][0-9,]*(\.[0-9]+)?$")

# Tables outside the generated sections that hold no measurement: (file, header row) -> why.
# (The per-layer byte formulas of docs/parallelism.md need no entry: they hold no figure.)
NOT_MEASURED = {
    ("docs/bad_inputs.md", "| case | the message says |"): (
        "the exact messages the trainer prints for bad inputs; their numbers are the inputs'"
    ),
    ("docs/gpu.md", "| wheel | size |"): (
        "the sizes of the wheels the GPU image carries, a packaging fact, not a run's figure"
    ),
    ("docs/gpu.md", "| row | what runs | budget s |"): (
        "each GPU check row's time budget, a limit set in benchmarks/gpu_plan.py"
    ),
    ("docs/benchmarks.md", "| arm | how it runs | its numbers, and where they come from |"): (
        "each time-to-loss arm's recipe (learning rates, warmup, schedule): settings, not results"
    ),
    ("docs/settings.md", "| flag | default | `auto` means | read by |"): (
        "what each behaviour switch's `auto` resolves to, a rule of the code"
    ),
}


def _generated(text: str) -> list[tuple[int, int]]:
    """The (start, end) character spans of every generated section in `text`."""
    spans = []
    for s in SECTIONS:
        at = 0
        while (i := text.find(s.begin, at)) >= 0:
            j = text.find(s.finish, i)
            if j < 0:
                break
            spans.append((i, j + len(s.finish)))
            at = j
    return spans


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def measured_tables(text: str) -> list[tuple[int, str]]:
    """(line number, header row) of each Markdown table in `text` outside code blocks and
    generated sections whose cells read as measured figures."""
    spans = _generated(text)
    lines = text.split("\n")
    found, fenced, offset, i = [], False, 0, 0
    starts = []
    for line in lines:
        starts.append(offset)
        offset += len(line) + 1
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            fenced = not fenced
        inside = any(a <= starts[i] < b for a, b in spans)
        is_table = (
            not fenced
            and not inside
            and line.lstrip().startswith("|")
            and i + 1 < len(lines)
            and re.match(r"^\s*\|[\s:|-]*-[\s:|-]*$", lines[i + 1])
        )
        if not is_table:
            i += 1
            continue
        header = _cells(line)
        j = i + 2
        rows = []
        while j < len(lines) and lines[j].lstrip().startswith("|"):
            rows.append(_cells(lines[j]))
            j += 1
        if _looks_measured(header, rows):
            found.append((i + 1, line.strip()))
        i = j
    return found


def _looks_measured(header: list[str], rows: list[list[str]]) -> bool:
    unit_columns = {k for k, h in enumerate(header) if UNIT_HEADER.search(h)}
    for row in rows:
        for k, cell in enumerate(row):
            plain = cell.strip("`*† ")
            if MEASURED.search(plain) or (k in unit_columns and NUMBER.match(plain)):
                return True
    return False


def unrendered(root: Path = REPO) -> list[str]:
    """'file:line: header' for each measured-looking table of the README and docs/ that no
    generated section holds and NOT_MEASURED does not list."""
    out = []
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        rel = path.relative_to(root).as_posix()
        for line, header in measured_tables(path.read_text()):
            if (rel, header) not in NOT_MEASURED:
                out.append(f"{rel}:{line}: {header}")
    return out


def test_every_measured_table_is_drawn_from_a_raw_result():
    """Put the table between the markers of a section of benchmarks/docs_tables.py that draws
    it from its raw file under benchmarks/results/, or take its figures out."""
    assert unrendered() == []


def test_every_listed_exception_still_exists():
    for (rel, header), why in NOT_MEASURED.items():
        assert why
        assert header in [h for _, h in measured_tables((REPO / rel).read_text())], rel


def test_a_measured_table_outside_the_markers_is_named(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# x\n")
    (tmp_path / "docs" / "a.md").write_text(
        "# a\n\nprose\n\n| run | tokens/s |\n|---|---:|\n| zero2 | 4,674 |\n"
    )
    (tmp_path / "docs" / "b.md").write_text("| run | time |\n|---|---|\n| zero2 | 3.1 s |\n")
    assert unrendered(tmp_path) == [
        "docs/a.md:5: | run | tokens/s |",
        "docs/b.md:1: | run | time |",
    ]


def test_tables_inside_markers_code_or_without_figures_pass(tmp_path):
    s = next(s for s in SECTIONS if s.name == "lora")
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        f"{s.begin}\n| run | tokens/s |\n|---|---:|\n| zero2 | 4,674 |\n{s.finish}\n\n"
        "```\n| run | tokens/s |\n|---|---:|\n| zero2 | 4,674 |\n```\n\n"
        "| flag | default |\n|---|---|\n| `--steps` | 1000 |\n| `--lr` | 3e-4 |\n"
    )
    assert unrendered(tmp_path) == []


def test_a_measured_table_planted_in_the_real_docs_fails(tmp_path):
    """A copy of README.md and docs/ passes; the same copy with a hand-written speed table added
    to one page fails, naming that page and line."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text((REPO / "README.md").read_text())
    for path in (REPO / "docs").glob("*.md"):
        (tmp_path / "docs" / path.name).write_text(path.read_text())
    assert unrendered(tmp_path) == []
    page = tmp_path / "docs" / "pipeline.md"
    text = page.read_text()
    page.write_text(text + "\n| run | s / step |\n|---|---:|\n| pp=2, m=8 | 7.97 |\n")
    line = text.count("\n") + 2
    assert f"docs/pipeline.md:{line}: | run | s / step |" in unrendered(tmp_path)


# Prose: a measured-looking figure in a sentence (a speed, a millisecond or fractional-second
# timing, a fractional speed-up such as 1.8x, a share faster or slower, an MFU) must name its raw
# file under benchmarks/results/ in the same paragraph. Whole seconds are left out: in prose they
# are mostly timeouts and intervals set in code.
PROSE_FIGURE = re.compile(
    r"(?<![\w.`/=-])[0-9][0-9,]*(\.[0-9]+)?\s?(tokens/s|tok/s|[GT]FLOP/s|GB/s|ms)(?![\w/`])"
    r"|(?<![\w.`/=-])[0-9]+\.[0-9]+\s?(s|x)(?![\w/`])"
    r"|(?<![\w.`/=-])[0-9][0-9.]*\s?%\s?(faster|slower|MFU)\b"
    r"|\bMFU (of |at )?[0-9][0-9.]*\s?%"
)
RAW_FILE = "benchmarks/results/"

# Prose figures that are no measurement: (file, figure as written) -> why.
NOT_MEASURED_PROSE = {
    ("docs/checkpoints.md", "2.5x"): (
        "the bound on a command's peak memory that tests/test_scale_memory.py holds, and the "
        "arithmetic of one more fp32 copy against it"
    ),
    ("docs/parallelism.md", "450 GB/s"): "NVLink's bandwidth per direction, the vendor's figure",
    ("docs/parallelism.md", "50 GB/s"): "InfiniBand's bandwidth per GPU, the vendor's figure",
    ("docs/parallelism.md", "16 ms"): "bytes over the vendor's NVLink bandwidth: arithmetic",
    ("docs/parallelism.md", "50 ms"): "a micro-batch's FLOPs over a vendor peak: arithmetic",
    ("docs/parallelism.md", "400 TFLOP/s"): "an H100's bf16 rate, the vendor's order of magnitude",
    ("docs/parallelism.md", "150 ms"): "bytes over the vendor's InfiniBand bandwidth: arithmetic",
    ("docs/parallelism.md", "0.8 s"): "bytes over the vendor's InfiniBand bandwidth: arithmetic",
    ("docs/pipeline.md", "1.12x"): "the pipeline bubble's arithmetic: 9 slots for 8 micro-batches",
    ("docs/reliability.md", "0.5 s"): "how often the liveness watchdog checks, set in code",
    ("docs/reliability.md", "0.1 s"): "torchrun's monitor interval, its default",
    ("docs/reliability.md", "2.5 s"): "the roll call's window on a stop signal, set in code",
    ("docs/scale.md", "0.25 s"): "how often the benchmark samples resident memory, set in code",
    ("docs/scale.md", "5 ms"): "how often construction is sampled, set in code",
}


def _prose_paragraphs(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each paragraph of `text` outside code blocks, tables and
    generated sections; a list with no blank line between its items is one paragraph."""
    spans = _generated(text)
    out, lines, fenced, offset, start = [], [], False, 0, 1
    for number, line in enumerate(text.split("\n"), 1):
        at, offset = offset, offset + len(line) + 1
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        skip = fenced or any(a <= at < b for a, b in spans) or line.lstrip().startswith("|")
        if skip or not line.strip():
            if lines:
                out.append((start, "\n".join(lines)))
                lines = []
            continue
        if not lines:
            start = number
        lines.append(line)
    if lines:
        out.append((start, "\n".join(lines)))
    return out


def uncited_prose(root: Path = REPO) -> list[str]:
    """'file:line: figure' for each measured-looking figure in the prose of the README and docs/
    whose paragraph names no file under benchmarks/results/ and NOT_MEASURED_PROSE does not list."""
    out = []
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        rel = path.relative_to(root).as_posix()
        for start, paragraph in _prose_paragraphs(path.read_text()):
            if RAW_FILE in paragraph:
                continue
            for m in PROSE_FIGURE.finditer(paragraph):
                if (rel, m.group(0)) not in NOT_MEASURED_PROSE:
                    line = start + paragraph[: m.start()].count("\n")
                    out.append(f"{rel}:{line}: {m.group(0)}")
    return out


def test_every_measured_figure_in_prose_names_its_raw_file():
    """Name the raw file under benchmarks/results/ in the figure's paragraph (or render it),
    or take the figure out."""
    assert uncited_prose() == []


def test_every_listed_prose_exception_still_exists():
    for (rel, figure), why in NOT_MEASURED_PROSE.items():
        assert why
        found = [m.group(0) for _, p in _prose_paragraphs((REPO / rel).read_text())
                 for m in PROSE_FIGURE.finditer(p)]  # fmt: skip
        assert figure in found, (rel, figure)


def test_a_measured_sentence_planted_in_the_real_docs_fails(tmp_path):
    """A copy of README.md and docs/ passes; the same copy with a speed-up stated in a sentence
    fails, naming the page and line; naming its raw file in the paragraph passes it again."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text((REPO / "README.md").read_text())
    for path in (REPO / "docs").glob("*.md"):
        (tmp_path / "docs" / path.name).write_text(path.read_text())
    assert uncited_prose(tmp_path) == []
    page = tmp_path / "docs" / "pipeline.md"
    text = page.read_text()
    page.write_text(text + "\nThe new schedule ran 1.8x faster, at 4,100 tokens/s.\n")
    line = text.count("\n") + 2
    assert uncited_prose(tmp_path) == [
        f"docs/pipeline.md:{line}: 1.8x",
        f"docs/pipeline.md:{line}: 4,100 tokens/s",
    ]
    page.write_text(text + "\nThe new schedule ran 1.8x faster (benchmarks/results/pp.json).\n")
    assert uncited_prose(tmp_path) == []


def test_prose_figures_in_code_tables_or_markers_pass(tmp_path):
    s = next(s for s in SECTIONS if s.name == "lora")
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        f"{s.begin}\nZeRO-2 ran 1.3x DDP at 12 ms a step.\n{s.finish}\n\n"
        "```\nZeRO-2 ran 1.3x DDP\n```\n\n"
        "A timeout of 30 s, 8 ranks, 2x the memory, 10% of the cores.\n"
    )
    assert uncited_prose(tmp_path) == []
