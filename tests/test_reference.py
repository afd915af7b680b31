"""CPU: the NumPy reference — tiled online softmax against the naive version, and the
naive version against a per-row textbook softmax; a value head dim of its own and MLA's
absorbed queries (qv)."""
import math

import numpy as np
import pytest

from cufa import reference


def _inputs(rng, batch, sq, sk, h, hk, d):
    return (rng.standard_normal((batch, sq, h, d)), rng.standard_normal((batch, sk, hk, d)),
            rng.standard_normal((batch, sk, hk, d)))


MASKS = [
    dict(),
    dict(causal=True),
    dict(window_size=(5, 0)),
    dict(window_size=(-1, 3)),
    dict(window_size=(2, 2), causal=True),
    dict(softcap=3.0),
    dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625])),
    dict(causal=True, window_size=(7, -1), softcap=5.0, alibi_slopes=np.array([0.3, 0.1, 0.2, 0.4])),
    dict(diag_offset=0, causal=True),
]


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: ",".join(sorted(m)) or "dense")
@pytest.mark.parametrize("sq,sk", [(1, 1), (1, 9), (9, 1), (37, 61), (61, 37), (64, 64), (100, 3)])
def test_tiled_matches_naive(rng, mask, sq, sk):
    q, k, v = _inputs(rng, 2, sq, sk, 4, 2, 24)
    o_ref, lse_ref = reference.attention(q, k, v, **mask)
    o, lse = reference.attention_tiled(q, k, v, block_m=16, block_n=24, **mask)
    np.testing.assert_allclose(o, o_ref, atol=1e-12, rtol=1e-10)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    fin = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[fin], lse_ref[fin], atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("attn_mask_kind", ["bool", "float"])
def test_tiled_matches_naive_with_attn_mask(rng, attn_mask_kind):
    q, k, v = _inputs(rng, 2, 45, 70, 4, 4, 16)
    if attn_mask_kind == "bool":
        m = rng.random((2, 1, 45, 70)) > 0.3     # broadcast over heads
        m[0, 0, 3] = False                       # a row with no key
    else:
        m = rng.standard_normal((45, 70)) * 2    # broadcast over batch and heads
    o_ref, lse_ref = reference.attention(q, k, v, attn_mask=m)
    o, lse = reference.attention_tiled(q, k, v, attn_mask=m, block_m=32, block_n=16)
    np.testing.assert_allclose(o, o_ref, atol=1e-12)
    np.testing.assert_allclose(lse[np.isfinite(lse_ref)], lse_ref[np.isfinite(lse_ref)], atol=1e-12)
    if attn_mask_kind == "bool":
        assert np.all(o[0, 3] == 0) and np.all(np.isneginf(lse[0, :, 3]))


def _textbook(q, k, v, b, h, i, scale, visible_row, bias_row=None):
    """softmax of one row written out by hand, GQA head mapping included."""
    hk = h // (q.shape[2] // k.shape[2])
    s = [scale * float(q[b, i, h] @ k[b, j, hk]) for j in range(k.shape[1])]
    s = [x + (bias_row[j] if bias_row is not None else 0.0) if visible_row[j] else -math.inf
         for j, x in enumerate(s)]
    if all(x == -math.inf for x in s):
        return np.zeros(q.shape[-1]), -math.inf
    m = max(s)
    w = [math.exp(x - m) for x in s]
    out = sum(wj * v[b, j, hk] for j, wj in enumerate(w)) / sum(w)
    return out, m + math.log(sum(w))


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (2, 1))])
def test_naive_matches_textbook(rng, causal, window):
    q, k, v = _inputs(rng, 1, 6, 9, 4, 2, 8)
    slopes = np.array([0.1, 0.2, 0.3, 0.4])
    o, lse = reference.attention(q, k, v, causal=causal, window_size=window, alibi_slopes=slopes)
    vis = reference.visible_keys(6, 9, causal=causal, window_size=window)
    for h in range(4):
        for i in range(6):
            bias = [-slopes[h] * abs(i + 3 - j) for j in range(9)]
            o_row, lse_row = _textbook(q, k, v, 0, h, i, 1 / math.sqrt(8), vis[i], bias)
            np.testing.assert_allclose(o[0, i, h], o_row, atol=1e-12)
            assert lse[0, h, i] == pytest.approx(lse_row, abs=1e-12)


