"""The mixture-of-experts model: routing against a plain-PyTorch reference, its router losses,
its cost, and its refusals."""

import pytest
import torch
import torch.nn.functional as F

from models import ModelError, build_model, flops_per_token, get_config, num_params
from models.moe import Experts, MoeFeedForward, grouped_mm_runs, router_metrics, take_router_totals


def reference_moe(x, gate_w, gate_up, down, top_k):
    """Token by token: fp32 router softmax over all experts, the top-k renormalised (Mixtral's
    formula), each chosen expert's SwiGLU output weighted and summed. Returns (out, experts)."""
    out = torch.zeros_like(x)
    chosen = []
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t].double() @ gate_w.double().T, dim=-1)
        p, idx = torch.sort(probs, descending=True)
        p, idx = p[:top_k] / p[:top_k].sum(), idx[:top_k]
        chosen.append(sorted(idx.tolist()))
        for w, e in zip(p.tolist(), idx.tolist(), strict=True):
            g, u = (gate_up[e] @ x[t]).chunk(2)
            out[t] += w * (down[e] @ (F.silu(g) * u))
    return out, chosen


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_routing_matches_a_token_by_token_reference(top_k):
    torch.manual_seed(0)
    config = get_config("tiny-moe", num_experts=4, num_experts_per_tok=top_k)
    layer = MoeFeedForward(config)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 24, config.hidden_size)
    with torch.no_grad():
        got = layer(x).reshape(-1, config.hidden_size)
        experts = layer.router_logits.topk(top_k, dim=-1).indices.sort(dim=-1).values.tolist()
        want, want_experts = reference_moe(
            x.reshape(-1, config.hidden_size),
            layer.gate.weight,
            layer.experts.gate_up_proj,
            layer.experts.down_proj,
            top_k,
        )
    assert experts == want_experts  # the same tokens go to the same experts
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # with the same weights


def experts_and_inputs(num_experts: int, tokens: int = 512, top_k: int = 2):
    config = get_config("tiny-moe", num_experts=num_experts, num_experts_per_tok=top_k)
    experts = Experts(config)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(tokens, config.hidden_size, requires_grad=True)
    index = torch.randint(0, num_experts, (tokens, top_k))
    index[:, 0] = index[:, 0] % (num_experts - 1)  # the last expert may get no token: a group of 0
    weight = torch.rand(tokens, top_k)
    return experts, x, index, weight


def forward_backward(fn, experts, x, index, weight):
    x.grad = None
    experts.zero_grad()
    out = fn(x, index, weight)
    out.square().sum().backward()
    return out.detach(), x.grad, experts.gate_up_proj.grad, experts.down_proj.grad


