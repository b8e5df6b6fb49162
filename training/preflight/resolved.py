"""The run's configuration as it runs: the tree that was asked for with every `auto` and every
"not given" made concrete from what preflight found (the DeepSpeed config as resolved, the
optimizer's numbers and the schedule, the precision, the attention kernel, the behaviour
switches), and why each of those has its value. train.py and everything below it read this
tree; resolved_config.json keeps it beside the tree asked for (`resolved`, `why`), and
RUN/run.yaml is this tree: its DeepSpeed config is the JSON itself, not a path, so the file
replays the run wherever it is passed back (`--config RUN/run.yaml`), and resolving it again
gives the same tree."""

from __future__ import annotations

from dataclasses import replace

from data.pairs import is_pairs
from training.settings import ds_config
from training.settings.run_config import RunConfig


def concrete(asked: RunConfig, found) -> tuple[RunConfig, dict[str, str]]:
    """(the tree, {setting path: why}) for `found`, a preflight.Prepared."""
    cfg, o, sch, sw = found.ds_config, found.optimizer, found.schedule, found.switches
    from_config = "not given: the DeepSpeed config's, else the default (settings/hparams.py)"
    why = {f"optim.{name}": from_config for name in _not_given(asked.optim)}
    optim = replace(
        asked.optim,
        micro_batch=cfg["train_micro_batch_size_per_gpu"],
        grad_accum=cfg["gradient_accumulation_steps"],
        global_batch=cfg["train_batch_size"],
        grad_clip=float(cfg.get("gradient_clipping") or 0.0),
        lr=o.lr,
        beta1=o.betas[0],
        beta2=o.betas[1],
        eps=o.eps,
        weight_decay=o.weight_decay,
        warmup=sch.warmup,
        min_lr_ratio=sch.min_lr_ratio,
        decay_steps=sch.decay if sch.kind == "wsd" else 0,
        objective=_objective(asked.optim.objective, found.manifest),
    )
    model = replace(
        asked.model,
        attention=found.attention,
        compile=sw.compile,
        activation_checkpointing=found.activation_checkpointing,
    )
    pipe = cfg.get("pipeline", {})
    engine = replace(
        asked.engine,
        ds_config=found.raw_config,
        precision=found.precision,
        pipeline_stages=ds_config.pipeline_stages(cfg) if pipe else None,
        pipeline_partition=pipe.get("partition", "parameters") if pipe else None,
    )
    # grad_sum, shm_collectives and keep_freed_memory stay as asked: they change no number
    # (each measured bit for bit against its off), only speed or memory on this host, and can
    # only be turned off, so a replay on another host decides them there
    host = replace(
        asked.host,
        hold_weights="on" if sw.hold_weights else "off",
        zero3_whole_blocks="on" if sw.zero3_whole_blocks else "off",
    )
    if asked.optim.objective == "auto":
        why["optim.objective"] = "auto: dpo on preference pairs, else next-token"
    choice = found.precision_choice
    why["engine.precision"] = choice.why if choice else "planned; measured once the ranks are up"
    why["model.attention"] = f"--attention {asked.model.attention} on {found.host.device_type}"
    why["model.activation_checkpointing"] = (
        "--activation-checkpointing or the config's activation_checkpointing section"
    )
    for switch, path in sw.settings().items():
        why[path] = sw.why.get(switch, "")
    device = found.host.device_type
    asked_auto = {path for path, _ in ds_config.auto_paths(found.raw_config or {})}
    for key in sorted(asked_auto & set(ds_config.DEVICE_AUTOS)):
        on = "on" if device != "cpu" else "off"
        why[f"ds_config.{key}"] = f"auto: {on} on {device} (settings/ds_config.py: DEVICE_AUTOS)"
    tree = replace(asked, optim=optim, model=model, engine=engine, host=host)
    return tree, why


def _objective(asked: str, manifest) -> str:
    """--objective auto made concrete: DPO on preference pairs, else next-token."""
    if asked != "auto":
        return asked
    return "dpo" if is_pairs(manifest) else "next-token"


def _not_given(section) -> list[str]:
    return [name for name, value in vars(section).items() if value is None]
