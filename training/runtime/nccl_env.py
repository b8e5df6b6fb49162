"""What NCCL runs with when the trainer starts it: the settings the field runs with so that a
failed or hung rank ends the whole job within the collective timeout (as gloo runs end today),
and leaves a trace of the last collectives each rank saw. A value the user set always stays."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULTS = {
    # a timed-out or failed collective tears its process down (torch's default, stated so a
    # launch environment that turned it off is visible in the record)
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    # one rank's NCCL error reaches the other ranks through the store, so they stop too
    # instead of waiting out the timeout
    "TORCH_NCCL_PROPAGATE_ERROR": "1",
    # the flight recorder: each rank keeps its last collectives, written out on a timeout
    "TORCH_FR_BUFFER_SIZE": "2000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
}
# Older names torch still reads (and warns about): a user who set one keeps it.
OLD_NAMES = {"TORCH_FR_BUFFER_SIZE": "TORCH_NCCL_TRACE_BUFFER_SIZE"}
TRACE_FILE = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"  # where the dumps go: a prefix, rank appended


def wanted(backend: str, env: dict, run_dir: Path) -> dict[str, str]:
    """The variables to set for a run on `backend` whose environment is `env`: none off NCCL,
    none the user set; the flight recorder's dumps go to the run folder."""
    if backend != "nccl":
        return {}
    want = {**DEFAULTS, TRACE_FILE: str(Path(run_dir) / "nccl_trace" / "rank_")}
    return {k: v for k, v in want.items() if k not in env and OLD_NAMES.get(k, k) not in env}


def apply(backend: str, run_dir: Path) -> dict[str, str]:
    """Set `wanted` in this process before its process group starts; returns what it set."""
    setting = wanted(backend, os.environ, run_dir)
    if TRACE_FILE in setting:
        Path(setting[TRACE_FILE]).parent.mkdir(parents=True, exist_ok=True)
    os.environ.update(setting)
    return setting


def in_effect(backend: str) -> dict[str, str] | None:
    """For the run record: each of these variables as the run has it (None off NCCL)."""
    if backend != "nccl":
        return None
    return {k: os.environ.get(k) for k in [*DEFAULTS, TRACE_FILE]}
