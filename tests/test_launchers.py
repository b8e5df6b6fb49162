"""The trainer under real cluster launchers on this machine: Open MPI's `mpirun -np 2`, and a
one-node SLURM (slurmctld and slurmd started here from a generated slurm.conf) running a bare
`srun -n 2` and an `sbatch` of launch/slurm.sbatch. None of them is handed RANK or WORLD_SIZE
(but sbatch, whose DeepSpeed launcher sets them): each rank must find its place from the
launcher's own variables (training/runtime/launcher.py), or every process trains as a world of
one. What cannot start here is skipped with its reason (.ci/run installs the packages)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from launch.supervise import run_marked
from tests.conftest import PY, REPO, TINY_RUN, read_metrics
from training.runtime.distributed import free_port

pytestmark = pytest.mark.slow  # real multi-process runs under real launchers

STEPS = ["--steps", "3", "--save-every", "0"]
# A bare launch: nothing of torchrun's or DeepSpeed's, nothing of an enclosing launcher.
TORCH_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def bare_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in TORCH_NAMES and not k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_"))
    }
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def check_two_rank_run(out: Path, launched_by: str) -> None:
    """One run of world 2 (not two runs of world 1): the record says so, both ranks reported
    where they ran, and the losses were logged once per step."""
    record = json.loads((out / "resolved_config.json").read_text())
    assert record["world"] == 2 and record["launched_by"] == launched_by, (
        record["world"],
        record["launched_by"],
    )
    ranks = record["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["pid"] != ranks[1]["pid"]
    assert ranks[0]["first_batch_sha1"] != ranks[1]["first_batch_sha1"]  # each its own share
    assert all(r["built"]["peak_host_bytes"] > 2**20 for r in ranks), ranks  # construction
    steps = [r["step"] for r in read_metrics(out)]
    assert steps == [1, 2, 3], steps


def train_argv(data: Path, out: Path) -> list[str]:
    return ["training/train.py", "--data", str(data), "--out", str(out), *TINY_RUN, *STEPS]


def test_bare_mpirun_trains_one_world_of_two(tiny_data, tmp_path):
    """`mpirun -np 2 python training/train.py` (Open MPI, no MASTER_ADDR, no RANK): a world of
    2 meeting at 127.0.0.1 on a port derived from Open MPI's job id. Over 60 s on 2 cores:
    two processes import torch and DeepSpeed and build an engine; a real mpirun is the test."""
    mpirun = shutil.which("mpirun")
    if mpirun is None or shutil.which("ompi_info") is None:
        pytest.skip("Open MPI's mpirun is not installed (apt-get install openmpi-bin)")
    out = tmp_path / "run"
    cmd = [mpirun, "-np", "2", "--bind-to", "none", "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    p, timed_out = run_marked(
        [*cmd, PY, *train_argv(tiny_data, out)], cwd=REPO, timeout=300, env=bare_env()
    )
    assert not timed_out and p.returncode == 0, (p.returncode, p.stdout[-3000:], p.stderr[-3000:])
    check_two_rank_run(out, "openmpi")


# ------------------------------------------------------------------------- a one-node SLURM
SLURM_CONF = """\
ClusterName=zerostack
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A one-node SLURM cluster of this machine, for this module: slurmctld and slurmd as root,
    authentication off (auth/none: nothing leaves 127.0.0.1). Yields the environment that
    points srun and sbatch at it."""
    tools = ("slurmctld", "slurmd", "srun", "sbatch", "sinfo")
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.skip(f"SLURM is not installed ({', '.join(missing)} missing: apt-get install "
                    "slurmctld slurmd slurm-client)")  # fmt: skip
    if os.geteuid() != 0:
        pytest.skip("slurmd needs root to start its tasks")
    d = tmp_path_factory.mktemp("slurm")
    (d / "state").mkdir()
    (d / "spool").mkdir()
    host = socket.gethostname().split(".")[0]
    conf = d / "slurm.conf"
    conf.write_text(
        SLURM_CONF.format(
            host=host, dir=d, ctld_port=free_port(), d_port=free_port(), cpus=os.cpu_count() or 2
        )
    )
    env = {**bare_env(), "SLURM_CONF": str(conf)}
    for daemon in ("slurmctld", "slurmd"):  # each forks into the background, writing its pid
        p = subprocess.run(
            [shutil.which(daemon), "-f", str(conf)] + (["-c"] if daemon == "slurmctld" else []),
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if p.returncode != 0:
            stop_slurm(d)
            pytest.skip(f"{daemon} did not start: {(p.stderr or p.stdout).strip()[-300:]}")
    state = ""
    for _ in range(60):  # the node registers within seconds
        q = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True)
        state = q.stdout.strip()
        if state == "idle":
            break
        time.sleep(0.5)
    else:
        log = (d / "slurmd.log").read_text()[-500:] if (d / "slurmd.log").exists() else ""
        stop_slurm(d)
        pytest.skip(f"the SLURM node did not come up (state {state!r}): {log}")
    yield env
    stop_slurm(d)


def stop_slurm(d: Path) -> None:
    for name in ("slurmd.pid", "slurmctld.pid"):
        pid_file = d / name
        try:
            os.kill(int(pid_file.read_text().strip()), 15)
        except (OSError, ValueError):
            pass  # never started, or gone


def test_bare_srun_trains_one_world_of_two(slurm, tiny_data, tmp_path):
    """`srun -n 2 python training/train.py`: rank, world and local rank from SLURM_PROCID,
    SLURM_STEP_NUM_TASKS and SLURM_LOCALID; the master the node list's first host (this one).
    Over 60 s on 2 cores, as the mpirun test, for the same reason."""
    out = tmp_path / "run"
    p, timed_out = run_marked(
        ["srun", "-n", "2", PY, *train_argv(tiny_data, out)],
        cwd=REPO, timeout=300, env=slurm,
    )  # fmt: skip
    assert not timed_out and p.returncode == 0, (p.returncode, p.stdout[-3000:], p.stderr[-3000:])
    check_two_rank_run(out, "slurm")
    record = json.loads((out / "resolved_config.json").read_text())
    assert record["host_layout"] == {"launcher": "slurm", "ranks_on_this_host": 2, "one_host": True}


def test_sbatch_of_the_slurm_script_trains(slurm, tiny_data, tmp_path):
    """launch/slurm.sbatch as a user submits it (`sbatch --nodes 1`, 2 ranks per node): the
    batch step's SLURM_PROCID / SLURM_NTASKS are not taken for a rank; DeepSpeed's launcher
    starts the world of 2, and the job's exit code is the run's. Over 60 s on 2 cores: a job
    through SLURM and DeepSpeed's launcher, then two ranks starting as in the mpirun test."""
    out = tmp_path / "run"
    log = tmp_path / "job.out"
    env = {**slurm, "SLOTS_PER_NODE": "2", "MASTER_PORT": str(free_port())}
    p, timed_out = run_marked(
        ["sbatch", "--wait", "--nodes", "1", f"--output={log}", "launch/slurm.sbatch",
         "--data", str(tiny_data), "--out", str(out), *TINY_RUN, *STEPS],
        cwd=REPO, timeout=400, env=env,
    )  # fmt: skip
    text = log.read_text() if log.exists() else ""
    assert not timed_out and p.returncode == 0, (p.returncode, p.stderr[-2000:], text[-4000:])
    check_two_rank_run(out, "deepspeed")
