"""Everything that can be checked before any process group or model exists, and every choice
made once for the whole run: the flags and the launcher's environment (command_line.py), the
run folder (run_folder.py), the DeepSpeed config (resolved by training/settings/ds_config.py),
the data, the model's config (model_folder.py), the precision (precision.py), what the engine
can do (engine.py), the memory plan (memory.py), what to resume from (resume.py), and the
behaviour switches (switches.py). A failure is one line, and nothing was written. A CPU's
precision is measured once the process group is up (`settle_precision`, called from
startup.py), every rank at once. This package is the one place below train.py that reads the
environment to decide anything (the launcher's layout, the host's memory)."""

from __future__ import annotations

import copy
import functools
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from data import load_data
from data.manifest import Manifest
from data.mixture import fingerprint
from models import pick_attention_kernel
from training.checkpoints.resume_point import ResumePlan, plan_resume
from training.checkpoints.universal_copy import Topology
from training.engines.base import OptimizerHparams
from training.loop.schedule import Schedule
from training.memory.shape import shape_of_config
from training.preflight import precision as precisions
from training.preflight.command_line import check_flags, check_launch_env
from training.preflight.engine_support import (
    check_chat_data,
    check_engine,
    check_lora,
    check_muon_model,
    check_parallel,
    check_preference_precision,
)
from training.preflight.followup_checks import background_bytes, plan_followups
from training.preflight.memory_fit import check_memory
from training.preflight.model_folder import (
    check_lengths,
    check_model,
    model_config,
    model_overrides,
)
from training.preflight.precision import Precision
from training.preflight.recipe_change import allowed_changes, check_recipe
from training.preflight.resolved import concrete
from training.preflight.resumed_model import check_resume_shape
from training.preflight.run_folder import check_out
from training.preflight.switches import (
    Host,
    Switches,
    compile_by_default,
    resolve_switches,
    this_host,
)
from training.runtime import build_locks, patches
from training.runtime.cluster import accelerate_ds_config
from training.runtime.distributed import accelerator
from training.settings import ds_config, nvme, parallel
from training.settings.run_config import RunConfig

# Where a DeepSpeed config held inside a run file came from, in its errors and the banner
INLINE_DS_CONFIG = "the run file's engine.ds_config"

__all__ = [
    "Precision",
    "Prepared",
    "Switches",
    "compile_by_default",
    "model_config",
    "model_overrides",
    "prepare_run",
    "rank0_printer",
    "settle_precision",
]


@dataclass(frozen=True, kw_only=True)
class Prepared:
    """What the checks found, for train.py to execute; `config` is the run's configuration as
    it runs (every `auto` made concrete, `why` says why: preflight/resolved.py)."""

    asked: RunConfig  # the configuration as given (flags over the run file)
    ds_config: dict  # resolved: no "auto" left, the batch triplet derived
    config_path: str
    precision: str  # bf16 | fp16 | fp32: what the run trains in (planned, until settled)
    precision_asked: str  # auto | bf16 | fp16 | fp32
    # Why, and the rates measured; None until settle_precision (a CPU measures once the process
    # group is up)
    precision_choice: Precision | None
    manifest: Manifest
    model_config: object  # the model's config (ours or any HF one), not the model
    topology: Topology  # this run's: what a checkpoint's files depend on
    resume: ResumePlan | None
    # The optimizer's numbers and the schedule: flag given > ds_config > default (hparams.py)
    optimizer: OptimizerHparams
    schedule: Schedule
    activation_checkpointing: bool = False  # the flag, or the config's section
    model_overrides: dict | None = None  # config fields the model is built with (positions)
    attention: str = "sdpa"  # our model's attention kernel, --attention made concrete
    switches: Switches = Switches()  # every behaviour switch, resolved (switches.py)
    # The DeepSpeed JSON as read (--nvme-path applied): what settle_precision re-resolves when a
    # CPU's measurement changes the plan, and what RUN/run.yaml holds
    raw_config: dict | None = None
    host: Host | None = None
    shape: object = None  # the model's counted shape (memory/shape.py)
    followups: tuple = ()  # background work on sealed checkpoints (loop/followups.py: Job)
    # what this resume changes of the checkpoint's recipe, as asked (recipe_change.py)
    recipe_changes: dict = field(default_factory=dict)

    @functools.cached_property
    def _resolved(self) -> tuple[RunConfig, dict]:
        return concrete(self.asked, self)

    @property
    def config(self) -> RunConfig:
        """The tree as the run uses it: every `auto` and "not given" made concrete."""
        return self._resolved[0]

    @property
    def why(self) -> dict[str, str]:
        """{setting path: why it has its value} for each setting preflight decided."""
        return self._resolved[1]

    @property
    def micro_batch(self) -> int:
        return self.ds_config["train_micro_batch_size_per_gpu"]

    @property
    def grad_accum(self) -> int:
        return self.ds_config["gradient_accumulation_steps"]


