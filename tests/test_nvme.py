"""ZeRO-Infinity: ZeRO-3 with parameters and optimizer states on a local disk path trains the
same as without offload. Needs libaio-dev (.ci/run installs it); DeepSpeed's async_io op
compiles on first use (about 6 minutes on 2 cores) and is cached in ~/.cache/torch_extensions."""

from __future__ import annotations

import json

import pytest
from conftest import TINY_RUN, launch, read_metrics

from training.train import main

FLAGS = [
    *TINY_RUN,
    "--steps",
    "4",
    "--save-every",
    "-1",
    "--peak-tflops",
    "1",
]


def _aio_missing() -> str | None:
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if AsyncIOBuilder().is_compatible(verbose=False):
        return None
    return "DeepSpeed's async_io op cannot be built here (apt-get install libaio-dev)"


@pytest.mark.slow
def test_nvme_offload_trains_like_no_offload(tiny_data, tmp_path):
    if why := _aio_missing():
        pytest.skip(why)
    runs = {}
    for name in ("zero3_nvme", "zero3_offload", "zero3"):
        out = tmp_path / name
        extra = ["--nvme-path", str(tmp_path / "swap")] if name == "zero3_nvme" else []
        launch(
            ["--data", str(tiny_data), "--out", str(out), *FLAGS, *extra]
            + ["--ds_config", f"ds_configs/{name}.json"],
            timeout=1200,  # the first use compiles async_io
        )
        runs[name] = [r["loss"] for r in read_metrics(out)]
    resolved = json.loads((tmp_path / "zero3_nvme" / "resolved_config.json").read_text())
    zo = resolved["ds_config"]["zero_optimization"]
    assert zo["offload_param"]["nvme_path"] == str(tmp_path / "swap")
    assert zo["offload_optimizer"]["nvme_path"] == str(tmp_path / "swap")
    assert isinstance(zo["offload_param"]["buffer_size"], int)
    # DeepSpeed's swappers made their per-rank folders there (it deletes the swap files
    # themselves when the engine goes away).
    stage3 = tmp_path / "swap" / "zero_stage_3"
    for kind in ("optimizer", "bfloat16params"):
        assert {p.name for p in (stage3 / kind).iterdir()} == {"rank0", "rank1"}
    # Same optimizer (DeepSpeed's CPU Adam) with the states in memory: the same losses.
    assert runs["zero3_nvme"] == pytest.approx(runs["zero3_offload"], rel=1e-6, abs=0)
    # And within bf16 rounding of ZeRO-3 without any offload (torch's AdamW on the device).
    assert runs["zero3_nvme"] == pytest.approx(runs["zero3"], rel=2e-3), runs


def test_nvme_path_needs_an_nvme_config(capsys, tiny_data, tmp_path):
    base = ["--data", str(tiny_data), "--out", str(tmp_path / "r"), "--model", "tiny"]
    assert main([*base, "--ds_config", "ds_configs/zero3.json", "--nvme-path", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--nvme-path given but the config offloads nothing" in err


def test_zero2_with_nvme_is_refused(capsys, tiny_data, tmp_path):
    """DeepSpeed would silently treat it as CPU offload."""
    cfg = json.loads(open("ds_configs/zero2_offload.json").read())
    cfg["zero_optimization"]["offload_optimizer"].update(device="nvme", nvme_path="auto")
    path = tmp_path / "z2nvme.json"
    path.write_text(json.dumps(cfg))
    base = ["--data", str(tiny_data), "--out", str(tmp_path / "r"), "--model", "tiny"]
    assert main([*base, "--ds_config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "nvme needs ZeRO stage 3" in err and "silently falls back to CPU offload" in err
