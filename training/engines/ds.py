"""DeepSpeed: `deepspeed.initialize` at the centre; ZeRO stage, offload, precision, tensor
parallelism (AutoTP) and sequence parallelism (Ulysses, sequence.py) all come from the JSON
config."""

from __future__ import annotations

import inspect
import math
import sys
import types
from pathlib import Path

import deepspeed
import deepspeed.runtime.engine
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
from deepspeed.utils import safe_set_full_fp32_param, set_z3_leaf_modules

from models import transformer_blocks
from training.engines.base import Engine, OptimizerHparams, StepResult
from training.engines.expert_parallel import adopt_layers
from training.engines.muon import newton_schulz_in_fp32
from training.engines.nonfinite import poison
from training.engines.optim import adamw, group_lr, param_groups, tag_muon
from training.engines.overflow import fuse_overflow_test
from training.engines.sequence import SequenceParallel
from training.engines.spike_guard import deepspeed_norm_checks
from training.memory.state_bytes import state_bytes
from training.runtime import patches, safe_load
from training.settings import parallel
from training.settings.ds_config import precision, zero_stage


def gather_blocks_whole(model) -> bool:
    """Make each transformer block (the classes the model lists in `_no_split_modules`) one unit
    for ZeRO-3: gathered and released whole, with one pair of hooks instead of one per linear
    layer and norm (`deepspeed.utils.set_z3_leaf_modules`). In bf16 the losses are bit for bit
    the same; in fp32 they differ in the last bits: DeepSpeed's per-module hooks pass a
    norm's input through an autograd function of their own, so without them autograd adds the
    gradients of a block's residual stream in another grouping (tests/test_train.py). Where it
    is on is --zero3-whole-blocks (training/preflight/switches.py). Returns whether the model
    has such blocks."""
    classes = list({type(m) for m in transformer_blocks(model)})
    if classes:
        set_z3_leaf_modules(model, classes)
    return bool(classes)


MUON = "deepspeed.runtime.zero.muon"


def asks_for_muon(ds_config: dict) -> bool:
    """Whether the resolved config's optimizer is DeepSpeed's Muon (--optimizer muon)."""
    return str(ds_config.get("optimizer", {}).get("type", "")).lower() == "muon"


def stand_in_for_muon(ds_config: dict) -> bool:
    """In a run whose optimizer is not DeepSpeed's Muon: put stand-ins where DeepSpeed's Muon
    modules go. DeepSpeed asks "is the optimizer Muon?" in deepspeed.initialize, in its bf16
    optimizer, in ZeRO-3's set-up and in each ZeRO-1/2 gradient reduction, importing those
    modules on the way, whose torch.compile decorators load inductor: 1-2 s of every start and
    first step, under --no-compile too. The stand-in's MuonWithAuxAdam has no instances, so each
    question gets stock's answer for every other optimizer, and its Muon update is never
    reached. Returns whether it stands in (not where Muon is the optimizer, already imported,
    or the patch is off)."""
    wanted = asks_for_muon(ds_config)
    names = (f"{MUON}.muon_optimizer", f"{MUON}.original_muon")
    if wanted or any(n in sys.modules for n in names) or not patches.verified("muon_stand_in"):
        return False
    optimizer, update = (types.ModuleType(n, "zerostack's stand-in: no Muon here") for n in names)
    optimizer.MuonWithAuxAdam = type("MuonWithAuxAdam", (), {"__module__": names[0]})

    def muon_update(*args, **kwargs):
        raise RuntimeError("DeepSpeed's Muon was not loaded: this run's optimizer is not Muon")

    update.muon_update = muon_update
    sys.modules.update(zip(names, (optimizer, update)))
    return True


# DeepSpeed's Muon functions under torch.compile (its callers import them at call time)
NEWTON_SCHULZ = ("zeropower_via_newtonschulz5", "zeropower_via_gram_newtonschulz", "muon_update")


def muon_modules(ds_config: dict, device_type: str) -> None:
    """DeepSpeed's Muon modules as the run needs them: stand-ins where its optimizer is not
    Muon; where it is, zerostack's split kept, and on a CPU the eager update and, in an fp32
    run, Newton-Schulz in fp32."""
    stand_in_for_muon(ds_config)
    keep_muon_split(ds_config)
    eager_muon_on_cpu(ds_config, device_type)
    if asks_for_muon(ds_config):
        newton_schulz_in_fp32(device_type, precision(ds_config))


