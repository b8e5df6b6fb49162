"""The run's configuration: one typed tree (training/settings/run_config.py), read from the flags
over a run file (--config), grouped in --help and in docs/settings.md as declared, each section
read only by its owner, and a run replayed from the file it writes."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml
from conftest import REPO, TINY_RUN, launch, rank_exit_codes, read_metrics

from training.errors import ConfigError
from training.settings import flags, runfile, settings_doc
from training.settings import run_config as tree
from training.settings.run_config import GROUPS, RunConfig, flat, nested, settings

BASE = ["--data", "D", "--out", "O"]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ------------------------------------------------------------------------ the file and the flags
def test_flags_override_the_run_file_which_overrides_the_defaults(tmp_path):
    path = write(tmp_path, "optim: {lr: 1e-3, steps: 7}\nengine: {backend: ddp}\nout: R\n")
    c = flags.parse(["--config", path, "--data", "D", "--steps", "9"])
    assert c.optim.lr == 1e-3  # YAML reads 1e-3 as a string: validated to a number
    assert (c.optim.steps, c.engine.backend, c.out) == (9, "ddp", "R")
    assert c.optim.seed == RunConfig.__dataclass_fields__["optim"].default_factory().seed


def test_every_shipped_example_round_trips(tmp_path):
    """Each example run file, loaded over the required settings, written back as the tree and
    loaded again, is the same run; the written file is the same text twice."""
    assert EXAMPLES, "no example run files"
    for path in EXAMPLES:
        first = flags.parse(["--config", str(path), *BASE])
        given = yaml.safe_load(path.read_text())
        for section, values in given.items():  # everything the file says is what the tree holds
            for key, value in values.items():
                if f"{section}.{key}" == "data.path":  # BASE's --data overrides it
                    continue
                held = getattr(getattr(first, section), key)
                assert (held.as_text() if hasattr(held, "as_text") else held) == value or (
                    isinstance(value, str) and float(value) == held
                ), (path.name, section, key)
        again = tmp_path / path.name
        runfile.dump(nested(first), again)
        second = flags.parse(["--config", str(again)])
        assert second == first, path.name
        runfile.dump(nested(second), tmp_path / "twice.yaml")
        assert (tmp_path / "twice.yaml").read_text() == again.read_text()


def test_a_runs_record_is_a_run_file(tmp_path):
    """resolved_config.json's `config` (JSON is YAML) loads as the run it records."""
    c = flags.parse([*BASE, "--lora", "r=8,targets=q_proj,v_proj", "--steps", "12"])
    record = {"config": nested(c), "flags": {}, "ds_config": {}}
    path = write(tmp_path, json.dumps(record), "resolved_config.json")
    assert flags.parse(["--config", path]) == c


def _bad_files():
    """(file text, what the one line must say): a mistake at every level of the tree."""
    yield "optim: [1, 2]\n", "optim must be a mapping"
    yield "- a\n- b\n", "a run file is a mapping of sections"
    yield "optim: {lr: [1\n", "not valid YAML (line 2, column 1)"
    for s in settings():
        if s.hidden:
            continue
        section = s.section
        if section:
            yield f"{section}: {{{s.name}x: 1}}\n", f"unknown setting {section}.{s.name}x"
        kind, choices = flags.base_type(s.kind)
        if choices:
            yield f"{section}: {{{s.name}: nonsense}}\n", f"{s.path}: input should be"
        elif kind in (int, float) and section:
            yield f"{section}: {{{s.name}: many}}\n", f"{s.path}: input should be a valid"
            # a number in quotes is text, as in the DeepSpeed JSON: lax reading took "10" as 10
            yield f'{section}: {{{s.name}: "10"}}\n', f"{s.path}: input should be a valid"
        elif kind is bool and section:
            yield f'{section}: {{{s.name}: "yes"}}\n', f"{s.path}: input should be a valid"
    for name in tree.SECTIONS:
        yield f"{name[:-1]}{name[-1]}s: {{}}\n", f"unknown section '{name}s'"


