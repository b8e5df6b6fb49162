"""Preflight of the engine: what the chosen backend cannot do with this config on this device,
and what tensor and sequence parallelism need of the model."""

from __future__ import annotations

from data.manifest import DataError
from models import PRESETS
from models.errors import ModelError
from training.engines.expert_parallel import check_shared_expert
from training.errors import ConfigError
from training.memory.shape import ModelShape, with_lora
from training.runtime.distributed import accelerator
from training.settings import ds_config, parallel
from training.settings.run_config import RunConfig


def check_engine(config: RunConfig, cfg: dict, cfg_path: str, precision: str) -> None:
    """What the chosen backend cannot do with this config on this device."""
    if config.engine.backend == "deepspeed" and precision == "fp16":
        acc = accelerator()
        if not acc.is_fp16_supported():
            raise ConfigError(
                f"{cfg_path}: fp16 is not supported on this device ({acc.device_name()}: no "
                "fp16 kernels); use a bf16 config such as ds_configs/zero2.json, or fp32.json"
            )
    if config.engine.backend != "deepspeed" and ds_config.pipeline_stages(cfg) > 1:
        raise ConfigError(f"{cfg_path}: pipeline configs need --backend deepspeed")


def check_preference_precision(config: RunConfig, cfg: dict, cfg_path: str, precision: str):
    """DPO and IPO under DeepSpeed's ZeRO-0 in bf16 train away from their fp32 reference: a loss
    gap of 8-12% one step in on the tiny presets (dense and MoE), where ZeRO-1 and 2 in bf16 and
    ZeRO-0 in fp32 follow it (benchmarks/matrix: zero0-dpo-*-bf16). Refused until it is found."""
    objective = config.optim.objective
    zero0 = config.engine.backend == "deepspeed" and ds_config.zero_stage(cfg) == 0
    if zero0 and precision == "bf16" and objective in ("dpo", "ipo"):
        raise ConfigError(
            f"{cfg_path}: --objective {objective} under ZeRO-0 in bf16 does not follow its fp32 "
            "reference (a loss gap of 8-12% after one step); use ZeRO-1 or 2 "
            "(ds_configs/zero2.json) or --precision fp32"
        )


def check_muon_model(config: RunConfig, model_cfg, cfg_path: str) -> None:
    """--optimizer muon needs a dense model: experts are stacked 3-D tensors, which Muon's split
    (engines/optim.py: muon_split) leaves to AdamW and DeepSpeed's Muon would take."""
    text = model_cfg.get_text_config() if hasattr(model_cfg, "get_text_config") else model_cfg
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    if config.optim.optimizer == "muon" and experts:
        raise ConfigError(
            f"{cfg_path}: --optimizer muon with a mixture-of-experts model ({experts} experts): "
            "its experts are stacked 3-D weights, which zerostack's Muon split does not take; "
            "use --optimizer adamw"
        )


def check_parallel(
    config: RunConfig, cfg: dict, layout: parallel.Layout, model_cfg, cfg_path: str
) -> None:
    """What tensor, sequence and expert parallelism need of the model (settings/parallel.py)."""
    if parallel.expert_size(cfg) != 1:
        pattern = cfg.get("expert_parallel", {}).get("moe_layer_pattern")
        parallel.check_experts(parallel.expert_size(cfg), layout.data, model_cfg, cfg_path, pattern)
        check_shared_expert(model_cfg, parallel.expert_size(cfg), cfg_path)
    if layout.tensor == 1 and layout.sequence == 1:
        return
    text = model_cfg.get_text_config() if hasattr(model_cfg, "get_text_config") else model_cfg
    heads = text.num_attention_heads
    parallel.check_model(
        layout,
        heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        seq_len=config.data.seq_len,
        source=cfg_path,
        intermediate=getattr(text, "intermediate_size", 0),
    )
    own_plan = {"partition_config", "preset_model"} & set(cfg.get("tensor_parallel", {}))
    # The config's own plan wins over the model's; pipeline stages split our blocks themselves.
    if layout.tensor > 1 and not own_plan and layout.pipeline == 1:
        check_tp_plan(model_cfg, config.model.name, cfg_path)
    if layout.tensor > 1 and own_plan and layout.pipeline == 1:
        parallel.check_own_plan(cfg, model_cfg, cfg_path)
    if layout.sequence > 1 and config.data.doc_mask:
        raise ConfigError(
            f"{cfg_path}: --doc-mask with sequence_parallel_size > 1: Ulysses attends over the "
            "whole gathered sequence with the causal flag only; drop --doc-mask"
        )


