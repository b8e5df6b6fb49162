"""ZeRO-Infinity: parameters and optimizer states swapped to a local disk (NVMe) path.

`ds_configs/zero3_nvme.json` says "nvme_path": "auto"; the trainer fills it from --nvme-path
(default RUN/nvme_swap), sizes the parameter swap buffers from the model, and checks before any
work that DeepSpeed's async_io op can be built here (it needs libaio's headers: Debian's
libaio-dev). The op compiles on first use (about 6 minutes on 2 cores) into
~/.cache/torch_extensions (or $TORCH_EXTENSIONS_DIR) and loads from there afterwards.
"""

from __future__ import annotations

import copy
from pathlib import Path

from training.config import ConfigError

SECTIONS = ("offload_optimizer", "offload_param")


def nvme_sections(cfg: dict) -> list[str]:
    """The offload sections of a (raw or resolved) config whose device is nvme."""
    zo = cfg.get("zero_optimization", {})
    return [s for s in SECTIONS if str(zo.get(s, {}).get("device", "none")).lower() == "nvme"]


def apply(
    cfg: dict, *, nvme_path: str | None, default_path: Path, largest_param: int, source: str
) -> dict:
    """Fill nvme_path (from --nvme-path, which overrides the file, else "auto" -> default_path)
    and an "auto" offload_param.buffer_size; returns a new config. --nvme-path with a config
    that offloads nothing to nvme is an error."""
    sections = nvme_sections(cfg)
    if nvme_path is not None and not sections:
        raise ConfigError(
            f"{source}: --nvme-path given but the config offloads nothing to nvme; use "
            "ds_configs/zero3_nvme.json (or set an offload device to nvme)"
        )
    if not sections:
        return cfg
    cfg = copy.deepcopy(cfg)
    zo = cfg["zero_optimization"]
    for name in sections:
        sec = zo[name]
        if nvme_path is not None:
            sec["nvme_path"] = str(Path(nvme_path).resolve())
        elif sec.get("nvme_path", "auto") == "auto":
            sec["nvme_path"] = str(default_path.resolve())
    par = zo.get("offload_param", {})
    if "offload_param" in sections and par.get("buffer_size") == "auto":
        # Each buffer must hold the largest parameter; DeepSpeed's default (1e8 elements x
        # buffer_count) is gigabytes of host memory, wasted on a small model.
        par["buffer_size"] = max(largest_param, 1 << 20)
    return cfg


def check_aio(source: str) -> None:
    """Refuse, in one line, an nvme config on a machine where async_io cannot be built."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        raise ConfigError(
            f"{source}: NVMe offload needs DeepSpeed's async_io op, which needs libaio's headers "
            "and library here (Debian/Ubuntu: apt-get install libaio-dev)"
        )


def largest_param_numel(model_cfg) -> int:
    """Elements of the largest weight of a Llama-style model: the embedding or an MLP matrix."""
    h = model_cfg.hidden_size
    return max(model_cfg.vocab_size * h, getattr(model_cfg, "intermediate_size", 4 * h) * h)
