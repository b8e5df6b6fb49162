"""Generated bad input over every input surface: flags, the DeepSpeed JSON, run files, a data
folder's manifest.json, the launcher's environment, a run's checkpoint listings and `latest`,
and the JSONL prepare reads. Each example runs the command's entry in this process (the trainer
up to the end of its preflight: nothing trains) and must end in one of two ways: accepted, or
refused with exit code 2 and exactly one `error:` line; never a traceback, and never a changed
file in the folders the input came from. hypothesis makes the inputs (random and mutated);
tests/test_train_errors.py holds the hand-written cases with their exact messages."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import training.train as train
from training.settings.run_config import settings as all_settings

# Few examples each, no per-example deadline (a preflight reads the data: ~0.1-1 s on 2 cores);
# the fixtures are reused across examples, so hypothesis's health check on them is moot.
FEW = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,  # the same inputs in every run: a failure here is a bug, not luck
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
LAUNCH_NAMES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE",
    "LOCAL_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID",
    "SLURM_STEP_ID", "SLURM_JOB_ID", "SLURM_NODEID", "SLURM_TASKS_PER_NODE",
    "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_STEP_NODELIST",
    "SLURM_JOB_NODELIST", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK", "PMI_SIZE",
    "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "PMIX_NAMESPACE",
)  # fmt: skip

# JSON values of every kind, small
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
env_text = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=10
)


def tree(*folders: Path) -> dict:
    """Every file under `folders` with its size and mtime: what "unchanged" means here."""
    return {
        str(p): (p.stat().st_size, p.stat().st_mtime_ns)
        for folder in folders
        for p in sorted(Path(folder).rglob("*"))
        if p.is_file()
    }


def outcome(capsys, entry, argv) -> tuple[int, list[str]]:
    """(exit code, the lines printed) of `entry(argv)` in this process; an exception other than
    SystemExit escapes: that is the traceback this test exists to catch."""
    try:
        code = entry(argv)
    except SystemExit as e:  # argparse: usage and one "prog: error: ..." line
        code = e.code if isinstance(e.code, int) else 2
    out = capsys.readouterr()
    return int(code or 0), (out.err + out.out).splitlines()


def accepted_or_refused(code: int, lines: list[str]) -> None:
    text = "\n".join(lines)
    assert "Traceback" not in text, text
    if code == 0:
        return
    errors = [line for line in lines if "error:" in line]
    assert code == 2 and len(errors) == 1, (code, text[-3000:])


@pytest.fixture
def trainer(monkeypatch, tmp_path):
    """train.main up to the end of its preflight: a run it accepts is not trained; a world of
    one, no launcher; checksums remembered in a cache of this test's own."""
    monkeypatch.setattr(train, "run_guarded", lambda *a, **k: 0)
    for name in LAUNCH_NAMES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return train.main


@pytest.fixture
def data_copy(tiny_data, tmp_path):
    return Path(shutil.copytree(tiny_data, tmp_path / "data"))


def base(data: Path, out: Path) -> list[str]:
    return ["--data", str(data), "--out", str(out), "--model", "tiny", "--seq-len", "32"]


# ---------------------------------------------------------------------------- the trainer
FLAGS = sorted({s.flag for s in all_settings() if s.flag})


@FEW
@given(
    st.lists(
        st.one_of(st.sampled_from(FLAGS).map(lambda f: f"--{f}"), env_text), min_size=1, max_size=4
    )
)
def test_generated_flags(trainer, capsys, tiny_data, tmp_path, argv):
    before = tree(tiny_data)
    code, lines = outcome(capsys, trainer, [*base(tiny_data, tmp_path / "run"), *argv])
    accepted_or_refused(code, lines)
    assert tree(tiny_data) == before


DS_KEYS = [
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "zero_optimization", "bf16", "fp16", "optimizer", "scheduler", "gradient_clipping",
    "activation_checkpointing", "pipeline", "steps_per_print",
]  # fmt: skip


