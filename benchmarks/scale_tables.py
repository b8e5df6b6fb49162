"""docs/scale.md's disk arithmetic, drawn from benchmarks/results/scale.json: for each ZeRO-Infinity
(`zero3_nvme`) row that trained, the bytes its training states take by arithmetic (18 bytes a
parameter) beside what the row measured on disk: the NVMe swap, the checkpoint, the universal
copy and the fp32 export."""

from __future__ import annotations

import json
import re
from pathlib import Path

GiB = 2**30
STATE_BYTES = 18  # bf16 weights 2 + fp32 master 4 + Adam moments 8 + fp32 gradients 4
BF16_GRAD_STATE_BYTES = 16  # the same with bf16 gradients


def _gib(b) -> str:
    return "-" if not b else f"{b / GiB:.1f} GiB"


def _host_memory(row: dict) -> float | None:
    """The host memory (bytes) the row's plan was made against, as its verdict states it."""
    m = re.search(r"host memory: needs .*? of ([0-9.]+) GiB", row["plan"].get("needs") or "")
    return float(m.group(1)) * GiB if m else None


def disk_arithmetic(results: Path) -> str:
    """The disk table and its note from `results`/scale.json."""
    rows = json.loads((results / "scale.json").read_text()).values()
    rows = sorted(
        (r for r in rows if r["config"] == "zero3_nvme" and r.get("train")),
        key=lambda r: r["plan"]["params"],
    )
    if not rows:
        return "No `zero3_nvme` row in scale.json yet: `python -m benchmarks.scale` adds them."
    vocab = ", ".join(sorted({str(r["vocab"]) for r in rows}))
    lines = [
        f"| model | parameters (vocab {vocab}) | training states ({STATE_BYTES} B/param) | NVMe "
        "swap, measured | checkpoint, measured | universal copy, measured | fp32 export, "
        "measured |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        n, mem = r["plan"]["params"], _host_memory(r)
        states = STATE_BYTES * n
        against = f" ({states / mem:.2f}x memory)" if mem else ""
        t = r["train"]
        lines.append(
            f"| {r['preset']} ({r['ranks']} ranks) | {n / 1e9:.2f}B | {_gib(states)}{against} "
            f"| {_gib(t.get('nvme_peak_bytes'))} | {_gib(t.get('checkpoint_bytes'))} "
            f"| {_gib((r.get('universal') or {}).get('bytes'))} "
            f"| {_gib((r.get('export') or {}).get('bytes'))} |"
        )
    big = rows[-1]
    n, mem, disk = big["plan"]["params"], _host_memory(big), big.get("disk") or {}
    bf16 = BF16_GRAD_STATE_BYTES * n
    note = []
    if mem:
        note.append(
            f"(Memory: {mem / GiB:.1f} GiB. Counting bf16 gradients instead, "
            f"{BF16_GRAD_STATE_BYTES} bytes a parameter, {big['preset']}'s states are "
            f"{bf16 / GiB:.1f} GiB, {bf16 / mem:.2f}x.)"
        )
    if disk.get("free"):
        both = disk["swap"] + disk["checkpoint_estimate"]
        note.append(
            f"The checkpoint is written while the swap is still there: at {big['preset']} that is "
            f"{both / GiB:.1f} GiB of the {disk['free'] / GiB:.1f} GiB free when the row ran "
            "(`benchmarks/scale.py` checks it first and trains without a checkpoint when the two "
            "would not fit)."
        )
    universal = (big.get("universal") or {}).get("bytes")
    note.append(
        "The swap is removed at the run's clean exit, so the universal conversion"
        + (f" ({_gib(universal)} beside the checkpoint)" if universal else "")
        + " and the export then have its room."
    )
    return "\n".join(lines) + "\n\n" + " ".join(note)
