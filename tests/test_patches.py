"""The patches into DeepSpeed's and torch's internals (training/runtime/patches.py): each is
applied only on the versions it was verified against, and its stock path and its patched path
train the same model alike (fp32, so the comparison is of the arithmetic, not of rounding)."""

from __future__ import annotations

import json

import pytest
from conftest import TINY_RUN, launch, read_metrics, shm_has_room

from training.runtime import patches


@pytest.mark.parametrize(
    "installed, low, high, inside",
    [
        ("0.19.8", "0.19.8", "0.19.8", True),
        ("2.13.0+cpu", "2.13.0", "2.13.0", True),  # a local tag is the same release
        ("0.19.9", "0.19.8", "0.19.8", False),
        ("0.19.7", "0.19.8", "0.19.9", False),
        ("0.20.0rc1", "0.19.8", "0.19.8", False),
        ("0.19.10", "0.19.8", "0.19.9", False),  # numbers, not strings: 10 > 9
        ("0.19.9", "0.19.8", "0.19.10", True),
        ("garbage", "0.19.8", "0.19.8", False),
    ],
)
def test_version_range(installed, low, high, inside):
    assert patches.in_range(installed, low, high) is inside


def test_outside_its_range_a_patch_takes_the_stock_path_and_says_so():
    ok, line = patches.check("shm_route", "0.20.0")
    assert not ok
    assert line == (
        "shm_route: deepspeed 0.20.0 is outside the versions it was verified against "
        "(0.19.8); taking the stock path (gloo)"
    )
    assert patches.check("fsdp2_held_grads", "2.14.0")[0] is False
    assert patches.check("fsdp2_held_grads", "2.13.0")[0] is True
    for name in patches.PATCHES:  # every patch names its stock path
        assert "stock: " in patches.PATCHES[name].what


def test_the_swapped_optimizer_workaround_finds_the_bug_it_works_around():
    """DeepSpeed 0.19.8's load_checkpoint skips the ZeRO optimizer file when the optimizer is
    swapped to NVMe: the workaround reads that off DeepSpeed before applying itself."""
    import deepspeed

    from training.engines.ds import skips_swapped_optimizer_file

    assert skips_swapped_optimizer_file() is (deepspeed.__version__ == "0.19.8")


RUN = [*TINY_RUN, "--precision", "fp32", "--steps", "3", "--save-every", "-1"]


def _losses(tiny_data, out, world, *flags) -> tuple[list[float], dict]:
    launch(["--data", str(tiny_data), "--out", str(out), *RUN, *flags], nproc=world)
    record = json.loads((out / "resolved_config.json").read_text())
    return [r["loss"] for r in read_metrics(out)], record


@pytest.mark.slow
def test_stock_and_patched_paths_train_alike_on_four_ranks(tiny_data, tmp_path):
    """ZeRO-3's gradient average through the shm route (runtime/shm.py: the comm layer and
    stage3.reduce_scatter_coalesced) against DeepSpeed's own on gloo: on 2 ranks bitwise
    (test_train.py: test_zero3_tuned_for_one_cpu_host_is_bitwise_the_stock_path); on 4 the
    kernel adds the ranks in another order than gloo: close, not bitwise, and the record says
    the route was on."""
    world = 4
    if not shm_has_room(world):
        pytest.skip("/dev/shm cannot hold DeepSpeed's segments here (the route stays off)")
    z3 = ["--ds_config", "ds_configs/zero3.json"]
    stock, rec = _losses(tiny_data, tmp_path / "z3_stock", world, *z3, "--shm-collectives", "off")
    assert rec["shm_collectives"] is False
    patched, rec = _losses(tiny_data, tmp_path / "z3_patched", world, *z3)
    assert rec["shm_collectives"] is True and rec["patches"]["shm_route"]["applied"]
    assert len(stock) == 3
    assert patched == pytest.approx(stock, rel=1e-5)  # (seen: not equal from step 2)
