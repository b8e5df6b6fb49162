"""zerostack's causal LM: config, presets, model, HF adapter, factory and pipeline layers.

Nothing here imports DeepSpeed or training/: engines apply parallelism to the model from outside.
"""

from models.blocks import transformer_blocks
from models.compile import compile_blocks
from models.config import ZeroStackConfig, ZeroStackMoeConfig
from models.errors import ModelError
from models.factory import Partitioned, build_model, model_class
from models.hf_adapter import (
    from_llama_config,
    from_llama_state_dict,
    save_llama,
    to_llama_config,
    to_llama_state_dict,
)
from models.hub import resolve_pretrained
from models.llama import (
    ZeroStackForCausalLM,
    causal_lm_loss,
    pick_attention_kernel,
    sdpa_backend,
    set_attention_kernel,
    set_document_mask,
    set_sequence_parallel,
    set_z_loss,
)
from models.moe import (
    ZeroStackMoeForCausalLM,
    router_metrics,
    take_router_totals,
    takes_router_group,
)
from models.pipeline import (
    model_state_dict_to_pipeline,
    pipeline_loss,
    pipeline_state_dict_to_model,
)
from models.presets import PRESETS, flops_per_token, get_config, num_params

__all__ = [
    "PRESETS",
    "ModelError",
    "Partitioned",
    "ZeroStackConfig",
    "ZeroStackForCausalLM",
    "ZeroStackMoeConfig",
    "ZeroStackMoeForCausalLM",
    "build_model",
    "causal_lm_loss",
    "compile_blocks",
    "flops_per_token",
    "from_llama_config",
    "from_llama_state_dict",
    "get_config",
    "model_class",
    "model_state_dict_to_pipeline",
    "num_params",
    "pick_attention_kernel",
    "sdpa_backend",
    "pipeline_loss",
    "pipeline_state_dict_to_model",
    "resolve_pretrained",
    "router_metrics",
    "save_llama",
    "set_attention_kernel",
    "set_document_mask",
    "set_z_loss",
    "set_sequence_parallel",
    "take_router_totals",
    "takes_router_group",
    "to_llama_config",
    "to_llama_state_dict",
    "transformer_blocks",
]
