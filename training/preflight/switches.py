"""The trainer's behaviour switches, resolved once before any rank starts: each is a setting
(settings/run_config.py) whose "auto" is made concrete here, from the config, the device and the
host, and handed down as a plain bool. `Switches.as_record()` is what resolved_config.json keeps
of them: the value and why (docs/settings.md lists every one, its default and who reads it).

"One host" is every rank of the world on this machine, as whichever launcher started the run says
(runtime/launcher.py); "fits" is against a quarter of the host's total memory (or
--host-mem-gib), never its free memory at launch, so the same command takes the same path on
the same machine."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field, fields

import psutil

from models.compile import cxx_compiler
from training.errors import ConfigError
from training.memory.fit import one_cpu_host_holds, zero3_holds_whole
from training.runtime import patches
from training.runtime.launcher import host_layout
from training.settings import ds_config, parallel
from training.settings.flags import auto_unless
from training.settings.run_config import RunConfig

GiB = 2**30
# Compiling the blocks costs its first step 17-25 s on a 2-core CPU (small preset; 18.6 s in
# bf16 on AVX512-BF16, 24.6 s in fp32 on AVX2; 118 s in bf16 on AVX2, which auto no longer
# picks) and saves 12-16% of every later step (0.2 s a step of the quickstart): it pays back
# after about 80-100 steps (docs/benchmarks.md, "What compiling costs"). A shorter run stays eager.
COMPILE_PAYS_AFTER = 100  # steps


def switch(setting: str):
    """A switch, off until resolved; `setting` is the run's setting it makes concrete. Its
    resolver is this module's function `_NAME`."""
    return field(default=False, metadata={"setting": setting})


@dataclass(frozen=True)
class Switches:
    """Every switch's value, and why it has it."""

    compile: bool = switch("model.compile")  # torch.compile each block (models/compile.py)
    # ZeRO-3 / FSDP2 keep weights gathered across micro-steps
    hold_weights: bool = switch("host.hold_weights")
    # ZeRO-3 gathers each transformer block as one unit
    zero3_whole_blocks: bool = switch("host.zero3_whole_blocks")
    grad_sum: bool = switch("host.grad_sum")  # ZeRO-1/2 sum over a loss divided by the world
    # collectives through DeepSpeed's shared-memory kernel
    shm_collectives: bool = switch("host.shm_collectives")
    # glibc keeps freed blocks on the heap between steps
    keep_freed_memory: bool = switch("host.keep_freed_memory")
    why: dict = field(default_factory=dict)  # {switch: one line}

    @staticmethod
    def settings() -> dict[str, str]:
        """{switch: the setting it makes concrete}, in declaration order."""
        return {f.name: f.metadata["setting"] for f in fields(Switches) if f.name != "why"}

    def as_record(self) -> dict:
        return {n: {"on": getattr(self, n), "why": self.why.get(n, "")} for n in self.settings()}


@dataclass(frozen=True)
class Host:
    """What the host-dependent switches look at."""

    device_type: str  # "cpu", "cuda", ...
    world: int
    ranks_here: int  # ranks of this world on this machine
    memory_bytes: int  # the host's total memory, or --host-mem-gib
    launcher: str = "none"  # who said how many ranks run here (runtime/launcher.py)


def ranks_on_this_host(world: int) -> int:
    """How many ranks of the world run on this machine, as the launcher says
    (runtime/launcher.py: torchrun, DeepSpeed, SLURM, Open MPI, MPICH); a single-host launch
    without any."""
    return host_layout(world).ranks_here


def this_host(config: RunConfig, device_type: str, world: int) -> Host:
    gib = config.host.host_mem_gib
    memory = int(gib * GiB) if gib else psutil.virtual_memory().total
    layout = host_layout(world)
    return Host(device_type, world, layout.ranks_here, memory, layout.launcher)


def resolve_switches(
    config: RunConfig, cfg: dict, host: Host, params: int, *, ours: bool, precision: str
) -> Switches:
    """Each switch's flag, with "auto" decided where it was measured to win (docs/benchmarks.md
    has each measurement): `cfg` is the resolved DeepSpeed config, `params` the model's count."""
    why: dict[str, str] = {}
    values = {}
    for name in Switches.settings():
        resolve = globals()[f"_{name}"]
        values[name], why[name] = resolve(config, cfg, host, params, ours, precision)
    return Switches(**values, why=why)


