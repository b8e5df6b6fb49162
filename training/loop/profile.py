"""`--profile A:B`: the torch profiler over optimizer steps A..B, on every rank, and where the
time went. Rank 0 writes RUN/profile/: `summary.json` and `summary.md` (each rank's time by kind
of work: matrix products, attention, elementwise, dtype copies, communication, the optimizer,
and what no op accounts for, Python and waiting), `ops_rank0.txt` (the op table) and
`trace_rank0.json` (open it in chrome://tracing or Perfetto). Profiled steps run a little slower
than the others; their tokens/s is not the run's."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from training.runtime.distributed import all_gather_object

# Op name -> kind of work, first match wins. Self time is counted, so a kind is what its own
# kernels took, not what they called.
KINDS = (
    (
        "communication",
        r"c10d|gloo|nccl|all_reduce|allreduce|all_gather|reduce_scatter|broadcast|"
        r"inference_all_reduce|record_param_comms|send|recv|barrier",
    ),
    ("matrix products", r"^aten::(mm|bmm|addmm|matmul|linear|baddbmm|_addmm_activation)$"),
    ("attention kernel", r"scaled_dot_product|flash_attention|_efficient_attention"),
    ("softmax and loss", r"softmax|cross_entropy|nll_loss|log_softmax"),
    ("optimizer", r"adam|_foreach_|cpu_adam"),  # not _fused_: rms_norm is fused too
    ("dtype copies", r"^aten::(copy_|_to_copy|to|clone|contiguous)$"),
    ("elementwise", r"^aten::"),
)


def parse_span(text: str | None) -> tuple[int, int] | None:
    """'5:8' -> (5, 8): profile steps 5 to 8 (1-based, inclusive). None stays None."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if not m or not 1 <= int(m[1]) <= int(m[2]):
        raise ValueError(f"--profile takes FIRST:LAST steps with 1 <= FIRST <= LAST, got {text!r}")
    return int(m[1]), int(m[2])


def kind_of(op: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, op):
            return kind
    return "other ops"


def summarize(events, wall_s: float) -> dict:
    """Seconds per kind of work from the profiler's key averages (self CPU time, plus self
    device time where there is a device), and the wall time no op accounts for."""
    seconds: dict[str, float] = {}
    for e in events:
        spent = (e.self_cpu_time_total + getattr(e, "self_device_time_total", 0)) / 1e6
        if spent > 0:
            kind = kind_of(e.key)
            seconds[kind] = seconds.get(kind, 0.0) + spent
    seconds["outside ops (Python, waiting)"] = max(0.0, wall_s - sum(seconds.values()))
    return {"wall_s": wall_s, "seconds": dict(sorted(seconds.items(), key=lambda kv: -kv[1]))}


class StepProfiler:
    """Start before step `first` begins, stop when step `last` ends; then write the files."""

    def __init__(self, span: tuple[int, int] | None, out: Path, is_main: bool, device_type: str):
        self.span, self.out, self.is_main = span, out, is_main
        self.activities = [ProfilerActivity.CPU]
        if device_type == "cuda":
            self.activities.append(ProfilerActivity.CUDA)
        self._prof = None
        self._t0 = 0.0
        self.summary: dict | None = None

    def before_step(self, step: int) -> None:
        """`step`: the step about to run (1-based)."""
        if self.span and step == self.span[0] and self._prof is None:
            self._prof = profile(activities=self.activities)
            self._prof.start()
            self._t0 = time.perf_counter()

    def after_step(self, step: int, logger) -> None:
        """`step`: the step just done. All ranks call (the summaries are gathered to rank 0)."""
        if self._prof is None or step < self.span[1]:
            return
        distributed = torch.distributed.is_initialized()
        if distributed:  # every rank's window ends together, so the walls compare
            torch.distributed.barrier()
        wall = time.perf_counter() - self._t0
        self._prof.stop()
        events = self._prof.key_averages()
        mine = summarize(events, wall)
        every = all_gather_object(mine) if distributed else [mine]
        steps = self.span[1] - self.span[0] + 1
        self.summary = {"steps": list(self.span), "per_rank": every}
        if self.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "summary.json").write_text(json.dumps(self.summary, indent=1) + "\n")
            (self.out / "summary.md").write_text(_table(every, self.span))
            table = events.table(sort_by="self_cpu_time_total", row_limit=60)
            (self.out / "ops_rank0.txt").write_text(table + "\n")
            self._prof.export_chrome_trace(str(self.out / "trace_rank0.json"))
            shares = ", ".join(
                f"{k} {v / mine['wall_s']:.0%}" for k, v in list(mine["seconds"].items())[:6]
            )
            logger.console(
                f"profile of steps {self.span[0]}-{self.span[1]} ({wall / steps:.3f} s a step on "
                f"rank 0): {shares}; {self.out}/summary.md"
            )
        self._prof = None


def _table(every: list[dict], span: tuple[int, int]) -> str:
    kinds = list(every[0]["seconds"])
    head = "| kind of work | " + " | ".join(f"rank {r}" for r in range(len(every))) + " |"
    lines = [
        f"# Where the time went, steps {span[0]}-{span[1]}",
        "",
        "Self time of each op, by kind, as a share of the profiled steps' wall time.",
        "",
        head,
        "|---|" + "---:|" * len(every),
    ]
    for kind in kinds:
        cells = [f"{r['seconds'].get(kind, 0.0) / r['wall_s']:.1%}" for r in every]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    lines.append("| wall seconds | " + " | ".join(f"{r['wall_s']:.3f}" for r in every) + " |")
    return "\n".join(lines) + "\n"
