"""Large models for real: memory, disk and time of every path at 125M-2.7B, planned beside measured.

    python -m benchmarks.scale --data data_cache/pystdlib                 # the default rows
    python -m benchmarks.scale --data DATA --rows 1.3B:zero3_nvme:1024:ckpt --steps 2
    python -m benchmarks.scale --render            # docs/scale.md only, from the stored rows

A row is PRESET:CONFIG:SEQ[:ckpt] (a ds_configs name; ckpt turns on activation checkpointing),
on 2 ranks of this machine, micro-batch 1. For each row:

1. the memory plan (training/memory/plan.py, the trainer's own check): fits or not, the planned
   bytes per rank in memory and on NVMe. A row the plan refuses is launched once without
   --force, to show the trainer refuses it in one line before any work; nothing else runs.
2. construction (ZeRO-3 rows): the model built the trainer's way on 2 ranks
   (tests/scripts/construct_rss.py), each rank's peak resident set sampled every 5 ms.
3. training: `--steps N` with a checkpoint at the end; every 0.25 s the resident set of each rank
   and of the whole process tree (launcher included; DeepSpeed's pinned and swap buffers are
   resident memory of the ranks) and the NVMe swap folder's size; tokens/s and MFU from
   RUN/metrics.jsonl (steps after the first); the save's time from the console and its peak
   from the samples taken while it ran; the checkpoint's size on disk.
4. resume: the same command with one more step; its time to the end of its first step beside
   the fresh run's (the difference is loading the checkpoint).
5. universal conversion and export (fp32, with the reload check), each a process of its own
   timed (wall seconds, peak RSS).

Results go to benchmarks/results/scale.json (one entry a row, rows re-run replace theirs), each
with the plan made before it ran, the code it ran on (commit and fingerprints), the host's
class, cores and load, and the run's ceiling probes at start and end (benchmarks/provenance.py).
docs/scale.md is drawn from that file alone (benchmarks/scale_doc.py), beside today's plan of
each row. Run folders are removed after each row unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from benchmarks import scale_doc
from benchmarks.host import timed as host_timed
from benchmarks.provenance import busy_cpu_seconds, code_record, host_record
from launch.launcher_argv import launcher_command

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
RESULTS = REPO / "benchmarks" / "results" / "scale.json"
DOC = REPO / "docs" / "scale.md"
DEFAULT_ROWS = [
    "125M:zero2:1024",
    "125M:zero3:1024",
    "125M:zero2:2048",
    "350M:zero2:1024",
    "350M:zero3:1024",
    "350M:zero2:2048",
    "1.3B:zero2:1024",
    "1.3B:zero3:1024:ckpt",
    "1.3B:zero3_offload:1024:ckpt",
    "1.3B:zero3_nvme:1024:ckpt",
    "2.7B:zero3_nvme:1024:ckpt",
]


# ------------------------------------------------------------------------------ watching a job
class Watch:
    """Samples a launcher's process tree every `interval` s: each rank's resident set (by its
    RANK), the tree's, and the size of a folder (the NVMe swap), with the console's lines and
    when each arrived."""

    def __init__(self, cmd: list[str], env: dict, folder: Path | None, interval: float = 0.25):
        self.t0 = time.time()
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.busy0 = busy_cpu_seconds()  # the host's, to tell the job's CPU from others'
        self.busy1: float | None = None
        self.own_cpu: dict[int, float] = {}  # pid -> its CPU seconds at the last sample
        self.lines: list[tuple[float, str]] = []
        self.samples: list[tuple[float, dict[int, int], int]] = []  # (t, {rank: rss}, tree rss)
        self.disk_peak = 0
        self.folder, self.interval = folder, interval
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.time() - self.t0, line.rstrip("\n")))

    def _sample(self):
        root = psutil.Process(self.proc.pid)
        last_du = 0.0
        while self.proc.poll() is None:
            ranks, tree = {}, 0
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                break
            for p in procs:
                try:
                    rss = p.memory_info().rss
                    cpu = p.cpu_times()
                    self.own_cpu[p.pid] = cpu.user + cpu.system
                    tree += rss
                    rank = p.environ().get("RANK") if p is not root else None
                    if rank is not None and "python" in p.name():
                        ranks[int(rank)] = max(ranks.get(int(rank), 0), rss)
                except psutil.Error:
                    continue
            self.samples.append((time.time() - self.t0, ranks, tree))
            if self.folder is not None and time.time() - last_du > 2:
                self.disk_peak = max(self.disk_peak, folder_bytes(self.folder))
                last_du = time.time()
            time.sleep(self.interval)

    def wait(self, timeout: float) -> int:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
        self.busy1 = busy_cpu_seconds()
        self._reader.join(10)
        self._sampler.join(10)
        return self.proc.returncode

    def other_cores_busy(self) -> float | None:
        """Cores the host kept busy with work outside this job while it ran, on average."""
        wall = time.time() - self.t0
        if self.busy1 is None or wall <= 0:
            return None
        return max(0.0, self.busy1 - self.busy0 - sum(self.own_cpu.values())) / wall

    @property
    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def when(self, pattern: str) -> float | None:
        """Seconds from the start to the first line matching `pattern`."""
        rx = re.compile(pattern)
        return next((t for t, line in self.lines if rx.search(line)), None)

    def peak(self, start: float = 0.0, end: float = float("inf")) -> tuple[dict[int, int], int]:
        """({rank: peak RSS}, the tree's peak RSS) over samples in [start, end]."""
        ranks, tree = {}, 0
        for t, rs, tr in self.samples:
            if start <= t <= end:
                for r, v in rs.items():
                    ranks[r] = max(ranks.get(r, 0), v)
                tree = max(tree, tr)
        return ranks, tree


def folder_bytes(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_blocks * 512  # allocated, not apparent
            except OSError:
                continue
    return total


def timed(cmd: list[str], log: Path) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of cmd, its output in `log`."""
    with log.open("w") as f:
        wall, rss, rc = host_timed(cmd, REPO, stdout=f, stderr=f)
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed; see {log}")
    return wall, rss


# ------------------------------------------------------------------------------ one row
def parse_row(spec: str) -> dict:
    parts = spec.split(":")
    if len(parts) < 3 or (len(parts) == 4 and parts[3] != "ckpt") or len(parts) > 4:
        raise SystemExit(f"row {spec!r}: give PRESET:CONFIG:SEQ[:ckpt]")
    return {"preset": parts[0], "config": parts[1], "seq": int(parts[2]), "ckpt": len(parts) == 4}


def planned(row: dict, vocab: int, world: int, nvme_dir: Path) -> dict:
    from models import get_config
    from training.memory.capacity import capacity
    from training.memory.fit import resolve_file
    from training.memory.shape import shape_of_config
    from training.memory.verdict import check_run, in_memory, plan_name

    shape = shape_of_config(get_config(row["preset"], vocab_size=vocab), row["preset"])
    path = REPO / "ds_configs" / f"{row['config']}.json"
    host = capacity(host_mem_gib=None).host_bytes  # the trainer's hold decision
    cfg = resolve_file(path, shape, world, 1, "cpu", world, host)
    for s in ("offload_optimizer", "offload_param"):  # the swap folder the run will use
        sec = cfg.get("zero_optimization", {}).get(s, {})
        if sec.get("device") == "nvme":
            sec["nvme_path"] = str(nvme_dir)
    v = check_run(
        shape,
        cfg,
        world,
        config_name=f"ds_configs/{row['config']}.json",
        seq_len=row["seq"],
        activation_checkpointing=row["ckpt"],
        nvme_dir=str(nvme_dir),
    )
    p = v.plan
    return {
        "params": shape.params,
        "fits": v.fits,
        "needs": v.needs,
        "cheapest": v.cheapest and plan_name(v.cheapest),
        "per_rank_memory": in_memory(p),
        "per_rank_nvme": p.total("nvme"),
        "model_states": p.model_states,
        "categories": p.per_rank,
    }


def train_args(row: dict, data: str, out: Path, steps: int, extra=()) -> list[str]:
    """The trainer's arguments for a row; `extra` comes last, so it overrides (--save-every)."""
    args = ["training/train.py", "--data", data, "--out", str(out), "--model", row["preset"]]
    args += ["--ds_config", f"ds_configs/{row['config']}.json", "--seq-len", str(row["seq"])]
    args += ["--micro-batch", "1", "--grad-accum", "1", "--steps", str(steps), "--log-every", "1"]
    args += ["--eval-every", "0", "--eval-samples", "2", "--save-every", "0", "--warmup", "1"]
    return args + (["--activation-checkpointing"] if row["ckpt"] else []) + list(extra)


def torchrun(args: list[str], ranks: int) -> list[str]:
    port = 29500 + os.getpid() % 1000
    return ["nice", "-n", "10", *launcher_command("torchrun", ranks, args, port=port, python=PY)]


def run_row(row: dict, a) -> dict:
    name = row_name(row)
    work = Path(a.workdir) / name.replace(":", "_")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    run, nvme = work / "run", work / "run" / "nvme_swap"
    from data import load_manifest

    vocab = load_manifest(a.data).vocab_size
    result = {"row": name, **row, "ranks": a.ranks, "steps": a.steps, "vocab": vocab}
    result["forced"] = False
    result["code"] = code_record()  # what the row describes: a later table says when it aged
    result["plan"] = planned(row, vocab, a.ranks, nvme)  # the plan before the run, kept as is
    print(f"[{name}] plan: {'fits' if result['plan']['fits'] else 'does NOT fit'}", flush=True)
    try:
        if not result["plan"]["fits"]:
            result["refusal"] = refusal(row, a, run)
            if not a.force:
                return result
            result["forced"] = True  # measured against the plan that refused it
        result["disk"] = disk_room(result["plan"], work, a.ranks)
        if not result["disk"]["checkpoint"]:
            print(f"[{name}] {result['disk']['why']}: trained without a checkpoint", flush=True)
        # each phase is kept as soon as it is measured: a long row cut short still reports
        if row["config"].startswith("zero3") and not a.no_construction:
            result["construction"] = construction(row, a, work, vocab)
            save_result(result)
        result["train"] = train(row, a, run, nvme, result["forced"], result["disk"]["checkpoint"])
        save_result(result)
        if not result["disk"]["checkpoint"]:
            return result
        if not a.no_resume:
            result["resume"] = resume(row, a, run, result["train"])
            save_result(result)
        result["universal"], result["export"] = convert_and_export(run, work)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    return result


def save_result(result: dict) -> None:
    """Merge one row into the results file (read again first: another invocation may have
    added rows meanwhile) and redraw the document."""
    results = {**load_results(), result["row"]: result}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1))
    scale_doc.write_doc(with_plans(results), DOC)


