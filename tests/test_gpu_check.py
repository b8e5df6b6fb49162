"""The GPU check (benchmarks/gpu_check.py, gpu_plan.py) as far as a CPU can take it: its plan parses with the
trainer's own parser and fits its deadline, a failing row stops no other, the table renders, one
row runs end to end at tiny size, and the carried wheels cover every import the GPU image lacks."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import gpu_check, gpu_plan, gpu_report, gpu_wheels

REPO = Path(__file__).resolve().parent.parent


def test_the_plan_has_every_row_and_every_trainer_argv_parses(tmp_path, monkeypatch):
    from training.settings import flags

    monkeypatch.chdir(REPO)  # the quickstart row names examples/quickstart.yaml from the root
    rows = gpu_plan.plan(gpu_check.parse(["--out", str(tmp_path), "--work", str(tmp_path)]))
    names = [r.name for r in rows]
    assert names[0] == "prepare"
    assert set(gpu_plan.ENGINES) | {
        "quickstart",
        "export",
        "lora",
        "async_save",
        "evaluate",
        "profile",
    } <= set(names)
    trains = [c for r in rows for c in r.commands if c.kind == "train"]
    # engines, quickstart, LoRA, async (3), profile
    assert len(trains) == len(gpu_plan.ENGINES) + 1 + 1 + 3 + 1
    for cmd in trains:
        argv = cmd.argv()
        assert argv[1:3] == ["-m", "torch.distributed.run"] and "training/train.py" in argv
        config = flags.parse(cmd.args)
        if cmd.args[cmd.args.index("--model") + 1] == "350M" if "--model" in cmd.args else False:
            assert config.data.seq_len == 1024 and config.engine.precision == "bf16"
            assert config.optim.steps == (14 if config.logging.profile else 30)
    modules = {c.module for r in rows for c in r.commands if c.kind == "module"}
    assert modules == {"data.prepare", "training.export", "training.evaluate"}


def test_the_rows_fit_the_deadline_and_the_tool_limit():
    a = gpu_check.parse([])
    assert a.budget == gpu_plan.DEADLINE_S <= 540  # 9 minutes of a 10-minute command
    rows = gpu_plan.plan(a)
    assert all(0 < r.budget_s <= 150 for r in rows)
    # the rows that must run come first: the deadline cuts only from the end
    assert [r.name for r in rows][:4] == ["prepare", "quickstart", "export", "zero2"]


def test_rows_filters_but_keeps_prepare():
    rows = gpu_plan.plan(gpu_check.parse(["--rows", "ddp,fsdp"]))
    assert [r.name for r in rows] == ["prepare", "ddp", "fsdp"]


def test_a_failing_row_is_recorded_and_the_next_one_runs(tmp_path):
    a = gpu_check.parse(["--out", str(tmp_path)])
    bad = gpu_plan.Row(
        "bad", "a module that is not there", 30, [gpu_plan.Command("module", [], "no_such_mod")]
    )
    slow = gpu_plan.Row(
        "slow",
        "a sleep over its budget",
        1,
        [gpu_plan.Command("module", ["-s", "import time; time.sleep(30)"], "timeit")],
    )
    good = gpu_plan.Row(
        "good",
        "a module that runs",
        30,
        [gpu_plan.Command("module", ["-n", "1", "pass"], "timeit")],
    )
    done: dict = {}
    got = []
    for row in (bad, slow, good):
        got.append(gpu_check.run_row(row, a, deadline=1e18, done=done))
        done[row.name] = got[-1]["status"]
    assert [r["status"] for r in got] == ["failed", "failed", "ok"]
    assert "No module named no_such_mod" in got[0]["reason"] and "\n" not in got[0]["reason"]
    assert got[1]["reason"] == "timed out after 1 s"
    assert (tmp_path / "logs" / "bad.log").is_file()
    after = gpu_plan.Row("after", "x", 30, [], after="bad")
    assert gpu_check.run_row(after, a, 1e18, done)["reason"].startswith("needs the bad row")


def test_the_table_renders_a_sample_document():
    doc = {
        "date": "2026-01-01T00:00:00Z",
        "command": "python -m benchmarks.gpu_check",
        "environment": {
            "device": "NVIDIA H100 80GB HBM3",
            "gpus": 1,
            "cpus": 16,
            "torch": "2.11.0",
            "deepspeed": "0.19.8",
        },
        "budget_s": 480,
        "wall_s": 301.5,
        "rows": [
            {
                "name": "zero2",
                "what": "350M, zero2",
                "status": "ok",
                "tokens_per_s": 81234.5,
                "mfu": 0.4123,
                "peak_mem_gb": 21.346,
                "wall_s": 31.2,
                "final_loss": 7.25,
            },
            {
                "name": "zero3_offload",
                "what": "350M, zero3_offload",
                "status": "failed",
                "reason": "RuntimeError: ninja | not found (exit 1)",
                "wall_s": 12,
            },
            {
                "name": "evaluate",
                "what": "lm-eval",
                "status": "skipped",
                "reason": "lm_eval is not installed",
            },
            {
                "name": "export",
                "what": "x",
                "status": "ok",
                "wall_s": 20,
                "logits": {"device": "cuda", "max_diff_fp32": 1e-6, "max_diff_bf16": 0.03},
            },
            {
                "name": "async_save",
                "what": "y",
                "status": "ok",
                "wall_s": 60,
                "steps": 8,
                "bitwise": True,
                "max_rel_loss_diff": 0.0,
            },
        ],
    }
    md = gpu_report.render(doc)
    lines = md.splitlines()
    assert "NVIDIA H100 80GB HBM3 (1 GPU, 16 cores); torch 2.11.0, deepspeed 0.19.8" in md
    table = [x for x in lines if x.startswith("|")]
    assert table[0] == gpu_report.COLUMNS and len(table) == 2 + 5
    assert (
        table[2] == "| zero2 | 350M, zero2 | ok | 81,234 | 41.2% | 21.35 | 31 | final loss 7.250 |"
    )
    assert "**failed**" in table[3] and "ninja / not found" in table[3]  # a | would split the cell
    assert "| skipped |" in table[4] and "lm_eval is not installed" in table[4]
    assert "fp32 max diff 1e-06, bf16 0.03" in table[5]
    assert "8 steps' losses bitwise equal" in table[6]
    assert all(x.count("|") == table[0].count("|") for x in table)


@pytest.mark.slow
def test_one_row_runs_end_to_end_at_tiny_size(tmp_path):
    """prepare and the zero2 row, on this CPU, through the same code the GPU runs."""
    out = tmp_path / "out"
    argv = [
        "--tiny",
        "--slack",
        "4",
        "--rows",
        "zero2",
        "--out",
        str(out),
        "--work",
        str(tmp_path / "work"),
    ]
    assert gpu_check.main(argv) == 0
    doc = json.loads((out / "gpu_check.json").read_text())
    rows = {r["name"]: r for r in doc["rows"]}
    assert rows["prepare"]["status"] == rows["zero2"]["status"] == "ok"
    assert rows["zero2"]["tokens_per_s"] > 0 and rows["zero2"]["peak_mem_gb"] > 0
    assert doc["environment"]["torch"] and doc["environment"]["device"].startswith("cpu")
    assert "| zero2 | tiny, zero2" in (out / "gpu_check.md").read_text()


# ------------------------------------------------------------------------------ the wheels
def third_party_imports(packages=("training", "models", "data")) -> dict[str, str]:
    """{top-level import name: a file importing it} of everything not ours and not stdlib."""
    ours = {"training", "models", "data", "launch", "benchmarks"}
    found = {}
    for package in packages:
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in ours:
                        found.setdefault(top, str(path.relative_to(REPO)))
    return found


def uncovered(imports: dict[str, str]) -> list[str]:
    carried, left_out = gpu_wheels.carried(), set(gpu_wheels.LEFT_OUT)
    out = []
    for name, where in sorted(imports.items()):
        dist = gpu_wheels.normalize(gpu_wheels.IMPORT_NAMES.get(name, name))
        if dist not in carried and name not in left_out:
            out.append(f"{name} ({where})")
    return out


def test_the_wheels_cover_every_import_the_gpu_image_lacks():
    imports = third_party_imports()
    assert {"torch", "deepspeed", "pydantic", "yaml"} <= set(imports)  # the reader sees them
    assert not uncovered(imports), "neither on the GPU image nor carried nor left out with a reason"


def test_the_coverage_check_sees_a_planted_import():
    assert uncovered({"somelib": "training/x.py", "torch": "training/y.py"}) == [
        "somelib (training/x.py)"
    ]


def test_every_wheel_is_pinned_by_the_lock_and_deepspeeds_needs_are_met():
    from importlib.metadata import requires

    for kind in ("binary", "pure", "built"):
        specs = subprocess.run(
            [sys.executable, "-m", "benchmarks.gpu_wheels", kind],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        assert specs and all("==" in s for s in specs)
    for dist in ("deepspeed", "pydantic"):
        needs = [r.split(";")[0] for r in requires(dist) if "extra ==" not in r]
        names = {
            gpu_wheels.normalize(r.split(">")[0].split("=")[0].split("<")[0].strip()) for r in needs
        }
        assert names <= gpu_wheels.carried(), names - gpu_wheels.carried()


def test_the_shell_scripts_parse():
    for script in ("gpu_wheels.sh", "gpu_check.sh"):
        subprocess.run(["bash", "-n", str(REPO / "benchmarks" / script)], check=True)
    text = (REPO / "benchmarks" / "gpu_check.sh").read_text()
    assert "--no-index --no-deps --no-compile --target" in text and "benchmarks.gpu_check" in text
    assert "/.whl/" in (REPO / ".gitignore").read_text().splitlines()


def _metrics(folder, losses):
    folder.mkdir(parents=True)
    lines = [json.dumps({"kind": "train", "step": s, "loss": v}) for s, v in losses.items()]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "checkpoints" / "step_00000004").mkdir(parents=True)
    (folder / "checkpoints" / "step_00000004" / "model.pt").write_text("x")


# The H200's losses (benchmarks/results/gpu/h200_2026-11-28/logs_1/async_save.log): the same
# code twice up to step 4, stopped and resumed in the second; they part at step 6.
H200_SYNC = [9.0997, 8.7915, 8.4021, 8.0452, 7.8433, 7.4695, 7.4971, 7.5096]
H200_BG = [9.0997, 8.7915, 8.4021, 8.0452, 7.8433, 7.4725, 7.5053, 7.5098]


def test_the_async_row_judges_steps_through_the_resume_and_reports_the_rest(tmp_path):
    row = gpu_plan.Row("async_save", "", 1, [], check="async")
    row.paths = {"sync": str(tmp_path / "sync"), "bg": str(tmp_path / "bg"), "step": 4}
    _metrics(tmp_path / "sync", dict(enumerate(H200_SYNC, 1)))
    _metrics(tmp_path / "bg", dict(enumerate(H200_BG, 1)))
    got = gpu_check.check_async(row, 10)
    assert "failed" not in got and got["judged_steps"] == 5 and got["max_rel_loss_diff"] == 0
    assert 1e-3 < got["max_rel_loss_diff_later"] < 1.2e-3 and not got["bitwise"]
    assert "5 steps' losses within 0.0e+00, all 8 within 1.1e-03" in gpu_report.note(
        {**got, "name": "async_save"}
    )
    # a resume that lost something shows at the first step after it
    bad = dict(enumerate(H200_BG, 1)) | {5: 7.86}
    shutil.rmtree(tmp_path / "bg")
    _metrics(tmp_path / "bg", bad)
    assert "first step after the resume" in gpu_check.check_async(row, 10)["failed"]


def test_a_row_that_needs_an_op_waits_for_the_background_build(tmp_path):
    a = gpu_check.parse(["--out", str(tmp_path)])
    build = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2)"])
    row = gpu_plan.Row(
        "needs_op", "x", 30, [gpu_plan.Command("module", ["-n", "1", "pass"], "timeit")], ops="X"
    )
    got = gpu_check.run_row(row, a, deadline=time.monotonic() + 60, done={}, build=build)
    assert got["status"] == "ok" and got["ops_build_exit"] == 0 and got["ops_wait_s"] >= 1.5
    assert got["wall_s"] < 1.5  # the wait is not counted in the row's own time
    plan = gpu_plan.plan(gpu_check.parse([]))
    assert {r.name for r in plan if r.ops} == {"zero2_offload", "zero3_offload"}


@pytest.mark.slow
def test_the_profile_row_runs_at_tiny_size_and_copies_its_tables(tmp_path):
    """The profile row through the same code the GPU runs: the profiler's summary and op table
    come back beside the logs, and the table's note says where a step went."""
    out = tmp_path / "out"
    argv = ["--tiny", "--slack", "4", "--rows", "profile", "--out", str(out)]
    assert gpu_check.main([*argv, "--work", str(tmp_path / "work")]) == 0
    row = {r["name"]: r for r in json.loads((out / "gpu_check.json").read_text())["rows"]}
    row = row["profile"]
    assert row["status"] == "ok" and row["profile"]["step_s"] > 0
    assert (out / "logs" / "profile_summary.md").read_text().startswith("# Where the time went")
    assert "ms a profiled step" in (out / "gpu_check.md").read_text()


def test_a_gpu_profile_without_device_times_fails(tmp_path):
    """On a GPU the op table must carry CUDA times: a CPU-only table there is a failed row."""
    prof = tmp_path / "run" / "profile"
    prof.mkdir(parents=True)
    summary = {
        "steps": [10, 12],
        "per_rank": [{"wall_s": 0.6, "seconds": {"matrix products": 0.3}}],
    }
    (prof / "summary.json").write_text(json.dumps(summary))
    (prof / "summary.md").write_text("# Where the time went\n")
    (prof / "ops_rank0.txt").write_text("Name  Self CPU %  Self CPU\n")
    paths = {"run": str(tmp_path / "run"), "logs": str(tmp_path / "logs")}
    row = gpu_plan.Row("profile", "x", 60, [], check="profile", paths={**paths, "gpu": False})
    got = gpu_check.check_profile(row, 10)
    assert "failed" not in got and got["profile"] == {"step_s": 0.2, "matrix products": 0.5}
    row.paths["gpu"] = True
    assert "no CUDA times" in gpu_check.check_profile(row, 10)["failed"]