def _compile(config, cfg, host, params, ours, precision) -> tuple[bool, str]:
    if config.model.compile is not None:
        return config.model.compile, "--compile" if config.model.compile else "--no-compile"
    if config.model.lora is not None:
        return False, "--lora (unmeasured)"
    checkpointing = ds_config.activation_checkpointing(cfg, config.model.activation_checkpointing)
    steps = min(config.optim.steps, config.checkpoint.stop_at or config.optim.steps)
    return compile_by_default(cfg, host.device_type, checkpointing, ours=ours, steps=steps)


def compile_by_default(
    cfg: dict,
    device_type: str,
    activation_checkpointing: bool,
    ours: bool = True,
    steps: int = COMPILE_PAYS_AFTER,
) -> tuple[bool, str]:
    """Whether a run that says neither --compile nor --no-compile compiles its blocks, and why:
    where it was measured to win (docs/benchmarks.md): our model (a preset, our folder or a
    Llama folder) on a CPU with a C++ compiler for Inductor, a run of `steps` long enough to pay
    the compile back, and none of what it was not measured with (pipeline stages, which it does
    not reach; tensor or sequence parallelism; activation checkpointing; parameter offload).
    Other models and GPUs keep it opt-in."""
    zero = cfg.get("zero_optimization", {})
    offload = str(zero.get("offload_param", {}).get("device", "none")).lower() != "none"
    return auto_unless(
        [
            (not ours, "not our model (unmeasured)"),
            (device_type != "cpu", f"{device_type}, not a CPU (unmeasured)"),
            (shutil.which(cxx_compiler()) is None, "no C++ compiler for Inductor"),
            (ds_config.pipeline_stages(cfg) > 1, "pipeline stages (not reached)"),
            (parallel.tensor_size(cfg) * parallel.sequence_size(cfg) > 1, "TP/SP (unmeasured)"),
            (activation_checkpointing, "activation checkpointing (unmeasured)"),
            (offload, "parameter offload (unmeasured)"),
            (
                steps < COMPILE_PAYS_AFTER,
                f"{steps} steps: compiling pays back after about {COMPILE_PAYS_AFTER}",
            ),
        ],
        f"our model on a CPU with a C++ compiler, {steps} steps",
    )


def _hold_weights(config, cfg, host, params, ours, precision) -> tuple[bool, str]:
    """ZeRO-3: the whole model under the persistence threshold, so every weight stays gathered
    across the micro-steps of a step and is gathered once after the optimizer step
    (memory/fit.py: zero3_holds_whole). FSDP2: the last micro-step's gathered weights and whole
    gradients kept through its backward (engines/fsdp.py). On a CPU with every rank on this
    host, and only when what is held fits (both are also how a model too big for ZeRO-2/DDP
    fits)."""
    stage = ds_config.zero_stage(cfg)
    zero3 = config.engine.backend == "deepspeed" and stage == 3
    fsdp = config.engine.backend == "fsdp"
    if not (zero3 or fsdp):
        if config.host.hold_weights == "on":
            raise ConfigError(
                f"--hold-weights on: only ZeRO-3 and FSDP2 hold weights (this is --backend "
                f"{config.engine.backend}, ZeRO-{stage}); drop the flag"
            )
        return False, "not ZeRO-3 or FSDP2"
    if fsdp:  # what no flag can change: nothing to hold across, or shards live in host memory
        if int(cfg.get("gradient_accumulation_steps", 1)) == 1:
            return False, "FSDP2 without accumulation: nothing to hold across"
        if config.engine.fsdp_cpu_offload:
            return False, "--fsdp-cpu-offload: the shards live in host memory"
    if config.host.hold_weights != "auto":
        return config.host.hold_weights == "on", f"--hold-weights {config.host.hold_weights}"
    where = (host.world, host.ranks_here, host.memory_bytes, host.device_type)
    if zero3:
        return zero3_holds_whole(cfg, params, *where)
    return one_cpu_host_holds(6 * params, *where)  # bf16 weights and fp32 gradients


