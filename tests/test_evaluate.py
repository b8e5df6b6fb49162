"""`python -m training.evaluate`: lm-evaluation-harness on our checkpoints and on any HF folder.

The harness's numbers must describe the model: its loglikelihood of a text under our export (and
under a foreign HF model) equals the model's own loss on the same tokens. A model trained a few
hundred steps on the built-in corpus beats a randomly initialised one, and chance, on the shipped
multiple-choice task, through the real harness. Bad input is one line before any work."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import NO_COMPILE, launch, read_metrics

from training.evaluation.command import main
from training.evaluation.local_tasks import HeldOut, heldout_documents, write_local_tasks

TEXT = 'def add(a, b):\n    """Return a + b."""\n    return a + b\n'
CONTEXT, CONTINUATION = "def add(a, b):\n", '    """Return a + b."""\n    return a + b\n'


def _harness_logliks(folder: Path) -> tuple[float, float]:
    """(rolling loglikelihood of TEXT, loglikelihood of CONTINUATION given CONTEXT) from the
    harness's own HFLM, in fp32 on the CPU."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=str(folder), device="cpu", dtype="float32", batch_size=1)
    (rolling,) = lm.loglikelihood_rolling(
        [Instance("loglikelihood_rolling", {}, (TEXT,), 0)], disable_tqdm=True
    )
    ((cond, _),) = lm.loglikelihood(
        [Instance("loglikelihood", {}, (CONTEXT, CONTINUATION), 0)], disable_tqdm=True
    )
    return rolling, cond


def _own_logliks(model, tok) -> tuple[float, float]:
    """The same two numbers from the model's own loss, on the tokens the harness scores: the
    text after the BOS token (the harness's prefix; end-of-text where there is no BOS), and the
    continuation's tokens after the context's, split as the harness splits them (the context's
    trailing whitespace moved to the continuation; the context's own tokens, then the whole
    text's past as many)."""
    enc = lambda s: tok(s, add_special_tokens=False).input_ids  # noqa: E731
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    with torch.no_grad():
        ids = torch.tensor([[prefix, *enc(TEXT)]])
        rolling = -model(input_ids=ids, labels=ids).loss.item() * (ids.shape[1] - 1)
        ctx = enc(CONTEXT.rstrip())
        seq = ctx + enc(CONTEXT + CONTINUATION)[len(ctx) :]
        ids = torch.tensor([seq])
        labels = ids.clone()
        labels[0, : len(ctx)] = -100  # only the continuation's tokens count
        cond = -model(input_ids=ids, labels=labels).loss.item() * (len(seq) - len(ctx))
    return rolling, cond


