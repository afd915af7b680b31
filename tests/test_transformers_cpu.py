"""CPU: cufa as a transformers attention backend, end to end on real model code, with the
float64 reference standing in for the kernels (the same four entry points, the same
arguments): the mask registry entry, the routes (padding, packed rows, decode steps on
dynamic and static caches), each layer's arguments (window, softcap, sinks, scaling, GQA,
an odd head dim) and the errors. The GPU test (test_gpu_transformers.py) runs the same
scenarios on the kernels."""
import pytest

transformers = pytest.importorskip(
    "transformers", reason="Hugging Face transformers is not installed (pip install "
    "transformers): the integration's tests need it")
torch = pytest.importorskip("torch")

import _transformers_check as tc  # noqa: E402
import cufa.integrations.transformers as hf  # noqa: E402
from transformers import masking_utils  # noqa: E402

DT = torch.bfloat16


@pytest.fixture
def calls(monkeypatch):
    """The kernels' stand-in, registered; the entry points each call reached, in order."""
    hf.register()
    made = []
    monkeypatch.setattr(hf, "_kernels", tc.reference_kernels(made))
    return made


@pytest.mark.parametrize("family", list(tc.FAMILIES))
@pytest.mark.parametrize("batch_kind,route", [
    ("left", "flash_attn_varlen_func"), ("right", "flash_attn_varlen_func"),
    ("left_short", "flash_attn_with_kvcache"), ("none", "flash_attn_func"),
    ("packed", None)])
def test_prefill_matches_the_reference_model(calls, family, batch_kind, route):
    tc.check_prefill(family, DT, "cpu", batch_kind)
    if batch_kind == "packed":  # (gpt-oss builds no packed mask: its eager one neither)
        route = "flash_attn_func" if family == "gpt_oss" else "flash_attn_varlen_func"
    assert set(calls) == {route}


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss", "gemma3", "llama_hd20"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generation_decodes_on_the_cache_kernels(calls, family, cache):
    tc.check_generation(family, DT, "cpu", cache, new_tokens=12)
    layers = tc.tiny_config(family).num_hidden_layers
    assert calls[:layers] == ["flash_attn_varlen_func"] * layers  # the left-padded prompt
    assert set(calls[layers:]) == {"flash_attn_with_kvcache"}      # then every step
    assert len(calls) == 12 * layers


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_packed_rows_from_flash_attn_keyword_arguments(calls, family):
    tc.check_flattened_kwargs(family, DT, "cpu")
    assert set(calls) == {"flash_attn_varlen_func"}


def test_fp16_too(calls):
    tc.check_prefill("qwen2", torch.float16, "cpu", "left")
    tc.check_generation("mistral", torch.float16, "cpu", "dynamic", new_tokens=6)


# -- the rule catches what a wrong argument does ------------------------------------------

def _mutated(change):
    """The stand-in with change(kwargs) applied to every flash-attn-style call."""
    return tc.wrapped(tc.reference_kernels(), lambda name, kwargs: (
        name != "scaled_dot_product_attention" and change(kwargs)))


@pytest.mark.parametrize("family,change", [
    ("mistral", lambda kw: kw.update(window_size=(-1, -1))),
    ("mistral", lambda kw: kw.update(window_size=(kw["window_size"][0] + 1, -1))),
    ("gemma2", lambda kw: kw.update(softcap=0.0)),
    ("gemma2", lambda kw: kw.update(softmax_scale=None)),
    ("gpt_oss", lambda kw: kw.update(learnable_sink=None)),
], ids=["no window", "window one key wider", "no softcap", "default scale", "no sink"])
@pytest.mark.parametrize("scenario", ["prefill", "generation"])
def test_a_wrong_argument_fails_the_rule(monkeypatch, family, change, scenario):
    hf.register()
    monkeypatch.setattr(hf, "_kernels", _mutated(change))
    with pytest.raises(AssertionError, match="over the bound"):
        if scenario == "prefill":
            tc.check_prefill(family, DT, "cpu", "left")
        else:
            tc.check_generation(family, DT, "cpu", "dynamic", new_tokens=12)


# -- the mask registry entry -----------------------------------------------------------------

