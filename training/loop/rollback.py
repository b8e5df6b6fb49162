"""Rolling back past the data: after --rollback-after skipped spikes or non-finite steps within
--rollback-window steps, every rank reloads the last checkpoint and its data reader skips the
samples those steps read, so the run goes on as if the data never had them. The spans skipped
are recorded in metrics.jsonl (a "rollback" record), in RUN/skipped_data.json and in every
later checkpoint; --skip-samples gives the same spans to a fresh run. More than
--max-rollbacks rollbacks stop the run as diverged (exit 3), keeping its checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

from training.checkpoints import layout
from training.checkpoints.resume_point import ResumePlan
from training.checkpoints.universal_copy import Topology
from training.errors import Diverged
from training.loop.restore import restore
from training.runtime import hang

RECORD = "skipped_data.json"


class Rollback:
    """Watches each step's trouble; `note` rolls the run back when it is due."""

    def __init__(
        self,
        after: int,
        window: int,
        limit: int,
        *,
        engine,
        loader,
        root: Path,
        rank: int,
        world: int,
        run_dir: Path,
        is_main: bool,
        guard=None,
        resumed: ResumePlan | None = None,
    ):
        self.after, self.window, self.limit = after, window, limit
        self.engine, self.loader, self.root = engine, loader, Path(root)
        self.rank, self.world, self.run_dir, self.is_main = rank, world, Path(run_dir), is_main
        self.troubles: list[tuple[int, tuple[int, int]]] = []  # (step, its [start, end) samples)
        self.guard = guard  # engines/spike_guard.py's history goes back with the weights
        # how the run's resume loaded its checkpoint: a rollback to that one loads it alike
        self.resumed = resumed

    def note(self, state, trouble: bool, span: tuple[int, int], saver, logger) -> bool:
        """Step `state.step`, which read global samples `span`, was skipped for `trouble` (a
        spike or a non-finite step). Returns True when the run was rolled back (`state` and the
        reader are then the checkpoint's). All ranks call alike. Raises Diverged past the limit."""
        if not self.after:
            return False
        if trouble:
            self.troubles.append((state.step, span))
        self.troubles = [t for t in self.troubles if t[0] > state.step - self.window]
        if not trouble or len(self.troubles) < self.after:
            return False
        steps = [s for s, _ in self.troubles]
        saver.settle()
        tag = saver.latest()
        if state.rollbacks >= self.limit or tag is None:
            why = (
                "no checkpoint was written" if tag is None else f"after {state.rollbacks} rollbacks"
            )
            raise Diverged(
                f"{len(steps)} steps within {self.window} (steps {', '.join(map(str, steps))}) "
                f"were skipped as spikes or non-finite, and the run cannot roll back again ({why}); "
                f"the last good checkpoint is {tag or 'none'}. Lower --lr, raise --warmup, or check "
                "the data; --rollback-after, --rollback-window and --max-rollbacks set this"
            )
        hang.pause()  # a reload is no step
        try:
            self._reload(state, tag)
        finally:
            hang.resume()
        spans = [list(s) for _, s in self.troubles]
        self.loader.skip([s for _, s in self.troubles])
        state.rollbacks += 1
        record = {
            "kind": "rollback",
            "step": steps[-1],
            "to_step": state.step,
            "checkpoint": tag,
            "trouble_steps": steps,
            "skipped_samples": spans,
            "rollbacks": state.rollbacks,
            "note": f"{self._steps(steps)} skipped as spikes or non-finite: rolled back to "
            f"{tag}; the samples read in them ({self._said(spans)}) are skipped from now on",
        }
        logger.log(record)
        if self.is_main:
            self._write_record(record)
        self.troubles.clear()
        return True

    def _reload(self, state, tag: str) -> None:
        """Back to checkpoint `tag` through the resume's own path (loop/restore.py), so one
        written on another world size, stage or layout loads through its universal copy."""
        back = restore(self._plan(tag), self.engine, self.loader, self.rank, self.world)
        # the counters of skipped steps keep what happened; the rest is the checkpoint's
        state.step, state.tokens = back.step, back.tokens
        if self.guard is not None:  # judged from here as it was at the checkpoint
            self.guard.load_state_dict(back.guard)

    def _plan(self, tag: str) -> ResumePlan:
        """How checkpoint `tag` of the run's folder loads: as the run's resume loaded it, when it
        is the one the run resumed from; else natively (the run wrote it, on this layout)."""
        resumed = self.resumed
        if (
            resumed is not None
            and resumed.tag == tag
            and resumed.root.resolve() == self.root.resolve()
        ):
            return resumed
        saved = layout.load_trainer_state(self.root, tag)
        return ResumePlan(self.root, tag, False, Topology.of_checkpoint(saved), "a rollback")

    def _write_record(self, record: dict) -> None:
        path = self.run_dir / RECORD
        try:
            old = json.loads(path.read_text()) if path.is_file() else {}
        except ValueError:
            old = {}
        rollbacks = [*old.get("rollbacks", []), {k: v for k, v in record.items() if k != "note"}]
        skip = sorted({tuple(s) for r in rollbacks for s in r["skipped_samples"]})
        text = json.dumps(
            {"skip_samples": ",".join(f"{a}:{b}" for a, b in skip), "rollbacks": rollbacks},
            indent=1,
        )
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        tmp.replace(path)

    @staticmethod
    def _steps(steps) -> str:
        return (
            f"step {steps[0]} was"
            if len(steps) == 1
            else f"steps {', '.join(map(str, steps))} were"
        )

    @staticmethod
    def _said(spans) -> str:
        return ", ".join(f"{a}:{b}" for a, b in spans)
