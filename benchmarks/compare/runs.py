"""What `python -m benchmarks.compare` runs and the figures it reads back: each engine as a real
multi-rank run of training/train.py, each loop beside it (benchmarks/compare/nanogpt_loop.py,
benchmarks/peer_hf.py) as its own program under torchrun, a finished run folder as a row, and
the rounds of one row as one."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from launch.launcher_argv import launcher_command
from training.runtime.distributed import free_port

REPO = Path(__file__).resolve().parent.parent.parent

NATIVE = ["ddp", "fsdp"]
# Rows that run an engine with one of the trainer's switches turned (docs/settings.md):
# name -> (engine, flags).
VARIANTS = {
    # sharded across micro-steps: the hold that one CPU host gets with accumulation, off
    "fsdp_shard": ("fsdp", ["--hold-weights", "off"]),
    "zero3_shard": ("zero3", ["--hold-weights", "off"]),
    # DeepSpeed dividing every reduce bucket by the world, not the trainer the loss
    "zero2_mean": ("zero2", ["--grad-sum", "off"]),
    # the blocks left uncompiled (the trainer compiles them by default on a CPU)
    "zero2_eager": ("zero2", ["--no-compile"]),
    "zero3_eager": ("zero3", ["--no-compile"]),
    "ddp_eager": ("ddp", ["--no-compile"]),
    "zero3_gloo": ("zero3", ["--shm-collectives", "off"]),  # every collective on gloo
    "fsdp_gloo": ("fsdp", ["--shm-collectives", "off"]),
    # the precision given, where the shipped configs say auto (preflight/precision.py)
    "zero2_fp32": ("zero2", ["--precision", "fp32"]),
    "zero2_bf16": ("zero2", ["--precision", "bf16"]),
    "ddp_fp32": ("ddp", ["--precision", "fp32"]),
    "ddp_bf16": ("ddp", ["--precision", "bf16"]),
}
WARMUP_STEPS = 3  # steps left out of tokens/s (allocation, first-step setup, op caches)
FLOORS = [  # (run, against, at least x)
    ("ddp", "reference", 0.95),
    ("zero2", "ddp", 0.95),
    ("zero3", "zero2", 0.95),
    ("fsdp", "ddp", 0.95),
    ("fsdp", "fsdp_shard", 1.0),
    ("zero3", "zero3_shard", 1.0),
    ("zero2", "zero2_mean", 1.0),
    ("zero2", "zero2_eager", 1.0),
    ("zero3", "zero3_gloo", 1.0),
    ("fsdp", "fsdp_gloo", 1.0),
    # the goals for ZeRO-2 against the loops people run today (the peer workload; set on a CPU
    # with AMX)
    ("zero2", "reference", 1.3),
    ("zero2", "hf_trainer", 1.5),
    # ... and as people run them: transformers' Llama with SDPA, our model with SDPA
    ("zero2", "reference_sdpa", 1.3),
    # ... and nanoGPT's own default, which compiles (no goal was set: the ratio is reported)
    ("zero2", "reference_compiled", 1.0),
    ("zero2", "hf_stock", 1.5),
]
# The rows that are loops beside the trainer, not its engines (run_reference starts them).
LOOPS = (
    "reference",
    "reference_compiled",
    "reference_sdpa",
    "reference_fp32",
    "plain",
    "hf_trainer",
    "hf_trainer_fp32",
    "hf_stock",
)


def ds_config_names() -> list[str]:
    return sorted(p.stem for p in (REPO / "ds_configs").glob("*.json"))


def _torchrun(
    a, program: list[str], nproc: int = 0, env: dict | None = None
) -> subprocess.CompletedProcess:
    cmd = launcher_command("torchrun", nproc or a.ranks, program, port=free_port())
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)


def job_flags(a, replicas: int = 0) -> list[str]:
    """The train.py flags every engine shares: the same work. An engine with fewer
    data-parallel replicas than ranks (tensor, sequence or pipeline parallel) accumulates
    proportionally more micro-batches, so every run steps on the same global batch."""
    accum = a.grad_accum * a.ranks // (replicas or a.ranks)
    return [
        *("--data", str(a.data), "--model", a.init, "--seq-len", str(a.seq_len)),
        *("--micro-batch", str(a.micro_batch), "--grad-accum", str(accum)),
        *("--steps", str(a.steps), "--seed", str(a.seed), "--lr", str(a.lr)),
        *("--warmup", str(max(1, a.steps // 10)), "--log-every", "1", "--eval-every", "0"),
        *("--eval-samples", str(a.eval_samples), "--save-every", "-1", "--resume", "never"),
    ]


def initial_weights(a) -> str:
    """A preset's initial weights, made once from the seed and saved, for every engine to load:
    seeding alone does not give ZeRO-3 the same weights (it builds the model partitioned and
    draws its random numbers in another order)."""
    from models import PRESETS

    if a.model not in PRESETS:
        return a.model  # a folder already holds its weights
    import torch

    from data import load_manifest
    from models import build_model

    layers = {"num_hidden_layers": a.layers} if a.layers else {}
    folder = Path(a.runs) / f"init_{a.model}{a.layers or ''}_seed{a.seed}"
    if not (folder / "config.json").is_file():
        torch.manual_seed(a.seed)
        vocab = load_manifest(a.data).vocab_size
        build_model(a.model, vocab_size=vocab, overrides=layers).save_pretrained(folder)
    return str(folder)


def engine_flags(name: str) -> list[str]:
    name = VARIANTS.get(name, (name,))[0]
    if name in NATIVE:
        return ["--backend", name]
    return ["--ds_config", f"ds_configs/{name}.json"]


def replicas(name: str, ranks: int) -> int:
    """Data-parallel replicas of an engine on `ranks` ranks: world / (pp x tp x sp), by the
    trainer's own rule (training/settings/parallel.py); the native engines are all data."""
    name = VARIANTS.get(name, (name,))[0]
    if name in NATIVE:
        return ranks
    from training.errors import ConfigError
    from training.settings import ds_config, parallel

    path = REPO / "ds_configs" / f"{name}.json"
    try:
        return parallel.layout(ds_config.load_json(path), ranks, str(path)).data
    except ConfigError:  # a layout the trainer refuses: the run says why, in its own line
        return ranks


