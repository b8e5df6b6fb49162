"""Preference tuning (data/preference.py, data/pairs.py, training/objectives/): pairs prepared
with the chat template and kept together in a batch, bad rows refused in one line, the DPO and
IPO losses and rewards against a plain-PyTorch computation, and real 2-rank runs: one stopped
and resumed bit for bit on the stored reference log-probs, and one under LoRA whose stored
reference is the base with the adapters off."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import launch, pair_rows, rank_exit_codes, read_metrics, refused, write_jsonl

from data import prepare
from data.examples import IGNORE_INDEX
from data.pairs import PairDataset
from data.reader import _to_xy
from training.engines.construct import build_for_engine
from training.objectives import PreferenceLoss

SEQ = 64
RUN = [
    "--seq-len", "64", "--micro-batch", "2", "--log-every", "1", "--eval-every", "3",
    "--eval-samples", "8", "--lr", "3e-3", "--warmup", "1", "--steps", "6", "--save-every", "3",
    "--precision", "fp32", "--no-compile",
]  # fmt: skip


def test_pairs_keep_chosen_and_rejected_together_with_only_the_answer_trained(pairs):
    ds = PairDataset(pairs["data"], "train", SEQ)
    assert ds.manifest.chat["pairs"] == {"train": len(ds), "val": 12}
    x, y, reference = _to_xy(np.stack([ds[i] for i in (3, 0, 5)]))
    assert x.shape == y.shape == (6, SEQ) and torch.isnan(reference).all()
    for k in range(3):  # rows 2k, 2k+1: one pair, the same prompt, different answers
        c, r = (y[2 * k + s] != IGNORE_INDEX for s in (0, 1))
        first = int(c.nonzero()[0])
        assert first == int(r.nonzero()[0]) > 0 and torch.equal(
            x[2 * k, :first], x[2 * k + 1, :first]
        )
        assert not torch.equal(x[2 * k], x[2 * k + 1])
    ds.reference = np.arange(2 * len(ds), dtype=np.float64).reshape(-1, 2) - 0.5
    _, _, reference = _to_xy(np.stack([ds[i] for i in (3, 0)]))
    assert reference.tolist() == [5.5, 6.5, -0.5, 0.5]  # the pair's own, bit for bit


@pytest.mark.parametrize(
    "row, says",
    [
        ({"prompt": "p", "chosen": "a"}, "'rejected' is missing"),
        ({"prompt": "p", "chosen": "a", "rejected": "a"}, "'chosen' and 'rejected' are the same"),
        ({"chosen": "a", "rejected": "b"}, "need a text 'prompt'"),
    ],
)
def test_bad_rows_are_refused_in_one_line_naming_file_and_row(pairs, row, says, tmp_path, capsys):
    from data.prepare import main

    src = write_jsonl(tmp_path / "bad.jsonl", [pair_rows(1)[0], row])
    out = tmp_path / "out"
    code = main(["--source", str(src), "--tokenizer", str(pairs["tokenizer"]), "--out", str(out),
                 "--seq-len", "64", "--quiet"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(f"error: {src}:2: ") and "\n" not in err, err
    assert says in err and not out.exists()


def test_a_prompt_longer_than_the_sequence_drops_its_pair_and_is_counted(pairs, tmp_path):
    rows = [{"prompt": "x " * 200, "chosen": "a", "rejected": "b"}, *pair_rows(2)]
    out = prepare(write_jsonl(tmp_path / "long.jsonl", rows), tmp_path / "out", val_fraction=0,
                  tokenizer=pairs["tokenizer"], seq_len=32, progress=False)  # fmt: skip
    counts = json.loads((out / "manifest.json").read_text())["chat"]
    assert counts["dropped_untrained"] == 1 and counts["pairs"]["train"] == 2


def plain_logps(logits: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Each row's summed log-prob of its trained targets, token by token."""
    out = []
    for row in range(len(y)):
        total = torch.zeros((), dtype=torch.float32)
        for t in range(y.shape[1]):
            if y[row, t] != IGNORE_INDEX:
                z = logits[row, t].float()
                total = total + (z[y[row, t]] - torch.logsumexp(z, 0))
        out.append(total)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_answer_logps_are_autograds_without_a_full_vocabulary_fp32_tensor(dtype, monkeypatch):
    """sequence_logps gives log_softmax(logits.float()).gather's values and gradients bit for
    bit, while no fp32 tensor as large as the logits exists in forward or backward (the full
    fp32 log-softmax and its gradient set a bf16 run's peak memory)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from training.objectives import dpo

    monkeypatch.setattr(dpo, "CHUNK_ELEMENTS", 4 * 1000)  # several blocks on a small batch
    torch.manual_seed(0)
    logits = (3 * torch.randn(4, 24, 1000)).to(dtype)
    y = torch.randint(0, 1000, (4, 24))
    y[:, :9] = IGNORE_INDEX
    weights = torch.randn(4)

    def plain(z):
        logp = torch.log_softmax(z.float(), dim=-1)
        picked = logp.gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return (picked * (y != IGNORE_INDEX)).sum(-1)

    class LargestFp32(TorchDispatchMode):
        most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    LargestFp32.most = max(LargestFp32.most, t.numel())
            return out

    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    want = plain(a)
    (want * weights).sum().backward()
    with LargestFp32():
        got = dpo.sequence_logps(b, y)[0]
        (got * weights).sum().backward()
    assert torch.equal(got, want) and torch.equal(b.grad, a.grad)
    if dtype == torch.bfloat16:  # an fp32 input is itself full size
        assert LargestFp32.most <= 4 * 1000 < logits.numel()


@pytest.mark.parametrize("kind", ["dpo", "ipo"])
def test_loss_and_rewards_equal_a_plain_pytorch_computation(pairs, kind):
    ds = PairDataset(pairs["data"], "train", SEQ)
    rng = np.random.default_rng(0)
    ds.reference = -rng.uniform(5, 60, size=(len(ds), 2))
    x, y, reference = _to_xy(np.stack([ds[i] for i in range(4)]))
    torch.manual_seed(0)
    model = build_for_engine("tiny", vocab_size=ds.manifest.vocab_size, backend="ddp", ds_config={})
    beta = 0.3
    objective = PreferenceLoss(kind, beta)
    with torch.no_grad():
        loss = objective(model, x, y, reference=reference)
        logits = model(input_ids=x).logits
    got = objective.take("eval", torch.device("cpu"))
    pol, lengths = plain_logps(logits, y), (y != IGNORE_INDEX).sum(1)
    losses, rc, rr, acc, prefers = [], [], [], [], []
    for i in range(4):
        pc, pr = pol[2 * i], pol[2 * i + 1]
        fc, fr = float(reference[2 * i]), float(reference[2 * i + 1])
        if kind == "ipo":  # per-token averages
            pc, pr = pc / lengths[2 * i], pr / lengths[2 * i + 1]
            fc, fr = fc / lengths[2 * i].item(), fr / lengths[2 * i + 1].item()
        h = (pc - pr) - (fc - fr)
        if kind == "dpo":
            losses.append(-torch.log(torch.sigmoid(beta * h)))
        else:
            losses.append((h - 1 / (2 * beta)) ** 2)
        rc.append(beta * (pc - fc))
        rr.append(beta * (pr - fr))
        acc.append(float(rc[-1] > rr[-1]))
        prefers.append(float(pc > pr))
    want = torch.stack(losses).mean()
    assert abs(loss.item() - want.item()) <= 1e-6 * max(1.0, abs(want.item())), (loss, want)
    assert got["rewards_chosen"] == pytest.approx(float(sum(rc) / 4), abs=1e-6)
    assert got["rewards_rejected"] == pytest.approx(float(sum(rr) / 4), abs=1e-6)
    assert got["accuracy"] == sum(acc) / 4 and 0 < got["accuracy"] < 1
    assert got["prefers_chosen"] == sum(prefers) / 4
    assert got["margin"] == pytest.approx(got["rewards_chosen"] - got["rewards_rejected"])


def test_objective_and_data_must_match(tiny_data, pairs, tmp_path, capsys, monkeypatch):
    base = ["--out", str(tmp_path / "run"), "--model", "tiny", "--steps", "1"]
    err = refused(capsys, monkeypatch, tmp_path, ["--data", str(tiny_data), *base,
                                                  "--objective", "dpo"])  # fmt: skip
    assert "--objective dpo trains on preference pairs" in err
    err = refused(capsys, monkeypatch, tmp_path, ["--data", str(pairs["data"]), *base,
                                                  "--objective", "next-token"])  # fmt: skip
    assert "holds preference pairs" in err


@pytest.mark.parametrize("objective", ["dpo", "ipo"])
def test_preference_objectives_under_zero0_in_bf16_are_refused(
    objective, pairs, tmp_path, capsys, monkeypatch
):
    """Measured 8-12% from their fp32 reference one step in (benchmarks/matrix), where ZeRO-1
    and 2 in bf16 follow it: refused until the cause is found; fp32 and ZeRO-2 start."""
    base = ["--data", str(pairs["data"]), "--out", str(tmp_path / "run"), "--model", "tiny",
            "--steps", "1", "--objective", objective]  # fmt: skip
    zero0 = ["--ds_config", "ds_configs/zero0.json"]
    err = refused(capsys, monkeypatch, tmp_path, [*base, *zero0, "--precision", "bf16"])
    assert f"--objective {objective} under ZeRO-0 in bf16 does not follow" in err


@pytest.fixture(scope="module")
def resumed(pairs) -> dict:
    """2 ranks ZeRO-2 DPO: `ref` uninterrupted for 6 steps, `stopped` stopped at step 3 and
    resumed to step 6 by the same command."""
    runs = pairs["base"] / "runs"

    def args(out):
        return ["--data", str(pairs["data"]), "--out", str(out), "--model", "tiny", *RUN]

    launch(args(runs / "ref"))
    launch([*args(runs / "stopped"), "--stop-at", "3"])
    stored = (runs / "stopped" / "reference" / "train.npy").read_bytes()
    p = launch(args(runs / "stopped"))
    return {"ref": runs / "ref", "stopped": runs / "stopped", "stored": stored, "log": p.stdout}


@pytest.mark.slow
def test_dpo_resumes_bit_for_bit_on_the_stored_reference(resumed):
    """Three 2-rank launches of the tiny model (each well under a minute on an idle 2-core
    host): resume is only shown by stopping and resuming a real run."""
    ref, again = read_metrics(resumed["ref"]), read_metrics(resumed["stopped"])
    assert ref[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)  # the policy is the reference
    assert ref[-1]["loss"] < ref[0]["loss"] and ref[-1]["accuracy"] > 0.5
    keys = ("loss", "rewards_chosen", "rewards_rejected", "accuracy", "logps_chosen", "grad_norm")
    assert [[r[k] for k in keys] for r in again if r["step"] > 3] == [
        [r[k] for k in keys] for r in ref if r["step"] > 3
    ]
    assert "train: 36 read back, val: 12 read back" in resumed["log"]
    assert (resumed["stopped"] / "reference" / "train.npy").read_bytes() == resumed["stored"]
    evals = read_metrics(resumed["ref"], "eval")
    assert {"val_accuracy", "val_margin", "val_rewards_chosen"} <= evals[-1].keys()


@pytest.mark.slow
def test_dpo_resumes_into_a_new_out_on_the_run_it_resumes_reference(pairs, resumed, tmp_path):
    """One 2-rank launch of 3 steps: the stopped run's step-3 checkpoint starts a fresh --out,
    which reads the reference log-probs that run stored (checked by their checksum), keeps a
    copy in its own folder, and follows the uninterrupted run bit for bit."""
    new, source = tmp_path / "new", resumed["stopped"] / "reference"
    step3 = resumed["stopped"] / "checkpoints" / "step_00000003"
    p = launch(["--data", str(pairs["data"]), "--out", str(new), "--model", "tiny", *RUN,
                "--resume", str(step3)])  # fmt: skip
    assert f"train: 36 read back from {source}" in p.stdout
    keys = ("loss", "rewards_chosen", "accuracy", "grad_norm")
    assert [[r[k] for k in keys] for r in read_metrics(new)] == [
        [r[k] for k in keys] for r in read_metrics(resumed["ref"]) if r["step"] > 3
    ]
    assert (new / "reference" / "train.npy").read_bytes() == resumed["stored"]
    assert (new / "reference" / "val.json").read_text() == (source / "val.json").read_text()


def test_stored_reference_is_refused_when_missing_changed_or_of_other_data(pairs, tmp_path):
    from training.errors import CheckpointError
    from training.objectives import reference

    ds, val = (PairDataset(pairs["data"], s, SEQ) for s in ("train", "val"))
    folder = tmp_path / "reference"
    with pytest.raises(CheckpointError, match="train.npy is missing: .* start the run afresh"):
        reference.read_back(folder, "train", ds)
    stored = -np.arange(2.0 * len(ds)).reshape(-1, 2)
    reference._store(folder, "train", stored, reference._fingerprint(ds))
    assert np.array_equal(reference.read_back(folder, "train", ds), stored)
    with pytest.raises(CheckpointError, match="computed on other data"):
        reference.read_back(folder, "train", val)
    changed = stored.copy()
    changed[3, 1] += 1e-9
    np.save(folder / "train.npy", changed)
    with pytest.raises(CheckpointError, match="does not match the checksum in train.json"):
        reference.read_back(folder, "train", ds)


def test_stored_reference_is_refused_when_of_another_model_or_precision(pairs, tmp_path):
    """The model's identity and the precision are stored beside the data's fingerprint; a file
    written before they were (no such fields) is not held to them."""
    from training.errors import CheckpointError
    from training.objectives import reference

    ds = PairDataset(pairs["data"], "train", SEQ)
    stored = -np.arange(2.0 * len(ds)).reshape(-1, 2)
    made_by = {"model": "a" * 64, "precision": "fp32"}
    old, new = tmp_path / "old", tmp_path / "new"
    reference._store(old, "train", stored, reference._fingerprint(ds))
    reference._store(new, "train", stored, reference._fingerprint(ds), made_by)
    assert np.array_equal(reference.read_back(old, "train", ds, made_by), stored)
    assert np.array_equal(reference.read_back(new, "train", ds, made_by), stored)
    with pytest.raises(CheckpointError, match=r"computed by another model \(config sha256 a{12}"):
        reference.read_back(new, "train", ds, {**made_by, "model": "b" * 64})
    with pytest.raises(CheckpointError, match="computed in fp32, this run trains in bf16; resume "
                                              "with --precision fp32"):  # fmt: skip
        reference.read_back(new, "train", ds, {**made_by, "precision": "bf16"})


def test_dropout_is_turned_off_in_modules_attributes_and_config():
    """GPT-2 (nn.Dropout modules; attn_pdrop and friends in its config) and Qwen2 (attention
    dropout as a float on each attention module): after disable_dropout a training-mode forward
    is the eval-mode one, bit for bit, as the reference pass (eval mode) computes it."""
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    from training.objectives.reference import disable_dropout, model_identity

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2,
                                      n_head=2))  # fmt: skip
    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, attention_dropout=0.3))  # fmt: skip
    qwen.config._attn_implementation = "eager"  # dropout on the probabilities, on every kernel
    x = torch.randint(0, 64, (2, 16))
    for model, turned in ((gpt2, 2 * 3 + 1 + 4), (qwen, 2)):
        identity = model_identity(model)
        with torch.no_grad():
            want = model.eval()(input_ids=x).logits
            assert not torch.equal(model.train()(input_ids=x).logits, want)  # dropout is on
            assert disable_dropout(model) >= turned
            assert torch.equal(model.train()(input_ids=x).logits, want)
        assert disable_dropout(model) == 0 and model_identity(model) == identity
    assert gpt2.config.attn_pdrop == gpt2.config.resid_pdrop == gpt2.config.embd_pdrop == 0.0
    assert qwen.config.attention_dropout == 0.0


def test_model_identity_is_the_config_without_paths_and_with_lora_the_base(tmp_path):
    from models import build_model
    from models.lora import apply_lora, parse_lora
    from training.objectives.reference import model_identity

    model = build_model("tiny", vocab_size=96)
    model.save_pretrained(tmp_path / "tiny")
    same = build_model(str(tmp_path / "tiny"), vocab_size=96)  # a path and architectures now
    assert model_identity(same) == model_identity(model)
    lora = apply_lora(build_model("tiny", vocab_size=96), parse_lora("r=4"), seed=0)
    assert model_identity(lora) == model_identity(model)
    other = build_model("tiny", vocab_size=96, overrides={"rope_theta": 5e5})
    assert model_identity(other) != model_identity(model)


@pytest.mark.slow
def test_dpo_resumes_on_another_world_size_within_the_cross_world_bound(pairs, resumed, tmp_path):
    """The 2-rank run's step-3 checkpoint resumed on 1 rank with 2 accumulation steps (the same
    4 pairs a step) through the universal resume: the stored reference log-probs are read back,
    and steps 4-6 follow the uninterrupted run within the cross-world bound of
    tests/test_universal.py (1e-3 relative on the loss)."""
    run = tmp_path / "one_rank"
    shutil.copytree(resumed["stopped"], run)
    step3 = run / "checkpoints" / "step_00000003"
    assert step3.is_dir()
    p = launch(["--data", str(pairs["data"]), "--out", str(run), "--model", "tiny", *RUN,
                "--grad-accum", "2", "--resume", str(step3)], nproc=1)  # fmt: skip
    assert "read back" in p.stdout + p.stderr  # the stored reference, not recomputed
    ref = {r["step"]: r for r in read_metrics(resumed["ref"])}
    again = [r for r in read_metrics(run) if r["step"] > 3]
    assert [r["step"] for r in again] == [4, 5, 6]
    for r in again:
        want = ref[r["step"]]
        assert abs(r["loss"] - want["loss"]) <= 1e-3 * want["loss"], (r["step"], r, want)
        assert r["accuracy"] == pytest.approx(want["accuracy"], abs=1e-6)


@pytest.mark.slow
def test_lora_dpo_reference_is_the_base_with_adapters_off(pairs, tmp_path):
    """A 2-rank LoRA run under the default config (ZeRO-2), then the stored reference
    log-probs against peft's disable_adapter on the trained model (over 60 s on a loaded
    host: a real run is what writes the reference)."""
    from models import build_model, save_llama
    from training.checkpoints import layout as ckpt
    from training.checkpoints.weights import load_lora_model
    from training.objectives.dpo import sequence_logps

    ds = PairDataset(pairs["data"], "train", SEQ)
    torch.manual_seed(5)
    base_model = build_model("tiny", vocab_size=ds.manifest.vocab_size)
    base = tmp_path / "base"
    save_llama(dict(base_model.named_parameters()), base_model.config, base)
    out = tmp_path / "lora"
    launch(["--data", str(pairs["data"]), "--out", str(out), "--model", str(base), *RUN,
            "--steps", "3", "--lr", "1e-2", "--lora", "r=4,alpha=16,dropout=0.0"])  # fmt: skip
    metrics = read_metrics(out)
    assert metrics[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    root, tag = ckpt.locate(out)
    model = load_lora_model(root, tag, ckpt.load_trainer_state(root, tag)).eval()
    x, y, _ = _to_xy(np.stack([ds[i] for i in range(6)]))
    stored = torch.from_numpy(np.load(out / "reference" / "train.npy")[:6].reshape(-1))
    with torch.no_grad():
        trained = sequence_logps(model(input_ids=x).logits, y)[0]
        with model.disable_adapter():
            off = sequence_logps(model(input_ids=x).logits, y)[0]
    assert torch.allclose(off.double(), stored, atol=1e-4)
    assert (trained.double() - stored).abs().max() > 1e-3  # the adapters did train


def test_memory_plan_counts_pairs_and_their_stored_reference(pairs):
    from models import get_config
    from training.memory.plan import REFERENCE_BYTES, plan
    from training.memory.shape import shape_of_config
    from training.preflight.memory_fit import _pairs

    n = _pairs(str(pairs["data"]))
    assert n == 48  # both splits
    shape = shape_of_config(get_config("small", vocab_size=8192), "small")
    ds = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    text, pref = (plan(shape, ds, 2, micro_batch=4, seq_len=256, pairs=k) for k in (0, n))
    # a micro-batch of 4 pairs is 8 sequences, and no more: no fp32 log-softmax is kept
    assert pref.per_rank["activations"]["device"] == 2 * text.per_rank["activations"]["device"]
    more = pref.per_rank["runtime"]["host"] - text.per_rank["runtime"]["host"]
    assert more == REFERENCE_BYTES * n


def gpt2_folder(pairs, out, **dropout) -> Path:
    """A tiny random GPT-2 folder (save_pretrained) on the pairs' vocabulary, with GPT-2's own
    dropout (0.1 on embeddings, residuals and attention) unless `dropout` says otherwise."""
    from transformers import GPT2Config, GPT2LMHeadModel

    m = json.loads((pairs["data"] / "manifest.json").read_text())
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=m["vocab_size"], n_positions=128, n_embd=32, n_layer=2,
                        n_head=2, bos_token_id=m["bos_id"], eos_token_id=m["eos_id"],
                        **dropout)  # fmt: skip
    GPT2LMHeadModel(config).save_pretrained(out)
    return out


@pytest.mark.slow
def test_dropout_is_off_so_the_first_step_is_the_reference(pairs, tmp_path):
    """A GPT-2 folder with dropout 0.1, one 2-rank step: the policy's first forward is the
    reference model's (its eval mode), so the loss is log 2 and the rewards 0, to fp32
    rounding; the record says dropout was turned off."""
    model = gpt2_folder(pairs, tmp_path / "gpt2")
    out = tmp_path / "run"
    p = launch(["--data", str(pairs["data"]), "--out", str(out), "--model", str(model), *RUN,
                "--steps", "1", "--eval-every", "0", "--save-every", "-1"])  # fmt: skip
    (first,) = read_metrics(out)
    assert abs(first["loss"] - math.log(2)) <= 1e-6, first
    assert abs(first["rewards_chosen"]) <= 1e-6 and abs(first["rewards_rejected"]) <= 1e-6
    record = json.loads((out / "resolved_config.json").read_text())
    assert "dropout off" in record["objective"] and "dropout off" in p.stdout, record["objective"]
    assert record["model_config"]["attn_pdrop"] == record["model_config"]["resid_pdrop"] == 0.0


ENGINES = {
    "zero0": ["--ds_config", "ds_configs/zero0.json"],
    "zero1": ["--ds_config", "ds_configs/zero1.json"],
    "zero3": ["--ds_config", "ds_configs/zero3.json"],
    "ddp": ["--backend", "ddp"],
    "fsdp": ["--backend", "fsdp"],
}


@pytest.fixture(scope="module")
def baselines(pairs, resumed):
    """(objective, ranks) -> the run of the DPO job under ZeRO-2 (the default config), each
    launched once when first asked for: 2 ranks (the resumed fixture's uninterrupted run), and 1
    rank with 2 accumulation steps (the same 4 pairs a step, in the same order)."""
    runs = {("dpo", 2): resumed["ref"]}

    def run(kind: str, nproc: int) -> Path:
        if (kind, nproc) not in runs:
            out = pairs["base"] / "runs" / f"zero2_{kind}_{nproc}"
            accum = ["--grad-accum", str(2 // nproc)]
            launch(["--data", str(pairs["data"]), "--out", str(out), "--model", "tiny", *RUN,
                    "--objective", kind, *accum, "--save-every", "-1"], nproc=nproc)  # fmt: skip
            runs[(kind, nproc)] = out
        return runs[(kind, nproc)]

    return run


def assert_same_trajectory(run: Path, want: Path, what: str) -> None:
    """Step by step within the cross-engine bound of tests/test_engines.py: 1e-3 relative on
    the loss (measured within 5e-7 in fp32), the rewards and log-probs alike, the same
    accuracy, and the step-1 gradient norm within 1e-2 (the same weights and batch)."""
    got, ref = read_metrics(run), read_metrics(want)
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, 7)), what
    for a, b in zip(got, ref, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-3 * b["loss"], (what, a["step"], a, b)
        for key in ("rewards_chosen", "rewards_rejected", "logps_chosen"):
            assert abs(a[key] - b[key]) <= 1e-3 * max(1.0, abs(b[key])), (what, key, a, b)
        assert a["accuracy"] == pytest.approx(b["accuracy"], abs=1e-6), (what, a, b)
    assert abs(got[0]["grad_norm"] - ref[0]["grad_norm"]) <= 1e-2 * ref[0]["grad_norm"], what
    val, val_ref = read_metrics(run, "eval"), read_metrics(want, "eval")
    assert len(val) == len(val_ref) == 2, what
    for a, b in zip(val, val_ref, strict=True):
        assert abs(a["val_loss"] - b["val_loss"]) <= 1e-3 * b["val_loss"], (what, a, b)


@pytest.mark.slow
@pytest.mark.parametrize(
    "engine, kind", [*((e, "dpo") for e in ENGINES), ("fsdp", "ipo")], ids=lambda v: v
)
def test_dpo_takes_the_same_steps_on_every_engine(pairs, baselines, engine, kind, tmp_path):
    """The same 6-step job (fp32, the tiny model from one seed, 4 pairs a step in the same
    order) on 2 ranks under each engine DPO is documented for, against ZeRO-2 on 2 ranks and
    on 1 rank; IPO under FSDP2 against IPO under ZeRO-2."""
    out = tmp_path / engine
    launch(["--data", str(pairs["data"]), "--out", str(out), "--model", "tiny", *RUN,
            *ENGINES[engine], "--objective", kind, "--save-every", "-1"])  # fmt: skip
    assert_same_trajectory(out, baselines(kind, 2), f"{engine} against zero2, 2 ranks")
    if kind == "dpo":
        assert_same_trajectory(out, baselines(kind, 1), f"{engine} against zero2, 1 rank")


@pytest.mark.slow
@pytest.mark.parametrize("change", ["precision", "model"])
def test_resume_on_a_reference_of_another_model_or_precision_is_refused(
    pairs, resumed, change, tmp_path
):
    """The ZeRO-2 run's step-3 checkpoint resumed into a new --out in bf16 (its reference was
    computed in fp32), or with a --model of the same shapes but another rotary base (the
    checkpoint's weights load into it; its reference is another model's): refused in one line
    on every rank, before any step."""
    from models import ZeroStackConfig, get_config

    m = json.loads((pairs["data"] / "manifest.json").read_text())
    if change == "precision":
        flags, says = ["--precision", "bf16"], "was computed in fp32, this run trains in bf16"
    else:
        folder = tmp_path / "other"
        cfg = get_config("tiny", vocab_size=m["vocab_size"]).to_dict()
        ZeroStackConfig(**{**cfg, "rope_theta": 5e5}).save_pretrained(folder)
        flags, says = ["--model", str(folder)], "was computed by another model (config sha256"
    new, step3 = tmp_path / "new", resumed["stopped"] / "checkpoints" / "step_00000003"
    p = launch(["--data", str(pairs["data"]), "--out", str(new), "--model", "tiny", *RUN,
                "--resume", str(step3), *flags], check=False)  # fmt: skip
    errors = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and says in errors[0], p.stdout[-2000:] + p.stderr[-3000:]
    assert str(resumed["stopped"] / "reference" / "train.npy") in errors[0]
    assert rank_exit_codes(p) == [2, 2]
    assert not (new / "metrics.jsonl").exists() or not read_metrics(new)  # not one step
