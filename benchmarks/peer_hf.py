"""The Hugging Face Trainer with DeepSpeed, as people run it, on the compare job's work: one rank
of it under torchrun, `python -m benchmarks.peer_hf [--stock] TRAIN_FLAGS...` (`python -m
benchmarks.compare --engines ... --hf-trainer` starts it).

Same model folder, data, micro-batch, accumulation, steps, learning rate, precision and thread
count as the zerostack rows; DeepSpeed from `ds_configs/zero2.json` (the Trainer fills its
"auto"s, except the all-gather bucket, left to DeepSpeed's default), `use_cpu=True` (the Trainer refuses bf16 on a CPU without it), fused AdamW. Our
model's attention kernel is the one the trainer picks, so the ratio measures the loops, not
the kernels. Writes one JSON row (tokens/s, MFU against a ceiling measured as the trainer
measures its own, peak resident set) to --out from rank 0.

`stock=True` (the `hf_stock` row, `--stock-peers`) runs it as people run it instead: transformers' own
`LlamaForCausalLM` with its default attention (SDPA), starting from the same weights (renamed by
models/hf_adapter.py), so the row also measures the model code and the kernel."""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

from benchmarks.compare.runs import WARMUP_STEPS
from training.runtime import distributed

REPO = Path(__file__).resolve().parent.parent


def train_windows(data_path, seq_len: int):
    """The training windows of a prepared folder as the HF Trainer takes them (a dataset of
    {input_ids, labels}; the model shifts the labels)."""
    import torch

    from data import TokenDataset

    windows = TokenDataset(data_path, "train", seq_len)

    class Windows(torch.utils.data.Dataset):
        def __len__(self):
            return len(windows)

        def __getitem__(self, i):
            w = torch.from_numpy(windows[i])
            return {"input_ids": w[:-1], "labels": w[:-1]}

    return Windows()


def as_transformers_llama(model):
    """Our model's weights in transformers' own `LlamaForCausalLM`, with its default attention
    (SDPA), in the model's dtype: the model people run under the Trainer."""
    from transformers import LlamaForCausalLM

    from models import to_llama_config, to_llama_state_dict

    dtype = next(model.parameters()).dtype
    theirs = LlamaForCausalLM._from_config(
        to_llama_config(model.config), attn_implementation="sdpa", dtype=dtype
    )
    result = theirs.load_state_dict(to_llama_state_dict(model.state_dict()), strict=False)
    tied = {"lm_head.weight"} if theirs.config.tie_word_embeddings else set()
    if result.unexpected_keys or set(result.missing_keys) - tied:
        raise RuntimeError(f"weights did not map onto LlamaForCausalLM: {result}")
    theirs.tie_weights()
    return theirs


def training_arguments(s):
    """The Trainer's arguments for the job in the run configuration `s`: DeepSpeed from ds_configs/zero2.json,
    on the CPU, fused AdamW, a step logged each step, nothing saved."""
    from transformers import TrainingArguments

    ds = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    ds = {k: v for k, v in ds.items() if not k.startswith("_")}
    # The Trainer fills the batch, clipping and reduce-bucket "auto"s; the all-gather bucket it
    # does not know, so DeepSpeed's default stands, as in the Trainer's documented ZeRO-2 file.
    ds["zero_optimization"].pop("allgather_bucket_size", None)
    return TrainingArguments(
        output_dir=str(Path(s.out).with_suffix(".trainer")),
        per_device_train_batch_size=s.optim.micro_batch,
        gradient_accumulation_steps=s.optim.grad_accum,
        max_steps=s.optim.steps,
        learning_rate=s.optim.lr,
        warmup_steps=s.optim.warmup or 0,
        max_grad_norm=1.0,
        bf16=s.engine.precision
        != "fp32",  # --precision fp32: the Trainer's own default (bf16=False)
        use_cpu=True,
        deepspeed=ds,
        optim="adamw_torch_fused",
        seed=s.optim.seed,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        disable_tqdm=True,
    )


def run(argv: list[str], warmup_steps: int, stock: bool = False) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback

    from models import flops_per_token, pick_attention_kernel, set_attention_kernel
    from training.runtime.flops import model_shapes, run_ceiling
    from training.settings import flags

    s = flags.parse(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # as the trainer does

    times: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t)

    args = training_arguments(s)
    dtype = torch.float32 if s.engine.precision == "fp32" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(s.model.name, dtype=dtype)
    if stock:
        model = as_transformers_llama(model)
    else:
        set_attention_kernel(model, pick_attention_kernel(s.model.attention, "cpu", s.data.seq_len))
    data = train_windows(s.data.path, s.data.seq_len)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[StepTimes()])
    # The ceiling as the trainer measures its own (after the process group exists).
    shapes = model_shapes(model.config, s.optim.micro_batch * s.data.seq_len)
    ceiling = run_ceiling(torch.device("cpu"), dtype, shapes).per_rank
    trainer.train()
    # the higher of a start and an end probe: one taken in a slow spell of the host reads low
    ceiling = max(ceiling, run_ceiling(torch.device("cpu"), dtype, shapes).per_rank)
    tokens = s.optim.micro_batch * s.optim.grad_accum * world * s.data.seq_len
    tps = statistics.median(tokens / t for t in times[warmup_steps:] or times)
    n = sum(p.numel() for p in model.parameters())
    fpt = flops_per_token(model.config, s.data.seq_len, n_params=n)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0])
    if dist.is_initialized():
        dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if int(os.environ.get("RANK", "0")) == 0:
        row = {"tokens_per_s": tps, "mfu": tps * fpt / (ceiling * world)}
        row.update(peak_mem_gb=rss.item() / 2**30, ceiling=ceiling)
        row["precision"] = "fp32" if dtype == torch.float32 else "bf16"
        Path(s.out).write_text(json.dumps(row))


if __name__ == "__main__":
    stock = sys.argv[1:2] == ["--stock"]
    run(sys.argv[1 + stock :], WARMUP_STEPS, stock=stock)
    distributed.exit_process(0)