def check_chat_data(config: RunConfig, cfg: dict, cfg_path: str, manifest) -> None:
    """What chat data (a loss mask, one example per sample, or packed with --doc-mask) does not
    compose with: the loop weighs the loss by trained tokens through the engine's micro-batch
    loss, which the pipeline engine does not expose and Ulysses splits across ranks; packing
    needs the data's EOS only where examples end."""
    check_objective(config, cfg, cfg_path, manifest)
    if getattr(manifest, "chat", None) is None:
        return
    if ds_config.pipeline_stages(cfg) > 1:
        raise ConfigError(
            f"{cfg_path}: chat data with the pipeline engine: its loss is not weighed by "
            "trained tokens; use a non-pipeline config"
        )
    if parallel.sequence_size(cfg) > 1:
        raise ConfigError(
            f"{cfg_path}: chat data with sequence_parallel_size > 1 is not supported; use a "
            "config without sequence parallelism"
        )
    if config.data.doc_mask:  # packed: the data's EOS must mark only where examples end
        from data.examples import ExampleDataset, separator_problem

        for split in ("train", "val"):
            try:
                problem = separator_problem(
                    ExampleDataset(config.data.path, split, config.data.seq_len)
                )
            except DataError:
                continue  # an empty split: nothing to pack
            if problem:
                raise ConfigError(problem)


def check_objective(config: RunConfig, cfg: dict, cfg_path: str, manifest) -> None:
    """--objective against the data: the DPO family needs preference pairs, which train only
    with it, one pair per sample (no --doc-mask) and every rank its own batch (no tensor
    parallelism: its ranks would share one)."""
    from data.pairs import is_pairs

    objective, pairs = config.optim.objective, is_pairs(manifest)
    if objective in ("dpo", "ipo") and not pairs:
        raise ConfigError(
            f"--objective {objective} trains on preference pairs; {config.data.path} is not "
            "(prepare prompt/chosen/rejected JSONL with data.prepare)"
        )
    if not pairs:
        return
    if objective == "next-token":
        raise ConfigError(
            f"{config.data.path} holds preference pairs: train them with --objective dpo or ipo"
        )
    if config.data.doc_mask:
        raise ConfigError("--doc-mask with preference pairs: a sample is one pair; drop it")
    if parallel.tensor_size(cfg) > 1:
        raise ConfigError(
            f"{cfg_path}: preference pairs with tensor parallelism are not supported; use a "
            "ZeRO 0-3 config without it"
        )


def check_lora(
    config: RunConfig, cfg: dict, cfg_path: str, model_cfg, shape: ModelShape
) -> ModelShape:
    """--lora checked against the engine and the model (every target matches a module);
    returns the shape with only the adapters trained, which the memory plan counts."""
    spec = config.model.lora
    if spec is None:
        return shape
    if config.model.name in PRESETS:
        raise ConfigError(
            f"--lora trains adapters on a pretrained model; --model {config.model.name} is a freshly "
            "initialised preset: give --model FOLDER (an export, or any HF causal LM)"
        )
    if config.engine.backend == "fsdp":
        raise ConfigError("--lora with --backend fsdp is not supported; use deepspeed or ddp")
    if ds_config.pipeline_stages(cfg) > 1 or parallel.tensor_size(cfg) > 1:
        raise ConfigError(
            f"{cfg_path}: --lora with pipeline stages or tensor parallelism is not supported; "
            "use a ZeRO 0-3 config without them"
        )
    if parallel.sequence_size(cfg) > 1:
        raise ConfigError(f"{cfg_path}: --lora with sequence_parallel_size > 1 is not supported")
    if parallel.expert_size(cfg) > 1:  # AutoEP would replace the MLPs inside peft's wrapper
        raise ConfigError(
            f"{cfg_path}: --lora with expert parallelism is not supported (the experts stay "
            "frozen under LoRA: nothing to split); use ds_configs/zero2.json"
        )
    try:
        return with_lora(shape, model_cfg, spec)
    except ModelError as e:
        raise ConfigError(f"--model {config.model.name}: {e}") from None


def check_tp_plan(model_cfg, model: str, cfg_path: str) -> None:
    """A transformers model's tensor-parallel plan in styles DeepSpeed's AutoTP applies: it
    refuses any other inside deepspeed.initialize, after every rank has started."""
    from deepspeed.module_inject.tp_plan_converter import SUPPORTED_STYLES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    plan = dict(getattr(model_cfg, "base_model_tp_plan", None) or {})
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(model_cfg), None)
    plan.update(getattr(model_class, "_tp_plan", None) or {})
    odd = sorted({style for style in plan.values() if style.lower() not in SUPPORTED_STYLES})
    if odd:
        raise ConfigError(
            f"{cfg_path}: --model {model}: its tensor-parallel plan uses {', '.join(odd)}, which "
            "DeepSpeed's AutoTP does not apply; give tensor_parallel.partition_config for this "
            "model, or use data parallelism / ZeRO-3"
        )
