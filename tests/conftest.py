"""Shared fixtures: a small real dataset prepared once per session, and a launcher for real
multi-process training runs of the train entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.matrix import inputs
from benchmarks.matrix.inputs import (  # noqa: F401  (test files import them from here)
    CHATML,
    chat_rows,
    chat_tokenizer,
    pair_rows,
    write_jsonl,
)
from benchmarks.matrix.runner import rank_exit_codes  # noqa: F401  (test files import it here)
from launch.launcher_argv import launcher_command
from launch.supervise import run_marked
from training.runtime import build_locks
from training.runtime.distributed import free_port

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
# The suite's runs are a few steps of a tiny model, where compiling the blocks (the trainer's
# default on a CPU) costs more than it saves: a training launch gets --no-compile unless it
# says --compile or asks for the defaults a user gets (as_shipped=True; tests/test_compile.py).
NO_COMPILE = "--no-compile"


def train_args(args: list[str], script: str, as_shipped: bool = False) -> list[str]:
    """`args` for a launch of `script`, with the suite's --no-compile where it trains."""
    trains = script == "training/train.py" or script.endswith("_train.py")
    said = {"--compile", NO_COMPILE} & set(args)
    return args if as_shipped or not trains or said else [*args, NO_COMPILE]


def sections(**values) -> dict:
    """ds_config.resolve's keyword sections from settings named as flags (micro_batch=2,
    backend="ddp", activation_checkpointing=True): the run's optim and engine sections."""
    from training.settings.run_config import EngineConfig, OptimConfig

    optim = {k: v for k, v in values.items() if k in OptimConfig.__dataclass_fields__}
    engine = {k: v for k, v in values.items() if k in EngineConfig.__dataclass_fields__}
    out = {"optim": OptimConfig(**optim), "engine": EngineConfig(**engine)}
    if "activation_checkpointing" in values:
        out["activation_checkpointing"] = values["activation_checkpointing"]
    unknown = set(values) - set(optim) - set(engine) - {"activation_checkpointing"}
    assert not unknown, f"not an optim or engine setting: {unknown}"
    return out


def launch(
    args: list[str],
    nproc: int = 2,
    env: dict | None = None,
    timeout: float = 600,
    script: str = "training/train.py",
    check: bool = True,
    as_shipped: bool = False,
    forked: bool = True,
    launcher: str = "torchrun",
) -> subprocess.CompletedProcess:
    """Run `script` as `nproc` ranks (a real gloo group on CPU): forked from the suite's rank
    server (tests/forked_ranks.py) where the launch runs in the suite's own environment, or adds
    only ZEROSTACK_* variables (the trainer and the test scripts read them at run time) or what
    the server's has already; else, or `forked` False (the test reads torchrun's variables),
    under torchrun. Either way a failed rank stops the run as torchrun stops it, and
    `rank_exit_codes` reads what the failed ranks exited with. `as_shipped`: the trainer's
    defaults as a user gets them (compiled blocks on a CPU included). `launcher`: "torchrun" or
    "deepspeed", the launcher run, or whose ranks the forked ones look like.
    ZEROSTACK_TEST_LAUNCHED=1 runs every launch under its real launcher (tests/forked_ranks.py
    says what differs)."""
    from forked_ranks import SERVER_ENV

    env = env or {}
    program = [script, *train_args(args, script, as_shipped)]
    cmd = launcher_command(launcher, nproc, program, port=free_port(), python=PY)
    forked = forked and os.environ.get("ZEROSTACK_TEST_LAUNCHED") != "1"
    if forked and all(k.startswith("ZEROSTACK_") or SERVER_ENV.get(k) == v for k, v in env.items()):
        p, timed_out = _forked(program, nproc, timeout, cmd, env, launcher)
    else:
        p, timed_out = run_marked(cmd, cwd=REPO, timeout=timeout, env=env)
    if timed_out:
        raise AssertionError(
            f"{' '.join(cmd)} timed out after {timeout}s:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        )
    if check and p.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}"
        )
    return p


_SERVER: list = []  # the rank server, started on first use


def _forked(
    program: list[str], nproc: int, timeout: float, cmd: list[str], env=None, launcher="torchrun"
):
    """(the run as a CompletedProcess, whether it timed out), its ranks forked by the server;
    its return code is torchrun's: 1 when a rank failed."""
    import tempfile

    from forked_ranks import Server

    if not _SERVER:
        _SERVER.append(Server())
    with tempfile.TemporaryDirectory() as tmp:
        failures, out, err, timed_out = _SERVER[0].run(
            program[0], program[1:], nproc, free_port(), Path(tmp) / "rank", timeout, env, launcher
        )
    p = subprocess.CompletedProcess(cmd, 1 if failures else 0, out, err)
    p.failures = failures
    return p, timed_out


