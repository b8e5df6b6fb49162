"""`ZeroStackConfig`: the shape of our Llama-style causal LM, with Llama's field names."""

from transformers import PretrainedConfig

from models.errors import ModelError


class ZeroStackConfig(PretrainedConfig):
    """Config of `ZeroStackForCausalLM`. Field names are Llama's, so the HF adapter is a plain copy.

    `head_dim` is always `hidden_size // num_attention_heads`; `num_key_value_heads=None` means
    multi-head attention (as many kv heads as heads). Bad shapes raise `ModelError`.
    """

    model_type = "zerostack"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]
    # How tensor parallelism splits a block, in transformers' tp_plan form (Llama's plan under our
    # module names): DeepSpeed's AutoTP and transformers' own `tp_plan="auto"` read it. Column
    # splits shard the output features (whole heads, whole MLP columns), row splits the inputs.
    # The per-head norms of qk_norm stay whole but see only the rank's heads: their gradients
    # are summed over the group (Qwen3's plan for its q_norm and k_norm).
    base_model_tp_plan = {
        "layers.*.attention.wq": "colwise",
        "layers.*.attention.wk": "colwise",
        "layers.*.attention.wv": "colwise",
        "layers.*.attention.wo": "rowwise",
        "layers.*.attention.q_norm": "replicated_with_grad_allreduce",
        "layers.*.attention.k_norm": "replicated_with_grad_allreduce",
        "layers.*.feed_forward.w1": "colwise",
        "layers.*.feed_forward.w3": "colwise",
        "layers.*.feed_forward.w2": "rowwise",
    }

    vocab_size: int = 32000
    hidden_size: int = 768
    intermediate_size: int = 2048
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = None
    use_cache: bool = True
    # RMSNorm of each head's queries and keys before the rotary embedding (Qwen3's, OLMo 2's):
    # steadier attention logits. The export then targets Qwen3ForCausalLM (models/hf_adapter.py).
    qk_norm: bool = False

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        self._validate()
        super().__post_init__(**kwargs)

    def _validate(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelError(f"{name} must be a positive integer, got {value!r}")
        h, nh, nkv = self.hidden_size, self.num_attention_heads, self.num_key_value_heads
        if h % nh:
            raise ModelError(f"num_attention_heads ({nh}) must divide hidden_size ({h})")
        if nh % nkv:
            raise ModelError(f"num_key_value_heads ({nkv}) must divide num_attention_heads ({nh})")
        if (h // nh) % 2:
            raise ModelError(
                f"head_dim = hidden_size / num_attention_heads = {h // nh} must be even for rotary embeddings"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_attention_heads


class ZeroStackMoeConfig(ZeroStackConfig):
    """Config of `ZeroStackMoeForCausalLM` (models/moe.py): our blocks with a routed MLP.

    `intermediate_size` is one expert's SwiGLU width (Mixtral's meaning). Each token goes to its
    `num_experts_per_tok` best experts, weighted by a softmax over their router logits; a shared
    expert of width `shared_expert_intermediate_size` (0: none) sees every token. The training
    loss adds `router_aux_loss_coef` times the load-balancing loss (Switch/Mixtral) and
    `router_z_loss_coef` times the router z-loss (ST-MoE).
    """

    model_type = "zerostack_moe"
    # Tensor parallelism splits attention only: experts are split by expert parallelism.
    base_model_tp_plan = {
        k: v for k, v in ZeroStackConfig.base_model_tp_plan.items() if "feed_forward" not in k
    }

    num_experts: int = 8
    num_experts_per_tok: int = 2
    shared_expert_intermediate_size: int = 0
    router_aux_loss_coef: float = 0.001
    router_z_loss_coef: float = 0.001

    def _validate(self) -> None:
        super()._validate()
        e, k = self.num_experts, self.num_experts_per_tok
        for name, value in (("num_experts", e), ("num_experts_per_tok", k)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelError(f"{name} must be a positive integer, got {value!r}")
        if k > e:
            raise ModelError(
                f"num_experts_per_tok ({k}) is above num_experts ({e}): a token cannot go to "
                "more experts than exist"
            )
        if self.shared_expert_intermediate_size < 0:
            raise ModelError("shared_expert_intermediate_size must be 0 (none) or positive")
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            if getattr(self, name) < 0:
                raise ModelError(f"{name} must be 0 or positive, got {getattr(self, name)!r}")