def test_describe_reads_transformers_mask_functions():
    mu = masking_utils
    assert hf.describe(mu.causal_mask_function) == ((-1, 0), None)
    assert hf.describe(mu.bidirectional_mask_function) == ((-1, -1), None)
    assert hf.describe(mu.sliding_window_causal_mask_function(24)) == ((23, 0), None)
    assert hf.describe(mu.sliding_window_bidirectional_mask_function(5)) == ((5, 5), None)
    ids = torch.tensor([[0, 0, 1, 1, 1]])
    window, packed = hf.describe(mu.and_masks(mu.causal_mask_function,
                                              mu.packed_sequence_mask_function(ids)))
    assert window == (-1, 0) and packed is ids
    positions = torch.tensor([[0, 1, 0, 1, 2]])
    if hasattr(mu, "remap_positions_for_packed_sequence"):  # (transformers 5.2x)
        remapped = mu.remap_positions_for_packed_sequence(
            mu.sliding_window_causal_mask_function(3), positions)
        assert hf.describe(mu.and_masks(remapped, mu.packed_sequence_mask_function(ids))) == (
            (2, 0), ids)
        assert hf.describe(remapped) is None  # (positions remapped, not told where sequences are)
    # what cufa's arguments cannot state: an overlay of the model's own, a union
    custom = lambda b, h, q, kv: kv % 2 == 0  # noqa: E731
    assert hf.describe(mu.and_masks(mu.causal_mask_function, custom)) is None
    assert hf.describe(mu.or_masks(mu.causal_mask_function, custom)) is None
    assert hf.describe(mu.chunked_causal_mask_function(8, torch.zeros(1))) is None


def _mask_args(**kw):
    args = dict(batch_size=2, q_length=5, kv_length=5, q_offset=0, kv_offset=0,
                mask_function=masking_utils.causal_mask_function, attention_mask=None)
    args.update(kw)
    return args


