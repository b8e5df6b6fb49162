"""The suite's rank server (tests/forked_ranks.py): its ranks train as torchrun's do, bit for
bit, on every engine, objective and world size the suite forks, resumed too, with the same
resolved configuration, exit codes and messages; and a run that outlives its time is killed
whole."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from conftest import TINY_RUN, _forked, launch, rank_exit_codes, read_metrics
from forked_ranks import launcher_args, launcher_env

STEPS = ["--steps", "3", "--save-every", "-1"]
# What a run records that no launch decides: measured speeds (the precision probe, the matmul
# ceiling, the reasons quoting them), the ranks' process ids and the run folder's own path.
MEASURED = ("precision_choice", "peak_flops_per_rank", "peak_flops")


def _same_record(a: Path, b: Path) -> None:
    rec = [json.loads((run / "resolved_config.json").read_text()) for run in (a, b)]
    for r, run in zip(rec, (a, b), strict=True):
        for key in MEASURED:
            r.pop(key, None)
        for rank in r["ranks"]:
            rank.pop("pid")
            rank.pop("built")  # seconds and bytes: measured
        r["why"] = {k: v for k, v in r["why"].items() if not v.startswith("measured")}
        text = json.dumps(r).replace(str(run), "RUN")
        r.clear()
        r.update(json.loads(text))
    differ = sorted(k for k in rec[0].keys() | rec[1].keys() if rec[0].get(k) != rec[1].get(k))
    assert not differ, {k: (rec[0].get(k), rec[1].get(k)) for k in differ}


def _same_steps(a: Path, b: Path) -> None:
    fields = ("step", "loss", "grad_norm", "tokens", "lr")
    for kind in ("train", "eval"):
        got, want = read_metrics(a, kind), read_metrics(b, kind)
        assert [[r.get(f) for f in fields] for r in got] == [
            [r.get(f) for f in fields] for r in want
        ], (kind, got, want)
    assert read_metrics(a), a


def _both(
    args: list[str], tmp_path: Path, nproc: int = 2, launcher: str = "torchrun"
) -> tuple[Path, Path]:
    runs = tmp_path / "forked", tmp_path / "launched"
    for run, forked in zip(runs, (True, False), strict=True):
        launch([*args, "--out", str(run)], nproc=nproc, forked=forked, launcher=launcher)
    return runs


CASES = {
    "zero2, 2 ranks": ([], 2),
    "zero2, 1 rank": ([], 1),
    "zero0, 2 ranks": (["--ds_config", "ds_configs/zero0.json"], 2),
    "zero3, 2 ranks": (["--ds_config", "ds_configs/zero3.json"], 2),
    "ddp, 2 ranks": (["--backend", "ddp"], 2),
    "fsdp, 2 ranks": (["--backend", "fsdp"], 2),
    "pipeline, 2 stages": (["--ds_config", "ds_configs/pipeline.json"], 2),
    "tp2": (["--ds_config", "ds_configs/tp2.json"], 2),
    "moe, zero2, 2 ranks": (["--model", "tiny-moe"], 2),
    "moe, ep2": (["--model", "tiny-moe", "--ds_config", "ds_configs/moe_ep2.json"], 2),
    "zero1, 4 ranks": (["--ds_config", "ds_configs/zero1.json"], 4),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.replace(", ", "-").replace(" ", "_"))
def test_forked_ranks_train_as_torchrun_ranks_bit_for_bit(tiny_data, tmp_path, case):
    extra, nproc = CASES[case]
    forked, launched = _both(["--data", str(tiny_data), *TINY_RUN, *STEPS, *extra], tmp_path, nproc)
    _same_steps(forked, launched)
    _same_record(forked, launched)


@pytest.mark.slow
def test_forked_ranks_train_as_deepspeeds_launcher_ranks(tiny_data, tmp_path):
    """As DeepSpeed's launcher starts them: its variables and --local_rank argument."""
    args = ["--data", str(tiny_data), *TINY_RUN, *STEPS]
    forked, launched = _both(args, tmp_path, launcher="deepspeed")
    _same_steps(forked, launched)
    _same_record(forked, launched)
    assert json.loads((forked / "resolved_config.json").read_text())["launched_by"] == "deepspeed"


