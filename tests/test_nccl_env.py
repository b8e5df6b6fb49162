"""NCCL runs start with the error handling, error propagation and flight recorder the field uses
(training/runtime/nccl_env.py); tested with the device's answer planted, as no GPU is here."""

from __future__ import annotations

import os

from training.runtime import nccl_env


def test_an_nccl_run_gets_error_handling_and_a_trace_in_its_run_folder(tmp_path):
    want = nccl_env.wanted("nccl", {}, tmp_path / "run")
    assert want["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert want["TORCH_NCCL_PROPAGATE_ERROR"] == "1"
    assert want["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and int(want["TORCH_FR_BUFFER_SIZE"]) > 0
    assert want[nccl_env.TRACE_FILE].startswith(str(tmp_path / "run" / "nccl_trace"))


def test_the_users_values_win_and_gloo_runs_get_nothing(tmp_path):
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", nccl_env.TRACE_FILE: "/elsewhere/t_"}
    want = nccl_env.wanted("nccl", env, tmp_path)
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in want and nccl_env.TRACE_FILE not in want
    assert nccl_env.wanted("gloo", {}, tmp_path) == {}
    # the flight recorder's size set under torch's older name (which torch warns about) stays
    assert "TORCH_FR_BUFFER_SIZE" not in nccl_env.wanted(
        "nccl", {"TORCH_NCCL_TRACE_BUFFER_SIZE": "10"}, tmp_path
    )
    assert nccl_env.in_effect("gloo") is None


def test_apply_sets_the_process_environment_before_the_group_starts(tmp_path, monkeypatch):
    for k in [*nccl_env.DEFAULTS, nccl_env.TRACE_FILE]:
        monkeypatch.delenv(k, raising=False)
    set_now = nccl_env.apply("nccl", tmp_path / "run")
    assert set_now and all(os.environ[k] == v for k, v in set_now.items())
    assert (tmp_path / "run" / "nccl_trace").is_dir()  # torch writes the dumps there
    assert nccl_env.in_effect("nccl")["TORCH_NCCL_PROPAGATE_ERROR"] == "1"