@pytest.mark.parametrize("text, says", list(_bad_files()))
def test_a_bad_run_file_is_one_line_naming_file_and_setting(tmp_path, text, says):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        flags.parse(["--config", path, *BASE])
    line = str(e.value)
    assert "\n" not in line and path in line and says in line, line


def test_a_run_files_numbers_are_read_as_yaml_12_does(tmp_path):
    """3e-4 without a dot is a float (PyYAML's YAML 1.1 reads it as text), an integer is a
    float where a float is asked, and a switch takes YAML's true/false."""
    text = "optim: {lr: 3e-4, min_lr_ratio: 0, steps: 10}\ncheckpoint: {async_save: true}\n"
    c = flags.parse(["--config", write(tmp_path, text), *BASE])
    assert (c.optim.lr, c.optim.steps, c.checkpoint.async_save) == (3e-4, 10, True)


def test_a_missing_run_file_or_required_setting_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="--config .*nope.yaml: no such file"):
        flags.parse(["--config", str(tmp_path / "nope.yaml"), *BASE])
    with pytest.raises(ConfigError, match="--data is required.*data.path in"):
        flags.parse(["--config", write(tmp_path, "out: O\n"), "--steps", "3"])
    with pytest.raises(ConfigError, match="unknown setting optim.lrr .did you mean 'lr'"):
        flags.parse(["--config", write(tmp_path, "optim: {lrr: 1}\n"), *BASE])


def test_a_bad_lora_spec_is_refused_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match="--lora r=x: r=x is not a number"):
        flags.parse([*BASE, "--lora", "r=x"])
    with pytest.raises(ConfigError, match="unknown key 'rank'"):
        flags.parse(["--config", write(tmp_path, "model: {lora: 'rank=4'}\n"), *BASE])


# ---------------------------------------------------------------------- --help and the reference
def _help_sections() -> dict[str, str]:
    """--help-all's text of each group, by title."""
    text = flags.parser(full=True).format_help()
    parts = {}
    titles = ["run", *(t for t, _ in GROUPS), "other spellings"]
    for i, title in enumerate(titles):
        start = text.index(f"\n{title}:\n")
        end = text.index(f"\n{titles[i + 1]}:\n") if i + 1 < len(titles) else len(text)
        parts[title] = text[start:end]
    return parts


def test_help_lists_every_setting_in_its_group_with_its_default():
    parts = _help_sections()
    group_of = {s: t for t, sections in GROUPS for s in sections} | {"": "run"}
    for s in settings():
        if s.hidden:
            continue
        part = " ".join(parts[group_of[s.section]].split())
        assert s.flag in part, (s.flag, group_of[s.section])
        after = part[re.search(rf"(?<![\w-]){s.flag}[ ,]", part).start() :]
        said = after[after.index("(default: ") :]  # this flag's: the first after it
        squeeze = lambda text: "".join(text.split())  # noqa: E731  (argparse wraps at hyphens)
        assert squeeze(said).startswith(squeeze(f"(default: {flags.default_text(s)})")), s.flag
    assert list(parts)[-2] == "host tuning"  # the machine's knobs come last


@pytest.mark.slow  # two processes that import the trainer
def test_help_fits_a_screen_and_help_all_has_the_rest(tmp_path):
    """`train.py --help` at 80 columns: the common settings in their groups, each flag once,
    in at most 120 lines; --help-all every setting; an alias --help leaves out still works."""
    env = {**os.environ, "COLUMNS": "80"}
    run = [sys.executable, "training/train.py"]
    short = subprocess.run([*run, "--help"], cwd=REPO, env=env, capture_output=True, text=True)
    lines = short.stdout.splitlines()
    assert short.returncode == 0 and len(lines) <= 120, len(lines)
    by_path = {s.path: s for s in settings()}
    for path in flags.COMMON:
        assert by_path[path].flag in short.stdout, path
    assert "--max_steps" not in short.stdout and "--help-all" in short.stdout
    full = subprocess.run([*run, "--help-all"], cwd=REPO, env=env, capture_output=True, text=True)
    assert full.returncode == 0
    for s in settings():
        assert s.hidden or s.flag in full.stdout, s.flag
    assert flags.parse([*BASE, "--max_steps", "7"]).optim.steps == 7


