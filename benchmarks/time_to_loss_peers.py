"""The two peer recipes of `python -m benchmarks.time_to_loss`, one rank of each under torchrun:

    python -m benchmarks.time_to_loss_peers nanogpt TRAIN_FLAGS...
    python -m benchmarks.time_to_loss_peers hf_trainer TRAIN_FLAGS...

Both read the trainer's own flags (--data, --model FOLDER, --seq-len, --micro-batch,
--grad-accum, --steps, --seed, --eval-every, --eval-samples, --precision, --compile, --out) and
write OUT/metrics.jsonl as the trainer does: a `start` record when the first step begins and an
`eval` record (step, val_loss) every --eval-every steps, each stamped with `time`. The validation
loss is `mean_val_loss`: the same windows, batches and mean as the trainer's evaluation, so every
arm is scored on the same held-out tokens. The parent stops a run once a loss reaches its target.

nanogpt: nanoGPT's train.py loop on our model (as benchmarks/compare/nanogpt_loop.py, plus its
schedule and evaluation): its `shakespeare_char` config, the one nanoGPT ships for a model of
this size: AdamW lr 1e-3, betas (0.9, 0.99), weight decay 0.1 on 2-D tensors only
(`configure_optimizers`), linear warmup then cosine decay to lr/10 over --steps
(`lr_decay_iters = max_iters`), grad clip 1.0, torch.compile before DDP (`compile = True`).
Its warmup is shakespeare_char's 100 of 5000 iterations, 2% of --steps.

hf_trainer: the Hugging Face Trainer as people run it with DeepSpeed (ds_configs/zero2.json,
its "auto"s filled by the Trainer): every hyper-parameter the Trainer's default (lr 5e-5,
linear decay to 0 over max_steps, no warmup, weight decay 0, betas (0.9, 0.999), grad clip 1.0,
its default optimizer); only the job's batch, steps, seed, precision and `use_cpu` are given.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

from training.runtime import distributed

REPO = Path(__file__).resolve().parent.parent
# nanoGPT's config/train_shakespeare_char.py (learning_rate, min_lr = lr/10, beta2) and
# train.py (beta1, weight_decay, grad_clip); warmup_iters 100 of max_iters 5000
NANOGPT = {"lr": 1e-3, "min_lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.1, "clip": 1.0}
NANOGPT_WARMUP = 100 / 5000


class Metrics:
    """Rank 0's OUT/metrics.jsonl, one stamped record a line, flushed as written."""

    def __init__(self, out: str, rank: int):
        self.file = open(Path(out) / "metrics.jsonl", "a") if rank == 0 else None

    def log(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")
            self.file.flush()


def mean_val_loss(model, s, rank: int, world: int, dtype) -> float:
    """The mean loss over the first --eval-samples validation windows, in the trainer's
    batches (data.eval_batches) and mean (training/loop/validation.py: over batches, all ranks)."""
    import torch
    import torch.distributed as dist

    from data import TokenDataset, eval_batches

    val = TokenDataset(s.data.path, "val", s.data.seq_len)
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        for x, y in eval_batches(val, s.optim.micro_batch, rank, world, s.eval.samples):
            total[0] += model(input_ids=x, labels=y, shift_labels=y).loss.double()
            total[1] += 1
    model.train(was_training)
    if dist.is_initialized() and world > 1:
        dist.all_reduce(total)
    return (total[0] / total[1].clamp(min=1)).item()


def nanogpt_lr(step: int, steps: int) -> float:
    """nanoGPT's get_lr: linear warmup, cosine decay to min_lr at lr_decay_iters (= steps)."""
    lr, low = NANOGPT["lr"], NANOGPT["min_lr"]
    warmup = max(1, round(NANOGPT_WARMUP * steps))
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    if step > steps:
        return low
    ratio = (step - warmup) / max(1, steps - warmup)
    return low + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - low)


