"""--optimizer muon: Muon on the transformer blocks' weight matrices, AdamW on the rest, on every
engine (DeepSpeed's Muon on ZeRO, torch.optim.Muon on DDP and FSDP2). The split, a run that
trains and is not AdamW's, the same steps on 1 and 2 ranks and on DeepSpeed and DDP, an exact
resume, and the refusals before any work."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch
from conftest import TINY_RUN, fresh_interpreter, launch, read_metrics, refused

from training.engines.base import OptimizerHparams
from training.engines.optim import muon_split, native_optimizer

# torch.compile off: DeepSpeed's Muon as it runs without its compile wrappers (the reference of
# the patch that runs it so on a CPU, engines/ds.py: eager_muon_on_cpu)
EAGER = {"TORCH_COMPILE_DISABLE": "1"}
STEPS = 8
# fp32, and Muon's default of no clipping (under ZeRO 1-3 DeepSpeed would clip the orthogonalized
# update where ZeRO-0, DDP and FSDP2 clip the gradient: refused there). The same 2 sequences a
# step on 1 rank (2 micro-steps) and on 2.
RUN = [*TINY_RUN, "--micro-batch", "1", "--steps", str(STEPS), "--precision", "fp32",
       "--lr", "3e-3"]  # fmt: skip
MATRIX = re.compile(r"layers\.\d+\.(attention\.w[qkvo]|feed_forward\.w[123])\.weight")


def test_the_split_puts_exactly_the_blocks_matrices_in_muon():
    """The blocks' attention and MLP projections to Muon; the embedding (tied to the head) and
    the norms to AdamW, as DeepSpeed's own tagging would put them (its Muon reads those tags);
    the native engines' optimizer steps each in its half."""
    import deepspeed

    from models import build_model

    model = build_model("tiny", vocab_size=256)
    muon, rest = muon_split(model)
    names = [n for n, _ in model.named_parameters()]
    assert muon == [n for n in names if MATRIX.fullmatch(n)] and len(muon) == 14
    assert rest == [n for n in names if n not in muon]
    assert "tok_embeddings.weight" in rest and all("norm" in n for n in rest[1:])
    config = SimpleNamespace(optimizer_name="muon", optimizer_params={})
    deepspeed.set_optimizer_flags(config, model)
    assert [n for n, p in model.named_parameters() if p.use_muon] == muon
    opt = native_optimizer(model, OptimizerHparams(1e-3, (0.9, 0.95), 1e-8, 0.1, 0.02), muon,
                           device_type="cpu")  # fmt: skip
    by_id = {id(p): n for n, p in model.named_parameters()}
    assert [by_id[id(p)] for p in opt.muon.param_groups[0]["params"]] == muon
    assert isinstance(opt.muon, torch.optim.Muon) and isinstance(opt.adamw, torch.optim.AdamW)


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory) -> dict:
    """ZeRO-2 on 1 rank (Muon and AdamW) and on 2, DDP on 2 with a checkpoint at step 4, FSDP2
    on 2 with --fsdp-cpu-offload."""
    base, out = tmp_path_factory.mktemp("muon"), {}

    def run(name, nproc, *extra):
        out[name] = base / name
        args = ["--data", str(tiny_data), *RUN, "--out", str(out[name]), *extra]
        launch(args, nproc=nproc)

    zero2 = ("--ds_config", "ds_configs/zero2.json")
    run("zero2_1", 1, *zero2, "--grad-accum", "2", "--optimizer", "muon", "--save-every", "0")
    run("adamw_1", 1, *zero2, "--grad-accum", "2", "--save-every", "0")
    run("zero2_2", 2, *zero2, "--optimizer", "muon", "--save-every", "0")
    run("ddp_2", 2, "--backend", "ddp", "--optimizer", "muon", "--save-every", "4")
    # FSDP2 with its shards kept on the host (the plain FSDP2 x Muon pair is the matrix's)
    offload = ("--fsdp-cpu-offload",)
    run("fsdp_2", 2, "--backend", "fsdp", *offload, "--optimizer", "muon", "--save-every", "0")
    return out


