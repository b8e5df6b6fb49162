"""The tables of what saving and long runs cost (docs/checkpoints.md, docs/reliability.md), drawn
from their raw result files; written into the docs by benchmarks/docs_tables.py."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from benchmarks.result_tables import MiB, load, n0, not_yet, table, where


def _save_row(r: dict) -> list[str]:
    """Stall, its parts, the background writes and the step times of one mode's record."""
    async_ = r["staged_bytes"] > 0
    parts = "/".join(
        f"{r[k]:.2f}" for k in ("stage_s_per_save_s", "wait_s_per_save_s", "seal_s_per_save_s")
    )
    stalls = [s["stall_s"] for s in r["saves"]]
    return [
        f"{r['stall_per_save_s']:.2f} ({min(stalls):.2f}-{max(stalls):.2f})",
        parts.replace("/", " / ") if async_ else "-",
        ", ".join(f"{w:.1f}" for w in r["write_s"]) if async_ else "-",
        f"{r['step_s_after_save']:.2f}",
        f"{r['step_s_other']:.2f}",
        n0(r["peak_rss_bytes"] / MiB),
    ]


SAVE_HEAD = [
    "loop stall per save s (range)",
    "copy / wait / seal s (mean)",
    "background writes s",
    "step s, interval holding a save",
    "step s, others",
    "peak RSS MiB",
]


def checkpoint_shared(results: Path) -> str:
    d = load(results, "checkpoint_stall.json")
    rows = [[mode, *_save_row(d["results"][mode]), where(d)] for mode in ("sync", "async")]
    return table(["saves", *SAVE_HEAD, "host, date"], rows, {1, 4, 5, 6})


def checkpoint_quiet(results: Path) -> str:
    rows = []
    for config in ("zero2", "zero3"):
        d = load(results, f"checkpoint_stall_125M_{config}.json")
        rows += [
            [config, mode, *_save_row(d["results"][mode]), where(d)] for mode in ("sync", "async")
        ]
    return table(["config", "saves", *SAVE_HEAD, "host, date"], rows, {2, 5, 6, 7})


def checkpoint_gpu(results: Path) -> str:
    """Synchronous and background saves into fresh pageable memory (pass 1), then background
    saves into kept page-locked buffers (pass 2): its first save, and the later ones, whose
    stall is the copy and the seal (the last save's wait is the end of the run)."""
    d = load(results, "checkpoint_stall_350M_gpu.json")
    rows = []
    for config in ("zero2", "zero3"):
        one = d["pass1"][config]["results"]
        rows.append([config, "sync", f"{one['sync']['stall_per_save_s']:.2f}", "-", "-"])
        a = one["async"]
        parts = " / ".join(
            f"{a[k]:.2f}" for k in ("stage_s_per_save_s", "wait_s_per_save_s", "seal_s_per_save_s")
        )
        writes = ", ".join(f"{w:.1f}" for w in a["write_s"])
        rows.append(
            [config, "async, fresh pageable staging", f"{a['stall_per_save_s']:.2f}", parts, writes]
        )
        saves = d["pass2"][config]["checkpoints"]
        first, later = saves[0], saves[1:]
        rows.append(
            [
                config,
                "async, kept page-locked staging: first save",
                f"{first['stall_s']:.2f}",
                f"{first['stage_s']:.2f} / {first['wait_s']:.2f} / {first['seal_s']:.3f}",
                f"{first['write_s']:.1f}",
            ]
        )
        rows.append(
            [
                config,
                "async, kept page-locked staging: later saves (copy + seal)",
                ", ".join(f"{s['stage_s'] + s['seal_s']:.2f}" for s in later),
                ", ".join(f"{s['stage_s']:.2f} / - / {s['seal_s']:.3f}" for s in later),
                ", ".join(f"{s['write_s']:.1f}" for s in later),
            ]
        )
    for r in rows:
        r.append(where(d))
    head = [
        "config",
        "saves",
        "loop stall per save s",
        "copy / wait / seal s",
        "background writes s",
        "device, date",
    ]
    return table(head, rows, {2})


def soak(results: Path) -> str:
    """RSS, open files, threads and /dev/shm at the start and the end of a long run."""
    from types import SimpleNamespace

    path = results / "soak.json"
    if not path.is_file():
        return not_yet("python -m benchmarks.soak", "soak.json")
    d = json.loads(path.read_text())
    return soak_table(d["rows"], SimpleNamespace(**d["args"]), d["warm"], where(d))


