"""The loop's checkpoint writer: what a checkpoint holds besides the engine's files (the trainer
state: step, tokens, data position, counters, and the run's facts a resume checks)."""

from __future__ import annotations

from pathlib import Path

from training.checkpoints import layout


class Saver:
    def __init__(
        self,
        engine,
        loader,
        logger,
        *,
        root: Path,
        keep_last: int,
        world: int,
        is_main,
        run_facts: dict,
    ):
        self.engine, self.loader, self.logger = engine, loader, logger
        self.root, self.keep_last, self.world, self.is_main = root, keep_last, world, is_main
        self.run_facts = run_facts  # backend, topology, model, data: what resume and export read

    def __call__(self, state) -> None:
        """All ranks call: checkpoint the end of step `state.step`."""
        trainer_state = {
            "step": state.step,
            "tokens": state.tokens,
            "skipped": state.skipped,
            "nonfinite": state.nonfinite,
            "data": self.loader.state_dict(),
            "world": self.world,
            **self.run_facts,
        }
        layout.save(self.engine, self.root, state.step, trainer_state, self.keep_last, self.is_main)
        self.logger.console(f"saved checkpoint {layout.tag_for(state.step)}")

    def latest(self) -> str | None:
        return layout.find_latest(self.root)