def _losses(run) -> list[float]:
    return [r["loss"] for r in read_metrics(run)]


@pytest.mark.slow
def test_a_muon_run_trains_and_is_not_adamw(runs):
    muon, adamw = _losses(runs["zero2_1"]), _losses(runs["adamw_1"])
    assert len(muon) == STEPS and sum(muon[-3:]) < sum(muon[:3]) - 0.3, muon  # it learns
    pairs = list(zip(muon[1:], adamw[1:], strict=True))
    assert muon[0] == adamw[0] and all(a != b for a, b in pairs), (muon, adamw)
    resolved = json.loads((runs["zero2_1"] / "resolved_config.json").read_text())
    section = resolved["ds_config"]["optimizer"]
    assert section["type"] == "Muon" and section["params"]["muon_lr"] == 0.02, section
    assert resolved["ds_config"]["gradient_clipping"] == 0.0  # Muon's default on every engine
    adamw = json.loads((runs["adamw_1"] / "resolved_config.json").read_text())
    assert adamw["ds_config"]["gradient_clipping"] == 1.0


@pytest.mark.slow
def test_muon_takes_the_same_steps_on_2_ranks_and_on_ddp_and_fsdp(runs):
    """ZeRO-2 on 2 ranks (each rank orthogonalizes the matrices of its partition), DDP's
    torch.optim.Muon and FSDP2's (on sharded matrices, offloaded to the host) against ZeRO-2 on
    1 rank, under the cross-engine tests' bound (tests/test_engines.py: 1e-3 relative; measured
    within 1e-4)."""
    ref = _losses(runs["zero2_1"])
    for name in ("zero2_2", "ddp_2", "fsdp_2"):
        for step, (a, b) in enumerate(zip(_losses(runs[name]), ref, strict=True), 1):
            assert abs(a - b) <= 1e-3 * b, (name, step, _losses(runs[name]), ref)


@pytest.mark.slow
def test_a_muon_run_resumes_exactly(runs, tiny_data, tmp_path):
    """DDP's checkpoint at step 4 (Muon's momentum and AdamW's moments in one optimizer state)
    continues to the same losses, bit for bit."""
    out = tmp_path / "resumed"
    args = ["--data", str(tiny_data), *RUN, "--out", str(out), "--backend", "ddp",
            "--optimizer", "muon", "--save-every", "0",
            "--resume", str(runs["ddp_2"] / "checkpoints" / "step_00000004")]  # fmt: skip
    r = launch(args, nproc=2)
    assert "resumed from step_00000004" in r.stdout + r.stderr
    straight, resumed = read_metrics(runs["ddp_2"])[4:], read_metrics(out)
    assert [x["step"] for x in resumed] == list(range(5, STEPS + 1))
    assert [(x["loss"], x["grad_norm"]) for x in resumed] == [
        (x["loss"], x["grad_norm"]) for x in straight
    ]


