"""ZeRO-Infinity: ZeRO-3 with parameters and optimizer states on a local disk path trains the
same as without offload, leaves no swap files behind, and its checkpoints (optimizer states in
offloaded_tensors/ swap files) resume exactly, convert to a universal checkpoint and export.
Needs libaio-dev (.ci/run installs it); DeepSpeed's async_io op compiles on first use (about 6
minutes on 2 cores) and is cached in ~/.cache/torch_extensions."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import TINY_RUN, launch, read_metrics

from training.checkpoints import layout as ckpt
from training.checkpoints.hf_export import main as export_main
from training.checkpoints.zero_files import ZeroFiles
from training.errors import CheckpointError
from training.train import main


def _aio_missing() -> str | None:
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if AsyncIOBuilder().is_compatible(verbose=False):
        return None
    return "DeepSpeed's async_io op cannot be built here (apt-get install libaio-dev)"


def test_nvme_path_needs_an_nvme_config(capsys, tiny_data, tmp_path):
    base = ["--data", str(tiny_data), "--out", str(tmp_path / "r"), "--model", "tiny"]
    assert main([*base, "--ds_config", "ds_configs/zero3.json", "--nvme-path", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--nvme-path given but the config offloads nothing" in err


def test_zero2_with_nvme_is_refused(capsys, tiny_data, tmp_path):
    """DeepSpeed would silently treat it as CPU offload."""
    cfg = json.loads(open("ds_configs/zero2_offload.json").read())
    cfg["zero_optimization"]["offload_optimizer"].update(device="nvme", nvme_path="auto")
    path = tmp_path / "z2nvme.json"
    path.write_text(json.dumps(cfg))
    base = ["--data", str(tiny_data), "--out", str(tmp_path / "r"), "--model", "tiny"]
    assert main([*base, "--ds_config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "nvme needs ZeRO stage 3" in err and "silently falls back to CPU offload" in err


# A tiny Llama wide enough that DeepSpeed swaps its optimizer states: it swaps a ZeRO-3
# sub-group only when one rank's partition of it is 1 MiB or more. With sub_group_size 400000
# the matrices make one swapped sub-group and one kept in memory, and the norms another in
# memory: the mixed layout a 1.3B model has (its norms stay in memory).
WIDE = {
    "model_type": "zerostack", "architectures": ["ZeroStackForCausalLM"], "vocab_size": 512,
    "hidden_size": 128, "intermediate_size": 1536, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
}  # fmt: skip
WIDE_RUN = [*TINY_RUN[2:], "--peak-tflops", "1", "--steps", "4"]  # TINY_RUN less --model


def _config(tmp, name: str) -> str:
    cfg = json.loads(open(f"ds_configs/{name}.json").read())
    cfg["zero_optimization"]["sub_group_size"] = 400000
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture(scope="module")
def nvme_runs(tiny_data, tmp_path_factory):
    """The wide model, 4 steps saving at 2 and 4, under zero3_nvme (swap folder: the default
    RUN/nvme_swap) and zero3_offload (the same CPU Adam, states in memory), both gathering
    parameters module by module: NVMe keeps --zero3-whole-blocks off, and with whole blocks the
    offload run's fp32 gradients would differ in the last bits (autograd adds a block's
    residual-stream gradients in another grouping; engines/ds.py: gather_blocks_whole), which
    Adam's first steps magnify where a gradient is near its eps. About 3 minutes the first time
    on 2 cores, most of it DeepSpeed building its async_io op (cached after that in the torch
    extensions folder); shared by every test of this module."""
    if why := _aio_missing():
        pytest.skip(why)
    base = tmp_path_factory.mktemp("nvme")
    model = base / "wide"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(WIDE))
    out = {"base": base, "model": model}
    for name in ("zero3_nvme", "zero3_offload"):
        out[name] = base / name
        launch(
            ["--data", str(tiny_data), "--out", str(out[name]), "--model", str(model)]
            + [*WIDE_RUN, "--save-every", "2", "--keep-last", "0"]
            + ["--ds_config", _config(base, name), "--zero3-whole-blocks", "off"],
            timeout=1200,
        )
    return out


@pytest.mark.slow
def test_nvme_offload_trains_like_offload_in_memory(nvme_runs, tiny_data, tmp_path):
    """ZeRO-Infinity with a swap folder the user names: the same losses as zero3_offload (the
    same CPU Adam, states in memory); its swap files are removed at exit, the folder stays.
    (zero3_offload against ZeRO-3 without offload: tests/test_train.py's trajectory test.)"""
    out, swap = tmp_path / "run", tmp_path / "swap"
    launch(
        ["--data", str(tiny_data), "--out", str(out), "--model", str(nvme_runs["model"])]
        + [*WIDE_RUN, "--save-every", "-1", "--nvme-path", str(swap)]
        + ["--ds_config", _config(nvme_runs["base"], "zero3_nvme")],
        timeout=1200,
    )
    zo = json.loads((out / "resolved_config.json").read_text())["ds_config"]["zero_optimization"]
    assert zo["offload_param"]["nvme_path"] == zo["offload_optimizer"]["nvme_path"] == str(swap)
    assert isinstance(zo["offload_param"]["buffer_size"], int)
    assert list(swap.iterdir()) == []  # DeepSpeed's zero_stage_3/... folders went at exit
    assert _losses(out) == pytest.approx(_losses(nvme_runs["zero3_offload"]), rel=1e-6, abs=0)


def _step(run, step: int):
    return run / "checkpoints" / ckpt.tag_for(step)


def _losses(run, key: str = "loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in read_metrics(run)}


@pytest.mark.slow
def test_nvme_checkpoint_reads_its_swap_files(nvme_runs, tmp_path):
    nvme, offload = nvme_runs["zero3_nvme"], nvme_runs["zero3_offload"]
    assert not (nvme / "nvme_swap").exists()  # the default swap folder went with the run
    for run in (nvme, offload):  # the same gathers, so the same arithmetic (nvme_runs)
        assert json.loads((run / "resolved_config.json").read_text())["zero3_blocks_whole"] is False
    assert _losses(nvme) == pytest.approx(_losses(offload), rel=1e-6, abs=0)
    src = _step(nvme, 4)
    swapped = {p.name for p in (src / "offloaded_tensors" / "rank01").iterdir()}
    assert {n.split("-")[0] for n in swapped} >= {"exp_avg", "exp_avg_sq"}, swapped
    # Every state of every parameter, swapped or not, equals the offload run's.
    got = {name: (dict(s), step) for name, s, step in ZeroFiles(src).params()}
    want = {name: (dict(s), step) for name, s, step in ZeroFiles(_step(offload, 4)).params()}
    assert got.keys() == want.keys()
    for name, (states, step) in want.items():
        assert got[name][1] == step == 4
        for key, value in states.items():
            torch.testing.assert_close(got[name][0][key], value, rtol=1e-6, atol=0, msg=name)
    # Export: stock transformers loads the same weights from both.
    from transformers import AutoModelForCausalLM

    weights = {}
    for name, run in (("nvme", nvme), ("offload", offload)):
        assert export_main([str(_step(run, 4)), "--out", str(tmp_path / name)]) == 0
        model = AutoModelForCausalLM.from_pretrained(tmp_path / name)
        weights[name] = model.state_dict()
    for k, v in weights["offload"].items():
        torch.testing.assert_close(weights["nvme"][k], v, rtol=1e-6, atol=0, msg=k)
    # A swap file cut short is refused in one line naming it.
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    victim = next((bad / "offloaded_tensors" / "rank01").glob("exp_avg_sq-*"))
    victim.write_bytes(victim.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=f"{victim.name} holds 1000 bytes") as e:
        list(ZeroFiles(bad).params())
    assert "\n" not in str(e.value)
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"{victim.name} is missing"):
        list(ZeroFiles(bad).params())


def _resume(nvme_runs, tiny_data, name: str, config: str):
    """The zero3_nvme run's step-2 checkpoint resumed under `config`: the new run's folder."""
    out = nvme_runs["base"] / name
    launch(
        ["--data", str(tiny_data), "--model", str(nvme_runs["model"]), *WIDE_RUN]
        + ["--resume", str(_step(nvme_runs["zero3_nvme"], 2)), "--save-every", "0"]
        + ["--out", str(out), "--ds_config", config]
    )
    return out


def _after_2(run, key: str = "loss") -> dict[int, float]:
    return {s: v for s, v in _losses(run, key).items() if s > 2}


@pytest.mark.slow
def test_nvme_checkpoint_resumes_under_zero2_through_its_universal_copy(nvme_runs, tiny_data):
    """The universal copy is made from the swap files: ZeRO-2 without offload takes steps 3
    and 4 as the uninterrupted run did (same weights; torch's AdamW instead of CPU Adam)."""
    got = _losses(_resume(nvme_runs, tiny_data, "z2", "ds_configs/zero2.json"))
    assert (nvme_runs["zero3_nvme"] / "checkpoints" / f"{ckpt.tag_for(2)}_universal").is_dir()
    want = _after_2(nvme_runs["zero3_nvme"])
    assert got == pytest.approx(want, rel=1e-4)  # step 3: equal; step 4: 1e-6 seen


@pytest.mark.slow
def test_nvme_checkpoint_resumes_exactly_under_nvme(nvme_runs, tiny_data):
    """DeepSpeed 0.19.8's load_checkpoint skips the ZeRO optimizer files when the optimizer
    swaps to NVMe and only copies offloaded_tensors/ back: alone, the Adam step count, the
    sub-groups too small to swap and the swapped moments started over (measured: step 3's loss
    5.9168 against the uninterrupted 5.9030). engines/ds.py: restore_swapped_optimizer puts them
    back: steps 3 and 4 after resuming at 2 are the uninterrupted run's to the bit, losses and
    gradient norms (the wide model keeps one sub-group swapped and two in memory)."""
    out = _resume(nvme_runs, tiny_data, "nvme", _config(nvme_runs["base"], "zero3_nvme"))
    for key in ("loss", "grad_norm"):
        assert _losses(out, key) == _after_2(nvme_runs["zero3_nvme"], key), key


@pytest.mark.slow
def test_nvme_checkpoint_on_another_layout_under_nvme_is_refused(nvme_runs, tiny_data, tmp_path):
    """A new world size with the optimizer still on NVMe would go through DeepSpeed's universal
    load into swapped sub-groups, which is untested: refused in one line before any work,
    naming the configs that resume it (through the universal copy)."""
    cfg = _config(nvme_runs["base"], "zero3_nvme")
    out = tmp_path / "run"
    args = ["--data", str(tiny_data), "--model", str(nvme_runs["model"]), *WIDE_RUN]
    args += ["--resume", str(_step(nvme_runs["zero3_nvme"], 2)), "--out", str(out)]
    p = launch([*args, "--ds_config", cfg], nproc=1, check=False)
    lines = [x for x in p.stderr.splitlines() if "not on a new layout" in x]
    assert p.returncode != 0 and lines, p.stderr[-3000:]
    assert lines[0].startswith("error: ") and "zero3_offload.json" in lines[0]
    assert not out.exists()  # refused before the run folder was made
