"""SFT against TRL's `SFTTrainer` with DeepSpeed: tokens/s, peak memory per rank, loss at step 1.

    python -m benchmarks.peer_trl --data SFT_DATA --model LLAMA_FOLDER [--rounds 3] [--steps 12]

SFT_DATA is chat data from `data.prepare` (for example the offline job's `pyfuncs-sft`), MODEL a
Llama folder with the same tokenizer (the offline job's base export). Each round runs, for
ZeRO-2 and ZeRO-3 (ds_configs/), full fine-tuning and `--lora`, as real 2-rank jobs under
torchrun: zerostack's training/train.py, then TRL's `SFTTrainer` on the same model, examples,
sequence length, precision (the one our `--precision auto` picked for the zerostack row),
micro-batch, learning rate and LoRA spec (peft's `LoraConfig` on the same seven projections).

TRL gets the prepared examples themselves (`input_ids` and `completion_mask`, which it takes
as a pre-tokenized dataset and turns into labels), so both train on the same tokens and the
same completion tokens. (From the JSONL's prompt/completion TRL appends EOS as text, which
a tokenizer that does not split special tokens out of text, such as ours, tokenizes as
the characters `</s>`: other targets, so another loss.) TRL pads each batch to its longest
example; zerostack pads each example to --seq-len (without --doc-mask), so the rows give
tokens/s three ways: trained (completion) tokens, real (example) tokens and sequence
positions computed (padding included). For TRL these are counted from its batches; for
zerostack, whose metrics count positions, from the mean of the examples the timed steps drew
(the same examples: both see the same batches, so the loss at step 1 is the same too).
`--systems trl,trl_tuned` adds TRL with our run's ZeRO bucket sizes in place of the Trainer's
`auto` (hidden_size squared) and without TRL's default gradient checkpointing. Raw rows with
the host to benchmarks/results/trl_sft.json (after every round); a markdown table to stdout.
TRL is the `bench` extra (`pip install -e ".[bench]"`); nothing outside benchmarks/ imports it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.provenance import today
from launch.launcher_argv import launcher_command
from training.runtime.distributed import free_port

REPO = Path(__file__).resolve().parent.parent
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
WARMUP_STEPS = 2  # steps left out of tokens/s
SEED = 1234
TIMEOUT_S = 240


def lora_config(spec: str):
    """peft's LoraConfig from our `--lora` spec (r, alpha, dropout), on the seven projections."""
    from peft import LoraConfig

    kv = dict(x.split("=", 1) for x in spec.split(",") if x)
    return LoraConfig(
        r=int(kv.get("r", 16)),
        lora_alpha=int(kv.get("alpha", 32)),
        lora_dropout=float(kv.get("dropout", 0.05)),
        target_modules=LLAMA_TARGETS,
        task_type="CAUSAL_LM",
    )


def examples(data: str, split: str = "train") -> list[dict]:
    """The prepared examples of a chat data folder as TRL takes pre-tokenized ones: each one's
    tokens and its loss mask (1 where the token is a target), unpadded."""
    import numpy as np

    from data import load_manifest

    m = load_manifest(data)
    rows = []
    for sh in m.split(split).shards:
        tok = np.fromfile(m.data_dir / sh.file, dtype=m.dtype)
        mask = np.fromfile(m.data_dir / sh.mask_file, dtype=np.uint8)
        idx = np.load(m.data_dir / sh.index_file)
        for a, b in zip(idx[:-1], idx[1:]):
            rows.append({"input_ids": tok[a:b].tolist(), "completion_mask": mask[a:b].tolist()})
    return rows


def train_split(data: str, seq_len: int):
    """The training split as zerostack's reader opens it: examples, or preference pairs."""
    from data import load_manifest
    from data.examples import ExampleDataset
    from data.pairs import PairDataset, is_pairs

    cls = PairDataset if is_pairs(load_manifest(data)) else ExampleDataset
    return cls(data, "train", seq_len)


