"""fp16 dynamic loss scaling through DeepSpeed: overflowing steps are skipped and counted, the
scale moves, and the scaler's state survives a checkpoint."""

from __future__ import annotations

import json

import pytest
from conftest import launch, read_metrics

pytestmark = pytest.mark.slow  # real 2-rank runs


def test_fp16_loss_scaling_skips_overflows_and_resumes(tiny_data, tmp_path):
    cfg = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": 1.0,
        # 2^20 overflows the fp16 gradients of the first steps: DeepSpeed must skip them and
        # halve the scale each time (hysteresis 1), then grow it after 2 clean steps.
        "fp16": {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": 20,
            "loss_scale_window": 2,
            "hysteresis": 1,
            "min_loss_scale": 1,
        },
        "zero_optimization": {"stage": 2},
    }
    path = tmp_path / "fp16.json"
    path.write_text(json.dumps(cfg))
    args = [
        "--data",
        str(tiny_data),
        "--ds_config",
        str(path),
        "--model",
        "tiny",
        "--seq-len",
        "32",
        "--micro-batch",
        "1",
        "--log-every",
        "1",
        "--eval-every",
        "0",
        "--eval-samples",
        "2",
        "--steps",
        "11",
        "--save-every",
        "0",
    ]
    script = "tests/scripts/fp16_patched_train.py"
    straight = tmp_path / "straight"
    launch([*args, "--out", str(straight)], script=script)
    m = read_metrics(straight)
    scales = [r["loss_scale"] for r in m]
    skipped = [r["skipped"] for r in m]
    assert skipped[0] >= 1 and skipped[-1] < 11  # overflows were skipped, then steps applied
    assert scales[0] < 2**20  # the scale came down from the initial 2^20
    assert any(b > a for a, b in zip(scales, scales[1:]))  # and grows again after clean windows
    # each skip is counted under its reason and logged with the scale it left
    overflows = read_metrics(straight, "overflow")
    assert [x["total"] for x in overflows] == list(range(1, skipped[-1] + 1))
    assert m[-1]["skipped_by"] == {"fp16 overflow": skipped[-1]}
    assert {x["step"]: x["loss_scale"] for x in overflows}.items() <= {
        x["step"]: x["loss_scale"] for x in m
    }.items()

    split = tmp_path / "split"
    launch([*args, "--out", str(split), "--stop-at", "5"], script=script)
    launch([*args, "--out", str(split)], script=script)
    r = read_metrics(split)
    assert [x["loss_scale"] for x in r] == scales  # the scaler resumed where it was
    assert [x["skipped"] for x in r] == skipped
    assert r[-1]["skipped_by"] == m[-1]["skipped_by"]  # the reasons resumed too
    assert [x["loss"] for x in r] == [x["loss"] for x in m]
