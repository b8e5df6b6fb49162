"""No code runs from a file zerostack reads: a pickle that would create a marker file when
unpickled is planted in a checkpoint's trainer state, in a DeepSpeed ZeRO file, in a DDP
optimizer file and in a `--model` folder's pytorch_model.bin (each time with the integrity listing
rewritten, as whoever plants a file would), and resume, universal conversion, export and
`--model` all refuse it in one line, exit 2, and the marker never appears."""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import subprocess

import numpy as np
import pytest
import torch
from conftest import PY, REPO, TINY_RUN, launch

from training.checkpoints import layout
from training.errors import CheckpointError
from training.runtime import safe_load


class Planted:
    """Unpickling this opens (creates) `marker`: what a hostile checkpoint would do, harmlessly."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def plant(path, marker, where=lambda obj: obj) -> None:
    """Put a Planted into the torch.save file at `path`, in the dict `where` picks."""
    obj = torch.load(path, weights_only=False)  # our own file, from the run just made
    where(obj)["planted"] = Planted(marker)
    torch.save(obj, path)


def reseal(folder) -> None:
    """List the folder's files again, as whoever planted one would."""
    old = json.loads((folder / "complete.json").read_text())
    layout.write_listing(folder, {k: v for k, v in old.items() if k not in ("files", "sha256")})


def train(args: list[str]) -> subprocess.CompletedProcess:
    """One process, no launcher: a refusal comes before any rank would start, and the exit
    code is the trainer's own (torchrun would turn 2 into 1)."""
    return subprocess.run(
        [PY, "training/train.py", *args], cwd=REPO, capture_output=True, text=True
    )


def refused(p, marker) -> None:
    out = p.stdout + p.stderr
    assert p.returncode == 2, out[-3000:]
    assert "refusing to load it" in out and "not plain data" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert not marker.exists()


# ---------------------------------------------------------------------------- fast: the mechanism


def test_rng_states_round_trip_exactly_through_json():
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    np.random.standard_normal()  # leaves a cached gaussian in numpy's state
    random.gauss(0, 1)  # and in Python's
    state = json.loads(json.dumps(layout.rng_state()))
    want = (torch.rand(5), np.random.standard_normal(5), random.gauss(0, 1), random.random())
    torch.manual_seed(7)
    np.random.seed(7)
    random.seed(7)
    layout.set_rng_state(state)
    got = (torch.rand(5), np.random.standard_normal(5), random.gauss(0, 1), random.random())
    assert torch.equal(want[0], got[0]) and np.array_equal(want[1], got[1])
    assert want[2:] == got[2:]


def test_a_planted_pickle_is_named_and_never_unpickled(tmp_path):
    marker = tmp_path / "marker"
    f = tmp_path / "file.pt"
    torch.save({"weight": torch.ones(2), "planted": Planted(marker)}, f)
    assert safe_load.unsafe_globals(f)  # read from the pickle, without loading it
    with pytest.raises(CheckpointError, match="refusing to load it: it names .*open"):
        safe_load.load(f)
    with pytest.raises(CheckpointError, match="refusing to load it"):
        safe_load.check_folder(tmp_path)
    # DeepSpeed's own loads pass weights_only=False: inside weights_only() torch overrides that
    with safe_load.weights_only(), pytest.raises(Exception, match="Weights only load failed"):
        torch.load(f, weights_only=False)
    assert not marker.exists()
    torch.save({"weight": torch.ones(2)}, f)
    assert safe_load.unsafe_globals(f) == [] and safe_load.load(f)["weight"].sum() == 2


def test_fsdp_metadata_is_read_with_dcp_classes_only(tmp_path):
    """FSDP2's `.metadata` is a plain pickle: DCP's own classes pass, anything else is named."""
    import warnings

    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "step_00000001"
    with warnings.catch_warnings():  # "no process group": one process is the point
        warnings.simplefilter("ignore", UserWarning)
        state = {"model": {"w": torch.ones(3, 2)}, "optim": {"lr": 0.1, "betas": (0.9, 0.95)}}
        dcp.save(state, checkpoint_id=str(folder / "dcp"), no_dist=True)
    safe_load.check_folder(folder)  # a real DCP checkpoint passes
    marker = tmp_path / "marker"
    metadata = folder / "dcp" / ".metadata"
    metadata.write_bytes(pickle.dumps({"planted": Planted(marker)}))
    with pytest.raises(CheckpointError, match=r"\.metadata: refusing to load it: it names"):
        safe_load.check_folder(folder)
    assert not marker.exists()


