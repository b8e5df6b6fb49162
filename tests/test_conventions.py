"""The trainer's command line meets users where they are (issue 18): DeepSpeed's spellings of the
config flag, HF Trainer's names for the flags that mean the same thing, and no prefix matching, so
a new flag can never change what an old command line means."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from training.settings.flags import parse, parser
from training.settings.run_config import flat

REPO = Path(__file__).resolve().parent.parent
BASE = ["--data", "D", "--out", "O"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--ds-config", "c.json"],
        ["--ds_config", "c.json"],
        ["--deepspeed_config", "c.json"],
        ["--deepspeed", "c.json"],
        ["--deepspeed", "--deepspeed_config", "c.json"],
        ["--deepspeed_config", "c.json", "--deepspeed"],
    ],
)
def test_config_flag_spellings(argv):
    assert parse([*BASE, *argv]).engine.ds_config == "c.json"


def test_two_different_configs_refused(capsys):
    with pytest.raises(SystemExit) as e:
        parse([*BASE, "--deepspeed", "a.json", "--ds-config", "b.json"])
    assert e.value.code == 2
    assert "the DeepSpeed config is already a.json" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--ste", "5"], ["--deepspeed_conf", "c.json"], ["--wand"]])
def test_no_prefix_matching(capsys, argv):
    with pytest.raises(SystemExit) as e:
        parse([*BASE, *argv])
    assert e.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


HF = {
    "--max_steps": ("steps", "7", 7),
    "--per_device_train_batch_size": ("micro_batch", "3", 3),
    "--gradient_accumulation_steps": ("grad_accum", "5", 5),
    "--learning_rate": ("lr", "3e-4", 3e-4),
    "--output_dir": ("out", "runs/x", "runs/x"),
    "--resume_from_checkpoint": ("resume", "runs/x/checkpoints/step_00000010", None),
    "--warmup_steps": ("warmup", "11", 11),
    "--weight_decay": ("weight_decay", "0.01", 0.01),
    "--seed": ("seed", "9", 9),
    "--logging_steps": ("log_every", "4", 4),
    "--save_steps": ("save_every", "50", 50),
    "--eval_steps": ("eval_every", "25", 25),
    "--max_grad_norm": ("grad_clip", "0.5", 0.5),
    "--adam_beta1": ("beta1", "0.8", 0.8),
    "--adam_beta2": ("beta2", "0.99", 0.99),
    "--adam_epsilon": ("eps", "1e-6", 1e-6),
}


@pytest.mark.parametrize("flag", sorted(HF))
def test_hf_trainer_spellings(flag):
    dest, text, value = HF[flag]
    s = parse([*BASE, flag, text])
    assert flat(s)[dest] == (text if value is None else value)


@pytest.mark.parametrize(
    "value,wandb", [("wandb", True), ("all", True), ("tensorboard", False), ("none", False)]
)
def test_report_to(value, wandb):
    assert parse([*BASE, "--report_to", value]).logging.wandb is wandb


def test_help_says_keep_last_zero_keeps_all():
    assert "0: keep all" in " ".join(parser(full=True).format_help().split())


def test_new_flags_declared():
    s = parse([*BASE, "--wandb-project", "p", "--run-name", "r"])
    assert (s.logging.wandb_project, s.logging.run_name) == ("p", "r")


def _options() -> set[str]:
    return {o for a in parser()._actions for o in a.option_strings}


def test_no_command_relies_on_an_abbreviation():
    """Every --flag written in the launch scripts, benchmarks, tests and docs is a full flag of
    the trainer, a flag of another of the repo's commands, or not a prefix of any trainer flag
    (another program's, such as the deepspeed launcher's)."""
    options = _options()
    # flags of the repo's other commands (benchmarks, data.prepare, export, ...)
    sources = [p.read_text() for p in REPO.rglob("*.py") if ".venv" not in p.parts]
    others = set(re.findall(r'add_argument\(\s*"(--[a-z0-9_-]+)"', "\n".join(sources)))
    others |= {"--output"}  # sbatch's (#SBATCH --output), in launch/slurm.sbatch
    files = [REPO / "README.md"]
    for folder in ("launch", "benchmarks", "tests", "docs"):
        files += [p for p in (REPO / folder).rglob("*") if p.suffix in (".py", ".sh", ".md", "")]
    files += list((REPO / "launch").glob("*.sbatch"))
    for path in files:
        if not path.is_file() or path.name == Path(__file__).name:  # this file's refusals
            continue
        for token in set(
            re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]*", path.read_text(errors="ignore"))
        ):
            if token in options or token in others or token.startswith("--no-"):
                continue
            prefix_of = [o for o in options if o.startswith(token)]
            assert not prefix_of, f"{path.name}: {token} abbreviates {prefix_of}"


HF_TABLE = re.compile(r"^\| `(--[a-z0-9_]+)[^`]*` \| `(--[a-z0-9-]+)")


def test_hf_trainer_table_rows_parse():
    """Each HF Trainer argument the table in docs/training.md maps to a zerostack flag is accepted
    under its HF name, with the same meaning."""
    text = (REPO / "docs" / "training.md").read_text()
    assert "## Flags from HF Trainer" in text
    section = text.split("## Flags from HF Trainer")[1].split("\n## ")[0]
    rows = [m.groups() for m in map(HF_TABLE.match, section.splitlines()) if m]
    assert len(rows) >= 12
    options = {o: a.dest for a in parser()._actions for o in a.option_strings}
    for hf, ours in rows:
        assert options[hf] == options[ours], (hf, ours)


@pytest.mark.slow  # a fresh interpreter importing torch and DeepSpeed
def test_deepspeed_form_in_a_real_process(tmp_path):
    """`--deepspeed --deepspeed_config X` as deepspeed.add_config_arguments gives it: the trainer
    reads X (here a bad one, refused in one line naming it, exit 2, before any work)."""
    bad = tmp_path / "bad.json"
    bad.write_text('{"zero_optimization": {"stage": "two"}}')
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "training.train", "--deepspeed", "--deepspeed_config", str(bad)]
    cmd += ["--data", str(tmp_path), "--out", str(out)]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    assert "bad.json: zero_optimization.stage must be 0, 1, 2 or 3" in p.stderr
    assert not out.exists()


def test_report_to_none_contradicting_wandb(capsys):
    with pytest.raises(SystemExit) as e:
        parse([*BASE, "--wandb", "--report_to", "none"])
    assert e.value.code == 2 and "contradicts --wandb" in capsys.readouterr().err
