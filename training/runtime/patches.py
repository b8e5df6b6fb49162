"""Every place zerostack reaches into DeepSpeed's or torch's internals, with the versions it was
verified against and the test that verifies it (`tested`): where the stock path runs at all,
the test runs it against the patched one (shm_route, staged_checkpoint_engine); where the stock
path fails or loses state (the rest), the test runs the patched path and checks what the stock
one would get wrong. Outside its range a patch is not applied: the run takes the library's stock
path, and says so in one line at start (preflight) and in resolved_config.json. Widen a range
only after its test passes on the new version."""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version


@dataclass(frozen=True)
class Patch:
    library: str  # the distribution whose internals it touches
    low: str  # verified from this release ...
    high: str  # ... to this one, both included (local tags such as +cpu ignored)
    what: str  # what it replaces, and the stock path taken outside the range
    tested: str  # the test (file::function) that verifies it, and how


PATCHES: dict[str, Patch] = {
    "shm_route": Patch(
        "deepspeed",
        "0.19.8",
        "0.19.8",
        "runtime/shm.py replaces cdb.all_reduce / all_gather_into_tensor / reduce_scatter_tensor "
        "and deepspeed.runtime.zero.stage3.reduce_scatter_coalesced; stock: gloo",
        "tests/test_patches.py::test_stock_and_patched_paths_train_alike_on_four_ranks: stock "
        "against patched, ZeRO-3 on 4 ranks",
    ),
    "optimizer_step_stand_down": Patch(
        "deepspeed",
        "0.19.8",
        "0.19.8",
        "engines/ds.py stands the torch optimizer's step down when a ZeRO-0 fp32 step's gradients "
        "are not finite; stock: DeepSpeed steps, and the loss says the rest",
        "tests/test_reliability.py::test_a_skipped_step_leaves_weights_and_optimizer_untouched: "
        "patched only (fp32_zero0: the weights and moments stay as they were)",
    ),
    "swapped_optimizer_restore": Patch(
        "deepspeed",
        "0.19.8",
        "0.19.8",
        "engines/ds.py rebuilds ZeRO-3 NVMe-swapped optimizer state that load_checkpoint skips "
        "(when the skip is there); stock: DeepSpeed's load, Adam's state restarts",
        "tests/test_nvme.py::test_nvme_checkpoint_resumes_exactly_under_nvme: patched only (the "
        "resume matches the uninterrupted run; stock restarts Adam)",
    ),
    "ulysses_mpu_shim": Patch(
        "deepspeed",
        "0.19.8",
        "0.19.8",
        "engines/ds.py gives Ulysses's mpu a tensor-parallel size of 1 during a load; stock: "
        "DeepSpeed's loader stops on the missing method",
        "tests/test_parallel_checkpoints.py::test_sp2_resumes_from_tp2_and_on_plain_data_parallel: "
        "patched only (stock stops)",
    ),
    "fsdp2_held_grads": Patch(
        "torch",
        "2.13.0",
        "2.13.0",
        "engines/fsdp.py reads FSDP2's private accumulated gradients to count them; stock: "
        "the held gradients are not counted in the model-state bytes",
        "tests/test_mfu.py::test_fsdp_hold_across_micro_steps_trains_alike: patched only (the "
        "held whole gradients are counted: twice the sharded run's)",
    ),
    "spike_norm_check": Patch(
        "deepspeed",
        "0.19.8",
        "0.19.8",
        "engines/spike_guard.py wraps is_invalid_grad_norm in DeepSpeed's ZeRO-1/2, ZeRO-3, bf16 "
        "and fp16 optimizer modules while the engine steps, so a spike's norm reads as invalid; "
        "stock: the spike guard judges and logs steps under DeepSpeed but does not skip them",
        "tests/test_spikes.py::test_the_spike_guard_skips_on_every_engine: patched only (zero3: "
        "the spike leaves the weights as they were; the rollback test runs ZeRO-2)",
    ),
    "staged_checkpoint_engine": Patch(
        "deepspeed",
        "0.19.8",
        "0.19.8",
        "engines/ds.py swaps engine.checkpoint_engine, for one --async-save, for one that stages "
        "each file into the background writer; stock: DeepSpeed writes each file itself during "
        "the save (synchronous; the seal hashes the files)",
        "tests/test_patches.py::test_staged_checkpoint_engine_writes_what_deepspeeds_writes: "
        "stock against patched, and every method DeepSpeed's engine calls on it",
    ),
    "muon_stand_in": Patch(
        "deepspeed",
        "0.19.8",
        "0.19.8",
        "engines/ds.py puts stand-in modules (a MuonWithAuxAdam with no instances) where "
        "DeepSpeed's Muon modules go, in a run whose optimizer is not Muon; stock: "
        "DeepSpeed's Muon checks (initialize, bf16 optimizer, ZeRO-3 set-up, each ZeRO-1/2 "
        "reduction) import its Muon modules, whose torch.compile decorators load inductor",
        "tests/test_patches.py::test_the_muon_stand_in_trains_as_stock: stock against patched "
        "over ZeRO-1, 2 and 3 steps in bf16, and Muon never imported",
    ),
    "muon_eager_on_cpu": Patch(
        "deepspeed",
        "0.19.8",
        "0.19.8",
        "engines/ds.py runs DeepSpeed's Muon update and Newton-Schulz eagerly on a CPU (their "
        "torch.compile wrappers unwrapped); stock: inductor compiles them per matrix shape, "
        "minutes of a small CPU's first steps",
        "tests/test_muon.py::test_deepspeeds_muon_runs_eagerly_on_a_cpu: patched against "
        "stock with torch.compile off, ZeRO-2 Muon steps bit for bit, no compiled graph",
    ),
    "muon_ns_fp32_on_cpu_deepspeed": Patch(
        "deepspeed",
        "0.19.8",
        "0.19.8",
        "engines/muon.py makes DeepSpeed's ns_compute_dtype('standard') float32 in a Muon run "
        "that trains in fp32 on a CPU; stock: bfloat16 wherever the accelerator takes it, which "
        "a CPU without bf16 units does by emulation, several times slower than fp32",
        "tests/test_muon.py::test_newton_schulz_runs_in_fp32_in_an_fp32_run_on_a_cpu: patched "
        "against stock (the dtype DeepSpeed's Newton-Schulz computes in)",
    ),
    "muon_ns_fp32_on_cpu_torch": Patch(
        "torch",
        "2.13.0",
        "2.13.0",
        "engines/muon.py puts a copy of torch.optim._muon._zeropower_via_newtonschulz with "
        "float32 in place of its bfloat16 in a Muon run that trains in fp32 on a CPU; stock: "
        "bfloat16, emulated and several times slower than fp32 on a CPU without bf16 units",
        "tests/test_muon.py::test_newton_schulz_runs_in_fp32_in_an_fp32_run_on_a_cpu: the copy "
        "in bfloat16 against stock, bit for bit; in float32, the dtype it computes in",
    ),
    "muon_split_tags": Patch(
        "deepspeed",
        "0.19.8",
        "0.19.8",
        "engines/ds.py wraps deepspeed.set_optimizer_flags so that a Muon run's parameters are "
        "tagged by zerostack's split after DeepSpeed's rule; stock: an untied output head goes "
        "to Muon under DeepSpeed and to AdamW under DDP and FSDP2 (the run stops on the check)",
        "tests/test_muon.py::test_an_untied_head_stays_with_adamw_under_deepspeed: patched "
        "only (stock tags the head for Muon)",
    ),
    "zero_overflow_fused": Patch(
        "deepspeed",
        "0.19.8",
        "0.19.8",
        "engines/overflow.py gives each ZeRO-1/2 optimizer (not offloaded) an overflow test of "
        "one aminmax per gradient in place of DeepSpeed's six ops per gradient; stock: "
        "DeepSpeed's per-gradient test",
        "tests/test_overflow.py::test_the_fused_overflow_test_answers_as_stock: stock against "
        "patched on ZeRO-1 and 2 gradients, finite and with NaN, +inf and -inf planted",
    ),
}


