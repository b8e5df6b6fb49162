"""One step of tiny-moe under DeepSpeed ZeRO-2 in fp32 with AutoEP on every rank of the world
(expert parallelism, each rank a different slice of the batch), against the same model in this
process on the whole batch: writes the largest gradient difference relative to the gradient's
largest entry, per parameter, to the JSON file named by argv[1] (rank 0)."""

import json
import sys

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_grad

from models import build_model
from training.engines.expert_parallel import autoep_section, capture_router_logits

deepspeed.init_distributed(dist_backend="gloo")
rank, world = dist.get_rank(), dist.get_world_size()
# the router losses are not sums over tokens: off, so the whole batch's gradient is the ranks' mean
over = {"router_aux_loss_coef": 0.0, "router_z_loss_coef": 0.0}
torch.manual_seed(0)
model = build_model("tiny-moe", overrides=over)
torch.manual_seed(0)
ref = build_model("tiny-moe", overrides=over).train()
cfg = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "zero_optimization": {"stage": 2},
    "expert_parallel": autoep_section(world),
}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
assert capture_router_logits(engine.module) == 2
batch = torch.randint(0, 512, (2 * world, 32), generator=torch.Generator().manual_seed(0))
x = batch[2 * rank : 2 * rank + 2]
engine.backward(engine(input_ids=x, labels=x).loss)
ref(input_ids=batch, labels=batch).loss.backward()
theirs = dict(ref.named_parameters())
out = {}
for name, p in engine.module.named_parameters():
    got = safe_get_full_grad(p)
    if ".experts.w" in name:  # this rank's experts, cut from the stacked weights
        experts = ref.layers[int(name.split(".")[1])].feed_forward.experts
        width, first = experts.down_proj.shape[2], rank * p.shape[0]
        gate_up, down = experts.gate_up_proj.grad, experts.down_proj.grad
        full = {"w1": gate_up[:, :width], "w3": gate_up[:, width:], "w2": down}
        want = full[name.rsplit(".", 1)[1]][first : first + p.shape[0]]
    else:
        want = theirs[name.replace("router.gate", "gate")].grad
    out[name] = ((got - want).abs().max() / want.abs().max()).item()
if rank == 0:
    json.dump(out, open(sys.argv[1], "w"))
