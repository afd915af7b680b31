"""GPU: the learnable sink (gpt-oss's per-head logit in every row's softmax denominator) on
every path that normalizes a row -- the forward of both kernel families, packed and paged
batches (whose short sequences the decode kernel takes), the KV-cache decode split or not,
SDPA -- and in every framework mode, against the float64 reference (pass rule in
_attention_check.py; outputs poisoned before the call). Rows that see no key must give
exactly 0 and lse = the sink; split-KV must give the unsplit call's result within the
merge's float32 rounding."""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import cufa  # noqa: E402
from cufa import reference  # noqa: E402
from _attention_check import (  # noqa: E402
    assert_pass_rule, capture_cuda_graph, check_attention, check_kvcache, cu_seqlens, f64, i32,
    lowp_attention, make_sink, randn)
import test_gpu_kvcache  # noqa: E402

NAN = float("nan")
# (q's dtype, the sink's): each sink dtype with each input dtype at least once
DTYPE_PAIRS = [("float16", "float32"), ("bfloat16", "bfloat16"), ("float16", "float16"),
               ("bfloat16", "float32")]


@pytest.fixture(params=["default", "sm80"])
def family(request, monkeypatch):
    """The forward's kernel family: the device's own (Hopper's on an H100), and the
    portable mma.sync kernels (plans read CUFA_KERNEL_FAMILY when they are made)."""
    if request.param == "sm80":
        monkeypatch.setenv("CUFA_KERNEL_FAMILY", "sm80")
    cufa.api.clear_plans()
    yield request.param
    monkeypatch.undo()
    cufa.api.clear_plans()


def check_rows_without_keys(out, lse, sink, rows):
    """Rows that see no key: output exactly 0, lse exactly the sink (in float32). out (b,
    sq, h, d), lse (b, h, sq); rows: boolean (b, h, sq)."""
    if not rows.any():
        return
    o = f64(out).transpose(0, 2, 1, 3)[rows]
    assert (o == 0).all(), "rows without keys are not 0"
    expected = np.broadcast_to(f64(sink.float())[None, :, None], rows.shape)[rows]
    np.testing.assert_array_equal(f64(lse)[rows], expected.astype(np.float32))


# -- flash_attn_func -------------------------------------------------------------------------

MASKS = {
    "none": {},
    "causal": dict(causal=True),
    "window": dict(window_size=(37, 5)),
    "softcap alibi": dict(softcap=8.0, alibi_slopes=True),
}


# each head dim with two (dtype, sink dtype) pairs, each pair with two head dims
FORWARD_CASES = [(d, *DTYPE_PAIRS[(i + j) % 4]) for i, d in enumerate((40, 64, 128, 256))
                 for j in (0, 2)]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("d,dtype,sink_dtype", FORWARD_CASES,
                         ids=[f"d{d}-{a}-{b}" for d, a, b in FORWARD_CASES])
