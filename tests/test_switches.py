"""The behaviour switches (training/preflight/switches.py): each flag's "auto" decided once from
the config, the device and the host, with the reason recorded; "on"/"off" obeyed, or refused
where they cannot apply. Hosts are described, not probed: the decisions are pure functions of
what the launcher and the machine say."""

from __future__ import annotations

import os

import pytest

from training.errors import ConfigError
from training.preflight.switches import Host, ranks_on_this_host, resolve_switches
from training.settings import ds_config
from training.settings import flags as cli

GiB = 2**30
BIG = Host("cpu", world=2, ranks_here=2, memory_bytes=64 * GiB)


def switches(config: str, *flags: str, host: Host = BIG, params: int = 10**6, accum: int = 2):
    argv = ["--data", "d", "--out", "o", "--grad-accum", str(accum), *flags]
    s = cli.parse(argv)
    raw = ds_config.load_json(f"ds_configs/{config}.json")
    cfg = ds_config.resolve(
        raw,
        world=host.world,
        optim=s.optim,
        engine=s.engine,
        hidden_size=64,
        device_type=host.device_type,
    )
    precision = s.engine.precision or ds_config.precision(cfg)
    return resolve_switches(s, cfg, host, params, ours=True, precision=precision)


def test_one_cpu_host_gets_every_measured_default():
    z3 = switches("zero3")
    assert (z3.compile, z3.hold_weights, z3.zero3_whole_blocks) == (True, True, True)
    assert (z3.grad_sum, z3.shm_collectives, z3.keep_freed_memory) == (False, True, True)
    assert z3.why["hold_weights"].startswith("auto: one CPU host")
    z2 = switches("zero2")
    assert (z2.grad_sum, z2.hold_weights, z2.zero3_whole_blocks) == (True, False, False)
    assert z2.why["hold_weights"] == "not ZeRO-3 or FSDP2"
    fsdp = switches("zero0", "--backend", "fsdp")
    assert fsdp.hold_weights and fsdp.shm_collectives and not fsdp.grad_sum
    ddp = switches("zero0", "--backend", "ddp")
    assert not (ddp.hold_weights or ddp.shm_collectives or ddp.grad_sum)
    record = z3.as_record()
    assert set(record) == {
        "compile",
        "hold_weights",
        "zero3_whole_blocks",
        "grad_sum",
        "shm_collectives",
        "keep_freed_memory",
    }
    assert all(set(v) == {"on", "why"} and v["why"] for v in record.values())


def test_several_hosts_a_gpu_or_a_small_host_turn_the_host_defaults_off():
    two_hosts = Host("cpu", world=4, ranks_here=2, memory_bytes=64 * GiB)
    z3 = switches("zero3", host=two_hosts)
    assert not z3.hold_weights and not z3.shm_collectives
    assert z3.why["hold_weights"] == "auto: 2 of 4 ranks on this host"
    assert z3.why["shm_collectives"] == "auto: 2 of 4 ranks on this host"
    assert z3.zero3_whole_blocks  # per rank: no host condition
    gpu = Host("cuda", world=2, ranks_here=2, memory_bytes=64 * GiB)
    g = switches("zero3", host=gpu)
    assert not (g.compile or g.hold_weights or g.zero3_whole_blocks or g.shm_collectives)
    assert not (g.keep_freed_memory or switches("zero2", host=gpu).grad_sum)
    # 2 ranks x 2 bytes x 1G parameters = 4 GiB: more than a quarter of a 12 GiB host
    small = Host("cpu", world=2, ranks_here=2, memory_bytes=12 * GiB)
    assert not switches("zero3", host=small, params=2**30).hold_weights
    assert switches("zero3", host=small, params=2**20).hold_weights
    assert not switches("zero0", "--backend", "fsdp", accum=1).hold_weights  # nothing to hold


def test_flags_win_over_auto_and_impossible_ones_are_refused():
    off = switches(
        "zero3",
        "--no-compile",
        "--hold-weights",
        "off",
        "--zero3-whole-blocks",
        "off",
        "--shm-collectives",
        "off",
        "--keep-freed-memory",
        "off",
    )
    assert not (off.compile or off.hold_weights or off.zero3_whole_blocks)
    assert not (off.shm_collectives or off.keep_freed_memory)
    assert off.why["hold_weights"] == "--hold-weights off"
    assert off.why["compile"] == "--no-compile"
    assert not switches("zero2", "--grad-sum", "off").grad_sum
    two_hosts = Host("cpu", world=4, ranks_here=2, memory_bytes=64 * GiB)
    assert switches("zero3", "--hold-weights", "on", host=two_hosts).hold_weights
    # FSDP2 with its shards in host memory holds nothing, whatever the flag says
    offloaded = switches("zero0", "--backend", "fsdp", "--fsdp-cpu-offload", "--hold-weights", "on")
    assert not offloaded.hold_weights
    assert offloaded.why["hold_weights"].startswith("--fsdp-cpu-offload")
    with pytest.raises(ConfigError, match="--hold-weights on: only ZeRO-3 and FSDP2"):
        switches("zero2", "--hold-weights", "on")
    with pytest.raises(ConfigError, match="--zero3-whole-blocks on: the run is not ZeRO-3"):
        switches("zero2", "--zero3-whole-blocks", "on")


def test_the_held_zero3_config_covers_the_whole_model():
    """--hold-weights resolves ZeRO-3's "auto" persistence threshold to the model's size."""
    raw = ds_config.load_json("ds_configs/zero3.json")
    kw = dict(world=2, hidden_size=64, device_type="cpu", params=10**6)
    zero = lambda cfg: cfg["zero_optimization"]["stage3_param_persistence_threshold"]  # noqa: E731
    assert zero(ds_config.resolve(raw, **kw)) == 640
    assert zero(ds_config.resolve(raw, hold_weights=True, **kw)) == 10**6


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"LOCAL_WORLD_SIZE": "2"}, 2),  # torchrun
        ({"LOCAL_SIZE": "2"}, 2),  # DeepSpeed's launcher (it never sets LOCAL_WORLD_SIZE)
        ({}, 4),  # no launcher: one process, or a launcher that says nothing: one host
    ],
)
def test_ranks_on_this_host_as_the_launcher_says(monkeypatch, env, expected):
    # Inside a SLURM or MPI allocation their variables would answer first (runtime/launcher.py).
    launchers = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MPI_LOCALNRANKS")
    for name in list(os.environ):
        if name in launchers or name.startswith(("SLURM_", "OMPI_", "PMI_")):
            monkeypatch.delenv(name)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert ranks_on_this_host(4) == expected


@pytest.mark.parametrize("world, on", [(1, True), (2, True), (3, False), (4, False)])
def test_grad_sum_only_where_it_gives_deepspeeds_bits(world, on):
    """Summing over a loss divided by the world is DeepSpeed's average to the bit on 2 ranks
    (tests/test_train.py: test_zero2_summing_gradients_over_a_divided_loss_is_bitwise_deepspeeds_mean);
    a larger world, checked by no test, falls back to DeepSpeed's own division, and says why."""
    z2 = switches("zero2", host=Host("cpu", world=world, ranks_here=world, memory_bytes=64 * GiB))
    assert z2.grad_sum is on
    if not on:
        assert (
            z2.why["grad_sum"] == f"auto: a world of {world} (checked to the bit on 2 ranks only)"
        )