def row_name(row: dict) -> str:
    return f"{row['preset']}:{row['config']}:{row['seq']}" + (":ckpt" if row["ckpt"] else "")


def refusal(row: dict, a, run: Path) -> dict:
    w = Watch(torchrun(train_args(row, a.data, run, a.steps), a.ranks), {}, None)
    code = w.wait(600)
    line = next((ln for _, ln in w.lines if ln.startswith("error:")), "")
    return {"line": line, "run_folder_made": run.exists(), "launcher_code": code}


def disk_room(plan: dict, work: Path, ranks: int) -> dict:
    """Whether the disk holds the swap files and the checkpoint at once (the checkpoint is
    saved while the swap files are still there; they are removed at the run's clean exit, so
    universal conversion and export then have the swap's room): a checkpoint is ~12 bytes a
    parameter (the fp32 master weights and Adam's two moments; 16-bit weights are within the
    margin), the swap is the plan's NVMe bytes on each rank."""
    free = shutil.disk_usage(work).free
    swap = plan["per_rank_nvme"] * ranks
    ckpt = 12 * plan["params"]
    ok = swap + ckpt * 1.05 < free
    g = scale_doc.gib
    why = f"swap {g(swap)} GiB + checkpoint ~{g(ckpt)} GiB vs {g(free)} GiB free on disk"
    return {"free": free, "swap": swap, "checkpoint_estimate": ckpt, "checkpoint": ok, "why": why}