def test_forward(rng, family, dtype, sink_dtype, d, mask):
    """Padded batches, GQA 6/2, lengths that fill no tile; 131 queries over 70 keys
    (bottom-right: the first 61 rows of a causal call see no key), and 97 over 203."""
    kw = dict(MASKS[mask])
    for sq, sk in ((97, 203), (131, 70)):
        q = randn(rng, (2, sq, 6, d), dtype)
        k, v = (randn(rng, (2, sk, 2, d), dtype) for _ in range(2))
        if kw.get("alibi_slopes") is not None:
            kw["alibi_slopes"] = torch.from_numpy(rng.uniform(0, 1, 6).astype(np.float32)).cuda()
        sink = make_sink(rng, 6, sink_dtype)
        out = torch.full_like(q, NAN)
        res, lse = cufa.flash_attn_func(q, k, v, out=out, return_lse=True,
                                        learnable_sink=sink, **kw)
        assert res is out
        label = f"{family} {dtype} sink {sink_dtype} d={d} {sq}x{sk} {mask}"
        check_attention(out, lse, q, k, v, label=label, learnable_sink=sink, **kw)
        seen = reference.visible_keys(sq, sk, causal=kw.get("causal", False),
                                      window_size=kw.get("window_size", (-1, -1))).any(axis=1)
        check_rows_without_keys(out, lse, sink, np.broadcast_to(~seen, (2, 6, sq)))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_huge_sinks_and_scores_do_not_overflow(rng, family, dtype, causal):
    """Sinks of +-1e4 and +-60 beside scores of a few thousand: the finalize takes the
    larger of the row max and the sink, so no exponential overflows and a dominant sink
    leaves the output near 0 with lse = sink."""
    q = randn(rng, (1, 100, 5, 64), dtype, scale=40.0)
    k = randn(rng, (1, 150, 5, 64), dtype, scale=40.0)
    v = randn(rng, (1, 150, 5, 64), dtype)
    sink = torch.tensor([1e4, -1e4, 60.0, -60.0, 0.5], device="cuda")
    out = torch.full_like(q, NAN)
    _, lse = cufa.flash_attn_func(q, k, v, out=out, causal=causal, return_lse=True,
                                  learnable_sink=sink)
    assert torch.isfinite(lse).all() and torch.isfinite(out).all()
    scores = f64(lse[0, 2:]).max()
    assert scores > 1e3 and 1e4 - 5e-3 <= f64(lse[0, 0]).min() <= f64(lse[0, 0]).max() <= 1e4 + 5e-3
    check_attention(out, lse, q, k, v, causal=causal, learnable_sink=sink,
                    label=f"{family} {dtype} causal={causal}")


def test_a_sink_of_minus_infinity_is_no_sink(rng, family):
    q = randn(rng, (2, 77, 4, 128), "bfloat16")
    k, v = (randn(rng, (2, 90, 4, 128), "bfloat16") for _ in range(2))
    none = torch.full((4,), -float("inf"), device="cuda")
    o, lse = cufa.flash_attn_func(q, k, v, causal=True, return_lse=True, learnable_sink=none)
    check_attention(o, lse, q, k, v, causal=True, label="sink -inf: the plain attention")
    o_plain, lse_plain = cufa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert torch.equal(o.view(torch.int16), o_plain.view(torch.int16))  # and its very bits
    assert torch.equal(lse, lse_plain)


def check_merged(out, lse, q, k, v, sink, label):
    """A merge of parts against the whole attention with its sink: the pass rule, row by
    row, with the roundings the parts add (each part's output rounded to the dtype, then
    the merged one: three roundings of the row's largest value), and lse within 2e-4."""
    sink64 = f64(sink)
    o_ref, lse_ref = reference.attention(f64(q), f64(k), f64(v), learnable_sink=sink64)
    o_lp, _ = lowp_attention(q, k, v, learnable_sink=sink64)
    assert_pass_rule(out, None, (o_ref, None), (o_lp, None), q.dtype, label, roundings=3)
    lerr = np.abs(f64(lse) - lse_ref).max()
    assert lerr <= 2e-4, f"{label}: lse max err {lerr:.3e}"


def test_merging_parts_of_a_sink_attention(rng):
    """docs/api.md: the parts of a sink attention merge (merge_attention_states) when the
    sink goes to exactly one part, or when sink-free parts are merged and the sink added
    once: both give the whole attention with its sink."""
    q = randn(rng, (2, 50, 4, 64), "float16")
    k, v = (randn(rng, (2, 300, 4, 64), "float16") for _ in range(2))
    sink = make_sink(rng, 4)
    o_a, lse_a = cufa.flash_attn_func(q, k[:, :120], v[:, :120], return_lse=True,
                                      learnable_sink=sink)
    o_b, lse_b = cufa.flash_attn_func(q, k[:, 120:], v[:, 120:], return_lse=True)
    out, lse = cufa.merge_attention_states(o_a, lse_a, o_b, lse_b)
    check_merged(out, lse, q, k, v, sink, "sink in one part")
    o_a, lse_a = cufa.flash_attn_func(q, k[:, :120], v[:, :120], return_lse=True)
    merged, merged_lse = cufa.merge_attention_states(o_a, lse_a, o_b, lse_b)
    lse = torch.logaddexp(merged_lse, sink[None, :, None])
    out = (merged * torch.exp(merged_lse - lse).transpose(1, 2)[..., None]).to(q.dtype)
    check_merged(out, lse, q, k, v, sink, "sink added after the merge")


