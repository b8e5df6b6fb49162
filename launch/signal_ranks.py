"""Send a signal to every rank of a running job, on whichever host it runs.

    python -m launch.signal_ranks RUN_DIR [USR1|TERM|INT]

Each rank's host and process id are in RUN_DIR/resolved_config.json ("ranks"), written when the
run starts. Ranks on this host get the signal directly; the others through `ssh HOST kill`.
This is how a job started by `deepspeed --hostfile` is asked to stop: signalling DeepSpeed's
runner instead makes it run `pkill -f` on every host, killing the ranks before they can save.
SLURM's preemption warning (launch/slurm.sbatch) comes through here.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path


def ranks_of(run_dir: str | os.PathLike) -> list[dict]:
    path = Path(run_dir) / "resolved_config.json"
    try:
        return json.loads(path.read_text())["ranks"]
    except (OSError, ValueError, KeyError):
        raise SystemExit(f"error: {path}: no rank list (has the run started?)") from None


def signal_ranks(run_dir: str | os.PathLike, sig: str = "USR1", timeout: float = 30) -> int:
    """Signal every rank; returns how many could not be reached."""
    signum = signal.Signals[f"SIG{sig.upper().removeprefix('SIG')}"]
    here = socket.gethostname()
    failed = 0
    for r in ranks_of(run_dir):
        pid = int(r["pid"])
        # Only a process that is still a trainer: a finished rank's pid may be reused.
        check = f"grep -q train.py /proc/{pid}/cmdline 2>/dev/null"
        kill = f"{check} && kill -{signum.name[3:]} {pid}"
        cmd = (
            ["sh", "-c", kill]
            if r["host"] == here
            else ["ssh", "-o", "BatchMode=yes", r["host"], kill]
        )
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            why = p.stderr.strip() or "no such trainer process (finished?)"
            print(f"rank {r['rank']} (pid {pid} on {r['host']}): {why}", file=sys.stderr)
            failed += 1
    return failed


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not 1 <= len(args) <= 2:
        print("usage: python -m launch.signal_ranks RUN_DIR [USR1|TERM|INT]", file=sys.stderr)
        return 2
    try:
        return 1 if signal_ranks(*args) else 0
    except KeyError:
        print(f"error: unknown signal {args[1]!r}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
