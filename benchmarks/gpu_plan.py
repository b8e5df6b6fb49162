"""The GPU check's plan: its rows in the order they run, each a few processes (the trainer under
torchrun on one device, or `python -m MODULE`) with a time budget, and a check of what they wrote
(benchmarks/gpu_check.py runs them)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from launch.launcher_argv import launcher_command
from training.runtime.distributed import free_port

REPO = Path(__file__).resolve().parent.parent
# The engines measured at the large preset: row name -> the trainer's engine flags.
ENGINES = {
    "zero2": ["--ds-config", "ds_configs/zero2.json"],
    "zero3": ["--ds-config", "ds_configs/zero3.json"],
    "ddp": ["--backend", "ddp"],
    "fsdp": ["--backend", "fsdp"],
    "zero2_offload": ["--ds-config", "ds_configs/zero2_offload.json"],
    "zero3_offload": ["--ds-config", "ds_configs/zero3_offload.json"],
    "zero1": ["--ds-config", "ds_configs/zero1.json"],
    "zero0": ["--ds-config", "ds_configs/zero0.json"],
    # beside the zero2 row: whether compiling pays back on this GPU within a run (the first
    # step's compile against the steps' gain), the figure compile-by-default waits for there
    "zero2_compiled": ["--ds-config", "ds_configs/zero2.json", "--compile"],
}
# Seconds each row may take at most. On an H200 a 10-step 350M row took 34-38 s, nearly all of
# it start-up (benchmarks/results/gpu/h200_2026-11-28).
BUDGETS = {"prepare": 90, "quickstart": 120, "export": 60, "lora": 75, "async_save": 150}
BUDGETS |= {"evaluate": 60, "zero2_offload": 90, "zero3_offload": 90, "zero2_compiled": 120}
BUDGETS["profile"] = 75  # 14 steps and the profiler's trace written after step 12
ENGINE_BUDGET = 60  # 34-38 s for 10 steps on the H200, of which ZeRO-3 stepped 4.5 s: 30 steps fit
# DeepSpeed's compiled ops a row loads: built in the background from the check's start (over
# 60 s of nvcc and g++ on the H200's image), so the row does not spend its budget building.
OPS = {"zero2_offload": "CPUAdamBuilder", "zero3_offload": "CPUAdamBuilder"}
# The engine rows after the first two, most wanted first: the deadline cuts from the end, and
# ZeRO-1 on one device partitions no more than ZeRO-2 (58,867 against 58,884 tokens/s there).
MORE_ENGINES = ("ddp", "fsdp", "zero2_offload", "zero3_offload", "zero0", "zero1")
DEADLINE_S = 540  # the whole check: a 10-minute command, with room for the install


@dataclass
class Command:
    """One process of a row: `train` is training/train.py under torchrun on one device,
    `module` is `python -m MODULE ARGS`."""

    kind: str
    args: list[str]
    module: str = ""

    def argv(self) -> list[str]:
        if self.kind == "train":
            program = ["training/train.py", *self.args]
            return launcher_command("torchrun", 1, program, port=free_port())
        return [sys.executable, "-m", self.module, *self.args]


@dataclass
class Row:
    """A row of the check: what it shows, its processes, then an optional check of what they
    wrote (`check`: "logits" or "async"); `figures` names the run folder whose metrics.jsonl
    gives tokens/s, MFU and peak memory; `after` a row it needs; `needs` a module it imports;
    `ops` a DeepSpeed op builder whose background build it waits for."""

    name: str
    what: str
    budget_s: int
    commands: list[Command]
    figures: str = ""
    check: str = ""
    after: str = ""
    needs: str = ""
    ops: str = ""
    paths: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------ the plan
def sizes(a) -> dict:
    """The job's sizes: the GPU's (350M, seq 1024) or --tiny's (CPU-sized, for a dry run)."""
    if a.tiny:
        return {"large": "tiny", "small": "tiny", "seq": 64, "micro": 2, "steps": 2}
    return {"large": a.model, "small": "small", "seq": a.seq_len, "micro": a.micro_batch}


def train_flags(a, model: str, out: Path, seq: int, micro: int, steps: int) -> list[str]:
    """The flags every training row shares: a short job, logged every step, no saves."""
    return [
        *("--data", str(a.work / "data"), "--model", model, "--out", str(out)),
        *("--seq-len", str(seq), "--micro-batch", str(micro), "--steps", str(steps)),
        *("--warmup", "2", "--log-every", "1", "--eval-every", "0", "--eval-samples", "4"),
        *("--save-every", "-1", "--resume", "never", "--precision", a.precision),
    ]


