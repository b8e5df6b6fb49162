"""Every generated section of the docs is what `python -m benchmarks.docs_tables` writes from
the committed raw results; a number changed in a raw file makes the check fail, naming the
table; and every older figure marked with the commit it came from names a real commit."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
from conftest import REPO

from benchmarks import docs_tables
from benchmarks.docs_tables import RESULTS, SECTIONS, stale

# One planted change per table drawn from a raw file: (section, file, edit of the loaded JSON).
PLANTS = {
    "engines_peer": ("compare_small6.json", lambda d: d["rows"][6].update(tokens_per_s=9999.0)),
    "engines_3d": ("compare_small_3d.json", lambda d: d["rows"][-1].update(loss=9.1234)),
    "matmul_by_host": (
        "host_class/compare_zen4.json",
        lambda d: d["rows"]["ddp"][0]["precision_choice"]["rates_flops"].update(bf16=999.9e9),
    ),
    "precision_by_host": (
        "host_class/compare_zen4.json",
        lambda d: d["rows"]["zero2"][0].update(tokens_per_s=1509.0),
    ),
    "compile_cost": (
        "host_class/compile_cost.json",
        lambda d: d["runs"]["native--compile"].update(first_step_s=11.0),
    ),
    "construction": (
        "construction.json",
        lambda d: next(iter(d["arms"].values()))["ranks"][0].update(peak=9 * 2**30),
    ),
    "lora": ("lora.json", lambda d: d["rows"][0].update(model_states_mb=120.3)),
    "doc_mask_earlier": (
        "doc_mask_attention.json",
        lambda d: d["earlier_run"]["rows"][2].update(forward_backward_ms=999.0),
    ),
    "moe": ("moe.json", lambda d: d["summary"][1].update(tokens_per_s=9999.0)),
    "moe_experts": ("moe_experts.json", lambda d: d["rows"][1]["median"].update(loop=9.5)),
    "trl_sft": ("trl_sft.json", lambda d: d["summary"][0].update(trained_tokens_per_s=3300.0)),
    "trl_dpo": ("trl_dpo.json", lambda d: d["fp32_check"][0]["loss_step1"].__setitem__(1, 0.7)),
    "quickstart_cpu": (
        "host_class/quickstart_avx2_emulated.json",
        lambda d: d.update(first_step_s_compiling=11.0),
    ),
    "checkpoint_shared": (
        "checkpoint_stall.json",
        lambda d: d["results"]["async"].update(stall_per_save_s=0.09),
    ),
    "checkpoint_quiet": (
        "checkpoint_stall_125M_zero3.json",
        lambda d: d["results"]["sync"].update(step_s_other=7.0),
    ),
    "checkpoint_gpu": (
        "checkpoint_stall_350M_gpu.json",
        lambda d: d["pass2"]["zero2"]["checkpoints"][0].update(stall_s=0.5),
    ),
    "doc_mask": ("doc_mask_attention.json", lambda d: d["rows"][0].update(forward_ms=100.0)),
    "dpo_job": ("dpo_pyfuncs.json", lambda d: d["after"].update(val_accuracy=0.9)),
    "spike_guard": (
        "spike_guard.json",
        lambda d: d["false_positives"][0]["replayed_log_norm"]["6.0"].append(400),
    ),
    "gpu_check": (
        "gpu/h200_2026-11-28_2/1_all_rows.json",
        lambda d: d["rows"][3].update(tokens_per_s=9999.0),
    ),
    "scale": (
        "scale.json",
        lambda d: d["350M:zero2:1024"]["train"].update(tokens_per_s=999.0),
    ),
    "scale_disk": (
        "scale.json",
        lambda d: d["2.7B:zero3_nvme:1024:ckpt"]["train"].update(checkpoint_bytes=31 * 2**30),
    ),
}


# Tables whose benchmark has not committed a raw file yet: a raw file added makes them stale.
ADDED = {
    "bench_train": (
        "bench_train_small.json",
        {
            "date": "2026-11-26T10:00:00Z",
            "host": {"class": "a test host", "cores": 2},
            "args": {"model": "small", "steps": 30, "seq_len": 256, "micro_batch": 8, "ranks": 2},
            "rows": [
                {
                    "name": "plain",
                    "tokens_per_s": 1000.0,
                    "mfu": 0.5,
                    "ceiling": 2e11,
                    "peak_mem_gb": 1.0,
                    "loss": 6.5,
                },
                {
                    "name": "zero2",
                    "tokens_per_s": 1234.0,
                    "mfu": 0.6,
                    "ceiling": 2e11,
                    "peak_mem_gb": 1.1,
                    "loss": 6.4,
                },
            ],
        },
    ),
    "soak": (
        "soak.json",
        {
            "date": "2026-11-26T10:00:00Z",
            "host": "a test host",
            "args": {"steps": 3000, "save_every": 50, "eval_every": 100},
            "warm": 210,
            "rows": [
                {
                    "engine": "zero2",
                    "start": {
                        "rss": [475e6, 471e6],
                        "fds": [22, 21],
                        "threads": [11, 9],
                        "shm_maps": [3, 2],
                    },
                    "end": {
                        "rss": [477e6, 472e6],
                        "fds": [22, 21],
                        "threads": [11, 9],
                        "shm_maps": [3, 2],
                    },
                    "between": [[750, [476e6, 472e6]]],
                    "rss_growth": [0.004, 0.004],
                    "shm_left": [],
                    "ok": True,
                    "checks": {},
                }
            ],
        },
    ),
    "time_to_loss": (
        "time_to_loss.json",
        {
            "command": "python -m benchmarks.time_to_loss",
            "date": "2026-11-26T10:00:00Z",
            "host": {"class": "a test host", "cores": 2},
            "job": {
                "model": "small",
                "layers": 0,
                "ranks": 2,
                "steps": 300,
                "target": 5.2,
                "max_minutes": 12,
                "rounds": 1,
                "eval_every": 10,
                "eval_samples": 64,
            },
            "tokens_per_step": 2048,
            "summary": {
                "zerostack": {
                    "rounds": 1,
                    "reached": 1,
                    "best_val_loss": 5.19,
                    "wall_to_target_s": {"median": 500.0, "min": 500.0, "max": 500.0},
                    "train_to_target_s": {"median": 480.0, "min": 480.0, "max": 480.0},
                    "tokens_to_target": {"median": 1234.0, "min": 1234.0, "max": 1234.0},
                    "steps_to_target": {"median": 120, "min": 120, "max": 120},
                },
                "hf_trainer": {
                    "rounds": 1,
                    "reached": 0,
                    "best_val_loss": 6.1,
                    "wall_to_target_s": None,
                    "train_to_target_s": None,
                    "tokens_to_target": None,
                    "steps_to_target": None,
                },
            },
            "ratios": {"zerostack": {"nanogpt": None, "hf_trainer": None}},
        },
    ),
    "attention_kernels": (
        "attention_kernels.json",
        {
            "date": "2026-11-26T10:00:00Z",
            "host": "a test host",
            "torch": "2.13.0",
            "args": {"heads": 12, "kv_heads": 12, "head_dim": 64, "tokens": 2048, "rounds": 7},
            "ceiling_gflops": 200.0,
            "rows": [
                {
                    "seq": 256,
                    "batch": 8,
                    "kernel": "sdpa",
                    "forward_ms": 7.4,
                    "backward_ms": 41.4,
                    "gflops": 49.0,
                },
                {
                    "seq": 256,
                    "batch": 8,
                    "kernel": "explicit",
                    "forward_ms": 23.1,
                    "backward_ms": 25.6,
                    "gflops": 50.0,
                },
            ],
        },
    ),
}


def planted(tmp_path, name: str):
    """A copy of the results folder with `name`'s planted change."""
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    if name in ADDED:
        file, d = ADDED[name]
    else:
        file, edit = PLANTS[name]
        d = json.loads((results / file).read_text())
        edit(d)
    (results / file).write_text(json.dumps(d))
    return results


