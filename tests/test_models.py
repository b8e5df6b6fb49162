"""models/: our Llama-style LM against stock transformers, its presets, checkpointing, pipeline form, factory."""

import json
import os

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from models import (
    PRESETS,
    ModelError,
    ZeroStackConfig,
    ZeroStackForCausalLM,
    build_model,
    causal_lm_loss,
    flops_per_token,
    from_llama_state_dict,
    get_config,
    model_class,
    model_state_dict_to_pipeline,
    num_params,
    pipeline_state_dict_to_model,
    save_llama,
    to_llama_config,
    to_llama_state_dict,
)
from models.llama import apply_rope, rope_cos_sin, rotate_half
from training.runtime.distributed import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: one thread is as fast, and far faster when other jobs share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(**overrides) -> ZeroStackConfig:
    return get_config("tiny", **{"vocab_size": 128, "max_position_embeddings": 64, **overrides})


def qwen2_config(vocab_size: int) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


def model_and_llama(config: ZeroStackConfig):
    torch.manual_seed(0)
    ours = ZeroStackForCausalLM(config).eval()
    llama = LlamaForCausalLM(to_llama_config(config)).eval()
    llama.load_state_dict(to_llama_state_dict(ours.state_dict()))
    return ours, llama


def test_rotate_half_is_hugging_faces_convention():
    assert rotate_half(torch.tensor([1.0, 2, 3, 4])).tolist() == [-3, -4, 1, 2]
    config = tiny()
    cos, signed_sin = rope_cos_sin(config, 10, torch.device("cpu"), torch.float32)
    sin = signed_sin[:, config.head_dim // 2 :].repeat(1, 2)  # the plain sin table, [sin, sin]
    x = torch.randn(2, 4, 10, config.head_dim)
    torch.testing.assert_close(apply_rope(x, cos, signed_sin), x * cos + rotate_half(x) * sin)


@pytest.mark.parametrize(
    "kv_heads, tied",
    [(4, True), (4, False), (2, True), (1, False)],
    ids=["mha-tied", "mha-untied", "gqa-tied", "mqa-untied"],
)
def test_logits_loss_and_greedy_generate_match_llama(kv_heads, tied):
    ours, llama = model_and_llama(tiny(num_key_value_heads=kv_heads, tie_word_embeddings=tied))
    x = torch.randint(0, 128, (2, 24))
    with torch.no_grad():
        a, b = ours(x, labels=x), llama(x, labels=x)
    torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(a.loss, b.loss)
    assert torch.equal(
        ours.generate(x[:, :6], max_new_tokens=12, do_sample=False),
        llama.generate(x[:, :6], max_new_tokens=12, do_sample=False),
    )


def test_left_padding_and_kv_cache_match_llama():
    ours, llama = model_and_llama(tiny(pad_token_id=0))
    x = torch.randint(1, 128, (3, 10))
    mask = torch.ones_like(x)
    mask[0, :4] = mask[1, :1] = 0
    x[mask == 0] = 0
    with torch.no_grad():
        a, b = ours(x, attention_mask=mask).logits, llama(x, attention_mask=mask).logits
    assert not a.isnan().any()
    torch.testing.assert_close(a[mask.bool()], b[mask.bool()], atol=1e-5, rtol=0)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False)
    cached = ours.generate(x, **kw)
    assert torch.equal(cached, llama.generate(x, **kw))
    assert torch.equal(cached, ours.generate(x, use_cache=False, **kw))