def in_our_order(data: str, seq_len: int, n: int, seed: int = SEED) -> list[dict]:
    """The examples of the first n samples zerostack's reader draws for `seed` (global positions
    0..n-1; rank r of step s takes positions (s * world + r) * micro_batch onwards). A sample of
    preference data is a pair: its chosen example, then its rejected one (2n rows)."""
    import numpy as np

    ds = train_split(data, seq_len)
    order = ds.order(seed)(np.arange(n))
    rows = examples(data)
    if getattr(ds, "pairs", False):
        return [rows[2 * i + side] for i in order for side in (0, 1)]
    return [rows[i] for i in order]


def drawn_means(data: str, seq_len: int, steps: int, per_step: int) -> dict:
    """Mean tokens and trained tokens of the examples the timed steps draw (after warm-up): the
    same ones on both systems, as their batches are the same."""
    rows = in_our_order(data, seq_len, steps * per_step)
    rows = rows[WARMUP_STEPS * len(rows) // steps :]
    return {
        "tokens": statistics.fmean(min(len(r["input_ids"]), seq_len + 1) for r in rows),
        "trained": statistics.fmean(sum(r["completion_mask"]) for r in rows),
    }


def trainer_args(a) -> dict:
    """The Trainer's arguments every peer job shares: DeepSpeed from ds_configs/CONFIG.json
    (trl_tuned: with the buckets our trainer picked), on the CPU, a constant learning rate,
    every step logged, the examples in zerostack's order."""
    ds = json.loads((REPO / "ds_configs" / f"{a.config}.json").read_text())
    ds = {k: v for k, v in ds.items() if not k.startswith("_")}
    zero = ds.get("zero_optimization", {})
    zero.pop("allgather_bucket_size", None)  # the Trainer leaves it to DeepSpeed's default
    if a.ds_from:  # trl_tuned: the buckets our trainer picked, where the shipped file says auto
        ours = json.loads(Path(a.ds_from).read_text())["ds_config"]["zero_optimization"]
        zero |= {k: ours[k] for k, v in zero.items() if v == "auto" and k in ours}
    return dict(
        output_dir=str(Path(a.out) / "trainer"),
        per_device_train_batch_size=a.micro_batch,
        gradient_accumulation_steps=1,
        max_steps=a.steps,
        learning_rate=a.lr,
        warmup_steps=0,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        bf16=a.precision == "bf16",
        use_cpu=True,
        deepspeed=ds,
        optim="adamw_torch_fused",
        seed=SEED,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        disable_tqdm=True,
        max_length=None,  # the examples are already within --seq-len + 1 (prepare dropped the rest)
        # the examples come in zerostack's order (in_our_order): accelerate deals batch k to
        # rank k % world, as our reader does, so every step's batches are the same on both
        train_sampling_strategy="sequential",
    )


def sft_config(a):
    """SFTTrainer's arguments: the shared ones, the loss on completions only, and TRL's
    default gradient checkpointing (trl_tuned turns it off)."""
    from trl import SFTConfig

    return SFTConfig(
        **trainer_args(a), completion_only_loss=True, gradient_checkpointing=not a.ds_from
    )


def sft_tally(batch: list[dict], out: dict) -> tuple[int, int, int]:
    """A batch of SFTTrainer's collator: its positions, real tokens and trained tokens."""
    return (
        out["input_ids"].numel(),
        int(sum(len(b["input_ids"]) for b in batch)),
        int((out["labels"][:, 1:] != -100).sum()),  # the model shifts the labels
    )


def counted(collate, counts: list[tuple[int, int, int]], tally=sft_tally):
    """`collate` that also appends each batch's `tally` (positions, real tokens, trained
    tokens) to `counts`."""

    def f(batch):
        out = collate(batch)
        counts.append(tally(batch, out))
        return out

    return f


def build_sft(a, args, model, tok, world: int, callbacks: list):
    """TRL's SFTTrainer on the examples in zerostack's order, and how to tally its batches."""
    from datasets import Dataset
    from trl import SFTTrainer

    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(
            in_our_order(a.data, a.seq_len, a.steps * a.micro_batch * world)
        ),
        processing_class=tok,
        peft_config=lora_config(a.lora) if a.lora else None,
        callbacks=callbacks,
    )
    return trainer, sft_tally


