"""The measured tables of benchmarks.md, cpu.md, bench_train.md and bench_attention.md, each
drawn from its raw result file under benchmarks/results/:
one function per table, taking the results folder and returning the table's Markdown. Every
row ends with where and when it was measured (the file's `host` and `date`). Written into the
docs by benchmarks/docs_tables.py."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

GiB, MiB = 2**30, 2**20


def load(results: Path, name: str) -> dict:
    return json.loads((results / name).read_text())


def where(d: dict) -> str:
    """The host class (the part of `host` before any note) and the day, for a row's last cell."""
    host = d["host"]["class"] if isinstance(d["host"], dict) else d["host"]
    return f"{host.split(';')[0].strip()}, {d['date'][:10]}"


def table(head: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> str:
    align = ["---:" if i in right else "---" for i in range(len(head))]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def n0(x) -> str:
    return f"{x:,.0f}"


def span(xs: list[float], fmt: str) -> str:
    """ "lo-hi" of `xs`, or the one value when they agree at this precision."""
    lo, hi = fmt.format(min(xs)), fmt.format(max(xs))
    return lo if lo == hi else f"{lo}-{hi}"


def rates(choice: dict) -> tuple[float, float] | None:
    """bf16 and fp32 GFLOP/s per rank a precision choice measured: its stored rates, else the
    ones its `why` quotes."""
    r = choice.get("rates_flops") or {}
    if "bf16" in r and "fp32" in r:
        return r["bf16"] / 1e9, r["fp32"] / 1e9
    m = re.search(r"bf16 ([\d.]+) vs fp32 ([\d.]+) GFLOP/s", choice.get("why") or "")
    return (float(m[1]), float(m[2])) if m else None


# benchmarks.md


def engines_peer(results: Path) -> str:
    from benchmarks.compare.report import section_body

    d = load(results, "compare_small6.json")
    body = section_body(d["rows"], d["command"], d["machine"], d["date"][:10], d["job"], where(d))
    return "\n".join(body)


def engines_3d(results: Path) -> str:
    """pp2 x tp2 (`pipeline_tp2`, on the 4 ranks it needs) beside `zero2`, `tp2` and `pipeline`
    on the same job and global batch: speed against `zero2`, the model states a rank measured
    beside what the memory plan planned, the losses, and how loaded the host was."""
    from benchmarks.compare.report import spread

    d = load(results, "compare_small_3d.json")
    job, host = d["job"], d["host"]
    by = {r["name"]: r for r in d["rows"]}
    base = by.get("zero2", {}).get("tokens_per_s")
    out = []
    for r in d["rows"]:
        if "error" in r:
            out.append([f"`{r['name']}`", f"not run: {r['error']}", *[""] * 8, where(d)])
            continue
        st = r["states"]
        parts = ", ".join(f"{st[k] / MiB:.1f}" for k in ("params", "grads", "optimizer", "buffers"))
        out.append(
            [
                f"`{r['name']}`",
                f"{r['layout']}, {r['grad_accum']} accum ({r.get('ranks', job['ranks'])} ranks)",
                n0(r["tokens_per_s"]),
                spread(r),
                f"{r['tokens_per_s'] / base:.2f}x" if base else "",
                f"{st['total'] / MiB:.1f}",
                f"{r['planned_states'] / MiB:.1f}" if r.get("planned_states") else "-",
                parts,
                f"{r['loss']:.4f}",
                f"{r['val_loss']:.4f}" if r.get("val_loss") is not None else "-",
                where(d),
            ]
        )
    avg = host.get("loadavg") or [0]
    after = host.get("loadavg_after") or avg
    head = (
        f"`{d['command']}`: `{job['model']}`, sequence {job['seq_len']}, micro-batch "
        f"{job['micro_batch']} x {job['grad_accum']} accumulation x {job['ranks']} ranks (the "
        f"same global batch in every row), {job['steps']} steps, {job['repeats']} rounds "
        f"round-robin. The host was shared: load average {avg[0]:.1f} at the start and "
        f"{after[0]:.1f} at the end on {host.get('cores', '?')} cores, "
        f"{host.get('busy_cores', 0):.1f} cores busy on average over the run, so tokens/s "
        "compare only within a round, and pp2 x tp2 runs 4 processes on those cores."
    )
    cols = ["run", "layout", "tokens/s", "spread", "vs `zero2`", "model states / rank (MiB)",
            "planned (MiB)", "params, grads, optimizer, buffers (MiB)", "train loss",
            "val loss", "host, date"]  # fmt: skip
    return "\n" + head + "\n\n" + table(cols, out, right={2, 4, 5, 6, 8, 9}) + "\n"


HOST_CLASS = ("compare_zen4.json", "compare_avx2_emulated.json", "compare_avx2_emulated_bf16.json")
LABEL = {
    "zero2": "ZeRO-2, `auto` (zero2.json as shipped)",
    "zero2_fp32": "ZeRO-2, `--precision fp32`",
    "zero2_bf16": "ZeRO-2, `--precision bf16`",
    "ddp": "DDP, `auto`",
    "ddp_fp32": "DDP, `--precision fp32`",
    "ddp_bf16": "DDP, `--precision bf16`",
    "reference_fp32": "nanoGPT-style DDP, fp32 (as nanoGPT runs on a CPU)",
    "reference": "nanoGPT-style DDP, bf16 autocast",
}


def _choices(d: dict) -> list[tuple[str, dict]]:
    """(host, precision choice) for every run a raw file records a choice of."""
    runs = [r for rs in d.get("rows", {}).values() for r in rs if "precision_choice" in r]
    out = [(where(d), r["precision_choice"]) for r in runs]
    if "precision" in d:  # a quickstart run
        out.append((where(d), d["precision"]))
    for key, r in d.get("runs", {}).items():  # compile_cost: both host classes in one file
        host = where(d) if key.startswith("native") else where({**d, "host": HELD})
        asked = "auto" if "asked" not in r["precision_why"] else "bf16"
        out.append((host, {"why": r["precision_why"], "picked": r["precision"], "asked": asked}))
    return out


def matmul_by_host(results: Path) -> str:
    """The bf16 and fp32 matmul rates each run measured before its first step, by host class,
    and what `auto` picked from them."""
    files = [
        *(f"host_class/{f}" for f in HOST_CLASS),
        "host_class/quickstart_avx2_emulated.json",
        "host_class/compile_cost.json",
    ]
    by: dict[str, list] = {}
    for f in files:
        for host, c in _choices(load(results, f)):
            if rates(c):
                by.setdefault(host, []).append(
                    (*rates(c), c["picked"] if c.get("asked") == "auto" else None)
                )
    rows = []
    for host, xs in by.items():
        bf, fp = [x[0] for x in xs], [x[1] for x in xs]
        ratio = [f / b for b, f, _ in xs]
        picked = sorted({x[2] for x in xs if x[2]})
        rows.append(
            [
                span(bf, "{:.1f}"),
                span(fp, "{:.1f}"),
                span(ratio, "{:.2f}" if max(ratio) < 1 else "{:.1f}"),
                ", ".join(picked) or "-",
                str(len(xs)),
                host,
            ]
        )
    head = [
        "bf16 GFLOP/s per rank",
        "fp32 GFLOP/s per rank",
        "fp32 / bf16",
        "`auto` picked",
        "runs",
        "host, date",
    ]
    return table(head, rows, {4})


HELD = "AMD EPYC (Zen 4, family 25 model 17) held to AVX2 (capability AVX2, bf16 units no)"


def precision_by_host(results: Path) -> str:
    rows, lines = [], []
    for f in HOST_CLASS:
        d = load(results, f"host_class/{f}")
        for name, runs in d["rows"].items():
            tps = [r["tokens_per_s"] for r in runs]
            rows.append(
                [
                    LABEL[name],
                    runs[0]["precision"],
                    n0(statistics.median(tps)),
                    ", ".join(n0(x) for x in tps),
                    where(d),
                ]
            )
        med = d["medians"]
        for engine in ("zero2", "ddp"):
            alts = [med[k] for k in (f"{engine}_fp32", f"{engine}_bf16") if k in med]
            if engine in med and alts:
                lines.append(
                    f"- {where(d)}: {LABEL[engine]} / the faster of its own engine's fp32 and bf16 "
                    f"rows = {med[engine] / max(alts):.2f}"
                )
    head = ["run", "precision", "tokens/s (median)", "rounds", "host, date"]
    return table(head, rows, {2}) + "\n\n" + "\n".join(lines)


def compile_cost(results: Path) -> str:
    d = load(results, "host_class/compile_cost.json")
    m = re.search(r"seq (\d+), micro-batch (\d+), (\d+) ranks", d["job"])
    tokens = int(m[1]) * int(m[2]) * int(m[3])
    rows = []
    for host in ("native", "avx2"):
        c, e = d["runs"][f"{host}--compile"], d["runs"][f"{host}--no-compile"]
        tc, te = c["tokens_per_s_steps_6_30"], e["tokens_per_s_steps_6_30"]
        gain = tokens / e["median_tokens_per_s"] - tokens / c["median_tokens_per_s"]
        even = (c["first_step_s"] - e["first_step_s"]) / gain if gain > 0 else None
        rows.append(
            [
                c["precision"],
                f"{c['first_step_s']} / {e['first_step_s']}",
                f"{n0(c['median_tokens_per_s'])} ({n0(min(tc))}-{n0(max(tc))})",
                f"{n0(e['median_tokens_per_s'])} ({n0(min(te))}-{n0(max(te))})",
                f"{even:.0f}" if even else "never",
                where({**d, "host": d["host"] if host == "native" else HELD}),
            ]
        )
    head = [
        "precision (`auto`)",
        "first step s: compiled / eager",
        "tokens/s compiled: median (min-max)",
        "eager",
        "break-even step",
        "host, date",
    ]
    return f"The job: {d['job']}.\n\n" + table(head, rows, {4})


def lora(results: Path) -> str:
    d = load(results, "lora.json")
    rows = [
        [
            {"full": "full fine-tuning", "lora": f"LoRA {d['args']['lora']}"}[r["name"]],
            f"{r['trainable'] / 1e6:.2f}M / {r['params'] / 1e6:.2f}M",
            n0(r["tokens_per_s"]),
            f"{r['peak_mem_gb']:.2f}",
            f"{r['model_states_mb']:.1f}",
            where(d),
        ]
        for r in d["rows"]
    ]
    head = [
        "run",
        "trained / all params",
        "tokens/s",
        "peak memory / rank (GB)",
        "model states / rank (MiB)",
        "host, date",
    ]
    return table(head, rows, {1, 2, 3, 4})


def moe(results: Path) -> str:
    """benchmarks/bench_moe.py: the MoE preset against the dense one of the same active
    parameters, expert parallelism against experts replicated; medians of the rounds with
    their lowest and highest."""
    d = load(results, "moe.json")
    rows = []
    for r in d["summary"]:
        rows.append(
            [
                r["arm"],
                r["model"],
                str(r["ranks"]),
                f"{n0(r['tokens_per_s'])} ({span(r['tokens_per_s_spread'], '{:,.0f}')})",
                f"{r['vs_dense']:.2f}",
                f"{r['loss']:.4f} ({span(r['loss_spread'], '{:.4f}')})",
                where(d),
            ]
        )
    head = ["run", "model", "ranks", "tokens/s (range)", "vs dense", "loss (range)", "host, date"]
    note = d["host"].get("note") if isinstance(d["host"], dict) else ""
    rounds = d["summary"][0]["rounds"]
    tail = f"\n\nMedians of {rounds} interleaved rounds." + (f" {note}" if note else "")
    return table(head, rows, {2, 3, 4, 5}) + tail


def moe_experts(results: Path) -> str:
    """benchmarks/bench_moe_experts.py: one MoE layer's experts, forward and backward, as one
    grouped matmul per projection against a matmul per expert; medians with min and max."""
    d = load(results, "moe_experts.json")
    rows = []
    for r in d["rows"]:
        cells = [str(r["experts"])]
        for arm in ("grouped", "loop"):
            lo, hi = r["min"][arm] * 1e3, r["max"][arm] * 1e3
            cells.append(f"{r['median'][arm] * 1e3:,.1f} ({lo:,.1f}-{hi:,.1f})")
        cells += [f"{r['loop_over_grouped']:.2f}", f"{r['max_relative_gap']:.1e}", where(d)]
        rows.append(cells)
    head = ["experts", "grouped ms (range)", "loop ms (range)", "loop / grouped",
            "largest gap", "host, date"]  # fmt: skip
    sh = d["shape"]
    tail = (
        f"\n\n{d['dtype']}, {sh['tokens']:,} tokens a step, top-{sh['top_k']}, hidden "
        f"{sh['hidden']:,}, each expert {sh['width']:,} wide, one thread; medians of "
        f"{d['rounds']} interleaved rounds. The largest gap is the largest difference between "
        "the arms' outputs and gradients, relative to the loop's largest value."
    )
    return table(head, rows, {0, 1, 2, 3, 4}) + tail


def trl_sft(results: Path) -> str:
    return peer_table(load(results, "trl_sft.json"))


def trl_dpo(results: Path) -> str:
    """The DPO peer's rows, and its fp32 step-1 check (zerostack / TRL)."""
    d = load(results, "trl_dpo.json")
    checks = []
    for c in d["fp32_check"]:
        if "error" in c:
            checks.append(f"{c['mode']}: failed ({c['error']})")
            continue
        (lz, lt), (pz, pt) = c["loss_step1"], c["logps_chosen_step1"]
        checks.append(
            f"{c['mode']}: loss {lz:.7f} / {lt:.7f}, chosen log-prob {pz:.5f} / {pt:.5f}"
            + ("" if c["agree"] else " (**differ by more than 1e-5**)")
        )
    return peer_table(d) + "\n\nStep 1 in fp32, ZeRO-2, zerostack / TRL: " + "; ".join(checks) + "."


def peer_table(d: dict) -> str:
    """The summary rows of a run of benchmarks/peer_trl.py (or peer_trl_dpo.py)."""
    rows = []
    for r in d["summary"]:
        lo, hi = r["trained_tokens_per_s_spread"]
        rows.append(
            [
                r["config"],
                r["mode"],
                r["system"],
                f"{n0(r['trained_tokens_per_s'])} ({n0(lo)}-{n0(hi)})",
                n0(r["tokens_per_s"]),
                n0(r["positions_per_s"]),
                f"{r['peak_mem_gb']:.2f}",
                f"{r['loss_step1']:.6f}",
                where(d),
            ]
        )
    head = [
        "ZeRO",
        "run",
        "system",
        "trained tok/s (range)",
        "real tok/s",
        "positions/s",
        "peak mem / rank (GB)",
        "loss step 1",
        "host, date",
    ]
    return (
        table(head, rows, {3, 4, 5, 6, 7}) + f"\n\nMedians of {d['summary'][0]['rounds']} rounds."
    )


# cpu.md


def quickstart_cpu(results: Path) -> str:
    d = load(results, "host_class/quickstart_avx2_emulated.json")
    last = d["evals"][-1]
    row = [
        f"`{d['command']}`",
        f"{d['precision']['picked']} ({d['precision']['why']})",
        f"{d['first_step_s_compiling']}",
        n0(d["median_tokens_per_s"]),
        n0(d["wall_s"]),
        f"{last['val_loss']:.3f} at step {last['step']}",
        where(d),
    ]
    head = [
        "command",
        "precision (`auto`)",
        "first step s (compiling)",
        "tokens/s (median)",
        "wall s",
        "val loss",
        "host, date",
    ]
    return table(head, [row], {2, 3, 4})


# bench_attention.md


def doc_mask(results: Path) -> str:
    d = load(results, "doc_mask_attention.json")
    return _doc_mask_table(d, d["rows"])


def doc_mask_earlier(results: Path) -> str:
    """The `earlier_run` entry of doc_mask_attention.json: the same command shortly before."""
    d = load(results, "doc_mask_attention.json")
    earlier = d["earlier_run"]
    return f"{_doc_mask_table(d, earlier['rows'])}\n\nFrom the file: {earlier['note']}."


def _doc_mask_table(d: dict, runs: list[dict]) -> str:
    def ms(x):
        return "-" if x is None else f"{x:.0f}"

    rows = [
        [
            str(r["seq"]),
            str(r["batch"]),
            str(r["documents"]),
            r["path"],
            ms(r["forward_ms"]),
            ms(r["forward_backward_ms"]),
            where(d),
        ]
        for r in runs
    ]
    head = [
        "sequence",
        "batch",
        "documents",
        "path",
        "forward (ms)",
        "forward + backward (ms)",
        "host, date",
    ]
    return table(head, rows, {0, 1, 2, 4, 5})


# tables of benchmarks whose raw files may not be committed yet


def not_yet(command: str, file: str) -> str:
    return (
        f"No raw result committed yet: `{command}` writes `{file}` under the results folder "
        "and draws this table from it."
    )


def bench_train(results: Path) -> str:
    """One table per committed `bench_train_MODEL.json`: each ds_config on 2 ranks against the
    plain loops of the same model (the first row the yardstick)."""
    files = sorted(results.glob("bench_train_*.json"))
    if not files:
        return not_yet("python benchmarks/bench_train.py", "bench_train_MODEL.json")
    return "\n\n".join(_bench_train(json.loads(f.read_text())) for f in files)


def _bench_train(d: dict) -> str:
    a, rows = d["args"], d["rows"]
    ref = rows[0].get("tokens_per_s")
    extra = f" Extra trainer flags: `{' '.join(a['extra'])}`." if a.get("extra") else ""
    intro = (
        f"`python benchmarks/bench_train.py --model {a['model']} --steps {a['steps']}`: sequence "
        f"{a['seq_len']}, {a['micro_batch'] * a['ranks'] * a['seq_len']:,} tokens a step, "
        f"DeepSpeed rows on {a['ranks']} ranks of one thread.{extra}"
    )
    lines = []
    for r in rows:
        if "error" in r:
            lines.append([r["name"], f"failed: {r['error']}", "", "", "", "", "", where(d)])
            continue
        lines.append(
            [
                r["name"],
                n0(r["tokens_per_s"]),
                f"{r['tokens_per_s'] / ref:.2f}x",
                f"{r['mfu']:.1%}",
                n0(r["ceiling"] / 1e9),
                f"{r['peak_mem_gb']:.2f}",
                f"{r['loss']:.3f}",
                where(d),
            ]
        )
    head = [
        "run",
        "tokens/s",
        "vs plain loop",
        "MFU",
        "against (GFLOP/s)",
        "peak memory / rank (GB)",
        "final loss",
        "host, date",
    ]
    return intro + "\n\n" + table(head, lines, {1, 2, 3, 4, 5, 6})


def attention_kernels(results: Path) -> str:
    path = results / "attention_kernels.json"
    if not path.is_file():
        return not_yet("python benchmarks/bench_attention.py", "attention_kernels.json")
    d = json.loads(path.read_text())
    a = d["args"]
    sdpa = {
        r["seq"]: r["forward_ms"] + r["backward_ms"] for r in d["rows"] if r["kernel"] == "sdpa"
    }
    rows = [
        [
            str(r["seq"]),
            str(r["batch"]),
            r["kernel"],
            f"{r['forward_ms']:.1f}",
            f"{r['backward_ms']:.1f}",
            f"{r['forward_ms'] + r['backward_ms']:.1f}",
            f"{sdpa[r['seq']] / (r['forward_ms'] + r['backward_ms']):.2f}x",
            n0(r["gflops"]),
            where(d),
        ]
        for r in d["rows"]
    ]
    intro = (
        f"One thread, torch {d['torch']}: {a['heads']} query heads and {a['kv_heads']} kv heads "
        f"of {a['head_dim']}, {a['tokens']} tokens a batch, bf16, the median of {a['rounds']} "
        f"rounds; this run's bf16 matmul ceiling (2048^3): {n0(d['ceiling_gflops'])} GFLOP/s."
    )
    head = [
        "sequence",
        "batch",
        "kernel",
        "forward (ms)",
        "backward (ms)",
        "total (ms)",
        "vs SDPA",
        "GFLOP/s",
        "host, date",
    ]
    return intro + "\n\n" + table(head, rows, {0, 1, 3, 4, 5, 6, 7})


def dpo_job(results: Path) -> str:
    """The offline DPO job's held-out figures: the base model, then each committed run."""
    files = [f for f in ("dpo_pyfuncs.json", "dpo_pyfuncs_lr1e-3.json") if (results / f).is_file()]
    if not files:
        return not_yet("python benchmarks/dpo_job.py", "dpo_pyfuncs.json")
    runs = [load(results, f) for f in files]

    def cells(e: dict) -> list[str]:
        figures = ("val_loss", "val_accuracy", "val_prefers_chosen", "val_margin")
        return [f"{e[figures[0]]:.4f}", *(f"{e[k]:.3f}" for k in figures[1:])]

    pairs = runs[0]["pairs"]["val"]
    rows = [["base (step 0)", *cells(runs[0]["before"]), where(runs[0])]]
    for d in runs:
        a = d["args"]
        rows.append([f"`--lr {a['lr']}`, {a['steps']} steps", *cells(d["after"]), where(d)])
    head = [f"held-out ({pairs} pairs)", "DPO loss", "reward accuracy", "prefers chosen"]
    return table([*head, "reward margin", "host, date"], rows)
