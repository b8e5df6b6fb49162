"""Ranks forked from a process that has imported the trainer once: how the suite starts its many
short multi-rank runs whose subject is training rather than launching.

In a short test run each rank spends most of its time importing torch, transformers and
DeepSpeed (about 4 s a rank on a 2-core CPU, against 1-2 s for the run). Here one server
process imports them once; each run is `nproc` processes forked from it, each made to look like
a rank torchrun started (the command the tests would otherwise run, tests/conftest.py `launch`),
or DeepSpeed's launcher where the test asks for it: the launcher's variables and arguments
(DeepSpeed's --local_rank), the thread count it leaves, a fresh interpreter's random states,
the script run as __main__, and an exit through the interpreter's normal path (atexit, finalizers, a SystemExit's message on stderr). tests/test_forked_ranks.py holds
forked runs equal to launched ones, bit for bit, engine by engine.

What cannot be made equal: the hash seed (fixed when the server's interpreter started, the
same for every rank and run; nothing of ours depends on set or dict iteration of strings), the
modules' import-time state (imported once, before a run's environment is set: a variable read
at import time takes the server's value, so tests pass only ZEROSTACK_* variables, which are
read at run time), and torchrun's agent: no agent store (TORCHELASTIC_USE_AGENT_STORE is
False, so rank 0 hosts the store, as under DeepSpeed's launcher) and no error file. Launching
itself (torchrun, deepspeed, the launch scripts, signals and exit codes through them) keeps its
real launchers, in the tests about it.

    python tests/forked_ranks.py      # the server: one JSON request a line on stdin
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STREAMS = ("out", "err")  # each rank's stdout and stderr, as a launcher passes them on
SERVER_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # what the server adds to its own


# ------------------------------------------------------------------------------ the server
def serve() -> None:
    """Import what every run imports, then answer requests: {"script", "args", "nproc", "port",
    "log", "env"} -> a line {"pgid"} once the ranks run, then {"failures"} when they have
    ended."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever else prints goes to stderr, never into the answers
    global FRESH_THREADS
    FRESH_THREADS = _fresh_threads()
    import training.train  # noqa: F401  torch, transformers, DeepSpeed and the trainer

    # fork() copies only the calling thread: a lock held by another would stay held forever
    assert threading.active_count() == 1, threading.enumerate()
    for line in sys.stdin:
        req = json.loads(line)
        pids = []
        for rank in range(req["nproc"]):  # one process group: a run that times out dies whole
            pids.append(_fork_rank({**req, "pgid": pids[0] if pids else 0}, rank))
            try:
                os.setpgid(pids[-1], pids[0])  # the rank does it too; whoever comes first
            except OSError:
                pass  # the rank has done it, or has already ended
        answers.write(json.dumps({"pgid": pids[0]}) + "\n")
        answers.flush()
        answers.write(json.dumps({"failures": _watch(pids)}) + "\n")
        answers.flush()


def _watch(pids: list[int]) -> dict[int, int]:
    """Wait for the ranks as torchrun's agent does: it looks every 0.1 s (its
    --monitor-interval); once a rank has failed, the others get SIGTERM, then SIGKILL 30 s
    later. Returns the exit codes that are not 0, by rank (torchrun's failure summary)."""
    codes: dict[int, int] = {}
    kill_at = None
    while len(codes) < len(pids):
        for rank, pid in enumerate(pids):
            if rank not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[rank] = os.waitstatus_to_exitcode(status)
        if kill_at is None and any(codes.values()):
            kill_at = time.monotonic() + 30
            _signal_live(pids, codes, signal.SIGTERM)
        elif kill_at is not None and time.monotonic() > kill_at:
            _signal_live(pids, codes, signal.SIGKILL)
            kill_at = float("inf")
        time.sleep(0.1)
    return {r: c for r, c in codes.items() if c}