def worker(a, make_args=sft_config, build=build_sft) -> None:
    """One rank of a TRL trainer under torchrun (the driver starts it): `make_args(a)` its
    arguments, `build(a, args, model, tokenizer, world, callbacks)` the trainer and its tally."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # as our trainer does
    dtype = torch.bfloat16 if a.precision == "bf16" else torch.float32
    args = make_args(a)
    counts: list[tuple[int, int, int]] = []  # per batch: positions, real tokens, trained tokens
    times: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t)

    # DeepSpeed's process group before the model: under ZeRO-3 from_pretrained builds it
    # partitioned (deepspeed.zero.Init), which on a CPU otherwise reads a world of 1 and refuses
    # the batch (on a GPU the Trainer's device setup starts it first)
    import deepspeed

    _ = args.device
    deepspeed.init_distributed(dist_backend="gloo")
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype)
    trainer, tally = build(a, args, model, tok, world, [StepTimes()])
    trainer.data_collator = counted(trainer.data_collator, counts, tally)
    trainer.train()
    report(a, trainer, counts, times)


def report(a, trainer, counts: list[tuple[int, int, int]], times: list[float]) -> None:
    """Rank 0 writes OUT/row.json: the timed steps' three rates over all ranks, the largest
    rank's peak memory, the losses and the first step's logged figures. All ranks call."""
    import torch
    import torch.distributed as dist

    logs = [h for h in trainer.state.log_history if "loss" in h]
    # grad_accum 1: the dataloader yields one batch per step, in order (no prefetch workers)
    per_step = torch.tensor([list(c) for c in counts[: len(times)]], dtype=torch.float64)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0])
    if dist.is_initialized():
        dist.all_reduce(per_step)  # every rank's tokens of each step
        dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    skip = min(WARMUP_STEPS, len(times) - 1)  # a run of a step or two: its last
    t = sum(times[skip:])
    tot = per_step[skip:].sum(0)
    row = {
        "positions_per_s": tot[0].item() / t,
        "tokens_per_s": tot[1].item() / t,
        "trained_tokens_per_s": tot[2].item() / t,
        "peak_mem_gb": rss.item() / 2**30,
        "loss_step1": logs[0]["loss"],
        "loss_last": logs[-1]["loss"],
        "step1": logs[0],
        "precision": a.precision,
        "trainable": sum(
            getattr(p, "ds_numel", p.numel()) for p in trainer.model.parameters() if p.requires_grad
        ),  # ZeRO-3 leaves each rank a shard: ds_numel is the whole
        "step_s": times,
    }
    Path(a.out, "row.json").write_text(json.dumps(row))


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    """A 2-rank job in its own process group; one stuck past TIMEOUT_S (a rank that never
    reaches the others) is ended whole and gives a row with an error, not a stuck benchmark."""
    p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)  # fmt: skip
    try:
        out, err = p.communicate(timeout=TIMEOUT_S)
        return subprocess.CompletedProcess(cmd, p.returncode, out, err)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return subprocess.CompletedProcess(cmd, "timeout", out, err + f"\nno exit in {TIMEOUT_S} s")


def run_trl(a, config, lora, precision, out: Path, extra: list[str]) -> dict:
    """A 2-rank job of the peer's worker (`a.module --worker`, with `extra` flags): its row."""
    out.mkdir(parents=True, exist_ok=True)
    program = ["-m", a.module, "--worker", "--config", config]
    cmd = launcher_command("torchrun", a.ranks, program, port=free_port())
    cmd += ["--data", a.data, "--model", a.model, "--out", str(out), "--steps", str(a.steps)]
    cmd += ["--micro-batch", str(a.micro_batch), "--lr", str(a.lr), "--precision", precision]
    cmd += ["--seq-len", str(a.seq_len), "--lora", lora, *extra]
    failed = _run_logged(cmd, out)
    if failed:
        return failed
    return json.loads((out / "row.json").read_text())


