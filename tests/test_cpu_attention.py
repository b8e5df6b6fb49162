"""The CPU attention backward (models/cpu_attention.py, models/kernels/): its gradients against
an fp32 reference and against SDPA's own bf16 backward, through the model eager and compiled,
and where "auto" picks it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models import ModelError, ZeroStackForCausalLM, compile_blocks, cpu_attention, get_config
from models.llama import pick_attention_kernel, set_attention_kernel


@pytest.fixture(scope="module")
def kernel():
    why = cpu_attention.available()  # builds it on first use (~10 s a machine)
    if why is not None:
        pytest.skip(f"the CPU attention kernel does not run here: {why}")


def _qkv(b, h, kv, t, d, seed=0):
    torch.manual_seed(seed)
    # q as the model makes it: a (b, t, h, d) projection viewed as (b, h, t, d)
    q = torch.randn(b, t, h, d, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    k = torch.randn(b, kv, t, d, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, kv, t, d, dtype=torch.bfloat16, requires_grad=True)
    return q, k, v, torch.randn(b, h, t, d, dtype=torch.bfloat16)


def _rel(a, b):
    return ((a.float() - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize(
    "b,h,kv,t,d",
    [(1, 4, 4, 128, 64), (2, 6, 2, 256, 64), (1, 4, 1, 192, 32), (1, 2, 2, 128, 128)],
    ids=["mha", "gqa", "mqa-d32", "d128"],
)
def test_gradients_match_the_fp32_reference(kernel, b, h, kv, t, d):
    q, k, v, grad = _qkv(b, h, kv, t, d)
    out = cpu_attention.causal_attention(q, k, v)
    out.backward(grad)
    ours = (q.grad, k.grad, v.grad)
    # the forward is SDPA's own, bit for bit
    sdpa = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    sdpa_out = F.scaled_dot_product_attention(*sdpa, is_causal=True, enable_gqa=h != kv)
    assert torch.equal(out, sdpa_out)
    sdpa_out.backward(grad)
    ref = [x.detach().float().requires_grad_() for x in (q, k, v)]
    F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=h != kv).backward(grad.float())
    for name, mine, theirs, exact in zip("qkv", ours, sdpa, ref, strict=True):
        err, sdpa_err = _rel(mine, exact.grad), _rel(theirs.grad, exact.grad)
        # fp32 accumulation: at least as close as SDPA's bf16 backward, which rounds its
        # accumulators to bf16
        assert err < 1e-2 and err <= 1.5 * sdpa_err + 1e-3, (name, err, sdpa_err)


def _model():
    # `tiny` with heads of 32 (grouped-query: 4 heads, 2 kv heads)
    cfg = get_config("tiny", vocab_size=256, hidden_size=128, intermediate_size=256)
    torch.manual_seed(0)
    return ZeroStackForCausalLM(cfg).train()


def _loss_and_grads(model, x):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=x, labels=x, shift_labels=x).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_model_trains_alike_under_amx_and_sdpa(kernel):
    """bf16 autocast, sequence 128: the amx kernel's loss is SDPA's (same forward) and its
    gradients agree within bf16 rounding; a sequence that does not divide into blocks falls
    back to SDPA."""
    model = _model()
    x = torch.randint(0, 256, (2, 128))
    set_attention_kernel(model, "sdpa")
    loss_sdpa, grads_sdpa = _loss_and_grads(model, x)
    set_attention_kernel(model, "amx")
    loss_amx, grads_amx = _loss_and_grads(model, x)
    assert torch.equal(loss_amx, loss_sdpa)
    for name, g in grads_sdpa.items():
        assert _rel(grads_amx[name], g.float()) < 2e-2, name
    odd = torch.randint(0, 256, (2, 100))  # not a multiple of the block: SDPA's path
    loss_odd, _ = _loss_and_grads(model, odd)
    set_attention_kernel(model, "sdpa")
    assert torch.equal(loss_odd, _loss_and_grads(model, odd)[0])


@pytest.mark.slow
def test_compiled_blocks_call_the_kernel(kernel):
    """Regional compilation traces the kernel as one op: the same loss and gradients as eager,
    and no graph break."""
    import torch._dynamo

    model = _model()
    x = torch.randint(0, 256, (2, 128))
    set_attention_kernel(model, "amx")
    loss_eager, grads_eager = _loss_and_grads(model, x)
    torch._dynamo.reset()
    compile_blocks(model)
    from torch._dynamo.utils import counters

    counters.clear()
    loss_compiled, grads_compiled = _loss_and_grads(model, x)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert abs(loss_compiled.item() - loss_eager.item()) < 1e-2 * loss_eager.item()
    for name, g in grads_eager.items():
        assert _rel(grads_compiled[name], g.float()) < 3e-2, name


def test_auto_picks_amx_on_cpus_that_run_it(kernel, monkeypatch):
    assert pick_attention_kernel("auto", "cpu", 256) == "amx"
    assert pick_attention_kernel("auto", "cpu", 1024) == "amx"
    assert pick_attention_kernel("auto", "cpu", 200) == "explicit"  # not in blocks of 64
    assert pick_attention_kernel("auto", "cuda", 1024) == "sdpa"
    assert pick_attention_kernel("auto", "cpu", 256, masked=True) == "sdpa"  # --doc-mask
    assert pick_attention_kernel("explicit", "cpu", 256) == "explicit"  # a run keeps off it


def test_auto_falls_back_on_a_host_without_amx(monkeypatch):
    """Runs on every host: a CPU without AMX (simulated where the host has it) never gets the
    amx kernel from auto, and asking for it says why in one line."""
    monkeypatch.setattr(cpu_attention, "_has_amx", lambda: False)
    cpu_attention.available.cache_clear()
    try:
        assert pick_attention_kernel("auto", "cpu", 256) == "explicit"
        assert pick_attention_kernel("auto", "cpu", 1024) == "sdpa"
        with pytest.raises(ModelError, match="no AMX"):
            pick_attention_kernel("amx", "cpu", 1024)
        with pytest.raises(ModelError, match="no AMX"):
            set_attention_kernel(_model(), "amx")
    finally:
        cpu_attention.available.cache_clear()


def test_a_fresh_process_that_only_sets_the_kernel_trains(kernel):
    """set_attention_kernel(model, "amx") loads the C++ op itself: a process that never asked
    pick_attention_kernel (a benchmark's loop, a user's script) still runs the backward."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import torch\n"
        "from models import build_model, set_attention_kernel\n"
        "m = build_model('tiny', vocab_size=512)\n"
        "set_attention_kernel(m, 'amx')\n"
        "x = torch.randint(0, 512, (2, 128))\n"
        "with torch.autocast('cpu', dtype=torch.bfloat16):\n"
        "    loss = m(input_ids=x, labels=x, shift_labels=x).loss\n"
        "loss.backward()\n"
        "print('grad', m.layers[0].attention.wq.weight.grad.abs().sum().item() > 0)\n"
    )
    repo = Path(__file__).resolve().parent.parent
    p = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().endswith("grad True"), p.stdout
