"""A run's record: `RUN/resolved_config.json`, everything needed to reproduce the run (flags, the
final DeepSpeed JSON, the model config, the data, where each rank ran, versions, the commit), and
the one-line banner rank 0 prints before the first step."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import deepspeed
import torch
import transformers

from data import BatchLoader
from data.mixture import fingerprint, parse_spec
from models.hub import resolve_pretrained
from training.runtime import cluster, nccl_env, patches
from training.runtime.flops import cpu_name
from training.runtime.shm import routed_dtypes as shm_routed_dtypes
from training.settings import ds_config, parallel, runfile
from training.settings.run_config import flat, nested

REPO = Path(__file__).resolve().parent.parent


def run_record(
    *,
    prepared,
    facts: dict,
    engine,
    dist,
    ranks: list[dict],
    shm: bool,
    accelerate_state: dict | None,
    ceiling,
    resume=None,
) -> dict:
    """What resolved_config.json holds. `facts`: the built model's n_params, flops_per_token and
    model_config; `ceiling`: the run's matmul ceiling (runtime/flops.py: Ceiling). `flags` holds
    every setting by its flag's name as the run uses it (every auto made concrete)."""
    layout = engine.layout()
    return {
        **settings_record(prepared),
        "ds_config_file": prepared.config_path,
        "lora_spec": prepared.config.model.lora and prepared.config.model.lora.as_record(),
        "schedule": prepared.schedule.kind,
        "ds_config": prepared.ds_config,
        "model_config": facts["model_config"].to_dict(),
        "n_params": facts["n_params"],
        "trainable_params": facts.get("trainable_params"),
        "flops_per_token": facts["flops_per_token"],
        "compiled": facts.get("compiled"),  # --compile: what torch.compile compiled
        "attention": facts.get("attention"),  # the kernel; for SDPA, which of its kernels runs
        "data": data_record(prepared.config.data.path, prepared.manifest),
        "world": dist.world,
        "launched_by": dist.launcher,  # whose variables gave the rank (runtime/launcher.py)
        # world = data x tensor x sequence x pipeline (settings/parallel.py)
        "parallel": asdict(parallel.layout(prepared.ds_config, dist.world, "config"))
        | {"data": engine.dp_world},
        "pipeline": layout
        and {"stages": len(layout), "data_parallel": engine.dp_world, "layers": layout},
        "ranks": ranks,
        "resume": resume
        and {
            "checkpoint": str(resume.root / resume.tag),
            "universal": resume.universal,
            "why": resume.why,
            # what it changes of the checkpoint's recipe, asked by --allow-recipe-change
            "recipe_changes": prepared.recipe_changes,
        },
        **({"accelerate": accelerate_state} if accelerate_state else {}),
        "backend": dist.backend,
        # on NCCL: error handling, error propagation and the flight recorder (runtime/nccl_env.py)
        "nccl_env": nccl_env.in_effect(dist.backend),
        # every behaviour switch as preflight resolved it, and why (training/preflight/switches.py)
        "switches": prepared.switches.as_record(),
        # how many ranks run on this host, and which launcher said so (runtime/launcher.py)
        "host_layout": prepared.host
        and {
            "launcher": prepared.host.launcher,
            "ranks_on_this_host": prepared.host.ranks_here,
            "one_host": prepared.host.ranks_here == dist.world,
        },
        # each patch into DeepSpeed's / torch's internals: applied, or the stock path and why
        "patches": patches.as_record(),
        "shm_collectives": shm,
        # what the route reduces in shared memory on this CPU (the rest goes to gloo)
        "shm_collectives_dtypes": shm_routed_dtypes() if shm else [],
        # ZeRO-3 gathers each transformer block whole (engines/ds.py: gather_blocks_whole)
        "zero3_blocks_whole": engine.blocks_whole,
        # ZeRO-3 and FSDP2 keeping weights gathered across micro-steps (one CPU host)
        "held_across_micro_steps": engine.hold,
        # ZeRO-1/2 summing gradients over a loss divided by the world (engines/ds.py)
        "gradients_summed": engine.sums_gradients,
        # what the loss is: next-token, or the DPO family on preference pairs (objectives/)
        "objective": getattr(engine.objective, "describe", lambda: "next-token")(),
        "device": str(dist.device),
        "precision": prepared.precision,
        # what was asked, what was picked and why, the rates it was measured by (CPU)
        "precision_choice": prepared.precision_choice.as_record(),
        "peak_flops_per_rank": ceiling.per_rank,  # what MFU divides by, times world
        "peak_flops": ceiling.as_record(),  # where that came from, each rank's probe
        "versions": versions(),
        "git_commit": git_commit(),
    }


