"""DPO against TRL's `DPOTrainer` with DeepSpeed: the loss and log-probs at step 1 in fp32, then
tokens/s and peak memory per rank.

    python -m benchmarks.peer_trl_dpo --data PAIRS --model LLAMA_FOLDER [--rounds 3] [--steps 8]

PAIRS is preference data from `data.prepare` (the offline DPO job's, benchmarks/dpo_job.py),
MODEL a Llama folder with the same tokenizer (the job's base). TRL's format has one prompt a
pair, so every pair's prompt must tokenize the same before either answer (a tokenizer can
merge a prompt's last characters with an answer's first: keep such rows out of PAIRS). The rounds are those of
benchmarks/peer_trl.py (its machinery, shared): per round, for ZeRO-2 and ZeRO-3, full and
`--lora`, a real 2-rank zerostack DPO run under torchrun, then TRL's `DPOTrainer` on the same
model, pairs in the same order, micro-batch (pairs a rank), learning rate, beta and precision.

TRL gets the prepared pairs themselves, split where the completion starts (`prompt_ids`,
`chosen_ids`, `rejected_ids`, the input of its collator): `DPOTrainer` always tokenizes text
again, so the benchmark's subclass hands the dataset through as it is, and both train on the
same tokens and the same answer tokens. Peers (`--systems`):

    trl             as TRL users run it: full fine-tuning keeps a reference model (a second
                    copy, wrapped by DeepSpeed as TRL does) and runs it at every step; LoRA
                    runs the base with the adapters off at every step
    trl_precompute  `precompute_ref_log_probs=True`, TRL's advice for memory: the reference
                    log-probs of the run's pairs computed before training, no second model

Both keep TRL's defaults otherwise (gradient checkpointing on, dropout off). Before the rounds,
zero2 full and LoRA run once in fp32 on both, for 2 steps: the step-1 loss and the log-probs
of the chosen answers (mean over the global batch) must agree within 1e-5 (`fp32_check` in
the raw file). Raw rows to benchmarks/results/trl_dpo.json; a table to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from benchmarks import peer_trl

BETA = 0.1  # TRL's default, and ours
TOLERANCE = 1e-5  # fp32 step 1: loss and mean chosen log-prob, relative


def split_pair(chosen: dict, rejected: dict) -> dict:
    """A pair of prepared examples (input_ids, completion_mask) as TRL's collator takes it: the
    shared prompt, then each answer (the tokens from the first trained one on)."""
    start = chosen["completion_mask"].index(1)
    if (
        rejected["completion_mask"].index(1) != start
        or chosen["input_ids"][:start] != rejected["input_ids"][:start]
        or not all(chosen["completion_mask"][start:])
        or not all(rejected["completion_mask"][start:])
    ):
        raise ValueError(
            "a pair whose answers do not follow one shared prompt (its prompt tokenizes "
            "differently before each answer): TRL's format cannot hold it; leave it out"
        )
    return {
        "prompt_ids": chosen["input_ids"][:start],
        "chosen_ids": chosen["input_ids"][start:],
        "rejected_ids": rejected["input_ids"][start:],
    }


def pairs_in_our_order(data: str, seq_len: int, n: int, seed: int = peer_trl.SEED) -> list[dict]:
    """The first n pairs zerostack's reader draws for `seed`, split for TRL."""
    rows = peer_trl.in_our_order(data, seq_len, n, seed)
    return [split_pair(rows[i], rows[i + 1]) for i in range(0, len(rows), 2)]


def dpo_tally(batch: list[dict], out: dict) -> tuple[int, int, int]:
    """A batch of DPOTrainer's collator (chosen rows, then rejected rows): its positions, real
    tokens and trained (answer) tokens."""
    return (
        out["input_ids"].numel(),
        int(out["attention_mask"].sum()),
        int(out["completion_mask"][:, 1:].sum()),  # the model shifts: position 0 predicts none
    )


def dpo_config(a):
    """DPOTrainer's arguments: the shared ones, the sigmoid loss with our beta, and whether the
    reference log-probs are precomputed."""
    from trl import DPOConfig

    args = peer_trl.trainer_args(a)
    # the Trainer fills no `auto` overlap_comm, and accelerate refuses one once TRL has wrapped
    # a reference model or the precompute engine: our run's value on this device
    args["deepspeed"]["zero_optimization"]["overlap_comm"] = a.overlap_comm == "true"
    return DPOConfig(
        **args,
        beta=a.beta,
        loss_type=["sigmoid"],
        precompute_ref_log_probs=a.precompute,
    )


def pretokenized_trainer():
    """TRL's DPOTrainer on pairs already tokenized (`DPOTrainer` tokenizes text again): the
    dataset handed through as it is, so TRL trains on the tokens zerostack trains on."""
    from trl import DPOTrainer

    class PreTokenizedDPOTrainer(DPOTrainer):
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset

    return PreTokenizedDPOTrainer