def _zero3_whole_blocks(config, cfg, host, params, ours, precision) -> tuple[bool, str]:
    """ZeRO-3 gathers and releases each transformer block as one unit (one pair of hooks, not
    one per linear layer); not with parameters on NVMe (a block at once needs more swap buffers
    than the config gives), not on GPUs (unmeasured)."""
    zero = cfg.get("zero_optimization", {})
    if config.engine.backend != "deepspeed" or ds_config.zero_stage(cfg) != 3:
        if config.host.zero3_whole_blocks == "on":
            raise ConfigError("--zero3-whole-blocks on: the run is not ZeRO-3; drop the flag")
        return False, "not ZeRO-3"
    if config.model.lora is not None:  # peft's adapter layers inside a leaf block: their
        # partitioned weights are not gathered again for the backward (DeepSpeed 0.19)
        if config.host.zero3_whole_blocks == "on":
            raise ConfigError("--zero3-whole-blocks on with --lora is not supported; drop it")
        return False, "--lora: adapters inside a block are gathered per layer"
    if config.host.zero3_whole_blocks != "auto":
        on = config.host.zero3_whole_blocks == "on"
        return on, f"--zero3-whole-blocks {config.host.zero3_whole_blocks}"
    nvme = zero.get("offload_param", {}).get("device") == "nvme"
    return auto_unless(
        [
            (nvme, "parameters on NVMe"),
            (host.device_type != "cpu", f"{host.device_type}, not a CPU (unmeasured)"),
        ],
        "ZeRO-3 on a CPU",
    )


def _grad_sum(config, cfg, host, params, ours, precision) -> tuple[bool, str]:
    """ZeRO-1/2 sum gradients across ranks (DeepSpeed's "gradient_allreduce_op": "sum") over a
    loss divided by the data-parallel world, rather than DeepSpeed dividing each reduce bucket:
    the same gradients, checked to the bit on 2 ranks (tests/test_train.py). On a CPU
    (measured), on at most 2 ranks (where that check holds), without tensor or sequence
    parallelism, not fp16 (its loss scale), and not when the config names its own
    gradient_allreduce_op."""
    if config.host.grad_sum == "off":
        return False, "--grad-sum off"
    return auto_unless(
        [
            (config.engine.backend != "deepspeed", "not DeepSpeed"),
            (ds_config.zero_stage(cfg) not in (1, 2), "not ZeRO-1/2"),
            (ds_config.pipeline_stages(cfg) > 1, "pipeline"),
            (host.device_type != "cpu", f"{host.device_type}, not a CPU (unmeasured)"),
            (parallel.tensor_size(cfg) * parallel.sequence_size(cfg) > 1, "TP/SP"),
            (precision == "fp16", "fp16 (its loss scale)"),
            ("gradient_allreduce_op" in cfg, "the config names gradient_allreduce_op"),
            # only 2 ranks are checked to the bit; dividing by 3 already differs in the last bit
            (host.world > 2, f"a world of {host.world} (checked to the bit on 2 ranks only)"),
        ],
        "ZeRO-1/2 on a CPU",
    )


def _shm_collectives(config, cfg, host, params, ours, precision) -> tuple[bool, str]:
    """DeepSpeed's and FSDP2's collectives through DeepSpeed's shared-memory kernel: every rank
    on one CPU host. Whether the kernel and its segments are there is known only once the
    process group is up (runtime/shm.py; the record's `shm_collectives` says what happened)."""
    if config.host.shm_collectives == "off":
        return False, "--shm-collectives off"
    return auto_unless(
        [
            (config.engine.backend == "ddp", "DDP (its own reducer)"),
            (host.world == 1, "one rank"),
            (host.device_type != "cpu", f"{host.device_type}, not a CPU"),
            (
                host.ranks_here != host.world,
                f"{host.ranks_here} of {host.world} ranks on this host",
            ),
            (not patches.verified("shm_route"), patches.check("shm_route")[1]),
        ],
        "every rank on one CPU host (if the kernel loads)",
    )


def _keep_freed_memory(config, cfg, host, params, ours, precision) -> tuple[bool, str]:
    """glibc keeps freed blocks up to 32 MiB on the heap and never trims it, so a step does not
    page-fault its working set in again (runtime/distributed.py: keep_freed_memory)."""
    if config.host.keep_freed_memory == "off":
        return False, "--keep-freed-memory off"
    return auto_unless(
        [(host.device_type != "cpu", f"{host.device_type}, not a CPU")], "a CPU (glibc's heap)"
    )
