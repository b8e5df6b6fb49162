"""docs/scale.md's table, drawn from benchmarks/results/scale.json alone: the plan before each
row ran beside today's, the 15% goal judged on held-out rows, MFU only where the stored probes
and load allow it, and rows older than the code they describe said so."""

from __future__ import annotations

import copy
import json
import subprocess

from benchmarks import scale, scale_doc
from benchmarks.provenance import BUSY_SHARE, REPO, changed_parts, code_record, mfu_distrust


def committed() -> dict:
    return json.loads(scale.RESULTS.read_text())


def row_line(table: str, row: str) -> list[str]:
    line = next(x for x in table.splitlines() if x.startswith(f"| `{row}`"))
    return [c.strip() for c in line.strip("|").split(" | ")]


def test_the_table_keeps_the_plan_each_row_had_before_it_ran():
    """The committed rows as they are: each row's plan stored before it ran is drawn beside
    today's, never over it, and each ratio is the row's stored peak over that plan. 2.7B under
    ZeRO-3 on NVMe was measured at 1.41x the plan stored before it ran (the NVMe constants were
    fitted to it afterwards), before rows recorded their code and end-of-run probe; the verdict
    judges the held-out rows only."""
    results = committed()
    now = scale.with_plans(results)
    assert all(now[k]["plan"] == r["plan"] for k, r in results.items())  # never replaced
    table = scale_doc.render(now)
    head = [c.strip() for c in table.splitlines()[0].strip("|").split(" | ")]
    ran = [k for k, r in results.items() if "train" in r]
    assert len(ran) >= 8, ran
    for key in ran:
        cells = dict(zip(head, row_line(table, key)))
        peak = max(results[key]["train"]["peak_rss"])
        before, today = results[key]["plan"], now[key]["plan_now"]
        assert cells["measured / plan before"] == f"{peak / before['per_rank_memory']:.2f}", key
        assert cells["measured / plan now"] == f"{peak / today['per_rank_memory']:.2f}", key
    cells = dict(zip(head, row_line(table, "2.7B:zero3_nvme:1024:ckpt")))
    assert cells["measured / plan before"] == "1.41"
    assert float(cells["measured / plan now"]) < 1.15
    assert "(fitted: NVME_FIXED, NVME_PER_PARAM)" in cells["row"]
    assert "predates the record" in cells["code measured (against today's)"]
    verdict = next(x for x in table.splitlines() if x.startswith("**Measured against the plan"))
    held = verdict.split("held-out rows")[1].split(";")[0]
    assert "2.7B:zero3_nvme" not in held and "`350M:zero2:1024` 1.05x" in held
    # a row without an end-of-run probe: its MFU is not shown, and the table says why
    assert cells["MFU"].startswith("- [") and "no end-of-run ceiling probe stored" in table


def train_row(start: float, end: float | None, other: float, cores: int = 2) -> dict:
    return {
        "mfu": 0.3,
        "ceiling": {"start_per_rank_flops": start, "end_per_rank_flops": end},
        "host": {"cores": cores, "other_cores_busy": other, "loadavg": [0.1, 0.1, 0.1]},
    }


def test_mfu_is_trusted_only_when_the_probes_agree_on_a_quiet_host():
    assert mfu_distrust(train_row(1e11, 1.05e11, 0.1)) is None
    assert "+20%" in mfu_distrust(train_row(1e11, 1.2e11, 0.1))
    assert "-15%" in mfu_distrust(train_row(1e11, 0.85e11, 0.1))
    assert "loaded host" in mfu_distrust(train_row(1e11, 1e11, BUSY_SHARE * 2 + 0.5))
    assert "no end-of-run" in mfu_distrust(train_row(1e11, None, 0.0))
    raised = train_row(1e11, 1e11, 0.0)
    raised["ceiling"]["raised"] = True
    assert "beat the start's ceiling" in mfu_distrust(raised)
    assert "no host load" in mfu_distrust({"ceiling": train_row(1, 1, 0)["ceiling"]})


def test_a_row_says_when_the_code_it_describes_has_changed():
    today = code_record()
    assert today["commit"] and changed_parts(today) == []
    assert changed_parts({**today, "trainer": "0" * 16}) == ["trainer"]
    assert changed_parts(None) is None
    r = copy.deepcopy(committed()["350M:zero2:1024"])
    r["code"] = {**today, "planner": "0" * 16}
    r["train"].update(train_row(1e11, 1.02e11, 0.0))
    table = scale_doc.render({r["row"]: r})
    cells = row_line(table, "350M:zero2:1024")
    assert "older (planner changed)" in table and "30.0%" in cells
    assert "Rows older than the code they describe**: `350M:zero2:1024`" in table
    # and what changed since the row's commit, for the reader to judge (the first commit here)
    first = subprocess.run(
        ["git", "rev-list", "--max-parents=0", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.split()
    if first:
        r["code"]["commit"] = first[0]
        said = scale_doc.render({r["row"]: r})
        assert f"changed since {first[0][:7]}: " in said and "`training/` " in said