def test_the_settings_reference_is_rendered_from_the_tree():
    doc = settings_doc.DOC.read_text()
    assert settings_doc.rewrite(doc) == doc, "run python -m training.settings.settings_doc"


def test_a_new_setting_appears_in_help_and_in_the_reference(monkeypatch):
    """A field added to a section needs nothing else to be a flag in its group, a key of the
    run file and a row of docs/settings.md."""

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Checkpoint(tree.CheckpointConfig):
        verify_every: int = tree.setting(0, "hash every N-th checkpoint again", low=0, need="0+")

    fields = {f.name: (f.type, f) for f in dataclasses.fields(RunConfig)}
    fields["checkpoint"] = (Checkpoint, dataclasses.field(default_factory=Checkpoint))
    Run = dataclasses.make_dataclass(
        "RunConfig",
        [(n, t, f) for n, (t, f) in fields.items()],
        frozen=True,
        kw_only=True,
        namespace={"__module__": tree.__name__},
    )
    hints = typing.get_type_hints(RunConfig) | {"checkpoint": Checkpoint}
    monkeypatch.setattr(tree, "RunConfig", Run)
    monkeypatch.setattr(tree, "SECTIONS", {**tree.SECTIONS, "checkpoint": Checkpoint})
    monkeypatch.setattr(typing, "get_type_hints", _hints_with(Run, hints))
    assert "--verify-every" in _help_sections()["checkpoints"]
    assert "| `--verify-every` | `checkpoint.verify_every` | 0 |" in settings_doc.render()


def _hints_with(cls, hints):
    real = typing.get_type_hints

    def get(obj, *a, **k):
        return hints if obj is cls else real(obj, *a, **k)

    return get


# ------------------------------------------------------------------------------ who reads what
ENTRY_POINTS = ("training.preflight",)  # and every module directly in training/
# Each section's class, and the packages below the entry points that may be handed it.
OWNERS = {
    "EngineConfig": ("training.engines", "training.settings"),
    "OptimConfig": ("training.settings", "training.memory"),
    "CheckpointConfig": ("training.loop",),
}
TREE_MODULES = (
    "training.settings.run_config",
    "training.settings.flags",
    "training.settings.runfile",
)


def _module(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def _imports_from_config(tree_: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree_):
        if isinstance(node, ast.ImportFrom) and node.module == "training.settings.run_config":
            names |= {a.name for a in node.names}
    return names


def test_a_section_is_read_only_by_its_owner_and_the_entry_points():
    wrong = []
    for path in (REPO / "training").rglob("*.py"):
        module = _module(path)
        entry = module.count(".") == 1 or module.startswith(ENTRY_POINTS) or module in TREE_MODULES
        for name in _imports_from_config(ast.parse(path.read_text())):
            if entry or name in ("settings", "flat", "nested", "Setting", "GROUPS", "REQUIRED"):
                continue
            owners = OWNERS.get(name, ())
            if not any(module.startswith(o) for o in owners):
                wrong.append(f"{module} imports {name} (its owners: {owners or 'entry points'})")
    assert not wrong, "\n".join(wrong)


def _attribute_reads() -> set[tuple[str, str]]:
    """(X, name) for every `... X.name` read in training/ outside the tree's own modules, X the
    last name before it (`config.optim.lr` and `optim.lr` are both ("optim", "lr"))."""
    reads = set()
    for path in (REPO / "training").rglob("*.py"):
        if _module(path) in TREE_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                owner = node.value
                last = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                reads.add((last, node.attr))
    return reads


def test_every_setting_has_a_reader():
    reads = _attribute_reads()
    unread = [
        s.path
        for s in settings()
        if s.section and (s.section, s.name) not in reads and ("config", s.name) not in reads
    ]
    assert not unread, f"settings nothing reads: {unread}"


def test_the_reader_check_sees_an_unread_setting():
    assert ("optim", "no_such_setting") not in _attribute_reads()
    assert ("optim", "lr") in _attribute_reads()


def test_no_untyped_settings_dict_remains():
    """No `flags.get("...")`/`settings.get(...)`: settings travel typed, never as a dict read
    with restated defaults."""
    found = []
    for root in ("training", "benchmarks", "launch"):
        for path in (REPO / root).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "get"
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id in ("flags", "settings")
                ):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, found