def _foreign_folder(tiny_data: Path, out: Path) -> Path:
    """A tiny GPT-2, randomly initialised and saved with save_pretrained, with the data's
    tokenizer: a foreign HF model folder, made here (no hub)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    m = json.loads((tiny_data / "manifest.json").read_text())
    config = GPT2Config(
        vocab_size=m["vocab_size"], n_positions=128, n_embd=32, n_layer=2, n_head=2,
        bos_token_id=m["bos_id"], eos_token_id=m["eos_id"],
    )  # fmt: skip
    GPT2LMHeadModel(config).save_pretrained(out)
    for f in (tiny_data / "tokenizer").iterdir():
        shutil.copy2(f, out / f.name)
    return out


def test_harness_loglikelihood_equals_a_foreign_models_own_loss(tiny_data, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = _foreign_folder(tiny_data, tmp_path / "gpt2")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    own = _own_logliks(model, AutoTokenizer.from_pretrained(folder))
    theirs = _harness_logliks(folder)
    assert own[0] < -10 and own[1] < -5  # real sums over several tokens, not zeros
    assert theirs == pytest.approx(own, rel=1e-5, abs=1e-4)


def test_shipped_tasks_are_made_from_held_out_documents(tiny_data, tmp_path):
    held = HeldOut.of_data(tiny_data)
    assert (held.val_fraction, held.max_docs) == (0.05, 300)  # the folder's own split
    assert HeldOut.of_data(tmp_path) == HeldOut()  # no pystdlib folder: the default one
    docs = heldout_documents(held)
    manifest = json.loads((tiny_data / "manifest.json").read_text())
    assert len(docs) == manifest["splits"]["val"]["documents"]
    folder = write_local_tasks(tmp_path / "tasks", held)
    items = [json.loads(x) for x in (folder / "pystdlib_continuation.jsonl").open()]
    assert len(items) >= 50
    for x in items:
        assert len(x["choices"]) == 4 and len(set(x["choices"])) == 4
        assert x["context"].startswith(("def ", "async def "))
        assert any(x["context"].splitlines()[0].strip() in d for d in docs)
    texts = [json.loads(x)["text"] for x in (folder / "pystdlib_docstring_code.jsonl").open()]
    assert len(texts) >= 20
    # the YAML points at the data written beside it, by absolute path
    yaml = (folder / "pystdlib_continuation.yaml").read_text()
    assert str(folder / "pystdlib_continuation.jsonl") in yaml


def test_loss_png_shows_task_scores_beside_the_loss(tmp_path):
    from training.loop.logger import plot_loss_curve

    def width(png: Path) -> int:
        return int.from_bytes(png.read_bytes()[16:20], "big")  # the IHDR chunk's width

    rows = [{"step": s, "kind": "train", "loss": 5.0 - s / 100} for s in range(1, 101)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plot_loss_curve(tmp_path / "metrics.jsonl", tmp_path / "loss.png")
    alone = width(tmp_path / "loss.png")
    tasks = {"kind": "tasks", "pystdlib_continuation/acc": 0.3, "x/bits_per_byte": 3.2}
    with open(tmp_path / "metrics.jsonl", "a") as f:
        for step in (50, 100):
            f.write(json.dumps({"step": step, **tasks}) + "\n")
    plot_loss_curve(tmp_path / "metrics.jsonl", tmp_path / "loss.png")
    assert width(tmp_path / "loss.png") > 1.5 * alone  # a second panel: the task scores


# ------------------------------------------------------------------------------------ bad input
def _refusal(capsys, argv) -> str:
    capsys.readouterr()  # what making the folder printed
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_unknown_task_is_one_line_before_any_work(tiny_data, tmp_path, capsys):
    folder = _foreign_folder(tiny_data, tmp_path / "gpt2")
    err = _refusal(capsys, [str(folder), "--tasks", "pystdlib_continuation,hellaswagg"])
    assert "--tasks hellaswagg: not a task lm-eval knows" in err and "hellaswag" in err


def test_a_folder_the_harness_cannot_load_is_one_line(tiny_data, tmp_path, capsys):
    folder = _foreign_folder(tiny_data, tmp_path / "gpt2")
    for f in ("tokenizer.json", "tokenizer_config.json", "sentencepiece.model"):
        (folder / f).unlink()
    assert "holds no tokenizer the harness can load" in _refusal(capsys, [str(folder)])
    (folder / "config.json").write_text('{"model_type": "bert"}')
    assert "its weights do not fit its config" in _refusal(capsys, [str(folder)])
    (folder / "config.json").write_text('{"model_type": "t5"}')
    assert "a t5 model, not a causal LM" in _refusal(capsys, [str(folder)])
    (folder / "config.json").unlink()
    assert "neither a run folder nor a model folder" in _refusal(capsys, [str(folder)])
    assert "no such run or model folder" in _refusal(capsys, [str(tmp_path / "nope")])
    err = _refusal(capsys, [str(tmp_path), "--data", str(tmp_path)])
    assert "not a prepared data folder" in err


def test_a_run_without_a_sealed_checkpoint_is_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000004").mkdir(parents=True)  # a save cut by a kill
    (run / "metrics.jsonl").write_text("")
    err = _refusal(capsys, [str(run)])
    assert str(run) in err and "no complete checkpoint" in err
    assert not (run / "eval").exists()


# ----------------------------------------------------------------------- a trained run, scored
@pytest.fixture(scope="module")
def trained_run(tiny_data, tmp_path_factory) -> Path:
    """Our tiny model trained 150 steps on the built-in corpus, on 1 rank in fp32."""
    run = tmp_path_factory.mktemp("eval") / "run"
    args = [
        "--data", str(tiny_data), "--out", str(run), "--model", "tiny", "--seq-len", "64",
        "--micro-batch", "16", "--steps", "150", "--log-every", "50", "--eval-every", "0",
        "--eval-samples", "8", "--lr", "5e-3", "--warmup", "10", "--save-every", "0",
        "--ds_config", "ds_configs/fp32.json", NO_COMPILE,
    ]  # fmt: skip
    launch(args, nproc=1)
    return run


@pytest.mark.slow
def test_harness_loglikelihood_equals_our_checkpoints_own_loss(trained_run, tmp_path):
    from transformers import AutoTokenizer

    from training.checkpoints import layout as ckpt
    from training.checkpoints.hf_export import export
    from training.checkpoints.weights import load_model

    root, tag = ckpt.locate(trained_run)
    ours = load_model(root, tag, ckpt.load_trainer_state(root, tag)).eval()  # our own model
    assert type(ours).__name__ == "ZeroStackForCausalLM"
    folder = export(trained_run, tmp_path / "hf")
    own = _own_logliks(ours, AutoTokenizer.from_pretrained(folder))
    assert _harness_logliks(folder) == pytest.approx(own, rel=1e-5, abs=1e-4)


@pytest.mark.slow
def test_trained_model_beats_random_init_and_chance_on_the_local_task(
    trained_run, tiny_data, tmp_path
):
    from transformers import LlamaForCausalLM

    from models.hf_adapter import to_llama_config
    from training.checkpoints import layout as ckpt
    from training.checkpoints.weights import config_from_dict

    assert main([str(trained_run)]) == 0  # the shipped local tasks, offline
    result = json.loads((trained_run / "eval" / "step_150.json").read_text())
    trained = result["scores"]["pystdlib_continuation/acc"]
    (logged,) = read_metrics(trained_run, kind="tasks")
    assert logged["step"] == 150 and logged["pystdlib_continuation/acc"] == trained
    assert 0 < logged["pystdlib_docstring_code/bits_per_byte"] < 8
    png = (trained_run / "loss.png").read_bytes()
    assert int.from_bytes(png[16:20], "big") >= 1000  # redrawn with the task scores' panel

    # the same architecture, randomly initialised, saved as a model folder
    root, tag = ckpt.locate(trained_run)
    config = config_from_dict(ckpt.load_trainer_state(root, tag)["model_config"])
    torch.manual_seed(0)
    LlamaForCausalLM(to_llama_config(config)).save_pretrained(tmp_path / "random")
    for f in (trained_run / "tokenizer").iterdir():
        shutil.copy2(f, tmp_path / "random" / f.name)
    out = tmp_path / "random.json"
    argv = [str(tmp_path / "random"), "--tasks", "pystdlib_continuation", "--out", str(out)]
    argv += ["--data", str(tiny_data)]  # the same items as the run's: its data's held-out files
    assert main(argv) == 0
    random_init = json.loads(out.read_text())["scores"]["pystdlib_continuation/acc"]
    n = result["harness"]["n-samples"]["pystdlib_continuation"]["effective"]
    assert n >= 50
    assert trained > 0.25 + 2 * (0.25 * 0.75 / n) ** 0.5  # above chance by two standard errors
    assert trained > random_init + 0.05, (trained, random_init)