def engine_ranks(name: str, ranks: int) -> int:
    """The ranks an engine runs on: the job's, or, for a layout whose model-parallel ranks
    (pipeline x tensor x sequence) the job's do not hold, the fewest multiple of them that
    holds the job's (`pipeline_tp2` on a 2-rank job: 4). Its data-parallel replicas accumulate
    fewer micro-batches (job_flags), so it still steps on the same global batch."""
    name = VARIANTS.get(name, (name,))[0]
    path = REPO / "ds_configs" / f"{name}.json"
    if name in NATIVE or not path.is_file():
        return ranks
    from training.errors import ConfigError
    from training.settings import ds_config, parallel

    try:
        cfg = ds_config.load_json(path)
        model = ds_config.pipeline_stages(cfg) * parallel.tensor_size(cfg)
        model *= parallel.sequence_size(cfg)
    except (ConfigError, ValueError, TypeError):  # the run says what is wrong, in its own line
        return ranks
    return ranks if ranks % model == 0 else model * -(-ranks // model)


def run_engine(name: str, a, repeat: int = 0) -> dict:
    out = Path(a.runs) / (name if repeat == 0 else f"{name}.{repeat}")
    t = time.time()
    nproc = engine_ranks(name, a.ranks)
    flags = [*job_flags(a, replicas(name, nproc)), *engine_flags(name), "--out", str(out)]
    flags += VARIANTS.get(name, (name, []))[1]
    p = _torchrun(a, ["training/train.py", *flags], nproc=nproc)
    if p.returncode != 0:
        err = [x for x in (p.stderr + p.stdout).splitlines() if x.startswith("error: ")]
        reason = err[0][len("error: ") :] if err else f"exit {p.returncode}"
        if not err:
            print(p.stdout[-2000:], p.stderr[-4000:], file=sys.stderr)
        return {"name": name, "error": reason}
    return {**summarize(out, name), "ranks": nproc, "wall_s": time.time() - t}


def summarize(run_dir: Path, name: str) -> dict:
    """A finished run folder -> its row: speed, memory, model states, losses, loss curve."""
    recs = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["kind"] == "train"]
    timed = train[WARMUP_STEPS:] or train
    states = next((r for r in recs if r["kind"] == "state_bytes"), {})
    evals = [r for r in recs if r["kind"] == "eval"]
    resolved = json.loads((Path(run_dir) / "resolved_config.json").read_text())
    from training.memory.plan import planned_model_states

    return {
        "name": name,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "mfu": statistics.median(r["mfu"] for r in timed),
        "peak_mem_gb": max(r["peak_mem_gb"] for r in train),
        "states": {k[: -len("_bytes")]: v for k, v in states.items() if k.endswith("_bytes")},
        "planned_states": planned_model_states(resolved),
        "loss": train[-1]["loss"],
        "val_loss": evals[-1]["val_loss"] if evals else None,
        "curve": [(r["step"], r["loss"]) for r in train],
        "precision": resolved["precision"],
        "zero_stage": resolved["ds_config"].get("zero_optimization", {}).get("stage", 0),
        "n_params": resolved["n_params"],
        "ceiling": resolved["peak_flops_per_rank"],  # measured in this run, per rank
        "shm_collectives": resolved.get("shm_collectives", False),
        "batch_tokens": resolved["ds_config"]["train_batch_size"] * resolved["flags"]["seq_len"],
        "layout": layout_text(resolved.get("parallel") or {"data": resolved["world"]}),
        "grad_accum": resolved["ds_config"]["gradient_accumulation_steps"],
    }