def _signal_live(pids: list[int], codes: dict, sig: int) -> None:
    for rank, pid in enumerate(pids):
        if rank not in codes:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def launcher_env(
    launcher: str, rank: int, world: int, port: int, omp: str | None
) -> dict[str, str | None]:
    """The variables `launcher` ("torchrun": one host, no rendezvous id; "deepspeed": its
    launcher on one host) gives rank `rank` of `world`, less torchrun's agent's (see the module's
    doc); `omp`: OMP_NUM_THREADS where the launcher was started (torchrun sets 1 for several
    ranks when unset, nothing for one; DeepSpeed's leaves it). None: a variable the rank must not
    have. DeepSpeed's launcher also passes --local_rank (`launcher_args`)."""
    common = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)}
    common |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": omp}
    if launcher == "deepspeed":
        return common | {
            "LOCAL_SIZE": str(world),
            "CROSS_RANK": "0",
            "CROSS_SIZE": "1",
            "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(world))),
            "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
        }
    return common | {
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": str(world),
        "ROLE_WORLD_SIZE": str(world),
        "GROUP_WORLD_SIZE": "1",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "OMP_NUM_THREADS": omp if omp is not None else ("1" if world > 1 else None),
    }


def launcher_args(launcher: str, rank: int) -> list[str]:
    """What `launcher` puts before the script's own arguments."""
    return [f"--local_rank={rank}"] if launcher == "deepspeed" else []


FRESH_THREADS = 0  # torch's threads in a new interpreter without OMP_NUM_THREADS (serve sets it)


def _fresh_threads() -> int:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    code = "import torch; print(torch.get_num_threads())"
    return int(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, check=True).stdout)  # fmt: skip


def _as_a_new_interpreter() -> None:
    """Reset what a new interpreter starts with and a fork copies from the server: torch's
    thread count (the server imported it with one thread; a new interpreter takes
    OMP_NUM_THREADS, else its default), and Python's, NumPy's and torch's random states, each
    seeded from the OS as at start-up."""
    import numpy as np
    import torch

    omp = os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(int(omp) if omp else FRESH_THREADS)
    random.seed()
    np.random.seed()
    torch.seed()


def _fork_rank(req: dict, rank: int) -> int:
    pid = os.fork()
    if pid:
        return pid
    # The rank. Whatever it raises or exits with unwinds to the interpreter, which ends it as it
    # ends a launched rank: its traceback or SystemExit message on stderr, the exit code, atexit.
    try:
        os.setpgid(0, req["pgid"])
    except OSError:
        pass
    launcher = req["launcher"]
    for name, value in launcher_env(launcher, rank, req["nproc"], req["port"], req["omp"]).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    os.environ.update(req["env"])
    for fd, stream in zip((1, 2), STREAMS, strict=True):
        log = f"{req['log']}.{rank}.{stream}"
        os.dup2(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    _as_a_new_interpreter()
    script = str(REPO / req["script"])
    sys.argv = [script, *launcher_args(launcher, rank), *req["args"]]
    import runpy

    runpy.run_path(script, run_name="__main__")
    sys.exit(0)


# ------------------------------------------------------------------------------ the client
class Server:
    """The server process, started on first use and kept for the session."""

    def __init__(self):
        env = {**os.environ, **SERVER_ENV}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [sys.executable, __file__],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def _answer(self, deadline: float) -> dict | None:
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, left))
            if not ready:
                return None
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the rank server ended ({self.proc.poll()})")
            return json.loads(line)

    def run(
        self,
        script: str,
        args: list[str],
        nproc: int,
        port: int,
        log: Path,
        timeout: float,
        env: dict[str, str] | None = None,
        launcher: str = "torchrun",
    ) -> tuple[dict[int, int], str, str, bool]:
        """(the failed ranks' exit codes, what the ranks printed on stdout, on stderr, whether
        the run timed out). `env`: variables the ranks add to the server's environment; only
        those read at run time (not at import) take effect. `launcher`: whose ranks they look
        like, "torchrun" or "deepspeed"."""
        req = {"script": script, "args": args, "nproc": nproc, "port": port, "log": str(log)}
        req["env"], req["omp"] = env or {}, os.environ.get("OMP_NUM_THREADS")
        req["launcher"] = launcher
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        started = self._answer(time.monotonic() + 120)
        if started is None:
            raise RuntimeError("the rank server did not start the ranks within 120 s")
        deadline = time.monotonic() + timeout
        done = self._answer(deadline)
        timed_out = done is None
        if timed_out:
            os.killpg(started["pgid"], signal.SIGKILL)
            done = self._answer(time.monotonic() + 60)
            if done is None:
                raise RuntimeError("the ranks outlived a SIGKILL to their process group")
        out, err = ("".join(_read(Path(f"{log}.{r}.{s}")) for r in range(nproc)) for s in STREAMS)
        return {int(r): c for r, c in done["failures"].items()}, out, err, timed_out


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


if __name__ == "__main__":
    serve()
