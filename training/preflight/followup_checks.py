"""Preflight of the background work on checkpoints (--export-every, --universal-every,
--eval-tasks): each asks for checkpoints that will exist, of an engine it can read, tasks the
harness knows; and the host has room for the job beside the ranks."""

from __future__ import annotations

from training.errors import ConfigError, EvalError
from training.loop.followups import Job
from training.settings.run_config import RunConfig

# A background export or universal conversion holds at most about two fp32 copies of the
# weights (the checkpoint's, read a parameter at a time, and the model it verifies against);
# the harness one model. What the plan adds to rank 0's host.
BYTES_PER_PARAM = 8


def plan_followups(config: RunConfig) -> tuple[Job, ...]:
    """The background jobs the flags ask for, checked; ConfigError in one line."""
    jobs = []
    if config.followups.export_every:
        jobs.append(Job("export", _every(config, "export-every", config.followups.export_every)))
    if config.followups.universal_every:
        if config.engine.backend != "deepspeed":
            raise ConfigError(
                f"--universal-every: a {config.engine.backend} checkpoint loads on any world size as "
                "it is; universal copies are for --backend deepspeed"
            )
        jobs.append(
            Job("universal", _every(config, "universal-every", config.followups.universal_every))
        )
    if config.followups.eval_tasks is not None or config.followups.eval_tasks_every:
        names = tuple(
            t.strip() for t in (config.followups.eval_tasks or "").split(",") if t.strip()
        )
        if config.followups.eval_tasks is not None and not names:
            raise ConfigError("--eval-tasks: give task names, comma-separated")
        names = names or _local_tasks()
        check_task_names(names)
        every = (
            config.followups.eval_tasks_every
            or max(config.checkpoint.save_every, 0)
            or config.optim.steps
        )
        every = _every(config, "eval-tasks-every", every)
        jobs.append(Job("tasks", every, names, config.followups.eval_tasks_limit))
    elif config.followups.eval_tasks_limit is not None:
        raise ConfigError("--eval-tasks-limit needs --eval-tasks or --eval-tasks-every")
    return tuple(jobs)


def _every(config: RunConfig, flag: str, n: int) -> int:
    if config.checkpoint.save_every == -1:
        raise ConfigError(f"--{flag} {n}: --save-every -1 saves no checkpoint to work on")
    if config.checkpoint.save_every > 0 and n % config.checkpoint.save_every:
        raise ConfigError(
            f"--{flag} {n}: must be a multiple of --save-every {config.checkpoint.save_every} (only those "
            "steps have a checkpoint)"
        )
    return n


def _local_tasks() -> tuple[str, ...]:
    from training.evaluation.local_tasks import LOCAL_TASKS

    return tuple(LOCAL_TASKS)


def check_task_names(names: tuple[str, ...]) -> None:
    """Every name a task the harness knows (the shipped local tasks without importing it)."""
    from training.evaluation import harness
    from training.evaluation.local_tasks import LOCAL_TASKS, TASKS_DIR

    if set(names) <= set(LOCAL_TASKS):
        return
    try:
        harness.task_manager(list(names), [TASKS_DIR])
    except EvalError as e:
        raise ConfigError(str(e).replace("--tasks", "--eval-tasks", 1)) from None


def background_bytes(jobs: tuple[Job, ...], n_params: int) -> int:
    """What the background job adds to rank 0's host at most (one job runs at a time)."""
    return BYTES_PER_PARAM * n_params if jobs else 0