@FEW
@given(
    st.one_of(
        st.dictionaries(st.sampled_from(DS_KEYS), json_values, max_size=4).map(json.dumps),
        st.dictionaries(
            st.just("zero_optimization"),
            st.dictionaries(
                st.sampled_from(["stage", "offload_optimizer", "overlap_comm"]), json_values
            ),
        ).map(json.dumps),
        st.text(max_size=40),  # not JSON at all
    )
)
def test_generated_ds_configs(trainer, capsys, tiny_data, tmp_path, text):
    file_given(trainer, capsys, tiny_data, tmp_path, "--ds_config", "c.json", text)


def file_given(trainer, capsys, tiny_data, tmp_path, flag: str, name: str, text: str) -> None:
    """The trainer given `text` as the file `flag` names: accepted, or refused in one line,
    and neither the data nor the file's folder changed."""
    given_file = tmp_path / "inputs" / name
    given_file.parent.mkdir(exist_ok=True)
    given_file.write_text(text)
    before = tree(tiny_data, given_file.parent)
    argv = [*base(tiny_data, tmp_path / "run"), flag, str(given_file)]
    accepted_or_refused(*outcome(capsys, trainer, argv))
    assert tree(tiny_data, given_file.parent) == before


SECTIONS = ["data", "model", "optim", "checkpoint", "engine", "eval", "logging", "host", "out"]


@FEW
@given(
    st.one_of(
        st.dictionaries(
            st.sampled_from(SECTIONS),
            st.one_of(
                json_values, st.dictionaries(st.sampled_from(FLAGS), json_values, max_size=3)
            ),
            max_size=3,
        ).map(lambda d: yaml.safe_dump(d, allow_unicode=True)),
        st.text(max_size=40),  # any text, YAML or not
    )
)
def test_generated_run_files(trainer, capsys, tiny_data, tmp_path, text):
    file_given(trainer, capsys, tiny_data, tmp_path, "--config", "run.yaml", text)


@FEW
@given(st.dictionaries(st.sampled_from(LAUNCH_NAMES), env_text, min_size=1, max_size=4))
def test_generated_launcher_environments(trainer, capsys, monkeypatch, tiny_data, tmp_path, env):
    with monkeypatch.context() as m:
        for name, value in env.items():
            m.setenv(name, value)
        before = tree(tiny_data)
        argv = base(tiny_data, tmp_path / "run")
        accepted_or_refused(*outcome(capsys, trainer, argv))
    assert tree(tiny_data) == before


def paths_in(obj, prefix=()) -> list[tuple]:
    """Every key path in a JSON value, the value itself first."""
    out = [prefix]
    items = (
        obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    )
    for k, v in items:
        out += paths_in(v, (*prefix, k))
    return out


def replaced(obj, path: tuple, value):
    """`obj` with the item at `path` replaced by `value` (removed when it is DELETE)."""
    if not path:
        return obj if value is DELETE else value
    copy = dict(obj) if isinstance(obj, dict) else list(obj)
    if len(path) == 1 and value is DELETE:
        del copy[path[0]]
    else:
        copy[path[0]] = replaced(obj[path[0]], path[1:], value)
    return copy


DELETE = object()


@settings(FEW, max_examples=100)  # many paths into the manifest, each example ~0.1 s
@given(st.data())
def test_generated_manifests(trainer, capsys, data_copy, tmp_path, data):
    """manifest.json with any one of its items replaced by another JSON value or removed, or the
    file cut short."""
    good = (data_copy / "manifest.json").read_text()
    obj = json.loads(good)
    path = data.draw(st.sampled_from(paths_in(obj)), label="path")
    value = data.draw(st.one_of(json_values, st.just(DELETE)), label="value")
    text = json.dumps(replaced(obj, path, value))
    if data.draw(st.booleans(), label="cut"):
        text = text[: data.draw(st.integers(0, len(text)), label="at")]
    (data_copy / "manifest.json").write_text(text)
    try:
        before = tree(data_copy)
        argv = base(data_copy, tmp_path / "run")
        accepted_or_refused(*outcome(capsys, trainer, argv))
        assert tree(data_copy) == before
    finally:
        (data_copy / "manifest.json").write_text(good)


