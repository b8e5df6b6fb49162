"""Loss spikes: a poisoned sample (a huge but finite loss, tests/scripts/spike_train.py) is
skipped by the spike guard on every rank and engine, and a rollback takes the run back past it
to the losses of a run whose data never had it."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import TINY_RUN, launch, read_metrics

SPIKE_TRAIN = "tests/scripts/spike_train.py"
MICRO, WORLD = 2, 2  # TINY_RUN's micro-batch, the launch's ranks


def poison_env(data, step: int) -> tuple[dict, tuple[int, int]]:
    """The environment that poisons rank 1's first sample of `step` (1-based), and the global
    samples that step reads. The poison is the sample's first 16 tokens, unique in the split."""
    from data import open_split
    from data.reader import BatchLoader

    ds = open_split(data, "train", 64, False)
    start = (step - 1) * MICRO * WORLD
    loader = BatchLoader(ds, MICRO, 1, WORLD, 1234)
    mark = ds[int(loader.sample_indices(np.array([start + MICRO]))[0])][:16]
    assert sum(bool((ds[i][:16] == mark).all()) for i in range(len(ds))) == 1
    env = {"ZEROSTACK_TEST_POISON": ",".join(map(str, mark.tolist()))}
    return env, (start, start + MICRO * WORLD)


def run_args(data, out, *extra):
    return ["--data", str(data), "--out", str(out), *TINY_RUN, *extra]


def last_losses(out) -> dict[int, float]:
    """Each step's loss as the run last logged it (a rollback logs the replayed steps again)."""
    return {r["step"]: r["loss"] for r in read_metrics(out)}


@pytest.mark.slow
def test_a_poisoned_batch_is_rolled_back_and_skipped_exactly(tiny_data, tmp_path):
    """Two 24-step 2-rank runs (over 60 s on 2 cores): the guard needs its warm-up and the
    rollback a checkpoint before the poisoned step, and exactness needs the run that never met
    the sample."""
    env, span = poison_env(tiny_data, 14)
    common = ["--steps", "24", "--save-every", "5", "--spike-window", "16"]
    hit = tmp_path / "hit"
    launch(run_args(tiny_data, hit, *common, "--rollback-after", "1"), env=env, script=SPIKE_TRAIN)
    (spike,) = read_metrics(hit, "spike")
    assert spike["step"] == 14
    assert spike["loss"] > spike["loss_limit"] and spike["grad_norm"] > spike["grad_norm_limit"]
    (back,) = read_metrics(hit, "rollback")
    assert (back["step"], back["to_step"], back["checkpoint"]) == (14, 10, "step_00000010")
    assert back["skipped_samples"] == [list(span)]
    said = json.loads((hit / "skipped_data.json").read_text())
    assert said["skip_samples"] == f"{span[0]}:{span[1]}"
    rows = read_metrics(hit)
    assert [r["step"] for r in rows] == [*range(1, 14), *range(11, 25)]  # 11-13 replayed
    assert rows[-1]["skipped"] == 1 and rows[-1]["skipped_by"] == {"spike": 1}

    # The same data and poison, the samples skipped from the start: never met
    clean = tmp_path / "clean"
    skip = f"{span[0]}:{span[1]}"
    launch(run_args(tiny_data, clean, *common, "--skip-samples", skip), env=env, script=SPIKE_TRAIN)
    assert not read_metrics(clean, "spike")
    assert last_losses(hit) == last_losses(clean)  # every step, bit for bit


def _weights(folder, config: str) -> dict:
    if config == "fsdp":
        from training.engines.fsdp import load_full_state_dict

        return load_full_state_dict(folder)
    from test_reliability import _state

    return _state(folder)


