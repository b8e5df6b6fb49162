"""The host layout as each launcher hands it over (training/preflight/hosts.py), and what it
decides: the one-host holds, the shm route and the thread split see the same number."""

from __future__ import annotations

import pytest

from training.preflight.hosts import host_layout, slurm_tasks_on_node

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
