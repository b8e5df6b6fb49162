"""The GPU check's JSON as a markdown table: one line per row with its result and figures.

python -m benchmarks.gpu_report gpu_check_out/gpu_check.json > gpu_check.md
"""

from __future__ import annotations

import json
import sys

COLUMNS = "| row | what ran | result | tokens/s | MFU | peak mem GB | wall s | note |"


def render(doc: dict) -> str:
    """gpu_check.json's document -> markdown: the device and versions, then the table."""
    env = doc.get("environment", {})
    versions = ", ".join(
        f"{k} {env[k]}" for k in ("torch", "deepspeed", "transformers", "python") if env.get(k)
    )
    lines = [
        f"# GPU check, {doc.get('date', '')}",
        "",
        f"Device: {env.get('device', '?')} ({env.get('gpus', 0)} GPU, {env.get('cpus', '?')} "
        f"cores); {versions}. Whole check {doc.get('wall_s', '?')} s of a {doc.get('budget_s', '?')} s budget.",
        "",
        f"`{doc.get('command', '')}`",
        "",
        COLUMNS,
        "|" + "---|" * (COLUMNS.count("|") - 1),
    ]
    lines += [table_line(r) for r in doc.get("rows", [])]
    return "\n".join(lines) + "\n"


def table_line(r: dict) -> str:
    result = {"ok": "ok", "failed": "**failed**"}.get(r["status"], r["status"])
    cells = [
        r["name"],
        r.get("what", ""),
        result,
        _num(r.get("tokens_per_s"), ",.0f"),
        _num(r.get("mfu"), ".1%"),
        _num(r.get("peak_mem_gb"), ".2f"),
        _num(r.get("wall_s"), ".0f"),
        note(r),
    ]
    return "| " + " | ".join(c.replace("|", "/") for c in cells) + " |"


def note(r: dict) -> str:
    """The reason a row failed or was skipped, else what its check found."""
    if r.get("reason"):
        return r["reason"]
    if "logits" in r:
        g = r["logits"]
        bf16 = f", bf16 {g['max_diff_bf16']:.2g}" if "max_diff_bf16" in g else ""
        return f"logits on {g['device']}: fp32 max diff {g['max_diff_fp32']:.2g}{bf16}"
    if "max_rel_loss_diff" in r:
        same = "bitwise equal" if r["bitwise"] else f"within {r['max_rel_loss_diff']:.1e}"
        return f"{r['steps']} steps' losses {same}; checkpoint files equal"
    if "final_loss" in r:
        return f"final loss {r['final_loss']:.3f}"
    return ""


def _num(x, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


if __name__ == "__main__":
    sys.stdout.write(render(json.loads(open(sys.argv[1]).read())))
