"""DeepSpeed's pipeline engine: our model's pipeline layers (`models/pipeline.py`) stacked into a
`PipelineModule` and cut into stages, ZeRO-0/1 across the data-parallel replicas that remain
(world = stages x dp).

`PipelineEngine.train_batch` runs a whole step at once (every micro-batch through every stage,
then the optimizer step), so this engine buffers the loop's micro-batches and runs the step on
the boundary. Everything else (lr, save, load) is the plain DeepSpeed engine's, except that a
universal copy names parameters as the unpipelined model does (training/checkpoints/universal_copy.py), so its
parameters are looked up under those names while it loads.
"""

from __future__ import annotations

import math
import warnings

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

from models import model_state_dict_to_pipeline, set_attention_kernel
from models.config import ZeroStackConfig
from models.pipeline import (
    TIED_KEY,
    BlockPipe,
    EmbeddingPipe,
    HeadPipe,
    NormPipe,
    pipeline_loss,
    pipeline_state_dict_to_model,
    tied_head,
)
from training.engines.base import OptimizerHparams, StepResult
from training.engines.ds import DeepSpeedEngine
from training.engines.pipeline_tensor import split_stage, stage_topology, without_tensor_parallel
from training.settings import parallel

# Without send/recv (gloo), DeepSpeed passes activations between stages by broadcasting the
# sender's own output tensor, which leaves a broadcast_ node in its graph. It does not change the
# values, so backward through it is the identity that torch warns it assumes: correct, and checked
# against the unpipelined model by tests/test_pipeline.py.
warnings.filterwarnings("ignore", message="c10d::broadcast_: an autograd kernel was not registered")

# Our names for DeepSpeed's partition methods (pipeline.partition in the config).
PARTITIONS = {
    "parameters": "parameters",  # balance parameter counts
    "blocks": f"type:{BlockPipe.__name__}",  # balance transformer blocks
    "uniform": "uniform",  # balance layer counts
}


def build_pipeline_module(
    config: ZeroStackConfig,
    *,
    num_stages: int,
    partition_method: str = "parameters",
    activation_checkpoint_interval: int = 0,
    loss_fn=None,
    tensor: int = 1,
) -> PipelineModule:
    """Our model's pipeline layers (models/pipeline.py) as a `PipelineModule` over num_stages
    stages (call deepspeed.init_distributed() first); with tensor > 1, on a pipe x model x data
    topology whose model groups split_stage (pipeline_tensor.py) splits the blocks over.

    loss_fn(logits, labels) defaults to `pipeline_loss`. With activation_checkpoint_interval > 0,
    only the blocks are recomputed: the embedding's input (token ids) carries no gradient."""
    tied = config.tie_word_embeddings
    specs = [
        TiedLayerSpec(TIED_KEY, EmbeddingPipe, config) if tied else LayerSpec(EmbeddingPipe, config)
    ]
    specs += [LayerSpec(BlockPipe, config, i) for i in range(config.num_hidden_layers)]
    specs.append(LayerSpec(NormPipe, config))
    if tied:
        specs.append(TiedLayerSpec(TIED_KEY, EmbeddingPipe, config, forward_fn=tied_head))
    else:
        specs.append(LayerSpec(HeadPipe, config))
    module = PipelineModule(
        layers=specs,
        num_stages=None if tensor > 1 else num_stages,
        topology=stage_topology(num_stages, tensor) if tensor > 1 else None,
        loss_fn=loss_fn or pipeline_loss,
        partition_method=partition_method,
        activation_checkpoint_interval=activation_checkpoint_interval,
        checkpointable_layers=[BlockPipe.__name__],
    )
    # Lets the module's own forward checkpoint outside a pipeline engine too.
    module.set_checkpoint_interval(activation_checkpoint_interval)
    return module


def stage_values(model, names) -> dict[str, torch.Tensor]:
    """The initial values of the pipeline parameters `names` (one stage's), from the model the
    pipeline layers come from. A model on the meta device gets values for the modules that own
    them alone (its `deferred_init` skips modules left on meta), so a rank never holds more
    than its stage."""
    where = model_state_dict_to_pipeline({n: n for n in model.state_dict()}, model.config)
    deferred = model.__dict__.pop("deferred_init", None)
    if deferred is not None:
        for name in {where[n] for n in names}:
            model.get_submodule(name.rpartition(".")[0]).to_empty(device="cpu", recurse=False)
        deferred(model)
    values = model.state_dict()
    return {n: values[where[n]] for n in names}