@pytest.mark.slow
@pytest.mark.parametrize("config", ["zero3", "ddp", "fsdp"])
def test_the_spike_guard_skips_on_every_engine(tiny_data, tmp_path, config):
    """A 10-step 2-rank run per engine, saving every step (near a minute on 2 cores): the guard's
    warm-up comes first, and the weights around the spike are read from two checkpoints. On ddp
    the run is stopped and resumed one step before the spike."""
    engine = {"ddp": ["--backend", "ddp"], "fsdp": ["--backend", "fsdp"]}.get(
        config, ["--ds_config", f"ds_configs/{config}.json"]
    )
    env, _ = poison_env(tiny_data, 10)
    out = tmp_path / "run"
    extra = ["--spike-window", "8", "--rollback-after", "0", "--keep-last", "0"]
    # ddp also stops after step 9 and resumes: the guard's history must come back with the
    # checkpoint, or the resumed guard is warming up again and lets step 10 through
    for stop in ["9", "10"] if config == "ddp" else ["10"]:
        launch(
            run_args(tiny_data, out, *engine, *extra, "--steps", "12", "--save-every", "1")
            + ["--stop-at", stop],
            env=env,
            script=SPIKE_TRAIN,
        )
    (spike,) = read_metrics(out, "spike")
    assert spike["step"] == 10 and spike["loss"] > spike["loss_limit"]
    rows = {r["step"]: r for r in read_metrics(out)}
    assert rows[10]["skipped_by"] == {"spike": 1} and rows[9]["skipped"] == 0
    assert not read_metrics(out, "nonfinite")  # a spike is not counted as non-finite
    s8, s9, s10 = (_weights(out / "checkpoints" / f"step_{i:08d}", config) for i in (8, 9, 10))
    assert any(not s8[k].equal(s9[k]) for k in s8)  # a normal step changes the weights ...
    assert all(s9[k].equal(s10[k]) for k in s9)  # ... the spike changed nothing


def test_the_guard_flags_a_spike_only_after_its_warmup():
    from training.engines.spike_guard import SpikeGuard

    guard = SpikeGuard(6.0, 16, 8, torch.device("cpu"))
    rng = np.random.default_rng(0)
    flagged = []
    for i in range(40):
        loss = 5.0 - 0.01 * i + rng.normal(0, 0.05) + (50.0 if i in (4, 30) else 0.0)
        guard.begin(torch.tensor(loss))
        gated = guard.gate(torch.tensor(1.0 + rng.normal(0, 0.05) + (9.0 if i == 33 else 0.0)))
        assert bool(torch.isinf(gated)) == bool(guard.spiked)
        flagged.append(bool(guard.spiked))
        guard.commit()
    # step 4's jump is inside the warm-up; 30 by its loss, 33 by its gradient norm
    assert [i for i, f in enumerate(flagged) if f] == [30, 33]


def _fed(guard, steps: range, seed: int) -> list[list[float]]:
    """Feed `guard` a noisy falling loss and norm for `steps`; the limits each step was held to."""
    rng = np.random.default_rng(seed)
    limits = []
    for i in steps:
        guard.begin(torch.tensor(5.0 - 0.01 * i + rng.normal(0, 0.05)))
        guard.gate(torch.tensor(1.0 + rng.normal(0, 0.05)))
        limits.append(guard.limits.tolist())
        guard.commit()
    return limits


def test_the_guards_history_resumes_from_a_checkpoint_exactly():
    """Saved at step 20 through trainer_state.json's JSON, the resumed guard holds steps 21-30
    to the unbroken guard's limits bit for bit (a fresh one would still be warming up)."""
    from training.engines.spike_guard import SpikeGuard

    def guard(window: int = 16) -> SpikeGuard:
        return SpikeGuard(6.0, window, 8, torch.device("cpu"))

    unbroken, stopped = guard(), guard()
    _fed(unbroken, range(20), seed=0)
    _fed(stopped, range(20), seed=0)
    saved = json.loads(json.dumps(stopped.state_dict()))
    resumed = guard()
    resumed.load_state_dict(saved)
    expected = _fed(unbroken, range(20, 30), seed=1)
    assert all(np.isfinite(expected[0]))
    assert _fed(resumed, range(20, 30), seed=1) == expected

    # Another window keeps the newest accepted steps, oldest first: a window of 4 resumed holds
    # what a window-4 guard fed the same 20 steps holds
    narrow, fed_narrow = guard(4), guard(4)
    narrow.load_state_dict(saved)
    _fed(fed_narrow, range(20), seed=0)
    assert narrow.state_dict()["count"] == 4
    assert sorted(map(tuple, zip(*narrow.state_dict()["history"]))) == sorted(
        map(tuple, zip(*fed_narrow.state_dict()["history"]))
    )


