"""The patches into DeepSpeed's and torch's internals (training/runtime/patches.py): each is
applied only on the versions it was verified against and names the test that verifies it;
where the stock path runs, it is run against the patched one here (the shm route trains the
same model alike, in fp32 so the comparison is of the arithmetic; the staged checkpoint engine
writes the files DeepSpeed's own writes)."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import TINY_RUN, fresh_interpreter, launch, read_metrics, shm_has_room

from training.runtime import patches


@pytest.mark.parametrize(
    "installed, low, high, inside",
    [
        ("0.19.8", "0.19.8", "0.19.8", True),
        ("2.13.0+cpu", "2.13.0", "2.13.0", True),  # a local tag is the same release
        ("0.19.9", "0.19.8", "0.19.8", False),
        ("0.19.7", "0.19.8", "0.19.9", False),
        ("0.20.0rc1", "0.19.8", "0.19.8", False),
        ("0.19.10", "0.19.8", "0.19.9", False),  # numbers, not strings: 10 > 9
        ("0.19.9", "0.19.8", "0.19.10", True),
        ("garbage", "0.19.8", "0.19.8", False),
    ],
)
def test_version_range(installed, low, high, inside):
    assert patches.in_range(installed, low, high) is inside


def test_outside_its_range_a_patch_takes_the_stock_path_and_says_so():
    ok, line = patches.check("shm_route", "0.20.0")
    assert not ok
    assert line == (
        "shm_route: deepspeed 0.20.0 is outside the versions it was verified against "
        "(0.19.8); taking the stock path (gloo)"
    )
    assert patches.check("fsdp2_held_grads", "2.14.0")[0] is False
    assert patches.check("fsdp2_held_grads", "2.13.0")[0] is True
    for name in patches.PATCHES:  # every patch names its stock path
        assert "stock: " in patches.PATCHES[name].what


def test_every_patch_names_a_test_that_exists():
    """Each patch's `tested` names file::function of a test in this folder, so the registry's
    word on how a patch is verified cannot outlive the test."""
    here = Path(__file__).parent
    for name, p in patches.PATCHES.items():
        path, function = p.tested.split(": ")[0].split("::")
        source = (here.parent / path).read_text()
        assert re.search(rf"^def {function}\(", source, re.M), (name, p.tested)


def test_staged_checkpoint_engine_writes_what_deepspeeds_writes(tmp_path):
    """--async-save's checkpoint engine (engines/ds.py, swapped into DeepSpeed's engine for one
    save) against DeepSpeed's own: the same state dict (a view sharing its buffer, as ZeRO's
    flat partitions do) loads back equal from both files, the view still sharing; the staged
    file is in the writer's hashes (the seal takes them). DeepSpeed's engine calls nothing on
    its checkpoint engine that the staged one leaves to a stock default it should not have."""
    import deepspeed.runtime.engine
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from training.checkpoints.background import BackgroundWriter
    from training.engines.ds import StagedCheckpointEngine

    flat = torch.randn(12)
    state = {"flat": flat, "part": flat[4:8], "step": 3, "inner": {"m": torch.ones(2, 3)}}
    stock, writer = TorchCheckpointEngine(), BackgroundWriter()
    staged = StagedCheckpointEngine(stock, writer)
    stock.save(state, str(tmp_path / "stock.pt"))
    staged.save(state, str(tmp_path / "staged.pt"))
    assert writer.wait(60) and writer.error is None
    assert [Path(p).name for p in writer.written] == ["staged.pt"]
    a, b = (torch.load(tmp_path / f, weights_only=False) for f in ("stock.pt", "staged.pt"))
    assert a.keys() == b.keys() and a["step"] == b["step"] == 3
    for x, y in (
        (a["flat"], b["flat"]),
        (a["part"], b["part"]),
        (a["inner"]["m"], b["inner"]["m"]),
    ):
        assert torch.equal(x, y)
    assert b["part"].untyped_storage().data_ptr() == b["flat"].untyped_storage().data_ptr()
    # Every method DeepSpeed's engine calls is on the base class (a new one would be missed
    # here) and, where the stock engine overrides it, the staged one does too.
    called = set(
        re.findall(r"checkpoint_engine\.(\w+)\(", inspect.getsource(deepspeed.runtime.engine))
    )
    assert called and called <= set(dir(CheckpointEngine)), called - set(dir(CheckpointEngine))
    stock_own = {m for m in called if m in vars(TorchCheckpointEngine)}
    assert stock_own <= set(vars(StagedCheckpointEngine)), stock_own - set(
        vars(StagedCheckpointEngine)
    )
    assert not staged.is_decoupled()  # DeepSpeed commits at once: zerostack's seal decides


def test_outside_its_versions_async_save_is_deepspeeds_own_save(monkeypatch):
    """The staged checkpoint engine's stock path: DeepSpeed saves with its own engine (the files
    written during the save, the seal hashing them), and its engine is put back either way."""
    from training.engines import ds

    class Stub:
        module, checkpoint_engine, used = torch.nn.Linear(1, 1), "stock", []

        def save_checkpoint(self, *args, **kwargs):
            self.used.append(self.checkpoint_engine)

    me = Stub()
    for verified in (True, False):
        monkeypatch.setattr(ds.patches, "verified", lambda name, ok=verified: ok)
        engine = SimpleNamespace(engine=me, expert_parallel=1)
        ds.DeepSpeedEngine.save(engine, "root", "tag", {}, writer=object())
        assert me.checkpoint_engine == "stock"
    assert isinstance(me.used[0], ds.StagedCheckpointEngine) and me.used[1] == "stock"


def test_the_swapped_optimizer_workaround_finds_the_bug_it_works_around():
    """DeepSpeed 0.19.8's load_checkpoint skips the ZeRO optimizer file when the optimizer is
    swapped to NVMe: the workaround reads that off DeepSpeed before applying itself."""
    import deepspeed

    from training.engines.ds import skips_swapped_optimizer_file

    assert skips_swapped_optimizer_file() is (deepspeed.__version__ == "0.19.8")


MUON_RUN = """
import json, os, sys, torch, deepspeed
from training.engines.ds import MUON, stand_in_for_muon
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
os.environ["MASTER_PORT"] = sys.argv[1]
deepspeed.init_distributed("gloo")
losses, stood_in = {}, []
for stage in (0, 1, 2, 3):
    config = {"train_batch_size": 2, "bf16": {"enabled": True},
              "zero_optimization": {"stage": stage}}
    if sys.argv[2] == "patched":
        stood_in.append(stand_in_for_muon(config))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    for _ in range(3):
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.setdefault(stage, []).append(loss.item())
muon = [n for n, m in sys.modules.items() if n.startswith(MUON + ".") and hasattr(m, "__file__")]
print(json.dumps([losses, stood_in, muon]))
"""


@pytest.mark.slow  # fresh interpreters
def test_the_muon_stand_in_trains_as_stock():
    """Stock against patched, each in a fresh interpreter: three bf16 steps under the bf16
    optimizer (ZeRO-0) and ZeRO-1, 2 and 3 give the same losses bit for bit, stock imports
    DeepSpeed's Muon modules on the way (the cost the stand-in removes) and the patched run
    none of them. A run that asks for Muon gets no stand-in."""
    from training.engines.ds import stand_in_for_muon

    stock_losses, _, stock_muon = fresh_interpreter(MUON_RUN, "stock")
    patched_losses, stood_in, patched_muon = fresh_interpreter(MUON_RUN, "patched")
    assert patched_losses == stock_losses
    assert stood_in == [True, False, False, False]  # once per process
    assert stock_muon and patched_muon == []  # stand-ins are no files
    assert not stand_in_for_muon({"optimizer": {"type": "Muon"}})


RUN = [*TINY_RUN, "--precision", "fp32", "--steps", "3", "--save-every", "-1"]


def _losses(tiny_data, out, world, *flags) -> tuple[list[float], dict]:
    launch(["--data", str(tiny_data), "--out", str(out), *RUN, *flags], nproc=world)
    record = json.loads((out / "resolved_config.json").read_text())
    return [r["loss"] for r in read_metrics(out)], record


@pytest.mark.slow
def test_stock_and_patched_paths_train_alike_on_four_ranks(tiny_data, tmp_path):
    """ZeRO-3's gradient average through the shm route (runtime/shm.py: the comm layer and
    stage3.reduce_scatter_coalesced) against DeepSpeed's own on gloo: on 2 ranks bitwise
    (test_train.py: test_zero3_tuned_for_one_cpu_host_is_bitwise_the_stock_path); on 4 the
    kernel adds the ranks in another order than gloo: close, not bitwise, and the record says
    the route was on."""
    world = 4
    if not shm_has_room(world):
        pytest.skip("/dev/shm cannot hold DeepSpeed's segments here (the route stays off)")
    z3 = ["--ds_config", "ds_configs/zero3.json"]
    stock, rec = _losses(tiny_data, tmp_path / "z3_stock", world, *z3, "--shm-collectives", "off")
    assert rec["shm_collectives"] is False
    patched, rec = _losses(tiny_data, tmp_path / "z3_patched", world, *z3)
    assert rec["shm_collectives"] is True and rec["patches"]["shm_route"]["applied"]
    assert len(stock) == 3
    assert patched == pytest.approx(stock, rel=1e-5)  # (seen: not equal from step 2)