# ------------------------------------------------------------------------ preflight's resolution
def test_preflight_makes_every_auto_and_not_given_concrete(tiny_data, tmp_path):
    from training.preflight import prepare_run

    config = flags.parse(["--data", str(tiny_data), "--out", str(tmp_path / "run"), *TINY_RUN])
    prepared = prepare_run(config, world=2)
    r = prepared.config
    assert prepared.asked == config and config.optim.warmup == 2 and config.optim.eps is None
    assert None not in [v for k, v in vars(r.optim).items()], r.optim
    assert (r.optim.micro_batch, r.optim.warmup, r.optim.eps) == (2, 2, 1e-8)
    assert r.model.attention != "auto" and r.model.compile is False  # TINY_RUN: --no-compile
    zero2 = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    assert r.engine.ds_config == zero2 and r.engine.precision in ("bf16", "fp32")
    assert prepared.config_path.endswith("zero2.json")
    assert r.host.hold_weights == "off" and r.host.zero3_whole_blocks == "off"  # ZeRO-2
    assert {"optim.eps", "engine.precision", "model.compile", "host.grad_sum"} <= set(prepared.why)
    assert prepared.why["model.compile"] == "--no-compile"
    overlap = prepared.why["ds_config.zero_optimization.overlap_comm"]
    assert overlap.startswith("auto: off on cpu"), overlap


# Layouts whose resolution decides the most (stages, switches, the schedule, the optimizer)
REPLAYED = {
    "zero2": [],
    "zero3": ["--ds_config", "ds_configs/zero3.json"],
    "ddp": ["--backend", "ddp"],
    "fsdp": ["--backend", "fsdp"],
    "pipeline": ["--ds_config", "ds_configs/pipeline.json", "--grad-accum", "2"],
    "offload": ["--ds_config", "ds_configs/zero2_offload.json"],
    "muon_wsd": ["--optimizer", "muon", "--schedule", "wsd", "--steps", "20"],
}


@pytest.mark.parametrize("extra", REPLAYED.values(), ids=REPLAYED.keys())
def test_the_resolved_tree_resolves_to_itself(tiny_data, tmp_path, extra):
    """What a run writes as RUN/run.yaml (the resolved tree, its DeepSpeed config inline),
    passed back as --config, resolves to the same tree and the same DeepSpeed config, with no
    `auto` or "not given" left in it: the run file is a replay, not the request."""
    from training.preflight import prepare_run

    args = ["--data", str(tiny_data), "--out", str(tmp_path / "run"), *TINY_RUN, *extra]
    first = prepare_run(flags.parse(args), world=2)
    path = tmp_path / "run.yaml"
    runfile.dump(nested(first.config), path, "a header\nof two lines")
    asked = flags.parse(["--config", str(path)])
    assert isinstance(asked.engine.ds_config, dict)
    again = prepare_run(asked, world=2)
    assert nested(again.config) == nested(first.config)
    assert again.ds_config == first.ds_config
    left = {k for k, v in flat(asked).items() if v is None or v == "auto"}
    # what stays as asked: the switches that change no number and follow the host (a replay
    # on another host decides them there), policies for later events, and what was not asked
    follow_host = {"grad_sum", "shm_collectives", "keep_freed_memory", "universal"}
    other_layouts = {"pipeline_stages", "pipeline_partition", "ddp_bucket_mb"}  # None: not used
    not_asked = {"lora", "run_name", "wandb_project", "profile", "peak_tflops", "stop_at",
                 "nvme_path", "eval_tasks", "eval_tasks_every", "eval_tasks_limit",
                 "allow_recipe_change", "host_mem_gib", "device_mem_gib", "config",
                 "local_rank", "resume"}  # fmt: skip
    assert left <= follow_host | not_asked | other_layouts, left - follow_host - not_asked


