"""Ranks forked from a process that has imported the trainer once: how the suite starts its many
short multi-rank runs whose subject is training rather than launching.

In a short test run each rank spends most of its time importing torch, transformers and
DeepSpeed (about 4 s a rank on a 2-core CPU, against 1-2 s for the run). Here one server
process imports them once; each run is `nproc` processes forked from it, each with the
environment DeepSpeed's launcher gives its ranks (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE,
MASTER_ADDR, MASTER_PORT) and the script run as __main__: the same gloo groups, engines and
files as under a launcher. Launching itself (torchrun, deepspeed, the launch scripts, signals
and exit codes through them) keeps its real launchers, in the tests about it.

    python tests/forked_ranks.py      # the server: one JSON request a line on stdin
"""

from __future__ import annotations

import json
import os
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


def _fork_rank(req: dict, rank: int) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        try:
            os.setpgid(0, req["pgid"])
        except OSError:
            pass
        world = req["nproc"]
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(req["port"]),
            **req["env"],
        )
        for fd, stream in zip((1, 2), STREAMS):
            log = f"{req['log']}.{rank}.{stream}"
            os.dup2(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        script = str(REPO / req["script"])
        sys.argv = [script, *req["args"]]
        import runpy

        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


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
    ) -> tuple[dict[int, int], str, str, bool]:
        """(the failed ranks' exit codes, what the ranks printed on stdout, on stderr, whether
        the run timed out). `env`: variables the ranks add to the server's environment; only
        those read at run time (not at import) take effect."""
        req = {"script": script, "args": args, "nproc": nproc, "port": port, "log": str(log)}
        req["env"] = env or {}
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
