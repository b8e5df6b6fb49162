"""The compatibility matrix (benchmarks/matrix/): its rules agree with what the trainer refuses,
its pairwise cover holds every pair of values of any two axes, docs/compatibility.md is the
rendering of the committed results with no blank cell, and the cover itself runs as real
multi-rank jobs: every case trains to its 1-rank reference within its bound with its replicas
identical, or is refused in one line that a rule names."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest
from conftest import launch

from benchmarks.host import host_class
from benchmarks.matrix.cases import Matrix, case_id, pairwise
from benchmarks.matrix.render import DOC, RESULTS, render
from benchmarks.matrix.runner import Runner, merge, torchrun
from benchmarks.provenance import today

MATRIX = Matrix.load()
COVER = pairwise(MATRIX)


def test_the_cover_holds_every_pair_of_values_that_can_train_and_one_case_of_each_rule():
    trainable = [c for c in MATRIX.all_cases() if not MATRIX.refusals(c)]
    names = list(MATRIX.axes)

    def pairs(cases):
        return {(a, c[a], b, c[b]) for c in cases for a, b in itertools.combinations(names, 2)}

    assert pairs(trainable) <= pairs([c for c in COVER if not MATRIX.refusals(c)])
    refused = {MATRIX.refusal(c).says for c in COVER if MATRIX.refusals(c)}
    assert refused == {rule.says for rule in MATRIX.rules}
    assert len(COVER) < len(trainable) / 20  # a cover, not the matrix


def test_a_rule_naming_an_unknown_value_is_refused(tmp_path):
    raw = {**MATRIX.raw, "refusals": [{"when": {"layout": "zero9"}, "says": "x"}]}
    path = tmp_path / "matrix.yaml"
    import yaml

    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match="zero9"):
        Matrix.load(path)


def test_the_doc_is_the_rendering_of_the_committed_results_with_no_blank_cell():
    text = render(MATRIX, RESULTS)
    assert DOC.read_text() == text, "run python -m benchmarks.matrix --render"
    assert "not run" not in text and "**bug**" not in text
    cases = json.loads(RESULTS.read_text())["cases"]
    assert {r["outcome"] for r in cases} <= {"match", "refused"}
    assert {r["id"] for r in cases} >= {case_id(c) for c in COVER}


@pytest.fixture(scope="module")
def runner(tiny_data, chat_data, pairs, tmp_path_factory):
    run = Runner(
        MATRIX,
        tmp_path_factory.mktemp("matrix"),
        launch=lambda args, ranks: launch(args, nproc=ranks, check=False),
    )
    run.inputs.made.update({"text": tiny_data, "chat": chat_data, "pairs": pairs["data"]})
    return run


@pytest.mark.slow
@pytest.mark.parametrize("case", COVER, ids=case_id)
def test_each_case_of_the_cover_trains_to_its_reference_or_is_refused(runner, case):
    result = runner.run(case)
    keep = os.environ.get("ZEROSTACK_MATRIX_RESULTS")  # also write the results file there
    if keep:
        merge(Path(keep), [{**result, "launcher": "forked"}], host_class(), today())
    assert result["outcome"] in ("match", "refused"), result
    if result["outcome"] == "match":
        assert result["replicas"] is not None, "the run wrote no replica check"


@pytest.mark.slow
def test_a_refused_case_launched_by_torchrun_is_judged_refused(
    tiny_data, chat_data, pairs, tmp_path
):
    """`python -m benchmarks.matrix` launches under torchrun, which prints a traceback of its
    own (ChildFailedError) whenever a rank fails: a refusal is still a refusal, not a bug."""
    case = next(c for c in COVER if MATRIX.refusals(c) and c["resume"] == "none")
    run = Runner(MATRIX, tmp_path, launch=torchrun)
    run.inputs.made.update({"text": tiny_data, "chat": chat_data, "pairs": pairs["data"]})
    result = run.run(case)
    assert result["outcome"] == "refused", result
