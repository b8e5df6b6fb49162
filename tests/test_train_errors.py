"""Bad input to the trainer: one clear line, exit code 2, before any process group or model."""

from __future__ import annotations

import json

import pytest

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
    "pipeline+zero2": ({"pipeline": {"stages": 2}, "zero_optimization": {"stage": 2}},
                       "ZeRO stage 0 or 1"),
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