def test_loss_shifts_labels_or_takes_shift_labels_as_they_are():
    torch.manual_seed(0)
    model = ZeroStackForCausalLM(tiny())
    x = torch.randint(0, 128, (2, 16))
    y = torch.roll(x, -1, dims=1)
    y[:, -1] = -100
    y[0, :3] = -100  # ignored targets
    out = model(input_ids=x, labels=y, shift_labels=y)  # the trainer's call
    expected = F.cross_entropy(out.logits.reshape(-1, 128), y.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, expected)
    labels = x.clone()
    labels[0, 1:4] = -100  # same targets as y, unshifted
    torch.testing.assert_close(model(input_ids=x, labels=labels).loss, expected)
    model_bf16 = model.to(torch.bfloat16)
    assert model_bf16(input_ids=x, labels=y, shift_labels=y).loss.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_and_its_gradient_match_cross_entropy_in_fp32(dtype):
    """causal_lm_loss makes its gradient during the forward, in chunks; it must equal autograd's.
    6,000 rows of a 1,000-word vocabulary are two chunks (4,194 rows each) in training and eval."""
    torch.manual_seed(0)
    logits = (3 * torch.randn(2, 3000, 1000)).to(dtype).requires_grad_()
    y = torch.randint(0, 1000, (2, 3000))
    y[0, :50] = -100
    for kwargs, reference in [
        ({}, lambda lg: F.cross_entropy(lg, y.reshape(-1), ignore_index=-100)),
        (
            {
                "num_items_in_batch": torch.tensor(123)
            },  # how HF's Trainer sums over accumulation steps
            lambda lg: F.cross_entropy(lg, y.reshape(-1), ignore_index=-100, reduction="sum") / 123,
        ),
    ]:
        loss = causal_lm_loss(logits, shift_labels=y, **kwargs)
        (grad,) = torch.autograd.grad(loss, logits)
        expected = reference(logits.float().reshape(-1, 1000))
        (expected_grad,) = torch.autograd.grad(expected, logits)
        assert loss.dtype == torch.float32
        torch.testing.assert_close(loss, expected)
        torch.testing.assert_close(grad, expected_grad, atol=1e-7, rtol=1e-2)
    with torch.no_grad():  # eval makes no gradient, and never upcasts all the logits at once
        torch.testing.assert_close(
            causal_lm_loss(logits, shift_labels=y), loss.detach() * 123 / 5950
        )


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_trainer_call_works_on_stock_hf_causal_lms(family):
    """model(input_ids=x, labels=y, shift_labels=y) means 'y are the targets' on any transformers causal LM."""
    torch.manual_seed(0)
    if family == "llama":
        model = LlamaForCausalLM(to_llama_config(tiny()))
    elif family == "gpt2":
        model = GPT2LMHeadModel(
            GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64)
        )
    else:
        model = Qwen2ForCausalLM(qwen2_config(vocab_size=128))
    x = torch.randint(0, 128, (2, 16))
    y = torch.randint(0, 128, (2, 16))
    out = model(input_ids=x, labels=y, shift_labels=y)
    torch.testing.assert_close(
        out.loss, F.cross_entropy(out.logits.float().reshape(-1, 128), y.reshape(-1))
    )


def test_save_pretrained_and_llama_export_load_with_stock_transformers(tmp_path):
    torch.manual_seed(0)
    model = ZeroStackForCausalLM(tiny(num_key_value_heads=2)).eval()
    x = torch.randint(0, 128, (2, 12))
    logits = model(x).logits

    model.save_pretrained(tmp_path / "ours")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    assert isinstance(again, ZeroStackForCausalLM)
    assert torch.equal(again(x).logits, logits)

    save_llama(model.state_dict(), model.config, tmp_path / "llama")
    exported = json.loads((tmp_path / "llama" / "config.json").read_text())
    assert exported["architectures"] == ["LlamaForCausalLM"] and exported["model_type"] == "llama"
    llama = AutoModelForCausalLM.from_pretrained(tmp_path / "llama")
    assert type(llama) is LlamaForCausalLM
    torch.testing.assert_close(llama(x).logits, logits, atol=1e-5, rtol=0)

    # and back: the factory trains our own class on an exported Llama folder
    back = build_model(str(tmp_path / "llama"))
    assert isinstance(back, ZeroStackForCausalLM)
    assert torch.equal(back(x).logits, logits)


def test_adapter_is_renaming_both_ways():
    sd = ZeroStackForCausalLM(tiny(tie_word_embeddings=False)).state_dict()
    llama_sd = to_llama_state_dict(sd)
    assert set(llama_sd) == set(
        LlamaForCausalLM(to_llama_config(tiny(tie_word_embeddings=False))).state_dict()
    )
    back = from_llama_state_dict(llama_sd)
    assert set(back) == set(sd) and all(back[k] is sd[k] for k in sd)