def test_mask_plans_padding_once():
    left = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    plan = hf.mask(**_mask_args(attention_mask=left))
    assert plan.padding == "run" and plan.leftpad.tolist() == [0, 2]
    assert plan.key_lens.tolist() == [5, 5] and plan.window == (-1, 0)
    holes = torch.tensor([[1, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    plan = hf.mask(**_mask_args(attention_mask=holes))
    assert plan.padding == "gather"
    assert plan.gather.cu_k.tolist() == [0, 4, 9] and plan.gather.max_k == 5
    assert plan.gather.k_rows[1].tolist() == [0, 2, 3, 4, 0, 1, 2, 3, 4]
    assert hf.mask(**_mask_args(attention_mask=torch.ones(2, 5))).padding is None
    # a decode step of a static cache: 3 of 8 key columns hold tokens
    plan = hf.mask(**_mask_args(q_length=1, kv_length=8, q_offset=2,
                                attention_mask=torch.tensor([[1, 1, 1], [0, 1, 1]])))
    assert plan.num_keys == 3 and plan.padding == "run" and plan.gather is None


def test_a_plan_moves_to_the_device_of_a_layer():
    """A model split over GPUs makes its mask once, on the first layer's device: a layer on
    another device reads a copy there (made once), with every index tensor moved; `meta`
    stands in for the second GPU."""
    holes = torch.tensor([[1, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    plan = hf.mask(**_mask_args(attention_mask=holes))
    meta = torch.device("meta")
    there = plan.on(meta)
    assert there is not plan and plan.on(meta) is there and plan.to("meta") is there
    assert plan.on(torch.device("cpu")) is plan and plan.to(torch.bfloat16) is plan
    g = there.gather
    for x in (*g.q_rows, *g.k_rows, g.cu_q, g.cu_k):
        assert x.device == meta
    assert (g.max_q, g.max_k) == (plan.gather.max_q, plan.gather.max_k)
    assert plan.gather.cu_k.device.type == "cpu" and there.window == plan.window
    left = torch.tensor([[1, 1, 1], [0, 1, 1]])  # a decode step's lengths and left padding
    step = hf.mask(**_mask_args(q_length=1, kv_length=8, q_offset=2, attention_mask=left))
    assert {step.on(meta).key_lens.device, step.on(meta).leftpad.device} == {meta}
    packed = hf.KeyPlan(window=(-1, 0), num_keys=6, q_length=6, batch=1, columns=6,
                        packed=(torch.tensor([0, 2, 6], dtype=torch.int32), 4))
    assert packed.on(meta).packed[0].device == meta and packed.on(meta).packed[1] == 4
    assert packed.to(torch.empty(0, device="meta")) is packed.on(meta)
    assert packed.to(device=meta, dtype=torch.bool) is packed.on(meta)
    # a collator's cu_seq_lens go to the layer's device too
    found = hf._cu_seq_lens(dict(cu_seq_lens_q=torch.tensor([0, 3]), cu_seq_lens_k=torch.tensor(
        [0, 3]), max_length_q=3, max_length_k=3), meta)
    assert found[0].device == meta and found[1].device == meta and found[0].dtype == torch.int32


def test_mask_falls_back_to_a_4d_mask():
    custom = lambda b, h, q, kv: kv % 2 == 0  # noqa: E731
    m = hf.mask(**_mask_args(mask_function=masking_utils.and_masks(
        masking_utils.causal_mask_function, custom)))
    assert m.dtype == torch.bool and m.shape == (2, 1, 5, 5)
    assert m[0, 0].tolist()[4] == [True, False, True, False, True]
    # a padding mask that does not line up with the keys (prefix tuning) also goes 4-D
    m = hf.mask(**_mask_args(attention_mask=torch.ones(2, 7, dtype=torch.bool), kv_length=7))
    assert isinstance(m, torch.Tensor) and m.shape == (2, 1, 5, 7)


@pytest.mark.parametrize("encoder_mask", ["none", "right", "left", "holes"])
@pytest.mark.parametrize("q_length", [5, 23])
def test_cross_attention_sees_every_encoder_key(calls, encoder_mask, q_length):
    """Keys that are not the queries' own (an encoder's): every real key, whatever the
    lengths, through the plan the mask entry makes (as create_bidirectional_mask asks)."""
    import types
    import numpy as np
    from cufa import reference
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, q_length, 16, generator=g).to(DT)
    k, v = (torch.randn(2, 2, 20, 16, generator=g).to(DT) for _ in range(2))
    keep = torch.ones(2, 20, dtype=torch.bool)
    if encoder_mask == "right":
        keep[1, 13:] = False
    elif encoder_mask == "left":
        keep[1, :6] = False
    elif encoder_mask == "holes":
        keep[0, 3:9] = False
    plan = hf.mask(**_mask_args(q_length=q_length, kv_length=20,
                                mask_function=masking_utils.bidirectional_mask_function,
                                attention_mask=None if encoder_mask == "none" else keep))
    assert isinstance(plan, hf.KeyPlan) and plan.num_keys == 20
    module = types.SimpleNamespace(training=False, is_causal=False, modules=lambda: [])
    out, _ = hf.attention(module, q, k, v, plan)
    for b in range(2):
        tr = (lambda x: x[b:b + 1].transpose(1, 2).double().numpy())
        ref, _ = reference.attention(tr(q), tr(k)[:, keep[b].numpy()],
                                     tr(v)[:, keep[b].numpy()])
        np.testing.assert_allclose(out[b:b + 1].double().numpy(), ref, atol=2e-2, rtol=0)
    assert "scaled_dot_product_attention" not in calls


def test_encoder_decoder_model(calls):
    tc.check_encoder_decoder(DT, "cpu", encoder_padding=True)
    assert "scaled_dot_product_attention" not in calls
    calls.clear()
    tc.check_encoder_decoder(DT, "cpu", encoder_padding=False)
    assert "scaled_dot_product_attention" not in calls


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_chunked_prefill_on_a_cache(calls, family):
    tc.check_chunked_prefill(family, DT, "cpu")
    assert set(calls) == {"flash_attn_varlen_func"}


def test_padding_inside_a_sequence(calls):
    tc.check_prefill("llama", DT, "cpu", "holes")    # causal: the gathered tokens
    assert set(calls) == {"flash_attn_varlen_func"}
    calls.clear()
    tc.check_prefill("mistral", DT, "cpu", "holes")  # a window counts columns: 4-D mask
    assert set(calls) == {"scaled_dot_product_attention"}
    with pytest.raises(NotImplementedError, match="softcap"):
        tc.check_prefill("gemma2", DT, "cpu", "holes")


def test_compiled_forward_without_padding(calls):
    """torch.compile of the whole model (dynamo alone here): a batch without a padding
    mask gets its plan inside the compiled forward, softcap and all."""
    torch._dynamo.reset()
    ref32, lowp, model = (tc.build("gemma2", impl, dt, "cpu") for impl, dt in (
        ("eager", torch.float32), ("eager", DT), ("cufa", DT)))
    ids, _ = tc.left_padded(2, 37, [0, 0])
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        out = [m(input_ids=ids).logits for m in (ref32, lowp, compiled)]
    tc.assert_logits_close(out[2], out[1], out[0], DT, torch.ones(2, 37, dtype=torch.bool),
                           "compiled gemma2")
    assert "scaled_dot_product_attention" not in calls


def test_a_2d_mask_handed_to_the_layer(calls):
    """A layer called with the padding mask itself (as flash-attn's path takes it) reads
    it as padding, causal."""
    import types
    import numpy as np
    from cufa import reference
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 4, 30, 16, generator=g).to(DT) for _ in range(3))
    keep = torch.ones(2, 30, dtype=torch.bool)
    keep[1, :11] = False
    module = types.SimpleNamespace(training=False, is_causal=True, modules=lambda: [])
    out, _ = hf.attention(module, q, k, v, keep)
    tr = (lambda x: x[1:, :, 11:].transpose(1, 2).double().numpy())
    ref, _ = reference.attention(tr(q), tr(k), tr(v), causal=True)
    np.testing.assert_allclose(out[1:, 11:].double().numpy(), ref, atol=2e-2, rtol=0)
    with pytest.raises(ValueError, match="2-D mask must be"):
        hf.attention(module, q, k, v, keep[:, :20])
    with pytest.raises(ValueError, match="4-D mask"):
        hf.attention(module, q, k, v, keep[None])


def test_scores_terms_cufa_cannot_add_are_refused_and_a_padding_mask_wins(calls):
    """A layer handed a term eager adds to the scores (T5's position_bias, per-token sink
    logits) is refused, never run without it; a 2-D padding mask wins over packed
    cu_seq_lens keywords, as in transformers' flash-attention path."""
    import types
    import numpy as np
    from cufa import reference
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 4, 30, 16, generator=g).to(DT) for _ in range(3))
    module = types.SimpleNamespace(training=False, is_causal=True, modules=lambda: [])
    keep = torch.ones(1, 30, dtype=torch.bool)
    for name in ("position_bias", "sinks"):
        with pytest.raises(NotImplementedError, match=f"`{name}`.*sdpa"):
            hf.attention(module, q, k, v, keep, **{name: torch.zeros(1, 4, 30, 30)})
    keep[0, 20:] = False
    cu = dict(cu_seq_lens_q=torch.tensor([0, 10, 20]), cu_seq_lens_k=torch.tensor([0, 10, 20]),
              max_length_q=10, max_length_k=10)
    out, _ = hf.attention(module, q, k, v, keep, **cu)
    tr = (lambda x: x[:, :, :20].transpose(1, 2).double().numpy())
    ref, _ = reference.attention(tr(q), tr(k), tr(v), causal=True)  # (one sequence of 20)
    np.testing.assert_allclose(out[:, :20].double().numpy(), ref, atol=2e-2, rtol=0)


def test_packed_rows_of_a_batch():
    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    cu, longest = hf._packed_rows(ids)
    assert cu.tolist() == [0, 2, 5, 6, 7, 12] and longest == 5


def test_a_4d_mask_from_the_caller_runs_on_sdpa(calls):
    ref32, lowp, model = (tc.build("llama", impl, dt, "cpu")
                          for impl, dt in (("sdpa", torch.float32), ("sdpa", DT), ("cufa", DT)))
    ids, _ = tc.left_padded(2, 17, [0, 0])
    keep = torch.rand(2, 1, 17, 17, generator=torch.Generator().manual_seed(5)) > 0.3
    keep |= torch.eye(17, dtype=torch.bool)  # every row sees a key
    with torch.no_grad():
        out = [m(input_ids=ids, attention_mask=keep).logits for m in (ref32, lowp, model)]
    assert set(calls) == {"scaled_dot_product_attention"}
    tc.assert_logits_close(out[2], out[1], out[0], DT, torch.ones(2, 17, dtype=torch.bool),
                           "a boolean 4-D mask")
    additive = torch.where(keep, 0.0, -1e4)
    with torch.no_grad():
        out = [m(input_ids=ids, attention_mask=additive.to(m.dtype)).logits
               for m in (ref32, lowp, model)]
    tc.assert_logits_close(out[2], out[1], out[0], DT, torch.ones(2, 17, dtype=torch.bool),
                           "an additive 4-D mask")


# -- registration and errors -----------------------------------------------------------------

def test_register_and_switch(calls):
    assert "cufa" in transformers.AttentionInterface._global_mapping
    assert "cufa" in masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    model = tc.build("llama", "sdpa", DT, "cpu")
    model.set_attn_implementation("cufa")
    assert model.config._attn_implementation == "cufa"
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]))
    assert calls == ["flash_attn_with_kvcache"] * 2  # (3 tokens: a decode-sized call)


