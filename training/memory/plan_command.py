"""`python -m training.memory_plan`: what one rank will hold for a model, a DeepSpeed config and
a world size, whether that fits the machine, and the cheapest shipped config that does.

    python -m training.memory_plan --model small --ds_config ds_configs/zero2.json --world 2
    python -m training.memory_plan --model 7B --ds_config ds_configs/zero3.json --world 16 \\
        --ranks-per-host 8 --device-mem 80 --host-mem 1000 --micro-batch 1 --seq-len 4096

How each number is counted: training/memory/plan.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from data import DataError, load_data
from models import ModelError, lora
from training.errors import ConfigError
from training.memory.capacity import Capacity, capacity, fits
from training.memory.fit import cheapest_fit, resolve_file, smallest_world
from training.memory.plan import CATEGORIES, LOCATIONS, Plan, fmt_bytes, plan
from training.memory.shape import model_shape
from training.settings.ds_config import CONFIG_DIR


def report(p: Plan, cap: Capacity) -> str:
    m = p.model
    lines = [
        f"model {m.name}: {m.params / 1e6:,.2f}M parameters (largest layer "
        f"{m.largest_layer / 1e6:,.2f}M) | {p.config}: ZeRO-{p.stage}, {p.precision} | "
        f"world {p.world}, {p.ranks_per_host} rank(s) per host | micro-batch {p.micro_batch} x "
        f"{p.seq_len} tokens{' | activation checkpointing' if p.activation_checkpointing else ''}",
        f"{'per rank':<22}{'device':>12}{'host':>12}{'nvme':>12}",
    ]
    names = {
        "params": "parameters",
        "grads": "gradients",
        "optimizer": "optimizer states",
        "buffers": "reduce buckets",
        "working": "working set (est.)",
        "heap": "heap slack (cpu)",
        "activations": "activations (est.)",
        "runtime": "runtime",
        "staging": "async-save copy",
    }
    for c in CATEGORIES:
        row = p.per_rank[c]
        if c == "staging" and not any(row.values()):
            continue  # no --async-save
        cells = "".join(f"{(fmt_bytes(row[loc]) if row[loc] else '-'):>12}" for loc in LOCATIONS)
        lines.append(f"  {names[c]:<20}{cells}")
    totals = "".join(f"{fmt_bytes(p.total(loc)):>12}" for loc in LOCATIONS)
    lines.append(f"  {'total':<20}{totals}")
    lines.append(
        f"  model states in memory (params + grads + optimizer + buckets): {fmt_bytes(p.model_states)}"
    )
    if p.deepspeed_estimate:
        e = p.deepspeed_estimate
        lines.append(
            f"DeepSpeed's {e['function']}: {fmt_bytes(e['device_bytes'])} per device, "
            f"{fmt_bytes(e['host_bytes'])} per host (model states only, 1.5x host buffer)"
        )
    ok, line = fits(p, cap)
    if cap.device_type == "cpu":
        line += " (on a CPU, device and host are one memory)"
    lines.append(f"{'fits' if ok else 'does NOT fit'} ({cap.device_type}): {line}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description="Per-rank memory for a model, a DeepSpeed config and a world size; whether it "
        "fits; the cheapest shipped config that fits."
    )
    ap.add_argument("--model", required=True, help="preset name or HF model folder")
    ap.add_argument("--ds_config", "--ds-config", default=str(CONFIG_DIR / "zero2.json"))
    ap.add_argument("--world", type=int, default=1, help="ranks in all")
    ap.add_argument("--ranks-per-host", type=int, default=None, help="default: all on one host")
    ap.add_argument("--data", default=None, help="a prepared data folder (its vocabulary)")
    ap.add_argument("--vocab-size", type=int, default=None)
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lora", default=None, help="the trainer's --lora spec: only adapters train")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument(
        "--device",
        default=None,
        help="cpu, or an accelerator such as cuda (default: this machine's); with another "
        "machine's accelerator give --device-mem",
    )
    ap.add_argument("--device-mem", type=float, default=None, help="GiB per device")
    ap.add_argument("--host-mem", type=float, default=None, help="GiB per host")
    ap.add_argument("--nvme-path", default=".", help="where swap files would go (free space)")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # --json keeps stdout for the JSON alone: DeepSpeed logs its warnings to stdout.
    with contextlib.redirect_stdout(sys.stderr) if a.json else contextlib.nullcontext():
        try:
            if a.world < 1:
                raise ConfigError(f"--world must be at least 1, got {a.world}")
            vocab = a.vocab_size or (load_data(a.data).vocab_size if a.data else None)
            shape = model_shape(a.model, vocab, a.lora and lora.parse_lora(a.lora))
            cap = capacity(a.device, a.device_mem, a.host_mem, a.nvme_path)
            rph = a.ranks_per_host or a.world
            cfg = resolve_file(
                a.ds_config, shape, a.world, a.micro_batch, cap.device_type, rph, cap.host_bytes
            )
        except (ConfigError, ModelError, DataError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        kw = dict(seq_len=a.seq_len, ranks_per_host=rph, device_type=cap.device_type)
        p = plan(
            shape,
            cfg,
            a.world,
            config_name=a.ds_config,
            activation_checkpointing=a.activation_checkpointing,
            **kw,
        )
        best = cheapest_fit(shape, a.world, cap, micro_batch=a.micro_batch, **kw)
        more = None if best is not None else smallest_world(shape, a.world, cap, a.micro_batch, kw)
    if a.json:
        print(json.dumps(_summary(p, cap, best or (more and more[1])), indent=1))
        return 0
    print(report(p, cap))
    if best is not None:
        extra = " with --activation-checkpointing" if best.activation_checkpointing else ""
        same = Path(best.config).name == Path(a.ds_config).name
        print(f"cheapest config that fits: {best.config}{extra}" + (" (this one)" if same else ""))
    elif more is not None:
        print(
            f"no shipped config fits {a.world} rank(s); {more[1].config} fits from {more[0]} "
            f"ranks ({rph} per host)"
        )
    else:
        print(f"no shipped config fits even {2**12} ranks; shrink --micro-batch or --seq-len")
    return 0


def _summary(p: Plan, cap: Capacity, fit: Plan | None) -> dict:
    """What --json prints."""
    return {
        **asdict(p),
        "model_states_bytes": p.model_states,
        "total_bytes": {loc: p.total(loc) for loc in LOCATIONS},
        "capacity": asdict(cap),
        "fits": fits(p, cap)[0],
        "cheapest_fit": fit
        and {
            "config": fit.config,
            "activation_checkpointing": fit.activation_checkpointing,
            "world": fit.world,
        },
    }