@pytest.mark.slow
def test_forked_dpo_and_resume_are_torchruns(pairs, tmp_path):
    """DPO on 2 ranks, saved at step 2, then resumed to step 4 on 1 rank: forked and launched
    alike, bit for bit, both legs."""
    base = ["--data", str(pairs["data"]), "--model", "tiny", "--objective", "dpo", "--seq-len",
            "64", "--micro-batch", "2", "--log-every", "1", "--eval-every", "0", "--lr", "3e-3",
            "--warmup", "1", "--precision", "fp32", "--no-compile", "--save-every", "2"]  # fmt: skip
    first = _both([*base, "--steps", "4", "--stop-at", "2"], tmp_path)
    for run, forked in zip(first, (True, False), strict=True):
        launch([*base, "--steps", "4", "--out", str(run), "--resume", "auto",
                "--grad-accum", "2"], nproc=1, forked=forked)  # fmt: skip
    _same_steps(*first)
    assert [r["step"] for r in read_metrics(first[0])][-1] == 4


@pytest.mark.slow
def test_forked_ranks_exit_and_refuse_as_launched_ones(tiny_data, tmp_path):
    """A refused input: the ranks exit 2 with the one `error:` line, forked as launched; a
    script's sys.exit("message") ends its rank with code 1 and the message on stderr, as the
    interpreter ends it."""
    bad = ["--data", str(tiny_data), *TINY_RUN, *STEPS, "--micro-batch", "0"]
    said = []
    for forked in (True, False):
        p = launch([*bad, "--out", str(tmp_path / f"bad{forked}")], check=False, forked=forked)
        codes = rank_exit_codes(p)  # a rank still refusing when another has may get SIGTERM
        assert p.returncode == 1 and 2 in codes and set(codes) <= {2, -15}, (forked, p.stderr)
        said.append(sorted({x for x in p.stderr.splitlines() if x.startswith("error: ")}))
    assert said[0] == said[1] and len(said[0]) == 1, said
    script = tmp_path / "says.py"
    script.write_text("import sys\nsys.exit('rank gives up: the reason')\n")
    for forked in (True, False):
        p = launch([], script=str(script), check=False, forked=forked)
        codes = rank_exit_codes(p)
        assert 1 in codes and set(codes) <= {1, -15}, (forked, codes)
        assert "rank gives up: the reason" in p.stderr, forked
    script = tmp_path / "fails.py"  # a run that fails: its traceback, code 1, atexit run
    script.write_text(
        "import atexit, sys\n"
        "atexit.register(lambda: print('atexit ran', file=sys.stderr))\n"
        "raise RuntimeError('the step failed')\n"
    )
    for forked in (True, False):
        p = launch([], script=str(script), check=False, forked=forked)
        codes = rank_exit_codes(p)
        assert 1 in codes and set(codes) <= {1, -15}, (forked, codes)
        assert "RuntimeError: the step failed" in p.stderr and "atexit ran" in p.stderr, forked


