"""On the CI box a skip of a test whose needs .ci/run provides fails instead (tests/conftest.py
MUST_RUN_ON_CI, ZEROSTACK_CI=1); elsewhere, and for skips about the host, it stays a skip."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO, ci_failure

SKIPPING = """
import pytest

def test_needs_mpirun():
    pytest.skip("Open MPI's mpirun is not installed (apt-get install openmpi-bin)")

def test_needs_a_gpu():
    pytest.skip("FlexAttention trains on GPUs only")
"""


def _run(tmp_path, ci: str) -> str:
    (tmp_path / "test_skipping.py").write_text(SKIPPING)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{REPO / 'tests'}:{REPO}", "ZEROSTACK_CI": ci}
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
         str(tmp_path / "test_skipping.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return p.stdout.strip().splitlines()[-1]


@pytest.mark.slow  # two pytest processes
def test_on_the_ci_box_a_skip_of_what_ci_provides_fails(tmp_path):
    assert "1 failed, 1 skipped" in _run(tmp_path, "1")
    assert "2 skipped" in _run(tmp_path, "0")


def test_every_skip_reason_of_what_ci_provides_is_classed():
    for reason in (
        "Open MPI's mpirun is not installed (apt-get install openmpi-bin)",
        "SLURM is not installed (slurmd missing: apt-get install ...)",
        "two hosts on one machine: no pdsh (see docs/testing.md)",
        "DeepSpeed's async_io op cannot be built here (apt-get install libaio-dev)",
        "TRL (in the dev extra: bash setup.sh) is not installed",
    ):
        assert ci_failure(reason, {"ZEROSTACK_CI": "1"}), reason
        assert ci_failure(reason, {}) is None
    for host in ("FlexAttention trains on GPUs only", "/dev/shm cannot hold DeepSpeed's segments"):
        assert ci_failure(host, {"ZEROSTACK_CI": "1"}) is None


def test_ci_sets_it_once_its_packages_are_in():
    run = (REPO / ".ci" / "run").read_text()
    assert run.index("export ZEROSTACK_CI=1") > run.index("apt-get install")
