"""The same model as a sequence of pipeline layers: embedding, one layer per block, final norm, head.

training/engines/pipeline_engine.py stacks them into a DeepSpeed `PipelineModule` (this package does not import
DeepSpeed).

Layer i of the pipeline holds exactly the weights of one piece of `ZeroStackForCausalLM`, so the two state
dicts map one-to-one (`pipeline_state_dict_to_model` / `model_state_dict_to_pipeline`). DeepSpeed names a
pipeline parameter `<layer_idx>.<name>`, and a tied embedding `tied_modules.embed.<name>`:

    tok_embeddings.weight   <->  0.weight            (tied: tied_modules.embed.weight)
    layers.{i}.<name>       <->  {i + 1}.<name>
    norm.weight             <->  {L + 1}.weight
    output.weight           <->  {L + 2}.weight      (tied: no weight of its own)

Between stages only tensors travel: token ids into layer 0, hidden states after it, logits out of the head.
"""

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ZeroStackConfig
from models.errors import ModelError
from models.llama import Block, RMSNorm, causal_lm_loss, compute_dtype, init_weights, rope_cos_sin

TIED_KEY = "embed"


class EmbeddingPipe(nn.Embedding):
    """Layer 0: token ids (batch, seq) -> hidden states (batch, seq, hidden)."""

    def __init__(self, config: ZeroStackConfig):
        super().__init__(config.vocab_size, config.hidden_size)
        init_weights(self, config.initializer_range)


class BlockPipe(Block):
    """One transformer block taking only hidden states; rotary tables come from the shared cache."""

    def __init__(self, config: ZeroStackConfig, layer_idx: int):
        if getattr(config, "num_experts", None):  # its router losses need the whole model's forward
            raise ModelError("pipeline parallelism does not take the MoE model; use ZeRO 1-2")
        super().__init__(config, layer_idx)
        self.config = config
        for module in self.modules():
            init_weights(module, config.initializer_range)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_cos_sin(self.config, h.shape[1], h.device, compute_dtype(h))
        return super().forward(h, cos, sin)


class NormPipe(RMSNorm):
    """The final norm."""

    def __init__(self, config: ZeroStackConfig):
        super().__init__(config.hidden_size, config.rms_norm_eps)


class HeadPipe(nn.Linear):
    """The untied lm_head: hidden states -> logits."""

    def __init__(self, config: ZeroStackConfig):
        super().__init__(config.hidden_size, config.vocab_size, bias=False)
        init_weights(self, config.initializer_range)


def tied_head(embedding: EmbeddingPipe, h: torch.Tensor) -> torch.Tensor:
    return F.linear(h, embedding.weight)


def pipeline_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss in fp32; labels are already-shifted targets, as long as the input (-100 ignored)."""
    return causal_lm_loss(logits, shift_labels=labels)


def model_state_dict_to_pipeline(sd: dict, config: ZeroStackConfig) -> dict:
    """ZeroStackForCausalLM state dict -> PipelineModule state dict (same tensors, renamed)."""
    last = config.num_hidden_layers
    embedding = f"tied_modules.{TIED_KEY}.weight" if config.tie_word_embeddings else "0.weight"
    out = {}
    for name, tensor in sd.items():
        if name == "tok_embeddings.weight":
            out[embedding] = tensor
        elif name.startswith("layers."):
            idx, rest = name[len("layers.") :].split(".", 1)
            out[f"{int(idx) + 1}.{rest}"] = tensor
        elif name == "norm.weight":
            out[f"{last + 1}.weight"] = tensor
        elif name == "output.weight":
            if not config.tie_word_embeddings:  # tied: the embedding's weight is the head
                out[f"{last + 2}.weight"] = tensor
        else:
            raise ModelError(f"unexpected parameter {name!r} in a zerostack state dict")
    return out


def pipeline_state_dict_to_model(sd: dict, config: ZeroStackConfig | None = None) -> dict:
    """PipelineModule state dict (all stages merged) -> ZeroStackForCausalLM state dict (same tensors).

    Tied embeddings are recognised by the `tied_modules.` key, or taken from config when given; the model
    dict then holds the embedding under both `tok_embeddings.weight` and `output.weight`, as the model's does.
    """
    tied = (
        config.tie_word_embeddings
        if config is not None
        else any(k.startswith("tied_modules.") for k in sd)
    )
    out = {}
    for name, tensor in sd.items():
        idx, rest = name.split(".", 1)
        if idx == "tied_modules" or name == "0.weight":
            out["tok_embeddings.weight"] = tensor
        elif not idx.isdigit() or (rest != "weight" and "." not in rest):
            raise ModelError(f"unexpected parameter {name!r} in a zerostack pipeline state dict")
        elif rest != "weight":
            out[f"layers.{int(idx) - 1}.{rest}"] = tensor
        else:  # the last layers own a bare weight: the final norm's is 1-D, the head's 2-D
            out["norm.weight" if tensor.dim() == 1 else "output.weight"] = tensor
    if tied and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out
