"""The GPU check's JSON as a markdown table: one line per row with its result and figures;
and docs/gpu.md's table of the last device's check, drawn from its raw files.

python -m benchmarks.gpu_report gpu_check_out/gpu_check.json > gpu_check.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

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
        if r["bitwise"]:
            return f"{r['steps']} steps' losses bitwise equal; checkpoint files equal"
        judged = r.get("judged_steps", r["steps"])
        later = r.get("max_rel_loss_diff_later")
        rest = f", all {r['steps']} within {later:.1e}" if later is not None else ""
        return (
            f"{judged} steps' losses within {r['max_rel_loss_diff']:.1e}{rest}; "
            "checkpoint files equal"
        )
    if "profile" in r:
        g = dict(r["profile"])
        step = g.pop("step_s")
        shares = ", ".join(f"{k} {v:.0%}" for k, v in g.items())
        return f"{step * 1000:.0f} ms a profiled step; {shares}"
    if "final_loss" in r:
        return f"final loss {r['final_loss']:.3f}"
    return ""


def section(results: Path) -> str:
    """docs/gpu.md's table: the newest folder under results/gpu/, whose files are the device's
    runs of the check in order (NAME.json); each row as its first run that succeeded, else its
    last try, with the file it came from: a row rerun after a fix shows the rerun and names it."""
    folders = sorted(results.glob("gpu/*/"), key=lambda f: _doc(f, 0).get("date", ""))
    if not folders:
        return "No raw result committed yet: `bash benchmarks/gpu_check.sh` on a GPU machine."
    runs = sorted(folders[-1].glob("*.json"))
    latest: dict[str, tuple[dict, str]] = {}
    for f in runs:
        for r in json.loads(f.read_text())["rows"]:
            before = latest.get(r["name"], ({"status": "skipped"},))[0]["status"]
            if r["name"] not in latest or (before != "ok" and r["status"] != "skipped"):
                latest[r["name"]] = (r, f.name)
    env, first = _doc(folders[-1], 0).get("environment", {}), _doc(folders[-1], 0)
    versions = ", ".join(
        f"{k} {env[k]}" for k in ("torch", "deepspeed", "transformers") if env.get(k)
    )
    head = COLUMNS.replace(" note |", " note | raw file |")
    lines = [
        f"{env.get('device', '?')}, {first.get('date', '')[:10]}; {versions}. "
        f"From `benchmarks/results/gpu/{folders[-1].name}/`.",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    lines += [table_line(r)[:-1] + f"| {file} |" for r, file in latest.values()]
    return "\n" + "\n".join(lines) + "\n"


def _doc(folder: Path, i: int) -> dict:
    files = sorted(folder.glob("*.json"))
    return json.loads(files[i].read_text()) if files else {}


def _num(x, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


if __name__ == "__main__":
    sys.stdout.write(render(json.loads(open(sys.argv[1]).read())))