def test_a_history_kept_summed_over_micro_batches_is_read_as_their_mean():
    """A checkpoint whose guard kept each step's loss summed over its micro-batches (written
    before the history kept their mean) resumes on the mean's scale: its loss row divided by
    the accumulation the trainer state says it ran with."""
    from training.engines.spike_guard import LOSS_SCALE, SpikeGuard
    from training.loop.restore import _guard_state

    kept = SpikeGuard(6.0, 16, 8, torch.device("cpu"))
    _fed(kept, range(12), seed=0)
    saved = json.loads(json.dumps(kept.state_dict()))
    assert saved["loss"] == LOSS_SCALE
    old = {k: v for k, v in saved.items() if k != "loss"}
    old["history"] = [[3 * v for v in old["history"][0]], old["history"][1]]
    # 2 ranks x micro 2 x accumulation 3 = 12: the old row is 3 times the mean
    trainer = {"spike_guard": old, "world": 2, "micro_batch": 2, "global_batch": 12}
    resumed = SpikeGuard(6.0, 16, 8, torch.device("cpu"))
    resumed.load_state_dict(_guard_state(trainer))
    assert torch.allclose(resumed.history, kept.history, rtol=1e-15, atol=0)
    assert _guard_state({**trainer, "spike_guard": saved}) == saved  # kept as the mean: as is


@pytest.mark.slow
def test_a_run_resumed_on_another_layout_is_judged_and_rolled_back_as_the_unbroken_run(
    tiny_data, tmp_path
):
    """2 ranks (ZeRO-2, accumulation 1) stop after step 6; the same folder resumes on 1 rank
    with accumulation 2 (the same global batch, through the universal copy) with its spike
    guard warm. The resumed steps are judged on the same scale as before (no step of the clean
    resume is a spike, and its losses follow the unbroken 2-rank run), and a poisoned step rolls
    the run back to the 2-rank checkpoint through its universal copy, to the losses of a resume
    that skipped the poisoned samples from the start. Five short launches (near a minute)."""
    env, span = poison_env(tiny_data, 9)
    common = ["--steps", "12", "--save-every", "6", "--spike-window", "8", "--keep-last", "0"]
    one_rank = ["--grad-accum", "2", "--rollback-after", "1"]
    unbroken = tmp_path / "unbroken"
    launch(run_args(tiny_data, unbroken, *common))
    first = tmp_path / "first"
    launch(run_args(tiny_data, first, *common, "--stop-at", "6"))
    clean, hit = tmp_path / "clean", tmp_path / "hit"
    shutil.copytree(first, clean)
    shutil.copytree(first, hit)

    launch(run_args(tiny_data, clean, *common, *one_rank), nproc=1, script=SPIKE_TRAIN)
    assert not read_metrics(clean, "spike") and not read_metrics(clean, "rollback")
    ref, resumed = last_losses(unbroken), last_losses(clean)
    for step in range(7, 13):
        assert abs(resumed[step] - ref[step]) <= 1e-3 * ref[step], (step, resumed, ref)

    launch(run_args(tiny_data, hit, *common, *one_rank), nproc=1, env=env, script=SPIKE_TRAIN)
    (spike,) = read_metrics(hit, "spike")
    assert spike["step"] == 9
    (back,) = read_metrics(hit, "rollback")
    assert (back["to_step"], back["checkpoint"]) == (6, "step_00000006")
    assert back["skipped_samples"] == [list(span)]
    skipped = tmp_path / "skipped"
    shutil.copytree(first, skipped)
    skip = f"{span[0]}:{span[1]}"
    launch(run_args(tiny_data, skipped, *common, *one_rank, "--skip-samples", skip), nproc=1)
    after = {s: v for s, v in last_losses(hit).items() if s > 6}
    assert after == {s: v for s, v in last_losses(skipped).items() if s > 6}
