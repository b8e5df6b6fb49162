"""The exit code a launch script ends with: the one the ranks recorded, not the launcher's own.

    python -m launch.exit_code LAUNCHER_CODE RECORD_FILE [train.py flags...]

A launcher (deepspeed, torchrun) exits with its own code: after a lost rank that is the dead
rank's (-9 -> 247), and torchrun says 1 for any failed rank. The rank that decides how a run
ended writes it (training/run_exit.py): into RUN/exit.json once it holds the run folder, and into
RECORD_FILE (ZEROSTACK_EXIT_RECORD, named by the script) always. A record counts only when it
carries this launch's ZEROSTACK_LAUNCH_ID. Prints the code to exit with, and says on stderr
why when it is not the launcher's own. Standard library only: it runs in the launch shell."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def run_dir(args: list[str]) -> Path | None:
    """--out of the train.py flags (the last one given, as argparse takes it)."""
    out = None
    for i, a in enumerate(args):
        if a == "--out" and i + 1 < len(args):
            out = args[i + 1]
        elif a.startswith("--out="):
            out = a.split("=", 1)[1]
    return Path(out) if out else None


def read(path: Path | None, launch_id: str) -> dict | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(record, dict) or record.get("launch_id") != launch_id:
        return None  # an earlier launch's, or another job's
    return record if isinstance(record.get("code"), int) else None


def main(argv: list[str]) -> int:
    own, record_file, flags = int(argv[0]), Path(argv[1]), argv[2:]
    launch_id = os.environ.get("ZEROSTACK_LAUNCH_ID", "")
    out = run_dir(flags)
    record = read(out / "exit.json" if out else None, launch_id) or read(record_file, launch_id)
    code = own if record is None else record["code"]
    if code != own:
        blamed = record.get("rank_blamed")
        who = f", rank {blamed}" if blamed is not None else ""
        print(
            f"launch: the launcher exited with {own}; the run ended with {code} "
            f"({record.get('meaning')}{who} at step {record.get('step')}: "
            f"{str(record.get('reason'))[:200]})",
            file=sys.stderr,
        )
    print(code)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
