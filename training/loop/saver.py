"""The loop's checkpoint writer: what a checkpoint holds besides the engine's files (the trainer
state: step, tokens, data position, counters, and the run's facts a resume checks), and when it
is sealed.

Synchronous (the default), a save returns sealed. With --async-save the loop waits only while
the engine's states are copied to host memory; each rank's thread writes and fsyncs the files
(checkpoints/background.py), and the checkpoint is sealed by `poll` at the first step boundary
where every rank's writer is done (one small all-reduce a step while a save is in flight).
Until then the previous sealed checkpoint stays `latest`. At most one save is in flight: a new
one first waits for the previous one and seals it. At a stop signal the save in flight gets
STOP_GRACE_S to finish; one that does not is left unsealed and the run says which checkpoint a
re-run resumes from."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from training.checkpoints import layout
from training.runtime.distributed import all_reduce_scalars
from training.settings.run_config import CheckpointConfig

# What a save in flight gets to finish after a stop signal: well inside the 30 s a scheduler
# usually allows between SIGTERM and SIGKILL, leaving room to exit.
STOP_GRACE_S = 20.0


@dataclass
class InFlight:
    """A background save not sealed yet, and what of it the loop has waited for so far."""

    step: int
    writer: object  # checkpoints/background.py: BackgroundWriter
    stage_s: float  # the loop blocked while the states were copied
    wait_s: float = 0.0  # ... waiting for the writers (a save came due first, the run's end)


class Saver:
    def __init__(
        self,
        engine,
        loader,
        logger,
        *,
        checkpoint: CheckpointConfig,
        root: Path,
        world: int,
        is_main,
        run_facts: dict,
        device=None,
        followups=None,
        guard=None,
    ):
        """`checkpoint`: the run's checkpoint section (how many to keep, --async-save)."""
        self.engine, self.loader, self.logger = engine, loader, logger
        self.root, self.world, self.is_main = root, world, is_main
        self.keep_last, self.async_save = checkpoint.keep_last, checkpoint.async_save
        self.run_facts = run_facts  # backend, topology, model, data: what resume and export read
        self.device = device
        self.pending: InFlight | None = None
        # rank 0's background work on sealed checkpoints (loop/followups.py), else None
        self.followups = followups
        self.guard = guard  # engines/spike_guard.py: its history goes into each checkpoint

    def __call__(self, state) -> None:
        """All ranks call: checkpoint the end of step `state.step` (with --async-save: start
        writing it, after sealing the save still in flight)."""
        trainer_state = {
            "step": state.step,
            "tokens": state.tokens,
            "skipped": state.skipped,
            "nonfinite": state.nonfinite,
            "skipped_by": dict(state.skipped_by),
            "rollbacks": state.rollbacks,
            "spike_guard": self.guard.state_dict() if self.guard is not None else None,
            "data": self.loader.state_dict(),
            "world": self.world,
            **self.run_facts,
        }
        tag = layout.tag_for(state.step)
        if not self.async_save:
            started = time.perf_counter()
            layout.save(
                self.engine,
                self.root,
                state.step,
                trainer_state,
                self.keep_last,
                self.is_main,
                busy=self._busy(),
            )
            took = time.perf_counter() - started
            self.logger.log(
                {
                    "kind": "checkpoint",
                    "step": state.step,
                    "async": False,
                    "stall_s": round(took, 4),
                }
            )
            self.logger.console(f"saved checkpoint {tag}")
            self._sealed(state.step)
            return
        self.settle()
        started = time.perf_counter()
        writer = layout.save_async(self.engine, self.root, state.step, trainer_state, self.is_main)
        stage = time.perf_counter() - started
        self.pending = InFlight(state.step, writer, stage)
        self.logger.console(
            f"saving checkpoint {tag} in the background (the loop waited {stage:.2f} s for a "
            f"{writer.staged_bytes / 2**20:,.1f} MiB host copy on rank 0)"
        )

    def poll(self) -> None:
        """All ranks call at every step boundary: seal the save in flight once every rank's
        writer is done; rank 0 tends its background work."""
        if self.followups is not None:
            self.followups.poll()
        if self.pending is None:
            return
        busy = all_reduce_scalars([0.0 if self.pending.writer.done() else 1.0], self.device, "max")
        if not busy[0]:
            self._seal()

    def settle(self, timeout: float | None = None) -> bool:
        """All ranks call: wait for the save in flight (up to `timeout` s) and seal it. False
        when some rank's writer did not finish in time: then nothing is sealed."""
        if self.pending is None:
            return True
        started = time.perf_counter()
        done = self.pending.writer.wait(timeout)
        late = all_reduce_scalars([0.0 if done else 1.0], self.device, "max")
        self.pending.wait_s += time.perf_counter() - started
        if late[0]:
            return False
        self._seal()
        return True

    def stop(self, state, saved: bool) -> str:
        """All ranks call at an agreed stop: save step `state.step` unless `saved` and seal it;
        a save in flight gets STOP_GRACE_S. Returns the tag a re-run resumes from."""
        if self.pending is not None and self.pending.step != state.step:
            if not self.settle(STOP_GRACE_S):
                return self._unfinished()
        if not saved:
            self(state)
        if not self.settle(STOP_GRACE_S):
            return self._unfinished()
        return layout.tag_for(state.step)

    def _unfinished(self) -> str:
        tag, latest = layout.tag_for(self.pending.step), self.latest()
        self.logger.console(
            f"the background save of {tag} did not finish within {STOP_GRACE_S:.0f} s of the "
            f"stop: it stays unsealed (set aside on the next start); a re-run resumes from "
            f"{latest or 'step 0 (no sealed checkpoint)'}"
        )
        self.pending = None
        return latest

    def _seal(self) -> None:
        p, self.pending = self.pending, None
        started = time.perf_counter()
        layout.seal(self.root, p.step, p.writer, self.keep_last, self.is_main, self._busy())
        seal = time.perf_counter() - started
        written = (p.writer.finished or time.monotonic()) - p.writer.started
        self.logger.log(
            {
                "kind": "checkpoint",
                "step": p.step,
                "async": True,
                # what the loop was blocked for this save: the copy, any wait, the seal
                "stall_s": round(p.stage_s + p.wait_s + seal, 4),
                "stage_s": round(p.stage_s, 4),
                "wait_s": round(p.wait_s, 4),
                "seal_s": round(seal, 4),
                "write_s": round(written, 4),
                "staged_bytes": p.writer.staged_bytes,
            }
        )
        self.logger.console(
            f"saved checkpoint {layout.tag_for(p.step)} (written in the background in "
            f"{written:.2f} s; sealed now)"
        )
        self._sealed(p.step)

    def _busy(self) -> frozenset:
        return frozenset(self.followups.busy()) if self.followups is not None else frozenset()

    def _sealed(self, step: int) -> None:
        if self.followups is not None:
            self.followups.sealed(step)

    def stop_followups(self) -> None:
        """A stop signal: rank 0 ends its background work (a re-run starts again what its latest
        checkpoint lacks). At the run's end train.py waits for it instead, after the process
        group is gone."""
        if self.followups is not None:
            self.followups.stop()

    def latest(self) -> str | None:
        return layout.find_latest(self.root)
