"""ZeRO-Infinity: parameters and optimizer states swapped to a local disk (NVMe) path.

`ds_configs/zero3_nvme.json` says "nvme_path": "auto"; config.resolve fills it with what
`auto_values` gives (--nvme-path, default RUN/nvme_swap) and sizes the parameter swap buffers
from the model. --nvme-path also overrides a path written in the file. The trainer checks before
any work that DeepSpeed's async_io op can be built here (it needs libaio's headers: Debian's
libaio-dev). The op compiles on first use (about 6 minutes on 2 cores) into
~/.cache/torch_extensions (or $TORCH_EXTENSIONS_DIR) and loads from there afterwards.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

from training.errors import ConfigError

SECTIONS = ("offload_optimizer", "offload_param")


def nvme_sections(cfg: dict) -> list[str]:
    """The offload sections of a (raw or resolved) config whose device is nvme."""
    zo = cfg.get("zero_optimization", {})
    return [s for s in SECTIONS if str(zo.get(s, {}).get("device", "none")).lower() == "nvme"]


def override_path(cfg: dict, nvme_path: str | None, source: str) -> dict:
    """--nvme-path overrides nvme_path in every nvme offload section (the file's value, "auto"
    or not); given with a config that offloads nothing to nvme, it is an error."""
    if nvme_path is None:
        return cfg
    sections = nvme_sections(cfg)
    if not sections:
        raise ConfigError(
            f"{source}: --nvme-path given but the config offloads nothing to nvme; use "
            "ds_configs/zero3_nvme.json (or set an offload device to nvme)"
        )
    cfg = copy.deepcopy(cfg)
    for name in sections:
        cfg["zero_optimization"][name]["nvme_path"] = str(Path(nvme_path).resolve())
    return cfg


def auto_values(nvme_path: str | None, run_dir: Path, model_cfg) -> tuple[str, int]:
    """The values ds_config.resolve gives nvme's "auto"s (its `swap`): the swap folder, and a
    parameter swap buffer just big enough for the largest parameter (DeepSpeed's default, 1e8
    elements per buffer, is gigabytes of host memory wasted on a small model)."""
    folder = str(Path(nvme_path or run_dir / "nvme_swap").resolve())
    return folder, max(largest_param_numel(model_cfg), 1 << 20)


def check_aio(source: str) -> None:
    """Refuse, in one line, an nvme config on a machine where async_io cannot be built."""
    from deepspeed.ops.op_builder import AsyncIOBuilder  # heavy: only for nvme configs

    if not AsyncIOBuilder().is_compatible(verbose=False):
        raise ConfigError(
            f"{source}: NVMe offload needs DeepSpeed's async_io op, which needs libaio's headers "
            "and library here (Debian/Ubuntu: apt-get install libaio-dev)"
        )


def remove_swap(cfg: dict, run_dir: Path, rank: int) -> None:
    """At a clean exit, once this rank's engine is gone: remove the swap folders DeepSpeed made
    for this rank (PATH/zero_stage_3/{optimizer,<dtype>params}/rankR; it leaves the optimizer's
    swap files, the size of the fp32 master weights and both Adam moments, behind), then each
    parent it made once it is empty (the last rank out removes them), and the default folder
    RUN/nvme_swap too. Nothing else in a --nvme-path folder is touched."""
    zero = cfg.get("zero_optimization", {})
    for path in {Path(zero[s]["nvme_path"]) for s in nvme_sections(cfg)}:
        stage3 = path / "zero_stage_3"
        if not stage3.is_dir():
            continue
        for kind in stage3.iterdir():
            if kind.name == "optimizer" or kind.name.endswith("params"):
                shutil.rmtree(kind / f"rank{rank}", ignore_errors=True)
                _remove_if_empty(kind)
        _remove_if_empty(stage3)
        if path.resolve() == (Path(run_dir) / "nvme_swap").resolve():
            _remove_if_empty(path)


def _remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:  # not empty (another rank is not done yet, or a user's files) or gone
        pass


def largest_param_numel(model_cfg) -> int:
    """Elements of the largest weight of a Llama-style model: the embedding or an MLP matrix."""
    h = model_cfg.hidden_size
    return max(model_cfg.vocab_size * h, getattr(model_cfg, "intermediate_size", 4 * h) * h)