def on_disk(rows: list[dict], folder: Path):
    """`rows` as a dataset saved in `folder` (rank 0 writes, every rank loads), as a user's data
    set loaded from disk is: TRL's precompute writes its cache beside the data on rank 0 and
    the other ranks open that file (a dataset built in memory keeps its cache in a temporary
    folder of each process, where the other ranks do not find it)."""
    import torch.distributed as dist
    from datasets import Dataset, load_from_disk

    if int(os.environ.get("RANK", "0")) == 0:
        Dataset.from_list(rows).save_to_disk(str(folder))
    if dist.is_initialized():
        dist.barrier()
    return load_from_disk(str(folder))


def build_dpo(a, args, model, tok, world: int, callbacks: list):
    """TRL's DPOTrainer on the pairs in zerostack's order, and how to tally its batches."""
    rows = pairs_in_our_order(a.data, a.seq_len, a.steps * a.micro_batch * world)
    trainer = pretokenized_trainer()(
        model=model,
        args=args,
        train_dataset=on_disk(rows, Path(a.out) / "pairs"),
        processing_class=tok,
        peft_config=peer_trl.lora_config(a.lora) if a.lora else None,
        callbacks=callbacks,
    )
    return trainer, dpo_tally


def logps_chosen(row: dict) -> float:
    """The mean log-prob of the chosen answers at step 1, as either system logs it."""
    first = row["step1"]
    return first["logps/chosen"] if "logps/chosen" in first else first["logps_chosen"]


def fp32_check(a) -> list[dict]:
    """zero2, full and LoRA, 2 steps in fp32 on both systems: step 1's loss and mean chosen
    log-prob side by side, and whether they agree within TOLERANCE."""
    out, steps = [], a.steps
    a.steps = 2
    try:
        for mode, lora in (("full", ""), ("lora", a.lora)):
            where = Path(a.runs) / "fp32" / mode
            a.zerostack_flags = [*zerostack_flags(a), "--precision", "fp32"]
            z = peer_trl.run_zerostack(
                a, "zero2", lora, where / "zerostack", {"tokens": 1, "trained": 1}
            )
            if "error" not in z:
                flags = dpo_system(a, "trl", where / "zerostack")
                t = peer_trl.run_trl(a, "zero2", lora, "fp32", where / "trl", flags)
            if "error" in z or "error" in t:
                out.append({"mode": mode, "error": z.get("error") or t.get("error")})
                continue
            row = {"mode": mode, "loss_step1": [z["loss_step1"], t["loss_step1"]],
                   "logps_chosen_step1": [logps_chosen(z), logps_chosen(t)],
                   "loss_step2": [z["loss_last"], t["loss_last"]]}  # fmt: skip
            row["agree"] = all(
                abs(x - y) <= TOLERANCE * max(1.0, abs(y))
                for x, y in (row["loss_step1"], row["logps_chosen_step1"])
            )
            print(row, flush=True)
            out.append(row)
    finally:
        a.steps = steps
    return out


def zerostack_flags(a) -> list[str]:
    """zerostack's DPO run: TRL's beta, a constant learning rate (TRL's here), and a short
    last evaluation (TRL's rows have none)."""
    return ["--dpo-beta", str(a.beta), "--min-lr-ratio", "1", "--eval-samples", "8"]


def dpo_system(a, system: str, zerostack_out: Path) -> list[str]:
    """A TRL row's flags: beta, the overlap_comm our run resolved, and for trl_precompute the
    reference log-probs precomputed (no reference model)."""
    resolved = zerostack_out / "resolved_config.json"
    overlap = (  # a zerostack run that failed before resolving it: DeepSpeed's default
        json.loads(resolved.read_text())["ds_config"]["zero_optimization"]["overlap_comm"]
        if resolved.is_file()
        else False
    )
    flags = ["--beta", str(a.beta), "--overlap-comm", str(bool(overlap)).lower()]
    return flags + (["--precompute"] if system == "trl_precompute" else [])


def main(argv: list[str] | None = None) -> int:
    systems_help = ("peers beside zerostack: trl (a reference model, or LoRA's adapters off), "
                    "trl_precompute (precompute_ref_log_probs=True)")  # fmt: skip
    p = peer_trl.parser(__doc__, "benchmarks/results/trl_dpo.json", "trl,trl_precompute",
                        systems_help)  # fmt: skip
    p.set_defaults(lora="r=16,alpha=32,dropout=0.0", seq_len=128, micro_batch=4, steps=8,
                   lr=1e-4, runs="runs/bench_trl_dpo")  # fmt: skip
    p.add_argument("--beta", type=float, default=BETA)
    p.add_argument("--no-fp32-check", action="store_true")
    p.add_argument("--precompute", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--overlap-comm", default="false", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        peer_trl.worker(a, dpo_config, build_dpo)
        return 0
    a.module = "benchmarks.peer_trl_dpo"
    a.data, a.model = str(Path(a.data).resolve()), str(Path(a.model).resolve())
    check = [] if a.no_fp32_check else fp32_check(a)

    def system_flags(system: str, zerostack_out: Path) -> list[str]:
        return dpo_system(a, system, zerostack_out)

    return peer_trl.drive(a, a.module, system_flags, zerostack_flags(a), {"fp32_check": check})


if __name__ == "__main__":
    sys.exit(main())
