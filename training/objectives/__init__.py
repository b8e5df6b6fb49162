"""Training objectives other than next-token prediction, which the one loop trains through the
engine's micro-batch loss (engines/base.py `Engine.objective`): the DPO family on preference
pairs (dpo.py), with the reference model's log-probabilities computed once per run
(reference.py)."""

from training.objectives.dpo import OBJECTIVES, PreferenceLoss, figures, sequence_logps

__all__ = ["OBJECTIVES", "PreferenceLoss", "figures", "sequence_logps"]