def test_visible_keys_bottom_right_and_top_left():
    # flash-attn: seqlen_q=2, seqlen_k=5, causal -> the diagonal ends at the bottom right
    assert reference.visible_keys(2, 5, causal=True).astype(int).tolist() == [
        [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert reference.visible_keys(2, 5, window_size=(1, 0)).astype(int).tolist() == [
        [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]
    # SDPA: top-left
    assert reference.visible_keys(2, 5, causal=True, diag_offset=0).astype(int).tolist() == [
        [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]
    # more queries than keys, bottom-right: the first rows see nothing
    assert reference.visible_keys(4, 2, causal=True).astype(int).tolist() == [
        [0, 0], [0, 0], [1, 0], [1, 1]]


def test_empty_keys_and_softcap_bound(rng):
    q, k, v = _inputs(rng, 1, 5, 0, 2, 2, 8)
    o, lse = reference.attention(q, k, v)
    assert o.shape == (1, 5, 2, 8) and np.all(o == 0) and np.all(np.isneginf(lse))
    q, k, v = _inputs(rng, 1, 5, 7, 2, 2, 8)
    o, lse = reference.attention(q * 100, k * 100, v, softcap=2.0)
    # capped scores lie in (-2, 2): lse <= 2 + log(7)
    assert np.all(lse <= 2 + math.log(7) + 1e-12)


def test_sdpa_layout(rng):
    q, k, v = (rng.standard_normal((2, 3, n, 8)) for n in (5, 7, 7))
    out = reference.sdpa(q, k, v, is_causal=True)
    o, _ = reference.attention(*(x.transpose(0, 2, 1, 3) for x in (q, k, v)), causal=True,
                               diag_offset=0)
    np.testing.assert_allclose(out, o.transpose(0, 2, 1, 3))


# -- learnable sink ------------------------------------------------------------------------

SINKS = {  # per head (4 heads): mixed signs, one that dominates every row, none at all
    "mixed": np.array([0.5, -1.25, 2.0, 0.0]),
    "huge": np.array([300.0, -300.0, 1e4, -1e4]),
    "-inf": np.array([-np.inf, 1.0, -np.inf, -2.0]),
}


@pytest.mark.parametrize("sink", list(SINKS))
@pytest.mark.parametrize("mask", MASKS[:8], ids=lambda m: ",".join(sorted(m)) or "dense")
@pytest.mark.parametrize("sq,sk", [(1, 1), (9, 1), (37, 61), (100, 3), (5, 0)])
def test_tiled_sink_matches_the_sink_column(rng, mask, sq, sk, sink):
    """The kernels' finalize (M = max(m, sink)) against gpt-oss's extra logit column."""
    q, k, v = _inputs(rng, 2, sq, sk, 4, 2, 24)
    o_ref, lse_ref = reference.attention(q, k, v, learnable_sink=SINKS[sink], **mask)
    o, lse = reference.attention_tiled(q, k, v, block_m=16, block_n=24,
                                       learnable_sink=SINKS[sink], **mask)
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    np.testing.assert_allclose(o, o_ref, atol=1e-12, rtol=1e-10)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    fin = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[fin], lse_ref[fin], atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (2, 1))])
def test_sink_matches_textbook(rng, causal, window):
    """out_i = sum_j exp(s_ij - m) v_j / (exp(sink_h - m) + sum_j exp(s_ij - m)), written
    out row by row; the sink is never scaled (softmax_scale 0.3 here)."""
    q, k, v = _inputs(rng, 1, 6, 9, 4, 2, 8)
    sink = np.array([0.7, -0.4, 3.0, -2.5])
    o, lse = reference.attention(q, k, v, causal=causal, window_size=window, softmax_scale=0.3,
                                 learnable_sink=sink)
    vis = reference.visible_keys(6, 9, causal=causal, window_size=window)
    for h in range(4):
        hk = h // 2
        for i in range(6):
            s = [0.3 * float(q[0, i, h] @ k[0, j, hk]) if vis[i, j] else -math.inf
                 for j in range(9)]
            m = max(s + [sink[h]])
            w = [math.exp(x - m) for x in s]
            den = math.exp(sink[h] - m) + sum(w)
            row = sum(wj * v[0, j, hk] for j, wj in enumerate(w)) / den
            np.testing.assert_allclose(o[0, i, h], row, atol=1e-12)
            assert lse[0, h, i] == pytest.approx(m + math.log(den), abs=1e-12)


def test_sink_rows_without_keys_give_zero_and_the_sink(rng):
    # bottom-right causal with more queries than keys: the first 4 rows see nothing
    q, k, v = _inputs(rng, 2, 7, 3, 4, 4, 8)
    sink = np.array([1.5, -np.inf, -30.0, 40.0])
    o, lse = reference.attention(q, k, v, causal=True, learnable_sink=sink)
    assert np.all(o[:, :4] == 0)
    np.testing.assert_array_equal(lse[:, :, :4], np.broadcast_to(sink[None, :, None], (2, 4, 4)))
    # no keys at all; and a sink of -inf is no sink
    o, lse = reference.attention(q, k[:, :0], v[:, :0], learnable_sink=sink)
    assert np.all(o == 0) and np.array_equal(lse[0, :, 0], sink)
    o_none, lse_none = reference.attention(q, k, v, causal=True)
    o_inf, lse_inf = reference.attention(q, k, v, causal=True, learnable_sink=np.full(4, -np.inf))
    np.testing.assert_array_equal(o_inf, o_none)
    np.testing.assert_array_equal(lse_inf, lse_none)


def test_sdpa_and_kvcache_take_the_sink(rng):
    sink = np.array([0.3, 1.1, -0.6])
    q, k, v = (rng.standard_normal((2, 3, n, 8)) for n in (5, 7, 7))
    out = reference.sdpa(q, k, v, is_causal=True, learnable_sink=sink)
    o, _ = reference.attention(*(x.transpose(0, 2, 1, 3) for x in (q, k, v)), causal=True,
                               diag_offset=0, learnable_sink=sink)
    np.testing.assert_allclose(out, o.transpose(0, 2, 1, 3))
    q = rng.standard_normal((2, 1, 3, 8))
    cache = rng.standard_normal((2, 10, 3, 8))
    o, lse, _, _ = reference.kvcache_attention(q, cache, cache, cache_seqlens=np.array([6, 0]),
                                               learnable_sink=sink)
    o_6, lse_6 = reference.attention(q[:1], cache[:1, :6], cache[:1, :6], learnable_sink=sink)
    np.testing.assert_allclose(o[:1], o_6)
    np.testing.assert_allclose(lse[:1], lse_6)
    assert np.all(o[1] == 0) and np.array_equal(lse[1, :, 0], sink)  # an empty cache


# -- a value head dim of its own, and MLA's absorbed queries (qv) -----------------------------

def test_value_head_dim_of_its_own():
    """192/128 (DeepSeek's prefill): out takes v's head dim, the scale q's."""
    rng = np.random.default_rng(5)
    q, k = rng.standard_normal((2, 9, 4, 12)), rng.standard_normal((2, 11, 2, 12))
    v = rng.standard_normal((2, 11, 2, 8))
    out, lse = reference.attention(q, k, v, causal=True)
    assert out.shape == (2, 9, 4, 8)
    for b, h in ((0, 0), (1, 3)):
        s = q[b, :, h] @ k[b, :, h // 2].T / np.sqrt(12)
        s[np.triu_indices(9, 11 - 9 + 1, 11)] = -np.inf
        p = np.exp(s - s.max(1, keepdims=True))
        np.testing.assert_allclose(out[b, :, h], p @ v[b, :, h // 2] / p.sum(1, keepdims=True))


def test_qv_is_attention_over_the_concatenated_dims():
    """MLA decode in FlashAttention-3's form: scores q . k_pe + qv . c_kv, values c_kv;
    the same as plain attention of [q, qv] over [k_pe, c_kv], with the scale of the
    concatenated head dim."""
    rng = np.random.default_rng(6)
    b, sq, h, sk, d_pe, d_c = 2, 3, 8, 13, 4, 16
    q, qv = rng.standard_normal((b, sq, h, d_pe)), rng.standard_normal((b, sq, h, d_c))
    k_pe, c_kv = rng.standard_normal((b, sk, 1, d_pe)), rng.standard_normal((b, sk, 1, d_c))
    out, lse = reference.attention(q, k_pe, c_kv, qv=qv, causal=True)
    want, want_lse = reference.attention(np.concatenate([q, qv], -1),
                                         np.concatenate([k_pe, c_kv], -1), c_kv, causal=True)
    np.testing.assert_allclose(out, want)
    np.testing.assert_allclose(lse, want_lse)
    # through the KV cache: contiguous, with lengths of their own
    lens = np.array([5, 13])
    got, got_lse, *_ = reference.kvcache_attention(q, k_pe, c_kv, cache_seqlens=lens, qv=qv,
                                                   causal=True)
    for i in range(b):
        o, l = reference.attention(q[i:i + 1], k_pe[i:i + 1, :lens[i]], c_kv[i:i + 1, :lens[i]],
                                   qv=qv[i:i + 1], causal=True)
        np.testing.assert_allclose(got[i:i + 1], o)
    with pytest.raises(ValueError, match="qv must be"):
        reference.attention(q, k_pe, c_kv, qv=qv[..., :5])


# -- fp8 e4m3 -----------------------------------------------------------------------------------

def test_round_to_e4m3_matches_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes (JAX's) is not installed")
    # every e4m3 value, the midpoints between neighbours (ties to even), and a spread
    codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    finite = np.unique(codes[np.isfinite(codes)])
    mids = (finite[1:] + finite[:-1]) / 2
    spread = np.random.default_rng(9).standard_normal(20000) * np.logspace(-4, 2.6, 20000)
    mids = mids.astype(np.float32)  # (exact; ml_dtypes converts from float32, so the
    # neighbours of a midpoint are float32 ones)
    for x in (finite, mids, spread.astype(np.float32), np.nextafter(mids, np.float32(0)),
              np.nextafter(mids, np.float32(1000))):
        clamped = np.clip(x, -448, 448).astype(np.float32)   # (ml_dtypes gives NaN past it)
        want = clamped.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
        np.testing.assert_array_equal(reference.round_to_e4m3(x), want)
    assert reference.round_to_e4m3(1000.0) == 448.0 and reference.round_to_e4m3(-1e9) == -448.0


def test_quantize_e4m3_error_is_half_a_step():
    x = np.random.default_rng(10).standard_normal(5000) * 3
    descale = 0.05
    back = reference.quantize_e4m3(x, descale) * descale
    rel = np.abs(back - x) / np.maximum(np.abs(x), 2.0 ** -6 * descale)
    assert rel.max() <= 2.0 ** -4 + 1e-12   # half of e4m3's 2^-3 step, relative


def test_kvcache_with_an_fp8_cache():
    """An e4m3 cache with per-(sequence, KV head) descales: appended keys are stored
    quantized, attention reads stored values times the descale; equal to plain attention
    over the dequantized keys."""
    rng = np.random.default_rng(12)
    b, h, hk, d, cap = 2, 4, 2, 8, 16
    q = rng.standard_normal((b, 1, h, d))
    kd, vd = rng.uniform(0.01, 0.1, (b, hk)), rng.uniform(0.01, 0.1, (b, hk))
    k_c = reference.quantize_e4m3(rng.standard_normal((b, cap, hk, d)), kd[:, None, :, None])
    v_c = reference.quantize_e4m3(rng.standard_normal((b, cap, hk, d)), vd[:, None, :, None])
    k_new, v_new = rng.standard_normal((b, 2, hk, d)), rng.standard_normal((b, 2, hk, d))
    lens = np.array([3, 9])
    out, _, k_after, v_after = reference.kvcache_attention(
        q, k_c, v_c, k=k_new, v=v_new, cache_seqlens=lens, causal=True, k_descale=kd,
        v_descale=vd)
    for i in range(b):
        stored = k_after[i, lens[i]:lens[i] + 2]
        np.testing.assert_array_equal(stored,
                                      reference.quantize_e4m3(k_new[i], kd[i][None, :, None]))
        keys = k_after[i:i + 1, :lens[i] + 2] * kd[i][None, None, :, None]
        vals = v_after[i:i + 1, :lens[i] + 2] * vd[i][None, None, :, None]
        o, _ = reference.attention(q[i:i + 1], keys, vals, causal=True)
        np.testing.assert_allclose(out[i:i + 1], o)
    # one scale for all (vLLM's k_scale), a (1,) array
    one, _, *_ = reference.kvcache_attention(q, k_c, v_c, cache_seqlens=lens,
                                             k_descale=np.array([0.05]), v_descale=0.05)
    two, _, *_ = reference.kvcache_attention(q, k_c, v_c, cache_seqlens=lens,
                                             k_descale=np.full((b, hk), 0.05),
                                             v_descale=np.full((b, hk), 0.05))
    np.testing.assert_array_equal(one, two)
