"""The README and docs/ hold together: every relative link resolves (file and heading), every
raw result they cite exists, the README stays a short front door, and the product speaks of
the software, never of how it was made."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REPO

README_MAX_LINES = 250
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
RESULT = re.compile(r"benchmarks/results/[A-Za-z0-9_./*-]*[A-Za-z0-9_/*-]")
# Words about the project's own making, not about the software.
MAKING = re.compile(r"\bissue [0-9]+|\bissue[0-9]+|\breporter\b|\bthe lead\b|\bsessions?\b", re.I)
# Rewritten elsewhere; checked once they land.
NOT_YET: set[str] = set()


def docs() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def dead_links(path: Path, text: str | None = None) -> list[str]:
    """Each relative link in `text` (default: the file's) that names no file, or no heading of
    the Markdown file it points into."""
    text = path.read_text() if text is None else text
    dead = []
    for target in LINK.findall(re.sub(r"```.*?```", "", text, flags=re.S)):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            dead.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            dead.append(target)
    return dead


def missing_results(text: str) -> list[str]:
    """Each benchmarks/results/... path cited in `text` that is not in the repo."""
    return [p for p in RESULT.findall(text) if not list(REPO.glob(p))]


def making_words(text: str) -> list[str]:
    return [m.group(0) for m in MAKING.finditer(text)]


@pytest.mark.parametrize("path", docs(), ids=lambda p: p.name)
def test_links_resolve(path):
    assert not dead_links(path), f"{path.name}: dead links {dead_links(path)}"


@pytest.mark.parametrize("path", docs(), ids=lambda p: p.name)
def test_cited_results_exist(path):
    missing = missing_results(path.read_text())
    assert not missing, f"{path.name} cites results that are not there: {missing}"


def test_index_maps_every_doc():
    listed = set(LINK.findall((REPO / "docs" / "index.md").read_text()))
    unlisted = [p.name for p in docs()[1:] if p.name != "index.md" and p.name not in listed]
    assert not unlisted, f"docs/index.md does not list {unlisted}"


def test_readme_is_a_short_front_door():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md is {len(lines)} lines"


def test_no_words_about_the_making():
    files = [p for p in docs() if p.name not in NOT_YET]
    files += sorted((REPO / "ds_configs").glob("*.json"))
    found = {p.name: making_words(p.read_text()) for p in files}
    assert not {k: v for k, v in found.items() if v}, found


def test_the_checks_catch_what_they_look_for(tmp_path):
    """Each checker finds a planted fault, so a passing run means something."""
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## A `flag` section\n")
    page.write_text(
        "[ok](other.md) [ok](other.md#a-flag-section) [web](https://example.com) [self](#top)\n"
        "[gone](missing.md) [bad anchor](other.md#nowhere)\n```\n[in code](ignored.md)\n```\n# Top\n"
    )
    assert dead_links(page) == ["missing.md", "other.md#nowhere"]
    assert missing_results("raw: benchmarks/results/scale.json and benchmarks/results/gone.json.")
    assert missing_results("benchmarks/results/scale.json, benchmarks/results/host_class/") == []
    assert making_words("as the issue 12 reporter said, the lead's session") == [
        "issue 12",
        "reporter",
        "the lead",
        "session",
    ]
    assert making_words("the sessionless reissue 5 of a leader") == []