def test_the_committed_docs_are_what_the_renderer_writes():
    """Re-render with `python -m benchmarks.docs_tables` after changing a raw result."""
    assert stale() == []


def test_every_table_from_a_raw_file_has_a_planted_change():
    from_results = {s.name for s in SECTIONS} - {"settings"}
    assert set(PLANTS) | set(ADDED) == from_results


@pytest.mark.parametrize("name", sorted({*PLANTS, *ADDED}))
def test_a_number_changed_in_a_raw_file_shows_in_its_table(tmp_path, name):
    section = next(s for s in SECTIONS if s.name == name)
    results = planted(tmp_path, name)
    assert section.ignore(section.body(results)) != section.ignore(section.body(RESULTS))


@pytest.mark.parametrize("name", sorted(ADDED))
def test_a_raw_file_added_fills_its_table(tmp_path, name):
    section = next(s for s in SECTIONS if s.name == name)
    body = section.body(planted(tmp_path, name))
    assert "No raw result committed yet" not in body
    assert "a test host, 2026-11-26" in body
    assert "1,234" in body or "23.1" in body or "+0.4% / +0.4%" in body


def test_the_check_fails_naming_the_stale_table(tmp_path, capsys):
    results = planted(tmp_path, "lora")
    assert stale(REPO, results) == ["lora (docs/benchmarks.md)"]
    assert docs_tables.main(["--check", "--results", str(results)]) == 1
    assert "error: table lora (docs/benchmarks.md) differs" in capsys.readouterr().out


def test_a_doc_without_its_markers_and_a_missing_folder_are_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="markers of table lora are missing"):
        docs_tables.rewrite("# no markers\n", next(s for s in SECTIONS if s.name == "lora"), "x")
    assert docs_tables.main(["--check", "--results", str(tmp_path / "gone")]) == 2
    assert capsys.readouterr().err.startswith("error: --results")


def test_figures_marked_as_older_name_a_real_commit():
    """A figure without a raw file is marked with the commit that published it; that commit
    must exist, so a reader can find the code it was measured on."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    named = set()
    for path in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        named |= set(re.findall(r"\bcommits? ([0-9a-f]{7})\b", path.read_text()))
        named |= set(re.findall(r"\bcommits [0-9a-f]{7}, ([0-9a-f]{7})\b", path.read_text()))
    assert named
    for commit in sorted(named):
        ok = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=REPO)
        assert ok.returncode == 0, f"the docs name commit {commit}, which is not in the history"
