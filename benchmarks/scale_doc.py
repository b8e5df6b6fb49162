"""docs/scale.md's table and plot, drawn from benchmarks/results/scale.json alone (scale.py adds
each row's plan of today, `plan_now`, beside the plan stored before the row ran, `plan`).

Three things the table says from the stored raw fields, not from what the text claims:
- measured against the plan **before** the run and against the plan **now**; the constants
  fitted to some rows (FITTED) make the second column agree with those rows by construction, so
  the 15% goal is judged on the first column of the rows not fitted to (held out);
- MFU only where it can be trusted (benchmarks/provenance.py: mfu_distrust), else "-" and why;
- which rows are older than the code they describe (their stored code fingerprints).
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.provenance import changed_files, changed_parts, mfu_distrust

GiB = 2**30
GOAL = 0.15  # measured within 15% of the plan made before the run
# The rows each of the planner's fitted constants (training/memory/plan.py) was fitted to, and
# the commit that fitted it: those rows were measured first and the constant chosen to match
# them, so their plan now is no prediction.
FITTED = {
    "CPU_HEAP_SLACK": (
        "33bf872",
        ("tiny:zero2:256", "125M:zero2:1024", "125M:zero3:1024", "350M:zero3:1024"),
    ),
    "NVME_FIXED, NVME_PER_PARAM": (
        "474c1c6",
        ("350M:zero3_nvme:1024:ckpt", "1.3B:zero3_nvme:1024:ckpt", "2.7B:zero3_nvme:1024:ckpt"),
    ),
}
START, END = "<!-- scale table: benchmarks/scale.py -->", "<!-- end of scale table -->"


def gib(b) -> str:
    return "-" if b is None else f"{b / GiB:.2f}"


def secs(s) -> str:
    return "-" if s is None else f"{s:.0f}"


def ratio(measured, plan) -> str:
    if not measured or not plan:
        return "-"
    return f"{measured / plan:.2f}"


def fitted_to(row: str) -> list[str]:
    """The fitted constants whose fit used this row."""
    return [name for name, (_, rows) in FITTED.items() if row in rows]


def code_cell(r: dict) -> str:
    parts = changed_parts(r.get("code"))
    if parts is None:
        return "predates the record"
    commit = (r["code"].get("commit") or "")[:7] + ("+" if r["code"].get("dirty") else "")
    return f"{commit}: " + (f"older ({', '.join(parts)} changed)" if parts else "current")


class Notes:
    """Footnotes, numbered as first used."""

    def __init__(self):
        self.texts: list[str] = []

    def mark(self, text: str) -> str:
        if text not in self.texts:
            self.texts.append(text)
        return f"[{self.texts.index(text) + 1}]"

    def render(self) -> str:
        return "\n".join(f"[{i}] {t}" for i, t in enumerate(self.texts, 1))


def render(results: dict) -> str:
    """The table (rows by size), its footnotes, and the plan-before verdict over held-out rows."""
    from models import get_config, num_params

    def order(key: str):
        try:
            return (num_params(get_config(key.split(":")[0])), key)
        except Exception:  # a preset since renamed: last
            return (float("inf"), key)

    rows = [results[k] for k in sorted(results, key=order)]
    notes = Notes()
    head = (
        "| row | params | code measured (against today's) | plan before the run | planned "
        "GiB/rank before (mem / nvme) | measured peak RSS GiB/rank (tree) | measured / plan "
        "before | planned GiB/rank now (mem / nvme) | measured / plan now | NVMe used GiB | "
        "construction s / peak GiB (grew) | tokens/s | MFU | save s / size GiB / peak GiB | "
        "resume s (fresh) | universal s / peak GiB | export s / peak GiB |"
    )
    lines = [head, "|" + "---|" * (head.count(" | ") + 1)]
    for r in rows:
        p, now = r["plan"], r.get("plan_now") or r["plan"]
        fit = fitted_to(r["row"])
        cells = [
            f"`{r['row']}`"
            + (" (partial*)" if r.get("partial") else "")
            + (f" (fitted: {', '.join(fit)})" if fit else ""),
            f"{p['params'] / 1e6:,.0f}M",
            code_cell(r),
            ("fits" if p["fits"] else f"refused (fits: {p['cheapest'] or 'none'})")
            + (" (run with --force)" if r.get("forced") else ""),
            f"{gib(p['per_rank_memory'])} / {gib(p['per_rank_nvme'])}",
        ]
        t = r.get("train")
        if t is None:
            line = r.get("refusal", {}).get("line", "")
            cells += [f"not run: the trainer refused it (`{line[:90]}...`)", "-"]
            cells += [f"{gib(now['per_rank_memory'])} / {gib(now['per_rank_nvme'])}"]
            cells += ["-"] * 9
        else:
            peak = max(t["peak_rss"])
            c, u, e, s = (r.get(k) for k in ("construction", "universal", "export", "resume"))
            why = mfu_distrust(t)
            cells += [
                f"{' / '.join(gib(x) for x in t['peak_rss'])} ({gib(t['tree_peak_rss'])})",
                ratio(peak, p["per_rank_memory"]),
                f"{gib(now['per_rank_memory'])} / {gib(now['per_rank_nvme'])}",
                ratio(peak, now["per_rank_memory"]),
                gib(t["nvme_peak_bytes"]) if t["nvme_peak_bytes"] else "-",
                f"{secs(c['seconds'])} / {gib(max(c['peak_rss']))} (+{gib(max(c['grew']))})"
                if c
                else "-",
                f"{t['tokens_per_s']:,.0f}",
                f"- {notes.mark(why)}" if why else f"{t['mfu']:.1%}",
                f"{secs(t['save_seconds'])} / {gib(t['checkpoint_bytes'])} / "
                f"{gib(max(t['save_peak_rss']) or None)}"
                if t["checkpoint_bytes"]
                else "-",
                resume_cell(s),
                f"{u['seconds']:.0f} / {gib(u['peak_rss'])}" if u else "-",
                f"{e['seconds']:.0f} / {gib(e['peak_rss'])}" if e else "-",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    mfu_notes = notes.render()
    if mfu_notes:
        lines += ["", "MFU not shown where it cannot be trusted:", "", mfu_notes]
    return "\n".join(lines + ["", verdict(rows), "", aged(rows)])


def resume_cell(s: dict | None) -> str:
    if not s:
        return "-"
    exact = {True: ", exact", False: ", NOT exact"}[s["exact"]["equal"]] if "exact" in s else ""
    return f"{s['to_first_step_s'] or 0:.0f} ({s['fresh_to_first_step_s'] or 0:.0f}){exact}"


def verdict(rows: list[dict]) -> str:
    """The 15% goal against the plan made before each row ran: the held-out rows (the goal),
    then the fitted ones (for the record)."""
    ran = [r for r in rows if r.get("train")]

    def listing(rs: list[dict]) -> str:
        return ", ".join(
            f"`{r['row']}` {max(r['train']['peak_rss']) / r['plan']['per_rank_memory']:.2f}x"
            for r in rs
        )

    def off(rs: list[dict]) -> list[dict]:
        return [
            r
            for r in rs
            if abs(max(r["train"]["peak_rss"]) / r["plan"]["per_rank_memory"] - 1) > GOAL
        ]

    held = [r for r in ran if not fitted_to(r["row"])]
    fit = [r for r in ran if fitted_to(r["row"])]
    fits = "; ".join(f"`{k}` in {c} to {len(v)} rows" for k, (c, v) in FITTED.items())
    out = (
        f"**Measured against the plan made before the run** (the goal: within {GOAL:.0%}). The "
        f"constants fitted to rows ({fits}) are left out of the goal: "
    )
    if held:
        missed = off(held)
        out += f"held-out rows ({len(held)}): {listing(held)}; " + (
            f"outside {GOAL:.0%}: {listing(missed)}." if missed else f"all within {GOAL:.0%}."
        )
    else:
        out += "no held-out row has run."
    if fit:
        out += (
            f" The rows the constants were fitted to (a row measured again since keeps the "
            f"mark), against the plan stored before each ran: "
            f"{listing(fit)}."
        )
    return out


def aged(rows: list[dict]) -> str:
    """Which rows were measured on code other than today's (benchmarks/provenance.py)."""
    none = [r["row"] for r in rows if changed_parts(r.get("code")) is None]
    older = [r["row"] for r in rows if changed_parts(r.get("code"))]
    out = "**Rows older than the code they describe**: "
    if not none and not older:
        return out + "none: every row was measured on today's trainer and planner."
    bits = []
    if older:
        bits.append(f"{', '.join(f'`{x}`' for x in older)} (the trainer or planner changed since)")
        by_commit = {}
        for r in rows:
            if r["row"] in older:
                by_commit.setdefault(r["code"].get("commit") or "", r["code"])
        for commit, code in by_commit.items():
            files = changed_files(code)
            if files:  # how much changed, by folder; git names the files
                bits.append(f"changed since {commit[:7]}: {_by_folder(files)}")
    if none:
        bits.append(
            f"{len(none)} rows measured before rows recorded their code (treat them as older): "
            + ", ".join(f"`{x}`" for x in none)
        )
    return out + "; ".join(bits) + "."


