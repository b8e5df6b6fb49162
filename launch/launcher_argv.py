"""The command line that starts N ranks of a program on this host, under torchrun or DeepSpeed's
launcher: the one place such an argv is spelled out (tests, benchmarks and drivers build theirs
here)."""

from __future__ import annotations

import sys
from pathlib import Path

LAUNCHERS = ("torchrun", "deepspeed")


def launcher_command(
    launcher: str,
    nproc: int,
    program: list[str],
    port: int | None = None,
    python: str = sys.executable,
) -> list[str]:
    """argv that runs `program` (a script and its arguments, or ["-m", module, ...]) as `nproc`
    ranks under `launcher` ("torchrun": `python -m torch.distributed.run`; "deepspeed": the
    `deepspeed` script beside `python`). `port`: the rendezvous port, left to the launcher's
    default when None."""
    if launcher == "torchrun":
        cmd = [python, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    elif launcher == "deepspeed":
        cmd = [str(Path(python).parent / "deepspeed"), "--num_gpus", str(nproc)]
    else:
        raise ValueError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")
    if port is not None:
        cmd += ["--master_port", str(port)]
    return cmd + list(program)
