"""Generate text from an exported model folder with stock transformers.

    python -m training.sample HF_DIR --prompt "def fibonacci(n):" --max-new-tokens 80 --top-p 0.9
    python -m training.sample HF_DIR --chat --prompt "Write a haiku" --system "Be brief."

With --chat the prompt is the user's turn: the conversation is rendered with the folder's chat
template (the one the model was fine-tuned with, data/chat.py), the assistant's turn is
generated, and only it is printed; it ends at EOS or at the template's end-of-turn token.

The model and tokenizer are loaded with AutoModelForCausalLM/AutoTokenizer and no zerostack model
code, which is the point: the export stands on its own. What is ours is the sampling rule
(`filter_logits`: temperature, then top-k, then top-p), so its meaning is defined and tested here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def filter_logits(logits, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """Logits (..., vocab) divided by `temperature`, with every token outside the `top_k` most
    likely (0: no limit) and outside the nucleus set to -inf. The nucleus is the smallest set of
    most likely tokens whose probability reaches `top_p` (1.0: every token); the most likely
    token is always kept."""
    import torch

    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # A token is dropped when the more likely ones before it already reach top_p.
        before = probs.cumsum(dim=-1) - probs
        drop_sorted = before >= top_p
        drop_sorted[..., 0] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def generate(
    hf_dir: str | Path,
    prompt: str,
    max_new_tokens: int = 80,
    greedy: bool = False,
    temperature: float = 0.8,
    top_k: int = 50,
    top_p: float = 1.0,
    seed: int = 0,
    chat: bool = False,
    system: str | None = None,
) -> str:
    """Load `hf_dir` with AutoModelForCausalLM/AutoTokenizer and continue `prompt`: greedily, or
    sampled from `filter_logits(temperature, top_k, top_p)`. `chat`: `prompt` (after `system`)
    is a user's turn rendered with the chat template, and the reply alone is returned."""
    # Heavy: imported once the folder is known to hold a model (so --help and errors are fast).
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    stop = [tok.eos_token_id]
    if chat:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        stop += end_of_turn(tok, messages)
    else:
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    sampling = {}
    if not greedy:
        # Ours the only filter: transformers' own warpers (and a generation_config's
        # defaults, such as top_k 50) switched off.
        rule = lambda _ids, scores: filter_logits(scores, temperature, top_k, top_p)  # noqa: E731
        sampling = dict(
            logits_processor=LogitsProcessorList([rule]), temperature=1.0, top_k=0, top_p=1.0
        )
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=not greedy,
            pad_token_id=tok.pad_token_id or tok.eos_token_id,
            eos_token_id=stop,
            **sampling,
        )
    return tok.decode(out[0, ids.shape[1] :] if chat else out[0], skip_special_tokens=True)


def end_of_turn(tok, messages: list[dict]) -> list[int]:
    """The special token the template closes an assistant turn with (e.g. <|im_end|>), found by
    rendering a reply and reading what follows it; [] when that is not a special token."""
    marker = "\x00reply\x00"
    text = tok.apply_chat_template(
        [*messages, {"role": "assistant", "content": marker}], tokenize=False
    )
    after = text.partition(marker)[2]
    ids = tok(after, add_special_tokens=False).input_ids if after else []
    return ids[:1] if ids and ids[0] in tok.all_special_ids else []


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Generate text from an exported model folder with stock transformers: "
        "greedily, or sampled with temperature, top-k and top-p (applied in that order)."
    )
    p.add_argument("hf_dir", help="a folder written by `python -m training.export`")
    p.add_argument("--prompt", default="def ")
    p.add_argument("--max-new-tokens", type=int, default=80)
    p.add_argument("--greedy", action="store_true", help="always the most likely token")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50, help="sample among the k most likely; 0: all")
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="sample among the smallest set of most likely tokens whose probability reaches p "
        "(nucleus sampling); 1.0: all",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--chat",
        action="store_true",
        help="the prompt is a user's turn: render it with the folder's chat template and print "
        "the assistant's reply",
    )
    p.add_argument("--system", default=None, help="with --chat: a system message first")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    bad = _bad_value(a)
    if bad:
        print(f"error: {bad}", file=sys.stderr)
        return 2
    if not Path(a.hf_dir).exists():  # a hub name (org/name): its snapshot in the HF cache
        from models import ModelError, resolve_pretrained

        try:
            a.hf_dir = str(resolve_pretrained(a.hf_dir, what="HF_DIR"))
        except ModelError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if not (Path(a.hf_dir) / "config.json").is_file():
        print(f"error: {a.hf_dir} holds no exported model (no config.json)", file=sys.stderr)
        return 2
    if a.chat and not _has_template(a.hf_dir):
        print(
            f"error: --chat: {a.hf_dir}'s tokenizer has no chat template (train on chat data "
            "prepared with one, or add chat_template to its tokenizer_config.json)",
            file=sys.stderr,
        )
        return 2
    text = generate(
        a.hf_dir, a.prompt, a.max_new_tokens, a.greedy, a.temperature, a.top_k, a.top_p, a.seed,
        chat=a.chat, system=a.system,
    )  # fmt: skip
    print(text)
    return 0


def _has_template(hf_dir: str) -> bool:
    from transformers import AutoTokenizer

    return bool(getattr(AutoTokenizer.from_pretrained(hf_dir), "chat_template", None))


def _bad_value(a) -> str | None:
    """One line naming the flag whose value cannot mean anything, or None."""
    if not a.temperature > 0:  # also catches nan
        return f"--temperature {a.temperature}: must be > 0 (use --greedy for the argmax)"
    if a.top_k < 0:
        return f"--top-k {a.top_k}: must be >= 0 (0: no limit)"
    if not 0 < a.top_p <= 1:
        return f"--top-p {a.top_p}: must be in (0, 1]"
    if a.max_new_tokens < 1:
        return f"--max-new-tokens {a.max_new_tokens}: must be >= 1"
    return None


if __name__ == "__main__":
    sys.exit(main())
