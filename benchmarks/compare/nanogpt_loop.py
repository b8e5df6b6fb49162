"""One rank of the nanoGPT-style DDP loop that `python -m benchmarks.compare` runs beside the
engines as the speed reference: `python -m benchmarks.compare.nanogpt_loop TRAIN_FLAGS...` under
torchrun (benchmarks/compare/runs.py: run_reference starts it)."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.compare.runs import WARMUP_STEPS
from training.runtime import distributed


def reference(argv: list[str]) -> None:
    """nanoGPT-style DDP, the loop people write by hand: the same model, data, batch, thread
    count and precision (bf16 autocast, or fp32 with --precision fp32 as nanoGPT runs on a CPU;
    fused AdamW, no_sync accumulation, clipping). Uncompiled unless --compile is given, which
    compiles the whole model before wrapping it in DDP, as nanoGPT's train.py does."""
    import resource

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from data import BatchLoader, TokenDataset, load_manifest
    from models import build_model, flops_per_token, pick_attention_kernel, set_attention_kernel
    from training.runtime.flops import model_shapes, run_ceiling
    from training.settings import flags
    from training.settings.hparams import DEFAULTS

    s = flags.parse(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # as the trainer does
    torch.manual_seed(s.optim.seed)
    model = build_model(s.model.name, vocab_size=load_manifest(s.data.path).vocab_size)
    # the attention kernel the trainer picks, so the ratio measures the engines alone
    set_attention_kernel(model, pick_attention_kernel(s.model.attention, "cpu", s.data.seq_len))
    # The ceiling of this run, measured as the trainer measures its own (runtime/flops.py).
    shapes = model_shapes(model.config, s.optim.micro_batch * s.data.seq_len)
    low = s.engine.precision != "fp32"  # bf16 autocast unless fp32 is asked
    dtype = torch.bfloat16 if low else torch.float32
    ceiling = run_ceiling(torch.device("cpu"), dtype, shapes).per_rank
    if s.model.compile:  # nanoGPT: model = torch.compile(model), then DDP(model)
        model = torch.compile(model)
    ddp = DDP(model)
    decay = DEFAULTS["weight_decay"] if s.optim.weight_decay is None else s.optim.weight_decay
    opt = torch.optim.AdamW(model.parameters(), lr=s.optim.lr, weight_decay=decay, fused=True)
    data = TokenDataset(s.data.path, "train", s.data.seq_len)
    loader = BatchLoader(data, s.optim.micro_batch, rank, world, s.optim.seed)
    times = []
    for _ in range(s.optim.steps):
        t = time.perf_counter()
        for micro in range(s.optim.grad_accum):
            x, y = loader.next_batch()
            ddp.require_backward_grad_sync = micro == s.optim.grad_accum - 1
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=low):
                loss = ddp(input_ids=x, labels=y, shift_labels=y).loss / s.optim.grad_accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # nanoGPT prints it every step
        times.append(time.perf_counter() - t)
    # A probe taken in one of the host's slow spells reads low (an MFU of 140% was seen):
    # the higher of the start's and the end's, as the trainer raises its own (loop/loop.py).
    ceiling = max(ceiling, run_ceiling(torch.device("cpu"), dtype, shapes).per_rank)
    tokens = s.optim.micro_batch * s.optim.grad_accum * world * s.data.seq_len
    tps = statistics.median(tokens / t for t in times[WARMUP_STEPS:] or times)
    fpt = flops_per_token(
        model.config, s.data.seq_len, n_params=sum(p.numel() for p in model.parameters())
    )
    peak = ceiling * world
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0])
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if rank == 0:
        row = {"tokens_per_s": tps, "mfu": tps * fpt / peak, "peak_mem_gb": rss.item() / 2**30}
        row.update(
            ceiling=ceiling, precision="bf16" if low else "fp32", compiled=bool(s.model.compile)
        )
        Path(s.out).write_text(json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    reference(sys.argv[1:])
    distributed.exit_process(0)