@pytest.mark.parametrize("num_experts", [8, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_give_the_loops_numbers(num_experts, dtype):
    """One grouped matmul per projection against the matmul per expert it replaced: outputs and
    every gradient within rounding (bf16 under autocast, as the engines run it)."""
    torch.manual_seed(0)
    assert grouped_mm_runs(torch.device("cpu"), dtype)  # CPU has it in every float dtype
    experts, x, index, weight = experts_and_inputs(num_experts)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        grouped = forward_backward(experts.forward, experts, x, index, weight)
        loop = forward_backward(experts.loop_forward, experts, x, index, weight)
    for got, want in zip(grouped, loop, strict=True):
        torch.testing.assert_close(got, want)  # fp32 rounding in fp32, both ways in bf16


def test_grouped_experts_hold_no_host_value():
    """The grouped path traces as one graph: no `.tolist()` or `.item()` of the tokens per
    expert, each of which is a device-to-host sync per layer on a GPU (and a graph break under
    torch.compile); the loop has one. Compiled, torch traces the grouped matmul in bf16 only."""
    cpu = torch.device("cpu")
    assert grouped_mm_runs(cpu, torch.bfloat16, compiled=True)
    assert not grouped_mm_runs(cpu, torch.float32, compiled=True)  # the loop, compiled in fp32
    experts, x, index, weight = experts_and_inputs(16, tokens=64)
    experts, x = experts.bfloat16(), x.detach().bfloat16()
    grouped = torch._dynamo.explain(experts.forward)(x, index, weight)
    loop = torch._dynamo.explain(experts.loop_forward)(x, index, weight)
    assert grouped.graph_break_count == 0 and grouped.graph_count == 1, grouped.break_reasons
    assert loop.graph_count == 0  # eager: nothing to recompile at every new count


def test_router_runs_in_fp32_under_bf16_autocast():
    torch.manual_seed(0)
    layer = MoeFeedForward(get_config("tiny-moe"))
    x = torch.randn(1, 8, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x)
    assert layer.router_logits.dtype == torch.float32


def test_training_loss_adds_the_router_losses_with_their_coefficients():
    torch.manual_seed(0)
    model = build_model("tiny-moe", overrides={"router_z_loss_coef": 0.01})
    x = torch.randint(0, 512, (2, 32))
    model.eval()
    ce = model(x, labels=x).loss
    model.train()
    out = model(x, labels=x)
    stats = model.router_stats
    # reference load-balancing loss, over all layers' tokens together as transformers' Mixtral
    logits = [m.router_logits for m in model.moe_layers()]  # cleared after the forward
    assert all(t is None for t in logits)
    c = model.config
    want = ce + c.router_aux_loss_coef * stats.aux_loss + c.router_z_loss_coef * stats.z_loss
    torch.testing.assert_close(out.loss, want)
    assert stats.tokens_per_expert.shape == (c.num_hidden_layers, c.num_experts)
    assert (
        int(stats.tokens_per_expert.sum())
        == c.num_hidden_layers * x.numel() * c.num_experts_per_tok
    )
    model(x, labels=x)  # a second training forward: the totals hold both
    second = model.router_stats
    metrics = router_metrics(take_router_totals(model))
    assert metrics["moe_expert_tokens_min"] <= metrics["moe_expert_tokens_max"]
    mean_aux = (float(stats.aux_loss) + float(second.aux_loss)) / 2
    assert metrics["moe_aux_loss"] == pytest.approx(mean_aux)
    assert take_router_totals(model) is None  # taken: reset
    # the aux loss alone trains the router
    model.zero_grad()
    out.aux_loss.backward()
    assert model.layers[0].feed_forward.gate.weight.grad.abs().sum() > 0


def plain_router_losses(logits, top_k, real=None):
    """Layer by layer, token by token, over the real tokens only: E * sum_e f_e * P_e (f_e the
    share of the layer's top-k assignments that went to e, P_e its mean router probability) and
    the mean logsumexp^2, each averaged over the layers."""
    aux, z = [], []
    for layer in logits:
        rows = [t for t in range(layer.shape[0]) if real is None or real[t]]
        e = layer.shape[1]
        counts, probs, lse = [0.0] * e, [0.0] * e, 0.0
        for t in rows:
            p = torch.softmax(layer[t].double(), dim=-1)
            for i in p.topk(top_k).indices.tolist():
                counts[i] += 1
            for i in range(e):
                probs[i] += float(p[i])
            lse += float(torch.logsumexp(layer[t].double(), dim=-1)) ** 2
        n = len(rows)
        aux.append(e * sum(c / n * q / n for c, q in zip(counts, probs, strict=True)))
        z.append(lse / n)
    return sum(aux) / len(aux), sum(z) / len(z)


def test_load_balancing_loss_is_per_layer_with_padding_left_out():
    """Each layer's Switch loss over its real tokens, averaged over the layers (Switch's,
    Megatron's, the Mixtral paper's per layer): a plain computation, and transformers' Mixtral
    function applied to each layer alone with the same attention mask. Padding rows, whatever
    their logits, change nothing."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from models.moe import router_stats

    torch.manual_seed(0)
    logits = [torch.randn(40, 8) * 2 for _ in range(3)]
    real = torch.ones(40, dtype=torch.bool)
    real[13:20] = real[33:] = False  # two rows of 20 tokens, right-padded
    ours = router_stats(logits, top_k=2, real=real)
    aux, z = plain_router_losses(logits, 2, real)
    assert float(ours.aux_loss) == pytest.approx(aux, rel=1e-5)
    assert float(ours.z_loss) == pytest.approx(z, rel=1e-5)
    mask = real.view(2, 20).long()
    per_layer = [load_balancing_loss_func((g,), 8, 2, mask) for g in logits]
    torch.testing.assert_close(ours.aux_loss, torch.stack(per_layer).mean())
    assert int(ours.tokens_per_expert.sum()) == 3 * 2 * int(real.sum())  # real tokens only
    # padding changed: nothing moves
    moved = [g.clone() for g in logits]
    for g in moved:
        g[~real] = torch.randn(int((~real).sum()), 8) * 10
    again = router_stats(moved, top_k=2, real=real)
    assert torch.equal(again.aux_loss, ours.aux_loss) and torch.equal(again.z_loss, ours.z_loss)
    assert torch.equal(again.tokens_per_expert, ours.tokens_per_expert)
    # no mask: every token, still layer by layer
    everything = router_stats(logits, top_k=2)
    assert float(everything.aux_loss) == pytest.approx(plain_router_losses(logits, 2)[0], rel=1e-5)


def test_padding_leaves_the_models_router_losses_unchanged():
    """A right-padded batch (chat data, preference pairs: data/examples.py): the tokens after
    the one each row's last trained target names are padding, left out of the router losses
    and the tokens counted, whatever the padding holds."""
    from models.moe import real_tokens

    torch.manual_seed(0)
    model = build_model("tiny-moe").train()
    x = torch.randint(0, 512, (3, 32), generator=torch.Generator().manual_seed(1))
    y = torch.full_like(x, -100)
    lengths = [32, 20, 9]  # tokens of each row's example
    for row, n in enumerate(lengths):
        y[row, 2 : n - 1] = x[row, 3:n]  # a prompt of 3 tokens; the rest of the example trained
    real = real_tokens(y)
    assert real.sum(dim=1).tolist() == lengths
    first = model(input_ids=x, labels=y, shift_labels=y)
    stats = model.router_stats
    padded = x.clone()
    for row, n in enumerate(lengths):
        padded[row, n:] = (row + 7) * 3  # other padding ids
    again = model(input_ids=padded, labels=y, shift_labels=y)
    torch.testing.assert_close(again.aux_loss, first.aux_loss)
    torch.testing.assert_close(model.router_stats.z_loss, stats.z_loss)
    assert torch.equal(model.router_stats.tokens_per_expert, stats.tokens_per_expert)
    c = model.config
    assert int(stats.tokens_per_expert.sum()) == c.num_hidden_layers * sum(lengths) * 2
    # the same numbers as a plain computation over the real tokens of each layer
    seen = []
    hooks = [
        m.register_forward_hook(lambda mod, i, out: seen.append(mod.router_logits.detach()))
        for m in model.moe_layers()
    ]
    with torch.no_grad():
        model(input_ids=x, labels=y, shift_labels=y)
    for h in hooks:
        h.remove()
    aux, z = plain_router_losses(seen, 2, real.reshape(-1))
    assert float(stats.aux_loss) == pytest.approx(aux, rel=1e-5)
    assert float(stats.z_loss) == pytest.approx(z, rel=1e-5)


def test_parameter_count_and_flops_count_active_experts():
    config = get_config("tiny-moe")
    model = build_model("tiny-moe")
    total = sum(p.numel() for p in model.parameters())
    assert total == num_params(config)
    h, i, e, k, layers = 64, 88, 4, 2, 2
    assert num_params(config) - num_params(config, active=True) == layers * (e - k) * 3 * h * i
    # MFU counts the experts a token uses, however the caller counted the parameters
    assert flops_per_token(config, 64, n_params=total) == flops_per_token(config, 64)
    all_four = get_config("tiny-moe", num_experts_per_tok=4)
    assert flops_per_token(config, 64) < flops_per_token(all_four, 64)


def test_shared_expert_sees_every_token():
    torch.manual_seed(0)
    config = get_config("tiny-moe", shared_expert_intermediate_size=32)
    layer = MoeFeedForward(config)
    with torch.no_grad():  # the experts are made with torch.empty: give them numbers
        for p in layer.parameters():
            p.normal_(0, 0.02)
    x = torch.randn(1, 8, 64)
    with torch.no_grad():
        both = layer(x)
        shared = layer.shared_expert(x)
        layer.shared_expert = None
        routed = layer(x)
    torch.testing.assert_close(both, routed + shared)
    model = build_model("tiny-moe", overrides={"shared_expert_intermediate_size": 32})
    assert num_params(config) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"num_experts_per_tok": 5}, "num_experts_per_tok (5) is above num_experts (4)"),
        ({"num_experts": 0}, "num_experts must be a positive integer"),
        ({"router_aux_loss_coef": -1.0}, "router_aux_loss_coef must be 0 or positive"),
    ],
)
def test_bad_moe_shapes_are_refused(overrides, words):
    with pytest.raises(ModelError, match=words.replace("(", r"\(").replace(")", r"\)")):
        get_config("tiny-moe", **overrides)


@pytest.mark.parametrize(
    "qk_norm, stock", [(False, "MixtralForCausalLM"), (True, "Qwen3MoeForCausalLM")]
)
def test_moe_export_is_our_model_in_stock_transformers(qk_norm, stock, tmp_path):
    """Mixtral, or with QK-norm Qwen3-MoE (its per-head q and k norms, its renormalised top-k)."""
    from transformers import AutoModelForCausalLM

    from models.hf_adapter import to_hf
    from training.checkpoints.hf_export import write_safetensors

    torch.manual_seed(0)
    shape = {"num_experts": 5, "num_experts_per_tok": 3, "qk_norm": qk_norm}
    ours = build_model("tiny-moe", overrides=shape).eval()
    if qk_norm:  # initialised to ones: make a swapped or missing norm show in the logits
        for name, p in ours.named_parameters():
            if "_norm" in name:
                torch.nn.init.uniform_(p, 0.5, 1.5)
    config, rename = to_hf(ours.config)
    config.save_pretrained(tmp_path)
    sd = rename(dict(ours.named_parameters()))  # the tied head is stored once, as embeddings
    write_safetensors(tmp_path, sd, torch.float32, 2**30)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(theirs).__name__ == stock
    ids = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(input_ids=ids), theirs(input_ids=ids, output_router_logits=True)
    torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.aux_loss, per_layer_aux(b, top_k=3))
    gen = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids[:1, :6], **gen), theirs.generate(ids[:1, :6], **gen))


def per_layer_aux(out, top_k: int) -> torch.Tensor:
    """A stock MoE output's load-balancing loss as our model reports it: transformers' function
    on each layer's router logits alone, averaged over the layers (transformers' own `aux_loss`
    pools the layers' tokens)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    e = out.router_logits[0].shape[-1]
    per_layer = [load_balancing_loss_func((g,), e, top_k) for g in out.router_logits]
    return torch.stack(per_layer).mean()


def test_shared_expert_export_is_refused():
    from models.hf_adapter import to_hf

    with pytest.raises(
        ModelError, match="shared expert, which transformers' Mixtral and Qwen3-MoE"
    ):
        to_hf(get_config("tiny-moe", shared_expert_intermediate_size=32))


def test_train_command_refuses_top_k_above_the_expert_count(
    tiny_data, tmp_path, capsys, monkeypatch
):
    import json

    from conftest import refused

    folder = tmp_path / "bad-moe"
    folder.mkdir()
    config = get_config("tiny-moe").to_dict()
    config["num_experts_per_tok"] = 6  # of 4 experts
    (folder / "config.json").write_text(json.dumps(config))
    argv = ["--data", str(tiny_data), "--out", str(tmp_path / "run"), "--model", str(folder)]
    err = refused(capsys, monkeypatch, tmp_path, argv)
    assert "num_experts_per_tok (6) is above num_experts (4)" in err


@pytest.mark.parametrize("target", ["gate_up_proj", "down_proj", "experts"])
def test_lora_on_the_stacked_experts_is_refused_in_one_line(target):
    """Our experts and transformers' Mixtral's are stacked weights, not the linear layers the
    adapters wrap: a target naming them is refused, saying what LoRA trains instead."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from models.lora import parse_lora, targets

    mixtral = MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
    )  # fmt: skip
    stacked = {"gate_up_proj", "down_proj", "experts"}
    for model in (build_model("tiny-moe"), MixtralForCausalLM(mixtral)):
        with pytest.raises(ModelError, match="routed experts are stacked weights") as e:
            targets(model, parse_lora(f"targets={target},q_proj,wq"))
        assert "\n" not in str(e.value)
        default = set(targets(model, parse_lora("r=4")))
        assert {"q_proj", "wq"} & default and not stacked & default  # attention; experts frozen


def test_train_command_refuses_lora_with_expert_parallelism(
    tiny_data, tmp_path, capsys, monkeypatch
):
    from conftest import refused

    folder = tmp_path / "hf-moe"
    build_model("tiny-moe").save_pretrained(folder)
    capsys.readouterr()  # the save's progress bar
    argv = ["--data", str(tiny_data), "--out", str(tmp_path / "run"), "--model", str(folder),
            "--lora", "r=4", "--ds_config", "ds_configs/moe_ep2.json"]  # fmt: skip
    err = refused(capsys, monkeypatch, tmp_path, argv)
    assert "--lora with expert parallelism is not supported" in err


def test_train_command_refuses_a_shared_expert_with_expert_parallelism(
    tiny_data, tmp_path, capsys, monkeypatch
):
    """AutoEP replaces the whole routed MLP with its own layer, which keeps a shared expert only
    for presets that declare one (Mixtral's does not): ours would vanish from the model."""
    from conftest import refused

    folder = tmp_path / "shared-moe"
    build_model("tiny-moe", overrides={"shared_expert_intermediate_size": 32}).save_pretrained(
        folder
    )
    capsys.readouterr()  # the save's progress bar
    argv = ["--data", str(tiny_data), "--out", str(tmp_path / "run"), "--model", str(folder),
            "--ds_config", "ds_configs/moe_ep2.json"]  # fmt: skip
    err = refused(capsys, monkeypatch, tmp_path, argv)
    assert "shared expert" in err and "expert parallelism" in err
