"""Bad input to the trainer: one clear line, exit code 2, before any process group or model."""

from __future__ import annotations

import json

import pytest
from deepspeed.accelerator import get_accelerator

from training.train import main


def run(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.fixture
def base(tiny_data, tmp_path):
    return ["--data", str(tiny_data), "--out", str(tmp_path / "run"), "--model", "tiny"]


def write(tmp_path, name, obj):
    p = tmp_path / name
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(p)


CASES = {
    "not json": ('{"bf16": {"enabled": true},}', "not valid JSON"),
    "unknown key": ({"zero_optimisation": {"stage": 2}}, "did you mean 'zero_optimization'"),
    "triplet": (
        {
            "train_batch_size": 6,
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 1,
        },
        "set train_batch_size to 4",
    ),
    "auto": (
        {"zero_optimization": {"stage": 3, "sub_group_size": "auto"}},
        'cannot resolve "auto" for zero_optimization.sub_group_size',
    ),
    "fp16+bf16": ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both true"),
    "pipeline+zero2": (
        {"pipeline": {"stages": 2}, "zero_optimization": {"stage": 2}},
        "ZeRO stage 0 or 1",
    ),
    "offload w/o optimizer": (
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
        '"optimizer" section',
    ),
    "fp16 on cpu": (
        {"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}},
        "fp16 is not supported on this device",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_config(capsys, base, tmp_path, case):
    if case == "fp16 on cpu" and get_accelerator().is_fp16_supported():
        pytest.skip("this CPU has fp16 kernels (oneDNN), so fp16 is not refused here")
    cfg, needle = CASES[case]
    code, err = run(capsys, [*base, "--ds_config", write(tmp_path, "c.json", cfg)])
    assert code == 2 and err.startswith("error: ") and "\n" not in err
    assert needle in err
    assert not (tmp_path / "run").exists()  # nothing was started


def test_missing_config_file(capsys, base, tmp_path):
    code, err = run(capsys, [*base, "--ds_config", str(tmp_path / "nope.json")])
    assert code == 2 and "config file not found" in err


def test_data_folder_without_manifest(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    code, err = run(capsys, ["--data", str(tmp_path / "empty"), "--out", str(tmp_path / "r")])
    assert code == 2 and "manifest" in err and "\n" not in err


def test_resume_pointing_at_nothing(capsys, base, tmp_path):
    code, err = run(capsys, [*base, "--resume", str(tmp_path / "nothing")])
    assert code == 2 and "no complete checkpoint" in err


def test_unknown_preset_lists_valid_ones(capsys, base):
    code, err = run(capsys, [*base[:-1], "nonexistent"])
    assert code == 2 and "tiny" in err and "small" in err


def test_folder_without_model(capsys, base, tmp_path):
    (tmp_path / "m").mkdir()
    code, err = run(capsys, [*base[:-1], str(tmp_path / "m")])
    assert code == 2 and ("no model" in err or "config.json" in err)


# --------------------------------------------------------------------------------------------
# More bad input: flags, data, checkpoints and the environment. Each case builds what it needs
# under tmp_path and returns (extra argv, environment); the run must end with one line, exit
# code 2, and every file that was there before unchanged. docs/bad_inputs.md lists them all.
def _data_copy(tmp_path, data):
    import shutil

    dst = tmp_path / "data"
    shutil.copytree(data, dst)
    return dst


def _truncate_shard(tmp_path, data):
    d = _data_copy(tmp_path, data)
    shard = sorted(d.glob("train_*.bin"))[0]
    shard.write_bytes(shard.read_bytes()[:-10])
    return ["--data", str(d)], {}


def _remove_shard(tmp_path, data):
    d = _data_copy(tmp_path, data)
    sorted(d.glob("val_*.bin"))[0].unlink()
    return ["--data", str(d)], {}


def _manifest_text(text):
    def build(tmp_path, data):
        d = _data_copy(tmp_path, data)
        (d / "manifest.json").write_text(text(json.loads((d / "manifest.json").read_text())))
        return ["--data", str(d)], {}

    return build


def _small_vocab_model(tmp_path, data):
    m = tmp_path / "model"
    m.mkdir()
    (m / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 100}))
    return ["--model", str(m)], {}


def _checkpoint(tmp_path, complete=True, truncate=False):
    """A checkpoint folder as a save leaves it (complete or killed before complete.json)."""
    folder = tmp_path / "run" / "checkpoints" / "step_00000004"
    folder.mkdir(parents=True)
    (folder / "mp_rank_00_model_states.pt").write_bytes(b"x" * 100)
    if complete:
        listing = {"files": {"mp_rank_00_model_states.pt": 100}}
        (folder / "complete.json").write_text(json.dumps(listing))
        (folder.parent / "latest").write_text(folder.name)
    if truncate:
        (folder / "mp_rank_00_model_states.pt").write_bytes(b"x" * 50)
    return folder


LAUNCHED = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}

RUN_CASES = {
    # flags
    "steps 0": (lambda t, d: (["--steps", "0"], {}), "--steps must be at least 1"),
    "seq-len 1": (lambda t, d: (["--seq-len", "1"], {}), "--seq-len must be at least 2"),
    "lr negative": (lambda t, d: (["--lr", "-1"], {}), "--lr must be 0 or more"),
    "dist-timeout negative": (
        lambda t, d: (["--dist-timeout", "-5"], {}),
        "--dist-timeout must be positive",
    ),
    "max-bad-steps 0": (
        lambda t, d: (["--max-bad-steps", "0"], {}),
        "--max-bad-steps must be at least 1",
    ),
    "save-every -2": (lambda t, d: (["--save-every", "-2"], {}), "--save-every must be -1"),
    "micro-batch 0": (
        lambda t, d: (["--micro-batch", "0"], {}),
        "--micro-batch must be at least 1, got 0",  # the flag is named now (issue 19)
    ),
    "global batch vs world": (
        lambda t, d: (["--global-batch", "5", "--micro-batch", "2"], LAUNCHED),
        "is not a multiple of train_micro_batch_size_per_gpu=2 x data-parallel world 2",
    ),
    "out is a file": (
        lambda t, d: ((t / "run").write_text("x") and [], {}),
        "exists and is not a folder",
    ),
    # data
    "data truncated shard": (_truncate_shard, "the manifest says"),
    "data missing shard": (_remove_shard, "listed in the manifest but missing"),
    "data manifest not json": (_manifest_text(lambda m: "{oops"), "is not a valid manifest"),
    "data newer format": (
        _manifest_text(lambda m: json.dumps({**m, "format_version": 99})),
        "format version 99",
    ),
    "data folder is a file": (
        lambda t, d: ((t / "f").write_text("x") and ["--data", str(t / "f")], {}),
        "no such dataset folder",
    ),
    "model vocab smaller than data": (_small_vocab_model, "its vocabulary has 100 tokens"),
    # checkpoints
    "resume killed save": (
        lambda t, d: (["--resume", str(_checkpoint(t, complete=False))], {}),
        "incomplete checkpoint (no complete.json: its save did not finish)",
    ),
    "resume truncated file": (
        lambda t, d: (["--resume", str(_checkpoint(t, truncate=True))], {}),
        "mp_rank_00_model_states.pt is 50 bytes, 100 were written (truncated?)",
    ),
    "resume never over checkpoints": (
        lambda t, d: (_checkpoint(t) and ["--resume", "never"], {}),
        "training from scratch would overwrite",
    ),
    # environment
    "env half a launcher": (
        lambda t, d: ([], {"WORLD_SIZE": "2"}),
        "the environment sets WORLD_SIZE but not MASTER_ADDR, MASTER_PORT, RANK",
    ),
    "env rank outside world": (
        lambda t, d: ([], {**LAUNCHED, "RANK": "2"}),
        "RANK=2 is not in 0..WORLD_SIZE-1",
    ),
}


def _tree(path):
    return {
        str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("case", sorted(RUN_CASES))
def test_bad_run_input(capsys, monkeypatch, base, tiny_data, tmp_path, case):
    build, needle = RUN_CASES[case]
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    extra, env = build(tmp_path, tiny_data)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    before = _tree(tmp_path)
    code, err = run(capsys, [*base, *extra])
    assert code == 2, err
    assert err.startswith("error: ") and "\n" not in err, err
    assert needle in err, err
    assert _tree(tmp_path) == before  # nothing written, nothing changed
