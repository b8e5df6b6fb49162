"""ZeroStackForCausalLM: a Llama-style causal LM, top to bottom in one file.

RMSNorm, rotary embeddings in Hugging Face's `rotate_half` convention, grouped-query attention through
`scaled_dot_product_attention`, SwiGLU MLP, pre-norm blocks, optional tied embeddings. The weights rename
one-to-one onto `transformers.LlamaForCausalLM` (see `models/hf_adapter.py`).

The model knows nothing about parallelism: DeepSpeed, DDP or FSDP wrap it from `training/`.
"""

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

import models.cpu_attention as cpu_attention
from models.config import ZeroStackConfig
from models.documents import (
    BlockMask,
    DocumentStarts,
    document_attention_mask,
    document_positions,
    flex_document_attention,
    per_document_attention,
)
from models.errors import ModelError

IGNORE_INDEX = -100


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale, computed in fp32 like Llama's (`F.rms_norm` upcasts)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


@functools.lru_cache(maxsize=32)
def _rope_table(head_dim: int, theta: float, length: int, device: torch.device, dtype: torch.dtype):
    """(cos, signed sin) of shape (length, head_dim), computed once per shape, device and dtype."""
    # Built outside inference mode so a table first made by generate() can be reused in training.
    with torch.inference_mode(False), torch.no_grad():
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim)
        )
        freqs = torch.outer(torch.arange(length, dtype=torch.float, device=device), inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        # sin carries rotate_half's sign, so apply_rope needs no negation: rotate_half(x) * sin == roll(x) * ±sin.
        return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def rope_cos_sin(config: ZeroStackConfig, seq_len: int, device: torch.device, dtype: torch.dtype):
    """Cached rotary (cos, signed sin) for positions [0, seq_len), each (seq_len, head_dim); see apply_rope."""
    length = max(seq_len, config.max_position_embeddings)
    cos, sin = _rope_table(config.head_dim, float(config.rope_theta), length, device, dtype)
    return cos[:seq_len], sin[:seq_len]


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype matmuls produce for input x: the autocast dtype when autocast is on, else x's own."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] on the last dim, so rotate_half([1, 2, 3, 4]) == [-3, -4, 1, 2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (batch, heads, seq, head_dim) by position: x * cos + rotate_half(x) * sin, as Llama does.

    rotate_half(x) * sin == roll(x, head_dim / 2) * signed_sin with signed_sin = [-sin, sin] (from rope_cos_sin):
    three kernels instead of five, which counts on a CPU where every kernel launch is a thread sync.
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def _linear(in_features: int, out_features: int, std: float) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=False)
    # Read by init_weights, so every init path (plain, from_pretrained, ZeRO-3) gives the same init.
    layer.init_std = std
    return layer


@torch.no_grad()
def init_weights(module: nn.Module, std: float) -> None:
    """Initialise one module's own weights: normal(0, std) (a linear's `init_std` wins), norms to one.

    transformers' init functions are used so that weights already loaded by from_pretrained are skipped.
    """
    if isinstance(module, nn.Linear):
        init.normal_(module.weight, mean=0.0, std=getattr(module, "init_std", std))
    elif isinstance(module, nn.Embedding):
        init.normal_(module.weight, mean=0.0, std=std)
    elif isinstance(module, RMSNorm):
        init.ones_(module.weight)


ATTENTION_KERNELS = ("sdpa", "explicit", "amx", "flex")
EXPLICIT_UP_TO = 512  # without "amx", "auto" picks the explicit kernel on CPUs up to here


