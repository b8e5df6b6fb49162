"""zerostack is a package, not a folder on sys.path: pyproject.toml declares every
package and command (and they are installed), no module reaches for sys.path, and
requirements.lock pins what requirements.txt asks for, torch left out."""

from __future__ import annotations

import importlib
import re
import subprocess
import tomllib  # requires-python >=3.11: the only Python the suite runs on
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
DEV_TOOLS = {
    "pytest",
    "ruff",
    "hypothesis",
    "trl",
}  # in requirements.txt for setup.sh; the `dev` extra in pyproject
SKIP_DIRS = {".venv", ".git", "build", "dist", "runs", "data_cache", "out", "__pycache__"}
# Spelled so that this file does not match itself.
PATH_EDIT = re.compile(r"\bsys\.path\.(insert|append)\s*\(")
E402 = re.compile(r"noqa:\s*E402")


def _python_files() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        files = [REPO / line for line in out.splitlines() if line]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout
        files = list(REPO.rglob("*.py"))
    return [f for f in files if f.is_file() and not SKIP_DIRS & set(f.relative_to(REPO).parts)]


def _requirements(path: Path) -> dict[str, Requirement]:
    reqs = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            r = Requirement(line)
            reqs[canonicalize_name(r.name)] = r
    return reqs


def _lock() -> dict[str, str]:
    pins = {}
    for line in (REPO / "requirements.lock").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"requirements.lock: {line!r} is not NAME==VERSION"
            pins[canonicalize_name(name)] = version.strip()
    return pins


def test_no_sys_path_edits_and_no_e402_exceptions():
    files = _python_files()
    assert len(files) > 50, "the repo's python files were not found"
    bad = []
    for f in files:
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            if PATH_EDIT.search(line) or E402.search(line):
                bad.append(f"{f.relative_to(REPO)}:{n}: {line.strip()}")
    assert not bad, "imports go through the installed package:\n" + "\n".join(bad)


def test_every_package_folder_is_declared():
    from setuptools import find_packages

    found = PYPROJECT["tool"]["setuptools"]["packages"]["find"]
    declared = set(find_packages(where=str(REPO), include=found["include"]))
    on_disk = {
        ".".join(p.parent.relative_to(REPO).parts)
        for p in REPO.rglob("__init__.py")
        if not SKIP_DIRS & set(p.relative_to(REPO).parts) and p.parent != REPO
    }
    on_disk = {p for p in on_disk if p.split(".")[0] != "tests"}
    assert on_disk - declared == set(), "packages pyproject.toml does not declare"
    assert declared - on_disk == set()
    for top in ("models", "data", "training", "launch", "benchmarks"):
        assert top in declared
    # data files the code reads beside its modules
    data = PYPROJECT["tool"]["setuptools"]["package-data"]
    assert "kernels/*.cpp" in data["models"] and list((REPO / "models" / "kernels").glob("*.cpp"))
    tasks = REPO / "training" / "evaluation" / "tasks"
    assert "tasks/*.yaml" in data["training.evaluation"] and list(tasks.glob("*.yaml"))


@pytest.mark.parametrize("name", sorted(PYPROJECT["project"]["scripts"]))
def test_console_scripts_resolve(name):
    target = PYPROJECT["project"]["scripts"][name]
    module, _, attr = target.partition(":")
    fn = getattr(importlib.import_module(module), attr)
    assert callable(fn), f"{name} = {target} is not callable"
    try:  # setup.sh installs it (pip install -e .): the installed commands are these
        dist = metadata.distribution("zerostack")
    except metadata.PackageNotFoundError:
        pytest.fail("zerostack is not installed, so its commands are not either: bash setup.sh")
    installed = {e.name: e.value for e in dist.entry_points if e.group == "console_scripts"}
    assert installed.get(name) == target, "reinstall: bash setup.sh"


def test_dependencies_match_requirements_txt():
    txt = _requirements(REPO / "requirements.txt")
    deps = {
        canonicalize_name(Requirement(d).name): Requirement(d)
        for d in PYPROJECT["project"]["dependencies"]
    }
    libs = {k: v for k, v in txt.items() if k not in DEV_TOOLS}
    assert {k: str(v.specifier) for k, v in deps.items()} == {
        k: str(v.specifier) for k, v in libs.items()
    }
    extras = PYPROJECT["project"]["optional-dependencies"]
    dev = {
        canonicalize_name(Requirement(d).name): str(Requirement(d).specifier) for d in extras["dev"]
    }
    assert dev == {k: str(txt[k].specifier) for k in DEV_TOOLS}
    wandb = {
        canonicalize_name(Requirement(d).name): str(Requirement(d).specifier)
        for d in extras["wandb"]
    }
    assert wandb == {
        k: str(v.specifier) for k, v in _requirements(REPO / "requirements-extras.txt").items()
    }


def test_lock_pins_the_requirements_and_not_torch():
    pins = _lock()
    assert "torch" not in pins, "torch is pinned in requirements.txt and installed first"
    assert not [p for p in pins if p.startswith("nvidia-") or p == "triton"]
    assert "zerostack" not in pins
    for name, req in _requirements(REPO / "requirements.txt").items():
        if name == "torch":
            continue
        assert name in pins, f"requirements.lock has no {name}: regenerate it with .ci/lock"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"requirements.lock pins {name}=={pins[name]}, outside {req}"
        )