def prepare_run(config: RunConfig, world: int, rank: int = 0) -> Prepared:
    """Check a run before any work; raises ConfigError, DataError, ModelError or CheckpointError
    with one line."""
    check_flags(config)
    allowed_changes(config)  # its names, before the data is read
    followups = plan_followups(config)
    check_out(config)
    check_launch_env()
    device = accelerator().device_name()
    raw, cfg_path = load_config(config, device)
    log = rank0_printer(rank)
    manifest = load_data(config.data.path, config.data.seq_len, verify=True, log=log)
    overrides = model_overrides(config.model.name, config.data.seq_len, config.model.qk_norm)
    model_cfg = model_config(config.model.name, manifest.vocab_size, overrides)
    check_lengths(config, model_cfg, manifest)
    raw = nvme.override_path(raw, config.engine.nvme_path, cfg_path)
    shape = shape_of_config(model_cfg, config.model.name)  # counted on the meta device
    host = this_host(config, device, world)
    for line in patches.unverified_lines():  # each patch outside its verified versions, once
        log(f"warning: {line}")
    for line in build_locks.clear_stale():  # a killed op build: the run would wait on it silently
        log(line)
    want = precisions.asked(config.engine.precision, raw, cfg_path)
    precision = precisions.PLANNED if want == "auto" else want  # chosen at the end
    cfg, switches = resolve_with_switches(
        config, precisions.apply(raw, precision), cfg_path, host, shape, model_cfg
    )
    if config.engine.backend == "deepspeed" and nvme.nvme_sections(cfg):
        nvme.check_aio(cfg_path)
    check_engine(config, cfg, cfg_path, precision)
    if want != "auto":  # an "auto" is checked once chosen (repick)
        check_preference_precision(config, cfg, cfg_path, precision)
    check_model(config, model_cfg, manifest, ds_config.pipeline_stages(cfg), cfg_path)
    check_muon_model(config, model_cfg, cfg_path)
    attention = pick_attention_kernel(
        config.model.attention, device, config.data.seq_len, config.data.doc_mask
    )
    check_parallel(config, cfg, parallel.layout(cfg, world, cfg_path), model_cfg, cfg_path)
    check_chat_data(config, cfg, cfg_path, manifest)
    shape = check_lora(config, cfg, cfg_path, model_cfg, shape)
    if config.engine.backend == "deepspeed":
        background = background_bytes(followups, shape.params)
        check_memory(config, cfg, cfg_path, shape, world, host.ranks_here, background)
    now = topology(config.engine.backend, cfg, world)
    saved = config.checkpoint
    resume = plan_resume(saved.resume, Path(config.out), now, saved.universal, log)
    if resume is not None:
        check_resume_shape(resume, model_cfg, config.model.name, config.model.lora)
    recipe = {"seq_len": config.data.seq_len, "global_batch": cfg["train_batch_size"]}
    recipe["data"] = fingerprint(config.data.path) if resume is not None else None
    recipe_changes = check_recipe(resume, config, recipe)
    optimizer, schedule = ds_config.hyperparameters(
        cfg, config.optim, config.engine.backend, cfg_path
    )
    prepared = Prepared(
        asked=config,
        ds_config=cfg,
        config_path=cfg_path,
        precision=precision,
        precision_asked=want,
        precision_choice=None,
        manifest=manifest,
        model_config=model_cfg,
        topology=now,
        resume=resume,
        optimizer=optimizer_config(optimizer, config),
        schedule=Schedule(**schedule),
        activation_checkpointing=ds_config.activation_checkpointing(
            cfg, config.model.activation_checkpointing
        ),
        model_overrides=overrides,
        attention=attention,
        switches=switches,
        raw_config=raw,
        host=host,
        shape=shape,
        followups=followups,
        recipe_changes=recipe_changes,
    )
    return choose_precision(config, prepared)


def optimizer_config(values: dict, config: RunConfig) -> OptimizerHparams:
    """The engines' optimizer numbers from the resolved ones (hparams.py), with Muon's lr under
    --optimizer muon."""
    muon = config.optim.muon_lr if config.optim.optimizer == "muon" else None
    betas = tuple(values["betas"])
    return OptimizerHparams(values["lr"], betas, values["eps"], values["weight_decay"], muon)


def load_config(config: RunConfig, device: str) -> tuple[dict, str]:
    """The DeepSpeed JSON the run names (or accelerate hands over, or the backend's default,
    or a run file holds itself) and where it came from, its own mistakes refused before the
    data's checksums are read."""
    asked = config.engine.ds_config
    if isinstance(asked, dict):  # a run file's own copy (RUN/run.yaml)
        raw, cfg_path = copy.deepcopy(asked), INLINE_DS_CONFIG
    else:
        default = "zero2.json" if config.engine.backend == "deepspeed" else "zero0.json"
        cfg_path = accelerate_ds_config(asked) or str(ds_config.CONFIG_DIR / default)
        raw = ds_config.load_json(cfg_path)
    ds_config.precheck(
        raw, optim=config.optim, engine=config.engine, source=cfg_path, device_type=device
    )
    return raw, cfg_path