def test_sdpa(rng, family):
    """SDPA's conventions (top-left causal, a boolean mask with a row that lets no key in):
    the sink as in flash_attn_func."""
    b, h, hk, L, S, d = 2, 8, 2, 70, 130, 64
    query = randn(rng, (b, L, h, d), "float16").transpose(1, 2)
    key, value = (randn(rng, (b, S, hk, d), "float16").transpose(1, 2) for _ in range(2))
    mask = torch.from_numpy(rng.random((b, 1, L, S)) > 0.3).cuda()
    mask[:, :, 3] = False
    sink = make_sink(rng, h, "bfloat16")
    for attn_mask, causal in ((None, True), (mask, False)):
        out = cufa.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                                is_causal=causal, enable_gqa=True,
                                                learnable_sink=sink)
        kw = dict(causal=causal, diag_offset=0, learnable_sink=sink)
        if attn_mask is not None:
            kw["attn_mask"] = attn_mask
        check_attention(out.transpose(1, 2), None, query.transpose(1, 2), key.transpose(1, 2),
                        value.transpose(1, 2), label=f"sdpa causal={causal}", **kw)
    assert (out[:, :, 3] == 0).all()


# -- flash_attn_varlen_func ------------------------------------------------------------------

def check_sequences(out, lse, q, keys, values, lens_q, sink, label, **kw):
    """A packed call's out (total, h, d) and lse (h, total): sequence b's rows against the
    reference over keys[b], values[b] ((1, n, hk, d) each); a sequence without keys gives
    0 and lse = sink."""
    starts = np.concatenate([[0], np.cumsum(lens_q)])
    for b, (kb, vb) in enumerate(zip(keys, values)):
        s, e = starts[b], starts[b + 1]
        if e == s:
            continue
        o_b, lse_b = out[s:e][None], lse[:, s:e][None]
        check_attention(o_b, lse_b, q[s:e][None], kb, vb, learnable_sink=sink,
                        label=f"{label}: seq {b} ({e - s} x {kb.shape[1]})", **kw)
        if kb.shape[1] == 0:
            check_rows_without_keys(o_b, lse_b, sink, np.ones(lse_b.shape, bool))


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype,sink_dtype", DTYPE_PAIRS, ids="-".join)
def test_varlen(rng, family, dtype, sink_dtype, d):
    """Packed batches with empty sequences, sequences without keys and causal rows before
    their first key (more queries than keys), GQA, window and softcap."""
    lens_q = [0, 1, 65, 7, 200, 33, 129, 0, 300]
    lens_k = [5, 0, 65, 0, 77, 160, 129, 0, 513]
    h, hk = 8, 2
    q = randn(rng, (1, sum(lens_q), h, d), dtype)[0]
    k, v = (randn(rng, (1, sum(lens_k), hk, d), dtype)[0] for _ in range(2))
    starts = np.concatenate([[0], np.cumsum(lens_k)])
    keys = [k[None, starts[b]:starts[b + 1]] for b in range(len(lens_k))]
    values = [v[None, starts[b]:starts[b + 1]] for b in range(len(lens_k))]
    for kw in (dict(causal=True), dict(window_size=(50, 10), softcap=6.0)):
        sink = make_sink(rng, h, sink_dtype)
        out = torch.full_like(q, NAN)
        res, lse = cufa.flash_attn_varlen_func(
            q, k, v, cu_seqlens(lens_q), cu_seqlens(lens_k), max(lens_q), max(lens_k),
            out=out, return_lse=True, learnable_sink=sink, **kw)
        assert res is out
        check_sequences(out, lse, q, keys, values, lens_q, sink,
                        f"{family} {dtype} sink {sink_dtype} d={d} {sorted(kw)}", **kw)


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("heads", [(8, 2), (16, 1), (4, 4)], ids=["GQA", "MQA", "MHA"])
def test_paged_varlen_both_kernels_add_the_sink(rng, family, heads, page_size):
    """A serving batch over a paged cache: sequences of up to 16 / group query rows take
    the decode kernel (split where few, long), the rest the forward (pages of 4: the
    portable kernels; of 16 on Hopper: TMA boxes); every sequence, whichever kernel took it,
    against the reference, sequences without keys too."""
    h, hk = heads
    lens_q = [1, 2, 0, 3, 40, 1, 130, 4]
    lens_k = [700, 2, 9, 0, 300, 0, 130, 1500]
    batch, d, dtype = len(lens_q), 128, "bfloat16"
    capacity = -(-max(lens_k) // page_size) * page_size
    k_cache, v_cache = (randn(rng, (batch, capacity, hk, d), dtype) for _ in range(2))
    table, num_pages = reference.paged_layout(batch, capacity, page_size, rng)
    k_pages, v_pages = (reference.to_paged(c, table, num_pages, fill=NAN)
                        for c in (k_cache, v_cache))
    q = randn(rng, (1, sum(lens_q), h, d), dtype)[0]
    sink = make_sink(rng, h, "float32")
    out = torch.full_like(q, NAN)
    _, lse = cufa.flash_attn_varlen_func(
        q, k_pages, v_pages, cu_seqlens(lens_q), cu_seqlens(lens_k), max(lens_q),
        max(lens_k), causal=True, out=out, return_lse=True, block_table=i32(table),
        learnable_sink=sink)
    keys = [k_cache[b:b + 1, :n] for b, n in enumerate(lens_k)]
    values = [v_cache[b:b + 1, :n] for b, n in enumerate(lens_k)]
    check_sequences(out, lse, q, keys, values, lens_q, sink,
                    f"{family} paged {h}/{hk} pages of {page_size}", causal=True)


# -- flash_attn_with_kvcache -----------------------------------------------------------------

DECODE_CASES = {
    # name: (head dim, heads, seqlen_q, page size or None, options)
    "d64 GQA": (64, (32, 8), 1, None, {}),
    "d64 paged causal spec": (64, (8, 2), 4, 16, dict(causal=True)),
    "d128 MQA window softcap": (128, (16, 1), 3, None, dict(causal=True, window_size=(300, 0),
                                                            softcap=20.0)),
    "d128 paged pages of 1": (128, (8, 8), 1, 1, {}),
    "d256 GQA alibi": (256, (8, 2), 2, 64, dict(alibi_slopes=True)),
    "d72": (72, (4, 2), 1, None, dict(causal=True)),
}


def decode_inputs(rng, d, heads, seqlen_q, page_size, dtype, lens):
    """q and a cache (contiguous, or paged with NaN in every page of no sequence), with the
    keyword arguments of the call: (kw, k_cache, v_cache) -- the caches contiguous, for the
    reference."""
    h, hk = heads
    batch, capacity = len(lens), 2048
    q = randn(rng, (batch, seqlen_q, h, d), dtype)
    k_cache, v_cache = (randn(rng, (batch, capacity, hk, d), dtype) for _ in range(2))
    kw = dict(q=q, cache_seqlens=i32(lens))
    if page_size:
        table, num_pages = reference.paged_layout(batch, capacity, page_size, rng)
        kw["k_cache"], kw["v_cache"] = (reference.to_paged(c, table, num_pages, fill=NAN)
                                        for c in (k_cache, v_cache))
        kw["block_table"] = i32(table)
    else:
        kw["k_cache"], kw["v_cache"] = k_cache, v_cache
    return kw


@pytest.fixture(params=["cp.async", "tma"])
def decode_kernel(request, monkeypatch):
    """The decode kernel: per-thread copies, or forced to the TMA one wherever it can run
    (contiguous d = 64 on Hopper; elsewhere the same as cp.async)."""
    from cufa import _compile, _runtime
    monkeypatch.setitem(_compile._overrides, _compile.DECODE_TMA_ENV,
                        "1" if request.param == "tma" else "0")
    _runtime.plans.clear()
    yield request.param
    monkeypatch.undo()
    _runtime.plans.clear()


@pytest.mark.parametrize("name", DECODE_CASES)
@pytest.mark.parametrize("dtype,sink_dtype", DTYPE_PAIRS[:3], ids="-".join)
def test_decode_splits_add_the_sink_once(rng, decode_kernel, dtype, sink_dtype, name):
    """num_splits 1, 2, 3 and 0 (the planner's): each against the reference (a cache of 0
    keys among them: out 0, lse = sink), and each split call the unsplit one's result
    within one rounding of the output at the row's scale, lse within float32 rounding (the
    sink enters once, in the merge). Both decode
    kernels (the TMA one where it runs: contiguous d = 64 on Hopper)."""
    d, heads, seqlen_q, page_size, options = DECODE_CASES[name]
    lens = [1500, 0, 37, 2048 - seqlen_q, 700]
    kw = decode_inputs(rng, d, heads, seqlen_q, page_size, dtype, lens)
    kw.update(options)
    if options.get("alibi_slopes"):
        kw["alibi_slopes"] = torch.from_numpy(rng.uniform(0, 1, heads[0]).astype(np.float32)).cuda()
    kw["learnable_sink"] = make_sink(rng, heads[0], sink_dtype)
    results = {}
    for splits in (1, 2, 3, 0):
        out = torch.full_like(kw["q"], NAN)
        res, lse = cufa.flash_attn_with_kvcache(**kw, num_splits=splits, out=out,
                                                return_softmax_lse=True)
        assert res is out
        label = f"{name} {dtype} sink {sink_dtype} {decode_kernel} splits={splits}"
        check_kvcache(out, lse, label=label, **kw)
        check_rows_without_keys(out[1:2], lse[1:2], kw["learnable_sink"],
                                np.ones((1,) + tuple(lse.shape[1:]), bool))
        results[splits] = (out, lse)
    # Bits differ: each part rounds its probabilities to 16 bits against its own max. So a
    # split call is held to one rounding of the output at its row's scale.
    one, one_lse = (f64(x) for x in results[1])
    eps = float(torch.finfo(kw["q"].dtype).eps)
    row_scale = np.abs(one).max(axis=-1, keepdims=True)
    for splits in (2, 3, 0):
        out, lse = (f64(x) for x in results[splits])
        err = np.abs(out - one)
        bound = eps * row_scale + 4e-6 * np.abs(one).max()
        assert (err <= bound).all(), (
            f"{name} splits={splits}: out differs from unsplit by {(err / bound).max():.2f} x "
            f"one rounding at the row's scale (max err {err.max():.3e})")
        np.testing.assert_allclose(lse, one_lse, rtol=1e-5, atol=1e-5,
                                   err_msg=f"{name} splits={splits}: lse")


def test_decode_with_append_and_huge_sinks(rng):
    """An append (the new keys attended at once) beside sinks that take all of a row's
    mass or none, split and not."""
    kw = decode_inputs(rng, 128, (8, 2), 2, 16, "float16", [100, 0, 1000])
    kw["k"], kw["v"] = (randn(rng, (3, 2, 2, 128), "float16") for _ in range(2))
    kw["learnable_sink"] = make_sink(rng, 8, "float16", kind="huge")
    for splits in (1, 4):
        before = {n: kw[n].clone() for n in ("k_cache", "v_cache")}
        out, lse = cufa.flash_attn_with_kvcache(**kw, causal=True, num_splits=splits,
                                                return_softmax_lse=True)
        assert torch.isfinite(lse).all() and torch.isfinite(out).all()
        check_kvcache(out, lse, label=f"append splits={splits}", causal=True,
                      **{**kw, **before})
        kw["cache_seqlens"] = kw["cache_seqlens"] + 2  # (the next call appends after these)


# -- the frameworks' compiled modes, and grad ------------------------------------------------

def test_cuda_graph_replays_read_the_sink_afresh(rng):
    """A captured call reads the sink's memory at each replay: new values in place take
    effect (dense, and a split decode, which the graph merges in decode_combine)."""
    q = randn(rng, (2, 100, 4, 64), "float16")
    k, v = (randn(rng, (2, 120, 4, 64), "float16") for _ in range(2))
    kw = decode_inputs(rng, 64, (8, 2), 1, 16, "bfloat16", [900, 3])
    sink, sink_d = make_sink(rng, 4), make_sink(rng, 8, "bfloat16")
    graph, ((out, lse), (out_d, lse_d)) = capture_cuda_graph(lambda: (
        cufa.flash_attn_func(q, k, v, causal=True, return_lse=True, learnable_sink=sink),
        cufa.flash_attn_with_kvcache(**kw, num_splits=3, return_softmax_lse=True,
                                     learnable_sink=sink_d)))
    for step in range(3):
        sink.copy_(make_sink(rng, 4))
        sink_d.copy_(make_sink(rng, 8, "bfloat16"))
        q.copy_(randn(rng, tuple(q.shape), "float16"))
        for x in (out, lse, out_d, lse_d):
            x.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        check_attention(out, lse, q, k, v, causal=True, learnable_sink=sink,
                        label=f"replay {step}")
        check_kvcache(out_d, lse_d, label=f"decode replay {step}", learnable_sink=sink_d, **kw)


def test_torch_compile(rng):
    """torch.compile with the sink a module parameter under inference_mode: dense, packed
    and decode ops in one compiled function."""
    import torch._dynamo
    torch._dynamo.reset()
    h, d = 8, 64
    sink = torch.nn.Parameter(make_sink(rng, h))

    @torch.compile(fullgraph=True, dynamic=True)
    def block(q, k, cu, q1, cache, lens):
        o = cufa.flash_attn_func(q, k, k, causal=True, learnable_sink=sink)
        ov, lse = cufa.flash_attn_varlen_func(q[0], k[0], k[0], cu, cu, 256, 256,
                                              learnable_sink=sink, return_lse=True)
        od = cufa.flash_attn_with_kvcache(q1, cache, cache, cache_seqlens=lens,
                                          learnable_sink=sink)
        return o * 1, ov, lse, od
    lens_q = [100, 0, 156]
    q = randn(rng, (1, 256, h, d), "float16")
    k = randn(rng, (1, 256, 2, d), "float16")
    q1, cache = randn(rng, (2, 1, h, d), "float16"), randn(rng, (2, 500, 2, d), "float16")
    with torch.inference_mode():
        o, ov, lse, od = block(q, k, cu_seqlens(lens_q), q1, cache, i32([500, 77]))
        torch.cuda.synchronize()
    check_attention(o, None, q, k, k, causal=True, learnable_sink=sink, label="compiled dense")
    starts = np.concatenate([[0], np.cumsum(lens_q)])
    check_sequences(ov, lse, q[0], [k[:, s:e] for s, e in zip(starts, starts[1:])],
                    [k[:, s:e] for s, e in zip(starts, starts[1:])], lens_q, sink.detach(),
                    "compiled varlen")
    check_kvcache(od, None, q1, cache, cache, cache_seqlens=i32([500, 77]),
                  learnable_sink=sink.detach(), label="compiled decode")


def test_a_sink_that_requires_grad(rng):
    """A sink parameter gets its gradient where autograd records (against the float64
    reference's); under no_grad it is read as it is (the bits of its detached copy's call)."""
    q = randn(rng, (1, 64, 4, 64), "float16")
    sink = torch.nn.Parameter(make_sink(rng, 4))
    dout = randn(rng, (1, 64, 4, 64), "float16")
    out = cufa.flash_attn_func(q, q, q, learnable_sink=sink)
    out.backward(dout)
    ref = reference.attention_backward(*(f64(x) for x in (q, q, q, dout)),
                                       learnable_sink=f64(sink))
    np.testing.assert_allclose(f64(sink.grad), ref.dsink, rtol=2e-2,
                               atol=1e-3 * np.abs(ref.dsink).max())
    with torch.no_grad():
        out = cufa.flash_attn_func(q, q, q, learnable_sink=sink)
    check_attention(out, None, q, q, q, learnable_sink=sink.detach(), label="under no_grad")
    assert torch.equal(out, cufa.flash_attn_func(q, q, q, learnable_sink=sink.detach()))


@pytest.fixture(scope="module")
def jax():
    jax = pytest.importorskip("jax")
    from cufa import _jax
    if not _jax.available():
        pytest.skip("this JAX has no buffer_callback")
    if not any(dev.platform == "gpu" for dev in jax.devices()):
        pytest.skip("JAX sees no GPU")
    return jax


def _t(x):
    return torch.from_dlpack(x.block_until_ready())


def test_jax_jit_and_eager(jax, rng):
    """jax.jit (the sink one more buffer of the callback) and eager JAX arrays: dense,
    packed, a split decode and SDPA against the reference, and jit's bits equal to eager's."""
    import jax.numpy as jnp

    def arr(shape, dtype=jnp.float16):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32), dtype)
    q, k = arr((2, 90, 8, 64)), arr((2, 110, 2, 64))
    sink = jnp.asarray(2 * rng.standard_normal(8), jnp.float32)

    def step(q, k, sink, cu, q1, cache, lens):
        o, lse = cufa.flash_attn_func(q, k, k, causal=True, return_lse=True, learnable_sink=sink)
        ov, lse_v = cufa.flash_attn_varlen_func(q[0], k[0], k[0], cu, cu, 90, 90,
                                                return_lse=True, learnable_sink=sink)
        od, lse_d = cufa.flash_attn_with_kvcache(q1, cache, cache, cache_seqlens=lens,
                                                 num_splits=3, return_softmax_lse=True,
                                                 learnable_sink=sink)
        os_ = cufa.scaled_dot_product_attention(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3),
                                                k.transpose(0, 2, 1, 3), enable_gqa=True,
                                                learnable_sink=sink)
        return o, lse, ov, lse_v, od, lse_d, os_
    lens_q = [40, 0, 50]
    args = (q, k, sink, jnp.asarray(np.concatenate([[0], np.cumsum(lens_q)]), jnp.int32),
            arr((2, 1, 8, 64)), arr((2, 700, 2, 64)), jnp.asarray([700, 0], jnp.int32))
    jitted = jax.jit(step)(*args)
    eager = step(*args)
    for a, b in zip(jitted, eager):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    o, lse, ov, lse_v, od, lse_d, os_ = (_t(x) for x in jitted)
    tq, tk, tsink = _t(q), _t(k), _t(sink)
    check_attention(o, lse, tq, tk, tk, causal=True, learnable_sink=tsink, label="jit dense")
    starts = np.concatenate([[0], np.cumsum(lens_q)])
    check_sequences(ov, lse_v, tq[0], [tk[:1, s:e] for s, e in zip(starts, starts[1:])],
                    [tk[:1, s:e] for s, e in zip(starts, starts[1:])], lens_q, tsink,
                    "jit varlen")
    q1, cache = _t(args[4]), _t(args[5])
    check_kvcache(od, lse_d, q1, cache, cache, cache_seqlens=i32([700, 0]),
                  learnable_sink=tsink, label="jit split decode")
    check_attention(os_.transpose(1, 2), None, tq, tk, tk, diag_offset=0, learnable_sink=tsink,
                    label="jit sdpa")


