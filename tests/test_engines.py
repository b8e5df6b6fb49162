"""DDP and FSDP2 beside DeepSpeed: the same trajectory from the same weights, model-state memory
as ZeRO's theory says, exact resume (FSDP2 also onto another world size), export to HF."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import launch, read_metrics, shm_has_room

ENGINES = ["ddp", "fsdp", "zero0", "zero1", "zero2", "zero3"]
STEPS = 20
COMMON = [
    *("--seq-len", "64", "--micro-batch", "1", "--log-every", "1", "--eval-every", "0"),
    *("--eval-samples", "8", "--lr", "3e-3", "--warmup", "2", "--steps", str(STEPS)),
]


def engine_flags(name: str) -> list[str]:
    if name in ("ddp", "fsdp"):
        return ["--backend", name]
    return ["--ds_config", f"ds_configs/{name}.json"]


@pytest.fixture(scope="module")
def init_model(tiny_data, tmp_path_factory):
    """One set of initial weights for every engine. (Seeding before construction is not
    enough: under ZeRO-3 the model is built partitioned and draws its random numbers in
    another order.)"""
    from data import load_manifest
    from models import build_model

    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=load_manifest(tiny_data).vocab_size)
    folder = tmp_path_factory.mktemp("init") / "tiny"
    model.save_pretrained(folder)
    return folder


def args(data, model, out, *extra, accum: int = 2) -> list[str]:
    return [
        *("--data", str(data), "--model", str(model), "--out", str(out)),
        *COMMON,
        *("--grad-accum", str(accum)),
        *extra,
    ]


@pytest.fixture(scope="module")
def runs(tiny_data, init_model, tmp_path_factory):
    """Every engine, 2 ranks, micro-batch 1 x 2 accumulation steps, 20 steps."""
    base = tmp_path_factory.mktemp("engines")
    out = {}
    for name in ENGINES:
        out[name] = base / name
        save = "0" if name in ("ddp", "fsdp") else "-1"  # native runs keep a final checkpoint
        launch(args(tiny_data, init_model, out[name], *engine_flags(name), "--save-every", save))
    return out


@pytest.mark.slow
def test_engines_follow_the_same_trajectory(runs):
    """In the precision "auto" picks on this host. In bf16: reference ZeRO-2 (bf16 weights,
    fp32 master copies, fp32 gradient reduction). DDP (fp32 weights, bf16 autocast), FSDP2
    (fp32 shards, bf16 compute, fp32 reduction), ZeRO-1 and ZeRO-3 differ from it only by
    where bf16 rounding happens: measured within 2e-4 relative over 20 steps; we hold 1e-3.
    ZeRO-0 in bf16 accumulates and all-reduces gradients in bf16 (8 mantissa bits), which
    moves its loss by ~1% here; we hold 2.5%. In fp32 (a host without bf16 units) every
    engine differs from ZeRO-2 only by the order of fp32 sums: measured within 1e-7 relative
    in loss and 6e-7 in gradient norm over 20 steps, under the same bounds."""
    loss = {n: [r["loss"] for r in read_metrics(runs[n])] for n in ENGINES}
    norm = {n: [r["grad_norm"] for r in read_metrics(runs[n])] for n in ENGINES}
    ref = loss["zero2"]
    assert len(ref) == STEPS and ref[-1] < ref[0] - 0.5, ref  # it learns
    for name in ENGINES:
        tol = 2.5e-2 if name == "zero0" else 1e-3
        for step, (a, b) in enumerate(zip(loss[name], ref, strict=True), 1):
            assert abs(a - b) <= tol * b, (name, step, loss[name], ref)
    # Gradient norms say the gradients themselves agree (a wrong accumulation scale would not
    # show in Adam's updates, but would here).
    for name in ENGINES:  # step 1: the same weights and batch, so the same gradient
        assert abs(norm[name][0] - norm["zero2"][0]) <= 1e-2 * norm["zero2"][0], norm
    for name in ("ddp", "fsdp", "zero1", "zero3"):  # measured within 8%
        for a, b in zip(norm[name], norm["zero2"], strict=True):
            assert abs(a - b) <= 0.2 * b, (name, norm[name], norm["zero2"])
    # DeepSpeed's and FSDP2's collectives went through shared memory (every rank on this
    # host); DDP's through gloo.
    for name in ENGINES:
        resolved = json.loads((runs[name] / "resolved_config.json").read_text())
        assert resolved["shm_collectives"] == (name != "ddp" and shm_has_room())
    # The loop logged model-state bytes once: FSDP2 keeps half of what DDP keeps on 2 ranks.
    states = {n: read_metrics(runs[n], "state_bytes") for n in ("ddp", "fsdp")}
    assert [len(s) for s in states.values()] == [1, 1]
    ddp, fsdp = states["ddp"][0], states["fsdp"][0]
    # ... but while it holds weights and gradients across micro-steps (one CPU host): whole
    # fp32 gradients, and the whole weights gathered in the run's precision (2N bytes in bf16,
    # 4N in fp32) as the model's parameters, beside the fp32 shards (2N on each of 2 ranks,
    # which the count reaches through FSDP2's state and files under optimizer)
    resolved = json.loads((runs["fsdp"] / "resolved_config.json").read_text())
    held = resolved["held_across_micro_steps"]
    want = {k: ddp[k] / 2 for k in ("params_bytes", "grads_bytes", "optimizer_bytes")}
    if held:
        weight_bytes = 4 if resolved["precision"] == "fp32" else 2
        want["params_bytes"] = ddp["params_bytes"] * weight_bytes / 4  # DDP's are fp32
        want["grads_bytes"] = ddp["grads_bytes"]
        want["optimizer_bytes"] += ddp["params_bytes"] / 2
    for key, value in want.items():
        assert abs(fsdp[key] / value - 1) < 0.02, (key, held, ddp, fsdp)


@pytest.mark.slow
def test_fsdp_on_shared_memory_is_bitwise_fsdp_on_gloo(runs, tiny_data, init_model, tmp_path):
    """On one CPU host FSDP2's all-gathers and reduce-scatters (an average) go through
    DeepSpeed's shared-memory kernel (runtime/shm.py: fsdp_comms); the same run with them on
    gloo takes the same steps to the bit, gradient norms included."""
    if not shm_has_room():
        pytest.skip("/dev/shm cannot hold DeepSpeed's segments here (the route stays off)")
    out = tmp_path / "gloo"
    flags = [*engine_flags("fsdp"), "--save-every", "-1"]
    launch(args(tiny_data, init_model, out, *flags, "--shm-collectives", "off"))
    assert json.loads((out / "resolved_config.json").read_text())["shm_collectives"] is False
    on, off = read_metrics(runs["fsdp"]), read_metrics(out)
    assert [(r["loss"], r["grad_norm"]) for r in on] == [(r["loss"], r["grad_norm"]) for r in off]


@pytest.fixture(scope="module")
def stopped(tiny_data, init_model, tmp_path_factory):
    """DDP and FSDP2 runs of the same job stopped (and saved) after step 10."""
    base = tmp_path_factory.mktemp("stopped")
    for backend in ("ddp", "fsdp"):
        out = base / backend
        launch(
            [
                *args(tiny_data, init_model, out, *engine_flags(backend), "--save-every", "0"),
                "--stop-at",
                "10",
            ]
        )
        assert (out / "checkpoints" / "latest").read_text() == "step_00000010"
    return base


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_native_engines_resume_exactly(runs, stopped, tiny_data, init_model, backend):
    """Resume the run stopped at step 10 and go on to 20: the same numbers, bit for bit, as
    the straight run."""
    split = stopped / backend
    r = launch(args(tiny_data, init_model, split, *engine_flags(backend), "--save-every", "0"))
    assert "resumed from step_00000010" in r.stdout + r.stderr
    a, b = read_metrics(runs[backend]), read_metrics(split)
    assert [x["step"] for x in b] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm", "lr", "tokens"):
        assert [x[key] for x in a] == [x[key] for x in b], key
    val = [read_metrics(run, "eval")[-1]["val_loss"] for run in (runs[backend], split)]
    assert val[0] == val[1]


@pytest.mark.slow
def test_fsdp_checkpoint_from_2_ranks_resumes_on_1(runs, stopped, tiny_data, init_model, tmp_path):
    """DCP reshards on load: step 10 of the 2-rank run continues on 1 rank with the same global
    batch (micro 1 x 4 accumulation), with both FSDP switches flipped (they change memory and
    communication, not the numbers). Only the order of fp32 gradient sums differs from the
    straight 2-rank run: within 1e-7 relative with SDPA attention; the explicit kernel the
    trainer picks on CPUs rounds its probabilities to bf16, which lets that 1e-7 grow to 2e-5
    over ten steps. We hold 1e-4, far below what a wrong batch or a reset optimizer changes."""
    one = tmp_path / "one"
    r = launch(
        [
            *args(tiny_data, init_model, one, "--backend", "fsdp", "--save-every", "0", accum=4),
            *("--resume", str(stopped / "fsdp" / "checkpoints" / "step_00000010")),
            *("--no-fsdp-reshard-after-forward", "--fsdp-cpu-offload"),
        ],
        nproc=1,
    )
    assert "resumed from step_00000010" in r.stdout + r.stderr
    straight, resumed = read_metrics(runs["fsdp"])[10:], read_metrics(one)
    assert [x["step"] for x in resumed] == list(range(11, STEPS + 1))
    assert [x["tokens"] for x in resumed] == [x["tokens"] for x in straight]
    for a, b in zip(resumed, straight, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * b["loss"], (resumed, straight)
    assert json.loads((one / "resolved_config.json").read_text())["world"] == 1


@pytest.mark.slow
def test_model_state_bytes_fall_as_theory_says(tiny_data, tmp_path):
    """A 19M-parameter model (hidden 384, 8 layers; the tiny vocabulary keeps the embedding
    small), so model states dominate. tests/scripts/state_bytes.py builds each engine in one
    2-rank process group and counts what it holds where the training loop counts
    (training/memory/state_bytes.py). With N parameters: DDP keeps 4N (fp32 weights) + 4N
    (grads) + 8N (Adam); DeepSpeed ZeRO-0 in bf16 keeps 2N + 2N + 12N (fp32 master + Adam);
    each ZeRO stage halves one more of them on 2 ranks, and FSDP2 halves all of DDP's."""
    from models import ZeroStackConfig, num_params

    model = tmp_path / "m19"
    cfg = dict(
        vocab_size=512,
        hidden_size=384,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=6,
        num_key_value_heads=6,
        max_position_embeddings=256,
    )
    ZeroStackConfig(**cfg).save_pretrained(model)
    n = num_params(ZeroStackConfig(**cfg))
    assert n > 18e6
    out = tmp_path / "bytes.json"
    # ZeRO's and FSDP's theory: the script builds its engines without the holds one CPU host
    # gets by default (whole weights for ZeRO-3, whole gradients for FSDP2 across micro-steps;
    # counted in tests/test_train.py and tests/test_mfu.py)
    launch([str(tiny_data), str(model), str(out), *ENGINES], script="tests/scripts/state_bytes.py")
    got = {
        name: max(ranks, key=lambda r: r["total"])
        for name, ranks in json.loads(out.read_text()).items()
    }

    def near(value, expected, rel=0.02):
        return abs(value - expected) <= rel * expected

    ddp, fsdp = got["ddp"], got["fsdp"]
    assert near(ddp["params"], 4 * n) and near(ddp["grads"], 4 * n), ddp
    assert near(ddp["optimizer"], 8 * n), ddp
    for key in ("params", "grads", "optimizer"):
        assert near(fsdp[key], ddp[key] / 2), (key, fsdp, ddp)
    z = [got[f"zero{i}"] for i in range(4)]
    assert near(z[0]["params"], 2 * n) and near(z[0]["grads"], 2 * n), z[0]
    assert near(z[0]["optimizer"], 12 * n), z[0]
    # ZeRO-1: optimizer states halve, the rest stays
    assert near(z[1]["optimizer"], z[0]["optimizer"] / 2), z[1]
    assert near(z[1]["params"], z[0]["params"]) and near(z[1]["grads"], z[0]["grads"]), z[1]
    # ZeRO-2: gradients halve too (the partition DeepSpeed pads to its alignment)
    assert near(z[2]["grads"], z[1]["grads"] / 2, rel=0.1), z[2]
    assert near(z[2]["optimizer"], z[1]["optimizer"]), z[2]
    # ZeRO-3: parameters halve too
    assert near(z[3]["params"], z[2]["params"] / 2), z[3]
    assert near(z[3]["grads"], z[2]["grads"], rel=0.1), z[3]
    assert near(z[3]["optimizer"], z[2]["optimizer"]), z[3]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_native_checkpoint_exports_to_hf(runs, tmp_path, backend):
    """The final checkpoint goes through training/checkpoints/hf_export.py like DeepSpeed's; stock
    transformers reloads it and its logits match our model holding the checkpoint's weights."""
    from transformers import AutoModelForCausalLM

    from models import ZeroStackForCausalLM
    from training.checkpoints import layout as ckpt
    from training.checkpoints.hf_export import export
    from training.checkpoints.weights import config_from_dict
    from training.engines import load_full_state_dict

    folder = runs[backend] / "checkpoints" / f"step_{STEPS:08d}"
    hf = export(runs[backend], tmp_path / "hf")
    state = ckpt.load_trainer_state(folder.parent, folder.name)
    assert state["backend"] == backend and state["world"] == 2

    sd = load_full_state_dict(backend, folder)
    ours = ZeroStackForCausalLM(config_from_dict(state["model_config"]))
    assert set(sd) <= set(ours.state_dict()) and all(v.dtype == torch.float32 for v in sd.values())
    ours.load_state_dict(sd, strict=False)  # a tied head may be stored once
    ours.tie_weights()
    theirs = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    assert type(theirs).__name__ == "LlamaForCausalLM"
    ids = torch.randint(
        0, ours.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        a, b = ours.eval()(input_ids=ids).logits, theirs.eval()(input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()
    # and they are the trained weights, not the initial ones: the export's loss on validation
    # text matches what the trainer measured at the end (bf16 there, fp32 here)
    from data import TokenDataset, eval_batches

    val = TokenDataset(state["data_dir"], "val", 64)
    losses = [
        theirs(input_ids=x, labels=y, shift_labels=y).loss.item()
        for x, y in eval_batches(val, 1, 0, 1, max_samples=8)
    ]
    trained = read_metrics(runs[backend], "eval")[-1]["val_loss"]
    assert abs(sum(losses) / len(losses) - trained) < 0.02 * trained, (losses, trained)


@pytest.mark.slow
def test_native_flags_and_backend_mismatch_fail_in_one_line(capsys, tiny_data, stopped, tmp_path):
    from training.train import main

    base = ["--data", str(tiny_data), "--model", "tiny"]
    cases = [
        (
            ["--out", str(tmp_path / "a"), "--fsdp-cpu-offload"],
            "--fsdp-cpu-offload needs --backend fsdp",
        ),
        (
            ["--out", str(tmp_path / "b"), "--backend", "ddp", "--ddp-bucket-mb", "0"],
            "must be positive",
        ),
        (["--out", str(stopped / "ddp"), "--backend", "fsdp"], "written by the ddp backend"),
    ]
    for argv, needle in cases:
        assert main([*base, *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and needle in err and "\n" not in err, err


@pytest.mark.slow
def test_compare_report_from_the_runs(runs, tiny_data, init_model, tmp_path):
    """The comparison command's report, written from this module's real runs (the command
    itself only adds launching them: `python -m benchmarks.compare --steps 6 --model tiny`)."""
    import argparse

    from benchmarks.compare.report import write_report
    from benchmarks.compare.runs import summarize

    rows = [summarize(runs[name], name) for name in ENGINES]
    a = argparse.Namespace(
        model=str(init_model),
        data=str(tiny_data),
        steps=STEPS,
        seq_len=64,
        micro_batch=1,
        grad_accum=2,
        ranks=2,
        seed=1234,
        repeats=1,
    )
    text = write_report(rows, a, tmp_path).read_text()
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["states"]["total"] > 0, row
    lines = [x for x in text.splitlines() if x.startswith("| DDP |") or x.startswith("| FSDP2 |")]
    assert len(lines) == 2 and "| 1.00x |" in lines[0], lines
    assert "DeepSpeed `zero2` / DDP = " in text
    for png in ("comparison_memory.png", "comparison_loss.png"):
        assert (tmp_path / png).stat().st_size > 10_000


@pytest.mark.slow
def test_a_run_from_step_0_does_not_mix_in_an_earlier_runs_metrics(tiny_data, init_model, tmp_path):
    """A run from step 0 starts a new metrics.jsonl (only a resumed run adds to one): a
    comparison row holds its own run only, not every run left in runs/compare."""
    import argparse

    from benchmarks.compare.runs import run_engine

    stale = tmp_path / "ddp"
    stale.mkdir()
    old = {"kind": "train", "step": 1, "loss": 9.0, "tokens_per_s": 1e12, "mfu": 1.0}
    (stale / "metrics.jsonl").write_text(json.dumps({**old, "peak_mem_gb": 99.0}) + "\n")
    a = argparse.Namespace(
        data=str(tiny_data),
        init=str(init_model),
        seq_len=64,
        micro_batch=1,
        grad_accum=1,
        steps=4,
        seed=1234,
        lr=1e-3,
        eval_samples=4,
        ranks=2,
        runs=str(tmp_path),
    )
    row = run_engine("ddp", a)
    assert [step for step, _ in row["curve"]] == [1, 2, 3, 4], row.get("error", row["curve"])
    assert row["tokens_per_s"] < 1e9 and row["peak_mem_gb"] < 99.0


def test_compare_floors_use_paired_rounds():
    """With repeats, a floor is the median of per-round ratios, not best against best: a fast
    spell in one round must not decide it."""
    from benchmarks.compare.runs import floor_ratio

    ddp = {"tokens_per_s": 3561, "all_tokens_per_s": [3543, 3444, 3561]}
    ref = {"tokens_per_s": 3774, "all_tokens_per_s": [3328, 3774, 3514]}
    ratio, rounds = floor_ratio(ddp, ref)
    assert [round(r, 3) for r in rounds] == [1.065, 0.913, 1.013] and ratio == rounds[2]
    assert floor_ratio({"tokens_per_s": 90}, {"tokens_per_s": 100}) == (0.9, [])
    assert floor_ratio({}, ref) == (None, [])


def test_compare_keeps_the_global_batch_for_every_layout():
    """benchmarks/compare gives a layout with fewer data-parallel replicas than ranks (tensor,
    sequence, pipeline) proportionally more accumulation: every row steps on the same batch."""
    import argparse

    from benchmarks.compare.runs import job_flags, replicas

    a = argparse.Namespace(
        data="d",
        init="m",
        seq_len=64,
        micro_batch=2,
        grad_accum=2,
        steps=4,
        seed=1,
        lr=1e-3,
        eval_samples=4,
        ranks=2,
    )
    assert [replicas(n, 2) for n in ("ddp", "zero2", "tp2", "sp2", "pipeline")] == [2, 2, 1, 1, 1]
    assert replicas("tp2", 3) == 3  # a layout the trainer refuses: the run itself says why
    for name in ("zero2", "tp2"):
        flags = job_flags(a, replicas(name, a.ranks))
        accum = int(flags[flags.index("--grad-accum") + 1])
        assert 2 * accum * replicas(name, a.ranks) == 2 * 2 * 2, (name, accum)


def test_compare_runs_a_3d_layout_on_the_ranks_it_needs():
    """pp2 x tp2 (`pipeline_tp2`) needs 4 ranks: on the 2-rank job benchmarks/compare runs it on
    4, as 1 replica accumulating 4 micro-batches (the same global batch as `zero2` on 2), and
    leaves every layout the job's ranks hold on them."""
    import argparse

    from benchmarks.compare.runs import engine_ranks, job_flags, replicas

    a = argparse.Namespace(data="d", init="m", seq_len=64, micro_batch=2, grad_accum=2, steps=4,
                           seed=1, lr=1e-3, eval_samples=4, ranks=2)  # fmt: skip
    names = ("ddp", "zero2", "tp2", "sp2", "pipeline", "pipeline_tp2", "zero2_eager")
    assert [engine_ranks(n, 2) for n in names] == [2, 2, 2, 2, 2, 4, 2]
    assert engine_ranks("pipeline_tp2", 8) == 8 and engine_ranks("pipeline_tp2", 6) == 8
    nproc = engine_ranks("pipeline_tp2", a.ranks)
    flags = job_flags(a, replicas("pipeline_tp2", nproc))
    assert replicas("pipeline_tp2", nproc) == 1
    assert 2 * int(flags[flags.index("--grad-accum") + 1]) == 2 * 2 * 2


def test_the_stock_peer_is_transformers_llama_with_our_weights():
    """benchmarks/peer_hf.py's `hf_stock` row trains transformers' own LlamaForCausalLM (SDPA
    attention) from the same initial weights as every other row: its logits equal ours."""
    from transformers import LlamaForCausalLM

    from benchmarks.peer_hf import as_transformers_llama
    from models import build_model

    torch.manual_seed(0)
    ours = build_model("tiny", vocab_size=512).eval()
    theirs = as_transformers_llama(ours).eval()
    assert type(theirs) is LlamaForCausalLM
    assert theirs.config._attn_implementation == "sdpa"
    assert theirs.lm_head.weight.data_ptr() == theirs.model.embed_tokens.weight.data_ptr()
    x = torch.randint(0, 512, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(theirs(x).logits, ours(x).logits, atol=2e-5, rtol=1e-4)


def test_ddp_turns_buffer_sync_off_under_the_name_the_installed_torch_takes(monkeypatch):
    """torch 2.13 names it forward_sync_buffers; torch 2.11 (a GPU image's) knows only
    broadcast_buffers and refused the newer name, which ended every DDP run there."""
    import inspect

    from training.engines import ddp

    takes = inspect.signature(ddp.DistributedDataParallel.__init__).parameters
    name = "forward_sync_buffers" if "forward_sync_buffers" in takes else "broadcast_buffers"
    assert ddp._no_buffer_sync() == {name: False}

    class OlderDDP:
        def __init__(self, module, device_ids=None, broadcast_buffers=True, bucket_cap_mb=None):
            pass

    monkeypatch.setattr(ddp, "DistributedDataParallel", OlderDDP)
    assert ddp._no_buffer_sync() == {"broadcast_buffers": False}