def layout_text(parallel: dict) -> str:
    """`{"tensor": 2, "data": 1, ...}` -> "1 data x 2 tensor": how the run's ranks divide."""
    parts = [f"{parallel.get('data', 1)} data"]
    parts += [
        f"{parallel[k]} {k}" for k in ("tensor", "sequence", "pipeline") if parallel.get(k, 1) > 1
    ]
    return " x ".join(parts)


def run_reference(a, repeat: int = 0, name: str = "reference") -> dict:
    """The nanoGPT-style DDP loop on a.ranks ranks, or (`plain`) the same loop in one process
    with every core, the whole global batch in each micro-step, or (`hf_trainer`) the Hugging
    Face Trainer with DeepSpeed (peer_hf.py); `reference_sdpa` and `hf_stock` are the first and
    the last as people run them (SDPA attention; transformers' own Llama)."""
    out = Path(a.runs) / (f"{name}.json" if repeat == 0 else f"{name}.{repeat}.json")
    args = [*job_flags(a), "--out", str(out)]
    nproc = 1 if name == "plain" else a.ranks
    if name == "plain":
        args += ["--micro-batch", str(a.micro_batch * a.ranks)]  # the last flag wins
    if name == "reference_sdpa":
        args += ["--attention", "sdpa"]
    if name == "reference_compiled":
        args += ["--compile"]  # nanoGPT's default: compile = True
    if name in ("reference_fp32", "hf_trainer_fp32"):
        # as each runs on a CPU by default: nanoGPT's ctx is nullcontext there, the Trainer's
        # bf16 is False unless asked
        args += ["--precision", "fp32"]
    hf = ["-m", "benchmarks.peer_hf"]
    program = {"hf_trainer": hf, "hf_trainer_fp32": hf, "hf_stock": [*hf, "--stock"]}.get(
        name, ["-m", "benchmarks.compare.nanogpt_loop"]
    )
    p = _torchrun(a, [*program, *args], nproc=nproc)
    if p.returncode != 0:
        print(p.stdout[-2000:], p.stderr[-4000:], file=sys.stderr)
        return {"name": name, "error": f"exit {p.returncode}"}
    return {"name": name, **json.loads(out.read_text())}


def floor_ratio(run: dict, against: dict) -> tuple[float | None, list[float]]:
    """tokens/s of `run` over `against`. With repeats, the median of the per-round ratios: runs
    of one round follow each other within a minute, so they share the machine's mood, which on
    a shared host moves a run by 5-10% from one minute to the next (best-of is biased by it)."""
    xs, ys = run.get("all_tokens_per_s"), against.get("all_tokens_per_s")
    if xs and ys and len(xs) == len(ys) > 1:
        rounds = [x / y for x, y in zip(xs, ys)]
        return statistics.median(rounds), rounds
    x, y = run.get("tokens_per_s"), against.get("tokens_per_s")
    return (x / y if x and y else None), []


def over_rounds(repeats: list[dict]) -> dict:
    """One row from repeated runs of the same job: the numbers of the first, the median tokens/s,
    MFU and ceiling of the rounds, and the rounds' tokens/s (their spread is shown)."""
    ok = [r for r in repeats if "error" not in r]
    if not ok:
        return repeats[0]
    return {
        **ok[0],
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in ok),
        "mfu": statistics.median(r["mfu"] for r in ok),
        "ceiling": statistics.median(r.get("ceiling") or 0 for r in ok),
        "all_tokens_per_s": [r["tokens_per_s"] for r in ok],
    }