def settings_record(prepared) -> dict:
    """The run's configuration three ways: as asked (`config`), as the run used it (`resolved`,
    every auto made concrete and the DeepSpeed config held whole, with `why`: the run file that
    replays the run, --config), and flat by flag name (`flags`, the resolved values)."""
    return {
        "config": nested(prepared.asked),
        "resolved": nested(prepared.config),
        "why": prepared.why,
        "flags": flat(prepared.config),
    }


def data_record(spec: str, manifest) -> dict:
    """Where the data is (its first folder holds the tokenizer) and what it was made from."""
    return {
        "dir": str(Path(parse_spec(spec)[0].folder).resolve()),
        "spec": spec,
        "sha256": fingerprint(spec),  # manifests and weights: a resume compares it
        "source": manifest.source,
        "tokenizer_sha256": getattr(manifest, "tokenizer_sha256", None),
    }


def write_record(run_dir: Path, record: dict, manifest) -> None:
    """Rank 0: resolved_config.json, and the run's own copy of the tokenizer (so exports work
    after the data folder moves)."""
    (run_dir / "resolved_config.json").write_text(json.dumps(record, indent=1, default=str))
    runfile.dump(record["resolved"], run_dir / "run.yaml", replay_header(record, run_dir.name))
    shutil.copytree(manifest.tokenizer_dir, run_dir / "tokenizer", dirs_exist_ok=True)


# What preflight decides by the host it runs on: a replay elsewhere may not run these
HOST_DECIDED = ("engine.precision", "model.attention", "model.compile", "host.")


def replay_header(record: dict, name: str) -> str:
    """run.yaml's opening comment: what the file is, how to replay it, and the values this
    host decided (another host may refuse them, each in one line naming the setting)."""
    resolved = record["resolved"]
    decided = [
        f"{path}={resolved[path.split('.')[0]][path.split('.')[1]]}"
        for path in record["why"]
        if path.startswith(HOST_DECIDED) and path.count(".") == 1
    ]
    return (
        "The run as it ran: every auto made concrete, and the DeepSpeed config "
        f"({record['ds_config_file']}) held whole.\n"
        f"python training/train.py --config {name}/run.yaml --out ANOTHER replays it.\n"
        f"Decided by this host ({_host(record['device'])}): {', '.join(decided)};\n"
        "on another host class, set any it refuses to auto."
    )


def _host(device: str) -> str:
    """The host class in words: the CPU's model, or a CUDA device's name."""
    if device == "cpu":
        return cpu_name()
    return torch.cuda.get_device_name(device) if device.startswith("cuda") else device


def describe_ranks(
    dist, loader: BatchLoader, coordinates: dict[str, int], built: dict | None = None
) -> list[dict]:
    """All ranks call: where each rank runs, its place in the layout, what building its model
    took (`built`: seconds, and the peak host memory by then) and what it reads first (from a
    fresh loader of the same data-parallel replica at the same position: the real one is
    untouched)."""
    fresh = BatchLoader(
        loader.dataset,
        loader.micro_batch,
        loader.rank,
        loader.world,
        loader.seed,
        loader.consumed_samples,
    )
    first = fresh.next_batch()[0]
    return cluster.describe_ranks(dist.rank, dist.local_rank, first, coordinates, built)


