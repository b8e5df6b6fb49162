"""Export any zerostack checkpoint to a folder stock `transformers` loads.

    python -m training.export RUN_DIR[/STEP] --out HF_DIR [--dtype bfloat16] [--max-shard-size 2GB]
        [--adapter-only]

From a DeepSpeed (ZeRO 0-3, pipeline), DDP or FSDP2 checkpoint, writes config.json
(LlamaForCausalLM for our model, MixtralForCausalLM for our MoE model), model.safetensors (or numbered shards and an index),
generation_config.json, the tokenizer and a model card (README.md). The weights are the fp32
master weights, read straight from the checkpoint's files: a ZeRO-3 export cannot come out
empty, because nothing is gathered from a live engine.

Then it checks its own work: the folder is reloaded with AutoModelForCausalLM and its logits and
greedy generation on a fixed batch must match those of our model holding the checkpoint's
weights. A mismatch is an error and the folder is not kept. Everything is written into a hidden
folder beside HF_DIR and renamed into place at the end.

A LoRA run (--lora) exports merged into the weights, or with --adapter-only as the adapter folder
peft loads on the run's base folder (`PeftModel.from_pretrained`), verified the same way.

Memory: at most one fp32 copy of the weights at any time. The checkpoint's files are mapped and
read one parameter at a time (zero_files.py), the safetensors files are written one
tensor at a time, and our model is freed before the export is reloaded.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.utils import logging

from data.files import scratch_folder, why_unwritable
from models import ModelError, ZeroStackForCausalLM
from models.hf_adapter import to_hf
from models.lora import adapter_state_dict, lora_config, stored_lora, to_llama_adapter
from training.checkpoints import layout as ckpt
from training.checkpoints.universal_copy import Topology
from training.checkpoints.weights import config_from_dict, load_lora_model, load_model
from training.checkpoints.zero_files import release_freed_memory
from training.errors import CheckpointError, ExportError
from training.runtime import runlock

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ST_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
GEN_PROMPT_LEN, GEN_NEW_TOKENS = 8, 16


@dataclass
class Report:
    """What `export` wrote and how it checked it."""

    folder: Path
    files: list[str]
    max_logit_diff: float
    generated: list[int]  # greedy tokens from the reloaded export (prompt excluded)


def locate(path: str | Path) -> tuple[Path, str]:
    """RUN_DIR (latest complete checkpoint), RUN_DIR/checkpoints, RUN_DIR/checkpoints/step_N,
    RUN_DIR/step_N or RUN_DIR/N -> (root, tag), after checking the files against their checksums."""
    try:
        root, tag = ckpt.locate(path)
        ckpt.verify(root / tag)
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    return root, tag


def export(path: str | Path, out: str | Path, **options) -> Path:
    """Write the HF folder for the checkpoint at `path` (see the module doc); returns it.
    `options` are export_report's."""
    return export_report(path, out, **options).folder