def plan(a) -> list[Row]:
    """The check's rows in the order they run (most wanted first, as the deadline may cut the
    last): the commands, their budgets and what each row shows."""
    z, runs = sizes(a), a.work / "runs"
    steps = z.get("steps", a.steps)
    hf = runs / "quickstart" / "hf"  # the export the LoRA and evaluate rows start from
    data = ["--source", "pystdlib", "--out", str(a.work / "data"), "--quiet"]
    data += ["--vocab-size", str(512 if a.tiny else 8192), "--max-docs", str(a.max_docs)]
    data += ["--num-proc", str(1 if a.tiny else 8)]
    prepare = Command("module", data, "data.prepare")
    rows = [Row("prepare", "pystdlib prepared", BUDGETS["prepare"], [prepare])]
    rows += quickstart_rows(a, z, runs / "quickstart", hf)
    first = ("zero2", "zero2_compiled", "zero3")  # compiled: whether compiling pays on a GPU
    rows += [engine_row(a, name, z, steps, runs) for name in first]
    rows += [async_row(a, z, runs), lora_row(a, z, steps, runs / "lora", hf)]
    more = [engine_row(a, name, z, steps, runs) for name in MORE_ENGINES]
    # where ZeRO-2's step goes on this device: after DDP and FSDP2, before the offload rows
    rows += more[:2] + [profile_row(a, z, runs / "profile")] + more[2:]
    scored = ["--data", str(a.work / "data"), "--limit", "20", "--out", str(runs / "eval.json")]
    score = Command("module", [str(hf), *scored], "training.evaluate")
    what = "training.evaluate: the shipped offline tasks on the export"
    rows.append(
        Row("evaluate", what, BUDGETS["evaluate"], [score], after="export", needs="lm_eval")
    )
    return [r for r in rows if not a.rows or r.name in a.rows or r.name == "prepare"]


def quickstart_rows(a, z: dict, quick: Path, hf: Path) -> list[Row]:
    """The quickstart's job on one device, then its export read by stock transformers."""
    args = ["--config", "examples/quickstart.yaml", "--data", str(a.work / "data")]
    args += ["--out", str(quick), "--steps", str(2 if a.tiny else 50), "--resume", "never"]
    if a.tiny:
        args += ["--model", "tiny", "--seq-len", "64", "--save-every", "0"]
    what = f"examples/quickstart.yaml ({z['small']}, ZeRO-2), 1 device"
    train = Row("quickstart", what, BUDGETS["quickstart"], [Command("train", args)])
    train.figures = str(quick)
    export = Command("module", [str(quick), "--out", str(hf), "--overwrite"], "training.export")
    what = "quickstart exported, reloaded by stock transformers: logits against ours on the device"
    checked = Row("export", what, BUDGETS["export"], [export], check="logits", after="quickstart")
    checked.paths = {"hf": str(hf)}
    return [train, checked]


def lora_row(a, z: dict, steps: int, out: Path, hf: Path) -> Row:
    args = train_flags(a, str(hf), out, z["seq"], z["micro"], steps) + ["--lora", "default"]
    args[args.index("--save-every") + 1] = "0"  # its export needs the last step saved
    export = Command("module", [str(out), "--out", str(out / "hf")], "training.export")
    what = "LoRA (default) on the export, ZeRO-2, then its merged export"
    row = Row("lora", what, BUDGETS["lora"], [Command("train", args), export], after="export")
    row.figures = str(out)
    return row


def engine_row(a, name: str, z: dict, steps: int, runs: Path) -> Row:
    out = runs / name
    args = [*train_flags(a, z["large"], out, z["seq"], z["micro"], steps), *ENGINES[name]]
    what = f"{z['large']}, {name}, seq {z['seq']}, micro-batch {z['micro']}, {steps} steps"
    budget = BUDGETS.get(name, ENGINE_BUDGET)
    return Row(
        name, what, budget, [Command("train", args)], figures=str(out), ops=OPS.get(name, "")
    )


def profile_row(a, z: dict, out: Path) -> Row:
    """ZeRO-2 at the engines' size under `--profile`: where a step's time goes on the device
    (matrix products, the optimizer, what no op accounts for), with the profiler's CUDA branch
    run where there is CUDA. Steps 10-12 (2-3 at --tiny) follow the warm-up and compile."""
    steps, span = (3, "2:3") if a.tiny else (14, "10:12")
    args = train_flags(a, z["large"], out, z["seq"], z["micro"], steps)
    args += [*ENGINES["zero2"], "--profile", span]
    what = f"{z['large']}, zero2 under --profile {span}: where a step's time goes"
    row = Row("profile", what, BUDGETS["profile"], [Command("train", args)], check="profile")
    row.figures = str(out)
    row.paths = {"run": str(out), "logs": str(Path(a.out) / "logs"), "gpu": not a.tiny}
    return row


def async_row(a, z: dict, runs: Path) -> Row:
    """A synchronous run, then the same run with background saves stopped after the first
    save and resumed: the check compares their losses step by step and their checkpoints'
    files."""
    steps, every = (4, 2) if a.tiny else (8, 4)
    sync, bg = runs / "async_sync", runs / "async_bg"

    def flags(out: Path) -> list[str]:
        args = train_flags(a, z["small"], out, z["seq"], z["micro"], steps)
        args[args.index("--save-every") + 1] = str(every)
        return [*args, "--keep-last", "0"]

    commands = [
        Command("train", flags(sync)),
        Command("train", [*flags(bg), "--async-save", "--stop-at", str(every)]),
        Command("train", [*flags(bg), "--async-save", "--resume", "auto"]),
    ]
    what = f"--async-save stopped at step {every} and resumed, against synchronous saves ({z['small']}, ZeRO-2)"
    paths = {"sync": str(sync), "bg": str(bg), "step": every}
    return Row(
        "async_save",
        what,
        BUDGETS["async_save"],
        commands,
        figures=str(bg),
        check="async",
        paths=paths,
    )