def _mib(v: list[float]) -> str:
    return " / ".join(f"{x / 2**20:.0f}" for x in v)


def _ints(v: list[float]) -> str:
    return " / ".join(f"{x:g}" for x in v)


def soak_table(rows: list[dict], a, warm: int, where: str) -> str:
    """The soak table; `a` holds the run's steps, save_every and eval_every, `where` the host
    class and day it ran."""
    about = (
        f"Measured with `python -m benchmarks.soak --steps {a.steps}` (tiny preset, 2 ranks, "
        f"sequence 64, save every {a.save_every} steps keeping the last 2, evaluation every "
        f"{a.eval_every}; {where}). Start: median of the samples over steps "
        f"{warm}-{warm + max(a.steps // 10, 20)}; end: over the last tenth before the final step. "
        "Per rank (rank 0 / rank 1)."
    )
    lines = [
        textwrap.fill(about, 100, break_on_hyphens=False),
        "",
        "| engine | RSS MiB start -> end | growth | RSS MiB at 25/50/75% | fds start -> end "
        "| threads | /dev/shm maps | run's /dev/shm files after exit | holds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['engine']} | {r['error']} | | | | | | | no |")
            continue
        s, e = r["start"], r["end"]
        mid = "; ".join(f"{step}: " + " / ".join(f"{x:.0f}" for x in v) for step, v in r["between"])
        growth = " / ".join(f"{g:+.1%}" for g in r["rss_growth"])
        lines.append(
            f"| {r['engine']} | {_mib(s['rss'])} -> {_mib(e['rss'])} | {growth} | {mid} "
            f"| {_ints(s['fds'])} -> {_ints(e['fds'])} | {_ints(s['threads'])} -> "
            f"{_ints(e['threads'])} | {_ints(s['shm_maps'])} -> {_ints(e['shm_maps'])} "
            f"| {len(r.get('shm_left', []))} | {'yes' if r['ok'] else 'NO: ' + _failed(r)} |"
        )
    return "\n".join(lines)


def _failed(r: dict) -> str:
    return ", ".join(k for k, ok in r["checks"].items() if not ok)


def spike_guard(results: Path) -> str:
    """False positives of the spike guard on clean runs: skipped live, and the logged loss and
    gradient norms replayed through the guard at other thresholds, in log space and linear."""
    from benchmarks.result_tables import table, where

    path = results / "spike_guard.json"
    if not path.is_file():
        return not_yet("python -m benchmarks.spike_rate", "spike_guard.json")
    d = json.loads(path.read_text())
    what = {
        "tiny": "tiny preset, 2 x 64 tokens a rank a step",
        "quickstart": "quickstart recipe (small preset, examples/quickstart.yaml)",
    }
    rows = []
    for r in d["false_positives"]:
        sig = sorted(r["replayed_log_norm"], key=float)
        rows.append(
            [
                f"{what.get(r['run'], r['run'])}, {r['steps']} steps",
                str(r["judged"]),
                str(len(r["spikes_at_default"])),
                " / ".join(str(len(r["replayed_log_norm"][k])) for k in sig),
                " / ".join(str(len(r["replayed_linear_norm"][k])) for k in sig),
                where(d),
            ]
        )
    at = " / ".join(f"{float(k):g}" for k in sig)
    head = [
        "clean run (2 CPU ranks, ZeRO-2)",
        "steps judged",
        f"skipped, live ({d['rule']['sigmas']:g} sigma)",
        f"log-norm rule (ours) at {at} sigma",
        f"linear rule (OLMo-core's) at {at} sigma",
        "host, date",
    ]
    ratios = ", ".join(f"{r['on_over_off']:.2f}" for r in d["cost"]["rounds"])
    cost = (
        f"Cost per step, tiny preset, guard on against `--spike-sigmas 0` in "
        f"{len(d['cost']['rounds'])} interleaved rounds ({where(d)}): tokens/s ratios {ratios}, "
        f"median {d['cost']['median_ratio']:.2f}."
    )
    return table(head, rows) + "\n\n" + textwrap.fill(cost, 100, break_on_hyphens=False)
