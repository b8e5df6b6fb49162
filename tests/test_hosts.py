"""Each launcher's environment as training/runtime/launcher.py reads it: rank, world, local rank
and master (what a bare srun or mpirun hands over; tests/test_launchers.py starts the real
ones), and the host layout the one-host holds, the shm route and the thread split decide on."""

from __future__ import annotations

import re

import pytest

from training.errors import ConfigError
from training.runtime import launcher
from training.runtime.launcher import host_layout, slurm_tasks_on_node

LAUNCHERS = (
    "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
    "SLURM_NODEID", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
)  # fmt: skip


@pytest.mark.parametrize(
    "env, ranks, launcher",
    [
        ({}, 8, "none"),  # a plain launch: the whole world here
        ({"LOCAL_WORLD_SIZE": "4"}, 4, "torchrun"),  # torchrun, accelerate launch
        ({"LOCAL_SIZE": "2"}, 2, "deepspeed"),  # deepspeed --hostfile: never LOCAL_WORLD_SIZE
        # torchrun inside a SLURM job: torchrun's own count wins over the allocation's
        ({"LOCAL_WORLD_SIZE": "2", "SLURM_NTASKS_PER_NODE": "4"}, 2, "torchrun"),
        ({"SLURM_NTASKS_PER_NODE": "2", "SLURM_LOCALID": "1"}, 2, "slurm"),  # srun alone
        ({"SLURM_TASKS_PER_NODE": "2(x3)", "SLURM_NODEID": "1"}, 2, "slurm"),
        ({"SLURM_TASKS_PER_NODE": "3(x2),2", "SLURM_NODEID": "2"}, 2, "slurm"),
        ({"SLURM_TASKS_PER_NODE": "8", "SLURM_NODEID": "0"}, 8, "slurm"),  # one node
        ({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, 4, "openmpi"),  # mpirun (Open MPI)
        ({"MPI_LOCALNRANKS": "2"}, 2, "mpich"),  # mpiexec (MPICH, Intel MPI)
        ({"LOCAL_SIZE": "", "MPI_LOCALNRANKS": "2"}, 2, "mpich"),  # an empty one is not said
        ({"SLURM_TASKS_PER_NODE": "garbled"}, 8, "none"),  # unreadable: taken as unsaid
    ],
)
def test_each_launchers_environment(monkeypatch, env, ranks, launcher):
    for name in LAUNCHERS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    layout = host_layout(8)
    assert (layout.ranks_here, layout.launcher) == (ranks, launcher)


def test_slurm_tasks_per_node_form():
    spec = "2(x3),1,4(x2)"
    assert [slurm_tasks_on_node(spec, n) for n in range(7)] == [2, 2, 2, 1, 4, 4, None]
    assert slurm_tasks_on_node("2(x", 0) is None


def test_preflight_reads_the_layout_from_the_launcher(monkeypatch):
    """Under DeepSpeed's launcher on two hosts of 2 ranks (LOCAL_SIZE=2, world 4) preflight's
    Host says 2 here, which the one-host holds and the shm route are decided on
    (test_switches.py: two_hosts)."""
    from training.preflight.switches import this_host
    from training.settings import flags as cli

    for name in LAUNCHERS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_SIZE", "2")
    settings = cli.parse(["--data", "d", "--out", "o"])
    host = this_host(settings, "cpu", 4)
    assert (host.ranks_here, host.launcher, host.world) == (2, "deepspeed", 4)


SRUN = {  # what `srun -n 2` gives its second task on a one-node allocation (SLURM 22.05)
    "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2",
    "SLURM_TASKS_PER_NODE": "2", "SLURM_NODEID": "0", "SLURM_STEP_NODELIST": "vm",
    "SLURM_JOB_NODELIST": "vm", "SLURM_NNODES": "1",
}  # fmt: skip
MPIRUN = {  # Open MPI 4.1's mpirun -np 2, rank 1
    "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "PMIX_NAMESPACE": "2118647809",
}  # fmt: skip
HYDRA = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}