def test_cupy_arrays(rng):
    """CuPy arrays, the sink a CuPy float16 array: dense and a split decode."""
    cupy = pytest.importorskip("cupy")
    q = cupy.asarray(rng.standard_normal((2, 80, 4, 64)), dtype=cupy.float16)
    cache = cupy.asarray(rng.standard_normal((2, 600, 4, 64)), dtype=cupy.float16)
    sink = cupy.asarray(2 * rng.standard_normal(4), dtype=cupy.float16)
    lens = cupy.asarray([600, 5], dtype=cupy.int32)
    out, lse = cufa.flash_attn_func(q, cache[:, :90], cache[:, :90], return_lse=True,
                                    learnable_sink=sink)
    out_d, lse_d = cufa.flash_attn_with_kvcache(q[:, :1], cache, cache, cache_seqlens=lens,
                                                num_splits=2, return_softmax_lse=True,
                                                learnable_sink=sink)
    t = torch.from_dlpack
    check_attention(t(out), t(lse), t(q), t(cache)[:, :90], t(cache)[:, :90],
                    learnable_sink=t(sink), label="cupy dense")
    check_kvcache(t(out_d), t(lse_d), t(q)[:, :1], t(cache), t(cache), cache_seqlens=t(lens),
                  learnable_sink=t(sink), label="cupy decode")