def test_a_run_file_holding_a_bad_ds_config_is_one_line(tiny_data, tmp_path):
    from training.preflight import prepare_run

    text = f"data: {{path: {tiny_data}}}\nout: {tmp_path / 'run'}\nengine:\n  ds_config:\n"
    path = write(tmp_path, text + "    train_batch_size: auto\n    zero_optimizationn: {}\n")
    with pytest.raises(ConfigError, match="run file's engine.ds_config.*zero_optimizationn"):
        prepare_run(flags.parse(["--config", path]), world=1)


# ------------------------------------------------------------------------------------- replay
REPLAYS = {
    "deepspeed": (2, []),
    "ddp": (2, ["--backend", "ddp"]),
    "dpo": (1, ["--objective", "dpo"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", REPLAYS)
def test_a_run_replayed_from_its_run_file_logs_the_same_losses(tiny_data, pairs, tmp_path, name):
    """A short run, then the same run from its RUN/run.yaml into another folder: the same
    losses to the bit. The run file holds the resolved tree (the DeepSpeed config inline, every
    auto decided) and reads as the record's `resolved`; the record keeps the tree asked for."""
    nproc, extra = REPLAYS[name]
    data = pairs["data"] if name == "dpo" else tiny_data
    first, again = tmp_path / "first", tmp_path / "again"
    args = ["--data", str(data), "--out", str(first), *TINY_RUN, "--steps", "6", *extra]
    launch(args, nproc=nproc)
    record, run_file = first / "resolved_config.json", first / "run.yaml"
    replayed = flags.parse(["--config", str(run_file)])
    assert replayed == flags.parse(["--config", str(record)])
    assert isinstance(replayed.engine.ds_config, dict) and replayed.optim.eps == 1e-8
    assert run_file.read_text().startswith("# The run as it ran")
    launch(["--config", str(run_file), "--out", str(again), "--save-every", "-1"], nproc=nproc)
    a, b = read_metrics(first), read_metrics(again)
    assert len(a) == 6 and [r["loss"] for r in a] == [r["loss"] for r in b]
    saved = json.loads(record.read_text())
    assert saved["resolved"]["optim"]["lr"] == 3e-3 and saved["resolved"]["optim"]["eps"] == 1e-8
    assert saved["config"]["optim"]["eps"] is None and saved["why"]["optim.eps"]


def test_every_switch_resolves_a_setting_of_the_tree():
    from training.preflight.switches import Switches

    paths = {s.path for s in settings()}
    assert set(Switches.settings().values()) <= paths, Switches.settings()


@pytest.mark.slow
def test_ranks_that_resolve_an_auto_differently_are_refused(tiny_data, tmp_path):
    """A rank deciding its precision otherwise (a GPU of another generation) is named in one
    line, on every rank alike, before any model is built: the run does not hang."""
    out = tmp_path / "run"
    p = launch(
        ["--data", str(tiny_data), "--out", str(out), *TINY_RUN, "--steps", "2"],
        script="tests/scripts/disagree_train.py",
        check=False,
    )
    assert p.returncode != 0 and 2 in rank_exit_codes(p)  # bad input, on every rank
    line = next(x for x in p.stderr.splitlines() if "ranks 1 resolved" in x)
    assert "--precision to 'fp16', rank 0 to " in line or "--precision to 'bf16'" in line, line
    assert not (out / "checkpoints").exists()
