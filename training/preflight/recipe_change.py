"""Preflight of a resume: the recipe (sequence length, global batch, data) against the one the
checkpoint was trained with. A change is the user's decision, asked for by name with
--allow-recipe-change, never a side effect of a changed flag or a rewritten data folder."""

from __future__ import annotations

from training.checkpoints.resume_point import ResumePlan
from training.errors import CheckpointError, ConfigError
from training.settings.run_config import RunConfig

# name: (the flag that changes it, what to say)
RECIPE = {
    "seq_len": ("--seq-len", "sequence length"),
    "global_batch": ("--global-batch", "global batch"),
    "data": ("--data", "data"),
}


def allowed_changes(config: RunConfig) -> set[str]:
    """--allow-recipe-change as names; an unknown one is refused in one line."""
    text = config.checkpoint.allow_recipe_change or ""
    names = {n.strip().replace("-", "_") for n in text.split(",") if n.strip()}
    unknown = sorted(names - set(RECIPE))
    if unknown:
        raise ConfigError(
            f"--allow-recipe-change {text}: {', '.join(unknown)} is not a part of the recipe; "
            f"name any of {', '.join(RECIPE)}"
        )
    return names


def check_recipe(plan: ResumePlan | None, config: RunConfig, now: dict) -> dict[str, dict]:
    """The checkpoint's recipe against this run's (`now`: seq_len, global_batch, data, as the
    checkpoint records them). Returns {name: {"from": saved, "to": now}} for each allowed
    change (the run records them); raises CheckpointError naming the first change not allowed.
    A checkpoint that does not record a part (written before it was kept) is not held to it."""
    allowed = allowed_changes(config)
    if plan is None:
        return {}
    state = plan.trainer_state()
    # a checkpoint written before the optimizer was recorded is AdamW's (the only one then)
    kind = state.get("optimizer", "adamw")
    if kind != config.optim.optimizer:
        raise CheckpointError(
            f"{plan.root / plan.tag} was trained with --optimizer {kind}, this run asks for "
            f"--optimizer {config.optim.optimizer}: its optimizer states fit no other optimizer; "
            f"resume with --optimizer {kind}"
        )
    if plan.universal and config.optim.optimizer == "muon":
        raise CheckpointError(
            f"{plan.root / plan.tag}: --optimizer muon through a universal copy (another world "
            "size or layout): DeepSpeed's universal copy carries Adam's states, not Muon's "
            "momentum; resume on the checkpoint's own layout"
        )
    saved = {"seq_len": state.get("seq_len"), "global_batch": state.get("global_batch")}
    saved["data"] = state.get("data_sha256")
    changes = {}
    for name, (flag, what) in RECIPE.items():
        if saved[name] is None or saved[name] == now[name]:
            continue
        if name not in allowed:
            was, asked = _shown(name, saved[name], now[name], config)
            raise CheckpointError(
                f"{plan.root / plan.tag} was trained with {what} {was}, this run asks for "
                f"{asked}{_beyond(name, now[name], state)}: resume with the checkpoint's {flag}, "
                f"or change it on purpose with --allow-recipe-change {name}"
            )
        changes[name] = {"from": saved[name], "to": now[name]}
    return changes


def _shown(name: str, was, now, config: RunConfig) -> tuple[str, str]:
    if name == "data":  # checksums: name the folder asked for, and the first digits
        return f"sha256 {str(was)[:12]}", f"--data {config.data.path} (sha256 {str(now)[:12]})"
    return str(was), f"{RECIPE[name][0]} {now}"


def _beyond(name: str, now, state: dict) -> str:
    """For a longer sequence: where it passes the positions the checkpoint's model had."""
    positions = (state.get("model_config") or {}).get("max_position_embeddings")
    if name == "seq_len" and isinstance(positions, int) and now > positions:
        return f", beyond its model's {positions} positions"
    return ""
