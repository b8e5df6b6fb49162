"""`python -m models.presets`: the table, and no runpy warning (models/__init__.py imports the
presets before runpy would run them, which is why the command lives in a package __main__)."""

from __future__ import annotations

import subprocess
import sys

from models import PRESETS, get_config, num_params


def test_presets_command_prints_the_table_and_no_warning():
    p = subprocess.run(
        [sys.executable, "-W", "default", "-m", "models.presets"], capture_output=True, text=True
    )
    assert p.returncode == 0 and p.stderr == ""
    rows = [r for r in p.stdout.splitlines() if r.startswith("| ") and "preset" not in r]
    assert [r.split("|")[1].strip() for r in rows] == list(PRESETS)
    assert f"{num_params(get_config('small')) / 1e6:,.2f}M" in rows[1]