@pytest.mark.slow
def test_a_resume_keeps_its_optimizer(runs, tiny_data, tmp_path, capsys, monkeypatch):
    step4 = runs["ddp_2"] / "checkpoints" / "step_00000004"
    argv = ["--data", str(tiny_data), *RUN, "--out", str(tmp_path / "run"), "--backend", "ddp",
            "--resume", str(step4)]  # fmt: skip
    err = refused(capsys, monkeypatch, tmp_path, argv)
    assert "was trained with --optimizer muon, this run asks for --optimizer adamw" in err


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--ds_config", "ds_configs/zero2_offload.json"], "zero_optimization.offload_optimizer"),
        (["--ds_config", "ds_configs/zero3_offload.json"], "zero_optimization.offload_"),
        (["--ds_config", "ds_configs/pipeline.json"], "pipeline parallelism"),
        (["--ds_config", "ds_configs/tp2.json"], "tensor parallelism"),
        (["--ds_config", "ds_configs/sp2.json"], "sequence parallelism"),
        (["--lora", "r=4"], "--optimizer muon with --lora"),
        (["--ds_config", "ds_configs/zero0.json", "--precision", "bf16"], "ZeRO-0 in bf16"),
        (["--model", "tiny-moe"], "mixture-of-experts model"),
        (
            ["--ds_config", "ds_configs/zero2.json", "--grad-clip", "1"],
            "clipping (1.0) under ZeRO-2",
        ),
    ],
)
def test_muon_is_refused_in_one_line_where_it_does_not_run(
    extra, says, tiny_data, tmp_path, capsys, monkeypatch
):
    argv = ["--data", str(tiny_data), *TINY_RUN, "--out", str(tmp_path / "run"),
            "--optimizer", "muon", *extra]  # fmt: skip
    err = refused(capsys, monkeypatch, tmp_path, argv)
    assert says in err and ("--optimizer muon" in err), err


def test_a_muon_section_needs_the_flag(tiny_data, tmp_path, capsys, monkeypatch):
    config = tmp_path / "muon.json"
    config.write_text(json.dumps({"optimizer": {"type": "Muon", "params": {}}}))
    argv = ["--data", str(tiny_data), *TINY_RUN, "--out", str(tmp_path / "run"),
            "--ds_config", str(config)]  # fmt: skip
    err = refused(capsys, monkeypatch, tmp_path, argv)
    assert "Muon is chosen with --optimizer muon" in err


EAGER_SCRIPT = """
import json, os, sys, torch, deepspeed
from training.engines.ds import eager_muon_on_cpu
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
os.environ["MASTER_PORT"] = sys.argv[1]
deepspeed.init_distributed("gloo")
params = {"lr": 1e-3, "muon_lr": 0.02, "adam_lr": 1e-3, "momentum": 0.95,
          "ns_method": "standard", "weight_decay": 0.0}
config = {"train_batch_size": 2, "zero_optimization": {"stage": 2},
          "optimizer": {"type": "Muon", "params": params}}
eager = eager_muon_on_cpu(config, "cpu") if sys.argv[2] == "patched" else False
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
x, losses = torch.randn(2, 8), []
for _ in range(3):
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
print(json.dumps({"eager": eager, "losses": losses, "graphs": graphs}))
"""


@pytest.mark.slow  # fresh interpreters, one of them compiling
def test_deepspeeds_muon_runs_eagerly_on_a_cpu():
    """Patched, DeepSpeed's Muon compiles nothing on a CPU and takes the steps its eager path
    takes (stock with torch.compile off), bit for bit; stock compiles its Newton-Schulz."""
    stock = fresh_interpreter(EAGER_SCRIPT, "stock")
    stock_eager = fresh_interpreter(EAGER_SCRIPT, "stock", env=EAGER)
    patched = fresh_interpreter(EAGER_SCRIPT, "patched")
    assert stock["graphs"] > 0 and patched["graphs"] == 0 and patched["eager"]
    assert patched["losses"] == stock_eager["losses"]
    assert patched["losses"][0] == stock["losses"][0]  # the first step is before any update