def keep_muon_split(ds_config: dict) -> bool:
    """In a Muon run: deepspeed.initialize tags the parameters by zerostack's split
    (engines/optim.py: muon_split) right after its own rule (2-D or more, not named embed or
    lm_head), which gives an untied output head (`output.weight`, a Llama folder's) to Muon
    where torch.optim.Muon's split under DDP and FSDP2 leaves it to AdamW. Returns whether it
    applied."""
    wanted = asks_for_muon(ds_config)
    own = deepspeed.set_optimizer_flags
    if not wanted or getattr(own, "keeps_muon_split", False):
        return False
    if not patches.verified("muon_split_tags"):
        return False

    def set_optimizer_flags(config_class, model) -> None:
        own(config_class, model)
        if str(config_class.optimizer_name).lower() == "muon":
            tag_muon(model)

    set_optimizer_flags.keeps_muon_split = True
    deepspeed.set_optimizer_flags = set_optimizer_flags
    return True


def eager_muon_on_cpu(ds_config: dict, device_type: str) -> bool:
    """In a Muon run on a CPU: DeepSpeed's Muon update and Newton-Schulz run eagerly, as
    torch.optim.Muon runs under DDP and FSDP2. Compiled, inductor builds them once per matrix
    shape in the first steps: about 3 minutes of an 8-step tiny run on 2 cores, against 28 s
    eagerly. On an accelerator they stay compiled. Returns whether it applied."""
    wanted = asks_for_muon(ds_config)
    if not wanted or device_type != "cpu" or not patches.verified("muon_eager_on_cpu"):
        return False
    import importlib

    module = importlib.import_module(f"{MUON}.original_muon")
    for name in NEWTON_SCHULZ:
        fn = getattr(module, name)
        setattr(module, name, getattr(fn, "_torchdynamo_orig_callable", fn))
    return True


def check_muon_tags(module, ours: set[str]) -> None:
    """deepspeed.initialize tags parameters for Muon by its own rule (2-D+, not named embed or
    lm_head); stop where that differs from ours (engines/optim.py: muon_split)."""
    params = module.named_parameters()
    theirs = {n for n, p in params if p.requires_grad and getattr(p, "use_muon", False)}
    if theirs != ours:
        differ = sorted(theirs ^ ours)
        raise RuntimeError(
            f"DeepSpeed's Muon split differs from zerostack's on {len(differ)} parameters "
            f"(first: {differ[0]}): this model's layout does not fit --optimizer muon"
        )


