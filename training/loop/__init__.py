"""The one training loop (loop.py) and the small parts it composes: the schedule, the step timer,
the saver, the evaluator, the count of bad steps (divergence.py) and the rank-0 logger."""

from training.loop.logger import RunLogger
from training.loop.loop import LoopConfig, LoopState, run
from training.loop.saver import Saver
from training.loop.schedule import Schedule
from training.loop.validation import Evaluator

__all__ = ["Evaluator", "LoopConfig", "LoopState", "RunLogger", "Saver", "Schedule", "run"]