def test_what_cufa_does_not_do_names_the_fallback(calls):
    model = tc.build("llama", "cufa", DT, "cpu")
    ids = torch.tensor([[5, 6, 7]])
    # autograd recording: a short sequence takes flash_attn_func (it has a backward)
    model(input_ids=ids)
    assert calls[-1] == "flash_attn_func"
    model(input_ids=ids, attention_mask=torch.tensor([[1, 1, 0]]))  # (right: gathered)
    assert calls[-1] == "flash_attn_varlen_func"
    with pytest.raises(NotImplementedError, match="training on padded sequences.*sdpa"):
        model(input_ids=ids, attention_mask=torch.tensor([[0, 1, 1]]))  # (left: a run)
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    model.train()
    with torch.no_grad(), pytest.raises(NotImplementedError, match="dropout.*sdpa"):
        model(input_ids=ids)
    model.eval()
    with torch.no_grad(), pytest.raises(NotImplementedError, match="eager"):
        model(input_ids=ids, output_attentions=True)
    # head dims over 256: inference on the forward and KV-cache kernels; not training (no
    # backward there) nor a 4-D mask (the SDPA-layout kernels stop at 256)
    wide = tc.build("llama", "cufa", torch.bfloat16, "cpu", head_dim=320)
    with torch.no_grad():
        wide(input_ids=ids)
    assert calls[-1] == "flash_attn_with_kvcache"
    with pytest.raises(NotImplementedError, match="head dim 320 over 256 while autograd.*sdpa"):
        wide.train()(input_ids=ids)
    wide.eval()
    with torch.no_grad(), pytest.raises(NotImplementedError, match="4-D attention mask.*sdpa"):
        wide(input_ids=ids, attention_mask=torch.ones(1, 1, 3, 3, dtype=torch.bool))
    fp32 = tc.build("llama", "cufa", torch.float32, "cpu")
    with torch.no_grad(), pytest.raises(TypeError, match="bfloat16.*sdpa"):
        fp32(input_ids=ids)
    gemma = tc.build("gemma2", "cufa", DT, "cpu")
    keep = torch.ones(1, 1, 3, 3, dtype=torch.bool).tril()
    with torch.no_grad(), pytest.raises(NotImplementedError, match="softcap"):
        gemma(input_ids=ids, attention_mask=keep)


def test_importing_without_transformers_says_what_is_missing(monkeypatch):
    import builtins
    import importlib
    import sys
    real_import = builtins.__import__

    def no_transformers(name, *args, **kwargs):
        if name == "transformers" or name.startswith("transformers."):
            raise ImportError("No module named 'transformers'")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_transformers)
    monkeypatch.delitem(sys.modules, "cufa.integrations.transformers")
    with pytest.raises(ImportError, match="pip install torch transformers"):
        importlib.import_module("cufa.integrations.transformers")


def test_deterministic_reaches_the_backward(monkeypatch):
    """As transformers asks its flash-attention kernels: the layer's `deterministic`
    keyword, else FLASH_ATTENTION_DETERMINISTIC=1; flash_attn_func and the varlen entry
    get it (where dq would otherwise be fused, the same bits every run)."""
    monkeypatch.delenv("FLASH_ATTENTION_DETERMINISTIC", raising=False)
    assert not hf._deterministic({}) and hf._deterministic({"deterministic": True})
    monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", "1")
    assert hf._deterministic({}) and not hf._deterministic({"deterministic": False})