def in_range(installed: str, low: str, high: str) -> bool:
    """Whether release `installed` lies in [low, high] (pre-releases and local tags compare by
    their release numbers: 2.13.0+cpu is 2.13.0); an unparsable version is outside."""
    got = release(installed)
    return got is not None and release(low) <= got <= release(high)


def release(v: str) -> tuple[int, ...] | None:
    """ "2.13.0+cpu" -> (2, 13, 0); "0.20.0rc1" -> (0, 20, 0); None when it starts with no number."""
    m = re.match(r"\d+(\.\d+)*", v.strip())
    return tuple(int(x) for x in m.group().split(".")) if m else None


def installed_version(library: str) -> str:
    try:
        return version(library)
    except PackageNotFoundError:
        return "not installed"


def check(name: str, installed: str | None = None) -> tuple[bool, str]:
    """(applied, one line) for patch `name` against `installed` (default: the library's
    installed version)."""
    p = PATCHES[name]
    installed = installed_version(p.library) if installed is None else installed
    span = p.low if p.low == p.high else f"{p.low} to {p.high}"
    if in_range(installed, p.low, p.high):
        return True, f"{p.library} {installed}: verified ({span})"
    return False, (
        f"{name}: {p.library} {installed} is outside the versions it was verified against "
        f"({span}); taking the stock path ({p.what.split('stock: ')[-1]})"
    )


def verified(name: str) -> bool:
    """Whether patch `name` may be applied with the libraries installed."""
    return check(name)[0]


def as_record() -> dict:
    """{patch: {"applied": bool, "why": line}} for resolved_config.json."""
    return {n: dict(zip(("applied", "why"), check(n))) for n in PATCHES}


def unverified_lines() -> list[str]:
    """One line for each patch not applied with the libraries installed (said at start)."""
    return [line for ok, line in map(check, PATCHES) if not ok]
