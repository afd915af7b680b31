"""GPU: cufa as a transformers attention backend on the kernels: tiny random-weight models
of seven families (GQA, MQA, sliding windows, softcap, sinks, local and global layers, a
head dim of 20) built in the test, their logits per position against the same weights on
sdpa/eager in float32, held to 2x the 16-bit sdpa/eager model's own error
(tests/_transformers_check.py); padded, packed and unpadded prefill, chunked prefill on a
cache, an encoder-decoder (cross-attention), 32 greedy tokens on the dynamic and the static
cache, eager and under torch.compile (what generate() does by itself with a static cache on
a GPU); and head dims over 256 at inference."""
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
transformers = pytest.importorskip(
    "transformers", reason="Hugging Face transformers is not installed (pip install "
    "transformers): the integration's tests need it")

import cufa  # noqa: E402
import _transformers_check as tc  # noqa: E402
import cufa.integrations.transformers as hf  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16]


@pytest.fixture
def calls(monkeypatch):
    hf.register()
    made = []
    monkeypatch.setattr(hf, "_kernels", tc.recording(cufa, made))
    return made


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", list(tc.FAMILIES))
@pytest.mark.parametrize("batch_kind", ["left", "right", "left_short", "none", "packed"])
def test_prefill(calls, family, batch_kind, dtype):
    tc.check_prefill(family, dtype, "cuda", batch_kind)
    assert calls and "scaled_dot_product_attention" not in calls


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_padding_inside_a_sequence(calls, family):
    tc.check_prefill(family, torch.bfloat16, "cuda", "holes")  # (mistral: the 4-D mask)


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gpt_oss"])
def test_chunked_prefill_on_a_cache(calls, family):
    tc.check_chunked_prefill(family, torch.bfloat16, "cuda")
    assert set(calls) == {"flash_attn_varlen_func"}


@pytest.mark.parametrize("encoder_padding", [True, False], ids=["padded", "unpadded"])
def test_encoder_decoder(calls, encoder_padding):
    tc.check_encoder_decoder(torch.bfloat16, "cuda", encoder_padding)
    assert "scaled_dot_product_attention" not in calls


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_packed_rows_from_flash_attn_keyword_arguments(calls, family):
    tc.check_flattened_kwargs(family, torch.bfloat16, "cuda")
    assert set(calls) == {"flash_attn_varlen_func"}


@pytest.mark.parametrize("batch_kind", ["left", "right", "none", "packed"])
def test_head_dim_over_256_prefill(calls, batch_kind):
    """Gemma 4's global layers' head dims: 384 here, local and global layers, MQA 4/1,
    inference (the forward and KV-cache kernels take up to 512)."""
    tc.check_prefill("gemma3", torch.bfloat16, "cuda", batch_kind, head_dim=384)
    assert calls and "scaled_dot_product_attention" not in calls


def test_head_dim_over_256_generation(calls):
    tc.check_generation("gemma3", torch.bfloat16, "cuda", "dynamic", new_tokens=16,
                        head_dim=384)
    assert "flash_attn_with_kvcache" in calls


@pytest.mark.parametrize("family", list(tc.FAMILIES))
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generation(calls, family, cache):
    tc.check_generation(family, torch.bfloat16, "cuda", cache, new_tokens=32)
    layers = tc.tiny_config(family).num_hidden_layers
    assert set(calls[layers:]) == {"flash_attn_with_kvcache"}


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss"])
def test_generation_compiled_on_the_static_cache(family):
    # (not through the recording stand-in: a list that grows a call is a guard dynamo
    # checks, and would recompile every step)
    from torch._dynamo.utils import counters
    hf.register()
    torch._dynamo.reset()
    counters.clear()
    tc.check_generation(family, torch.bfloat16, "cuda", "static", new_tokens=32,
                        compiled=True)
    # the steps reuse one compiled forward: a length read from the plan would recompile
    # every step, up to dynamo's limit of 8
    graphs = counters["stats"]["unique_graphs"]
    assert 0 < graphs < 8, f"{graphs} graphs compiled for 31 decode steps"


