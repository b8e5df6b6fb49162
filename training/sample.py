"""Generate text from an exported model folder with stock transformers (no zerostack code in
the loop, which is the point: the export stands on its own).

    python -m training.sample HF_DIR --prompt "def fibonacci(n):" --max-new-tokens 80
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def generate(
    hf_dir: str | Path,
    prompt: str,
    max_new_tokens: int = 80,
    greedy: bool = False,
    temperature: float = 0.8,
    top_k: int = 50,
    seed: int = 0,
) -> str:
    """Load `hf_dir` with AutoModelForCausalLM/AutoTokenizer and continue `prompt`."""
    # Heavy: imported once the folder is known to hold a model (so --help and errors are fast).
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        sampling = {} if greedy else {"temperature": temperature, "top_k": top_k}
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=not greedy,
            pad_token_id=tok.pad_token_id or tok.eos_token_id,
            **sampling,
        )
    return tok.decode(out[0], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("hf_dir")
    p.add_argument("--prompt", default="def ")
    p.add_argument("--max-new-tokens", type=int, default=80)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if not (Path(a.hf_dir) / "config.json").is_file():
        print(f"error: {a.hf_dir} holds no exported model (no config.json)", file=sys.stderr)
        return 2
    print(generate(a.hf_dir, a.prompt, a.max_new_tokens, a.greedy, a.temperature, seed=a.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