def export_report(
    path: str | Path,
    out: str | Path,
    *,
    dtype: str = "float32",
    overwrite: bool = False,
    verify: bool = True,
    max_shard_size: str | int = "2GB",
    adapter_only: bool = False,
) -> Report:
    """Write the HF folder for the checkpoint at `path`; returns what was written and checked.
    A LoRA run's checkpoint exports merged into a full model, or with `adapter_only` as the
    adapter folder peft loads on the run's base model."""
    out = Path(out)
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    shard_bytes = parse_size(max_shard_size)
    check_target(out, overwrite)
    root, tag = locate(path)
    try:
        state = ckpt.load_trainer_state(root, tag)
    except CheckpointError as e:  # already one line naming the file
        raise ExportError(str(e)) from None
    except Exception as e:
        raise ExportError(f"{root / tag}: unreadable trainer state ({e})") from None
    torch_dtype = DTYPES[dtype]
    config = config_from_dict(state["model_config"])
    ours = isinstance(config, ZeroStackForCausalLM.config_class)
    if adapter_only and not state.get("lora"):
        raise ExportError(f"--adapter-only: {root / tag} is not a LoRA run's checkpoint")
    if ours:
        try:  # a shape no stock class has (an MoE shared expert) is refused before any work
            to_hf(config)
        except ModelError as e:
            raise ExportError(f"{root / tag}: {e}") from None

    model = _load(root, tag, state, torch_dtype, merged=not adapter_only)
    ids = _fixed_batch(config.vocab_size)
    ref_logits, ref_gen = _logits_and_greedy(model, ids)
    if adapter_only:
        return _export_adapter(
            model, root, tag, state, out, torch_dtype, verify, ids, ref_logits, ref_gen
        )

    tmp = scratch_folder(out)
    try:
        if ours:
            _save_llama_streaming(model, config, tmp, torch_dtype, shard_bytes)
        else:  # any other HF causal LM keeps its own class, names and writer
            model.to(torch_dtype).save_pretrained(tmp, max_shard_size=shard_bytes)
        del model
        release_freed_memory()  # the reload below must not stack on our model's freed pages
        _write_generation_config(tmp, config)
        _copy_tokenizer(root.parent, state, tmp)
        _write_card(tmp, root.parent, tag, state, dtype)
        err, gen = verify_export(tmp, ids, ref_logits, ref_gen) if verify else (float("nan"), [])
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Report(out, sorted(p.name for p in out.iterdir()), err, gen)


def _publish(tmp: Path, out: Path) -> None:
    """The checked folder `tmp` becomes `out`, replacing what --overwrite allowed there."""
    if out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    tmp.rename(out)


def _load(root: Path, tag: str, state: dict, dtype: torch.dtype, merged: bool):
    """The checkpoint's model in fp32 (weights rounded to dtype); a LoRA run's is its base with
    the adapters, as peft holds them or merged into the weights."""
    try:
        if not state.get("lora"):
            return load_model(root, tag, state, dtype)
        model = load_lora_model(root, tag, state, dtype)
    except CheckpointError as e:  # weights that do not fit, files not read here: one line
        raise ExportError(str(e)) from None
    if not merged:
        return model
    model = model.merge_and_unload()
    with torch.no_grad():  # the merged weights are what is written, in dtype
        for p in model.parameters():
            p.copy_(p.to(dtype).float())
    return model.eval()


def _export_adapter(
    model, root, tag, state, out, dtype, verify, ids, ref_logits, ref_gen
) -> Report:
    """The adapter folder (adapter_config.json, adapter_model.safetensors, the tokenizer) for
    `PeftModel.from_pretrained(base, folder)`, verified on the run's base model."""
    tmp = scratch_folder(out)
    try:
        save_adapter(model, state, tmp, dtype)
        del model
        _copy_tokenizer(root.parent, state, tmp)
        err, gen = float("nan"), []
        if verify:
            err, gen = verify_export(tmp, ids, ref_logits, ref_gen, base=state["base_model"])
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Report(out, sorted(p.name for p in out.iterdir()), err, gen)


def save_adapter(model, state: dict, folder: Path, dtype: torch.dtype) -> None:
    """peft's two files, under the names of the model `from_pretrained(base_model)` builds
    (LlamaForCausalLM's for our model): the adapters load on the base folder as it is."""
    from safetensors.torch import save_file

    sd = adapter_state_dict(model)
    targets = sorted(model.peft_config["default"].target_modules)
    if isinstance(model.config, ZeroStackForCausalLM.config_class):
        sd, targets = to_llama_adapter(sd, targets)
    config = lora_config(None, stored_lora(state["lora"]), targets)
    config.base_model_name_or_path = state["base_model"]
    config.save_pretrained(folder)
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in sd.items()}
    save_file(tensors, folder / "adapter_model.safetensors", metadata={"format": "pt"})


