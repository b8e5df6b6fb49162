"""Running the matrix's cases as real multi-rank jobs and judging each against matrix.yaml.

A case is one combination of the axes. Its job trains `steps` steps (a resume: to `resume_at`
on the case's layout, then on the layout `resume_on` names); it is then

    match    it trained, its losses stay within the bound of its reference's at every step, and
             every parameter several ranks hold whole was identical on all of them at the end
             (the run's `replicas` record)
    refused  it was refused before any work with one line, and a rule of matrix.yaml says so
             with that line
    bug      anything else: a gap past the bound, replicas that differ, a refusal no rule
             expects (or another line), a combination a rule refuses that trained, a crash

The reference is the same objective, model, LoRA and data on 1 rank (matrix.yaml `reference`),
run once per such key and kept in the work folder."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.matrix import inputs
from benchmarks.matrix.cases import Matrix, case_id

REPO = Path(__file__).resolve().parents[2]
# (the trainer's argv, ranks) -> the finished launch
Launch = Callable[[list[str], int], subprocess.CompletedProcess]


def torchrun(args: list[str], ranks: int) -> subprocess.CompletedProcess:
    """The trainer as `ranks` ranks under torchrun, as a user launches it."""
    from launch.launcher_argv import launcher_command
    from training.runtime.distributed import free_port

    cmd = launcher_command("torchrun", ranks, ["training/train.py", *args], port=free_port())
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)


@dataclass
class Inputs:
    """The data and model folders the cases train on, made once under `work`."""

    work: Path
    made: dict = field(default_factory=dict)

    def data(self, kind: str) -> Path:
        if kind not in self.made:
            text = self._text()
            self.made[kind] = {
                "text": lambda: text,
                "chat": lambda: inputs.chat_data(text, self._fresh("chat")),
                "pairs": lambda: inputs.pair_data(text, self._fresh("pairs"))["data"],
            }[kind]()
        return self.made[kind]

    def folder(self, kind: str) -> Path:
        key = f"hf_{kind}"
        if key not in self.made:
            self.made[key] = inputs.hf_folder(kind, self._fresh(key))
        return self.made[key]

    def _text(self) -> Path:
        if "text" not in self.made:
            self.made["text"] = inputs.text_data(self._fresh("text") / "pystdlib-tiny")
        return self.made["text"]

    def _fresh(self, name: str) -> Path:
        path = self.work / "inputs" / name
        path.mkdir(parents=True, exist_ok=True)
        return path


@dataclass
class Runner:
    """Runs cases of `matrix` under `work`, launching with `launch`."""

    matrix: Matrix
    work: Path
    launch: Launch = torchrun
    references: dict = field(default_factory=dict)

    def __post_init__(self):
        self.inputs = Inputs(self.work)

    def run(self, case: dict[str, str]) -> dict:
        """The case's result record (what results.json keeps)."""
        started = time.perf_counter()
        rules = self.matrix.refusals(case)
        out = self.work / "runs" / case_id(case)
        first = self._launch(case, case["layout"], out, stop=case["resume"] != "none")
        result = {"id": case_id(case), "case": case, "bound": self.matrix.bound(case)}
        if first.returncode != 0:
            result |= _judge_refusal(first, rules)
        else:  # a rule may refuse its resume, not its first launch
            result |= self._judge_trained(case, out)
        result["seconds"] = round(time.perf_counter() - started, 1)
        return result

    def _judge_trained(self, case: dict[str, str], out: Path) -> dict:
        if case["resume"] != "none":
            target = self.matrix.raw["resume_on"][case["resume"]][case["layout"]]
            ranks = 1 if case["resume"] == "world" else None
            second = self._launch(case, target, out, ranks=ranks)
            if second.returncode != 0:  # a resume refused, as a rule may say, or a bug
                return _judge_refusal(second, self.matrix.refusals(case))
        if self.matrix.refusals(case):
            return {"outcome": "bug", "why": "trained, but a rule refuses it"}
        losses = _losses(out)
        reference = self._reference(case)
        steps = int(self.matrix.raw["steps"])
        if sorted(losses) != list(range(1, steps + 1)):
            return {"outcome": "bug", "why": f"logged steps {sorted(losses)}, not 1-{steps}"}
        gaps = [abs(losses[s] - reference[s]) / abs(reference[s]) for s in range(1, steps + 1)]
        replicas = _replicas(out)
        result = {"gap": max(gaps), "losses": [losses[s] for s in range(1, steps + 1)],
                  "replicas": replicas}  # fmt: skip
        if max(gaps) > self.matrix.bound(case):
            return result | {"outcome": "bug", "why": f"loss gap {max(gaps):.2e} past the bound"}
        if replicas and replicas.get("differ"):
            return result | {"outcome": "bug", "why": f"replicas differ: {replicas['differ']}"}
        return result | {"outcome": "match"}

    def _reference(self, case: dict[str, str]) -> dict[int, float]:
        """The reference's loss at each step, run once per objective, model, LoRA, optimizer
        and mask."""
        mask = "doc_mask" if case["feature"] == "doc_mask" else "plain"
        key = (case["objective"], case["model"], case["lora"], case["optimizer"], mask)
        if key not in self.references:
            out = self.work / "references" / "-".join(key)
            ref = {**case, "feature": mask, "resume": "none", "precision": "fp32"}
            spec = self.matrix.raw["reference"]
            done = self._launch(ref, None, out, ranks=int(spec["ranks"]), extra=spec["args"])
            if done.returncode != 0:
                raise RuntimeError(f"the reference {'-'.join(key)} failed: {_one_line(done)}")
            self.references[key] = _losses(out)
        return self.references[key]

    def _launch(self, case, layout, out: Path, stop=False, ranks=None, extra=()):
        """One launch of the case's job on `layout` (None: the reference's own args)."""
        axes, raw = self.matrix.axes, self.matrix.raw
        objective, model = axes["objective"][case["objective"]], axes["model"][case["model"]]
        args = ["--data", str(self.inputs.data(objective["data"])), "--out", str(out)]
        if "folder" in model:
            args += ["--model", str(self.inputs.folder(model["folder"]))]
        args += [*model.get("args", []), *objective.get("args", [])]
        for axis in ("lora", "optimizer", "precision", "feature"):
            args += axes[axis][case[axis]].get("args", [])
        if layout is not None:
            args += axes["layout"][layout]["args"]
        args += [*raw["common"], *extra, "--global-batch", str(raw["global_batch"])]
        args += ["--steps", str(raw["steps"])]
        if stop:
            args += ["--stop-at", str(raw["resume_at"])]
        n = ranks or int(axes["layout"][layout]["ranks"])
        done = self.launch(args, n)
        logs = self.work / "logs"  # each launch's output, beside (not in) its run folder
        logs.mkdir(parents=True, exist_ok=True)
        name = f"{out.name}-{'reference' if layout is None else layout}-{n}"
        (logs / f"{name}.log").write_text(f"$ {' '.join(args)}\n{done.stdout}\n{done.stderr}")
        return done


