"""Check the environment a training run needs and say what is wrong, in plain words.

    python -m launch.doctor --out runs/x --data data_cache/pystdlib
    torchrun --nproc_per_node 2 -m launch.doctor --out runs/x            (any launcher, N ranks)
    deepspeed --num_gpus 2 launch/doctor.py --out runs/x

Every rank runs every check; rank 0 prints one line per check (ok, warn or FAIL), naming the
ranks where the answer differs. Checks: the launcher's environment (ranks, world size,
master), versions of torch, deepspeed and transformers (the same on every rank, and the pinned
ones), the accelerator and its communication backend, a process group, an all-reduce and a
broadcast across all ranks with the expected result, free space in the output folder (and
that it is writable), and the prepared data's manifest. Exit status 0 when nothing failed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from training.errors import ConfigError
from training.runtime import launcher

REPO = Path(__file__).resolve().parent.parent
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Check the environment a zerostack run needs.")
    p.add_argument("--out", default="runs", help="the run folder (or its parent) to check")
    p.add_argument("--data", default=None, help="a prepared data folder to check")
    p.add_argument("--verify-data", action="store_true", help="also check shard checksums")
    p.add_argument("--min-free-gb", type=float, default=5.0, help="warn below this much space")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds for each collective")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


# ------------------------------------------------------------------------------ the checks
def check_launcher() -> tuple[str, str]:
    """The launch as the trainer will read it (training/runtime/launcher.py)."""
    env = os.environ
    have = [k for k in LAUNCH_ENV if k in env]
    if have and len(have) < len(LAUNCH_ENV):
        missing = [k for k in LAUNCH_ENV if k not in env]
        return "FAIL", (
            f"{', '.join(have)} set but not {', '.join(missing)}: start through torchrun or "
            "deepspeed, or unset them to run one process"
        )
    try:
        here = launcher.read(env)
    except ConfigError as e:
        return "FAIL", str(e)
    if here.launcher == "none":
        return "ok", "no launcher: a world of one process"
    if "TORCHELASTIC_RUN_ID" not in env and here.launcher == "torchrun":
        name = "a launcher"
    else:
        name = here.launcher
    port = here.master_port if here.master_port is not None else "any free port"
    return "ok", f"{name}: world of {here.world}, master {here.master_addr}:{port}"


def versions() -> dict[str, str]:
    import deepspeed
    import torch
    import transformers

    return {
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
    }


def check_versions(v: dict[str, str]) -> tuple[str, str]:
    pins = {}
    req = REPO / "requirements.txt"
    if req.is_file():
        for line in req.read_text().splitlines():
            name, sep, version = line.split("#")[0].strip().partition("==")
            if sep:
                pins[name.strip()] = version.strip()
    text = ", ".join(f"{k} {x}" for k, x in v.items())
    off = [
        f"{k} {v[k]} (requirements.txt pins {pin})"
        for k, pin in pins.items()
        if k in v and v[k].split("+")[0] != pin
    ]
    if off:
        return "warn", f"{text}; not the pinned versions: {', '.join(off)}"
    return "ok", text


def check_backend() -> tuple[str, str, str | None]:
    import torch.distributed as dist

    from training.runtime.distributed import accelerator

    acc = accelerator()
    backend = acc.communication_backend_name()
    name = acc.device_name()
    count = acc.device_count() if name != "cpu" else os.cpu_count()
    what = f"{backend} on {name} ({count} {'cores' if name == 'cpu' else 'devices'} here)"
    if not dist.is_available():
        return "FAIL", "this torch was built without torch.distributed", None
    if not dist.is_backend_available(backend):
        return "FAIL", f"{what}: torch has no {backend} backend on this machine", None
    return "ok", what, backend


def check_disk(out: str, min_free_gb: float) -> tuple[str, str]:
    path = Path(out).resolve()
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        return "FAIL", f"{path}: {probe} exists and is not a folder"
    free = shutil.disk_usage(probe).free / 2**30
    test = probe / f".zerostack-doctor-{socket.gethostname()}-{os.getpid()}"
    try:
        with open(test, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
        test.unlink()
    except OSError as e:
        return "FAIL", f"{probe} is not writable ({e.strerror})"
    where = f"{probe}" + ("" if probe == path else f" (for {path}, which does not exist yet)")
    if free < min_free_gb:
        return "warn", f"{where}: only {free:.1f} GiB free (--min-free-gb {min_free_gb:g})"
    return "ok", f"{where}: {free:,.1f} GiB free, writable"


def check_data(data: str | None, verify: bool) -> tuple[str, str]:
    if data is None:
        return "skip", "no --data given"
    from data import DataError, load_data

    try:
        m = load_data(data, verify=verify)
    except DataError as e:
        return "FAIL", str(e)
    counts = ", ".join(f"{s.tokens:,} {name} tokens" for name, s in m.splits.items())
    return "ok", f"{data}: {counts}, vocab {m.vocab_size}, source {m.source}" + (
        ", checksums verified" if verify else ""
    )


def collectives(world: int, rank: int, device) -> list[tuple[str, str, str]]:
    """An all-reduce and a broadcast with known answers, and a timed 16 MiB all-reduce."""
    import torch
    import torch.distributed as dist

    out = []
    t = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(t)
    want = world * (world + 1) / 2
    got = t.item()
    out.append(
        (
            "all-reduce",
            "ok" if got == want else "FAIL",
            f"sum of 1..{world} over {_ranks(world)} = {got:g}"
            + ("" if got == want else f", expected {want:g}: the ranks disagree"),
        )
    )
    b = torch.arange(1024, dtype=torch.float32, device=device) * (1.0 if rank == 0 else -1.0)
    dist.broadcast(b, src=0)
    intact = bool(torch.equal(b, torch.arange(1024, dtype=torch.float32, device=device)))
    out.append(
        (
            "broadcast",
            "ok" if intact else "FAIL",
            "rank 0's tensor arrived intact" if intact else "rank 0's tensor arrived changed",
        )
    )
    big = torch.ones(4 * 2**20, dtype=torch.float32, device=device)
    dist.all_reduce(big)  # warm up the connections
    start = time.perf_counter()
    dist.all_reduce(big)
    if device.type != "cpu":
        torch.accelerator.synchronize()
    ms = torch.tensor([(time.perf_counter() - start) * 1e3], device=device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)  # the slowest rank's time
    ms = ms.item()
    ok = bool((big == world * world).all())  # ones, reduced twice
    bus = 2 * (world - 1) / world * big.numel() * 4 / (ms / 1e3) / 1e9 if world > 1 else 0
    out.append(
        (
            "bandwidth",
            "ok" if ok else "FAIL",
            f"16 MiB all-reduce in {ms:.1f} ms ({bus:.2f} GB/s bus)"
            + ("" if ok else "; wrong result"),
        )
    )
    return out


# ------------------------------------------------------------------------------ running
def run(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    results: list[tuple[str, str, str]] = []  # (check, status, text) of this rank
    status, text = check_launcher()
    results.append(("launcher", status, text))
    launcher_ok = status == "ok"
    v = versions()
    results.append(("versions", *check_versions(v)))
    status, text, backend = check_backend()
    results.append(("backend", status, text))
    results.append(("disk", *check_disk(a.out, a.min_free_gb)))
    results.append(("data", *check_data(a.data, a.verify_data)))

    here = launcher.read() if launcher_ok else None
    rank, world = (here.rank, here.world) if here else (0, 1)
    if not (launcher_ok and backend):
        results.append(("process group", "skip", "not started: fix the lines above first"))
        return report([results], [socket.gethostname()], rank, world, alone=True)

    import torch.distributed as dist

    from training.runtime import distributed as D

    try:
        info = D.setup(timeout_s=a.timeout, local_rank_arg=a.local_rank)
    except Exception as e:
        results.append(
            (
                "process group",
                "FAIL",
                f"could not start one within {a.timeout:g}s ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:200]}); check that every rank can reach "
                f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} and the "
                "network interface (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)",
            )
        )
        return report([results], [socket.gethostname()], rank, world, alone=True)
    results.append(("process group", "ok", f"{info.backend}, {_ranks(info.world)}"))
    try:
        results += collectives(info.world, info.rank, info.device)
        everyone = [None] * info.world
        dist.all_gather_object(everyone, (results, socket.gethostname(), v))
    except Exception as e:
        results.append(
            (
                "all-reduce",
                "FAIL",
                f"a collective failed or timed out after {a.timeout:g}s ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:200]}): a rank cannot reach the others",
            )
        )
        return report([results], [socket.gethostname()], info.rank, info.world, alone=True)
    per_rank = [r for r, _, _ in everyone]
    hosts = [h for _, h, _ in everyone]
    if len({tuple(sorted(x.items())) for _, _, x in everyone}) > 1:  # version skew across hosts
        for r, (_, _, x) in zip(per_rank, everyone):
            i = [c for c, _, _ in r].index("versions")
            r[i] = ("versions", "FAIL", "not the same on every rank: " + check_versions(x)[1])
    code = report(per_rank, hosts, info.rank, info.world)
    D.teardown()
    return code


def report(per_rank, hosts, rank: int, world: int, alone: bool = False) -> int:
    """Rank 0 prints (every rank when the ranks could not share results). 1 if a FAIL."""
    failed = any(s == "FAIL" for results in per_rank for _, s, _ in results)
    if rank != 0 and not alone:
        return int(failed)
    lines = []
    prefix = f"[rank {rank}] " if alone and world > 1 else ""
    n_hosts = len(set(hosts))
    lines.append(
        f"{prefix}zerostack doctor: {_ranks(world)}"
        + (
            ""
            if alone
            else f" on {n_hosts} host{'s' * (n_hosts > 1)} ({', '.join(sorted(set(hosts)))})"
        )
    )
    for i, (check, _, _) in enumerate(per_rank[0]):
        answers: dict[tuple[str, str], list[int]] = {}
        for r, results in enumerate(per_rank):
            answers.setdefault(results[i][1:], []).append(r if not alone else rank)
        for (status, text), ranks in answers.items():
            who = "" if len(answers) == 1 or alone else f"{_span(ranks)}: "
            lines.append(f"{prefix}{status:<5} {check:<13} {who}{text}")
    lines.append(
        f"{prefix}verdict: "
        + ("something is wrong: see the FAIL lines" if failed else "ready to train")
    )
    print("\n".join(lines), flush=True)
    return int(failed)


def _span(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ",".join(map(str, ranks))


def _ranks(n: int) -> str:
    return f"{n} rank{'s' * (n != 1)}"


def main(argv: list[str] | None = None) -> int:
    return run(argv)


def cli() -> None:
    """The `zerostack-doctor` command and `launch/doctor.py` run as a script: main's exit code,
    through distributed.exit_process (the checks ran collectives)."""
    code = main()
    from training.runtime import distributed

    distributed.exit_process(code)


if __name__ == "__main__":
    cli()