def trainer_facts(record: dict) -> dict:
    """What every checkpoint's trainer state keeps of the run, for a resume (topology) and an
    export (model, data) to read back."""
    flags, cfg = record["flags"], record["ds_config"]
    return {
        "seed": flags["seed"],
        "backend": flags["backend"],
        "zero_stage": ds_config.zero_stage(cfg),
        "pipeline_stages": ds_config.pipeline_stages(cfg),
        "tensor_parallel": parallel.tensor_size(cfg),
        "sequence_parallel": parallel.sequence_size(cfg),
        "expert_parallel": parallel.expert_size(cfg),
        "model": flags["model"],
        "data_dir": record["data"]["dir"],
        "seq_len": flags["seq_len"],
        # the rest of the recipe a resume holds to (preflight/recipe_change.py)
        "global_batch": cfg["train_batch_size"],
        "micro_batch": cfg["train_micro_batch_size_per_gpu"],
        "data_sha256": record["data"].get("sha256"),
        "model_config": record["model_config"],
        "precision": record["precision"],  # an "auto" resume keeps it (exact resume)
        "optimizer": flags["optimizer"],  # its states fit no other (preflight/recipe_change.py)
        # --lora: the adapters' spec (its fields: models/lora.py stored_lora reads them back),
        # and the frozen model they sit on (what export loads)
        "lora": record["lora_spec"],
        "base_model": flags["lora"] and str(Path(resolve_pretrained(flags["model"])).resolve()),
    }


def banner(record: dict, batch: tuple[int, int, int, int]) -> str:
    """The run in one line: engine, config, precision, world, model, batch, resume."""
    flags, cfg = record["flags"], record["ds_config"]
    stage = cfg.get("zero_optimization", {}).get("stage", 0)
    how = f"ZeRO-{stage}" if flags["backend"] == "deepspeed" else "batch and clipping"
    comm = record["backend"] + (" + shm collectives" if record["shm_collectives"] else "")
    micro, accum, dp, seq = batch
    line = (
        f"zerostack: {flags['backend']} | {Path(record['ds_config_file']).name} ({how}) | "
        f"{_precision(record)} | world {record['world']} ({comm}) | model {flags['model']} "
        f"{record['n_params'] / 1e6:.2f}M params | batch {micro}x{accum}x{dp}x{seq} tokens"
    )
    attention = record.get("attention") or {}
    if attention.get("kernel"):
        line += f" | attention {attention['kernel']}" + (
            f" ({attention['sdpa']})" if attention.get("sdpa") else ""
        )
    if record.get("objective", "next-token") != "next-token":
        line += f" | {record['objective']}"
    if record["pipeline"]:
        line += f" | pipeline {record['pipeline']['stages']} stages x {dp} data-parallel"
    elif max(record["parallel"]["tensor"], record["parallel"]["sequence"]) > 1:
        sizes = {k: v for k, v in record["parallel"].items() if k != "data"}
        line += " | " + parallel.Layout(**sizes).describe()
    built = [r["built"] for r in record["ranks"] if r.get("built")]
    if built:  # what building the model took its slowest rank, and its fullest one's memory
        peak = max(b["peak_host_bytes"] for b in built) / 2**30
        line += f" | built in {max(b['seconds'] for b in built):.1f} s, host peak {peak:.2f} GiB"
    return line


def _precision(record: dict) -> str:
    """The banner's precision: what runs, and for "auto" why (both rates, where measured)."""
    choice = record.get("precision_choice") or {}
    if choice.get("asked") != "auto":
        return record["precision"] + (
            " (slow here: see the warning)" if choice.get("warning") else ""
        )
    return f"{record['precision']} (auto: {choice['why']})"


def resumed(plan) -> str:
    """The banner's resume part: ' | resumed from step_N' (and what it was saved on)."""
    if plan is None:
        return ""
    return f" | resumed from {plan.tag}" + (
        f" (universal: saved on {plan.saved_on})" if plan.universal else ""
    )


def world_change(plan, world: int, global_batch: int, grad_accum: int, step: int) -> dict | None:
    """A resume on another world size than the checkpoint's (under an elastic launch: a host
    lost, or back) as a metrics record, with the accumulation that keeps the global batch;
    None for a fresh run or the same world. torchrun's restart count says which restart it was."""
    if plan is None or plan.saved_on.world == world:
        return None
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return {
        "kind": "world",
        "step": step,
        "from": plan.saved_on.world,
        "to": world,
        "global_batch": global_batch,
        "grad_accum": grad_accum,
        "checkpoint": plan.tag,
        "elastic_restart": int(restart) if restart and restart.isdigit() else None,
    }


def versions() -> dict:
    return {
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
    }


def git_commit() -> str | None:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        return None