def construction(row: dict, a, work: Path, vocab: int) -> dict:
    out = work / "construct.json"
    args = ["tests/scripts/construct_rss.py", row["preset"], str(out), row["config"], str(vocab)]
    args.append(str(work / "construct_swap"))
    w = Watch(torchrun(args, a.ranks), {}, None)
    if w.wait(3600) != 0:
        raise RuntimeError(f"construction failed:\n{w.output[-3000:]}")
    r = json.loads(out.read_text())
    shutil.rmtree(work / "construct_swap", ignore_errors=True)
    return {
        "seconds": max(x["seconds"] for x in r["ranks"]),
        "peak_rss": [x["peak"] for x in r["ranks"]],
        "grew": [x["peak"] - x["before"] for x in r["ranks"]],
        "fp32_bytes": r["fp32_bytes"],
    }


def train(row: dict, a, run: Path, nvme: Path, force: bool, checkpoint: bool) -> dict:
    extra = (["--force"] if force else []) + ([] if checkpoint else ["--save-every", "-1"])
    steps = a.steps
    if a.exact_resume:  # the schedule spans the resumed step too, as the uninterrupted run's
        steps, extra = a.steps + 1, [*extra, "--stop-at", str(a.steps)]
    host = host_record()
    w = Watch(torchrun(train_args(row, a.data, run, steps, extra), a.ranks), {}, nvme)
    code = w.wait(a.timeout)
    host.update(loadavg_after=list(os.getloadavg()), other_cores_busy=w.other_cores_busy())
    if code != 0:
        raise RuntimeError(f"training failed ({code}):\n{w.output[-4000:]}")
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("kind") == "train"]
    later = steps[1:] or steps
    first_step = w.when(r"train step 1\b|step\s+1/")
    last = w.when(rf"train step {a.steps}\b|step\s+{a.steps}/")
    saved = w.when(r"saved checkpoint")
    ranks, tree = w.peak()
    save_ranks, _ = w.peak(last or 0, saved or float("inf"))
    # where the peak falls: before the first step (construction, DeepSpeed's set-up, the
    # optimizer's swap files written) or in the steps
    setup_ranks, _ = w.peak(0, first_step or float("inf"))
    steps_ranks, _ = w.peak(first_step or 0, last or float("inf"))
    latest = run / "checkpoints" / "latest"
    tag = latest.read_text().strip() if checkpoint else None
    return {
        "peak_rss": [ranks.get(r, 0) for r in range(a.ranks)],
        "setup_peak_rss": [setup_ranks.get(r, 0) for r in range(a.ranks)],
        "steps_peak_rss": [steps_ranks.get(r, 0) for r in range(a.ranks)],
        "tree_peak_rss": tree,
        "nvme_peak_bytes": w.disk_peak,
        "tokens_per_s": sum(r["tokens_per_s"] for r in later) / len(later),
        "mfu": sum(r["mfu"] for r in later) / len(later),
        "step_seconds": [r.get("step_time") or r.get("seconds") for r in later],
        "to_first_step_s": first_step,
        "save_seconds": (saved - last) if saved and last else None,
        "save_peak_rss": [save_ranks.get(r, 0) for r in range(a.ranks)],
        "checkpoint_bytes": folder_bytes(run / "checkpoints" / tag) if tag else None,
        "wall_s": w.samples[-1][0] if w.samples else None,
        "loss": [r["loss"] for r in steps],
        "ceiling": ceiling_probes(records),
        "host": host,
    }


