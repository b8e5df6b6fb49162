"""The small real inputs the matrix's jobs train on, made on the machine (no download): a slice
of the built-in corpus with a small trained tokenizer, chat examples and preference pairs in
the shapes users bring (prepared with an instruct-style tokenizer), and HF model folders with
random weights of stock transformers classes. The test suite trains on the same."""

from __future__ import annotations

import json
from pathlib import Path

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_tokenizer(tiny_data: Path, out: Path, template: str | None = CHATML) -> Path:
    """An HF tokenizer folder shaped like an instruct model's: tiny_data's tokenizer with the
    special tokens <|im_start|> and <|im_end|> and a ChatML template (none when None)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_data / "tokenizer"))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = template
    tok.split_special_tokens = False  # as an instruct model's: the template's tokens are special
    tok.init_kwargs["split_special_tokens"] = False
    tok.save_pretrained(str(out))
    return out


def chat_rows(n: int) -> list[dict]:
    """`n` examples in the three shapes whose completions are one word or a long line,
    so micro-batches hold very different numbers of trained tokens."""
    out = []
    for i in range(n):
        body = "return " + " + ".join(f"x{k}" for k in range(5 + i % 5)) if i % 2 else "ok"
        shape = i % 3
        if shape == 0:
            out.append({"prompt": f"def f{i}(x):\n", "completion": f"    {body}\n"})
        elif shape == 1:
            out.append(
                {"instruction": f"Name {i}", "input": f"in {i}" if i % 4 else "", "output": body}
            )
        else:
            user = {"role": "user", "content": f"Question {i}?"}
            out.append({"messages": [{"role": "system", "content": "Be brief."}, user,
                                     {"role": "assistant", "content": body}]})  # fmt: skip
    return out


def pair_rows(n: int) -> list[dict]:
    """`n` pairs in TRL's two shapes: text, and conversational with an implicit prompt."""
    out = []
    for i in range(n):
        if i % 2:
            out.append({"prompt": f"def f{i}(x):", "chosen": f"    return x + {i}",
                        "rejected": f"    pass  # {i}"})  # fmt: skip
        else:
            user = {"role": "user", "content": f"Is {i} even?"}
            out.append({"chosen": [user, {"role": "assistant", "content": "yes " * (i % 5 + 1)}],
                        "rejected": [user, {"role": "assistant", "content": "no"}]})  # fmt: skip
    return out


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def text_data(out: Path) -> Path:
    """A real corpus (300 files of the Python standard library) with a 512-token tokenizer."""
    from data import prepare

    prepare("pystdlib", out, vocab_size=512, max_docs=300, num_proc=1, val_fraction=0.05)
    return out


def chat_data(text: Path, base: Path) -> Path:
    """Chat data prepared from `chat_rows(60)` with `chat_tokenizer`, 64-token examples."""
    from data import prepare

    tok = chat_tokenizer(text, base / "tokenizer")
    src = write_jsonl(base / "chat.jsonl", chat_rows(60))
    out = base / "sft"
    prepare(src, out, tokenizer=tok, seq_len=64, val_fraction=0.2, progress=False)
    return out


def pair_data(text: Path, base: Path) -> dict:
    """Preference data from `pair_rows(48)`, 64-token sequences, and the tokenizer."""
    from data import prepare

    tok = chat_tokenizer(text, base / "tokenizer")
    src = write_jsonl(base / "pairs.jsonl", pair_rows(48))
    out = base / "pref"
    prepare(src, out, tokenizer=tok, seq_len=64, val_fraction=0.25, progress=False)
    return {"data": out, "tokenizer": tok, "base": base}


def hf_folder(kind: str, out: Path, vocab_size: int = 514) -> Path:
    """A stock `llama` or `mixtral` causal LM of the tiny preset's size with seeded random
    weights, saved as transformers saves it (vocabulary: the chat tokenizer's)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig

    shape = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=88, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    if kind == "llama":
        config = LlamaConfig(**shape)
    elif kind == "mixtral":
        config = MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **shape)
    else:
        raise ValueError(f"no HF folder kind {kind!r}")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out
