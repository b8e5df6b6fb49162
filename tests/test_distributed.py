"""DeepSpeed's collectives through shared memory on one CPU host (training/runtime/shm.py)."""

from __future__ import annotations

import json

import pytest
from conftest import launch, shm_has_room

pytestmark = pytest.mark.slow  # real 2-rank process groups


def test_shm_collectives_match_gloo_and_leave_nothing_behind():
    """2 real ranks: float32/bf16/fp16 sums over the kernel's chunk edges equal the exact sum
    (to the dtype's rounding), all-gathers are exact (also with the input inside the output,
    as ZeRO-3 passes it) and reduce-scatters sum (also into a chunk of their input, as ZeRO-3
    passes it), async calls included, without touching gloo; ZeRO-3's coalesced gradient
    average is DeepSpeed's to the bit; MAX, int64, non-contiguous and
    sub-group calls still go to gloo and are right; no /dev/shm segment of the run remains."""
    if not shm_has_room():
        pytest.skip("/dev/shm cannot hold DeepSpeed's segments here (the route stays off)")
    r = launch([], script="tests/scripts/shm_collectives.py")
    _check_routed(json.loads(next(x for x in r.stdout.splitlines() if x.startswith("{"))))


def test_shm_collectives_on_an_avx2_host_route_float32_only():
    """DeepSpeed's kernel on a CPU with AVX2 but no AVX-512 (level 1, simulated here where the
    host has AVX-512) reduces float32 only: the bf16/fp16 calls go to gloo and are still right,
    and everything else holds as on an AVX-512 host."""
    if not shm_has_room():
        pytest.skip("/dev/shm cannot hold DeepSpeed's segments here (the route stays off)")
    r = launch(["level1"], script="tests/scripts/shm_collectives.py", forked=False)
    out = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("{")))
    assert out["level"] == 1
    _check_routed(out)


def _check_routed(out: dict) -> None:
    assert out["routed"] is True
    assert out["segments_left"] == []
    # Level 2 (AVX-512): every call above went through shared memory. Level 1 (AVX2 only): the
    # 20 bf16/fp16 sums, gathers and scatters went to gloo (as seen on an AMD Zen 3 host).
    assert out["gloo_calls_routed"] == (0 if out["level"] >= 2 else 20)
    assert out["gloo_calls_fallback"] == 4  # MAX, non-contiguous, int64, sub-group
    assert out["gathers"] and all(out["gathers"].values()), out["gathers"]
    assert out["fsdp"] and all(out["fsdp"].values()), out["fsdp"]  # FSDP2's, bitwise gloo's
    assert len(out["coalesced"]) == 4 and all(out["coalesced"].values()), out["coalesced"]
    assert out["max"] == [2.0] * 5
    assert out["noncontiguous"] == 3 * 45.0
    assert out["int64"] == [3, 3, 3]
    assert out["async"] == [2.0] * 4
    assert out["subgroup"] == [1.0] * 4
    tol = {"torch.float32": 1e-6, "torch.bfloat16": 8e-3, "torch.float16": 1e-3}
    for key, err in out["errors"].items():
        assert err <= tol[key.split("/")[0]], (key, err)


def test_shm_collectives_on_four_ranks_round_as_a_sum_in_another_order():
    """On 4 ranks (3 alike, seen once) the route still takes every call (nothing refused,
    nothing falls back to gloo), gathers stay exact, and ZeRO-3's coalesced gradient average
    and FSDP2's are gloo's to fp32 rounding only: the kernel adds the ranks in another order
    than gloo's ring, so the bitwise claim holds on two ranks alone, a power of two or not."""
    world = 4
    if not shm_has_room(world):
        pytest.skip("/dev/shm cannot hold DeepSpeed's segments here (the route stays off)")
    r = launch([], nproc=world, script="tests/scripts/shm_collectives.py")
    out = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("{")))
    assert out["routed"] is True and out["segments_left"] == []
    assert out["gloo_calls_routed"] == (0 if out["level"] >= 2 else 20)
    assert all(out["gathers"].values()), out["gathers"]
    tol = {"torch.float32": 1e-6, "torch.bfloat16": 8e-3, "torch.float16": 1e-3}
    for key, err in {**out["errors"], **out["coalesced_err"]}.items():
        assert err <= tol[key.split("/")[0]], (key, err)
    assert max(out["fsdp_err"].values()) <= 1e-6, out["fsdp_err"]


def test_shm_collectives_can_be_turned_off():
    r = launch(["off"], script="tests/scripts/shm_collectives.py")
    out = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("{")))
    assert out["routed"] is False
    assert out["fsdp"] is None  # FSDP2 keeps its own collectives
    assert out["gloo_calls_routed"] == 12 + 1 + 12 + 12  # sums, async sum, gathers, scatters
    assert all(out["gathers"].values())
    assert len(out["coalesced"]) == 4 and all(out["coalesced"].values())  # DeepSpeed's own
