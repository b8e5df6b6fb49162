"""The whole configuration validated before any rank starts (issue 19, kinds 1-3), and nothing in a
ds_config accepted and then ignored (issue 18). Each bad input ends in one `error:` line naming
the key, flag or file, exit code 2, and nothing written; each case is a row of
docs/bad_inputs.md. Run in-process: the preflight refuses before a process group exists."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import launch, read_metrics, sections
from deepspeed.runtime.lr_schedules import WarmupDecayLR

from training.errors import ConfigError
from training.loop.schedule import Schedule
from training.settings import ds_config as C
from training.settings import ds_sections as keys
from training.settings import hparams
from training.settings.run_config import OptimConfig
from training.train import main


def refused(capsys, argv) -> str:
    """main(argv) must exit 2 with exactly one error line (warnings of the data layer may come
    before it); returns that line."""
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and err[-1] == errors[0], err
    return errors[0]


@pytest.fixture
def base(tiny_data, tmp_path):
    return ["--data", str(tiny_data), "--out", str(tmp_path / "run"), "--model", "tiny"]


def config(tmp_path, obj) -> list[str]:
    p = tmp_path / "c.json"
    p.write_text(json.dumps(obj))
    return ["--ds-config", str(p)]


# kind 1: what only DeepSpeed checked, or nobody applied
CONFIG_CASES = {
    "stage not a number": ({"zero_optimization": {"stage": "two"}}, "stage must be 0, 1, 2 or 3"),
    "stage as a string": ({"zero_optimization": {"stage": "2"}}, "got '2'"),
    "stage 7": ({"zero_optimization": {"stage": 7}}, "stage must be 0, 1, 2 or 3"),
    "offload device unknown": (
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}},
        "zero_optimization.offload_param.device",
    ),
    "misspelled zero key": (
        {"zero_optimization": {"stage": 2, "overlap_com": True}},
        "zero_optimization.overlap_com is not a key DeepSpeed reads (did you mean 'overlap_comm'?)",
    ),
    "zero bool as a string": (
        {"zero_optimization": {"stage": 2, "contiguous_gradients": "false"}},
        "zero_optimization.contiguous_gradients must be true or false",
    ),
    "bf16 enabled yes": (
        {"bf16": {"enabled": "yes"}},
        'bf16.enabled must be true or false, got "yes"',
    ),
    "fp16 unknown key": ({"fp16": {"enabled": False, "loss_scal": 0}}, "fp16.loss_scal"),
    "optimizer unknown": (
        {"optimizer": {"type": "AdamWW", "params": {}}},
        "unknown optimizer.type 'AdamWW' (did you mean 'AdamW'?)",
    ),
    "optimizer not wired": (
        {"optimizer": {"type": "Lamb"}},
        "optimizer.type 'Lamb' is a DeepSpeed",
    ),
    "optimizer lr negative": (
        {"optimizer": {"type": "AdamW", "params": {"lr": -0.1}}},
        "the optimizer's lr must be finite and 0 or more",
    ),
    "optimizer beta2 >= 1": (
        {"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.5]}}},
        "beta2 must be finite and in [0, 1)",
    ),
    "optimizer eps 0": (
        {"optimizer": {"type": "AdamW", "params": {"eps": 0}}},
        "eps must be finite and positive",
    ),
    "optimizer decay a string": (
        {"optimizer": {"type": "AdamW", "params": {"weight_decay": "high"}}},
        "optimizer weight_decay must be a number",
    ),
    "optimizer param unknown": (
        {"optimizer": {"type": "AdamW", "params": {"lrr": 1e-3}}},
        "optimizer.params.lrr is not applied",
    ),
    "scheduler unknown": (
        {"scheduler": {"type": "WarmupCosine"}},
        "unknown scheduler.type 'WarmupCosine' (did you mean 'WarmupCosineLR'?)",
    ),
    "scheduler not reproduced": ({"scheduler": {"type": "OneCycle"}}, "'OneCycle' is a DeepSpeed"),
    "scheduler param unknown": (
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 5}}},
        "scheduler.params.warmup_num_step is not applied",
    ),
    "scheduler warmup 0": (
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}},
        "warmup_num_steps must be a positive integer",
    ),
    "scheduler warmup type": (
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "exp"}}},
        "warmup_type must be log or linear",
    ),
    "tensor_parallel": (
        {"tensor_parallel": {"autotp_size": 2}},
        "world size 1 is not divisible by tensor_parallel.autotp_size=2",
    ),
    "sequence_parallel": (
        {"sequence_parallel_size": 2},
        "world size 1 is not divisible by sequence_parallel_size=2",
    ),
    "curriculum": (
        {"curriculum_learning": {"enabled": True}},
        "curriculum_learning is not applied",
    ),
    "partition_activations": (
        {"activation_checkpointing": {"partition_activations": True}},
        "activation_checkpointing.partition_activations=true is not applied",
    ),
    "activation key typo": (
        {"activation_checkpointing": {"cpu_checkpoint": True}},
        "did you mean 'cpu_checkpointing'?",
    ),
    "load_universal by hand": ({"checkpoint": {"load_universal": True}}, "decided by --universal"),
    # DeepSpeed's writers: decoupled returns before its files are written (they would be sealed
    # half-written); the fast one was not verified under the sealing rule.
    "decoupled writer": (
        {"checkpoint": {"writer": {"decoupled": True}}},
        "checkpoint.writer (decoupled writer) is not applied",
    ),
    "fast writer": (
        {"checkpoint": {"writer": {"type": "fast", "decoupled": False}}},
        "checkpoint.writer (fast writer) is not applied",
    ),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_bad_config_refused_before_work(capsys, base, tmp_path, case):
    cfg, says = CONFIG_CASES[case]
    line = refused(capsys, [*base, *config(tmp_path, cfg)])
    assert says in line and "c.json" in line
    assert not (tmp_path / "run").exists()


def test_deepspeed_only_keys_refused_under_ddp(capsys, base, tmp_path):
    line = refused(
        capsys,
        [*base, "--backend", "ddp", *config(tmp_path, {"wall_clock_breakdown": True})],
    )
    assert "wall_clock_breakdown is DeepSpeed's and --backend ddp does not apply it" in line
    cfg = {"zero_optimization": {"stage": 2}}
    line = refused(capsys, [*base, "--backend", "fsdp", *config(tmp_path, cfg)])
    assert "zero_optimization is DeepSpeed's" in line


def test_min_lr_ratio_without_a_floor(capsys, base, tmp_path):
    cfg = {"scheduler": {"type": "WarmupLR"}}
    line = refused(capsys, [*base, "--min-lr-ratio", "0.2", *config(tmp_path, cfg)])
    assert "--min-lr-ratio: scheduler WarmupLR" in line


# kind 3: numbers accepted and silently wrong
FLAG_CASES = {
    "--lr inf": (["--lr", "inf"], "--lr must be 0 or more, got inf"),
    "--lr nan": (["--learning_rate", "nan"], "--lr must be 0 or more, got nan"),
    "--warmup -1": (["--warmup", "-1"], "--warmup must be 0 or more"),
    "--grad-clip -1": (["--grad-clip", "-1"], "--grad-clip must be 0 (no clipping) or more"),
    "--beta2 1": (["--beta2", "1"], "--beta2 must be in [0, 1)"),
    "--eps 0": (["--eps", "0"], "--eps must be positive"),
    "--weight-decay -0.1": (["--weight-decay", "-0.1"], "--weight-decay must be 0 or more"),
    "--min-lr-ratio 2": (["--min-lr-ratio", "2"], "--min-lr-ratio must be between 0 and 1"),
    "--keep-last -1": (["--keep-last", "-1"], "--keep-last must be 0 (keep all) or more"),
    "--eval-samples 0": (["--eval-samples", "0"], "--eval-samples must be at least 1"),
    "--log-every 0": (["--log-every", "0"], "--log-every must be at least 1"),
    "--seed -1": (["--seed", "-1"], "--seed must be in 0..2^32-1"),
    "--stop-at 0": (["--stop-at", "0"], "--stop-at must be at least 1"),
    "--grad-accum 0": (["--grad-accum", "0"], "--grad-accum must be at least 1"),
    "--peak-tflops 0": (["--peak-tflops", "0"], "--peak-tflops must be positive"),
    "--dist-timeout inf": (["--dist-timeout", "inf"], "--dist-timeout must be positive"),
    "--profile 5:2": (["--profile", "5:2"], "--profile takes FIRST:LAST steps"),
    "--profile 3": (["--profile", "3"], "--profile takes FIRST:LAST steps"),
    "--profile past the end": (["--profile", "2:999999"], "the run has"),
}


@pytest.mark.parametrize("case", sorted(FLAG_CASES))
def test_bad_number_refused(capsys, base, case):
    argv, says = FLAG_CASES[case]
    assert says in refused(capsys, [*base, *argv])


def test_wandb_missing_is_one_line_at_flag_time(capsys, base):
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    for argv in (["--wandb"], ["--report_to", "wandb"]):
        assert "pip install wandb" in refused(capsys, [*base, *argv])


# kind 2: what crashed inside the run
def _model_folder(tmp_path):
    from models import build_model

    folder = tmp_path / "m"
    build_model("tiny", vocab_size=512).save_pretrained(folder)
    return folder


def test_broken_model_config_json(capsys, base, tmp_path):
    folder = _model_folder(tmp_path)
    (folder / "config.json").write_text('{"model_type": "zerostack", "hidden_size": ')
    line = refused(capsys, [*base, "--model", str(folder)])
    assert "config.json cannot be read" in line


def test_weights_that_do_not_match_their_config(capsys, base, tmp_path):
    folder = _model_folder(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] *= 2
    (folder / "config.json").write_text(json.dumps(cfg))
    line = refused(capsys, [*base, "--model", str(folder)])
    assert "has shape" in line and "of different models" in line


def test_seq_len_longer_than_the_model(capsys, base, tmp_path):
    folder = _model_folder(tmp_path)  # tiny's 256 positions, as trained
    line = refused(capsys, [*base, "--model", str(folder), "--seq-len", "512"])
    assert f"--seq-len 512 is longer than --model {folder}'s 256 positions" in line


def test_a_preset_is_built_for_a_longer_sequence():
    """A preset has no trained positions: long context widens its rotary range instead."""
    from models import build_model
    from training.preflight import model_config, model_overrides

    assert model_overrides("tiny", 256) == {}
    overrides = model_overrides("tiny", 512)
    assert model_config("tiny", 512, overrides).max_position_embeddings == 512
    model = build_model("tiny", vocab_size=512, overrides=overrides)
    assert model.config.max_position_embeddings == 512
    x = torch.randint(0, 512, (1, 512))
    assert model(x).logits.shape == (1, 512, 512)


def test_seq_len_longer_than_the_data(capsys, tiny_data, tmp_path):
    folder = _model_folder(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["max_position_embeddings"] = 1 << 20
    (folder / "config.json").write_text(json.dumps(cfg))
    argv = ["--data", str(tiny_data), "--out", str(tmp_path / "run"), "--model", str(folder)]
    line = refused(capsys, [*argv, "--seq-len", "200000"])
    assert "split of" in line and "too few for one window" in line


def test_out_under_a_file(capsys, tiny_data, tmp_path):
    (tmp_path / "f").write_text("x")
    argv = ["--data", str(tiny_data), "--model", "tiny", "--out", str(tmp_path / "f" / "run")]
    assert "is a file, not a folder" in refused(capsys, argv)


@pytest.mark.parametrize("where", ["the data folder", "inside it"])
def test_out_in_a_data_folder(capsys, tiny_data, where):
    out = tiny_data if where == "the data folder" else tiny_data / "runs" / "r1"
    before = sorted(p.name for p in tiny_data.iterdir())
    line = refused(capsys, ["--data", str(tiny_data), "--model", "tiny", "--out", str(out)])
    assert "is a prepared data folder" in line
    assert sorted(p.name for p in tiny_data.iterdir()) == before


def test_resume_with_another_model_shape(capsys, base, tmp_path):
    folder = tmp_path / "run" / "checkpoints" / "step_00000004"
    folder.mkdir(parents=True)
    from models import get_config

    saved = get_config("tiny", vocab_size=512).to_dict()
    saved["hidden_size"] = 128
    state = {"step": 4, "backend": "deepspeed", "world": 1, "zero_stage": 2, "model_config": saved}
    (folder / "trainer_state.json").write_text(json.dumps(state))
    (folder / "rng_state.json").write_text("[]")
    files = {n: (folder / n).stat().st_size for n in ("trainer_state.json", "rng_state.json")}
    (folder / "complete.json").write_text(json.dumps({"files": files}))
    (folder.parent / "latest").write_text(folder.name)
    line = refused(capsys, base)
    assert "hidden_size=128" in line and "--model tiny has hidden_size=64" in line


# issue 18: every key applied or refused
def resolve(raw, **flags):
    kw = sections(**{"steps": 50, "backend": "deepspeed", **flags})
    return C.resolve(raw, world=1, **kw, hidden_size=64, source="t.json", device_type="cpu")


# A value for each top-level key, as a user would write it.
SAMPLES = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "steps_per_print": 10,
    "dump_state": True,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
    # world 1 here: sizes of 1 (tests/test_parallel_layout.py checks real sizes)
    "tensor_parallel": {"autotp_size": 1},
    "sequence_parallel_size": 1,
    "expert_parallel": {"enabled": True, "autoep_size": 1},
    "seq_parallel_communication_data_type": "fp32",
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
    "fp16": {"enabled": False},
    "bf16": {"enabled": True},
    "bfloat16": {"enabled": True},
    "gradient_clipping": 0.5,
    "prescale_gradients": True,
    "gradient_predivide_factor": 2.0,
    "sparse_gradients": True,
    "zero_optimization": {"stage": 1},
    "zero_allow_untested_optimizer": True,
    "zero_force_ds_cpu_optimizer": True,
    "activation_checkpointing": {"partition_activations": False},
    "flops_profiler": {"enabled": True},
    "wall_clock_breakdown": True,
    "memory_breakdown": True,
    "tensorboard": {"enabled": True, "output_path": "tb"},
    "wandb": {"enabled": True},
    "csv_monitor": {"enabled": True},
    "comet": {"enabled": True},
    "comms_logger": {"enabled": True},
    "aio": {"block_size": 1048576},
    "pipeline": {"stages": 1},
    "checkpoint": {"tag_validation": "Fail"},
    "data_types": {"grad_accum_dtype": "fp32"},
    "communication_data_type": "fp32",
    "graph_harvesting": True,
    "timers": {"throughput": {"enabled": True}},
}


def test_every_known_key_is_applied_or_refused():
    """Each key of KNOWN_KEYS either changes what the run uses (the resolved config handed to
    DeepSpeed, the schedule, the model's checkpointing) or is refused naming it."""
    groups = (keys.APPLIED_BY_ZEROSTACK, keys.APPLIED_BY_DEEPSPEED, set(keys.REFUSED))
    assert set().union(*groups) == C.KNOWN_KEYS and sum(map(len, groups)) == len(C.KNOWN_KEYS)
    plain = OptimConfig(steps=50)
    plain_opt, plain_sched = C.hyperparameters(resolve({}), plain, "deepspeed")
    for key in sorted(C.KNOWN_KEYS):
        if key in keys.REFUSED:
            with pytest.raises(ConfigError, match=f"t.json: {key} is not applied"):
                resolve({key: {"enabled": True}})
            continue
        out = resolve({key: SAMPLES[key]})
        opt, sched = C.hyperparameters(out, plain, "deepspeed")
        if key == "optimizer":
            assert opt["lr"] == 3e-4 != plain_opt["lr"]
        elif key == "scheduler":
            assert sched["kind"] == "WarmupLR" and sched["warmup"] == 5 != plain_sched["warmup"]
        elif key == "activation_checkpointing":
            assert C.activation_checkpointing(out, False) and not C.activation_checkpointing(
                {}, False
            )
        elif key == "gradient_accumulation_steps":
            assert out["gradient_accumulation_steps"] != 1  # the triplet derived from it
        else:
            assert out[key] == SAMPLES[key], key  # handed to deepspeed.initialize as written
        sized = (
            "zero_optimization",
            "pipeline",
            "tensor_parallel",
            "sequence_parallel_size",
            "expert_parallel",
        )
        if key in keys.APPLIED_BY_DEEPSPEED and key not in sized:
            with pytest.raises(ConfigError, match=f"{key} is DeepSpeed's"):
                resolve({key: SAMPLES[key]}, backend="ddp")


def test_optimizer_values_follow_one_rule():
    """Flag given > ds_config > default, for each number; written into the resolved config."""
    raw = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.8, 0.99]}}}
    out = resolve(raw)
    assert out["optimizer"]["params"] == {
        "lr": 3e-4,
        "betas": [0.8, 0.99],
        "eps": 1e-8,
        "weight_decay": 0.1,
    }
    opt, sched = C.hyperparameters(out, OptimConfig(steps=50), "deepspeed")
    assert opt["lr"] == 3e-4 and sched["lr"] == 3e-4  # the schedule peaks at the config's lr
    opt, sched = C.hyperparameters(
        resolve(raw, lr=1e-2), OptimConfig(steps=50, lr=1e-2), "deepspeed"
    )
    assert opt["lr"] == 1e-2 and sched["lr"] == 1e-2 and opt["betas"] == [0.8, 0.99]
    opt, _ = C.hyperparameters(resolve({}), OptimConfig(steps=50), "deepspeed")
    assert opt == {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}