def test_presets_parameter_count_and_flops_formula():
    for name in PRESETS:
        config = get_config(name)
        with torch.device("meta"):  # shapes only: the 13B preset costs nothing here
            model = model_class(config)(config)
        assert sum(p.numel() for p in model.parameters()) == num_params(config), name
    assert num_params(get_config("tiny")) < 1_000_000
    assert 10e6 <= num_params(get_config("small")) <= 20e6
    assert 6.5e9 < num_params(get_config("7B")) < 6.8e9

    c = get_config("7B")  # untied: the input table does no matmul, the lm_head does
    n, v, h, layers = num_params(c), c.vocab_size, c.hidden_size, c.num_hidden_layers
    assert flops_per_token(c, 1024) == 6 * (n - v * h) + 12 * layers * h * 1024
    c = get_config("small")  # tied: the one table is the lm_head
    assert flops_per_token(c, 256) == 6 * num_params(c) + 12 * 8 * 384 * 256

    gpt2 = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64)
    n = sum(p.numel() for p in GPT2LMHeadModel(gpt2).parameters())
    assert flops_per_token(gpt2, 64, n_params=n) == 6 * n + 12 * 2 * 32 * 64
    with pytest.raises(ModelError):
        flops_per_token(gpt2, 64)


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda d: get_config("huge"), "valid presets: tiny, small, 125M"),
        (
            lambda d: ZeroStackConfig(hidden_size=100, num_attention_heads=3),
            "must divide hidden_size",
        ),
        (
            lambda d: ZeroStackConfig(num_attention_heads=12, num_key_value_heads=5),
            "must divide num_attention_heads",
        ),
        (lambda d: build_model(str(d)), "holds no model"),
        (lambda d: build_model("no-such-preset-or-folder"), "not a preset (tiny, small"),
    ],
    ids=["preset", "heads", "kv-heads", "empty-folder", "unknown-spec"],
)
def test_bad_input_gets_one_clear_line(tmp_path, make, expected):
    with pytest.raises(ModelError) as info:
        make(tmp_path)
    message = str(info.value)
    assert expected in message and "\n" not in message
    if "folder" in expected:
        assert str(tmp_path) in message


def test_build_model_from_presets_and_any_hf_folder(tmp_path):
    model = build_model("tiny", vocab_size=300, overrides={"num_hidden_layers": 3})
    assert isinstance(model, ZeroStackForCausalLM)
    assert (model.config.vocab_size, model.config.num_hidden_layers) == (300, 3)

    # a config-only folder builds that architecture fresh; a smaller vocabulary than the data's is grown
    GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64).save_pretrained(
        tmp_path / "gpt2"
    )
    gpt2 = build_model(str(tmp_path / "gpt2"), vocab_size=120)
    assert isinstance(gpt2, GPT2LMHeadModel) and gpt2.get_input_embeddings().weight.shape[0] == 120

    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(qwen2_config(vocab_size=100)).eval()
    qwen.save_pretrained(tmp_path / "qwen")
    # a vocabulary larger than the data's (padded) is kept
    loaded = build_model(str(tmp_path / "qwen"), vocab_size=90).eval()
    x = torch.randint(0, 90, (1, 8))
    assert isinstance(loaded, Qwen2ForCausalLM) and loaded.config.vocab_size == 100
    assert torch.equal(loaded(x).logits, qwen(x).logits)


def test_activation_checkpointing_gives_the_same_gradients():
    import deepspeed

    torch.manual_seed(0)
    model = ZeroStackForCausalLM(tiny(num_hidden_layers=3)).train()
    x = torch.randint(0, 128, (2, 32))

    def grads():
        model.zero_grad()
        model(input_ids=x, labels=x).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = grads()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert all(block.gradient_checkpointing for block in model.layers)
    checkpointed = grads()
    model.gradient_checkpointing_disable()
    # DeepSpeed's (reentrant) checkpoint, switched on the way the trainer does when its config asks for it
    model._set_gradient_checkpointing(
        enable=True, gradient_checkpointing_func=deepspeed.checkpointing.checkpoint
    )
    deepspeed_checkpointed = grads()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], atol=1e-7, rtol=0)
        torch.testing.assert_close(deepspeed_checkpointed[name], plain[name], atol=1e-7, rtol=0)


def test_activation_checkpointing_holds_less_memory():
    """Bytes kept alive for backward at the end of the forward, counted through autograd's saved-tensor hooks
    (deterministic, unlike a process's RSS high-water mark). Inside a checkpointed block the checkpoint's own
    hooks take over and keep nothing but the block inputs, so the count must fall well below the plain one."""
    torch.manual_seed(0)
    model = ZeroStackForCausalLM(tiny(num_hidden_layers=6)).train()
    x = torch.randint(0, 128, (4, 256))

    def saved_bytes():
        storages = {}

        def pack(t):
            if t.device.type != "meta":
                storage = t.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        return sum(n for ptr, n in storages.items() if ptr not in params)

    plain = saved_bytes()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed = saved_bytes()
    assert plain > 3 * checkpointed, (checkpointed, plain)


