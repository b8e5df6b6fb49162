"""Preflight of a resume: the checkpoint's model against the one asked for."""

from __future__ import annotations

from training.checkpoints.resume import ResumePlan
from training.errors import CheckpointError

# What a checkpoint's weights depend on: a resume with another value cannot load them.
SHAPE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "tie_word_embeddings",
    "n_embd",
    "n_layer",
    "n_head",
)


def check_resume_shape(plan: ResumePlan, model_cfg, model: str) -> None:
    """The checkpoint's recorded model config against the requested one, before ranks start (a
    state-dict traceback on every rank otherwise)."""
    saved = plan.trainer_state().get("model_config")
    if not isinstance(saved, dict):
        return  # an old checkpoint without it: the engine's load says
    wanted = model_cfg.to_dict()
    for key in SHAPE_KEYS:
        if key in saved and key in wanted and saved[key] != wanted[key]:
            raise CheckpointError(
                f"{plan.root / plan.tag} holds a model with {key}={saved[key]!r}, but --model "
                f"{model} has {key}={wanted[key]!r}; resume with the model it was trained with, "
                "or start a new run in another --out (or --resume never)"
            )
