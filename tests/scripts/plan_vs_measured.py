"""The memory plan next to the model-state bytes a real engine holds, per rank.

    torchrun --nproc_per_node 2 tests/scripts/plan_vs_measured.py DATA_DIR MODEL OUT.json CONFIG...

CONFIG is a ds_configs name (zero0 ... zero3; ZeRO-3 ones last: transformers builds every later
model partitioned while a ZeRO-3 one lives). For each, in one process group: the trainer's own
config rule, model factory and DeepSpeed engine, micro-batch 1 x 2 accumulation steps, and the
bytes of model states this rank holds after the first micro-batch of the second step (gradients
and optimizer states both exist then), counted by walking the engine's own objects: every tensor
storage reachable from the model's parameters and the DeepSpeed optimizer, once each. Rank 0 writes
{config: {"measured": [rank 0, rank 1, ...], "plan": training.memory_plan's per-rank plan}}.
"""

import gc
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from data import load_manifest  # noqa: E402
from models import build_model  # noqa: E402
from training import config as C  # noqa: E402
from training import distributed as D  # noqa: E402
from training import memory_plan  # noqa: E402
from training.engines import build_engine  # noqa: E402
from training.train import REPO, Settings, parser  # noqa: E402


def state_bytes(module, optimizer) -> dict:
    """{"params", "grads", "optimizer", "buffers", "total"}: bytes of the distinct storages behind
    the parameters (ZeRO-3: their partitions), their gradients, and everything reachable from the
    optimizer (flat fp32 partitions, Adam's moments, gradient partitions, reduce buckets)."""
    seen: dict[tuple, tuple[str, int]] = {}

    def add(t, category: str) -> None:
        if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
            key = (t.device, t.untyped_storage().data_ptr())
            seen.setdefault(key, (category, t.untyped_storage().nbytes()))

    params = list(module.parameters())
    for p in params:
        add(getattr(p, "ds_tensor", None), "params")
        add(p, "params")
    for p in params:
        add(p.grad, "grads")
    visited: set[int] = set()

    def walk(obj, name: str, depth: int) -> None:
        if depth > 8 or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
            return
        if isinstance(obj, torch.Tensor):
            low = name.lower()
            kind = (
                "buffers"
                if "ipg" in low or "bucket" in low
                else "grads"
                if "grad" in low
                else "optimizer"
            )
            add(obj, kind)
            add(obj.grad, "grads")
            return
        if id(obj) in visited or isinstance(obj, torch.nn.Module):
            return
        visited.add(id(obj))
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{name}.{k}" if isinstance(k, str) else name, depth + 1)
        elif isinstance(obj, (list, tuple, set)):
            for v in obj:
                walk(v, name, depth + 1)
        elif type(obj).__module__.startswith(("deepspeed", "torch.optim")) and hasattr(
            obj, "__dict__"
        ):
            for k, v in vars(obj).items():
                walk(v, f"{name}.{k}", depth + 1)

    walk(optimizer, "", 0)
    out = dict.fromkeys(("params", "grads", "optimizer", "buffers"), 0)
    for category, nbytes in seen.values():
        out[category] += nbytes
    out["total"] = sum(out.values())
    return out


def measure(name: str, data: str, model: str, dist) -> tuple[dict, dict]:
    argv = ["--data", data, "--out", "-", "--model", model, "--micro-batch", "1"]
    s = Settings(**vars(parser().parse_args([*argv, "--grad-accum", "2"])))
    vocab = load_manifest(data).vocab_size
    shape = memory_plan.model_shape(model, vocab)
    raw = C.load_json(REPO / "ds_configs" / f"{name}.json")
    ds_cfg = C.resolve(raw, world=dist.world, flags=vars(s), hidden_size=shape.hidden)
    plan = memory_plan.plan(shape, ds_cfg, dist.world, config_name=name, seq_len=32)
    torch.manual_seed(0)
    stage = C.zero_stage(ds_cfg)
    net = build_model(model, vocab_size=vocab, zero3_config=ds_cfg if stage == 3 else None)
    engine = build_engine("deepspeed", model=net, ds_config=ds_cfg, settings=s, device=dist.device)
    x = torch.randint(0, vocab, (1, 32))
    for step in range(2):
        engine.forward_backward(x, x, boundary=False)
        if step == 1:
            measured = state_bytes(engine.engine.module, engine.engine.optimizer)
        engine.forward_backward(x, x, boundary=True)
        engine.step()
    del engine, net
    gc.collect()
    return measured, {**asdict(plan), "model_states": plan.model_states}


def main() -> None:
    data, model, out_path, *configs = sys.argv[1:]
    dist = D.setup()
    import deepspeed

    deepspeed.init_distributed(dist_backend=dist.backend)
    results = {}
    for name in configs:
        measured, plan = measure(name, data, model, dist)
        per_rank = [None] * dist.world
        torch.distributed.all_gather_object(per_rank, measured)
        results[name] = {"measured": per_rank, "plan": plan}
    if dist.is_main:
        Path(out_path).write_text(json.dumps(results, indent=1))
    D.teardown()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
