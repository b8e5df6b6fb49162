"""An export read two ways on the device: stock transformers' AutoModelForCausalLM and our model
(models.build_model on the same folder), their logits compared on a fixed batch in fp32 (a
tolerance) and in bf16 (reported). Prints one JSON line; exit 1 when fp32 differs.

    python -m benchmarks.gpu_logits HF_DIR [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import sys


def compare(folder: str, device: str) -> dict:
    """{device, max_diff_fp32, tol_fp32, max_diff_bf16 (where the device runs bf16), ok}."""
    import torch
    from transformers import AutoModelForCausalLM

    from models import build_model

    out = {"device": device}
    ids = None
    for dtype in (torch.float32, torch.bfloat16):
        theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        ours = build_model(folder, dtype=dtype).to(device).eval()
        if ids is None:  # the same tokens for both dtypes
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(0, theirs.config.vocab_size, (2, 64), generator=g).to(device)
        with torch.no_grad():
            a, b = theirs(input_ids=ids).logits.float(), ours(input_ids=ids).logits.float()
        key = "fp32" if dtype == torch.float32 else "bf16"
        out[f"max_diff_{key}"] = (a - b).abs().max().item()
        out[f"tol_{key}"] = (1e-4 if key == "fp32" else 5e-2) * max(1.0, a.abs().max().item())
        del theirs, ours
    out["ok"] = out["max_diff_fp32"] <= out["tol_fp32"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder")
    p.add_argument("--device", default=None, help="default: cuda where there is one, else cpu")
    a = p.parse_args(argv)
    import torch

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    result = compare(a.folder, device)
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
