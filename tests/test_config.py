"""The one rule for settings: file, then flags, then "auto", then the batch triplet."""

import json

import pytest
from conftest import sections

from training.settings import ds_config as C
from training.settings import parallel

FLAGS = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}


def resolve(cfg, world=2, **flags):
    kw = sections(**{**FLAGS, **flags})
    return C.resolve(cfg, world=world, **kw, hidden_size=64, source="t.json")


def test_every_shipped_config_resolves_with_no_auto_left(tmp_path):
    for path in sorted((C.Path(__file__).parent.parent / "ds_configs").glob("*.json")):
        world = 4 if path.stem == "pipeline_tp2" else 2  # 3D: pp2 x tp2
        out = resolve(C.load_json(path), world=world, micro_batch=2, grad_accum=3)
        assert '"auto"' not in json.dumps(out), path
        replicas = parallel.layout(out, world, str(path)).data  # world / (pp x tp x sp)
        assert out["train_batch_size"] == 2 * 3 * replicas
        assert replicas == (1 if path.stem in ("pipeline", "tp2", "sp2", "pipeline_tp2") else 2), (
            path
        )
        assert not any(k.startswith("_") for k in out)


@pytest.mark.parametrize(
    "given, world, expect",
    [
        ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, 2, (16, 2, 4)),
        ({"train_batch_size": 16, "gradient_accumulation_steps": 2}, 2, (16, 4, 2)),
        ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, 2, (12, 3, 2)),
        ({"train_batch_size": 8}, 4, (8, 2, 1)),
        ({}, 1, (C.DEFAULT_MICRO_BATCH, C.DEFAULT_MICRO_BATCH, 1)),
    ],
)
def test_batch_triplet_is_derived(given, world, expect):
    out = resolve(given, world=world)
    assert (
        out["train_batch_size"],
        out["train_micro_batch_size_per_gpu"],
        out["gradient_accumulation_steps"],
    ) == expect


def test_flags_override_file_keys():
    out = resolve(
        {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.5},
        micro_batch=2,
        grad_clip=2.0,
    )
    assert out["train_micro_batch_size_per_gpu"] == 2 and out["gradient_clipping"] == 2.0


def test_auto_optimizer_params_come_from_flags():
    cfg = {
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "weight_decay": "auto"},
        }
    }
    out = resolve(cfg, lr=5e-4)
    # every number the optimizer runs with is written out, eps included (issue 18)
    assert out["optimizer"]["params"] == {
        "lr": 5e-4,
        "betas": [0.9, 0.95],
        "weight_decay": 0.1,
        "eps": 1e-8,
    }


@pytest.mark.parametrize(
    "cfg, needle",
    [
        (
            {
                "train_batch_size": 10,
                "train_micro_batch_size_per_gpu": 2,
                "gradient_accumulation_steps": 2,
            },
            "set train_batch_size to 8",
        ),
        ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}, "multiple of 8"),
        ({"train_batch_sise": 8}, "did you mean 'train_batch_size'"),
        (
            {"zero_optimization": {"stage": 2, "sub_group_size": "auto"}},
            'cannot resolve "auto" for zero_optimization.sub_group_size',
        ),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both true"),
        ({"pipeline": {"stages": 2}, "zero_optimization": {"stage": 2}}, "ZeRO stage 0 or 1"),
        ({"pipeline": {"stages": 3}}, "not divisible by pipeline.stages=3"),
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
            'needs an "optimizer" section',
        ),
        (
            {
                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}},
                "optimizer": {"type": "AdamW"},
            },
            "silently falls back",
        ),
        (
            {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
            "offload_param needs ZeRO stage 3",
        ),
        ({"train_micro_batch_size_per_gpu": 0}, "must be a positive integer"),
    ],
)
def test_bad_configs_fail_with_one_line_naming_the_problem(cfg, needle):
    with pytest.raises(C.ConfigError) as e:
        resolve(cfg)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg and msg.startswith("t.json")


def test_config_file_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 8,}')
    with pytest.raises(C.ConfigError, match=r"bad.json: not valid JSON \(line 1"):
        C.load_json(bad)
    with pytest.raises(C.ConfigError, match="config file not found"):
        C.load_json(tmp_path / "missing.json")