def explicit_attention(q, k, v, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v written out, the same numbers SDPA gives (within bf16 rounding).

    q (b, heads, t, d); k, v (b, kv_heads, s, d); mask as SDPA's (True = attend) or None for causal.
    The query heads that share a kv head are folded into one matmul, so k and v are never repeated.
    On CPUs it beats SDPA's flash kernel at short sequences (docs/benchmarks.md has where it breaks
    even), for the price of holding the (t, s) probabilities of every head."""
    b, h, t, d = q.shape
    kv, s = k.shape[1], k.shape[2]
    group = h // kv
    scores = ((q * d**-0.5).reshape(b, kv, group * t, d) @ k.transpose(-1, -2)).view(
        b, kv, group, t, s
    )
    if mask is not None:
        scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    elif t > 1:
        causal = torch.ones(t, s, dtype=torch.bool, device=q.device).triu_(s - t + 1)
        scores = scores.masked_fill(causal, float("-inf"))
    probs = scores.softmax(-1).view(b, kv, group * t, s)
    return (probs @ v).view(b, h, t, d)


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads and rotary positions."""

    def __init__(self, config: ZeroStackConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.kernel = "sdpa"  # one of ATTENTION_KERNELS: set_attention_kernel(); not in the config
        # (module, q, k, v) -> (batch, seq, features) or None: set_sequence_parallel()
        self.sequence_parallel = None
        self.n_heads = config.num_attention_heads
        self.config_qk_norm = bool(getattr(config, "qk_norm", False))
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        h, std = config.hidden_size, config.initializer_range
        self.wq = _linear(h, self.n_heads * self.head_dim, std)
        self.wk = _linear(h, self.n_kv_heads * self.head_dim, std)
        self.wv = _linear(h, self.n_kv_heads * self.head_dim, std)
        # Residual projections start smaller so the residual stream's variance does not grow with depth.
        self.wo = _linear(
            self.n_heads * self.head_dim, h, std / math.sqrt(2 * config.num_hidden_layers)
        )
        if config.qk_norm:  # per head, over head_dim, as Qwen3's q_norm / k_norm
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, cos, sin, mask=None, cache: Cache | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism a rank holds a slice of the heads.
        q = self.wq(x).view(b, t, -1, self.head_dim)
        k = self.wk(x).view(b, t, -1, self.head_dim)
        if self.config_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        if self.sequence_parallel is not None:
            # x is this rank's slice of the sequence; the wrapper trades it for a slice of the
            # heads over the whole sequence around `core` (set_sequence_parallel).
            return self.wo(self.sequence_parallel(self, q, k, v))
        y = self.core(q, k, v, mask)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))

    def core(self, q, k, v, mask=None) -> torch.Tensor:
        """Attention proper on (batch, heads, seq, head_dim) q/k/v; the model passes a mask only
        when the causal flag cannot express it (padding, chunked prefill, documents)."""
        if isinstance(mask, BlockMask):
            return flex_document_attention(q, k, v, mask)
        if isinstance(mask, DocumentStarts):
            return per_document_attention(q, k, v, mask.starts)
        if self.kernel == "explicit":
            return explicit_attention(q, k, v, mask)
        if self.kernel == "amx" and mask is None and cpu_attention.fits(q, k):
            return cpu_attention.causal_attention(q, k, v)
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None and q.shape[2] > 1,
            enable_gqa=k.shape[1] != q.shape[1],
        )


def pick_attention_kernel(choice: str, device_type: str, seq_len: int, masked: bool = False) -> str:
    """`choice`, with "auto" made concrete where each was measured faster (docs/benchmarks.md,
    docs/bench_attention.md): on a CPU, SDPA's forward with our backward ("amx") where the
    host runs it and the sequence divides into its blocks, else the explicit kernel up to
    sequence 512 and SDPA beyond; GPUs keep SDPA's fused kernels. `masked`: attention under a
    mask beyond causality (document masking), which "amx" does not take: on a GPU it takes
    FlexAttention ("flex"), whose block mask skips the blocks between documents in one fused
    kernel; on a CPU, SDPA over each document alone (models/documents.py). "amx" asked for on a host that cannot run it, or "flex" on a CPU (torch has
    no FlexAttention backward there), is a ModelError that says why."""
    if choice == "amx" and (why := cpu_attention.available()) is not None:
        raise ModelError(f"--attention amx: not on this host: {why}")
    if choice == "flex" and device_type == "cpu":
        raise ModelError(
            f"--attention flex: torch {torch.__version__} has no FlexAttention backward on CPUs; "
            "use --attention auto (SDPA per document) or run on a GPU"
        )
    if choice != "auto":
        return choice
    if device_type != "cpu":
        return "flex" if masked else "sdpa"
    if masked:
        # SDPA per document, no dense mask: a step 725 ms at 256 tokens against 852 (SDPA, dense)
        # and 874 (explicit), 988 against 1621 and 1788 at 2048 (docs/bench_attention.md)
        return "sdpa"
    if seq_len % cpu_attention.SMALL_BLOCK == 0 and cpu_attention.available() is None:
        return "amx"
    return "explicit" if seq_len <= EXPLICIT_UP_TO else "sdpa"