def _run_logged(cmd: list[str], out: Path) -> dict | None:
    """Run `cmd`, its output kept in OUT/console.log; an error row when it failed, else None."""
    p = _run(cmd)
    out.mkdir(parents=True, exist_ok=True)
    (out / "console.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        print(p.stdout[-2000:], p.stderr[-4000:], file=sys.stderr)
        return {"error": f"exit {p.returncode}"}
    return None


def zerostack_row(out: Path, seq_len: int, means: dict) -> dict:
    """tokens/s of a zerostack run's metrics (sequence positions: micro-batch x seq_len a rank)
    as the three rates, with the drawn examples' mean tokens and trained tokens."""
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["kind"] == "train"]
    timed = train[WARMUP_STEPS:] or train[-1:]  # a run of a step or two: its last
    positions = statistics.median(r["tokens_per_s"] for r in timed)
    resolved = json.loads((out / "resolved_config.json").read_text())
    samples = positions / seq_len
    return {
        "positions_per_s": positions,
        "tokens_per_s": samples * means["tokens"],
        "trained_tokens_per_s": samples * means["trained"],
        "peak_mem_gb": max(r["peak_mem_gb"] for r in train),
        "loss_step1": train[0]["loss"],
        "loss_last": train[-1]["loss"],
        "step1": train[0],
        "precision": resolved["precision"],
        "trainable": resolved["trainable_params"],
    }


def run_zerostack(a, config: str, lora: str, out: Path, means: dict) -> dict:
    """A 2-rank training/train.py job on the same data, model and batch: its row."""
    program = ["training/train.py", "--ds_config", f"ds_configs/{config}.json"]
    cmd = launcher_command("torchrun", a.ranks, program, port=free_port())
    cmd += ["--data", a.data, "--model", a.model, "--out", str(out), "--seq-len", str(a.seq_len)]
    cmd += ["--micro-batch", str(a.micro_batch), "--steps", str(a.steps), "--lr", str(a.lr)]
    cmd += ["--warmup", "0", "--log-every", "1", "--eval-every", "0", "--save-every", "-1"]
    cmd += ["--resume", "never", "--no-compile", "--seed", str(SEED)]
    cmd += (["--lora", lora] if lora else []) + a.zerostack_flags
    failed = _run_logged(cmd, out)
    if failed:
        return failed
    return zerostack_row(out, a.seq_len, means)


def summarise(rows: list[dict]) -> list[dict]:
    """Median and spread over the rounds of each (config, mode, system)."""
    keys = ("positions_per_s", "tokens_per_s", "trained_tokens_per_s", "peak_mem_gb")
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if "error" not in r:
            groups.setdefault((r["config"], r["mode"], r["system"]), []).append(r)
    out = []
    for (config, mode, system), rs in groups.items():
        s = {"config": config, "mode": mode, "system": system, "rounds": len(rs)}
        for k in keys:
            v = [r[k] for r in rs]
            s[k] = statistics.median(v)
            s[k + "_spread"] = (min(v), max(v))
        s["loss_step1"] = rs[0]["loss_step1"]
        s["step1"] = rs[0].get("step1")  # the first step's logged figures
        s["precision"] = rs[0]["precision"]
        s["trainable"] = rs[0]["trainable"]
        out.append(s)
    return out