class DeepSpeedEngine(Engine):
    name = "deepspeed"

    def __init__(
        self,
        *,
        model,
        ds_config: dict,
        optimizer: OptimizerHparams,
        device: torch.device,
        whole_blocks: bool = False,
        grad_sum: bool = False,
    ):
        """`whole_blocks`: ZeRO-3 gathers each transformer block as one unit; `grad_sum`: ZeRO-1/2
        sum gradients ("gradient_allreduce_op": "sum") over a loss the trainer divides by the
        data-parallel world, rather than DeepSpeed dividing every reduce bucket (the same
        gradients, checked to the bit on 2 ranks). Both resolved by the
        trainer's switches (training/preflight/switches.py)."""
        super().__init__()
        tp, sp = parallel.tensor_size(ds_config), parallel.sequence_size(ds_config)
        micro = int(ds_config["train_micro_batch_size_per_gpu"])
        self.sequence = (
            SequenceParallel(model, sp, micro, int(ds_config["zero_optimization"].get("stage", 0)))
            if sp > 1
            else None
        )
        if tp > 1:
            # DeepSpeed's batch check counts every rank of a tensor-parallel group as a replica;
            # the samples per step are still train_batch_size (micro x accumulation x replicas).
            ds_config = {**ds_config, "train_batch_size": ds_config["train_batch_size"] * tp}
        groups = param_groups(model, optimizer.weight_decay)
        if parallel.expert_size(ds_config) > 1:  # DeepSpeed splits named groups into expert ones
            groups = [{**g, "name": f"group{i}"} for i, g in enumerate(groups)]
        torch_optimizer = None
        if "optimizer" not in ds_config:
            # Our own AdamW (fused on this device); DeepSpeed wraps it for ZeRO.
            torch_optimizer = adamw(groups, optimizer, device_type=device.type)
        self.blocks_whole = whole_blocks and gather_blocks_whole(model)
        self.sums_gradients = grad_sum
        if self.sums_gradients:
            ds_config = {**ds_config, "gradient_allreduce_op": "sum"}
        # With an "optimizer" section DeepSpeed builds its own (e.g. CPU Adam for offload)
        # from the same parameter groups.
        muon = tag_muon(model) if optimizer.muon_lr is not None else None
        muon_modules(ds_config, device.type)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model,
            optimizer=torch_optimizer,
            model_parameters=groups if torch_optimizer is None else None,
            config=ds_config,
            mpu=self.sequence.mpu if self.sequence else None,
        )
        fuse_overflow_test(self.engine.optimizer)  # ZeRO-1/2: one reduction per gradient
        if muon is not None:
            check_muon_tags(self.engine.module, muon)
        self.optimizer_config = optimizer
        self.tensor_parallel = tp
        self.expert_parallel = parallel.expert_size(ds_config)
        if self.expert_parallel > 1:  # AutoEP replaced the routed MLPs
            adopt_layers(self.engine.module)
        # ZeRO-3 marks the weights its persistence threshold covers (settings/ds_config.py:
        # persistence_threshold); all of them: held gathered across micro-steps
        params = list(self.engine.module.parameters())
        self.hold = zero_stage(ds_config) == 3 and all(
            getattr(p, "ds_persist", False) for p in params
        )
        if tp > 1:  # AutoTP's groups: the ranks of one tensor-parallel group read the same data
            self.dp_rank = self.engine.mpu.get_data_parallel_rank()
            self.dp_world = self.engine.mpu.get_data_parallel_world_size()
        elif sp > 1:  # Ulysses groups are consecutive ranks
            self.dp_rank, self.dp_world = dist.get_rank() // sp, dist.get_world_size() // sp
        self.device = device
        # What each group was built with: a universal load copies group 0's values onto every
        # group under ZeRO-3 (so norms would be decayed), so load() puts these back.
        self._group_hparams = [
            {k: g[k] for k in ("weight_decay", "betas", "eps") if k in g}
            for g in self.engine.optimizer.param_groups
        ]
        # DeepSpeed's own optimizer wrappers (ZeRO 1-3, bf16, fp16) skip an update whose global
        # gradient norm is not finite; a plain torch optimizer (fp32, ZeRO-0) needs us to.
        self._plain_optimizer = not hasattr(self.engine.optimizer, "overflow")
        self._stand_down_verified = patches.verified("optimizer_step_stand_down")
        self._plain_norm = None

    def coordinates(self) -> dict[str, int]:
        out = {"data_parallel": self.dp_rank}
        if self.sequence:
            out["sequence_parallel"] = self.sequence.rank
        if self.tensor_parallel > 1:
            out["tensor_parallel"] = self.engine.mpu.get_tensor_model_parallel_rank()
        return out

    @property
    def module(self):
        return self.engine.module

    def _loss(self, x, y, num_items=None, reference=None) -> torch.Tensor:
        if self.sequence:
            return self.engine(**self.sequence.inputs(x, y)).loss
        return self.objective(self.engine, x, y, num_items, reference)

    def forward_backward(self, x, y, boundary: bool, num_items=None, reference=None):
        loss = self._loss(x, y, num_items, reference)
        scale = self.sequence.backward_scale if self.sequence else 1.0
        if self.sums_gradients:  # the ranks' gradients are summed: their mean, as DeepSpeed's
            scale /= self.dp_world
        self.engine.backward(poison(loss * scale))  # a non-finite loss: non-finite gradients
        if not boundary:
            self.engine.step()  # DeepSpeed counts micro-steps; no reduction, no update here
        return self.sequence.whole_loss(loss) if self.sequence else loss.detach()

    def step(self) -> StepResult:
        finite = self._grads_finite() if self._plain_optimizer else True
        forced = self._plain_optimizer and self._stand_down_verified and not finite
        stood_down = []
        if forced:  # a torch optimizer has no skip path: stand its step down for this call
            self.engine.optimizer.step = lambda *args, **kwargs: stood_down.append(1)
        try:
            with deepspeed_norm_checks(self._gate()):
                self.engine.step()  # DeepSpeed's bookkeeping (counters, zeroing grads) still runs
        finally:
            if forced:
                del self.engine.optimizer.step
        if forced and not stood_down:  # DeepSpeed stepped some other way: the update went in
            raise RuntimeError(
                "DeepSpeed did not call the optimizer's step: the stand-down of a non-finite "
                "step (engines/ds.py) does not fit this DeepSpeed"
            )
        norm = self.engine.get_global_grad_norm()
        if norm is None and self._plain_optimizer:  # a torch optimizer: DeepSpeed keeps none
            norm = self._plain_norm
        if isinstance(norm, torch.Tensor):
            norm = norm.item()
        skipped = forced or not self.engine.was_step_applied()
        scale = getattr(self.engine.optimizer, "cur_scale", None)
        return StepResult(
            None if norm is None or not math.isfinite(norm) else float(norm),
            skipped,
            float(scale) if self.engine.fp16_enabled() and scale is not None else None,
        )

    def _grads_finite(self) -> bool:
        # ZeRO-0 has all-reduced the gradients by now, so every rank decides alike.
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        if not grads:
            return True
        norm = torch.nn.utils.get_total_norm(grads)
        self._plain_norm = norm  # the step's gradient norm, which DeepSpeed keeps none of here
        return bool(torch.isfinite(self.spike_gate(norm) if self.spike_gate else norm))

    def _gate(self):
        """The spike gate as DeepSpeed's norm check needs it: the norm it checks is scaled by
        the fp16 loss scale (bf16, fp32: 1)."""
        if self.spike_gate is None or self._plain_optimizer:  # the plain path gated above
            return None
        if not patches.verified("spike_norm_check"):  # said once at start (preflight)
            return None
        if not self.engine.fp16_enabled():
            return self.spike_gate
        scale = float(getattr(self.engine.optimizer, "loss_scale", 1.0) or 1.0)
        return lambda norm: self.spike_gate(torch.as_tensor(norm) / scale)

    def set_lr(self, lr: float) -> None:
        for group in self.engine.optimizer.param_groups:
            group["lr"] = group_lr(group, lr, self.optimizer_config)

    @torch.no_grad()
    def eval_loss(self, x, y, num_items=None, reference=None) -> torch.Tensor:
        loss = self._loss(x, y, num_items, reference)
        return self.sequence.whole_loss(loss) if self.sequence else loss.detach()

    def train(self) -> None:
        self.engine.train()

    def eval(self) -> None:
        self.engine.eval()

    def state_bytes(self) -> dict[str, int]:
        # engine.optimizer is DeepSpeed's wrapper: its flat partitions, buckets and the inner
        # optimizer's states are all reachable from it.
        return state_bytes(self.engine.module, self.engine.optimizer)

    def save(self, root, tag: str, client_state: dict, writer=None) -> None:
        # universal_checkpoint_info is what ds_to_universal needs to convert ZeRO-1/2 files.
        # AutoTP attaches its own (which parameters are row-split, which replicated) and
        # DeepSpeed writes it; client state is applied last, so an empty one would erase it.
        from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

        state = dict(client_state)
        # AutoEP writes its own (which ranks hold which experts) and refuses ours
        own = self.expert_parallel > 1
        if not own and getattr(self.engine.module, UNIVERSAL_CHECKPOINT_INFO, None) is None:
            state[UNIVERSAL_CHECKPOINT_INFO] = {}
        # Outside the verified versions DeepSpeed writes its files itself: a synchronous save,
        # which the seal hashes and fsyncs as it does any file the writer did not stage.
        if writer is None or not patches.verified("staged_checkpoint_engine"):
            self.engine.save_checkpoint(str(root), tag=tag, client_state=state, save_latest=False)
            return
        # --async-save: DeepSpeed's own save, each file it writes through its checkpoint engine
        # (model states, every rank's ZeRO partition, pipeline layers) staged into the writer.
        own = self.engine.checkpoint_engine
        self.engine.checkpoint_engine = StagedCheckpointEngine(own, writer)
        try:
            self.engine.save_checkpoint(str(root), tag=tag, client_state=state, save_latest=False)
        finally:
            self.engine.checkpoint_engine = own

    def set_master_weights(self, weights) -> int:
        """Overwrite the fp32 master copy of each (name, tensor) in `weights` (all ranks, same
        order); returns how many parameters were set. Under bf16 DeepSpeed builds the masters
        from the 16-bit weights, which would round a model imported from an fp32 folder."""
        params = dict(self.engine.module.named_parameters())
        n = 0
        for name, value in weights:
            p = params.get(name)
            if p is None:
                continue
            value = value.float()
            if value.shape != p.shape and not hasattr(p, "ds_id"):
                value = self._tensor_parallel_slice(value, p.shape, name)
            if hasattr(p, "ds_id"):  # ZeRO-3 cuts rank slices out of the padded flat value
                world = dist.get_world_size(group=p.ds_process_group)
                value = F.pad(value.flatten(), (0, p.partition_numel() * world - value.numel()))
            if hasattr(p, "ds_id") or getattr(p, "_hp_mapping", None) is not None:
                safe_set_full_fp32_param(p, value)
                n += 1
        return n

    def _tensor_parallel_slice(self, value, shape, name: str):
        """This rank's part of a whole weight that AutoTP split: equal contiguous slices along
        the one dimension that differs (output features for column splits, input features for
        row splits), in tensor-parallel rank order, as AutoTP cuts whole heads and columns."""
        dims = [d for d, (a, b) in enumerate(zip(value.shape, shape)) if a != b]
        if self.tensor_parallel == 1 or len(dims) != 1 or len(value.shape) != len(shape):
            raise ValueError(f"{name}: shape {tuple(value.shape)} does not fit {tuple(shape)}")
        rank = self.engine.mpu.get_tensor_model_parallel_rank()
        return value.chunk(self.tensor_parallel, dims[0])[rank]

    def load(self, root, tag: str) -> None:
        """Load root/tag: a native checkpoint, or a universal copy when the config says
        checkpoint.load_universal (the resume plan sets it before initialize)."""
        restore_swapped_optimizer(self.engine.optimizer, Path(root) / tag)
        mpu = self.sequence.mpu if self.sequence else None
        shim = mpu is not None and not hasattr(mpu, "get_tensor_model_parallel_world_size")
        shim = shim and patches.verified("ulysses_mpu_shim")
        if shim:
            # DeepSpeed's universal loader asks the engine's mpu for the tensor-parallel size
            # and stops on Ulysses's groups, which have none (their "model parallel" size is
            # the sequence-parallel one, which would cut whole weights): here it is 1.
            mpu.get_tensor_model_parallel_world_size = lambda: 1
            mpu.get_tensor_model_parallel_rank = lambda: 0
        try:
            path, _ = self.engine.load_checkpoint(
                str(root), tag=tag, load_lr_scheduler_states=False
            )
        finally:
            if shim:
                del mpu.get_tensor_model_parallel_world_size, mpu.get_tensor_model_parallel_rank
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {root}/{tag}")
        for group, hp in zip(self.engine.optimizer.param_groups, self._group_hparams):
            group.update(hp)
        base = getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)
        for st in getattr(base, "state", {}).values():
            # The ZeRO-3 universal loader gives every sub-group the same step tensor, which
            # torch's AdamW then advances once per sub-group: give each its own.
            if isinstance(st.get("step"), torch.Tensor):
                st["step"] = st["step"].clone()
            elif isinstance(st.get("step"), int | float) and not _counts_in_python(base):
                # A checkpoint of DeepSpeed's CPU Adam (offload, NVMe) counts in a plain number;
                # torch's AdamW stops on one ("state_steps ... singleton tensors").
                st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32)


