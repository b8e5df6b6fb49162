"""The command line of training/train.py, generated from the run's configuration tree
(run_config.py): a flag per setting, grouped in --help as a user reads them (data, model,
optimization, checkpoints, parallelism and engines, evaluation and follow-up jobs, logging, host
tuning), every one with its help and its default.

A run is resolved in one order: the defaults, then the run file (`--config FILE`, runfile.py),
then the flags given. A `bool` setting whose default is False is a switch (`--force`); one whose
default is True (or None, decided later: `--compile`) also gets its `--no-` form. No prefix of a
flag is accepted (`allow_abbrev=False`): a new flag can never change what an old command line
means.
"""

from __future__ import annotations

import argparse
import typing

import pydantic

from models.errors import ModelError
from models.lora import LoraSpec, parse_lora
from training.errors import ConfigError
from training.settings import runfile
from training.settings.run_config import GROUPS, REQUIRED, RunConfig, Setting, settings

DESCRIPTION = (
    "Train a causal LM with DeepSpeed, DDP or FSDP2. Settings come from their defaults, then "
    "--config FILE (a run file, nested by the groups below), then these flags."
)


def parse(argv: list[str] | None = None) -> RunConfig:
    """The run's configuration from the command line (and the run file it names). argparse
    exits 2 on a malformed command line; a bad run file or value raises ConfigError."""
    p = parser()
    given = vars(p.parse_args(argv))
    report = given.pop("report_to", None)
    if report in ("wandb", "all"):
        given["wandb"] = True
    elif report and given.get("wandb"):
        p.error(f"--report_to {report} contradicts --wandb: give one of them")
    path = given.pop("config", None)
    values = runfile.load(path) if path else {}
    _strict(values, path)
    by_dest = {s.dest: s for s in settings()}
    for dest, value in given.items():
        values[by_dest[dest].path] = value
    return build(values, source=path)


def build(values: dict, source: str | None = None) -> RunConfig:
    """The tree from {setting path: value} over the defaults; ConfigError names the setting."""
    tree: dict = {}
    for s in settings():
        if s.path in values:
            value = values[s.path]
        elif s.default is REQUIRED:
            where = f" or as {s.path} in {source}" if source else f" (or {s.path} in a run file)"
            raise ConfigError(f"{s.flag} is required: give it on the command line{where}")
        else:
            continue
        if s.name == "lora" and isinstance(value, str):
            value = _lora(value)
        if s.section:
            tree.setdefault(s.section, {})[s.name] = value
        else:
            tree[s.name] = value
    try:
        return pydantic.TypeAdapter(RunConfig).validate_python(tree)
    except pydantic.ValidationError as e:
        raise ConfigError(_one_line(e, source)) from None


def _strict(values: dict, source: str | None) -> None:
    """A run file's values hold their settings' types as they are, as DeepSpeed's JSON is read:
    "10" is not 10, nor "yes" a switch (the flags' text is converted by argparse, once)."""
    by_path = {s.path: s for s in settings()}
    for path, value in values.items():
        kind = str | None if by_path[path].name == "lora" else by_path[path].kind
        try:
            pydantic.TypeAdapter(kind).validate_python(value, strict=True)
        except pydantic.ValidationError as e:
            raise ConfigError(_one_line(e, source, path)) from None


def _lora(text: str) -> LoraSpec:
    try:
        return parse_lora(text)
    except ModelError as e:
        raise ConfigError(str(e)) from None


def _one_line(error: pydantic.ValidationError, source: str | None, path: str = "") -> str:
    first = error.errors()[0]
    inner = ".".join(str(p) for p in first["loc"] if not str(p).startswith("function"))
    path = path or inner
    by_path = {s.path: s for s in settings()}
    setting = by_path.get(path)
    where = f"{source}: {path}" if source else (setting.flag if setting else path)
    return f"{where}: {first['msg'].lower()}, got {first.get('input')!r}"


# The settings --help shows (with --config), the 35 a user reaches for first; --help-all (and docs/settings.md)
# has every one. The rest are accepted all the same.
COMMON = frozenset({
    "out", "data.path", "data.seq_len", "model.name", "model.lora",
    "model.activation_checkpointing", "model.compile", "optim.steps", "optim.micro_batch",
    "optim.grad_accum", "optim.global_batch", "optim.lr", "optim.min_lr_ratio", "optim.warmup",
    "optim.weight_decay", "optim.grad_clip", "optim.seed", "optim.objective", "optim.dpo_beta",
    "checkpoint.save_every", "checkpoint.keep_last", "checkpoint.async_save",
    "checkpoint.resume", "engine.backend", "engine.ds_config", "engine.precision",
    "engine.pipeline_stages", "eval.every", "eval.samples", "followups.export_every",
    "followups.eval_tasks", "logging.every", "logging.wandb", "logging.run_name", "host.force",
})  # fmt: skip
USAGE = "%(prog)s --data DATA --out OUT [--config FILE] [settings ...]"


