"""Every way a run can be refused or end, in one leaf module that imports nothing of zerostack.

Exit codes: one per kind of ending, so a restart loop (or a person) can tell "resume me" from
"fix something first".

    0   finished (or --stop-at reached)
    1   unexpected error (a Python traceback says where)
    2   bad input: config, flags, data, checkpoint or environment; nothing was changed
    3   diverged: --max-bad-steps consecutive steps had a non-finite loss or gradient norm
    4   lost a rank: another rank died or stopped answering; re-run to resume
    5   could not write a checkpoint (disk full, quota, permissions); the previous one is intact
    6   hung: a step ran far longer than the run's recent steps; every rank's Python stacks are
        in RUN/hang/; re-run to resume
    75  preempted: SIGTERM, SIGUSR1 or Ctrl-C; a checkpoint was saved, re-run to resume
    130 a second Ctrl-C: stopped at once, without saving

Restart loops (launch/local.sh) retry 1, 4, 6 and 75 and stop on 0, 2, 3 and 5, which would only
fail the same way again. How a run is turned into one of these is training/run_exit.py.
"""

from __future__ import annotations

OK = 0
CRASHED = 1
BAD_INPUT = 2
DIVERGED = 3
LOST_RANK = 4
SAVE_FAILED = 5
HUNG = 6
PREEMPTED = 75  # EX_TEMPFAIL: try again later
INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


class ConfigError(ValueError):
    """A bad config or flag, found before any work starts."""


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or corrupt."""


class WeightsError(CheckpointError):
    """A checkpoint whose weights do not fit its model."""


class ExportError(ValueError):
    """A bad export request: no checkpoint, a non-empty target, a failed verification."""


class EvalError(ValueError):
    """`python -m training.evaluate` refused: an unknown task, a folder the harness cannot load,
    a run with no sealed checkpoint (training/evaluation/)."""


class LaunchError(RuntimeError):
    """The launcher's view of the world and ours disagree (this rank speaks for itself)."""


class Diverged(Exception):
    """Too many consecutive steps with a non-finite loss or gradient norm."""


class SaveFailed(Exception):
    """A checkpoint could not be written; `latest` still names the previous complete one."""
