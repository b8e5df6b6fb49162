"""The one place that knows `transformers.LlamaForCausalLM`'s parameter names, Qwen3's,
which are Llama's plus a per-head RMSNorm of queries and keys (`q_norm`, `k_norm`), and
`MixtralForCausalLM`'s and `Qwen3MoeForCausalLM`'s: a model with `qk_norm` exports as a stock
`Qwen3ForCausalLM`, our mixture-of-experts model as `MixtralForCausalLM` (with `qk_norm`
`Qwen3MoeForCausalLM`), every other as `LlamaForCausalLM`.

Our rotary embedding uses Hugging Face's `rotate_half` convention, so converting weights either way is pure
renaming: no permutation of q/k, no reshaping. Configs map field by field. Our MoE model exports as Mixtral:
its blocks are Llama's (no QK-norm, no biases) with Mixtral's router and SwiGLU experts; with QK-norm
they are Qwen3-MoE's, whose router (softmax, top-k, renormalised) routes as ours.
"""

import os
import re

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
)

from models.config import ZeroStackConfig, ZeroStackMoeConfig
from models.errors import ModelError

# (ours, Llama's). Per-block names are relative to `layers.{i}.` / `model.layers.{i}.`.
_TOP_LEVEL = [
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
]
_PER_BLOCK = [
    ("attention_norm.weight", "input_layernorm.weight"),
    ("attention.wq.weight", "self_attn.q_proj.weight"),
    ("attention.wk.weight", "self_attn.k_proj.weight"),
    ("attention.wv.weight", "self_attn.v_proj.weight"),
    ("attention.wo.weight", "self_attn.o_proj.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("feed_forward.w1.weight", "mlp.gate_proj.weight"),
    ("feed_forward.w3.weight", "mlp.up_proj.weight"),
    ("feed_forward.w2.weight", "mlp.down_proj.weight"),
    ("attention.q_norm.weight", "self_attn.q_norm.weight"),  # qk_norm (Qwen3) only
    ("attention.k_norm.weight", "self_attn.k_norm.weight"),
]
_OURS_BLOCK = re.compile(r"layers\.(\d+)\.(.+)")
_LLAMA_BLOCK = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _rename(
    sd: dict, top: dict, block: dict, block_re: re.Pattern, block_prefix: str, what: str
) -> dict:
    out = {}
    for name, tensor in sd.items():
        if name in top:
            out[top[name]] = tensor
            continue
        m = block_re.fullmatch(name)
        if m is None or m.group(2) not in block:
            raise ModelError(f"unexpected parameter {name!r} in a {what} state dict")
        out[f"{block_prefix}{m.group(1)}.{block[m.group(2)]}"] = tensor
    return out


def to_llama_state_dict(sd: dict) -> dict:
    """Our state dict -> LlamaForCausalLM's (same tensors, new names)."""
    return _rename(
        sd, dict(_TOP_LEVEL), dict(_PER_BLOCK), _OURS_BLOCK, "model.layers.", "zerostack"
    )


_MOE = "feed_forward."
# Where a stock MoE checkpoint file keeps a block's routed MLP, and its experts' (gate, up, down)
MIXTRAL_NAMES = ("block_sparse_moe", ("w1", "w3", "w2"))
QWEN3_MOE_NAMES = ("mlp", ("gate_proj", "up_proj", "down_proj"))


def to_moe_state_dict(sd: dict, names: tuple = MIXTRAL_NAMES) -> dict:
    """Our MoE model's state dict -> the names of a Mixtral checkpoint file (or with
    QWEN3_MOE_NAMES a Qwen3-MoE one: what `save_pretrained` writes and every transformers
    version loads): the router as `<block>.gate`, each expert as `<block>.experts.{e}.<gate, up,
    down>`, cut from our stacked weights as views (no copy)."""
    block, (gate_name, up_name, down_name) = names
    dense = {k: v for k, v in sd.items() if _MOE not in k}
    out = to_llama_state_dict(dense)
    for name, t in sd.items():
        m = _OURS_BLOCK.fullmatch(name)
        if m is None or not m.group(2).startswith(_MOE):
            continue
        prefix, what = f"model.layers.{m.group(1)}.{block}.", m.group(2)[len(_MOE) :]
        if what == "gate.weight":
            out[prefix + what] = t
        elif what == "experts.gate_up_proj":
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{prefix}experts.{e}.{gate_name}.weight"] = gate[e]
                out[f"{prefix}experts.{e}.{up_name}.weight"] = up[e]
        elif what == "experts.down_proj":
            for e in range(t.shape[0]):
                out[f"{prefix}experts.{e}.{down_name}.weight"] = t[e]
        else:
            raise ModelError(f"{name}: a stock MoE model has no such weight (a shared expert?)")
    return out


def to_qwen3_moe_state_dict(sd: dict) -> dict:
    return to_moe_state_dict(sd, QWEN3_MOE_NAMES)


def from_llama_state_dict(sd: dict) -> dict:
    """LlamaForCausalLM's state dict -> ours (same tensors, new names). Rotary buffers, if any, are dropped."""
    sd = {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}
    top = {theirs: ours for ours, theirs in _TOP_LEVEL}
    block = {theirs: ours for ours, theirs in _PER_BLOCK}
    return _rename(sd, top, block, _LLAMA_BLOCK, "layers.", "Llama")


def to_llama_config(config: ZeroStackConfig) -> LlamaConfig | Qwen3Config:
    """Our config -> a LlamaConfig of the same shape, with `architectures=["LlamaForCausalLM"]`;
    with qk_norm a Qwen3Config (full attention in every layer, `Qwen3ForCausalLM`)."""
    if getattr(config, "qk_norm", False):
        return Qwen3Config(
            **_shared_fields(config), use_sliding_window=False, architectures=["Qwen3ForCausalLM"]
        )
    return LlamaConfig(**_shared_fields(config), mlp_bias=False, architectures=["LlamaForCausalLM"])


def _shared_fields(config: ZeroStackConfig) -> dict:
    """The fields Llama's and Qwen3's configs share, from ours."""
    return dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        hidden_act="silu",
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(config.rope_theta)},
        tie_word_embeddings=config.tie_word_embeddings,
        initializer_range=config.initializer_range,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        attention_bias=False,
        dtype=config.dtype,
    )


