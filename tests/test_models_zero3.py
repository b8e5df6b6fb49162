"""ZeRO-3 construction on 2 real ranks (training/engines/construct.py: the engine builds the
model inside DeepSpeed's construction context): each rank holds only its partition, from a preset
and from a Llama folder.

Run by pytest, which launches this same file under torch.distributed.run; the worker is the
__main__ part.
"""

import math
import os
import subprocess
import sys

import pytest
import torch

from launch.launcher_argv import launcher_command
from training.runtime.distributed import free_port

pytestmark = pytest.mark.slow  # a real 2-rank process group

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ZERO3 = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 3},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
}


def test_zero3_init_partitions_presets_and_llama_folders(tmp_path):
    cmd = launcher_command("torchrun", 2, [__file__, str(tmp_path)], port=free_port())
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("ZERO3 OK") == 2, out.stdout[-3000:]


def _worker(folder: str) -> None:
    import deepspeed
    import torch.distributed as dist

    from models import ZeroStackForCausalLM, get_config, num_params, save_llama
    from training.engines.construct import build_for_engine

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def gathered_state(model):
        params = list(model.parameters())
        with deepspeed.zero.GatheredParameters(params):
            return {name: p.detach().clone() for name, p in model.named_parameters()}

    # 1. A preset built under zero.Init: every parameter is partitioned as it is created.
    torch.manual_seed(0)
    model = build_for_engine("small", vocab_size=None, backend="deepspeed", ds_config=ZERO3)
    config = model.config
    params = list(model.parameters())
    for p in params:
        assert p.numel() == 0, "a full parameter is materialised on this rank"
        assert p.ds_tensor.numel() == math.ceil(p.ds_numel / world)
    assert sum(p.ds_numel for p in params) == num_params(config)
    assert sum(p.ds_tensor.numel() for p in params) <= num_params(config) / world + len(params)

    # The partitions add up to one consistent, sensibly initialised model on every rank.
    state = gathered_state(model)
    sums = [None] * world
    dist.all_gather_object(sums, {k: v.double().sum().item() for k, v in state.items()})
    assert sums[0] == sums[1]
    std = state["layers.0.attention.wq.weight"].std().item()
    assert abs(std - 0.02) < 0.002, std
    residual_std = state["layers.0.attention.wo.weight"].std().item()
    assert abs(residual_std - 0.02 / math.sqrt(2 * config.num_hidden_layers)) < 0.001, residual_std

    # 2. An exported Llama folder loads into our model, partitioned, one parameter at a time.
    llama_dir = os.path.join(folder, "llama")
    if rank == 0:
        torch.manual_seed(1)
        reference = ZeroStackForCausalLM(get_config("tiny"))
        save_llama(reference.state_dict(), reference.config, llama_dir)
    dist.barrier()
    torch.manual_seed(1)
    reference = ZeroStackForCausalLM(get_config("tiny"))  # same seed, same weights on every rank
    loaded = build_for_engine(llama_dir, vocab_size=None, backend="deepspeed", ds_config=ZERO3)
    assert isinstance(loaded, ZeroStackForCausalLM)
    assert all(p.numel() == 0 for p in loaded.parameters())
    state = gathered_state(loaded)
    for name, p in reference.named_parameters():
        assert torch.equal(state[name], p.detach()), name

    # 3. It trains under the ZeRO-3 engine and computes what the whole model computes.
    engine, *_ = deepspeed.initialize(model=loaded, config=ZERO3)
    torch.manual_seed(2)
    x = torch.randint(0, 512, (2, 16))
    y = torch.roll(x, -1, dims=1)
    loss = engine(input_ids=x, labels=y, shift_labels=y).loss
    expected = reference(input_ids=x, labels=y, shift_labels=y).loss
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=0)
    engine.backward(loss)
    engine.step()

    print("ZERO3 OK", rank, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    _worker(sys.argv[1])