def ceiling_probes(records: list[dict]) -> dict:
    """The run's matmul ceiling (per rank) probed at its start and again at its end, and
    whether a step beat it (the loop then raised it), from its own record: what MFU divided by,
    so the table can tell an MFU that holds from one measured while the host changed speed."""

    def probe(when: str) -> dict:
        return next(
            (r for r in records if r.get("kind") == "ceiling" and r.get("when") == when), {}
        )

    start, end = probe("start"), probe("end")
    return {
        "source": start.get("source"),
        "start_per_rank_flops": start.get("per_rank_flops"),
        "end_per_rank_flops": end.get("per_rank_flops"),
        "raised": any(r.get("kind") == "ceiling" and r.get("when") == "raised" for r in records),
    }


def resume(row: dict, a, run: Path, trained: dict) -> dict:
    w = Watch(torchrun(train_args(row, a.data, run, a.steps + 1), a.ranks), {}, None)
    code = w.wait(a.timeout)
    if code != 0 or "resumed from" not in w.output:
        raise RuntimeError(f"resume failed ({code}):\n{w.output[-4000:]}")
    first = w.when(rf"train step {a.steps + 1}\b|step\s+{a.steps + 1}/")
    ranks, _ = w.peak()
    out = {
        "to_first_step_s": first,
        "fresh_to_first_step_s": trained["to_first_step_s"],
        "peak_rss": [ranks.get(r, 0) for r in range(a.ranks)],
    }
    if a.exact_resume:  # the same steps + 1 without a stop: the resumed step, to the bit?
        straight = run.parent / "straight"
        args = train_args(row, a.data, straight, a.steps + 1, ["--save-every", "-1"])
        if Watch(torchrun(args, a.ranks), {}, None).wait(a.timeout) != 0:
            raise RuntimeError("the uninterrupted run for the exact-resume check failed")
        got, want = (last_step(folder) for folder in (run, straight))
        out["exact"] = {"resumed": got, "uninterrupted": want, "equal": got == want}
        shutil.rmtree(straight, ignore_errors=True)
    return out