def planted_model_folder(tmp_path):
    """A Llama folder whose only weights are a pickled pytorch_model.bin holding a Planted."""
    from models import get_config
    from models.hf_adapter import to_llama_config

    folder = tmp_path / "model"
    folder.mkdir()
    to_llama_config(get_config("tiny", vocab_size=512)).save_pretrained(folder)
    marker = tmp_path / "marker"
    weights = {"model.norm.weight": torch.ones(2), "x": Planted(marker)}
    torch.save(weights, folder / "pytorch_model.bin")
    return folder, marker


def test_the_model_loader_refuses_a_planted_bin(tmp_path):
    from models import ModelError, build_model

    folder, marker = planted_model_folder(tmp_path)
    with pytest.raises(CheckpointError, match="pytorch_model.bin: refusing to load it"):
        safe_load.check_model_folder(folder)
    with pytest.raises(ModelError, match="refusing to load it"):  # the loader itself, too
        build_model(str(folder))
    assert not marker.exists()


# ------------------------------------------------------- slow: real checkpoints, real commands

RUN = [*TINY_RUN, "--steps", "2", "--save-every", "2"]
TAG = layout.tag_for(2)


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory) -> dict:
    """A 1-rank DeepSpeed ZeRO-2 run and a 1-rank DDP run, each with one checkpoint."""
    base = tmp_path_factory.mktemp("pickle_safety")
    out = {}
    for name, extra in {"zero2": [], "ddp": ["--backend", "ddp"]}.items():
        out[name] = base / name
        launch(["--data", str(tiny_data), "--out", str(out[name]), *RUN, *extra], nproc=1)
    return out


def planted_copy(runs, kind: str, tmp_path):
    """A copy of a run with a Planted in its checkpoint: `trainer_state` (the pickled trainer
    state of older checkpoints, in place of the JSON), `zero_file` (a ZeRO optim_states file) or
    `ddp_optim` (the DDP optimizer file). Returns (run copy, marker)."""
    run = tmp_path / kind
    shutil.copytree(runs["ddp" if kind == "ddp_optim" else "zero2"], run)
    folder = run / "checkpoints" / TAG
    marker = tmp_path / f"marker_{kind}"
    if kind == "trainer_state":
        state = layout.load_trainer_state(run / "checkpoints", TAG)
        (folder / layout.STATE).unlink()
        (folder / layout.RNG).unlink()
        torch.save({**state, "rng": [Planted(marker)]}, folder / layout.PICKLED_STATE)
    elif kind == "zero_file":
        (optim,) = folder.glob("*_optim_states.pt")
        plant(optim, marker, lambda sd: sd["optimizer_state_dict"])
    else:
        plant(folder / "optim.pt", marker)
    reseal(folder)
    return run, marker


KINDS = ["trainer_state", "zero_file", "ddp_optim"]


@pytest.mark.slow
def test_training_on_a_model_folder_with_a_planted_bin_is_refused(tiny_data, tmp_path):
    folder, marker = planted_model_folder(tmp_path)
    p = train(["--model", str(folder), "--data", str(tiny_data), "--out", str(tmp_path / "out")])
    refused(p, marker)
    assert "pytorch_model.bin" in p.stdout + p.stderr


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_resume_refuses_a_planted_pickle(runs, tiny_data, tmp_path, kind):
    run, marker = planted_copy(runs, kind, tmp_path)
    backend = ["--backend", "ddp"] if kind == "ddp_optim" else []
    args = ["--data", str(tiny_data), "--out", str(run), *RUN, "--steps", "3", *backend]
    refused(train(args), marker)


@pytest.mark.slow
def test_conversion_and_export_refuse_a_planted_zero_file(runs, tmp_path):
    run, marker = planted_copy(runs, "zero_file", tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for cmd in (["training.universal", str(run)], ["training.export", str(run), "--out", "hf"]):
        p = subprocess.run([PY, "-m", *cmd], cwd=tmp_path, env=env, capture_output=True, text=True)
        refused(p, marker)
    assert not (run / "checkpoints" / (TAG + layout.UNIVERSAL_SUFFIX)).exists()
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["trainer_state", "ddp_optim"])
def test_export_refuses_a_planted_trainer_state_or_optimizer_file(runs, tmp_path, kind, capsys):
    from training.checkpoints import hf_export, universal_copy

    run, marker = planted_copy(runs, kind, tmp_path)
    assert hf_export.main([str(run), "--out", str(tmp_path / "hf")]) == 2
    assert universal_copy.main([str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("refusing to load it") == 2 and not marker.exists()