def parser(full: bool = False) -> argparse.ArgumentParser:
    """The command line of training/train.py, generated from the tree. Every default is
    SUPPRESS: what argparse returns is what was given, so a run file's values stand unless a
    flag overrides them; --help says each setting's default. `full`: --help lists every
    setting (--help-all), not only COMMON's."""
    shown = None if full else COMMON
    more = sum(1 for s in settings() if not s.hidden and s.path not in COMMON)
    p = argparse.ArgumentParser(
        description=DESCRIPTION,
        usage=USAGE,
        epilog=None
        if full
        else f"{more} more settings (engine and host tuning, the spike guard and rollback, "
        "follow-up jobs, other spellings): --help-all; every one: docs/settings.md",
        allow_abbrev=False,
        argument_default=argparse.SUPPRESS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--help-all", action=_HelpAll, nargs=0, help="every setting, with its default, and exit"
    )
    run = p.add_argument_group("run")
    run.add_argument(
        "--config",
        metavar="FILE",
        help="a run file (YAML; a run's resolved_config.json or run.yaml replays it): any of "
        "the settings below, nested by section; flags given override it",
    )
    by_section = {}
    for s in settings():
        by_section.setdefault(s.section, []).append(s)
    for s in by_section.pop(""):
        _add(run, s, shown)
    for title, sections in GROUPS:
        group = p.add_argument_group(title)
        for section in sections:
            for s in by_section[section]:
                _add(group, s, shown)
    _add_spellings(p, full)
    return p


class _HelpAll(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        globals()["parser"](full=True).print_help()  # on stdout, as --help
        parser.exit()


def _add(group, s: Setting, shown: frozenset | None = None) -> None:
    kind, choices = base_type(s.kind)
    kw: dict = {"dest": s.dest}
    if s.hidden or (shown is not None and s.path not in shown):
        kw["help"] = argparse.SUPPRESS
    elif shown is not None:  # --help: each setting's first clause, its default's too
        text = f"{brief(s.help)} (default: {brief(default_text(s), ('; ', ': '))})"
        kw["help"] = text.replace("%", "%%")
    else:
        kw["help"] = f"{s.help} (default: {default_text(s)})".replace("%", "%%")
    if kind is bool:
        # a switch; a default of True or None ("decided later") also gets its --no- form
        kw["action"] = "store_true" if s.default is False else argparse.BooleanOptionalAction
    else:
        kw["type"] = str if kind is LoraSpec else kind
        if choices:
            kw["choices"] = choices
        elif kind in (int, float):
            kw["metavar"] = "N" if kind is int else "X"
    if s.dest == "ds_config":
        kw["action"] = _OneConfig
    if shown is None or not s.aliases:
        group.add_argument(s.flag, *s.aliases, **kw)
    else:  # --help names the flag once; the other spellings are in --help-all
        group.add_argument(s.flag, **kw)
        group.add_argument(*s.aliases, **{**kw, "help": argparse.SUPPRESS})


def _add_spellings(p: argparse.ArgumentParser, shown: bool = True) -> None:
    """Other tools' spellings of settings that are not settings themselves (in --help-all)."""
    hf = p.add_argument_group("other spellings") if shown else p
    # DeepSpeed's own form (deepspeed.add_config_arguments, Megatron-DeepSpeed): `--deepspeed`
    # as a switch beside `--deepspeed_config X`, or `--deepspeed X` naming the file.
    hf.add_argument(
        "--deepspeed",
        dest="ds_config",
        nargs="?",
        const=None,
        action=_OneConfig,
        help="DeepSpeed's spelling: a switch (the config comes from --deepspeed_config) or the "
        "config file itself"
        if shown
        else argparse.SUPPRESS,
    )
    hf.add_argument(
        "--report_to",
        "--report-to",
        dest="report_to",
        choices=["wandb", "tensorboard", "all", "none"],
        help="HF Trainer's spelling: wandb or all = --wandb; tensorboard or none = no W&B "
        "(metrics.jsonl and TensorBoard files are always written)"
        if shown
        else argparse.SUPPRESS,
    )


def brief(text: str, stops: tuple[str, ...] = ("; ",)) -> str:
    """`text` as --help says it: up to its first of `stops` outside parentheses, less a closing
    parenthesis (an aside) after three words or more."""
    depth = 0
    for i, c in enumerate(text):
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth == 0 and any(text.startswith(stop, i) for stop in stops):
            text = text[:i]
            break
    if text.endswith(")") and " (" in text:
        head = text[: text.rindex(" (")]
        if len(head.split()) >= 3 and head.count("(") == head.count(")"):
            return head
    return text


def default_text(s: Setting) -> str:
    """A setting's default as --help and docs/settings.md say it."""
    if s.default is REQUIRED:
        return "required"
    if s.shown:
        return s.shown
    if s.default is None:
        return "none"
    if isinstance(s.default, bool):
        return "on" if s.default else "off"
    return str(s.default)


class _OneConfig(argparse.Action):
    """The config file, under any of its spellings; two different files is an error, not a
    silent "last one wins"."""

    def __call__(self, parser, namespace, value, option_string=None):
        if value is None:  # the bare `--deepspeed` switch
            return
        given = getattr(namespace, self.dest, None)
        if given is not None and given != value:
            parser.error(f"{option_string} {value}: the DeepSpeed config is already {given}")
        setattr(namespace, self.dest, value)


def auto_unless(blockers, on_why: str) -> tuple[bool, str]:
    """A switch's "auto" made concrete: off with the first (condition, why) in `blockers` that
    holds, else on; returns (on, "auto: why")."""
    for blocked, why in blockers:
        if blocked:
            return False, f"auto: {why}"
    return True, f"auto: {on_why}"


def base_type(t) -> tuple[type, list | None]:
    """int | None -> (int, None); Literal["a", "b"] | None -> (str, ["a", "b"])."""
    args = [a for a in typing.get_args(t) if a is not type(None)] or [t]
    inner = args[0]
    if typing.get_origin(inner) is typing.Literal:
        return type(typing.get_args(inner)[0]), list(typing.get_args(inner))
    if typing.get_origin(t) is typing.Literal:
        return type(typing.get_args(t)[0]), list(typing.get_args(t))
    return inner, None


__all__ = ["auto_unless", "build", "parse", "parser"]