@pytest.mark.slow
@pytest.mark.parametrize("launcher, nproc", [("torchrun", 1), ("torchrun", 2), ("deepspeed", 2)])
def test_a_forked_rank_starts_as_a_launched_one(tmp_path, launcher, nproc):
    """The same arguments (DeepSpeed's --local_rank), the launcher's variables, torch's thread
    count, and random generators seeded afresh in every rank, forked as launched."""
    seen = {}
    for forked in (True, False):
        where = tmp_path / str(forked)
        where.mkdir()
        launch(["x"], nproc, {"ZEROSTACK_SEEN": str(where)}, script="tests/scripts/what_a_rank_sees.py",
               forked=forked, launcher=launcher)  # fmt: skip
        seen[forked] = [json.loads((where / f"{r}.json").read_text()) for r in range(nproc)]
    for mine, theirs in zip(seen[True], seen[False], strict=True):
        # DeepSpeed's import sets it: in the server, as in every trainer rank, not in this script
        mine["env"].pop("PYTORCH_NVML_BASED_CUDA_CHECK")
        theirs["env"].pop("PYTORCH_NVML_BASED_CUDA_CHECK")
        assert (mine["argv"], mine["env"], mine["threads"]) == (
            theirs["argv"],
            theirs["env"],
            theirs["threads"],
        ), (mine, theirs)
    draws = [tuple(r["draws"]) for rs in seen.values() for r in rs]
    assert len(set(draws)) == len(draws), draws  # no two ranks, forked or not, draw alike


def test_forked_ranks_get_the_launchers_variables_arguments_and_thread_count():
    one, two = (launcher_env("torchrun", r, n, 29500, None) for r, n in ((0, 1), (1, 2)))
    assert one["OMP_NUM_THREADS"] is None and two["OMP_NUM_THREADS"] == "1"
    assert launcher_env("torchrun", 0, 1, 29500, "3")["OMP_NUM_THREADS"] == "3"  # a user's stays
    assert two["RANK"] == two["LOCAL_RANK"] == "1" and two["LOCAL_WORLD_SIZE"] == "2"
    assert "LOCAL_SIZE" not in two and launcher_args("torchrun", 1) == []
    ds = launcher_env("deepspeed", 1, 2, 29500, None)
    assert ds["LOCAL_SIZE"] == "2" and ds["OMP_NUM_THREADS"] is None
    assert "LOCAL_WORLD_SIZE" not in ds and launcher_args("deepspeed", 1) == ["--local_rank=1"]


@pytest.mark.slow
def test_a_forked_run_past_its_time_is_killed_whole(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(
        "import os, pathlib, time\n"
        f"pathlib.Path('{tmp_path}', os.environ['RANK']).write_text(str(os.getpid()))\n"
        "time.sleep(600)\n"
    )
    t = time.monotonic()
    p, timed_out = _forked([str(script)], 2, 5, ["sleeper"])
    assert timed_out and time.monotonic() - t < 60
    assert p.returncode == 1 and set(rank_exit_codes(p)) == {-9}  # SIGKILL, reaped by the server
    for rank in ("0", "1"):
        with pytest.raises(ProcessLookupError):
            os.kill(int((tmp_path / rank).read_text()), 0)


@pytest.mark.slow
def test_a_failed_rank_stops_the_others_as_under_torchrun(tmp_path):
    """Rank 1 fails at once, rank 0 would sleep for 10 minutes: as torchrun's agent does, the
    server stops rank 0 (SIGTERM) in seconds, and the failures are rank 1's code and rank 0's
    SIGTERM."""
    script = tmp_path / "fails.py"
    script.write_text(
        "import os, pathlib, sys, time\n"
        f"pathlib.Path('{tmp_path}', os.environ['RANK']).write_text(str(os.getpid()))\n"
        "print('rank', os.environ['RANK'], 'says so on stderr', file=sys.stderr)\n"
        "sys.exit(3) if os.environ['RANK'] == '1' else time.sleep(600)\n"
    )
    for forked in (True, False):
        t = time.monotonic()
        p = launch([], script=str(script), check=False, forked=forked, timeout=120)
        assert time.monotonic() - t < 60 and p.returncode == 1, (forked, p.stderr[-2000:])
        assert rank_exit_codes(p) == [-15, 3], (forked, p.stderr[-2000:])
        assert "rank 1 says so on stderr" in p.stderr and "rank 1 says" not in p.stdout
        with pytest.raises(ProcessLookupError):
            os.kill(int((tmp_path / "0").read_text()), 0)