def check_target(out: Path, overwrite: bool) -> None:
    """Raise ExportError unless `out` may be written: absent or empty, or with --overwrite a
    folder that neither is nor contains a run or data folder, and inside one only when it is an
    earlier export (RUN/hf): nothing a user owns is replaced by mistake."""
    if (why := why_unwritable(out)) is not None:
        raise ExportError(f"--out: {why}")
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    if not overwrite:
        raise ExportError(f"{out}: exists and is not empty; pass --overwrite to replace it")
    earlier_export = (out / "config.json").is_file() and any(out.glob("*.safetensors"))
    owned = runlock.owned_near(out, inside_ok=earlier_export)
    if owned:
        raise ExportError(f"--out {owned}; refusing to replace it: pick a new --out")


def parse_size(size: str | int) -> int:
    """'2GB', '500MB', '10GiB' or a byte count -> bytes."""
    if isinstance(size, int):
        return size
    s = size.strip().upper()
    units = {
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "B": 1,
    }
    for unit, mult in units.items():
        if s.endswith(unit) and s[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(s[: -len(unit)]) * mult)
    if s.isdigit():
        return int(s)
    raise ExportError(f"--max-shard-size {size}: give a size such as 2GB or 500MB")


def _save_llama_streaming(
    model, config, folder: Path, dtype: torch.dtype, shard_bytes: int
) -> None:
    """config.json and safetensors shards of our model as LlamaForCausalLM (our MoE model as
    MixtralForCausalLM), one tensor at a time."""
    hf_config, rename = to_hf(config)
    hf_config.dtype = dtype
    hf_config.save_pretrained(folder)
    sd = rename(dict(model.named_parameters()))  # named_parameters skips tied copies
    if config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)  # stored once, as embed_tokens
    write_safetensors(folder, sd, dtype, shard_bytes)


def write_safetensors(
    folder: Path, tensors: dict[str, torch.Tensor], dtype: torch.dtype, shard_bytes: int
) -> list[str]:
    """Write `tensors` (cast to dtype) as model.safetensors, or as model-0000i-of-0000n
    shards plus model.safetensors.index.json when they exceed shard_bytes. Each tensor is cast
    and written on its own, so no second copy of the weights is ever built."""
    size = torch.empty((), dtype=dtype).element_size()
    shards: list[list[str]] = [[]]
    used = 0
    for name, t in tensors.items():
        n = t.numel() * size
        if shards[-1] and used + n > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += n
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for file, names in zip(files, shards):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name in names:
            n = tensors[name].numel() * size
            header[name] = {
                "dtype": _ST_DTYPE[dtype],
                "shape": list(tensors[name].shape),
                "data_offsets": [offset, offset + n],
            }
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data that follows starts 8-byte aligned
        with open(folder / file, "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            for name in names:
                t = tensors[name].detach().to(dtype).contiguous().reshape(-1)
                f.write(memoryview(t.view(torch.uint8).numpy()))
    if len(files) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * size for t in tensors.values())},
            "weight_map": {name: file for file, names in zip(files, shards) for name in names},
        }
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return files


def _fixed_batch(vocab_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (2, 16), generator=g)


