"""The warmup-stable-decay schedule (training/loop/schedule.py `wsd_lr_at`, --schedule wsd): its
phases and decay shapes, its refusals, and the reason it exists: a run resumed from a
checkpoint of its stable phase with a new --steps decays from there, step for step as a run
that asked for those steps from the start."""

from __future__ import annotations

import math

import pytest
from conftest import TINY_RUN, launch, read_metrics

from training.errors import ConfigError
from training.loop.schedule import Schedule, wsd_lr_at
from training.settings import ds_config as C
from training.settings.run_config import OptimConfig


def _wsd(step, total=100, decay=20, shape="1-sqrt", warmup=10):
    return wsd_lr_at(
        step, lr=1e-3, warmup=warmup, total=total, decay=decay, shape=shape, min_lr_ratio=0.1
    )


@pytest.mark.parametrize("shape", ["1-sqrt", "linear", "cosine"])
def test_warmup_then_the_peak_then_the_decay_to_the_floor(shape):
    lrs = [_wsd(s, shape=shape) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)  # linear warmup
    assert set(lrs[10:80]) == {1e-3}  # the stable phase: the peak, exactly
    assert lrs[99] == pytest.approx(1e-4)  # the last step at the floor
    assert all(a > b for a, b in zip(lrs[79:99], lrs[80:], strict=True))  # decaying throughout
    half = {"1-sqrt": 1 - math.sqrt(0.5), "linear": 0.5, "cosine": 0.5}[shape]
    assert lrs[89] == pytest.approx(1e-4 + 9e-4 * half)


def test_the_stable_phase_does_not_depend_on_the_run_length():
    assert [_wsd(s, total=100) for s in range(80)] == [_wsd(s, total=1000) for s in range(80)]


def test_it_resolves_from_the_flags_and_is_refused_beside_a_scheduler_section():
    _, fields = C.hyperparameters(
        C.resolve({}, world=1, optim=OptimConfig(steps=50, schedule="wsd"), hidden_size=64),
        OptimConfig(steps=50, schedule="wsd"),
        "deepspeed",
    )
    assert (fields["kind"], fields["decay"], fields["shape"]) == ("wsd", 10, "1-sqrt")  # 20%
    assert Schedule(**fields).at(30) == fields["lr"]
    raw = {"scheduler": {"type": "WarmupCosineLR", "params": {}}}
    wsd = OptimConfig(steps=50, schedule="wsd")
    with pytest.raises(ConfigError, match="--schedule wsd with scheduler WarmupCosineLR"):
        C.resolve(raw, world=1, optim=wsd, hidden_size=64)
    with pytest.raises(ConfigError, match="decay would start inside the warmup"):
        C.resolve({}, world=1, optim=OptimConfig(steps=50, schedule="wsd", decay_steps=45,
                                                 warmup=10), hidden_size=64)  # fmt: skip
    with pytest.raises(ConfigError, match="--decay-steps: the cosine schedule"):
        C.resolve({}, world=1, optim=OptimConfig(steps=50, decay_steps=5), hidden_size=64)


@pytest.mark.slow
def test_a_stable_phase_checkpoint_decays_to_a_new_end_as_if_asked_from_the_start(
    tiny_data, tmp_path
):
    """A 10-step wsd run (decay 3) against a run planned for 40 steps, stopped at step 5 in its
    stable phase and resumed with --steps 10 --decay-steps 3: the same losses, bit for bit."""
    base = ["--data", str(tiny_data), *TINY_RUN, "--schedule", "wsd", "--warmup", "2",
            "--precision", "fp32", "--save-every", "5"]  # fmt: skip
    launch([*base, "--steps", "10", "--decay-steps", "3", "--out", str(tmp_path / "planned")])
    longer = tmp_path / "longer"
    launch([*base, "--steps", "40", "--stop-at", "5", "--out", str(longer)])
    launch([*base, "--steps", "10", "--decay-steps", "3", "--out", str(longer)])
    planned, resumed = read_metrics(tmp_path / "planned"), read_metrics(longer)
    assert [r["step"] for r in resumed] == list(range(1, 11))
    assert [(r["loss"], r["lr"]) for r in resumed] == [(r["loss"], r["lr"]) for r in planned]
    assert planned[4]["lr"] == planned[6]["lr"] > planned[7]["lr"] > planned[9]["lr"]