def sdpa_backend(config, device: torch.device, dtype: torch.dtype, seq_len: int) -> str | None:
    """Which of SDPA's kernels a causal training step of `config` at `seq_len` takes on `device`
    in `dtype` ("flash_attention", "efficient_attention", "cudnn_attention" or "math"), as torch's
    own dispatcher decides it: the name the run reports for `--attention sdpa`. None where torch
    cannot say (no dispatcher query in this build)."""
    from torch.nn.attention import SDPBackend

    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return None
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    q = torch.empty((1, heads, seq_len, head_dim), device=device, dtype=dtype, requires_grad=True)
    kv = torch.empty((1, kv_heads, seq_len, head_dim), device=device, dtype=dtype)
    kv.requires_grad_(True)
    try:
        choice = choose(q, kv, kv, None, 0.0, True, enable_gqa=kv_heads != heads)
    except (RuntimeError, TypeError):  # a device or dtype its dispatcher does not take
        return None
    return SDPBackend(choice).name.lower()


def set_attention_kernel(model: nn.Module, kernel: str) -> int:
    """Make every attention layer of `model` (ours, plain or pipelined) use `kernel`; returns how many."""
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(
            f"attention kernel {kernel!r}: choose one of {', '.join(ATTENTION_KERNELS)}"
        )
    # loads the C++ in this process (a process that never picked it has not)
    if kernel == "amx" and (why := cpu_attention.available()) is not None:
        raise ModelError(f"attention kernel 'amx': not on this host: {why}")
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for m in layers:
        m.kernel = kernel
    return len(layers)