class PipelineEngine(DeepSpeedEngine):
    name = "pipeline"

    def __init__(
        self,
        *,
        model,
        ds_config: dict,
        optimizer: OptimizerHparams,
        device: torch.device,
        attention: str,
    ):
        """model: the ZeroStackForCausalLM, built on the meta device with its `deferred_init`
        (training/engines/construct.py) or whole. Each rank makes only its stage's layers, with
        exactly the whole model's initial weights (under tensor parallelism, its slices of
        them)."""
        pipe_cfg = ds_config.get("pipeline", {})
        tensor = parallel.tensor_size(ds_config)
        pipe = build_pipeline_module(
            model.config,
            num_stages=int(pipe_cfg["stages"]),
            partition_method=PARTITIONS[pipe_cfg.get("partition", "parameters")],
            activation_checkpoint_interval=int(pipe_cfg.get("activation_checkpoint_interval", 0)),
            tensor=tensor,
        )
        pipe.load_state_dict(stage_values(model, pipe.state_dict()))
        if tensor > 1:
            split_stage(pipe, pipe.mpu().get_slice_parallel_group(), model.config)
        set_attention_kernel(pipe, attention)
        self.config = model.config
        ds_config = without_tensor_parallel(ds_config)
        super().__init__(model=pipe, ds_config=ds_config, optimizer=optimizer, device=device)
        self.tensor_parallel = tensor  # for set_master_weights' slices
        grid = self.engine.grid
        self.stage = grid.get_stage_id()
        self.stages = grid.get_pipe_parallel_world_size()
        self.dp_rank = grid.get_data_parallel_rank()
        self.dp_world = grid.get_data_parallel_world_size()
        self.micro_batches = self.engine.micro_batches
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def coordinates(self) -> dict[str, int]:
        out = {"data_parallel": self.dp_rank, "pipeline_stage": self.stage}
        if self.tensor_parallel > 1:
            out["tensor_parallel"] = self.engine.grid.get_tensor_model_parallel_rank()
        return out

    def layout(self) -> list[list[str]]:
        """Layer class names per stage, e.g. [[EmbeddingPipe, BlockPipe], [BlockPipe, ...]]."""
        specs, parts = self.engine.module._layer_specs, self.engine.module.parts
        return [
            [spec.typename.__name__ for spec in specs[parts[s] : parts[s + 1]]]
            for s in range(self.stages)
        ]

    def forward_backward(self, x, y, boundary: bool, num_items=None, reference=None):
        """Buffers (x, y); on the boundary runs the whole step (every micro-batch, the reduction
        and the optimizer step) and returns the sum of the step's micro-batch losses, averaged
        over the data-parallel replicas; before the boundary it returns 0. So the loop's running
        sum and count still give the mean over micro-batches, as for the other engines."""
        if num_items is not None or reference is not None:  # preflight refuses chat data here
            raise ValueError("the pipeline engine trains next-token loss on unmasked data only")
        self._pending.append((x, y))
        if not boundary:
            return torch.zeros((), device=self.device)
        batches, self._pending = self._pending, []
        if len(batches) != self.micro_batches:
            raise RuntimeError(
                f"the pipeline step needs {self.micro_batches} micro-batches, got {len(batches)}"
            )
        # The first stage reads x, the last reads y; the middle stages read neither.
        mean = self.engine.train_batch(iter(batches))
        return mean.detach().float().reshape(()) * len(batches)

    def step(self) -> StepResult:
        # train_batch has already stepped; report what it did.
        norm = self.engine.get_global_grad_norm()
        if isinstance(norm, torch.Tensor):
            norm = norm.item()
        scale = getattr(self.engine.optimizer, "cur_scale", None)
        return StepResult(
            None if norm is None or not math.isfinite(norm) else float(norm),
            not self.engine.was_step_applied(),
            float(scale) if self.engine.fp16_enabled() and scale is not None else None,
        )

    def set_master_weights(self, weights) -> int:
        """The DeepSpeed engine's, for (name, tensor) under the model's names: each stage sets
        the fp32 masters of its own layers."""

        def renamed():
            for name, value in weights:
                yield from model_state_dict_to_pipeline({name: value}, self.config).items()

        return super().set_master_weights(renamed())

    def load(self, root, tag: str) -> None:
        """The DeepSpeed engine's. A universal copy (from a pipeline run with another layout, or
        from an unpipelined one) holds zero/<name>/ under the model's names: DeepSpeed's loader
        finds each parameter's folder through the optimizer's `param_names`, so those read the
        model's names (`layers.0.attention.wq.weight` for `1.attention.wq.weight`) meanwhile."""
        if not self.engine.load_universal_checkpoint():
            return super().load(root, tag)
        opt = self.engine.optimizer
        own = opt.param_names
        opt.param_names = {
            p: next(iter(pipeline_state_dict_to_model({name: p}, self.config)))
            for p, name in own.items()
        }
        try:
            super().load(root, tag)
        finally:
            opt.param_names = own

    @torch.no_grad()
    def eval_loss(self, x, y, num_items=None, reference=None) -> torch.Tensor:
        """Every rank calls with its replica's batch; returns that batch's loss averaged over the
        data-parallel replicas, on every stage."""
        if num_items is not None or reference is not None:
            raise ValueError("the pipeline engine does not weigh the loss by trained tokens")
        loss = self.engine.eval_batch(iter([(x, y)]), num_micro_batches=1)
        return loss.detach().float().reshape(())
