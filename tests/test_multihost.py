"""A real two-host job: `deepspeed --hostfile` over pdsh and ssh, one rank on each of two hosts
made on this machine with network namespaces (launch/two_hosts.py), gloo over the veth link.

Needs root, pdsh and openssh-server (.ci/run installs them); skipped, saying why, elsewhere.
By hand: sudo .venv/bin/python -m launch.two_hosts --data DATA --out RUN --model tiny
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from conftest import PY, REPO, TINY_RUN, free_port, launch, read_metrics

from launch.supervise import run_marked
from launch.two_hosts import TwoHosts, unavailable

WHY = unavailable()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        WHY is not None, reason=f"two hosts on one machine: {WHY} (see docs/testing.md)"
    ),
]

FLAGS = [
    *TINY_RUN,
    "--no-compile",  # the two hosts' ranks do not inherit the suite's ZEROSTACK_COMPILE=0
    "--steps",
    "4",
    "--peak-tflops",
    "1",
]
# One thread per rank on both layouts, so the 2-host and 1-host runs do the same arithmetic.
THREADS = {"OMP_NUM_THREADS": "1"}


def _alive(pid: int) -> bool:
    """A running process (a zombie waiting for its reparented parent to reap it is dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _gone(hosts: TwoHosts, pids: list[int]) -> None:
    """Everything the hosts made is gone: namespaces, their /etc/netns entries, processes, keys."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for ns in hosts.ns:
        assert ns not in listed
        assert not (Path("/etc/netns") / ns).exists()
    for pid in pids:
        assert not _alive(pid), pid
    for key in ("hostkey", "dotssh", "authorized_keys"):
        assert not (hosts.workdir / key).exists()


def _scheduler(tmp_path: Path) -> dict:
    """What a SLURM allocation of node1 and node2 shows the batch script: its variables, and an
    `scontrol show hostnames` that expands the node list (the scheduler is not under test)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "node1\\nnode2\\n"\n')
    scontrol.chmod(0o755)
    return {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_SUBMIT_DIR": str(REPO),
        "SLOTS_PER_NODE": "1",
    }


def test_two_host_job_matches_one_host_and_resumes_on_one(tiny_data, tmp_path):
    """The SLURM batch script on a 2-node allocation: it writes the hostfile and runs
    launch/hostfile.sh, which runs `deepspeed --hostfile` (pdsh, ssh) from node1. About 70 s:
    the one test of the real multi-host path, so it also resumes on one host in the same run."""
    run = tmp_path / "two_hosts"
    with TwoHosts(workdir=tmp_path / "hosts") as hosts:
        sshd = sorted(hosts.sshd_pids())
        env = {
            **THREADS,
            **_scheduler(tmp_path),
            "GLOO_SOCKET_IFNAME": "eth0",
            "DS_ENV_FILE": str(tmp_path / "deepspeed_env"),
            "MASTER_PORT": str(free_port()),
            "VENV": str(Path(PY).parent.parent),  # the virtualenv running these tests
        }
        args = ["--data", str(tiny_data), "--out", str(run), *FLAGS, "--stop-at", "2"]
        p = hosts.run(["bash", "launch/slurm.sbatch", *args], env=env, timeout=900)
    _gone(hosts, sshd)

    # pdsh started one launcher per host; each rank ran in its own namespace (host name and
    # address of that host) and read different data.
    out = p.stdout + p.stderr
    assert "node1 slots=1\nnode2 slots=1" in out  # the hostfile, from the allocation
    assert "pdsh -S -f 1024 -w node1,node2" in out
    assert "node1: " in out and "node2: " in out
    ranks = json.loads((run / "resolved_config.json").read_text())["ranks"]
    assert [(r["rank"], r["host"], r["addr"]) for r in ranks] == [
        (0, "node1", "10.77.0.1"),
        (1, "node2", "10.77.0.2"),
    ]
    assert ranks[0]["first_batch_sha1"] != ranks[1]["first_batch_sha1"]
    # DeepSpeed's launcher says LOCAL_SIZE=1 on each host (never LOCAL_WORLD_SIZE): one rank
    # here of two, so nothing that needs every rank on one host is on.
    record = json.loads((run / "resolved_config.json").read_text())
    assert record["host_layout"] == {
        "launcher": "deepspeed",
        "ranks_on_this_host": 1,
        "one_host": False,
    }
    assert record["shm_collectives"] is False
    assert record["switches"]["shm_collectives"]["why"] == "auto: 1 of 2 ranks on this host"
    forwarded = (tmp_path / "deepspeed_env").read_text().splitlines()
    assert {"GLOO_SOCKET_IFNAME=eth0", "OMP_NUM_THREADS=1"} <= set(forwarded)

    # The same job on one host gives the same losses.
    ref = tmp_path / "one_host"
    launch(["--data", str(tiny_data), "--out", str(ref), *FLAGS], env=THREADS)
    two = [r["loss"] for r in read_metrics(run)]
    one = [r["loss"] for r in read_metrics(ref)]
    assert len(two) == 2 and two == pytest.approx(one[:2], rel=1e-6), (two, one)

    # The 2-host checkpoint resumes on one host with one rank, through a universal checkpoint
    # (the same global batch of 4: 2 per micro-batch x 2 accumulation steps), and continues the
    # same trajectory (the 2 micro-batches now add up in another order: float rounding).
    r = launch(
        ["--data", str(tiny_data), "--out", str(run), *FLAGS, "--grad-accum", "2"],
        nproc=1,
        env=THREADS,
    )
    log = r.stdout + r.stderr
    assert "resumed from step_00000002" in log and "world 1" in log
    assert (run / "checkpoints" / "step_00000002_universal").is_dir()
    assert [x["step"] for x in read_metrics(run)] == [1, 2, 3, 4]
    resumed = [x["loss"] for x in read_metrics(run)]
    assert resumed[2:] == pytest.approx(one[2:], rel=1e-4), (resumed, one)


def test_torchrun_on_two_hosts(tiny_data, tmp_path):
    """launch/torchrun.sh started on each host, meeting through c10d rendezvous on node1, under
    ZeRO-3: the record shows it partitions across the hosts and holds nothing."""
    run = tmp_path / "torchrun"
    env = {
        **os.environ,
        **THREADS,
        "NNODES": "2",
        "RDZV_HOST": "node1",
        "RDZV_ID": f"zs-test-{os.getpid()}",
        "GLOO_SOCKET_IFNAME": "eth0",
        "VENV": str(Path(PY).parent.parent),
    }
    cmd = ["bash", "launch/torchrun.sh", "1", "--data", str(tiny_data), "--out", str(run)]
    cmd += [*FLAGS, "--steps", "2", "--save-every", "-1"]  # the last --steps wins
    cmd += ["--ds_config", "ds_configs/zero3.json"]  # partitioned across the hosts, not held
    with TwoHosts(workdir=tmp_path / "hosts") as hosts:
        node2 = subprocess.Popen(
            hosts.command(cmd, host=1),
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            hosts.run(cmd, env=env, timeout=600)
            node2_out, _ = node2.communicate(timeout=120)
        finally:
            if node2.poll() is None:
                node2.kill()
        assert node2.returncode == 0, node2_out[-3000:]
    ranks = json.loads((run / "resolved_config.json").read_text())["ranks"]
    assert sorted((r["host"], r["addr"]) for r in ranks) == [
        ("node1", "10.77.0.1"),
        ("node2", "10.77.0.2"),
    ]
    assert len(read_metrics(run)) == 2
    # One rank on each host: ZeRO-3 partitions (its persistence threshold is its own default,
    # not the whole model) and nothing is held across micro-steps.
    record = json.loads((run / "resolved_config.json").read_text())
    assert record["host_layout"] == {
        "launcher": "torchrun",
        "ranks_on_this_host": 1,
        "one_host": False,
    }
    threshold = record["ds_config"]["zero_optimization"]["stage3_param_persistence_threshold"]
    assert threshold < record["n_params"] / 10, threshold
    assert record["held_across_micro_steps"] is False
    assert record["switches"]["hold_weights"] == {
        "on": False,
        "why": "auto: 1 of 2 ranks on this host",
    }
    assert record["shm_collectives"] is False


def test_two_hosts_are_removed_when_the_job_fails(tmp_path):
    """A failure inside leaves nothing behind: a process still running on node2, both sshd,
    the namespaces and the keys all go."""
    with pytest.raises(RuntimeError, match="boom"):
        with TwoHosts(workdir=tmp_path / "hosts") as hosts:
            sshd = sorted(hosts.sshd_pids())
            hosts.run(["ssh", "node2", "nohup sleep 600 >/dev/null 2>&1 & echo $!"], timeout=30)
            stray = hosts.namespace_pids() - set(sshd)
            assert stray  # the sleeper on node2 (and its ssh session)
            raise RuntimeError("boom")
    _gone(hosts, sshd + sorted(stray))


def _workers(hosts: TwoHosts, host: int) -> list[psutil.Process]:
    """The training ranks torchrun started on host `host` (its agent has no RANK)."""
    out = []
    for pid in hosts.host_pids(host):
        try:
            p = psutil.Process(pid)
            if "RANK" in p.environ() and any(a.endswith("train.py") for a in p.cmdline()):
                out.append(p)
        except psutil.Error:
            continue
    return out


def _signal(processes: list[psutil.Process], sig: int) -> None:
    for p in processes:
        p.send_signal(sig)


def _wait_for(what: str, ok, timeout: float, *logs: Path) -> None:
    deadline = time.time() + timeout
    while not ok():
        if time.time() > deadline:
            tails = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in logs if p.exists())
            raise AssertionError(f"timed out waiting for {what}\n{tails}")
        time.sleep(0.1)


def _trained(run: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run)] if (run / "metrics.jsonl").exists() else []


