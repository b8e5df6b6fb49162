"""What `python -m benchmarks.compare` writes: comparison.md and its two pictures, the speed
table's lines for docs/benchmarks.md (drawn by benchmarks/docs_tables.py from the raw JSON), and
every round's raw figures as JSON."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from benchmarks.compare.runs import FLOORS, LOOPS, WARMUP_STEPS, floor_ratio


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
    lines = _report_intro(a, done)
    lines += _engine_table(rows, by.get("ddp", {}).get("tokens_per_s"))
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
    lines += _precision_table(by.get("zero2"), by.get("fp32"))
    lines += STATES_NOTE
    md = out_dir / "comparison.md"
    md.write_text("\n".join(lines))
    plot_memory(done, out_dir / "comparison_memory.png")
    plot_loss(done, out_dir / "comparison_loss.png")
    return md


def _report_intro(a, done: list[dict]) -> list[str]:
    """The report's title, the command and machine, and what the job and each column are."""
    first = done[0] if done else {}
    cmd = " ".join(["python -m benchmarks.compare", *getattr(a, "argv", [])])
    return [
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
        "nanoGPT-style DDP loop of the same model (`benchmarks/compare/nanogpt_loop.py`). "
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
    ]


def _engine_table(rows: list[dict], ddp: float | None) -> list[str]:
    """One line per row: speed, memory, model states against the plan, losses."""
    lines = [
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
    return lines


def _precision_table(bf: dict | None, fp: dict | None) -> list[str]:
    """ZeRO-2 in bf16 against fp32 (`zero2.json`, `fp32.json`), when both ran."""
    if not (bf and fp and "error" not in bf and "error" not in fp):
        return []
    lines = [
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
    return lines


# How the model-state columns are counted, and what the plan beside them is.
STATES_NOTE = [
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


def section_body(
    rows: list[dict], cmd: str, machine: str, date: str, job: dict, where: str
) -> list[str]:
    """The speed table's lines from a run's rows (live, or a raw JSON's `rows`): tokens/s, the
    ratios against the floors, and MFU against the ceiling each run measured for itself."""
    by = {r["name"]: r for r in rows}
    ddp = by.get("ddp", {}).get("tokens_per_s")
    lines = [
        f"`{cmd}` on {machine}, {date}: model `{job['model']}`"
        + (f" with {job['layers']} layers" if job.get("layers") else "")
        + f", sequence {job['seq_len']}, micro-batch {job['micro_batch']} x "
        f"{job['grad_accum']} accumulation x {job['ranks']} ranks x 1 thread, bf16, "
        f"{job['steps']} steps, {job['repeats']} rounds run "
        "round-robin. Tokens/s: the median of the rounds' medians over the steps after warm-up "
        "(the rounds' spread beside it). MFU is "
        "against the bf16 matmul ceiling each run measured for itself at its start, on all "
        "ranks at once, on the model's matmul shapes (`training/runtime/flops.py`), shown "
        "beside it; absolute numbers move with the host, the ratios of one run do not.",
        "",
        "| run | tokens/s | spread | vs DDP | MFU | against (GFLOP/s per rank) | host, date |",
        "|---|---:|---|---:|---:|---:|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {_label(r['name'])} | not run: {r['error']} | | | | | {where} |")
            continue
        vs = f"{r['tokens_per_s'] / ddp:.2f}x" if ddp else ""
        lines.append(
            f"| {_label(r['name'])} | {r['tokens_per_s']:,.0f} | {spread(r)} | {vs} | "
            f"{r['mfu']:.1%} | "
            f"{r.get('ceiling', 0) / 1e9:,.0f} | {where} |"
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
    return lines


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