@torch.no_grad()
def _logits_and_greedy(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    logits = model(input_ids=ids).logits.float()
    gen = model.generate(
        ids[:1, :GEN_PROMPT_LEN],
        attention_mask=torch.ones_like(ids[:1, :GEN_PROMPT_LEN]),
        max_new_tokens=GEN_NEW_TOKENS,
        min_new_tokens=GEN_NEW_TOKENS,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=model.config.pad_token_id if model.config.pad_token_id is not None else 0,
    )
    return logits, {
        "tokens": gen.sequences[0, GEN_PROMPT_LEN:].tolist(),
        "scores": torch.stack([s[0] for s in gen.scores]).float(),
    }


def verify_export(
    folder: Path, ids: torch.Tensor, ref_logits: torch.Tensor, ref_gen: dict, base=None
):
    """Reload `folder` with stock transformers (an adapter folder: peft on the `base` folder);
    its logits on `ids` and its greedy continuation must match the checkpoint's. Returns
    (max |logit difference|, generated tokens)."""
    logging.disable_progress_bar()
    if base is None:
        theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    else:
        from peft import PeftModel

        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        theirs = PeftModel.from_pretrained(model, folder).eval()
    logits, gen = _logits_and_greedy(theirs, ids)
    del theirs
    err = (logits - ref_logits).abs().max().item()
    tol = 1e-4 * max(1.0, ref_logits.abs().max().item())
    if not err <= tol:
        raise ExportError(
            f"{folder}: reloaded logits differ from the checkpoint's by {err:.3g} "
            f"(tolerance {tol:.3g}); the export is wrong and was not kept"
        )
    for i, (a, b) in enumerate(zip(ref_gen["tokens"], gen["tokens"])):
        if a != b:
            top2 = ref_gen["scores"][i].topk(2).values
            if (top2[0] - top2[1]).item() > 2 * tol:  # not a near-tie: a real difference
                raise ExportError(
                    f"{folder}: greedy generation from the reloaded export differs from the "
                    f"checkpoint's at token {i} ({b} vs {a}); the export was not kept"
                )
            break
    return err, gen["tokens"]


def _write_generation_config(folder: Path, config) -> None:
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


def _eval_at(run_dir: Path, step: int) -> dict:
    """The last evaluation at or before `step` (metrics.jsonl), else final_eval.json's."""
    best = {}
    try:
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            r = json.loads(line)
            if r.get("kind") == "eval" and r.get("step", math.inf) <= step:
                best = r
    except (OSError, ValueError):
        pass
    if not best and (run_dir / "final_eval.json").is_file():
        ev = json.loads((run_dir / "final_eval.json").read_text())
        best = ev if ev.get("step") == step else {}
    return best


def _write_card(folder: Path, run_dir: Path, tag: str, state: dict, dtype: str) -> None:
    ev = _eval_at(run_dir, int(state.get("step", 0)))
    tokens = state.get("tokens")
    lines = [
        "---",
        "library_name: transformers",
        "tags: [zerostack, llama]",
        "---",
        "",
        f"# {run_dir.name}",
        "",
        "A causal LM trained with zerostack and exported to a stock `LlamaForCausalLM` folder.",
        "",
        f"- checkpoint: `{tag}` ({state.get('backend', 'deepspeed')}, "
        f"{Topology.of_checkpoint(state)})",
        f"- model: {state.get('model')}, weights in {dtype}",
        f"- data: `{Path(state.get('data_dir', '?')).name}`",
        f"- steps: {state.get('step')}",
        f"- tokens trained: {tokens:,}" if tokens else "- tokens trained: unknown",
    ]
    if ev:
        lines.append(
            f"- validation loss {ev.get('val_loss', float('nan')):.4f}, bits per byte "
            f"{ev.get('bpb', float('nan')):.4f} (at step {ev.get('step')})"
        )
    lines += [
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        'model = AutoModelForCausalLM.from_pretrained("PATH")',
        'tok = AutoTokenizer.from_pretrained("PATH")',
        "```",
        "",
    ]
    (folder / "README.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Export a checkpoint to a Hugging Face folder.")
    p.add_argument(
        "path", help="RUN_DIR (latest checkpoint), RUN_DIR/checkpoints/step_N or RUN_DIR/N"
    )
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument(
        "--max-shard-size", default="2GB", help="larger exports are sharded (default 2GB)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--no-verify", action="store_true", help="skip the reload check")
    p.add_argument(
        "--adapter-only",
        action="store_true",
        help="a LoRA run: write the adapter folder peft loads on the base model, not the merged model",
    )
    a = p.parse_args(argv)
    try:
        r = export_report(
            a.path,
            a.out,
            dtype=a.dtype,
            overwrite=a.overwrite,
            verify=not a.no_verify,
            max_shard_size=a.max_shard_size,
            adapter_only=a.adapter_only,
        )
    except (ExportError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    check = (
        ""
        if a.no_verify
        else f"; reloaded logits within {r.max_logit_diff:.1e}, greedy generation identical"
    )
    print(f"exported {r.folder} ({', '.join(r.files)}){check}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