def _steps_on(run: Path, world: int) -> list[int]:
    """The steps trained since the run last changed to `world` ranks (metrics' "world" records)."""
    if not (run / "metrics.jsonl").exists():
        return []
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    changes = [i for i, r in enumerate(records) if r.get("kind") == "world" and r["to"] == world]
    if not changes:
        return []
    return [r["step"] for r in records[changes[-1] :] if r.get("kind") == "train"]


def _last_loss_per_step(run: Path) -> dict[int, float]:
    """A step run again after a restart counts once, as it was trained last."""
    return {r["step"]: r["loss"] for r in read_metrics(run)}


def test_elastic_job_goes_on_without_a_lost_host_and_grows_back(tiny_data, tmp_path):
    """NNODES=1:2 launch/torchrun.sh on both hosts (c10d rendezvous on node1), --global-batch 4.
    node2 is killed whole (its torchrun agent and rank) mid-run: node1's agent restarts its rank
    on a world of one, which resumes from the last checkpoint through its universal copy,
    accumulating 2 micro-batches for the same global batch. node2's command started again joins:
    node1's rank saves at the next step and the world of two resumes. The losses match an
    uninterrupted 2-rank run's within the cross-world-size bound of tests/test_universal.py.
    About 90 s (130 s on a busy host): three rounds of rank start-up plus the reference run.
    Each phase is held open by pausing node1's rank (SIGSTOP) while the hosts change, far
    below the hang watch's 300 s floor, so the run cannot end before the host goes or returns."""
    run = tmp_path / "elastic"
    logs = [tmp_path / "node1.log", tmp_path / "node2.log", tmp_path / "node2_again.log"]
    env = {
        **os.environ,
        **THREADS,
        "NNODES": "1:2",
        "MAX_RESTARTS": "3",
        "RDZV_HOST": "node1",
        "RDZV_PORT": str(free_port()),
        "RDZV_ID": f"zs-elastic-{os.getpid()}",
        # drop a lost host's agent after 3 s without keep-alives and close a round 3 s after a
        # quorum (15 s and 30 s by default)
        "RDZV_CONF": "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3",
        "GLOO_SOCKET_IFNAME": "eth0",
        "VENV": str(Path(PY).parent.parent),
        "LOGLEVEL": "INFO",  # torchrun's agent says when it sees a host waiting to join
    }
    common = ["--data", str(tiny_data), *FLAGS, "--steps", "10", "--global-batch", "4"]
    cmd = ["bash", "launch/torchrun.sh", "1", "--out", str(run), *common, "--save-every", "2"]

    def start(host: int, log: Path) -> subprocess.Popen:
        return subprocess.Popen(
            hosts.command(cmd, host=host),
            cwd=REPO,
            env=env,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    with TwoHosts(workdir=tmp_path / "hosts") as hosts:
        node1 = start(0, logs[0])
        node2 = again = start(1, logs[1])
        try:
            # Both hosts train; once step 3 is logged (step 2's checkpoint saved), node2 goes.
            _wait_for("step 3 on two hosts", lambda: 3 in _trained(run), 600, *logs)
            rank = _workers(hosts, 0)
            _signal(rank, signal.SIGSTOP)
            for pid in hosts.host_pids(1) - hosts.sshd_pids():  # node2's agent and rank
                os.kill(pid, signal.SIGKILL)
            node2.wait(timeout=30)
            _signal(rank, signal.SIGCONT)
            # node1 goes on alone from the last checkpoint.
            _wait_for("a step on one host", lambda: _steps_on(run, 1), 300, *logs)
            rank = _workers(hosts, 0)
            _signal(rank, signal.SIGSTOP)
            again = start(1, logs[2])  # the host is back
            _wait_for(
                "node1's agent to see node2 waiting",
                lambda: "new nodes" in logs[0].read_text(),
                120,
                *logs,
            )
            _signal(rank, signal.SIGCONT)
            assert node1.wait(timeout=300) == 0, logs[0].read_text()[-4000:]
            assert again.wait(timeout=60) == 0, logs[2].read_text()[-4000:]
        finally:
            for p in (node1, node2, again):  # and TwoHosts kills what is left in the hosts
                if p.poll() is None:
                    p.kill()

    log = logs[0].read_text()
    changes = read_metrics(run, "world")
    assert [(c["from"], c["to"], c["grad_accum"]) for c in changes] == [(2, 1, 2), (1, 2, 1)], (
        changes
    )
    assert all(c["global_batch"] == 4 for c in changes)
    # each restart resumed through a universal copy of the other world's checkpoint
    assert "(universal: saved on 2 ranks, ZeRO-2)" in log, log
    assert "(universal: saved on 1 rank, ZeRO-2)" in log, log
    assert "global batch 4 kept with gradient accumulation 2" in log
    ranks = json.loads((run / "resolved_config.json").read_text())["ranks"]
    assert sorted(r["host"] for r in ranks) == ["node1", "node2"]  # grown back to both hosts

    # The same run uninterrupted on one host with two ranks: the same losses at every step,
    # within what another order of adding the micro-batches allows.
    # Through the same script and python, so DeepSpeed's JIT-built ops are not rebuilt for it.
    ref = tmp_path / "uninterrupted"
    alone = {k: v for k, v in env.items() if k not in ("NNODES", "RDZV_HOST", "RDZV_CONF")}
    argv = ["bash", "launch/torchrun.sh", "2", "--out", str(ref), *common, "--save-every", "0"]
    p, timed_out = run_marked(argv, cwd=REPO, timeout=600, env=alone, merge_stderr=True)
    assert not timed_out and p.returncode == 0, p.stdout[-4000:]
    got, want = _last_loss_per_step(run), _last_loss_per_step(ref)
    assert sorted(got) == list(range(1, 11))
    for step, loss in want.items():
        assert abs(got[step] - loss) <= 1e-3 * loss, (step, got, want)
