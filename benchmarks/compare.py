"""One short job under every engine: DDP, FSDP2 and each ds_config, compared on the same work.

    python -m benchmarks.compare                      # the default job: `small` on pystdlib
    python -m benchmarks.compare --steps 10 --engines ddp,fsdp,zero2 --out /tmp/cmp

Every engine trains the same preset on the same data with the same global batch, steps, seed and
schedule, each as a real multi-rank run of training/train.py under torchrun. A few-line
nanoGPT-style DDP loop of the same model (`reference`, below, uncompiled; `reference_compiled`
is the same loop under torch.compile, as nanoGPT's train.py runs by default) runs beside them as
the speed reference. Writes OUT/comparison.md (tokens/s, MFU, peak memory per rank, model-state bytes per
rank, final train and validation loss, and ZeRO-2 in bf16 against fp32), OUT/comparison_memory.png
and OUT/comparison_loss.png, and every round's raw figures with the host (its class, cores and
load) to benchmarks/results/compare_MODEL.json (--results). Timings are medians over the steps
after warm-up, then the median of the rounds (--repeats), shown with their spread; other jobs on
the machine move them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.provenance import busy_cpu_seconds
from launch.command import launcher_command
from training.runtime.distributed import free_port

REPO = Path(__file__).resolve().parent.parent

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
    # issue 17's goals for ZeRO-2 against the loops people run today (the peer workload)
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
# `--peer`: the workload of the peer comparison (issue 17): a 16.9M Llama (`small` with 6
# layers), sequence 256, micro-batch 8 per rank, no accumulation, 2 ranks x 1 thread, bf16;
# the four engines, the plain one-process loop, the nanoGPT-style loop and the HF Trainer with
# DeepSpeed (each also as people run it), alternated round by round.
PEER = {
    "model": "small",
    "layers": 6,
    "micro_batch": 8,
    "grad_accum": 1,
    "steps": 10,
    "repeats": 2,
    "engines": "zero2,ddp,fsdp,zero3,zero2_eager",
    "no_reference": False,
    "hf_trainer": True,
    "stock_peers": True,
    "plain": True,
    "section": "docs/benchmarks.md",
    "out": "runs/compare_peer",
}
SECTION = "## Engines side by side, against the ceiling measured in the same run"


def ds_config_names() -> list[str]:
    return sorted(p.stem for p in (REPO / "ds_configs").glob("*.json"))


def _torchrun(
    a, script: str, args: list[str], nproc: int = 0, env: dict | None = None
) -> subprocess.CompletedProcess:
    cmd = launcher_command("torchrun", nproc or a.ranks, [script, *args], port=free_port())
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)


# ------------------------------------------------------------------------------ the runs
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


def run_engine(name: str, a, repeat: int = 0) -> dict:
    out = Path(a.runs) / (name if repeat == 0 else f"{name}.{repeat}")
    t = time.time()
    flags = [*job_flags(a, replicas(name, a.ranks)), *engine_flags(name), "--out", str(out)]
    flags += VARIANTS.get(name, (name, []))[1]
    p = _torchrun(a, "training/train.py", flags)
    if p.returncode != 0:
        err = [x for x in (p.stderr + p.stdout).splitlines() if x.startswith("error: ")]
        reason = err[0][len("error: ") :] if err else f"exit {p.returncode}"
        if not err:
            print(p.stdout[-2000:], p.stderr[-4000:], file=sys.stderr)
        return {"name": name, "error": reason}
    return {**summarize(out, name), "wall_s": time.time() - t}


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


# ------------------------------------------------------------------------------ reference
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
    hf = {"hf_trainer": "--hf-trainer-rank", "hf_trainer_fp32": "--hf-trainer-rank"}
    entry = {**hf, "hf_stock": "--hf-stock-rank"}.get(name, "--reference")
    p = _torchrun(a, str(Path(__file__).resolve()), [entry, *args], nproc=nproc)
    if p.returncode != 0:
        print(p.stdout[-2000:], p.stderr[-4000:], file=sys.stderr)
        return {"name": name, "error": f"exit {p.returncode}"}
    return {"name": name, **json.loads(out.read_text())}


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
    from training.settings.flags import Settings
    from training.settings.hparams import DEFAULTS

    s = Settings.parse(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # as the trainer does
    torch.manual_seed(s.seed)
    model = build_model(s.model, vocab_size=load_manifest(s.data).vocab_size)
    # the attention kernel the trainer picks, so the ratio measures the engines alone
    set_attention_kernel(model, pick_attention_kernel(s.attention, "cpu", s.seq_len))
    # The ceiling of this run, measured as the trainer measures its own (runtime/flops.py).
    shapes = model_shapes(model.config, s.micro_batch * s.seq_len)
    low = s.precision != "fp32"  # bf16 autocast unless fp32 is asked
    dtype = torch.bfloat16 if low else torch.float32
    ceiling = run_ceiling(torch.device("cpu"), dtype, shapes).per_rank
    if s.compile:  # nanoGPT: model = torch.compile(model), then DDP(model)
        model = torch.compile(model)
    ddp = DDP(model)
    decay = DEFAULTS["weight_decay"] if s.weight_decay is None else s.weight_decay
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=decay, fused=True)
    data = TokenDataset(s.data, "train", s.seq_len)
    loader = BatchLoader(data, s.micro_batch, rank, world, s.seed)
    times = []
    for _ in range(s.steps):
        t = time.perf_counter()
        for micro in range(s.grad_accum):
            x, y = loader.next_batch()
            ddp.require_backward_grad_sync = micro == s.grad_accum - 1
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=low):
                loss = ddp(input_ids=x, labels=y, shift_labels=y).loss / s.grad_accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # nanoGPT prints it every step
        times.append(time.perf_counter() - t)
    # A probe taken in one of the host's slow spells reads low (an MFU of 140% was seen):
    # the higher of the start's and the end's, as the trainer raises its own (loop/loop.py).
    ceiling = max(ceiling, run_ceiling(torch.device("cpu"), dtype, shapes).per_rank)
    tokens = s.micro_batch * s.grad_accum * world * s.seq_len
    tps = statistics.median(tokens / t for t in times[WARMUP_STEPS:] or times)
    fpt = flops_per_token(
        model.config, s.seq_len, n_params=sum(p.numel() for p in model.parameters())
    )
    peak = ceiling * world
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0])
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if rank == 0:
        row = {"tokens_per_s": tps, "mfu": tps * fpt / peak, "peak_mem_gb": rss.item() / 2**30}
        row.update(ceiling=ceiling, precision="bf16" if low else "fp32", compiled=bool(s.compile))
        Path(s.out).write_text(json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()


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


def spread(r: dict) -> str:
    """The rounds' tokens/s as "min-max", or "" for one round."""
    xs = r.get("all_tokens_per_s") or []
    return f"{min(xs):,.0f}-{max(xs):,.0f}" if len(xs) > 1 else ""


