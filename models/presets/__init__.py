"""Model size presets as data, and the model's cost by formula (parameters, training FLOPs per token).

`tiny` is for tests, `small` for the quickstart. 125M-2.7B follow GPT-3's shapes (hidden, layers, heads) with a
SwiGLU width of about 8/3 hidden, rounded up to a multiple of 256, and tied embeddings; 7B and 13B are Llama 2's
shapes. Names are nominal: the parameter count depends on the vocabulary, which the data's tokenizer decides
(`get_config(name, vocab_size=...)`); `python -m models.presets` prints the table. `tiny-moe` and
`small-moe` are mixtures of experts (models/moe.py) with the active parameters of `tiny` and `small`.
"""

from models.config import ZeroStackConfig, ZeroStackMoeConfig
from models.errors import ModelError

# Fields not given here take ZeroStackConfig's defaults (rms_norm_eps 1e-5, rope_theta 1e4, init 0.02).
PRESETS: dict[str, dict] = {
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    ),
    "small": dict(
        vocab_size=8192,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    ),
    "125M": dict(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
    "350M": dict(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=24,
        num_attention_heads=16,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
    "760M": dict(
        vocab_size=32000,
        hidden_size=1536,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
    "1.3B": dict(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=24,
        num_attention_heads=16,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
    # GPT-3 2.7B's shape (2560 wide, 32 layers, 32 heads): the largest whose training states
    # (about 16 bytes a parameter) NVMe offload can train on a 24 GiB host (docs/scale.md)
    "2.7B": dict(
        vocab_size=32000,
        hidden_size=2560,
        intermediate_size=6912,
        num_hidden_layers=32,
        num_attention_heads=32,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
    "7B": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    "13B": dict(
        vocab_size=32000,
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=40,
        num_attention_heads=40,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    # tiny's shape with 4 experts of half its MLP width, 2 a token: the active MLP is tiny's
    "tiny-moe": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=88,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        num_experts=4,
        num_experts_per_tok=2,
    ),
    # small's shape with 8 experts of half its MLP width, 2 a token: small's active parameters
    # (the dense model to measure it against) with about 4 times its MLP parameters
    "small-moe": dict(
        vocab_size=8192,
        hidden_size=384,
        intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        num_experts=8,
        num_experts_per_tok=2,
    ),
}


def get_config(name: str, **overrides) -> ZeroStackConfig:
    """Preset name (+ field overrides, e.g. vocab_size=...) -> ZeroStackConfig. Unknown names raise ModelError."""
    if name not in PRESETS:
        raise ModelError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}")
    fields = {**PRESETS[name], **overrides}
    return (ZeroStackMoeConfig if "num_experts" in fields else ZeroStackConfig)(**fields)


def num_params(config: ZeroStackConfig, active: bool = False) -> int:
    """Parameters of ZeroStackForCausalLM(config) (or the MoE model's), by formula; tied
    embeddings count once. `active`: an MoE model's experts count only the k a token uses."""
    h, hd = config.hidden_size, config.head_dim
    # wq and wo: heads * head_dim each way; wk and wv: kv_heads * head_dim
    attention = h * hd * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    mlp = 3 * h * config.intermediate_size
    if isinstance(config, ZeroStackMoeConfig):  # experts, router, shared expert
        experts = config.num_experts_per_tok if active else config.num_experts
        mlp = mlp * experts + h * config.num_experts
        mlp += 3 * h * config.shared_expert_intermediate_size
    block = attention + mlp + 2 * h  # + two norms
    embeddings = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    return config.num_hidden_layers * block + h + embeddings


def _get(config, *names):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    raise ModelError(f"{type(config).__name__} has none of {names}; cannot count its FLOPs")


def flops_per_token(config, seq_len: int, n_params: int | None = None) -> float:
    """Training FLOPs per token (forward + backward) at sequence length seq_len: 6*N + 12*L*H*seq_len.

    N counts every weight that takes part in a matmul (of an MoE model, the active ones: the k
    experts a token goes to): all parameters except the input embedding table, with
    the lm_head counted (whether tied or not), i.e. the PaLM / nanoGPT convention. The attention term
    12*L*H*seq_len is the QK^T and AV matmuls forward and backward, over the full (not causally halved) square.
    `config` may be our config (N by formula) or any HF causal-LM config (GPT-2's n_layer/n_embd, Qwen2's ...);
    for those pass n_params = sum(p.numel() for p in model.parameters()) (tied weights counted once).
    """
    layers = _get(config, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _get(config, "hidden_size", "n_embd", "d_model")
    vocab = _get(config, "vocab_size")
    if isinstance(config, ZeroStackMoeConfig):
        n_params = num_params(config, active=True)  # a counted n_params holds every expert
    elif n_params is None:
        if not isinstance(config, ZeroStackConfig):
            raise ModelError(f"flops_per_token needs n_params for a {type(config).__name__}")
        n_params = num_params(config)
    else:
        n_params -= inactive_expert_params(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    # A tied table is counted once in n_params and is the lm_head's matmul; an untied input table does no matmul.
    n_matmul = n_params if tied else n_params - vocab * hidden
    return 6.0 * n_matmul + 12.0 * layers * hidden * seq_len


def inactive_expert_params(config) -> int:
    """Expert parameters a token does not use in a transformers MoE config (Mixtral's
    `num_local_experts`, Qwen-MoE's `num_experts` and `moe_intermediate_size`); 0 for dense."""
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    k = getattr(config, "num_experts_per_tok", None)
    if not experts or not k:
        return 0
    width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return (experts - k) * 3 * config.hidden_size * width * config.num_hidden_layers


def preset_table(seq_len: int = 1024) -> str:
    """A Markdown table of every preset: parameters and training FLOPs per token at seq_len."""
    rows = [
        f"| preset | layers | hidden | heads/kv | params | GFLOPs/token @ {seq_len} |",
        "|---|---|---|---|---|---|",
    ]
    for name in PRESETS:
        c = get_config(name)
        rows.append(
            f"| {name} | {c.num_hidden_layers} | {c.hidden_size} | {c.num_attention_heads}/{c.num_key_value_heads} "
            f"| {num_params(c) / 1e6:,.2f}M | {flops_per_token(c, seq_len) / 1e9:.3f} |"
        )
    return "\n".join(rows)