def test_a_4d_mask_from_the_caller(calls):
    ref32, lowp, model = (tc.build("llama", impl, dt, "cuda") for impl, dt in (
        ("sdpa", torch.float32), ("sdpa", torch.bfloat16), ("cufa", torch.bfloat16)))
    ids, _ = tc.left_padded(2, 67, [0, 0], device="cuda")
    keep = torch.rand(2, 1, 67, 67, generator=torch.Generator().manual_seed(5)) > 0.3
    keep = (keep | torch.eye(67, dtype=torch.bool)).cuda()
    with torch.no_grad():
        out = [m(input_ids=ids, attention_mask=keep).logits for m in (ref32, lowp, model)]
    assert set(calls) == {"scaled_dot_product_attention"}
    tc.assert_logits_close(out[2], out[1], out[0], torch.bfloat16,
                           torch.ones(2, 67, dtype=torch.bool), "a boolean 4-D mask")


def _grads(model, ids, mask):
    model.zero_grad(set_to_none=True)
    labels = ids.masked_fill(mask == 0, -100)
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    return {n: p.grad.detach().double() for n, p in model.named_parameters()
            if p.grad is not None}


@pytest.mark.parametrize("family", list(tc.FAMILIES))
@pytest.mark.parametrize("batch_kind", ["none", "right"])
def test_training_gradients(calls, family, batch_kind):
    """One backward of the language-model loss: every parameter's gradient, row by row
    (each row of a weight, each of a vector), within 2x the bf16 reference model's error
    of the float32 one plus 4 bf16 roundings of the row's largest value."""
    # gpt-oss routes each token to its top 2 of 4 experts: a rounding that reorders two
    # router logits moves a token to another expert, a gradient no bound holds (seen on the
    # H200 with other seeds, at 8x on the experts); all 4 experts keep the routing smooth.
    # Its attention's biases: test_training_gradients_with_biased_values.
    moe = dict(num_experts_per_tok=4, attention_bias=False) if family == "gpt_oss" else {}
    worst = _gradient_ratios(family, batch_kind, **moe)
    assert calls and "flash_attn_with_kvcache" not in calls
    over = {n: f"{r:.2f}x" for n, r in sorted(worst.items(), key=lambda x: -x[1]) if r > 1}
    assert not over, f"{family} {batch_kind}: gradients over their bound: {over}"


@pytest.mark.parametrize("batch_kind", ["none", "right"])
def test_training_gradients_with_biased_values(calls, batch_kind):
    """gpt-oss as configured (v_proj with a bias, a sink a head): the backward's D =
    rowsum(dout * out) reads the bf16 out, whose rounding of the values' common part (the
    bias) the sink leaves uncancelled in dS. FlashAttention's algorithm does the same: a
    PyTorch emulation of it gave the full layer's q/k gradients 1.1-3.6x the bound of the
    rule above on four seeds (D from the float32 out: 0.6-1.1x), cufa on the H200 1.2-5.3x
    on six; so here at most 8x. The forward's out carries the same common part, rounded
    (as FlashAttention's does), into o_proj's gradient: 1.17x on the H200, so at most 2x
    there, and every other gradient at the rule's 1x."""
    worst = _gradient_ratios("gpt_oss", batch_kind, num_experts_per_tok=4)
    assert calls and "flash_attn_with_kvcache" not in calls
    allowed = {"self_attn.q_proj": 8, "self_attn.k_proj": 8, "self_attn.o_proj": 2}
    over = {n: f"{r:.2f}x" for n, r in worst.items()
            if r > max([f for part, f in allowed.items() if part in n] or [1])}
    assert not over, f"gpt_oss {batch_kind}: gradients over their bound: {over}"


def _gradient_ratios(family, batch_kind, **overrides):
    """Each parameter's worst row: its error / (2x the bf16 reference model's + 4 bf16
    roundings of the row's largest value), both against the float32 model."""
    ref32, lowp, model = (tc.build(family, impl, dt, "cuda", **overrides) for impl, dt in (
        (tc.reference_attention(family), torch.float32),
        (tc.reference_attention(family), torch.bfloat16), ("cufa", torch.bfloat16)))
    pads = [0, 0] if batch_kind == "none" else [0, 9]
    ids, mask = tc.right_padded(2, 45, pads, device="cuda")
    g32, glp, got = (_grads(m, ids, mask) for m in (ref32, lowp, model))
    assert got.keys() == g32.keys()
    eps = float(torch.finfo(torch.bfloat16).eps)
    worst = {}
    for name, ref in g32.items():
        rows = (lambda x: x.reshape(x.shape[0], -1) if x.ndim > 1 else x.reshape(1, -1))
        err = (rows(got[name]) - rows(ref)).abs().amax(-1)
        err_lp = (rows(glp[name]) - rows(ref)).abs().amax(-1)
        bound = 2 * err_lp + 4 * eps * rows(ref).abs().amax(-1) + 1e-9
        worst[name] = float((err / bound).max())
    return worst
