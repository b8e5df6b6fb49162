"""Shard checksums at start: a shard whose sha256 differs from the manifest never trains; each
file is hashed once per data folder (a stamp), so later starts stay fast."""

from __future__ import annotations

import os
import shutil

import pytest

from data import DataError, verify_shards
from data.manifest import STAMP


def flip_a_byte(path, at=100):
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.fixture
def data(tiny_data, tmp_path):
    return shutil.copytree(tiny_data, tmp_path / "data")


def stamps(cache):
    return list((cache / "zerostack" / "verified").glob("*.json"))


def test_files_are_hashed_once_and_a_changed_shard_is_caught(data, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    verify_shards(data)
    [stamp] = stamps(tmp_path / "cache")  # rewritten only when some file had to be hashed
    first = stamp.stat().st_mtime_ns
    verify_shards(data)  # nothing changed: nothing hashed again
    assert stamp.stat().st_mtime_ns == first
    shard = data / "train_00000.bin"
    st = shard.stat()
    flip_a_byte(shard)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with its mtime put back
    with pytest.raises(DataError, match="train_00000.bin: sha256 does not match") as e:
        verify_shards(data)
    assert "\n" not in str(e.value)
    flip_a_byte(shard)  # repaired: accepted again
    verify_shards(data)


def test_the_data_folder_is_never_written(data, tmp_path, monkeypatch):
    """The stamp lives in the user's cache: verifying (a run, refused or not) leaves the data
    folder as the user made it, writable or not."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (data / STAMP).unlink(missing_ok=True)  # one an older version left there
    before = sorted(p.name for p in data.iterdir())
    verify_shards(data)
    assert sorted(p.name for p in data.iterdir()) == before
    assert len(stamps(tmp_path / "cache")) == 1


def test_the_trainer_refuses_a_damaged_shard_before_any_work(data, tmp_path, capsys):
    from training.train import main

    flip_a_byte(data / "val_00000.bin", at=10)
    out = tmp_path / "run"
    code = main(
        ["--data", str(data), "--out", str(out), "--model", "tiny", "--steps", "1", "--lr", "1e-3"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: ")
    assert "val_00000.bin: sha256 does not match" in err[0]
    assert not (out / "checkpoints").exists()