def topology(backend: str, cfg: dict, world: int) -> Topology:
    """This run's topology: what its checkpoint's files depend on."""
    return Topology(
        backend,
        world,
        ds_config.zero_stage(cfg),
        ds_config.pipeline_stages(cfg),
        parallel.tensor_size(cfg),
        parallel.sequence_size(cfg),
        parallel.expert_size(cfg),
        optimizer_on_nvme="offload_optimizer" in nvme.nvme_sections(cfg),
    )


def choose_precision(config: RunConfig, prepared: Prepared) -> Prepared:
    """The precision where it needs no measurement: an "auto" resume keeps its checkpoint's, a
    GPU takes what it supports, fp32 is fp32. A CPU's "auto", bf16 or fp16 is measured once the
    process group is up (settle_precision)."""
    want, device, resume = prepared.precision_asked, prepared.host.device_type, prepared.resume
    auto_resume = want == "auto" and resume is not None
    kept = resume.trainer_state().get("precision") if auto_resume else None
    if kept:
        # An exact resume continues in the precision its optimizer states were saved in.
        why = f"resuming {resume.tag}, saved in {kept}"
        return repick(config, prepared, Precision(kept, "auto", why))
    if not precisions.needs_probe(want, device):
        bf16 = device == "cpu" or accelerator().is_bf16_supported()
        return repick(config, prepared, precisions.decide(want, device, bf16_supported=bf16))
    return prepared


def settle_precision(
    config: RunConfig, prepared: Prepared, probed: dict[str, tuple[float, ...]]
) -> Prepared:
    """A CPU's precision, decided on the rates every rank measured together (`probed`: each
    rank's FLOP/s by dtype, runtime/flops.py: probe_ranks), the same on every rank. A run
    whose precision was already chosen is returned as it is."""
    if prepared.precision_choice is not None:
        return prepared
    rates = {name: sum(r) / len(r) for name, r in probed.items()}
    device = prepared.host.device_type
    return repick(
        config, prepared, precisions.decide(prepared.precision_asked, device, rates=rates)
    )


def probe_dtypes(prepared: Prepared) -> list[str]:
    """What settle_precision needs measured: the asked 16-bit dtype (bf16 for auto) and fp32;
    nothing once the precision is chosen."""
    if prepared.precision_choice is not None:
        return []
    asked = prepared.precision_asked
    return ["bf16" if asked == "auto" else asked, "fp32"]


def repick(config: RunConfig, prepared: Prepared, choice: Precision) -> Prepared:
    """The prepared run in `choice`'s precision: where it differs from what was planned, the
    config and the switches resolved anew, and the engine and memory checks run again."""
    if choice.name == prepared.precision:
        check_preference_precision(config, prepared.ds_config, prepared.config_path, choice.name)
        return replace(prepared, precision_choice=choice)
    raw, path, host = prepared.raw_config, prepared.config_path, prepared.host
    cfg, switches = resolve_with_switches(
        config,
        precisions.apply(raw, choice.name),
        path,
        host,
        prepared.shape,
        prepared.model_config,
    )
    check_engine(config, cfg, path, choice.name)
    check_preference_precision(config, cfg, path, choice.name)
    if config.engine.backend == "deepspeed":
        background = background_bytes(prepared.followups, prepared.shape.params)
        check_memory(config, cfg, path, prepared.shape, host.world, host.ranks_here, background)
    return replace(
        prepared, ds_config=cfg, switches=switches, precision=choice.name, precision_choice=choice
    )


def resolve_with_switches(
    config: RunConfig, raw: dict, cfg_path: str, host, shape, model_cfg
) -> tuple[dict, Switches]:
    """The DeepSpeed config with every "auto" resolved, and the switches decided on it. ZeRO-3's
    "auto" persistence threshold covers the whole model when the weights are held, so a held
    run's config is resolved once more with that."""
    kw = dict(
        world=host.world,
        optim=config.optim,
        engine=config.engine,
        activation_checkpointing=config.model.activation_checkpointing,
        swap=nvme.auto_values(config.engine.nvme_path, Path(config.out), model_cfg),
        hidden_size=model_cfg.hidden_size,
        source=cfg_path,
        device_type=host.device_type,
        params=shape.params,
    )
    ours = getattr(model_cfg, "model_type", "?") in ("zerostack", "llama")
    decided: list[Switches] = []

    def holds(cfg: dict) -> bool:  # the switches, decided on the config as first resolved
        precision = ds_config.precision(cfg)
        decided.append(
            resolve_switches(config, cfg, host, shape.params, ours=ours, precision=precision)
        )
        return decided[0].hold_weights

    return ds_config.resolve_held(raw, holds, **kw), decided[0]


def rank0_printer(rank: int):
    """print(line) to stderr on rank 0, nothing elsewhere: rank 0 speaks for all."""
    if rank != 0:
        return lambda line: None
    return lambda line: print(line, file=sys.stderr, flush=True)
