"""Preflight of --out: a folder a run can be written into."""

from __future__ import annotations

import os
from pathlib import Path

from data.manifest import MANIFEST
from training.errors import ConfigError
from training.settings.run_config import RunConfig


def check_out(config: RunConfig) -> None:
    """--out can be made a run folder: not a file, no file on its way, writable, and not a
    prepared data folder or inside one (run files would be written into the dataset)."""
    out = Path(config.out).absolute()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {config.out} exists and is not a folder")
    existing = out
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"--out {config.out}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {config.out}: {existing} is not writable")
    for folder in (existing, *existing.parents):
        if (folder / MANIFEST).is_file():
            raise ConfigError(
                f"--out {config.out}: {folder} is a prepared data folder (it holds "
                f"{MANIFEST}); put the run elsewhere"
            )
