"""Preflight of a resume: the checkpoint's model against the one asked for."""

from __future__ import annotations

from models import from_llama_config
from models.lora import LoraSpec, stored_lora
from training.checkpoints.resume_point import ResumePlan
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


def check_resume_shape(
    plan: ResumePlan, model_cfg, model: str, lora: LoraSpec | None = None
) -> None:
    """The checkpoint's recorded model config (and --lora spec) against the requested one,
    before ranks start (a state-dict traceback on every rank otherwise)."""
    state = plan.trainer_state()
    saved_lora = stored_lora(state.get("lora"))
    if "lora" in state and saved_lora != lora:
        raise CheckpointError(
            f"{plan.root / plan.tag} was trained with --lora "
            f"{saved_lora and saved_lora.as_text()}, this run asks for --lora "
            f"{lora and lora.as_text()}; resume with the same --lora, or start a new run in "
            "another --out"
        )
    saved = state.get("model_config")
    if not isinstance(saved, dict):
        return  # an old checkpoint without it: the engine's load says
    if getattr(model_cfg, "model_type", None) == "llama":  # a Llama folder trains as our model
        model_cfg = from_llama_config(model_cfg)
    wanted = model_cfg.to_dict()
    for key in SHAPE_KEYS:
        if key in saved and key in wanted and saved[key] != wanted[key]:
            raise CheckpointError(
                f"{plan.root / plan.tag} holds a model with {key}={saved[key]!r}, but --model "
                f"{model} has {key}={wanted[key]!r}; resume with the model it was trained with, "
                "or start a new run in another --out (or --resume never)"
            )