@FEW
@given(
    st.one_of(st.text(max_size=30), st.sampled_from(["step_00000004", "../../etc", "", "\n"])),
    st.one_of(json_values.map(json.dumps), st.text(max_size=30), st.none()),
)
def test_generated_checkpoint_listings(trainer, capsys, tiny_data, tmp_path, latest, listing):
    """A run folder whose `latest` and complete.json say anything: resumed from a checkpoint it
    can load, or refused; the run folder as it was."""
    run = tmp_path / "run"
    shutil.rmtree(run, ignore_errors=True)
    step = run / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (step / "mp_rank_00_model_states.pt").write_bytes(b"x" * 100)
    if listing is not None:
        (step / "complete.json").write_text(listing)
    (step.parent / "latest").write_text(latest)
    before = tree(run, tiny_data)
    accepted_or_refused(*outcome(capsys, trainer, base(tiny_data, run)))
    assert tree(run, tiny_data) == before


# ---------------------------------------------------------------------------- data.prepare
@FEW
@given(
    st.one_of(
        st.binary(max_size=200),  # not text at all
        st.lists(json_values.map(json.dumps), min_size=1, max_size=4).map(
            lambda rows: "\n".join(rows).encode()
        ),
        st.lists(
            st.dictionaries(st.sampled_from(["text", "messages", "prompt", "completion", "role"]),
                            json_values, min_size=1, max_size=2).map(json.dumps),
            min_size=1, max_size=4,
        ).map(lambda rows: "\n".join(rows).encode()),
    )
)  # fmt: skip
def test_generated_jsonl_for_prepare(capsys, tiny_data, tmp_path, blob):
    """Any bytes as a .jsonl source, text or chat: prepared, or refused in one line."""
    from data.prepare import main as prepare

    src = tmp_path / "in" / "rows.jsonl"
    src.parent.mkdir(exist_ok=True)
    src.write_bytes(blob)
    out = tmp_path / "prepared"
    shutil.rmtree(out, ignore_errors=True)
    before = tree(src.parent, tiny_data)
    argv = ["--source", str(src), "--out", str(out), "--tokenizer", str(tiny_data / "tokenizer"),
            "--quiet", "--val-fraction", "0.5"]  # fmt: skip
    accepted_or_refused(*outcome(capsys, prepare, argv))
    assert tree(src.parent, tiny_data) == before


# ---------------------------------------------------------------------------- output folders
@pytest.mark.parametrize("command", ["prepare", "export"])
def test_an_output_folder_under_a_regular_file(capsys, tiny_data, tmp_path, command):
    """--out whose parent is a file: one line naming it, before any work; the file as it was."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    out = blocker / "out"
    if command == "prepare":
        from data.prepare import main as entry

        text = tmp_path / "corpus.txt"
        text.write_text("def f(x):\n    return x + 1\n" * 200)
        argv = ["--source", str(text), "--out", str(out), "--quiet",
                "--tokenizer", str(tiny_data / "tokenizer")]  # fmt: skip
    else:
        from training.checkpoints.hf_export import main as entry

        argv = [str(tmp_path / "a_run"), "--out", str(out)]
    code, lines = outcome(capsys, entry, argv)
    accepted_or_refused(code, lines)
    assert code == 2 and f"{blocker} is a file, not a folder" in lines[-1], lines
    assert blocker.read_text() == "not a folder"


def test_the_inputs_before_mutation_are_accepted(trainer, capsys, tiny_data, tmp_path):
    """What the generators start from passes the preflight: a refusal above is the mutation's."""
    code, lines = outcome(capsys, trainer, base(tiny_data, tmp_path / "run"))
    assert code == 0, lines
    assert not (tmp_path / "run").exists()  # accepted, and nothing written: nothing trained