def to_moe_config(config: ZeroStackMoeConfig) -> MixtralConfig | Qwen3MoeConfig:
    """Our MoE config -> a MixtralConfig of the same shape (`architectures=["MixtralForCausalLM"]`),
    with qk_norm a Qwen3MoeConfig (`Qwen3MoeForCausalLM`, experts in every layer, top-k weights
    renormalised as ours are). Neither has a shared expert: a model with one is a ModelError."""
    if config.shared_expert_intermediate_size:
        raise ModelError(
            "this MoE model has a shared expert, which transformers' Mixtral and Qwen3-MoE do not "
            "have; it cannot be exported as either"
        )
    qk_norm = getattr(config, "qk_norm", False)
    cls = Qwen3MoeConfig if qk_norm else MixtralConfig
    llama = to_llama_config(config).to_dict()
    own = {"architectures", "model_type", "sliding_window", "use_sliding_window"}
    fields = {k: llama[k] for k in set(cls.__dataclass_fields__) & set(llama) - own}
    moe = dict(
        num_experts_per_tok=config.num_experts_per_tok,
        router_aux_loss_coef=config.router_aux_loss_coef,
        sliding_window=None,
    )
    if qk_norm:
        return Qwen3MoeConfig(
            **fields, **moe, num_experts=config.num_experts, norm_topk_prob=True,
            moe_intermediate_size=config.intermediate_size, decoder_sparse_step=1,
            mlp_only_layers=[], use_sliding_window=False, architectures=["Qwen3MoeForCausalLM"],
        )  # fmt: skip
    return MixtralConfig(
        **fields, **moe, num_local_experts=config.num_experts, architectures=["MixtralForCausalLM"]
    )


def to_hf(config: ZeroStackConfig):
    """Our config -> (the stock transformers config it exports as, the state-dict renamer):
    Mixtral for our MoE model (Qwen3-MoE with qk_norm), Llama for the dense one."""
    if isinstance(config, ZeroStackMoeConfig):
        qk_norm = getattr(config, "qk_norm", False)
        return to_moe_config(config), (to_qwen3_moe_state_dict if qk_norm else to_moe_state_dict)
    return to_llama_config(config), to_llama_state_dict


def from_llama_config(llama_config: LlamaConfig) -> ZeroStackConfig:
    """A LlamaConfig -> our config. Raises ModelError for Llama variants our model does not implement."""
    rope = dict(llama_config.rope_parameters or {})
    head_dim = (
        getattr(llama_config, "head_dim", None)
        or llama_config.hidden_size // llama_config.num_attention_heads
    )
    unsupported = {
        "hidden_act": (llama_config.hidden_act, "silu"),
        "attention_bias": (bool(llama_config.attention_bias), False),
        "mlp_bias": (bool(getattr(llama_config, "mlp_bias", False)), False),
        "use_sliding_window": (bool(getattr(llama_config, "use_sliding_window", False)), False),
        "rope_type": (rope.get("rope_type", "default"), "default"),
        "head_dim": (head_dim, llama_config.hidden_size // llama_config.num_attention_heads),
    }
    for key, (got, want) in unsupported.items():
        if got != want:
            raise ModelError(
                f"this Llama config has {key}={got!r}; zerostack's model supports only {want!r}"
            )
    return ZeroStackConfig(
        vocab_size=llama_config.vocab_size,
        hidden_size=llama_config.hidden_size,
        intermediate_size=llama_config.intermediate_size,
        num_hidden_layers=llama_config.num_hidden_layers,
        num_attention_heads=llama_config.num_attention_heads,
        num_key_value_heads=llama_config.num_key_value_heads,
        max_position_embeddings=llama_config.max_position_embeddings,
        rms_norm_eps=llama_config.rms_norm_eps,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        tie_word_embeddings=bool(llama_config.tie_word_embeddings),
        initializer_range=llama_config.initializer_range,
        bos_token_id=llama_config.bos_token_id,
        eos_token_id=llama_config.eos_token_id,
        pad_token_id=llama_config.pad_token_id,
        qk_norm=isinstance(llama_config, Qwen3Config),
    )


def save_llama(state_dict: dict, config: ZeroStackConfig, out_dir: str | os.PathLike) -> None:
    """Write our weights as a stock `LlamaForCausalLM` folder (config.json + model.safetensors).

    state_dict: ours, full (not ZeRO-partitioned), any dtype; the files keep that dtype.
    """
    llama_config = to_llama_config(config)
    llama_sd = to_llama_state_dict(state_dict)
    if config.tie_word_embeddings:
        llama_sd.pop("lm_head.weight", None)  # stored once, as embed_tokens
    llama_config.dtype = next(iter(llama_sd.values())).dtype
    with torch.device("meta"):
        model = (Qwen3ForCausalLM if config.qk_norm else LlamaForCausalLM)(llama_config)
    model.load_state_dict(llama_sd, strict=False, assign=True)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelError(f"state dict lacks weights for {missing[:3]} ...")
    model.save_pretrained(out_dir)