class StagedCheckpointEngine(CheckpointEngine):
    """DeepSpeed's checkpoint engine for one --async-save: `save` stages the state dict into a
    background writer (checkpoints/background.py) instead of writing it, everything else is
    the engine's own. save_checkpoint returns once every file is staged, and zerostack seals
    the folder when the writers are done. (DeepSpeed's decoupled writer commits at a later step
    on its own terms, not telling zerostack when the files are durable: settings/ds_sections.py
    refuses it.)"""

    def __init__(self, own, writer):
        super().__init__()
        self.own, self.writer = own, writer

    def create(self, info):
        return self.own.create(info)

    def save(self, state_dict, path: str):
        self.writer.save(state_dict, path)

    def load(self, path: str, map_location=None):
        return self.own.load(path, map_location)

    def commit(self, info):
        return True  # zerostack's seal commits, once the files are durable

    def is_data_parallel_writer(self, dp_rank):
        return self.own.is_data_parallel_writer(dp_rank)


def restore_swapped_optimizer(optimizer, folder: Path) -> None:
    """Before DeepSpeed's load_checkpoint, when ZeRO-3 swaps the optimizer to NVMe and the
    checkpoint is native (not a universal copy). DeepSpeed 0.19.8 then skips the ZeRO optimizer
    file: it copies offloaded_tensors/ (the swapped sub-groups' fp32 weights and moments) back
    and rebuilds every 16-bit weight from the fp32 weights it then has, so the Adam step count
    and the sub-groups too small to swap (kept in memory: norms, small matrices) would start
    over, and the swapped sub-groups' moments would not be read back (the swapper reads the
    state tensors the optimizer holds, and a fresh one holds none). From this rank's file:
    every sub-group's step, the kept ones' fp32 weights and moments, and placeholders for the
    swapped ones' moments, before DeepSpeed rebuilds the 16-bit weights."""
    if not getattr(optimizer, "swap_optimizer", False) or (folder / "zero").is_dir():
        return  # not swapping, or a universal copy (DeepSpeed loads that one whole)
    if not (skips_swapped_optimizer_file() and patches.verified("swapped_optimizer_restore")):
        return  # DeepSpeed reads the file itself, or an unverified DeepSpeed: its own load
    dp = dist.get_rank(group=optimizer.dp_process_group)
    found = sorted(folder.glob(f"*zero_pp_rank_{dp}_mp_rank_00_optim_states.pt"))
    if not found:
        raise RuntimeError(f"{folder}: no ZeRO optimizer file for data-parallel rank {dp}")
    saved = safe_load.load(found[0])["optimizer_state_dict"]
    states, flats = saved["optimizer_state_dict"]["state"], saved["fp32_flat_groups"]
    live = optimizer.optimizer.state  # empty until a first step: CPU Adam makes it then
    # the saved states are numbered in the order of the fp32 sub-group flats
    for i, flat in enumerate(optimizer.fp32_partitioned_groups_flat):
        st = states[i]
        if optimizer._swappable_optimizer_subgroup(i):
            # Placeholders the swapper registers and fills from the swap files DeepSpeed copies
            # back (unwritten memory: nothing is resident until a sub-group is swapped in).
            n = optimizer.fp16_partitioned_groups_flat_numel[i]
            moments = {k: torch.empty(n, dtype=flat.dtype) for k in ("exp_avg", "exp_avg_sq")}
        else:
            flat.data.copy_(flats[i])
            moments = {k: st[k].clone() for k in ("exp_avg", "exp_avg_sq")}
        live[flat] = {"step": st["step"], **moments}


def skips_swapped_optimizer_file() -> bool:
    """Whether this DeepSpeed's load_checkpoint has the 0.19.8 bug restore_swapped_optimizer
    works around: it skips the ZeRO optimizer file when the optimizer is swapped to NVMe (read
    off its source, the condition that does it)."""
    source = inspect.getsource(deepspeed.runtime.engine.DeepSpeedEngine.load_checkpoint)
    return "not self.zero_nvme_offload_optimizer()" in source


def _counts_in_python(optimizer) -> bool:
    """Whether the optimizer keeps its step count as a Python number (DeepSpeed's CPU Adam)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return isinstance(optimizer, DeepSpeedCPUAdam)