@pytest.mark.parametrize(
    "env, launch",
    [
        ({}, ("none", 0, 1, 0, "127.0.0.1")),  # python train.py
        (
            {
                "RANK": "3",
                "WORLD_SIZE": "4",
                "LOCAL_RANK": "1",
                "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "node1",
                "MASTER_PORT": "29501",
            },
            ("torchrun", 3, 4, 1, "node1"),
        ),  # fmt: skip
        (
            {
                "RANK": "1",
                "WORLD_SIZE": "2",
                "LOCAL_RANK": "1",
                "LOCAL_SIZE": "2",
                "MASTER_ADDR": "10.0.0.1",
                "MASTER_PORT": "29500",
            },
            ("deepspeed", 1, 2, 1, "10.0.0.1"),
        ),  # fmt: skip
        (SRUN, ("slurm", 1, 2, 1, "127.0.0.1")),  # a bare srun: one node, so this host
        (MPIRUN, ("openmpi", 1, 2, 1, "127.0.0.1")),  # a bare mpirun on one host
        ({**HYDRA, "MASTER_ADDR": "h0"}, ("mpich", 3, 4, 1, "h0")),  # MPICH over two hosts
        # an sbatch script's own step: SLURM_PROCID=0 of SLURM_NTASKS, but no srun task
        ({k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}, ("none", 0, 1, 0, "127.0.0.1")),
        # mpirun inside an sbatch script: Open MPI's rank, not the batch step's
        (
            {**{k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}, **MPIRUN},
            ("openmpi", 1, 2, 1, "127.0.0.1"),
        ),  # fmt: skip
        # srun over two nodes: the first host of the step's node list is the master
        (
            {
                **SRUN,
                "SLURM_STEP_NODELIST": "gpu[07-08]",
                "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
                "SLURM_TASKS_PER_NODE": "1(x2)",
                "SLURM_PROCID": "1",
                "SLURM_LOCALID": "0",
                "SLURM_NODEID": "1",
            },
            ("slurm", 1, 2, 0, "gpu07"),
        ),  # fmt: skip
    ],
)
def test_each_launcher_gives_rank_world_and_master(env, launch):
    got = launcher.read(env)
    assert (got.launcher, got.rank, got.world, got.local_rank, got.master_addr) == launch
    if got.world > 1:  # every rank of the launch meets at the same port, from the job's id
        assert got.master_port and launcher.read({**env, "SLURM_PROCID": "0"}).master_port == (
            got.master_port
        )
        exported: dict[str, str] = {}
        launcher.export(got, exported)
        assert exported == {
            "RANK": str(launch[1]), "WORLD_SIZE": str(launch[2]),
            "LOCAL_RANK": str(launch[3]), "MASTER_ADDR": launch[4],
            "MASTER_PORT": str(got.master_port),
        }  # fmt: skip


def test_two_launches_get_two_ports():
    one = launcher.read(SRUN).master_port
    assert launcher.read({**SRUN, "SLURM_JOB_ID": "8"}).master_port != one
    assert launcher.read({**SRUN, "SLURM_STEP_ID": "1"}).master_port != one
    assert 20000 <= one < 32000  # below the ephemeral ports


@pytest.mark.parametrize(
    "env, says",
    [
        ({**SRUN, "SLURM_PROCID": "one"}, "SLURM_PROCID='one' is not a whole number"),
        ({**MPIRUN, "OMPI_COMM_WORLD_SIZE": "2.0"}, "OMPI_COMM_WORLD_SIZE='2.0'"),
        ({"RANK": "0", "WORLD_SIZE": "x"}, "WORLD_SIZE='x'"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is not in 0..WORLD_SIZE-1"),
        ({**MPIRUN, "MASTER_PORT": "99999"}, "MASTER_PORT=99999 is not a TCP port"),
        ({**HYDRA}, "mpich started 4 ranks on more than one host without MASTER_ADDR"),
    ],
)
def test_an_unreadable_launch_is_one_clear_error(env, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        launcher.read(env)


def test_first_host_of_a_node_list(monkeypatch):
    monkeypatch.setattr(launcher.shutil, "which", lambda _: None)  # no SLURM tools: read here
    assert launcher.first_host("gpu[07-09,12],cpu1") == "gpu07"
    assert launcher.first_host("node-a,node-b") == "node-a"
    assert launcher.first_host("") is None


def test_a_non_integer_launcher_variable_refuses_the_run(capsys, monkeypatch, tmp_path):
    """train.py under an srun whose SLURM_PROCID is not a number: one line, exit 2, no run."""
    from training.train import main

    for k, v in {**SRUN, "SLURM_PROCID": "x1"}.items():
        monkeypatch.setenv(k, v)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(k, raising=False)
    code = main(["--data", str(tmp_path), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == "error: the launcher's SLURM_PROCID='x1' is not a whole number"
    assert "Traceback" not in err and not (tmp_path / "run").exists()
