"""The exit code a user sees is the documented one (training/errors.py), through each launch
script: the ranks write how the run ended into RUN/exit.json, and the script exits with that
code instead of the launcher's own (deepspeed's 247 for a rank killed by -9, torchrun's 1 for
any failed rank). Real launches, real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import PY, REPO, free_port
from test_reliability import Job, args

SCRIPTS = ["launch/local.sh", "launch/torchrun.sh"]


def script_env() -> dict:
    return {"MASTER_PORT": str(free_port()), "VENV": str(Path(PY).parent.parent)}


def exit_record(run: Path) -> dict:
    return json.loads((run / "exit.json").read_text())


def test_the_exit_record_is_read_only_for_this_launch(tmp_path):
    """launch/exit_code.py: the record of this launch wins over the launcher's code; another
    launch's record (an earlier run, another job) and a missing one leave the launcher's."""
    run = tmp_path / "run"
    run.mkdir()
    spare = tmp_path / "spare.json"
    (run / "exit.json").write_text(json.dumps({"code": 4, "launch_id": "a", "meaning": "x"}))

    def code(launch_id: str, own: int) -> int:
        p = subprocess.run(
            [PY, "-m", "launch.exit_code", str(own), str(spare), "--data", "d", "--out", str(run)],
            cwd=REPO,
            env={**os.environ, "ZEROSTACK_LAUNCH_ID": launch_id},
            capture_output=True,
            text=True,
            check=True,
        )
        return int(p.stdout.strip())

    assert code("a", 247) == 4
    assert code("b", 247) == 247
    spare.write_text(json.dumps({"code": 2, "launch_id": "b"}))  # refused before it held RUN
    assert code("b", 1) == 2
    (run / "exit.json").unlink()
    assert code("a", 1) == 1


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_launch_scripts_exit_with_the_documented_code(tiny_data, tmp_path, script):
    """Through the script: a bad input ends 2, a SIGTERM to the script 75 (a checkpoint saved),
    and a kill -9 of rank 1 4, with the record naming rank 1 and rank 0 never promising a
    save it cannot make. 30-75 s a script on 2 cores: three launches of the real script, the
    last waiting out the watchdog's roll call for the killed rank; one test holds all three
    codes so each script starts its launcher only three times."""
    out = tmp_path / "run"
    run = args(tiny_data, out, steps=400, save_every=3)

    p = subprocess.run(
        ["bash", script, "2", *args(tiny_data, out, "--lr", "-1")],
        cwd=REPO,
        env={**os.environ, **script_env()},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2, p.stderr[-3000:]
    assert "--lr must be 0 or more" in p.stdout + p.stderr
    assert not out.exists()  # a refused launch leaves nothing behind

    job = Job(["bash", script, "2", *run], env=script_env())
    job.wait_for(r"train step 2 ")
    os.kill(job.proc.pid, signal.SIGTERM)
    assert job.finish() == 75, job.output[-4000:]
    record = exit_record(out)
    assert (record["code"], record["meaning"]) == (75, "preempted")
    assert (out / "checkpoints" / "latest").read_text() == f"step_{record['step']:08d}"

    job = Job(["bash", script, "2", *run], env=script_env())
    job.wait_for(r"saved checkpoint step_\d+")
    os.kill(job.rank_pid(1), signal.SIGKILL)
    assert job.finish(timeout=200) == 4, job.output[-4000:]
    record = exit_record(out)
    assert (record["code"], record["rank_blamed"]) == (4, 1), record
    assert "rank 1 is not responding" in record["reason"]
    assert "saving a checkpoint at the next step boundary" not in job.output
    assert not (out / "run.lock").exists()  # given back by rank 0 on its way out


def test_a_rank_ends_with_its_code_after_running_the_exit_handlers(tmp_path):
    """training/runtime/distributed.py exit_process: an entry point's last line leaves without
    the interpreter's finalization (where gloo's worker threads can abort a finished run), yet
    with its code, its atexit handlers run and its output flushed."""
    marker = tmp_path / "atexit_ran"
    code = (
        "import atexit, sys\n"
        "from training.runtime import distributed\n"
        f"atexit.register(lambda: open({str(marker)!r}, 'w').write('yes'))\n"
        "print('kept', end='')\n"
        "sys.stderr.write('also kept')\n"
        "distributed.exit_process(3)\n"
        "print('never reached')\n"
    )
    p = subprocess.run([PY, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 3, p.stderr[-2000:]
    assert p.stdout == "kept"
    assert p.stderr.endswith("also kept")
    assert marker.read_text() == "yes"