@pytest.fixture(scope="module")
def one_rank_group():
    """A 1-process gloo group: what building a PipelineModule needs."""
    import deepspeed
    import torch.distributed as dist

    env = dict(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    deepspeed.init_distributed(dist_backend="gloo")
    yield
    dist.destroy_process_group()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_pipeline_layers_reassemble_into_the_model(one_rank_group, tied):
    from training.engines.pipeline_engine import (
        build_pipeline_module,  # the engine stacks our layers
    )

    config = tiny(tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = ZeroStackForCausalLM(config).eval()
    pipe = build_pipeline_module(config, num_stages=1, activation_checkpoint_interval=1).eval()

    model_sd, pipe_sd = model.state_dict(), pipe.state_dict()
    to_pipe = model_state_dict_to_pipeline(model_sd, config)
    assert set(to_pipe) == set(pipe_sd)
    assert all(to_pipe[k].shape == pipe_sd[k].shape for k in pipe_sd)
    assert ("tied_modules.embed.weight" in pipe_sd) == tied

    pipe.load_state_dict(to_pipe)
    back = pipeline_state_dict_to_model(pipe.state_dict())
    assert set(back) == set(model_sd)
    assert all(torch.equal(back[k], model_sd[k]) for k in model_sd)

    # Same loss and same gradients, with the pipeline's activation checkpointing on: blocks are recomputed,
    # the embedding (whose input, token ids, carries no gradient) is not, so it still gets its gradient.
    x = torch.randint(0, 128, (2, 16))
    y = torch.roll(x, -1, dims=1)
    pipe.train()
    pipe_loss = pipe.loss_fn(pipe(x), y)
    pipe_loss.backward()
    model_loss = model(x, labels=y, shift_labels=y).loss
    model_loss.backward()
    torch.testing.assert_close(pipe_loss, model_loss)
    pipe_grads = pipeline_state_dict_to_model({n: p.grad for n, p in pipe.named_parameters()})
    for name, param in model.named_parameters():
        torch.testing.assert_close(pipe_grads[name], param.grad, atol=1e-7, rtol=0)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])  # MHA, GQA, MQA
def test_explicit_attention_kernel_matches_sdpa(kv_heads):
    """The written-out kernel gives SDPA's logits and gradients (fp32), with padding masks and
    with a kv cache in generate; the bf16 loss agrees within bf16 rounding."""
    from models import set_attention_kernel

    torch.manual_seed(0)
    model = ZeroStackForCausalLM(tiny(num_key_value_heads=kv_heads)).train()
    x = torch.randint(0, 128, (2, 24))
    mask = torch.ones_like(x)
    mask[1, :5] = 0  # left padding: the explicit path gets SDPA's boolean mask

    def run(kernel, dtype=torch.float32):
        assert set_attention_kernel(model, kernel) == model.config.num_hidden_layers
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            out = model(input_ids=x, labels=x)
            padded = model(input_ids=x, attention_mask=mask).logits
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            gen = model.generate(
                x, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0
            )
        return out.logits, padded, grads, gen, out.loss

    sdpa, explicit = run("sdpa"), run("explicit")
    torch.testing.assert_close(explicit[0], sdpa[0], atol=1e-5, rtol=1e-5)
    keep = mask.bool()
    torch.testing.assert_close(explicit[1][keep], sdpa[1][keep], atol=1e-5, rtol=1e-5)
    for name in sdpa[2]:
        torch.testing.assert_close(explicit[2][name], sdpa[2][name], atol=1e-5, rtol=1e-4)
    assert torch.equal(explicit[3], sdpa[3])
    loss16 = {k: run(k, torch.bfloat16)[4].item() for k in ("sdpa", "explicit")}
    assert abs(loss16["sdpa"] - loss16["explicit"]) < 2e-2 * loss16["sdpa"], loss16
    with pytest.raises(ValueError, match="choose one of"):
        set_attention_kernel(model, "ring")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_reported_sdpa_kernel_is_the_one_that_runs(dtype):
    """The run names SDPA's kernel (the banner and resolved_config.json's `attention`): the name
    must be the kernel torch's profiler sees a training forward and backward run."""
    from models import sdpa_backend, set_attention_kernel

    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=64).to(dtype)
    set_attention_kernel(model, "sdpa")
    named = sdpa_backend(model.config, torch.device("cpu"), dtype, 32)
    assert named is not None
    ids = torch.randint(0, 64, (2, 32))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(input_ids=ids, labels=ids).loss.backward()
    ran = {e.key for e in prof.key_averages() if "scaled_dot_product" in e.key}
    assert any(named in key for key in ran), (named, ran)