# -- the sink beside every other argument of the cache and packed paths --

SINK_COMBOS = {
    "rotary interleaved, append": dict(rotary="interleaved", new=2, seqlen_q=2, causal=True),
    "rotary half, float32 tables, paged": dict(rotary="half", rotary_fp32=True, new=1,
                                               page_size=16, causal=True),
    "cache_leftpad": dict(leftpad=[0, 5, 30], lens=[40, 60, 100], seqlen_q=3, causal=True),
    "cache_leftpad, paged, append": dict(leftpad=[3, 0, 17], lens=[40, 1, 100], new=2,
                                         page_size=16, seqlen_q=2, causal=True),
    "cache_batch_idx, append": dict(batch_idx=True, new=1),
    "head dim 59, rotary, append": dict(d=59, rotary="interleaved", rotary_dim=58, new=1,
                                        causal=True),
    "head dim 111, num_splits 3": dict(d=111, num_splits=3, capacity=600, seqlen_q=4,
                                       causal=True),
    "head dim 250, window (-1, 3)": dict(d=250, seqlen_q=5, window_size=(-1, 3), new=2),
}


@pytest.mark.parametrize("name", SINK_COMBOS)
@pytest.mark.parametrize("sink_dtype", ["float32", "bfloat16"])
def test_sink_beside_every_kvcache_argument(rng, name, sink_dtype):
    """The sink with rotary, cache_leftpad, cache_batch_idx, an append, odd head dims
    (the element-wise kernels), splits and a window open on the left: out and lse against
    the reference, the cache after the append likewise."""
    test_gpu_kvcache.run_case(rng, f"{name}, sink {sink_dtype}", sink=sink_dtype,
                              **SINK_COMBOS[name])