NS_SCRIPT = """
import importlib, json, torch
from torch.optim import _muon
from training.engines.muon import DEEPSPEED_MUON, newton_schulz, newton_schulz_in_fp32
ds = importlib.import_module(DEEPSPEED_MUON)
stock_torch, stock_ds = _muon._zeropower_via_newtonschulz, ds.ns_compute_dtype
torch.manual_seed(0)
ab, mats = (3.4445, -4.7750, 2.0315), [torch.randn(48, 96), torch.randn(96, 48)]
faithful = all(torch.equal(newton_schulz(m, ab, 5, 1e-7, dtype=torch.bfloat16),
                           stock_torch(m, ab, 5, 1e-7)) for m in mats)
off = newton_schulz_in_fp32("cuda", "fp32") + newton_schulz_in_fp32("cpu", "bf16")
before = str(ds.ns_compute_dtype("standard"))
applied = newton_schulz_in_fp32("cpu", "fp32")
kept = [m.clone() for m in mats]
outs = [_muon._zeropower_via_newtonschulz(m, ab, 5, 1e-7) for m in mats]
eager = getattr(ds.zeropower_via_newtonschulz5, "_torchdynamo_orig_callable", None)
gap = max((o - stock_torch(m, ab, 5, 1e-7).float()).abs().max().item() for o, m in zip(outs, mats))
print(json.dumps({"faithful": faithful, "off": off, "before": before, "applied": applied,
                  "after": str(ds.ns_compute_dtype("standard")),
                  "gram_kept": ds.ns_compute_dtype("gram") == stock_ds("gram"),
                  "torch": sorted({str(o.dtype) for o in outs}), "ds": str(eager(mats[0], 5).dtype),
                  "untouched": all(torch.equal(a, b) for a, b in zip(mats, kept)), "gap": gap}))
"""


@pytest.mark.slow  # a fresh interpreter: no stand-in of DeepSpeed's Muon from an earlier test
def test_newton_schulz_runs_in_fp32_in_an_fp32_run_on_a_cpu():
    """Stock, DeepSpeed's and torch's Muon orthogonalize in bf16, emulated on a CPU without bf16
    units; patched, an fp32 run on a CPU computes it in fp32 (a bf16 run, or one on an
    accelerator, keeps stock's). Torch's function is replaced by a copy, which in bf16 gives
    stock's result bit for bit and leaves its input alone in fp32."""
    got = fresh_interpreter(NS_SCRIPT)
    assert got["faithful"] and got["off"] == [] and got["before"] == "torch.bfloat16"
    assert got["applied"] == ["muon_ns_fp32_on_cpu_deepspeed", "muon_ns_fp32_on_cpu_torch"]
    assert got["after"] == "torch.float32" and got["gram_kept"] and got["untouched"]
    assert got["torch"] == ["torch.float32"] and got["ds"] == "torch.float32"
    assert 0 < got["gap"] < 0.1, got  # bf16's rounding, and no more


UNTIED_SCRIPT = """
import json, os, sys, torch, deepspeed
from models import build_model
from training.engines.ds import keep_muon_split
from training.engines.optim import muon_split
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
os.environ["MASTER_PORT"] = sys.argv[1]
deepspeed.init_distributed("gloo")
params = {"lr": 1e-3, "muon_lr": 0.02, "adam_lr": 1e-3, "momentum": 0.95, "weight_decay": 0.0}
config = {"train_batch_size": 2, "zero_optimization": {"stage": 2},
          "optimizer": {"type": "Muon", "params": params}}
kept = keep_muon_split(config) if sys.argv[2] == "patched" else False
model = build_model("tiny", vocab_size=256, overrides={"tie_word_embeddings": False})
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
tagged = [n for n, p in engine.module.named_parameters() if p.use_muon]
print(json.dumps({"kept": kept, "tagged": tagged, "ours": muon_split(model)[0]}))
"""


@pytest.mark.slow  # fresh interpreters
def test_an_untied_head_stays_with_adamw_under_deepspeed():
    """DeepSpeed's own rule gives a 2-D output head that is not named lm_head (ours, untied:
    `output.weight`) to Muon; patched, its tags are zerostack's split, as under DDP and FSDP2."""
    stock = fresh_interpreter(UNTIED_SCRIPT, "stock")
    patched = fresh_interpreter(UNTIED_SCRIPT, "patched")
    assert "output.weight" in stock["tagged"] and "output.weight" not in stock["ours"]
    assert patched["kept"] and patched["tagged"] == patched["ours"]