# DeepSpeed's compiled ops the slow tier's runs load, in the order they first need them
SUITE_OPS = ("ShareMemCommBuilder", "CPUAdamBuilder", "FusedAdamBuilder", "AsyncIOBuilder")


def pytest_collection_finish(session) -> None:
    """A session with slow tests builds the ops they load from the start, on idle CPU
    (tests/scripts/build_ops.py): on a cold extension cache that is about 7 minutes of a
    2-core machine (async_io alone 4) the tests would otherwise wait for. Never stopped: a
    build cut short leaves torch's lock behind, which every later load would wait on: such
    locks, left by an earlier run, go first."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for line in build_locks.clear_stale(after_s=build_locks.UNATTENDED_AFTER_S):  # one host
        if reporter is not None:
            reporter.write_line(line)
    if any(item.get_closest_marker("slow") for item in session.items):
        subprocess.Popen(
            [PY, "tests/scripts/build_ops.py", *SUITE_OPS],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )


# Skips that hide a break where .ci/run has provided what the test needs (its system packages,
# root, a git clone, the dev extra): with ZEROSTACK_CI=1, which .ci/run sets once those are in,
# a skip whose reason holds one of these fails instead. Every other skip is about the host (its
# CPU, a GPU, the kernel's cgroups, /dev/shm's size) and stays a skip there too.
MUST_RUN_ON_CI = (
    "mpirun is not installed",
    "SLURM is not installed",
    "slurmd needs root",
    "did not start",
    "the SLURM node did not come up",
    "two hosts on one machine",
    "async_io op cannot be built",
    "TRL (in the dev extra",
    "not a git checkout",
)


def ci_failure(reason: str, env=os.environ) -> str | None:
    """The failure a skip with `reason` becomes on the CI box; None where it stays a skip."""
    if env.get("ZEROSTACK_CI") != "1" or not any(m in reason for m in MUST_RUN_ON_CI):
        return None
    return f"skipped where .ci/run provides what it needs, which hides a break: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and isinstance(report.longrepr, tuple):
        failure = ci_failure(str(report.longrepr[2]))
        if failure:
            report.outcome, report.longrepr = "failed", failure


def fresh_interpreter(script: str, *args: str, env: dict | None = None):
    """`script` run by `python -c` in a fresh interpreter (nothing imported before it starts),
    with a free port as its first argument and `args` after; the JSON its last line prints."""
    p = subprocess.run(
        [sys.executable, "-c", script, str(free_port()), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def shm_has_room(ranks: int = 2) -> bool:
    """Whether /dev/shm can hold DeepSpeed's shared-memory segments (66 MiB per rank): without
    room the all-reduce route stays off (training/runtime/shm.py), and tests expect that."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= ranks * 70 * 2**20


def refused(capsys, monkeypatch, tmp_path, argv, world=2) -> str:
    """Rank 0 of a `world`-rank launch of the trainer, in this process: it must refuse `argv`
    with one line and exit code 2, before creating the run folder (tmp_path / "run")."""
    from training.train import main

    env = {"RANK": "0", "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "\n" not in err, err
    assert not (tmp_path / "run").exists()  # nothing was started
    return err


def read_metrics(run_dir: Path, kind: str = "train") -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == kind]


def loss_at(run_dir: Path, step: int) -> float:
    return next(r["loss"] for r in read_metrics(run_dir) if r["step"] == step)


def step_dir(run_dir: Path, step: int) -> Path:
    from training.checkpoints import layout

    return Path(run_dir) / "checkpoints" / layout.tag_for(step)


STATE_KEYS = ("fp32", "exp_avg", "exp_avg_sq")


def checkpoint_states(folder: Path) -> dict:
    """{name: ({fp32, exp_avg, exp_avg_sq}: full tensors, step)} of a ZeRO or universal folder,
    under the model's parameter names (a pipeline checkpoint's are renamed)."""
    from functools import partial

    import torch

    from training.checkpoints.universal_copy import model_name
    from training.checkpoints.zero_files import ZeroFiles

    if (folder / "zero").is_dir():
        load = partial(torch.load, weights_only=False)
        return {
            d.name: (
                {k: load(d / f"{k}.pt")["param"] for k in STATE_KEYS},
                float(load(d / "step.pt")),
            )
            for d in (folder / "zero").iterdir()
            if d.is_dir()
        }
    pipelined = any(folder.glob("layer_*-model_states.pt"))
    return {
        (model_name(name, s.shape) if pipelined else name): (s, float(step))
        for name, s, step in ZeroFiles(folder).params()
    }