@pytest.mark.parametrize("d", [59, 128])
def test_sink_with_seqused_k(rng, family, d):
    """Packed sequences attending to their first seqused_k keys (NaN past them), one with
    none (out 0, lse = the sink), with a sink and a causal mask."""
    lens_q, lens_k, used = [5, 3, 77, 130], [90, 7, 200, 130], [50, 0, 200, 1]
    h, hk = 6, 2
    q = randn(rng, (1, sum(lens_q), h, d), "bfloat16")[0]
    k, v = (randn(rng, (1, sum(lens_k), hk, d), "bfloat16")[0] for _ in range(2))
    ck = np.concatenate([[0], np.cumsum(lens_k)])
    for x in (k, v):
        for i, n in enumerate(used):
            x[ck[i] + n:ck[i + 1]] = NAN
    sink = make_sink(rng, h, "float16")
    out, lse = cufa.flash_attn_varlen_func(q, k, v, cu_seqlens(lens_q), cu_seqlens(lens_k),
                                           max(lens_q), max(lens_k), seqused_k=i32(used),
                                           causal=True, learnable_sink=sink, return_lse=True)
    cq = np.concatenate([[0], np.cumsum(lens_q)])
    for i in range(len(lens_q)):
        rows, keys = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i] + used[i])
        check_attention(out[rows][None], lse[:, rows][None], q[rows][None], k[keys][None],
                        v[keys][None], causal=True, learnable_sink=sink,
                        label=f"d {d} {family} sequence {i} ({used[i]} keys used)")