def last_step(run: Path) -> list:
    """[step, loss, grad norm] of a run's last logged training step."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    r = [x for x in map(json.loads, lines) if x.get("kind") == "train"][-1]
    return [r["step"], r["loss"], r["grad_norm"]]


def convert_and_export(run: Path, work: Path) -> tuple[dict, dict]:
    uni = timed([PY, "-m", "training.universal", str(run)], work / "universal.log")
    ckpts = run / "checkpoints"
    uni_folder = next((p for p in ckpts.iterdir() if "universal" in p.name), None)
    uni_bytes = folder_bytes(uni_folder) if uni_folder else None
    if uni_folder is not None:
        shutil.rmtree(uni_folder)  # before the export: the disk holds one big copy at a time
    hf = work / "hf"
    exp = timed([PY, "-m", "training.export", str(run), "--out", str(hf)], work / "export.log")
    exp_bytes = folder_bytes(hf)
    shutil.rmtree(hf, ignore_errors=True)
    return (
        {"seconds": uni[0], "peak_rss": uni[1], "bytes": uni_bytes},
        {"seconds": exp[0], "peak_rss": exp[1], "bytes": exp_bytes},
    )


# ------------------------------------------------------------------------------ the document
def with_plans(results: dict) -> dict:
    """Each row as stored, plus `plan_now`: the plan the planner makes for it today, beside the
    plan stored before it ran (`plan`) and what was measured then."""
    nvme = REPO / "runs" / "x"
    return {
        k: {**r, "plan_now": planned(parse_row(r["row"]), r["vocab"], r["ranks"], nvme)}
        for k, r in results.items()
    }


def load_results() -> dict:
    return json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="data_cache/pystdlib")
    ap.add_argument("--rows", default=",".join(DEFAULT_ROWS), help="PRESET:CONFIG:SEQ[:ckpt],...")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--workdir", default="runs/scale")
    ap.add_argument("--keep", action="store_true", help="keep each row's run folder")
    ap.add_argument("--timeout", type=float, default=7200, help="seconds per training launch")
    ap.add_argument("--no-resume", action="store_true", help="leave out the resume (long rows)")
    ap.add_argument(
        "--exact-resume",
        action="store_true",
        help="also run steps+1 without a stop and compare the resumed step with it",
    )
    ap.add_argument("--no-construction", action="store_true", help="leave out the build alone")
    ap.add_argument("--render", action="store_true", help="only redraw docs/scale.md")
    ap.add_argument(
        "--force", action="store_true", help="also run rows the plan refuses (to measure the plan)"
    )
    a = ap.parse_args(argv)
    if not a.render:
        for spec in a.rows.split(","):
            row = parse_row(spec)
            try:
                save_result(run_row(row, a))
            except RuntimeError as e:
                print(f"[{spec}] failed: {e}", file=sys.stderr, flush=True)
    results = with_plans(load_results())
    print(scale_doc.write_doc(results, DOC))
    return 0


if __name__ == "__main__":
    sys.exit(main())