def assert_same_state(a: Path, b: Path, tol: float | dict = 1e-5) -> None:
    """Two checkpoints' weights and Adam moments, parameter by parameter. tol: the largest
    relative difference, or {fp32|exp_avg|exp_avg_sq: that}."""
    sa, sb = checkpoint_states(a), checkpoint_states(b)
    assert sa.keys() == sb.keys()
    for name, (ta, step_a) in sa.items():
        tb, step_b = sb[name]
        assert step_a == step_b, (name, step_a, step_b)
        for key in STATE_KEYS:
            x, y = ta[key], tb[key]
            assert x.shape == y.shape, (name, key, x.shape, y.shape)
            rel = ((x - y).norm() / y.norm().clamp_min(1e-30)).item()
            assert rel <= (tol[key] if isinstance(tol, dict) else tol), (name, key, rel)


def ds_variant(tmp: Path, name: str, base: str, **changes) -> list[str]:
    """--ds_config for a shipped config with top-level keys changed (None drops a key)."""
    cfg = json.loads((REPO / "ds_configs" / base).read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path = Path(tmp) / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return ["--ds_config", str(path)]


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A real corpus (a slice of the Python standard library) tokenized with a small trained
    tokenizer: shared by every training test."""
    return inputs.text_data(tmp_path_factory.mktemp("data") / "pystdlib-tiny")


# The short tiny-model run most tests launch: 2 sequences of 64 tokens per rank and micro-step,
# a metrics line every step, no evaluation until the end.
TINY_RUN = [
    "--model", "tiny", "--seq-len", "64", "--micro-batch", "2", "--log-every", "1",
    "--eval-every", "0", "--eval-samples", "8", "--lr", "3e-3", "--warmup", "2", NO_COMPILE,
]  # fmt: skip

UNIVERSAL_ARGS = [
    "--model", "tiny", "--seq-len", "64", "--log-every", "1", "--eval-every", "0",
    "--eval-samples", "8", "--lr", "3e-3", "--warmup", "2", "--steps", "6",
]  # fmt: skip


@pytest.fixture(scope="session")
def resumed_runs(tiny_data, tmp_path_factory) -> dict:
    """The checkpoints of tests/test_universal.py, which test_export.py exports too: an
    uninterrupted 2-rank ZeRO-2 run `ref` saving every step (6 steps); runs resumed from its step 3
    that take step 4 on 1 rank ZeRO-2 (`z2_1rank`), 2 ranks ZeRO-3 (`z3_2rank`) and 1 rank ZeRO-1
    (`z1_1rank`); and `z3_2rank` continued on 1 rank ZeRO-3 to step 5. `logs` holds each
    resumed launch's output."""
    base = tmp_path_factory.mktemp("universal")

    def args(out, *extra):
        return ["--data", str(tiny_data), "--out", str(out), *UNIVERSAL_ARGS, *extra]

    ref = base / "ref"
    launch(args(ref, "--micro-batch", "2", "--save-every", "1", "--keep-last", "10"))
    src = ref / "checkpoints" / "step_00000003"
    out = {"ref": ref, "logs": {}}
    resumes = {  # name: (ranks, config, batch flags)
        "z2_1rank": (1, "zero2", ["--micro-batch", "2", "--grad-accum", "2"]),
        "z3_2rank": (2, "zero3", ["--micro-batch", "2"]),
        "z1_1rank": (1, "zero1", ["--micro-batch", "2", "--grad-accum", "2"]),
    }
    for name, (n, cfg, batch) in resumes.items():
        run = base / name
        extra = ["--ds_config", f"ds_configs/{cfg}.json", "--resume", str(src), "--stop-at", "4"]
        p = launch(args(run, *batch, *extra, "--save-every", "0"), nproc=n)
        out[name], out["logs"][name] = run, p.stdout + p.stderr
    # ZeRO-3 on 2 ranks -> ZeRO-3 on 1 rank, continuing the z3_2rank run in its own folder
    run = out["z3_2rank"]
    extra = ["--ds_config", "ds_configs/zero3.json", "--stop-at", "5", "--save-every", "0"]
    p = launch(args(run, "--micro-batch", "2", "--grad-accum", "2", *extra), nproc=1)
    out["logs"]["z3_1rank"] = p.stdout + p.stderr
    return out


@pytest.fixture(scope="session")
def chat_data(tiny_data, tmp_path_factory) -> Path:
    """Chat data prepared from `chat_rows(60)` with `chat_tokenizer`, 64-token examples."""
    return inputs.chat_data(tiny_data, tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="session")
def pairs(tiny_data, tmp_path_factory) -> dict:
    """Preference data from `pair_rows(48)`, 64-token sequences, and the tokenizer."""
    return inputs.pair_data(tiny_data, tmp_path_factory.mktemp("pairs"))
