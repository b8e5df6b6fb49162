"""lm-evaluation-harness on a model folder: the task names checked, the folder checked, the
harness run (HFLM and `simple_evaluate`), and its results read as flat scores."""

from __future__ import annotations

import difflib
import json
from pathlib import Path

from training.errors import EvalError


def task_manager(names: list[str], include: list[Path]):
    """An lm-eval TaskManager that knows every name in `names`: the folders in `include` alone
    when they hold them all (fast, offline), else with the harness's own tasks too. An unknown
    name raises EvalError naming it and the closest known ones."""
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=[str(p) for p in include], include_defaults=False)
    if not set(names) - set(tm.all_tasks):
        return tm
    tm = TaskManager(include_path=[str(p) for p in include])
    unknown = [n for n in names if n not in tm.all_tasks]
    if unknown:
        near = difflib.get_close_matches(unknown[0], tm.all_tasks, n=3)
        hint = f"; did you mean {', '.join(near)}?" if near else ""
        raise EvalError(
            f"--tasks {unknown[0]}: not a task lm-eval knows (its own tasks, the shipped local "
            f"tasks or --include-path){hint}"
        )
    return tm


def check_model_folder(folder: Path) -> None:
    """Raise EvalError in one line unless the harness can load `folder`: a config transformers
    reads, of a causal LM, and a tokenizer."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not folder.is_dir():
        raise EvalError(f"{folder}: no such folder (give a run folder or a model folder)")
    if not (folder / "config.json").is_file():
        raise EvalError(f"{folder}: neither a run folder nor a model folder (no config.json)")
    try:
        config = AutoConfig.from_pretrained(folder)
    except Exception as e:
        raise EvalError(f"{folder}/config.json: transformers cannot read it ({_line(e)})") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise EvalError(f"{folder}: a {config.model_type} model, not a causal LM")
    _check_weights(folder, config)
    try:
        tok = AutoTokenizer.from_pretrained(folder)
        ids = tok("def f():\n", add_special_tokens=False).input_ids
        ids = ids if tok.decode(ids).strip() else []  # a tokenizer with no vocabulary
    except Exception as e:
        raise EvalError(f"{folder}: holds no tokenizer the harness can load ({_line(e)})") from None
    if not ids:
        raise EvalError(
            f"{folder}: holds no tokenizer the harness can load (it encodes to nothing)"
        )
    vocab = getattr(config.get_text_config(), "vocab_size", None)
    if vocab is not None and max(ids) >= vocab:
        raise EvalError(
            f"{folder}: its tokenizer gives token {max(ids)}, past the model's vocabulary ({vocab})"
        )


def _check_weights(folder: Path, config) -> None:
    """EvalError unless the folder's safetensors hold the weights its config's model has (names
    read from the file headers, the model built on the meta device: nothing is loaded)."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        if not any(folder.glob("*.bin")):
            raise EvalError(f"{folder}: holds no weights (no *.safetensors or *.bin)")
        return  # a pickled folder: transformers checks it as it loads
    have = set()
    for f in files:
        with safe_open(f, "pt") as st:
            have.update(st.keys())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    want = [n for n, _ in model.named_parameters()]  # tied weights named once
    missing = [n for n in want if n not in have and n.split(".", 1)[-1] not in have]
    if len(missing) > len(want) // 2:
        raise EvalError(
            f"{folder}: its weights do not fit its config ({len(missing)} of {len(want)} "
            f"missing, such as {missing[0]})"
        )


def choose(device: str, dtype: str, batch_size: str) -> tuple[str, str, int | str]:
    """'auto's made concrete: a GPU if there is one, bf16 where it has it (else fp32), and
    lm-eval's own batch-size search on a GPU; on a CPU fp32 and batches of 8."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        gpu_bf16 = device.startswith("cuda") and torch.cuda.is_bf16_supported()
        dtype = "bfloat16" if gpu_bf16 else "float32"
    if batch_size == "auto":
        return device, dtype, "auto" if device.startswith("cuda") else 8
    return device, dtype, int(batch_size)


def evaluate(
    folder: Path,
    names: list[str],
    tm,
    *,
    device: str,
    dtype: str,
    batch_size,
    limit: int | None = None,
) -> dict:
    """Run the harness on `folder` for `names`; returns its results (the `results`,
    `n-samples` and `versions` of simple_evaluate's answer)."""
    import datasets
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    datasets.disable_progress_bars()  # one bar per task file read: noise
    lm = HFLM(
        pretrained=str(folder), backend="causal", device=device, dtype=dtype, batch_size=batch_size
    )
    out = simple_evaluate(
        model=lm, tasks=names, task_manager=tm, limit=limit, log_samples=False, bootstrap_iters=1000
    )
    return {
        k: out[k]
        for k in ("results", "n-samples", "versions", "n-shot", "higher_is_better")
        if k in out
    }


def scores(results: dict) -> dict[str, float]:
    """{'task/metric': value} from the harness's results, standard errors left out."""
    flat = {}
    for task, metrics in results["results"].items():
        for key, v in metrics.items():
            metric, _, filt = key.partition(",")
            if isinstance(v, (int, float)) and "_stderr" not in metric and metric != "sample_len":
                name = metric if filt in ("", "none") else f"{metric}_{filt}"
                flat[f"{task}/{name}"] = float(v)
    return flat


def table(results: dict) -> str:
    """The harness's own markdown table of `results`."""
    from lm_eval.utils import make_table

    return make_table(json.loads(json.dumps(results, default=str)))


def _line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