def nanogpt(s) -> None:
    """nanoGPT's loop on our model and data under torchrun (gloo), with its evaluation."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import AutoModelForCausalLM

    from data import BatchLoader, TokenDataset
    from models import pick_attention_kernel, set_attention_kernel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # as the trainer does
    torch.manual_seed(s.optim.seed)
    log = Metrics(s.out, rank)
    model = AutoModelForCausalLM.from_pretrained(s.model.name, dtype=torch.float32)
    set_attention_kernel(model, pick_attention_kernel(s.model.attention, "cpu", s.data.seq_len))
    # nanoGPT's configure_optimizers: decay on tensors of 2+ dims, none on norms and biases
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": NANOGPT["weight_decay"]},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=NANOGPT["lr"], betas=NANOGPT["betas"], fused=True)
    if s.model.compile:  # nanoGPT: model = torch.compile(model), then DDP(model)
        model = torch.compile(model)
    ddp = DDP(model)
    dtype = torch.float32 if s.engine.precision in (None, "fp32") else torch.bfloat16
    data = TokenDataset(s.data.path, "train", s.data.seq_len)
    loader = BatchLoader(data, s.optim.micro_batch, rank, world, s.optim.seed)
    log.log({"kind": "start", "step": 0})
    for step in range(s.optim.steps):
        for group in opt.param_groups:
            group["lr"] = nanogpt_lr(step, s.optim.steps)
        for micro in range(s.optim.grad_accum):
            x, y = loader.next_batch()
            ddp.require_backward_grad_sync = micro == s.optim.grad_accum - 1
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                loss = ddp(input_ids=x, labels=y, shift_labels=y).loss / s.optim.grad_accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), NANOGPT["clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        log.log({"kind": "train", "step": step + 1, "loss": loss.item() * s.optim.grad_accum})
        if s.eval.every and (step + 1) % s.eval.every == 0:
            val = mean_val_loss(model, s, rank, world, dtype)
            log.log({"kind": "eval", "step": step + 1, "val_loss": val})
    dist.barrier()
    dist.destroy_process_group()


def hf_arguments(s):
    """The Trainer's arguments as people give them: the job's batch, steps, seed and precision,
    DeepSpeed ZeRO-2, nothing saved; every hyper-parameter left at the Trainer's default."""
    from transformers import TrainingArguments

    ds = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    ds = {k: v for k, v in ds.items() if not k.startswith("_")}
    # The "auto"s the Trainer does not fill (it fills the batch, clipping, precision and
    # reduce bucket): DeepSpeed's defaults, as in the Trainer's documented ZeRO-2 file.
    zero = ds["zero_optimization"]
    for key in ("allgather_bucket_size", "overlap_comm"):
        if zero.get(key) == "auto":
            zero.pop(key)
    return TrainingArguments(
        output_dir=str(Path(s.out) / "trainer"),
        per_device_train_batch_size=s.optim.micro_batch,
        gradient_accumulation_steps=s.optim.grad_accum,
        max_steps=s.optim.steps,
        bf16=s.engine.precision == "bf16",  # the Trainer's default: False
        use_cpu=True,  # the Trainer refuses DeepSpeed's bf16 on a CPU without it
        deepspeed=ds,
        seed=s.optim.seed,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        disable_tqdm=True,
    )


def hf_trainer(s) -> None:
    """The HF Trainer on our model and data under torchrun, with an evaluation every
    --eval-every steps from a callback (the same windows as every arm)."""
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback

    from benchmarks.peer_hf import train_windows
    from models import pick_attention_kernel, set_attention_kernel

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # as the trainer does
    log = Metrics(s.out, rank)

    dtype = torch.bfloat16 if s.engine.precision == "bf16" else torch.float32

    class Evaluate(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 0:
                log.log({"kind": "start", "step": 0})

        def on_step_end(self, args, state, control, model=None, **kw):
            if s.eval.every and state.global_step % s.eval.every == 0:
                val = mean_val_loss(model, s, rank, world, dtype)
                log.log({"kind": "eval", "step": state.global_step, "val_loss": val})

    args = hf_arguments(s)
    model = AutoModelForCausalLM.from_pretrained(s.model.name, dtype=dtype)
    set_attention_kernel(model, pick_attention_kernel(s.model.attention, "cpu", s.data.seq_len))
    data = train_windows(s.data.path, s.data.seq_len)
    Trainer(model=model, args=args, train_dataset=data, callbacks=[Evaluate()]).train()


if __name__ == "__main__":
    from training.settings import flags

    arm, argv = sys.argv[1], sys.argv[2:]
    settings = flags.parse(argv)
    Path(settings.out).mkdir(parents=True, exist_ok=True)
    {"nanogpt": nanogpt, "hf_trainer": hf_trainer}[arm](settings)
    distributed.exit_process(0)