def table(summary: list[dict]) -> str:
    lines = [
        "| ZeRO | run | system | trained tok/s | real tok/s | positions/s | peak mem / rank (GB) | loss step 1 |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for s in summary:
        lo, hi = s["trained_tokens_per_s_spread"]
        lines.append(
            f"| {s['config']} | {s['mode']} | {s['system']} | {s['trained_tokens_per_s']:,.0f} "
            f"({lo:,.0f}-{hi:,.0f}) | {s['tokens_per_s']:,.0f} | {s['positions_per_s']:,.0f} | "
            f"{s['peak_mem_gb']:.2f} | {s['loss_step1']:.3f} |"
        )
    return "\n".join(lines)


def parser(doc: str, results: str, systems: str, systems_help: str) -> argparse.ArgumentParser:
    """The options every peer benchmark takes (driver, and worker flags the driver passes)."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--configs", default="zero2,zero3")
    p.add_argument("--lora", default="r=16,alpha=32,dropout=0.05")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--systems", default=systems, help=systems_help)
    p.add_argument("--runs", default="runs/bench_trl")
    p.add_argument("--json", default=results)
    # worker (one rank of TRL, started by the driver)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--precision", help=argparse.SUPPRESS)
    p.add_argument("--ds-from", help=argparse.SUPPRESS)
    return p


def drive(
    a, module: str, system_flags, zerostack_flags: list[str], extra: dict | None = None
) -> int:
    """Interleaved rounds: per round, ZeRO config and full/LoRA, zerostack then each peer
    system (`system_flags(system, zerostack_out)`: its worker's extra flags). Raw rows, their
    summary and `extra` to --json after every round."""
    from benchmarks.host import host_class

    a.module, a.zerostack_flags = module, zerostack_flags
    a.data, a.model = str(Path(a.data).resolve()), str(Path(a.model).resolve())
    pairs = getattr(train_split(a.data, a.seq_len), "pairs", False)
    means = drawn_means(a.data, a.seq_len, a.steps, a.micro_batch * a.ranks)
    runs, host = Path(a.runs), host_class()
    rows, loads = [], []
    for rnd in range(a.rounds):
        for config in a.configs.split(","):
            for mode, lora in (("full", ""), ("lora", a.lora)):
                loads.append(os.getloadavg()[0])
                out = runs / f"r{rnd}" / config / mode
                z = run_zerostack(a, config, lora, out / "zerostack", means)
                z |= {"round": rnd, "config": config, "mode": mode, "system": "zerostack"}
                print(z, flush=True)
                precision = z.get("precision") or "bf16"
                rows.append(z)
                for system in a.systems.split(","):
                    flags = system_flags(system, out / "zerostack")
                    t = run_trl(a, config, lora, precision, out / system, flags)
                    t |= {"round": rnd, "config": config, "mode": mode, "system": system}
                    print(t, flush=True)
                    rows.append(t)
        record = {"date": today(), "host": host, "load_avg_1m": loads, "cpus": os.cpu_count(),
                  "args": vars(a), "data_means": means, "pairs": pairs, "rows": rows,
                  "summary": summarise(rows), **(extra or {})}  # fmt: skip
        Path(a.json).write_text(json.dumps(record, indent=1))  # a cut-short run keeps its rounds
    print(f"\n{host}; {a.ranks} ranks, seq {a.seq_len}, micro-batch {a.micro_batch}, "
          f"{a.steps} steps, load average {min(loads):.1f}-{max(loads):.1f}")  # fmt: skip
    print(table(record["summary"]))
    return 0


def sft_system(system: str, zerostack_out: Path) -> list[str]:
    """trl_tuned: with the ZeRO buckets our trainer picked (and no gradient checkpointing)."""
    tuned = system == "trl_tuned"
    return ["--ds-from", str(zerostack_out / "resolved_config.json")] if tuned else []


def main(argv: list[str] | None = None) -> int:
    systems_help = ("peers beside zerostack: trl (TRL's defaults), trl_tuned (our run's ZeRO "
                    "buckets, no gradient checkpointing)")  # fmt: skip
    p = parser(__doc__, "benchmarks/results/trl_sft.json", "trl", systems_help)
    a = p.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    return drive(a, "benchmarks.peer_trl", sft_system, [])


if __name__ == "__main__":
    sys.exit(main())