def _by_folder(files: list[str]) -> str:
    """'118 files (`training/` 99, `models/` 10)': how much changed; `git diff --stat` names them."""
    counts: dict[str, int] = {}
    for f in files:
        top = f.split("/")[0] + "/" if "/" in f else f
        counts[top] = counts.get(top, 0) + 1
    folders = ", ".join(f"`{k}` {n}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    return f"{len(files)} files ({folders})"


def plot_memory(results: dict, path: Path) -> None:
    """Memory per rank against model size, one colour per config: measured peak resident set
    (filled) beside the plan made before the run (hollow), and the rows the plan refuses (x,
    planned only), under the line of what a rank of this machine has."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import psutil

    series: dict[str, list[dict]] = {}
    for r in results.values():
        name = f"{r['config']}{' + ckpt' if r['ckpt'] else ''}, seq {r['seq']}"
        series.setdefault(name, []).append(r)
    fig, ax = plt.subplots(figsize=(11, 5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (name, rows), colour in zip(sorted(series.items()), colours * 4):
        rows = sorted(rows, key=lambda r: r["plan"]["params"])
        x = [r["plan"]["params"] / 1e9 for r in rows]
        planned_gib = [r["plan"]["per_rank_memory"] / GiB for r in rows]
        ax.plot(x, planned_gib, "--", color=colour, marker="o", mfc="none", label=f"{name}: plan")
        ran = [r for r in rows if r.get("train")]
        if ran:
            ax.plot(
                [r["plan"]["params"] / 1e9 for r in ran],
                [max(r["train"]["peak_rss"]) / GiB for r in ran],
                "-",
                color=colour,
                marker="o",
                label=f"{name}: measured",
            )
        refused = [r for r in rows if not r["plan"]["fits"]]
        ax.plot(
            [r["plan"]["params"] / 1e9 for r in refused],
            [r["plan"]["per_rank_memory"] / GiB for r in refused],
            "x",
            color=colour,
            ms=10,
        )
    ranks = next(iter(results.values()))["ranks"]
    have = psutil.virtual_memory().total / GiB / ranks
    ax.axhline(have, color="black", lw=0.8)
    ax.text(
        0.02,
        have * 1.03,
        f"this machine's memory / {ranks} ranks",
        transform=ax.get_yaxis_transform(),
    )
    ax.set_xscale("log")
    ax.set_xlabel("parameters (billions)")
    ax.set_ylabel("GiB per rank (host memory)")
    ax.set_title(
        "Memory per rank: measured peak (filled), planned before the run (hollow); x = refused"
    )
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_doc(results: dict, doc: Path) -> str:
    """Redraw the table block of `doc` and its plot beside it; returns the table."""
    plot = doc.with_name("scale_memory.png")
    plot_memory(results, plot)
    table = render(results)
    block = f"{START}\n{table}\n\n![memory per rank against model size]({plot.name})\n{END}"
    text = doc.read_text() if doc.is_file() else ""
    if START in text and END in text:
        text = text.split(START)[0] + block + text.split(END, 1)[1]
    else:
        text = f"# Scale\n\n{block}\n" + text
    doc.write_text(text)
    return table