def set_sequence_parallel(model: nn.Module, wrapper) -> int:
    """Route every attention layer of our model through `wrapper(attention, q, k, v)`, which
    returns the layer's output before `wo`, (batch, local seq, features); None undoes it. The
    training side builds the wrapper (DeepSpeed's Ulysses all-to-all around `Attention.core`),
    so the model itself needs no distributed code. Returns how many layers were routed."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for m in layers:
        m.sequence_parallel = wrapper
    return len(layers)


def set_z_loss(model: nn.Module, coefficient: float) -> None:
    """Train our model with a z-loss of `coefficient` (0: none). Raises ValueError for a model
    that is not ours."""
    if not isinstance(model, ZeroStackForCausalLM):
        raise ValueError(f"the z-loss is zerostack's model's; {type(model).__name__} has none")
    model.z_loss = float(coefficient)


def set_document_mask(model: nn.Module, separator: int | None) -> None:
    """Make our model treat `separator` (the data's EOS) as the end of a document in its training
    windows: attention stays inside each document and rotary positions restart at each; None
    turns it off. Windows with padding, a kv cache or given position_ids keep the usual causal
    path, so generate() is unchanged. Raises ValueError for a model that is not ours."""
    if not isinstance(model, ZeroStackForCausalLM):
        raise ValueError(
            f"document masking is zerostack's model's; {type(model).__name__} does not have it"
        )
    model.document_separator = separator


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: ZeroStackConfig, width: int | None = None):
        super().__init__()
        h, std = config.hidden_size, config.initializer_range
        i = width or config.intermediate_size
        self.w1 = _linear(h, i, std)  # gate
        self.w3 = _linear(h, i, std)  # up
        # down: a residual projection, scaled like wo
        self.w2 = _linear(i, h, std / math.sqrt(2 * config.num_hidden_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(GradientCheckpointingLayer):
    """Pre-norm transformer block. As a GradientCheckpointingLayer it is recomputed in backward when
    `model.gradient_checkpointing_enable()` (or `_set_gradient_checkpointing`) has switched it on."""

    def __init__(
        self, config: ZeroStackConfig, layer_idx: int, feed_forward: nn.Module | None = None
    ):
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = Attention(config, layer_idx)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # the MoE model passes its routed MLP (models/moe.py)
        self.feed_forward = feed_forward if feed_forward is not None else FeedForward(config)

    def forward(self, x, cos, sin, mask=None, past_key_values: Cache | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, mask, past_key_values)
        return x + self.feed_forward(self.ffn_norm(x))


def _attention_mask(
    attention_mask: torch.Tensor | None, q_len: int, past_len: int, device
) -> torch.Tensor | None:
    """Boolean (batch|1, 1, q_len, k_len) mask, True = attend, or None when SDPA's causal flag suffices."""
    padded = attention_mask is not None and not bool(attention_mask.all())
    if not padded and (past_len == 0 or q_len == 1):
        return None
    k_len = past_len + q_len
    k_pos = torch.arange(k_len, device=device)
    q_pos = torch.arange(past_len, k_len, device=device)
    mask = (k_pos[None, :] <= q_pos[:, None])[None, None]
    if padded:
        mask = mask & attention_mask[:, None, None, -k_len:].bool()
        # A padding query with no visible key would make SDPA return NaN; let it see itself (its output is unused).
        mask = mask | (k_pos[None, :] == q_pos[:, None])
    return mask


class _CrossEntropyGradInForward(torch.autograd.Function):
    """Summed fp32 cross-entropy of (N, V) logits whose gradient is made during the forward, chunk by chunk.

    The same numbers as `F.cross_entropy(logits.float(), ...)`, but the full-size fp32 copy, log-softmax
    and their backward never exist: each chunk of rows is upcast while it sits in cache, and what is kept
    for backward is softmax - onehot in the logits' dtype (half the bytes of the fp32 log-softmax that
    autograd would keep for bf16 logits).
    """

    @staticmethod
    def forward(ctx, logits, targets, ignore_index: int, denominator, chunk_rows: int, z=None):
        """`z` (a z-loss): [coefficient, None], its part of the loss written to z[1]."""
        grad = torch.empty_like(logits)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        z_total = torch.zeros((), dtype=torch.float32, device=logits.device)
        scale = 1.0 / denominator
        for start in range(0, logits.shape[0], chunk_rows):
            t = targets[start : start + chunk_rows]
            valid = (t != ignore_index).unsqueeze(1)
            t = t.masked_fill(~valid.squeeze(1), 0).unsqueeze(1)
            rows = logits[start : start + chunk_rows]
            logp = F.log_softmax(rows, dim=1, dtype=torch.float32)
            total -= (logp.gather(1, t) * valid).sum()
            weight = valid * scale  # d(loss)/d(row loss): 0 for ignored rows
            on_softmax = weight
            if z is not None:  # + coef * lse^2 a row, whose gradient is 2 coef lse softmax
                lse = rows[:, :1].float() - logp[:, :1]  # log of the normalizer
                z_total += (lse.square() * valid).sum()
                on_softmax = weight * (1 + 2 * z[0] * lse)
            # (softmax - onehot) * weight, in place of the chunk's log-softmax
            grad[start : start + chunk_rows] = (
                logp.exp_().mul_(on_softmax).scatter_add_(1, t, -weight)
            )
        ctx.save_for_backward(grad)
        if z is None:
            return total * scale
        z[1] = (z_total * z[0] * scale).detach()
        return (total + z[0] * z_total) * scale

    @staticmethod
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        return grad * grad_output.to(grad.dtype), None, None, None, None, None


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    shift_labels: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    num_items_in_batch: torch.Tensor | int | None = None,
    z_loss: list | None = None,
) -> torch.Tensor:
    """Next-token cross-entropy in fp32, as transformers' ForCausalLMLoss.

    `labels` (batch, seq) are shifted here (position i predicts labels[i + 1]); `shift_labels`, if given, are
    already-shifted targets of the same length as the input and are used as they are. Targets equal to
    `ignore_index` do not count. With `num_items_in_batch` the sum is divided by it instead of taking the mean.
    `z_loss` ([coefficient, None], training only): the loss adds coefficient x log(Z)^2 per counted token
    (PaLM's z-loss, Z the softmax's normalizer), and its part of the loss is written to z_loss[1].
    """
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    logits = logits.reshape(-1, logits.shape[-1])
    targets = shift_labels.reshape(-1).to(logits.device)
    if num_items_in_batch is None:
        denominator = (targets != ignore_index).sum()
    elif torch.is_tensor(num_items_in_batch):
        denominator = num_items_in_batch.to(logits.device)
    else:
        denominator = num_items_in_batch
    # Rows per chunk: about 16 MB of fp32, small enough to stay in a CPU's last-level cache.
    chunk_rows = max(1, (1 << 22) // logits.shape[-1])
    if not (torch.is_grad_enabled() and logits.requires_grad):  # eval: no gradient to make
        # Chunk by chunk too: no full-size fp32 copy of the logits at long sequences.
        loss = sum(
            F.cross_entropy(
                logits[i : i + chunk_rows].float(),
                targets[i : i + chunk_rows],
                ignore_index=ignore_index,
                reduction="sum",
            )
            for i in range(0, logits.shape[0], chunk_rows)
        )
        return loss / denominator
    return _CrossEntropyGradInForward.apply(
        logits, targets, ignore_index, denominator, chunk_rows, z_loss
    )


# The output's KV-cache field: `cache` from transformers 5.24, `past_key_values` before.
_CACHE_FIELD = (
    "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
)


class ZeroStackForCausalLM(PreTrainedModel, GenerationMixin):
    """The causal LM. `forward(input_ids, labels=...)` returns a `CausalLMOutputWithPast` with an fp32 loss."""

    config_class = ZeroStackConfig
    base_model_prefix = "zerostack"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Block"]
    _skip_keys_device_placement = ["past_key_values", "cache"]
    _supports_sdpa = True
    _tied_weights_keys = {"output.weight": "tok_embeddings.weight"}

    def __init__(self, config: ZeroStackConfig):
        super().__init__(config)
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self._block(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.output = _linear(config.hidden_size, config.vocab_size, config.initializer_range)
        # Token id that ends documents in packed windows, or None: set_document_mask(); not config.
        self.document_separator: int | None = None
        # z-loss coefficient in training (set_z_loss; not config), and the sum of its part of the
        # loss over the training forwards since the loop last took it (a device tensor)
        self.z_loss = 0.0
        self.z_loss_sum: torch.Tensor | None = None
        self.post_init()  # initialises weights through _init_weights and ties output to tok_embeddings if asked

    def _block(self, config: ZeroStackConfig, layer_idx: int) -> Block:
        return Block(config, layer_idx)

    def _init_weights(self, module: nn.Module) -> None:
        init_weights(module, self.config.initializer_range)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.tok_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.tok_embeddings = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.output

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.output = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        shift_labels: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        inputs_embeds: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        cache: Cache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits for input_ids (batch, seq); the loss too when `labels` are given (see `causal_lm_loss`).

        attention_mask (batch, past + seq) of 1/0 marks padding; without it, or when it is all ones, no mask
        is built and SDPA runs with its causal flag. `use_cache=True` (what generate passes) returns a
        DynamicCache; it is off by default so training never keeps one. A cache passed in is taken as
        `past_key_values` or as `cache` (transformers 5.24's name for it). `logits_to_keep=n` computes logits
        for the last n positions only. After `set_document_mask(model, eos_id)`, a window without padding,
        cache or position_ids attends within each of its documents only. Other keyword arguments from HF
        callers (return_dict, output_attentions, ...) are ignored, except `ignore_index` and
        `num_items_in_batch` for the loss.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if cache is not None:  # transformers >= 5.24 names the KV cache `cache`
            past_key_values = cache
        h = self.tok_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        t = h.shape[1]

        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        cache = past_key_values if use_cache or past_key_values is not None else None
        past_len = cache.get_seq_length() if cache is not None else 0

        dtype = compute_dtype(h)
        mask = _attention_mask(attention_mask, t, past_len, h.device)
        packed = self.document_separator is not None and input_ids is not None
        if packed and cache is None and mask is None and position_ids is None:
            # Packed documents (training): each attends to itself only, from position 0.
            docs, position_ids = document_positions(input_ids, self.document_separator)
            # One mask a forward, in the shape this model's attention kernel takes.
            mask = document_attention_mask(docs, position_ids, self.layers[0].attention.kernel)
            cos, sin = rope_cos_sin(self.config, t, h.device, dtype)  # positions are below t
            cos, sin = cos[position_ids].unsqueeze(1), sin[position_ids].unsqueeze(1)
        elif position_ids is None:
            cos, sin = rope_cos_sin(self.config, past_len + t, h.device, dtype)
            cos, sin = cos[past_len:], sin[past_len:]
        else:
            cos, sin = rope_cos_sin(self.config, int(position_ids.max()) + 1, h.device, dtype)
            cos, sin = cos[position_ids].unsqueeze(1), sin[position_ids].unsqueeze(1)

        for block in self.layers:
            # Positional arguments: reentrant checkpoint functions (DeepSpeed's) only see those.
            h = block(h, cos, sin, mask, past_key_values=cache)
        h = self.norm(h)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.output(h)

        loss = None
        z_term = [self.z_loss, None] if self.z_loss and torch.is_grad_enabled() else None
        if labels is not None:
            loss = causal_lm_loss(
                logits,
                labels,
                shift_labels,
                ignore_index=kwargs.get("ignore_index", IGNORE_INDEX),
                num_items_in_batch=kwargs.get("num_items_in_batch"),
                z_loss=z_term,
            )
            if z_term is not None:
                z = z_term[1]
                self.z_loss_sum = z if self.z_loss_sum is None else self.z_loss_sum + z
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})


# Our own save_pretrained folders (model_type "zerostack") load through the Auto classes.
AutoConfig.register("zerostack", ZeroStackConfig, exist_ok=True)
AutoModelForCausalLM.register(ZeroStackConfig, ZeroStackForCausalLM, exist_ok=True)