def _judge_refusal(done: subprocess.CompletedProcess, rules) -> dict:
    """A failed first launch: a refusal is one `error:` line, no traceback, every failed rank
    exiting 2 (training/errors.py's code for a refused configuration)."""
    line = _one_line(done)
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error: ")]
    codes = set(rank_exit_codes(done))
    # every rank refuses with 2; a launcher may have stopped a slower one first (SIGTERM)
    if len(errors) != 1 or rank_tracebacks(done.stderr) or 2 not in codes or codes - {2, -15}:
        return {"outcome": "bug", "why": f"failed (ranks exited {sorted(codes)}): {line}"}
    if not rules:
        return {"outcome": "bug", "refusal": line, "why": "refused, but no rule expects it"}
    if not any(rule.says in line for rule in rules):
        said = " or ".join(repr(r.says) for r in rules)
        return {"outcome": "bug", "refusal": line, "why": f"refused, but not with {said}"}
    return {"outcome": "refused", "refusal": line}


def rank_tracebacks(stderr: str) -> list[str]:
    """The tracebacks a failed launch's ranks printed: torchrun's own, which it prints whenever
    a rank fails (ChildFailedError, with its failure summary), is not one of them."""
    blocks = stderr.split("Traceback (most recent call last):")[1:]
    return [b for b in blocks if "ChildFailedError" not in b]


def rank_exit_codes(run: subprocess.CompletedProcess | str) -> list[int]:
    """What the ranks that failed a run exited with, sorted: as the test suite's rank server
    saw them (`failures`), or as torchrun's failure summary in the run's output gives them."""
    if hasattr(run, "failures"):
        return sorted(run.failures.values())
    text = run if isinstance(run, str) else run.stdout + run.stderr
    return sorted(int(c) for c in re.findall(r"exitcode\s+:\s*(-?\d+)", text))


def _one_line(done: subprocess.CompletedProcess) -> str:
    """The refusal's line (`error: ...`), else the failed run's last line that names an error,
    else its last line."""
    lines = [ln for ln in done.stderr.splitlines() + done.stdout.splitlines() if ln.strip()]
    said = [ln for ln in lines if ln.startswith("error: ")]
    named = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (said or named[-1:] or lines[-1:] or [""])[0][:400]


def _losses(out: Path) -> dict[int, float]:
    """Each step's loss as the run last logged it."""
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r.get("kind") == "train"}


def _replicas(out: Path) -> dict | None:
    """The run's last replica check (None: the run wrote none)."""
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    found = [r for r in rows if r.get("kind") == "replicas"]
    return found[-1] if found else None


def merge(results_path: Path, fresh: list[dict], host: str, date: str) -> dict:
    """results.json with `fresh` results replacing those of the same cases."""
    old = json.loads(results_path.read_text()) if results_path.is_file() else {"cases": []}
    kept = {r["id"]: r for r in old["cases"]}
    for r in fresh:
        kept[r["id"]] = {**r, "host": host, "date": date}
    merged = {"cases": sorted(kept.values(), key=lambda r: r["id"])}
    results_path.write_text(json.dumps(merged, indent=1) + "\n")
    return merged
