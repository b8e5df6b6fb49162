"""A run kept in a file: `--config run.yaml` holds any subset of the settings, nested as the
tree of run_config.py (`optim: {lr: 3.0e-4}`), and flags on the command line override it. YAML,
because it is what the field's recipes are written in (axolotl, litgpt, TRL's and the HF
alignment recipes) and JSON is YAML too: `RUN/resolved_config.json` (its `resolved` tree) and
`RUN/run.yaml`, both written by every run, replay that run when passed back: every `auto` as it
was decided, and the DeepSpeed config held whole (`engine.ds_config` as a mapping).

Parsing is PyYAML's (its safe loader: no tags, no code), with YAML 1.2's floats (`3e-4` is a
float, where YAML 1.1 reads a string); types, `Literal` choices and nested sections are
validated strictly by pydantic against the dataclasses themselves (flags.py `build`): a quoted
`"10"` is not an integer, nor `"yes"` a switch, as in the DeepSpeed JSON. What is written here by
hand: the unknown-key check with its suggestion, and each error turned into one line naming the
file and the setting.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from training.errors import ConfigError
from training.settings.ds_sections import near
from training.settings.run_config import Setting, settings


class _Loader(yaml.SafeLoader):
    """The safe loader, reading 1e-3 and 3E+4 as floats (YAML 1.2) as recipes mean them."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)?\.?[0-9_]*[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def load(path: str) -> dict:
    """{setting path ("optim.lr", "out"): value} from a run file, or from a run's
    resolved_config.json (its `config`); ConfigError in one line for a missing or unreadable
    file, a key that is no setting, or a section that is not a mapping."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        tree = yaml.load(p.read_text(), Loader=_Loader)  # noqa: S506  (a safe loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: a run file is a mapping of sections, got {type(tree).__name__}")
    if isinstance(tree.get("config"), dict) and "ds_config" in tree:  # a run's record
        tree = tree["resolved"] if isinstance(tree.get("resolved"), dict) else tree["config"]
    return _flatten(tree, path)


def _flatten(tree: dict, path: str) -> dict:
    known = {s.path: s for s in settings() if not s.hidden}
    sections = {s.section for s in known.values() if s.section}
    values = {}
    for key, value in tree.items():
        if key == "out":
            values["out"] = value
            continue
        if key not in sections:
            hint = near(str(key), sorted([*sections, "out"]))
            raise ConfigError(f"{path}: unknown section {key!r}{hint}")
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: {key} must be a mapping of its settings, got {value!r}")
        for name, v in value.items():
            dotted = f"{key}.{name}"
            if dotted not in known:
                names = [p.split(".", 1)[1] for p in known if p.startswith(f"{key}.")]
                raise ConfigError(f"{path}: unknown setting {dotted}{near(str(name), names)}")
            values[dotted] = v
    return values


def dump(tree: dict, path: Path, header: str = "") -> None:
    """A run file of `tree` (run_config.py: nested), which replays the run it came from;
    `header` goes first, as comment lines."""
    comments = "".join(f"# {line}\n" for line in header.splitlines())
    path.write_text(comments + yaml.safe_dump(tree, sort_keys=False, width=100))


def describe(s: Setting) -> str:
    """Where a setting is spelled: 'optim.lr (--lr)'."""
    return f"{s.path} ({s.flag})"