@pytest.mark.parametrize(
    "name, device, itemsize",
    [
        ("zero1.json", "cpu", 2),
        ("zero2.json", "cpu", 2),
        ("zero2_offload.json", "cpu", 2),
        ("fp32.json", "cpu", 4),
        ("pipeline.json", "cpu", 4),  # bf16 with fp32 gradient accumulation
        ("zero2.json", "cuda", None),
        ("zero3.json", "cpu", None),  # ZeRO-3 allocates its bucket once
    ],
)
def test_auto_reduce_bucket_stays_under_the_mmap_threshold_on_cpu(name, device, itemsize):
    """ZeRO-1/2 allocate the reduce bucket every backward: on CPU the "auto" bucket stays below
    glibc's largest mmap threshold (32 MiB), or every micro-batch page-faults it in again
    (test_train checks that such a block comes from the heap)."""
    raw = C.load_json(C.Path(__file__).parent.parent / "ds_configs" / name)
    raw.setdefault("zero_optimization", {})["reduce_bucket_size"] = "auto"
    flags = {**FLAGS, "micro_batch": 2}
    out = C.resolve(raw, world=2, **sections(**flags), hidden_size=384, device_type=device)
    bucket = out["zero_optimization"]["reduce_bucket_size"]
    if itemsize is None:
        assert bucket == 50_000_000
    else:
        assert C.CPU_BUCKET_BYTES - itemsize < bucket * itemsize <= C.CPU_BUCKET_BYTES < 2**25
    raw["zero_optimization"]["reduce_bucket_size"] = 123_456_789  # a given value is kept
    out = C.resolve(raw, world=2, **sections(**flags), hidden_size=384, device_type=device)
    assert out["zero_optimization"]["reduce_bucket_size"] == 123_456_789


def _shipped():
    return sorted((C.Path(__file__).parent.parent / "ds_configs").glob("*.json"))


def _device_autos_as(raw: dict, value) -> dict:
    """`raw` with every device-decided "auto" replaced by `value`."""
    raw = json.loads(json.dumps(raw))
    for path in C.DEVICE_AUTOS:
        *parents, last = path.split(".")
        d = raw
        for p in parents:
            d = d.get(p, {})
        if d.get(last) == "auto":
            d[last] = value
    return raw


def test_a_cpu_resolves_the_device_autos_as_the_configs_said_before():
    """On a CPU the shipped configs resolve to what they resolved to when they said
    overlap_comm and pin_memory false outright: the CPU's measured choices are unchanged."""
    asked = [p for p in _shipped() if "auto" in json.dumps(C.load_json(p))]
    device_autos = 0
    for path in asked:
        raw = C.load_json(path)
        device_autos += raw != _device_autos_as(raw, "x")
        world = 4 if path.stem == "pipeline_tp2" else 2  # 3D: pp2 x tp2
        kw = dict(world=world, hidden_size=64, device_type="cpu", **sections(micro_batch=2))
        assert C.resolve(raw, **kw) == C.resolve(_device_autos_as(raw, False), **kw), path
    assert device_autos >= 7  # every ZeRO config and both offload sections say auto


def test_a_gpu_overlaps_the_reduction_and_pins_offload_buffers():
    raw = C.load_json(C.Path(__file__).parent.parent / "ds_configs" / "zero3_offload.json")
    kw = dict(world=2, hidden_size=64, **sections(micro_batch=2))
    gpu = C.resolve(raw, device_type="cuda", **kw)["zero_optimization"]
    cpu = C.resolve(raw, device_type="cpu", **kw)["zero_optimization"]
    assert gpu["overlap_comm"] and gpu["offload_optimizer"]["pin_memory"]
    assert gpu["offload_param"]["pin_memory"]
    assert not (cpu["overlap_comm"] or cpu["offload_optimizer"]["pin_memory"])
    raw["zero_optimization"]["overlap_comm"] = False  # a value given always wins
    assert not C.resolve(raw, device_type="cuda", **kw)["zero_optimization"]["overlap_comm"]
