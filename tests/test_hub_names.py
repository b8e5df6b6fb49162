"""Hub names (`org/name`) for --model and --tokenizer, resolved through a Hugging Face cache that
the tests fill locally (the layout `snapshot_download` writes: models--org--name/refs/main and
snapshots/<commit>/...), with the hub switched off: what a user gets offline after one download."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TINY_RUN, launch, read_metrics
from huggingface_hub import constants

from data import load_manifest, prepare
from data.manifest import DataError
from data.tokenizer import load_tokenizer
from models import ModelError, build_model, save_llama
from models.hub import resolve_pretrained
from training.train import main

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fill_cache(cache: Path, repo: str, folder: Path) -> Path:
    """Put `folder` into the HF cache at `cache` as repo's main revision; returns the snapshot."""
    org, name = repo.split("/")
    root = cache / f"models--{org}--{name}"
    snapshot = root / "snapshots" / COMMIT
    shutil.copytree(folder, snapshot)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(tiny_data, tmp_path_factory) -> Path:
    """A cache holding `zs-test/tiny-llama`: a tiny stock LlamaForCausalLM folder (weights in
    safetensors) with the tiny dataset's tokenizer."""
    work = tmp_path_factory.mktemp("hub")
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=load_manifest(tiny_data).vocab_size)
    save_llama(model.state_dict(), model.config, work / "llama")
    for f in (tiny_data / "tokenizer").iterdir():
        shutil.copy(f, work / "llama" / f.name)
    fill_cache(work / "cache", "zs-test/tiny-llama", work / "llama")
    return work / "cache"


@pytest.fixture
def offline(hub_cache, monkeypatch) -> Path:
    """This process sees only `hub_cache`, with the hub switched off (HF_HUB_OFFLINE=1)."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub_cache


def offline_env(cache: Path) -> dict:
    return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


def test_a_hub_name_builds_the_cached_model_offline(offline):
    folder = resolve_pretrained("zs-test/tiny-llama")
    assert folder == offline / "models--zs-test--tiny-llama" / "snapshots" / COMMIT
    model = build_model("zs-test/tiny-llama")
    local = build_model(str(folder))
    assert type(model).__name__ == "ZeroStackForCausalLM"  # a Llama folder trains as our model
    for (name, a), (_, b) in zip(
        model.state_dict().items(), local.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_a_local_folder_wins_over_a_hub_name(offline, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local = Path("zs-test/tiny-llama")  # spelled like the cached repository
    small = build_model("tiny", vocab_size=320)
    save_llama(small.state_dict(), small.config, local)
    assert resolve_pretrained("zs-test/tiny-llama") == local
    assert build_model("zs-test/tiny-llama").config.vocab_size == 320  # the cached one has 512


def test_missing_names_fail_in_one_line(offline, tmp_path):
    with pytest.raises(ModelError) as e:
        resolve_pretrained("zs-test/absent")
    msg = str(e.value)
    assert "\n" not in msg and "zs-test/absent" in msg and "HF_HUB_OFFLINE" in msg
    assert str(offline) in msg  # says which cache it looked in
    with pytest.raises(ModelError, match="no such folder"):
        resolve_pretrained(str(tmp_path / "nope" / "model"))


def test_the_trainer_refuses_a_missing_name_before_any_work(offline, tiny_data, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["--data", str(tiny_data), "--out", str(out), "--model", "zs-test/absent"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    named = [line for line in err.splitlines() if "zs-test/absent" in line]
    assert len(named) == 1 and "--model zs-test/absent" in err.splitlines()[-1], err
    assert not out.exists()


def test_prepare_takes_a_hub_tokenizer_offline(offline, tiny_data, tmp_path):
    corpus = tmp_path / "c.jsonl"
    lines = [f'{{"text": "def f{i}(x):\\n    return x + {i}\\n"}}\n' for i in range(40)]
    corpus.write_text("".join(lines))
    data = prepare(str(corpus), tmp_path / "data", tokenizer="zs-test/tiny-llama", progress=False)
    ours = load_tokenizer(tiny_data / "tokenizer")
    assert load_manifest(data).vocab_size == len(ours)
    text = "def g(y):\n    return y\n"
    assert load_tokenizer(data / "tokenizer")(text).input_ids == ours(text).input_ids


@pytest.mark.slow
def test_train_from_a_hub_name_offline(hub_cache, tiny_data, tmp_path):
    """The user's path with a filled cache and the hub switched off: --model org/name trains
    from the cached weights (bf16, so the fp32 master weights are read from the snapshot too)."""
    run = tmp_path / "run"
    args = ["--data", str(tiny_data), "--out", str(run), *TINY_RUN, "--steps", "2"]
    args[args.index("tiny")] = "zs-test/tiny-llama"
    p = launch([*args, "--save-every", "-1"], nproc=1, env=offline_env(hub_cache))
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    record = json.loads((run / "resolved_config.json").read_text())
    assert "zs-test/tiny-llama" in json.dumps(record), p.stderr[-2000:]


def test_tokenizer_hub_name_offline_miss_is_one_data_error(offline):
    with pytest.raises(DataError) as e:
        load_tokenizer("zs-test/absent-tokenizer")
    assert "\n" not in str(e.value) and "zs-test/absent-tokenizer" in str(e.value)
