"""Export any zerostack checkpoint to a folder stock `transformers` loads.

    python -m training.export RUN_DIR[/checkpoints/step_N] --out HF_DIR [--dtype bfloat16]

Writes config.json (LlamaForCausalLM for our model), model.safetensors, generation_config.json
and the tokenizer, then reloads the folder with AutoModelForCausalLM and checks its logits
against the checkpoint's weights on a fixed batch: a mismatch is an error, never a silent file.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from training import checkpoint as ckpt


class ExportError(ValueError):
    """A bad export request: no checkpoint, a non-empty target, a failed verification."""


def locate(path: str | Path) -> tuple[Path, str]:
    """RUN_DIR (latest complete checkpoint), RUN_DIR/checkpoints, or a step folder -> (root, tag)."""
    p = Path(path)
    if not p.exists():
        raise ExportError(f"{p}: no such run or checkpoint folder")
    try:
        found = ckpt.resolve_resume(str(p), p)
    except ckpt.CheckpointError as e:
        raise ExportError(str(e).replace("--resume ", "")) from None
    if found is None:
        raise ExportError(f"{p}: holds no complete checkpoint")
    return found


def load_state_dict(root: Path, tag: str, state: dict) -> dict[str, torch.Tensor]:
    """The full fp32 weights of checkpoint `tag`, under the model's own parameter names."""
    folder = root / tag
    backend = state.get("backend", "deepspeed")
    if backend == "deepspeed":
        if state.get("zero_stage", 0) >= 1:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            sd = get_fp32_state_dict_from_zero_checkpoint(str(root), tag=tag)
        else:  # ZeRO-0 keeps whole weights in the model-states file
            sd = torch.load(
                folder / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False
            )["module"]
        return {k: v.float() for k, v in sd.items()}
    from training.engines import load_full_state_dict

    return load_full_state_dict(backend, folder)


def export(
    path: str | Path,
    out: str | Path,
    *,
    dtype: str = "float32",
    overwrite: bool = False,
    verify: bool = True,
) -> Path:
    """Write the HF folder for the checkpoint at `path`; returns the folder."""
    from models import ZeroStackForCausalLM
    from models.hf_adapter import save_llama

    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"{out}: exists and is not empty; pass --overwrite to replace it")
    root, tag = locate(path)
    state = ckpt.load_trainer_state(root, tag)
    config = config_from_dict(state["model_config"])
    sd = load_state_dict(root, tag, state)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        dtype
    ]

    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if isinstance(config, ZeroStackForCausalLM.config_class):
        save_llama({k: v.to(torch_dtype) for k, v in sd.items()}, config, tmp)
    else:  # any other HF causal LM: its own class and names
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(
            {k: v.to(torch_dtype) for k, v in sd.items()}, strict=False, assign=True
        )
        model.tie_weights()
        model.save_pretrained(tmp)
    _write_generation_config(tmp, config)
    _copy_tokenizer(root.parent, state, tmp)
    _write_card(tmp, root.parent, tag, state)
    if verify:
        verify_export(tmp, config, sd, torch_dtype)
    if out.exists():
        shutil.rmtree(out)
    tmp.replace(out)
    return out


def config_from_dict(d: dict):
    """A model config saved as a dict (ours or any HF model type) -> its config object."""
    from transformers import AutoConfig

    import models  # noqa: F401  (registers the "zerostack" model type with AutoConfig)

    d = dict(d)
    return AutoConfig.for_model(d.pop("model_type"), **d)


def _write_generation_config(folder: Path, config) -> None:
    from transformers import GenerationConfig

    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(folder)


def _copy_tokenizer(run_dir: Path, state: dict, folder: Path) -> None:
    for src in (run_dir / "tokenizer", Path(state.get("data_dir", "")) / "tokenizer"):
        if src.is_dir():
            for f in src.iterdir():
                if f.is_file():
                    shutil.copy2(f, folder / f.name)
            return
    print(
        f"warning: no tokenizer found for {run_dir}; the export has weights only", file=sys.stderr
    )


def _write_card(folder: Path, run_dir: Path, tag: str, state: dict) -> None:
    ev = {}
    if (run_dir / "final_eval.json").is_file():
        ev = json.loads((run_dir / "final_eval.json").read_text())
    lines = [
        "# zerostack export",
        "",
        f"- checkpoint: `{tag}` ({state.get('backend', 'deepspeed')}, "
        f"ZeRO-{state.get('zero_stage', 0)}, world {state.get('world')})",
        f"- model: {state.get('model')}",
        f"- steps: {state.get('step')}",
        f"- tokens trained: {state.get('tokens'):,}" if state.get("tokens") else "- tokens: ?",
        f"- data: `{Path(state.get('data_dir', '?')).name}`",
    ]
    if ev:
        lines.append(
            f"- validation loss {ev.get('val_loss', float('nan')):.4f}, bits per byte "
            f"{ev.get('bpb', float('nan')):.4f} (at step {ev.get('step')})"
        )
    lines += [
        "",
        "Load it with stock transformers:",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "model = AutoModelForCausalLM.from_pretrained(PATH)",
        "tok = AutoTokenizer.from_pretrained(PATH)",
        "```",
        "",
    ]
    (folder / "README.md").write_text("\n".join(lines))


def verify_export(folder: Path, config, sd: dict, dtype: torch.dtype, atol: float | None = None):
    """Reload `folder` with stock transformers; its logits must match the checkpoint's weights
    run through our model on a fixed batch."""
    from transformers import AutoModelForCausalLM

    from models import ZeroStackForCausalLM

    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if isinstance(config, ZeroStackForCausalLM.config_class):
        ours = ZeroStackForCausalLM(config)
    else:
        ours = AutoModelForCausalLM.from_config(config)
    ours.load_state_dict({k: v.to(dtype).float() for k, v in sd.items()}, strict=False)
    ours.tie_weights()
    ours.eval()
    with torch.no_grad():
        a = ours(input_ids=ids).logits
        b = theirs(input_ids=ids).logits
    err = (a - b).abs().max().item()
    tol = atol if atol is not None else 1e-4 * max(1.0, a.abs().max().item())
    if not err <= tol:
        raise ExportError(
            f"{folder}: reloaded logits differ from the checkpoint's by {err:.3g} "
            f"(tolerance {tol:.3g}); the export is wrong and was not kept"
        )
    return err


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Export a checkpoint to a Hugging Face folder.")
    p.add_argument("path", help="RUN_DIR, RUN_DIR/checkpoints or a step_N folder")
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--no-verify", action="store_true")
    a = p.parse_args(argv)
    try:
        out = export(a.path, a.out, dtype=a.dtype, overwrite=a.overwrite, verify=not a.no_verify)
    except (ExportError, ckpt.CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {out} (loads with AutoModelForCausalLM.from_pretrained)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
