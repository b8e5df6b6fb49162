"""The fused ZeRO-1/2 overflow test (training/engines/overflow.py) against DeepSpeed's own, on
the gradients of real engines: the same answer on finite gradients and with NaN, +inf or -inf
planted in any one of them, in a fraction of the ops."""

from __future__ import annotations

import pytest
from conftest import fresh_interpreter

SCRIPT = """
import json, os, sys, torch, deepspeed
from torch.profiler import profile, ProfilerActivity
from training.engines.overflow import fuse_overflow_test
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
os.environ["MASTER_PORT"] = sys.argv[1]
deepspeed.init_distributed("gloo")

def ops(fn):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))

def grads(opt):
    out = []
    for i in range(len(opt.bit16_groups)):
        g = opt.averaged_gradients[i]
        out += [t for t in g if t is not None and t.numel()]
    return out

report = {}
# ZeRO-1 accumulating in fp32 is DeepSpeed's BF16_Optimizer, which has no per-gradient test
for stage, accumulate in ((1, "fp32"), (1, "bf16"), (2, "fp32"), (2, "bf16")):
        config = {"train_batch_size": 2, "bf16": {"enabled": True},
                  "data_types": {"grad_accum_dtype": accumulate},
                  "zero_optimization": {"stage": stage}}
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        fused = fuse_overflow_test(engine.optimizer)
        if stage == 1 and accumulate == "fp32":
            report["1-fp32"] = {"fused": fused, "kind": type(engine.optimizer).__name__}
            continue
        x = torch.randn(2, 16, dtype=torch.bfloat16)
        engine.backward(engine(x).float().pow(2).mean())
        o = engine.optimizer
        answers = [(o._stock_overflow_test().tolist(), o.has_overflow_partitioned_grads_serial().tolist())]
        for t in grads(o):
            for bad in (float("nan"), float("inf"), -float("inf")):
                flat = t.view(-1)
                keep = flat[-1].clone()
                flat[-1] = bad
                answers.append((o._stock_overflow_test().tolist(), o.has_overflow_partitioned_grads_serial().tolist()))
                flat[-1] = keep
        report[f"{stage}-{accumulate}"] = {
            "fused": fused, "flat": hasattr(o.averaged_gradients[0], "flat_partition"), "answers": answers, "gradients": len(grads(o)),
            "stock_ops": ops(o._stock_overflow_test),
            "fused_ops": ops(o.has_overflow_partitioned_grads_serial),
        }
        engine.step()
print(json.dumps(report))
"""


@pytest.mark.slow  # a fresh interpreter
def test_the_fused_overflow_test_answers_as_stock():
    report = fresh_interpreter(SCRIPT)
    assert set(report) == {"1-fp32", "1-bf16", "2-fp32", "2-bf16"}
    assert report.pop("1-fp32") == {"fused": False, "kind": "BF16_Optimizer"}
    for case, r in report.items():
        assert r["fused"], case
        assert r["flat"] is (case == "2-fp32"), case  # both of DeepSpeed's layouts are covered
        assert r["gradients"] >= 1, case
        # the first answer is on the finite gradients, then one for each planted value
        assert r["answers"][0] == [[False], [False]], case
        assert len(r["answers"]) == 1 + 3 * r["gradients"], case
        assert all(stock == fused == [True] for stock, fused in r["answers"][1:]), case
        assert r["fused_ops"] * 3 <= r["stock_ops"], case