def save_raw(results: dict[str, list[dict]], rows: list[dict], a, host: dict, path: Path) -> None:
    """Every round of every run, the rows drawn from them and the host, as JSON: the table can
    be checked and redrawn from it."""
    from benchmarks.provenance import code_record

    keep = [{k: v for k, v in r.items() if k != "curve"} for r in rows]
    rounds = {
        n: [{k: v for k, v in r.items() if k != "curve"} for r in rs] for n, rs in results.items()
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "command": " ".join(["python -m benchmarks.compare", *a.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "host": host,
        "code": code_record(),
        "data": Path(a.data).name,
        "job": {
            k: getattr(a, k)
            for k in (
                "model",
                "layers",
                "seq_len",
                "micro_batch",
                "grad_accum",
                "steps",
                "ranks",
                "repeats",
                "seed",
            )
        },
        "rows": keep,
        "rounds": rounds,
    }
    path.write_text(json.dumps(doc, indent=1))


# ------------------------------------------------------------------------------ the report
def machine() -> str:
    import deepspeed
    import torch

    from benchmarks.host import accelerators, host_class

    versions = f"torch {torch.__version__}, deepspeed {deepspeed.__version__}"
    gpus = accelerators()
    if gpus:
        return f"{gpus}, {versions}"
    return f"{host_class()}, {os.cpu_count()} cores, no GPU (gloo), {versions}"


def _mib(b) -> str:
    return "" if b is None else f"{b / 2**20:,.1f}"


def write_report(rows: list[dict], a, out_dir: Path) -> Path:
    """comparison.md and the two PNGs into out_dir; returns the markdown's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    by = {r["name"]: r for r in rows}
    done = [r for r in rows if "error" not in r and r["name"] not in LOOPS]
    first = done[0] if done else {}
    ddp = by.get("ddp", {}).get("tokens_per_s")
    cmd = " ".join(["python -m benchmarks.compare", *getattr(a, "argv", [])])
    lines = [
        "# DDP, FSDP2 and DeepSpeed on the same work",
        "",
        f"Made by `{cmd}` on {machine()}, {time.strftime('%Y-%m-%d')}.",
        "",
        f"The job: model `{a.model}` ({first.get('n_params', 0) / 1e6:.1f}M parameters; its "
        "initial weights are made once from the seed and loaded by every run), data "
        f"`{Path(a.data).name}`, sequence {a.seq_len}, global batch {a.micro_batch} x "
        f"{a.grad_accum} accumulation x {a.ranks} ranks = {first.get('batch_tokens', 0):,} "
        f"tokens per step, {a.steps} steps, seed {a.seed}, the same schedule for all. Every row "
        f"is a real {a.ranks}-rank run of `training/train.py`; the reference is a few-line "
        "nanoGPT-style DDP loop of the same model (`benchmarks/compare.py: reference`). "
        "A run with fewer data-parallel replicas than ranks (tensor, sequence or pipeline "
        "parallel: replicas = world / (tp x sp x pp)) accumulates proportionally more "
        "micro-batches, so every row steps on the same global batch (the `ranks` column).",
        "",
        f"Tokens/s is the median over steps {WARMUP_STEPS + 1}-{a.steps}"
        + (
            f", then the median of {a.repeats} rounds of each (run round-robin; the rounds' "
            "spread beside it)"
            if a.repeats > 1
            else ", one round"
        )
        + "; MFU is against the "
        "matmul ceiling each run measured for itself at its start (all ranks at once, on the "
        "model's matmul shapes: `training/runtime/flops.py`), summed over ranks. Peak "
        "memory is the fullest rank's peak RSS on a CPU (max allocated on a GPU): it includes "
        "the Python, torch and DeepSpeed runtime, so model states show better in their own "
        "columns. Timings of the same command move by about 5% between runs, even on an idle "
        "machine: `--repeats N` takes the median of N rounds."
        + (
            " The DeepSpeed and FSDP2 rows gather and reduce through DeepSpeed's shared-memory "
            "kernel (every rank on one host; `--shm-collectives off` sends them to gloo); "
            "DDP through gloo."
            if any(r.get("shm_collectives") for r in done)
            else ""
        ),
        "",
        "| engine | precision | ranks | tokens/s | spread | vs DDP | MFU | peak memory / rank (GiB) | "
        "params | grads | optimizer | buffers | model states / rank (MiB) | planned (MiB) | "
        "train loss | val loss |",
        "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        label = _label(r["name"])
        if "error" in r:
            lines.append(f"| {label} | | | not run: {r['error']} |" + " |" * 12)
            continue
        st = r.get("states", {})
        vs = f"{r['tokens_per_s'] / ddp:.2f}x" if ddp else ""
        ranks = r.get("layout", "") + (f", {r['grad_accum']} accum" if "grad_accum" in r else "")
        lines.append(
            f"| {label} | {r.get('precision', 'bf16')} | {ranks} | {r['tokens_per_s']:,.0f} | "
            f"{spread(r)} | {vs} | "
            f"{r['mfu']:.1%} | {r['peak_mem_gb']:.2f} | {_mib(st.get('params'))} | "
            f"{_mib(st.get('grads'))} | {_mib(st.get('optimizer'))} | "
            f"{_mib(st.get('buffers'))} | {_mib(st.get('total'))} | "
            f"{_mib(r.get('planned_states'))} | "
            + (f"{r['loss']:.4f} | " if "loss" in r else " | ")
            + (f"{r['val_loss']:.4f} |" if r.get("val_loss") is not None else " |")
        )
    lines += ["", "Speed floors, measured in the same run:", ""]
    for run, against, floor in FLOORS:
        ratio, rounds = floor_ratio(by.get(run, {}), by.get(against, {}))
        if ratio:
            verdict = "holds" if ratio >= floor else "MISSED"
            each = f"; each round: {', '.join(f'{r:.3f}' for r in rounds)}" if rounds else ""
            lines.append(
                f"- {_label(run)} / {_label(against)} = {ratio:.3f} (floor {floor}{each}): "
                f"{verdict}"
            )
    bf, fp = by.get("zero2"), by.get("fp32")
    if bf and fp and "error" not in bf and "error" not in fp:
        lines += [
            "",
            "bf16 against fp32, both ZeRO-2 (`zero2.json`, `fp32.json`):",
            "",
            "| precision | tokens/s | model states / rank (MiB) | train loss | val loss |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in (bf, fp):
            lines.append(
                f"| {r['precision']} | {r['tokens_per_s']:,.0f} | "
                f"{_mib(r['states'].get('total'))} | {r['loss']:.4f} | {r['val_loss']:.4f} |"
            )
        lines += [
            "",
            f"bf16 runs {bf['tokens_per_s'] / fp['tokens_per_s']:.2f}x the tokens/s of fp32; "
            f"its final validation loss differs by {bf['val_loss'] - fp['val_loss']:+.4f}.",
        ]
    lines += [
        "",
        "## How model states are counted",
        "",
        "`training/memory/state_bytes.py` walks what each engine holds on a rank: the model's parameters "
        "and their gradients, and every tensor reachable from the optimizer object (for "
        "DeepSpeed its flat bf16/fp32 partitions, gradient partitions and buckets; for FSDP2 "
        "the DTensor shards). Each storage is counted once by its size, so views into a flat "
        "buffer are not double-counted. Storages behind parameters are `params`, behind "
        "gradients `grads`, reduction buckets `buffers`, the rest (fp32 master weights, Adam's "
        "moments) `optimizer`. The training loop counts once per run, after the first "
        "micro-batch's backward of the second step (optimizer states exist; gradients are held "
        "as they accumulate), and logs the fullest rank (`kind: state_bytes` in metrics.jsonl). "
        "With N parameters on 2 ranks, theory says: DDP 4N + 4N + 8N bytes (fp32 weights, "
        "grads, Adam); ZeRO-0 2N + 2N + 12N (bf16 weights and grads, fp32 master + Adam); "
        "ZeRO-1 halves the 12N, ZeRO-2 also the grads, ZeRO-3 also the weights; FSDP2 halves "
        "all of DDP's. The offload configs keep their optimizer states in host memory (the same "
        "memory on a CPU-only machine) and add fp32 gradient partitions for the CPU optimizer. "
        "`planned` is what `python -m training.memory_plan` expects for the same model, config "
        "and world before anything runs (tests/test_memory_plan.py holds it within 2% of the "
        "count for ZeRO 0-3, 12% for ZeRO-2 with CPU offload).",
        "",
        "![model states and peak memory per rank](comparison_memory.png)",
        "",
        "![loss curves](comparison_loss.png)",
        "",
    ]
    md = out_dir / "comparison.md"
    md.write_text("\n".join(lines))
    plot_memory(done, out_dir / "comparison_memory.png")
    plot_loss(done, out_dir / "comparison_loss.png")
    return md


def _label(name: str) -> str:
    return {
        "ddp": "DDP",
        "fsdp": "FSDP2",
        "reference": "nanoGPT-style DDP, uncompiled (reference)",
        "reference_compiled": "nanoGPT-style DDP, torch.compile (nanoGPT's default)",
        "plain": "plain loop (1 process, all cores)",
        "hf_trainer": "HF Trainer + DeepSpeed `zero2` (peer)",
        "reference_sdpa": "nanoGPT-style DDP, SDPA attention (as people run it)",
        "reference_fp32": "nanoGPT-style DDP in fp32, uncompiled",
        "hf_trainer_fp32": "HF Trainer + DeepSpeed ZeRO-2 in fp32 (its default, bf16=False)",
        "hf_stock": "HF Trainer + DeepSpeed `zero2`, transformers' Llama (as people run it)",
        "fsdp_shard": "FSDP2, sharded across micro-steps",
        "zero3_shard": "DeepSpeed `zero3`, sharded across micro-steps",
        "zero2_mean": "DeepSpeed `zero2`, dividing every bucket by the world",
        "zero2_eager": "DeepSpeed `zero2`, blocks not compiled",
        "zero3_eager": "DeepSpeed `zero3`, blocks not compiled",
        "ddp_eager": "DDP, blocks not compiled",
        "zero3_gloo": "DeepSpeed `zero3`, every collective on gloo",
        "fsdp_gloo": "FSDP2, every collective on gloo",
        "ddp_fp32": "DDP, --precision fp32",
        "ddp_bf16": "DDP, --precision bf16",
        "zero2_fp32": "DeepSpeed `zero2`, --precision fp32",
        "zero2_bf16": "DeepSpeed `zero2`, --precision bf16",
    }.get(name, f"DeepSpeed `{name}`")


def write_section(rows: list[dict], a, path: Path) -> str:
    """The speed table as a section of `path` (SECTION, replaced when there, else appended):
    tokens/s, the ratios, and MFU against the ceiling each run measured for itself."""
    by = {r["name"]: r for r in rows}
    ddp = by.get("ddp", {}).get("tokens_per_s")
    cmd = " ".join(["python -m benchmarks.compare", *getattr(a, "argv", [])])
    lines = [
        SECTION,
        "",
        f"`{cmd}` on {machine()}, {time.strftime('%Y-%m-%d')}: model `{a.model}`"
        + (f" with {a.layers} layers" if a.layers else "")
        + f", sequence {a.seq_len}, micro-batch {a.micro_batch} x {a.grad_accum} accumulation "
        f"x {a.ranks} ranks x 1 thread, bf16, {a.steps} steps, {a.repeats} rounds run "
        "round-robin. Tokens/s: the median of the rounds' medians over the steps after warm-up "
        "(the rounds' spread beside it). MFU is "
        "against the bf16 matmul ceiling each run measured for itself at its start, on all "
        "ranks at once, on the model's matmul shapes (`training/runtime/flops.py`), shown "
        "beside it; absolute numbers move with the host, the ratios of one run do not.",
        "",
        "| run | tokens/s | spread | vs DDP | MFU | against (GFLOP/s per rank) |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {_label(r['name'])} | not run: {r['error']} | | | | |")
            continue
        vs = f"{r['tokens_per_s'] / ddp:.2f}x" if ddp else ""
        lines.append(
            f"| {_label(r['name'])} | {r['tokens_per_s']:,.0f} | {spread(r)} | {vs} | "
            f"{r['mfu']:.1%} | "
            f"{r.get('ceiling', 0) / 1e9:,.0f} |"
        )
    lines += ["", "Ratios, the median of each round's (runs of one round follow each other):", ""]
    for run, against, floor in FLOORS:
        ratio, rounds = floor_ratio(by.get(run, {}), by.get(against, {}))
        if ratio:
            each = ", ".join(f"{x:.3f}" for x in rounds)
            verdict = "holds" if ratio >= floor else "MISSED"
            lines.append(
                f"- {_label(run)} / {_label(against)} = {ratio:.3f} (floor {floor}"
                + (f"; rounds {each}" if each else "")
                + f"): {verdict}"
            )
    section = "\n".join(lines) + "\n"
    text = path.read_text() if path.is_file() else ""
    start = text.find(SECTION)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + len(SECTION))
        text = text[:start] + section + ("\n" + text[end + 1 :] if end >= 0 else "")
    path.write_text(text)
    return section


def plot_memory(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), dpi=100)
    bottom = [0.0] * len(rows)
    for part in ("params", "grads", "optimizer", "buffers"):
        vals = [r.get("states", {}).get(part, 0) / 2**20 for r in rows]
        ax1.bar(names, vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax1.set_ylabel("MiB per rank")
    ax1.set_title("model states per rank")
    ax1.legend()
    ax2.bar(names, [r["peak_mem_gb"] for r in rows], color="gray")
    ax2.set_ylabel("GiB")
    ax2.set_title("peak memory per rank (RSS on CPU)")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=45)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_loss(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for r in rows:
        ax.plot(*zip(*r["curve"]), label=f"{r['name']} ({r['precision']})", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _flags_worth_showing(argv: list[str]) -> list[str]:
    """argv without the flags that only say where files live (for the report's command)."""
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x in ("--out", "--runs", "--data"):
            skip = True
        elif not x.startswith(("--out=", "--runs=", "--data=")):
            out.append(x)
    return out


# ------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--reference"]:  # one rank of the reference loop, under torchrun
        reference(argv[1:])
        return 0
    if argv[:1] in (["--hf-trainer-rank"], ["--hf-stock-rank"]):  # one rank of an HF Trainer peer
        from benchmarks import peer_hf

        peer_hf.run(argv[1:], WARMUP_STEPS, stock=argv[0] == "--hf-stock-rank")
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default="data_cache/pystdlib", help="prepared data (made if absent)")
    p.add_argument("--model", default="small")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--eval-samples", type=int, default=32)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument(
        "--engines",
        default=",".join(NATIVE + ds_config_names()),
        help="comma-separated: ddp, fsdp, ds_configs names, and the variants fsdp_shard and "
        "zero3_shard (--hold-weights off), zero2_mean (--grad-sum off), zero2_eager, "
        "zero3_eager and ddp_eager (--no-compile), zero3_gloo and fsdp_gloo "
        "(--shm-collectives off), zero2_fp32, zero2_bf16, ddp_fp32 and ddp_bf16 (--precision), "
        "and the loops by name (reference_compiled: nanoGPT's default torch.compile; "
        "reference_fp32: nanoGPT's fp32 on a CPU) (default: all but the variants)",
    )
    p.add_argument("--no-reference", action="store_true", help="skip the nanoGPT-style loop")
    p.add_argument(
        "--repeats", type=int, default=1, help="run everything N times, take the median tokens/s"
    )
    p.add_argument(
        "--results",
        default="",
        help="the raw rounds as JSON (default: benchmarks/results/compare_MODEL[LAYERS].json)",
    )
    p.add_argument("--out", default="docs", help="where comparison.md and the PNGs go")
    p.add_argument("--runs", default="runs/compare", help="where the runs' folders go")
    p.add_argument("--layers", type=int, default=0, help="override the preset's layer count")
    p.add_argument("--plain", action="store_true", help="add the loop in one process, all cores")
    p.add_argument(
        "--hf-trainer",
        action="store_true",
        help="add the Hugging Face Trainer with DeepSpeed ZeRO-2 on the same job "
        "(benchmarks/peer_hf.py)",
    )
    p.add_argument(
        "--stock-peers",
        action="store_true",
        help="add the peers as people run them: the nanoGPT-style loop with SDPA attention and "
        "the HF Trainer with DeepSpeed on transformers' own Llama",
    )
    p.add_argument("--section", default="", help="also write the speed table into this markdown")
    p.add_argument(
        "--peer",
        action="store_true",
        help="the peer workload: ZeRO-2/DDP/FSDP2/ZeRO-3, the plain loop, the nanoGPT-style "
        "loop and the HF Trainer with DeepSpeed (also as people run them: --stock-peers), "
        "`small` with 6 layers, micro-batch 8, no "
        "accumulation, 2 rounds, the table into docs/benchmarks.md (explicit flags still win)",
    )
    if "--peer" in argv:
        p.set_defaults(**PEER)
    a = p.parse_args(argv)
    a.argv = _flags_worth_showing(argv)
    if a.steps <= WARMUP_STEPS:
        print(f"error: --steps must be more than {WARMUP_STEPS} (the warm-up)", file=sys.stderr)
        return 2
    known = NATIVE + list(VARIANTS) + ds_config_names() + list(LOOPS)
    unknown = set(a.engines.split(",")) - set(known)
    if unknown:
        print(
            f"error: unknown engines {sorted(unknown)}; choose from ddp, fsdp, "
            f"{', '.join(ds_config_names())}",
            file=sys.stderr,
        )
        return 2
    if not (Path(a.data) / "manifest.json").is_file():
        from data import prepare

        print(f"preparing the built-in corpus into {a.data} (once)", flush=True)
        prepare("pystdlib", a.data, num_proc=os.cpu_count() or 1)
    Path(a.runs).mkdir(parents=True, exist_ok=True)
    a.init = initial_weights(a)

    names = ([] if a.no_reference else ["reference"]) + (["plain"] if a.plain else [])
    names += ["hf_trainer"] if a.hf_trainer else []
    names += ["reference_sdpa", "reference_compiled", "hf_stock"] if a.stock_peers else []
    names = list(dict.fromkeys(names + a.engines.split(",")))  # a loop may be named twice
    results: dict[str, list[dict]] = {name: [] for name in names}
    # The floors' runs go first and back to back: the host's speed drifts over minutes, and a
    # ratio is only as good as the closeness in time of its two runs.
    paired = [n for run, against, _ in FLOORS for n in (against, run) if n in names]
    paired = list(dict.fromkeys(paired))  # reference, ddp, zero2
    order = paired + [n for n in names if n not in paired]
    from benchmarks.provenance import host_record

    host = {**host_record(), "busy_cpu_s_before": busy_cpu_seconds()}
    t0 = time.time()
    for repeat in range(a.repeats):  # round-robin, so a busy spell does not hit one engine only
        for name in order:
            if results[name] and "error" in results[name][0]:
                continue  # refused or failed: once is enough
            print(f"running {name} ({repeat + 1}/{a.repeats}) ...", flush=True)
            if name in LOOPS:
                results[name].append(run_reference(a, repeat, name))
            else:
                results[name].append(run_engine(name, a, repeat))
    rows = [over_rounds(results[name]) for name in names]
    wall = time.time() - t0
    host.update(loadavg_after=list(os.getloadavg()), wall_s=wall)
    host["busy_cores"] = (busy_cpu_seconds() - host.pop("busy_cpu_s_before")) / wall
    raw = Path(
        a.results or REPO / "benchmarks" / "results" / f"compare_{a.model}{a.layers or ''}.json"
    )
    save_raw(results, rows, a, host, raw)
    print(f"raw rounds: {raw}", flush=True)
    if rows and rows[0]["name"] == "reference":
        print(f"reference: {rows[0]}", flush=True)
    md = write_report(rows, a, Path(a.out))
    print(md.read_text())
    if a.section:
        print(write_section(rows, a, Path(a.section)))
    return 0


if __name__ == "__main__":
    code = main()
    from training.runtime import distributed

    distributed.exit_process(code)