def _deepspeed_lrs(cls, steps, opt_lr, **params):
    """The learning rate each optimizer update runs with under DeepSpeed's own scheduler."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=opt_lr)
    sched, lrs = cls(opt, **params), []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        sched.step()
    return lrs


@pytest.mark.parametrize("kind", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"])
@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_scheduler_section_is_what_deepspeed_computes(kind, warmup_type):
    from deepspeed.runtime import lr_schedules

    params = {"warmup_num_steps": 6, "warmup_type": warmup_type}
    params |= {"cos_min_ratio": 0.05, "warmup_min_ratio": 0.1} if kind == "WarmupCosineLR" else {}
    params |= {"warmup_min_lr": 1e-5} if kind != "WarmupCosineLR" else {}
    raw = {"optimizer": {"type": "AdamW", "params": {"lr": 2e-3}}, "scheduler": {"type": kind}}
    raw["scheduler"]["params"] = params
    out = resolve(raw, steps=20)
    _, fields = C.hyperparameters(out, OptimConfig(steps=20), "deepspeed")
    ours = [Schedule(**fields).at(s) for s in range(24)]
    theirs = _deepspeed_lrs(
        getattr(lr_schedules, kind), 24, 2e-3, **out["scheduler"]["params"]
    )  # DeepSpeed's class, fed the resolved section exactly as deepspeed.initialize would be
    assert ours == pytest.approx(theirs, rel=1e-12, abs=0)
    assert max(ours) == pytest.approx(2e-3, rel=0.05)
    assert out["scheduler"]["params"][
        "total_num_steps" if kind != "WarmupLR" else "warmup_num_steps"
    ]


def test_warmup_flag_overrides_the_scheduler_section():
    raw = {"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 50}}}
    flags = {"steps": 100, "warmup": 7, "min_lr_ratio": 0.3}
    _, fields = C.hyperparameters(resolve(raw, **flags), OptimConfig(**flags), "deepspeed")
    assert fields["warmup"] == 7 and fields["min_lr_ratio"] == 0.3 and fields["total"] == 100
    assert math.isclose(Schedule(**fields).at(99), 1e-3 * 0.3, rel_tol=0.01)


def test_cpu_checkpointing_applies_on_cpu_only():
    raw = {"activation_checkpointing": {"cpu_checkpointing": True}}
    assert C.activation_checkpointing(resolve(raw), False)
    with pytest.raises(ConfigError, match="cpu_checkpointing=true is not applied"):
        C.resolve(raw, world=1, optim=OptimConfig(steps=5), hidden_size=64, device_type="cuda")


def test_deepspeed_defaults_for_scheduler_params():
    schedule = {"scheduler": {"type": "WarmupLR"}}
    fields = hparams.resolve_schedule(schedule, OptimConfig(steps=10), 5e-4, "t")
    assert fields["warmup"] == 1000 and fields["warmup_type"] == "log" and fields["lr"] == 5e-4


@pytest.mark.slow
def test_a_run_follows_the_config_schedule_and_optimizer(tiny_data, tmp_path):
    """End to end: a run with an optimizer and a scheduler section and no --lr uses the config's
    numbers at every step (the DeepSpeed engine, one rank), and records them."""
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 5e-3, "torch_adam": True}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"warmup_num_steps": 3, "warmup_type": "linear", "warmup_min_lr": 1e-4},
        },
        "activation_checkpointing": {},
    }
    out = tmp_path / "run"
    argv = ["--data", str(tiny_data), "--model", "tiny", "--out", str(out), "--seq-len", "64"]
    argv += [*config(tmp_path, cfg), "--steps", "5", "--log-every", "1", "--eval-every", "0"]
    launch([*argv, "--save-every", "-1"], nproc=1)
    lrs = [r["lr"] for r in read_metrics(out)]
    params = {"warmup_num_steps": 3, "warmup_type": "linear", "warmup_min_lr": 1e-4}
    want = _deepspeed_lrs(WarmupDecayLR, 5, 5e-3, total_num_steps=5, warmup_max_lr=5e-3, **params)
    assert lrs == pytest.approx(want, rel=1e-9) and max(lrs) == pytest.approx(5e-3)
    record = json.loads((out / "resolved_config.json").read_text())["ds_config"]
    assert record["optimizer"]["params"]["lr"] == 5e-3
    assert record["scheduler"]["params"]["total_num_steps"] == 5


def test_hostfile_host_that_does_not_resolve(tmp_path):
    """launch/hostfile.sh refuses before DeepSpeed's launcher starts (it would die with a
    traceback)."""
    import subprocess
    from pathlib import Path

    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=1\n# a comment\nno-such-host.invalid slots=2\n")
    repo = Path(__file__).resolve().parent.parent
    p = subprocess.run(
        ["bash", "launch/hostfile.sh", str(hostfile), "127.0.0.1", "--steps", "1"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2
    assert p.stderr.strip() == (
        f"error: hostfile {hostfile}: host 'no-such-host.invalid' does not resolve"
    )
