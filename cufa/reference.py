"""NumPy reference attention, in float64: a naive version that builds the whole score
matrix, and the tiled online-softmax algorithm the kernels implement.

Layout (batch, seqlen, nheads, headdim), like ``flash_attn_func``. Both return
``(out, lse)`` with lse (batch, nheads, seqlen_q); rows that see no key give 0 and
lse -inf. Score pipeline, in this order (as in the kernels):

    s = scale * q.k  ->  softcap * tanh(s / softcap)  ->  - slope * |i + diag_offset - j|
      ->  + attn_mask (additive) / -inf where a boolean mask is False
      ->  -inf outside the window  i + diag_offset - left <= j <= i + diag_offset + right

diag_offset is seqlen_k - seqlen_q for flash-attn's bottom-right alignment (the default)
and 0 for PyTorch SDPA's top-left alignment.

learnable_sink (nheads,), as gpt-oss writes it: head h's sink is appended to every row
of its scores as one more logit column, taken as it is (no scale, cap, bias or mask);
the softmax runs over the row and the column is dropped, so it takes a share of the
denominator and adds no value. The lse includes it; a row that sees no key gives 0 and
lse = sink.

attention_backward: the gradients of attention()'s output (dq, dk, dv; the sink's and an
additive mask's), from the whole score matrix, for the backward kernels' tests.

KV cache (flash_attn_with_kvcache): kvcache_attention appends, rotates and gathers each
sequence's keys (kvcache_gather), then runs attention() per sequence; merge_states
combines two partial results; paged_layout / to_paged / from_paged move a contiguous
cache to and from pages.
"""
import math
from dataclasses import dataclass

import numpy as np


def visible_keys(seqlen_q, seqlen_k, *, causal=False, window_size=(-1, -1), diag_offset=None):
    """Boolean (seqlen_q, seqlen_k): which keys each query sees."""
    if diag_offset is None:
        diag_offset = seqlen_k - seqlen_q
    left, right = window_size
    if causal:
        right = 0
    i = np.arange(seqlen_q)[:, None] + diag_offset
    j = np.arange(seqlen_k)[None, :]
    vis = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if left >= 0:
        vis &= j >= i - left
    if right >= 0:
        vis &= j <= i + right
    return vis


def _expand_kv(x, nheads):
    """GQA/MQA: repeat each KV head for the query heads that share it."""
    return np.repeat(x, nheads // x.shape[2], axis=2)


def _score_mods(s, rows, cols, *, scale, softcap, alibi_slopes, attn_mask, visible, diag_offset):
    """Turn raw dot products s (batch, nheads, len(rows), len(cols)) into final scores."""
    s = s * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    if alibi_slopes is not None:
        slopes = np.asarray(alibi_slopes, dtype=np.float64)
        slopes = slopes.reshape((1, -1) if slopes.ndim == 1 else slopes.shape)[:, :, None, None]
        dist = np.abs(rows[:, None] + diag_offset - cols[None, :]).astype(np.float64)
        s = s - slopes * dist
    if attn_mask is not None:
        m = attn_mask[..., rows[:, None], cols[None, :]]
        s = np.where(m, s, -np.inf) if m.dtype == bool else s + m.astype(np.float64)
    return np.where(visible[rows[:, None], cols[None, :]], s, -np.inf)


def _prepare(q, k, v, softmax_scale, causal, window_size, attn_mask, diag_offset):
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    batch, seqlen_q, nheads, d = q.shape
    seqlen_k = k.shape[1]
    if diag_offset is None:
        diag_offset = seqlen_k - seqlen_q
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    visible = visible_keys(seqlen_q, seqlen_k, causal=causal, window_size=window_size,
                           diag_offset=diag_offset)
    if attn_mask is not None:
        attn_mask = np.asarray(attn_mask)
        attn_mask = np.broadcast_to(attn_mask, (batch, nheads, seqlen_q, seqlen_k))
    # (batch, nheads, seqlen, d) for the products
    qh = q.transpose(0, 2, 1, 3)
    kh = _expand_kv(k, nheads).transpose(0, 2, 1, 3)
    vh = _expand_kv(v, nheads).transpose(0, 2, 1, 3)
    return qh, kh, vh, scale, visible, attn_mask, diag_offset


def with_sink_column(s, learnable_sink):
    """Scores (batch, nheads, rows, keys) with head h's sink appended to each row as one
    more column (gpt-oss's formulation); s itself without a sink."""
    if learnable_sink is None:
        return s
    sink = np.asarray(learnable_sink, dtype=np.float64).reshape(1, -1, 1, 1)
    return np.concatenate([s, np.broadcast_to(sink, s.shape[:-1] + (1,))], axis=-1)


def _exp_rows(s):
    """Scores (..., columns) -> (each row's max, 0 where the row is all -inf; exp(s - max);
    the rows' sums): the softmax's parts, safe for rows that see nothing."""
    m = s.max(axis=-1, keepdims=True) if s.shape[-1] else np.full(s.shape[:-1] + (1,), -np.inf)
    m_safe = np.where(np.isneginf(m), 0.0, m)
    e = np.exp(s - m_safe)
    return m_safe, e, e.sum(axis=-1, keepdims=True)


def attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, attn_mask=None, diag_offset=None, learnable_sink=None,
              qv=None):
    """Naive attention: the full (seqlen_q, seqlen_k) score matrix (and the sink column),
    then softmax. v may have a head dim of its own (out takes it). qv (batch, seqlen_q,
    nheads, v's head dim), FlashAttention-3's form of MLA's absorbed queries: the scores
    gain qv . v (q . k + qv . v, then the scale; by default 1 / sqrt(q's + qv's head
    dims))."""
    if qv is not None and softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(np.shape(q)[-1] + np.shape(qv)[-1])
    qh, kh, vh, scale, visible, attn_mask, diag_offset = _prepare(
        q, k, v, softmax_scale, causal, window_size, attn_mask, diag_offset)
    rows, cols = np.arange(qh.shape[2]), np.arange(kh.shape[2])
    dots = qh @ kh.transpose(0, 1, 3, 2)
    if qv is not None:
        if np.shape(qv) != qh.shape[:1] + qh.shape[2:3] + qh.shape[1:2] + vh.shape[3:]:
            raise ValueError(f"qv must be (batch, seqlen_q, nheads, v's head dim); got "
                             f"{np.shape(qv)}")
        dots = dots + np.asarray(qv, dtype=np.float64).transpose(0, 2, 1, 3) @ vh.transpose(
            0, 1, 3, 2)
    s = _score_mods(dots, rows, cols, scale=scale, softcap=softcap,
                    alibi_slopes=alibi_slopes, attn_mask=attn_mask, visible=visible,
                    diag_offset=diag_offset)
    m_safe, p, l = _exp_rows(with_sink_column(s, learnable_sink))
    p = p[..., :len(cols)]  # (the sink's column dropped: it adds no value)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(l == 0, 0.0, (p @ vh) / l)
        lse = np.where(l == 0, -np.inf, m_safe + np.log(l))[..., 0]
    return out.transpose(0, 2, 1, 3), lse


@dataclass
class AttentionGrads:
    """attention()'s gradients: dq, dk, dv in the inputs' layouts (dk, dv summed over the
    query heads that share a KV head); dsink (nheads,) or None; dmask in the additive
    float mask's own shape (summed over its broadcast dimensions) or None."""
    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    dsink: object = None
    dmask: object = None


def attention_backward(q, k, v, dout, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                       softcap=0.0, alibi_slopes=None, attn_mask=None, diag_offset=None,
                       learnable_sink=None):
    """The gradients of sum(attention(q, k, v, ...)[0] * dout) in float64, from the whole
    score matrix, as the backward kernels must give them (same arguments as attention()).

        P = softmax over [scores, sink] (the sink's column dropped), O = P V
        dV = P^T dO;  dP = dO V^T;  D = rowsum(dO * O);  dS = P * (dP - D)
        dsink[h] = -sum over rows of P_sink * D    (the sink adds no value)
        dmask = dS (an additive mask; a boolean one has none)
        through softcap: dS * (1 - tanh(s / cap)^2);  dQ = scale dS K;  dK = scale dS^T Q

    ALiBi's bias and the masks are constants. A row that sees no key (and no sink) has
    P = 0: zero gradients from it."""
    qh, kh, vh, scale, visible, mask_b, diag_offset = _prepare(
        q, k, v, softmax_scale, causal, window_size, attn_mask, diag_offset)
    batch, nheads, seqlen_q, _ = qh.shape
    nheads_k, seqlen_k = np.shape(k)[2], kh.shape[2]
    rows, cols = np.arange(seqlen_q), np.arange(seqlen_k)
    dots = qh @ kh.transpose(0, 1, 3, 2)
    s = with_sink_column(_score_mods(dots, rows, cols, scale=scale, softcap=softcap,
                                     alibi_slopes=alibi_slopes, attn_mask=mask_b,
                                     visible=visible, diag_offset=diag_offset),
                         learnable_sink)
    _, e, l = _exp_rows(s)
    with np.errstate(divide="ignore", invalid="ignore"):
        p_all = np.where(l == 0, 0.0, e / l)
    p = p_all[..., :seqlen_k]
    do = np.asarray(dout, dtype=np.float64).transpose(0, 2, 1, 3)
    o = p @ vh
    dvh = p.transpose(0, 1, 3, 2) @ do
    dp = do @ vh.transpose(0, 1, 3, 2)
    big_d = (do * o).sum(axis=-1, keepdims=True)
    ds = p * (dp - big_d)
    dsink = None
    if learnable_sink is not None:
        dsink = -(p_all[..., seqlen_k] * big_d[..., 0]).sum(axis=(0, 2))
    dmask = None
    if attn_mask is not None and np.asarray(attn_mask).dtype != bool:
        dmask = _sum_to_shape(ds, np.shape(attn_mask))
    if softcap:
        ds = ds * (1.0 - np.tanh(dots * scale / softcap) ** 2)
    dqh = scale * ds @ kh
    dkh = scale * ds.transpose(0, 1, 3, 2) @ qh

    def per_kv_head(x):  # (batch, nheads, seqlen_k, d) -> (batch, seqlen_k, nheads_k, d)
        x = x.reshape(batch, nheads_k, nheads // nheads_k, seqlen_k, x.shape[-1]).sum(axis=2)
        return x.transpose(0, 2, 1, 3)
    return AttentionGrads(dq=dqh.transpose(0, 2, 1, 3), dk=per_kv_head(dkh),
                          dv=per_kv_head(dvh), dsink=dsink, dmask=dmask)


def _sum_to_shape(x, shape):
    """x summed over the dimensions a tensor of `shape` was broadcast along to reach it."""
    x = x.sum(axis=tuple(range(x.ndim - len(shape)))) if x.ndim > len(shape) else x
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return x.sum(axis=axes, keepdims=True) if axes else x


def attention_tiled(q, k, v, *, block_m=64, block_n=64, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, attn_mask=None,
                    diag_offset=None, learnable_sink=None):
    """The FlashAttention algorithm: Q row blocks, K/V column blocks, running max m and
    sum l, partial output rescaled whenever the max grows, one division at the end, where
    the sink joins the denominator (as the kernels' finalize: M = max(m, sink), so that
    neither exponential overflows)."""
    qh, kh, vh, scale, visible, attn_mask, diag_offset = _prepare(
        q, k, v, softmax_scale, causal, window_size, attn_mask, diag_offset)
    batch, nheads, seqlen_q, d = qh.shape
    seqlen_k = kh.shape[2]
    out = np.zeros_like(qh)
    lse = np.empty((batch, nheads, seqlen_q))
    sink = np.full(nheads, -np.inf) if learnable_sink is None else np.asarray(
        learnable_sink, dtype=np.float64)
    sink = sink.reshape(1, nheads, 1, 1)
    for r0 in range(0, seqlen_q, block_m):
        rows = np.arange(r0, min(r0 + block_m, seqlen_q))
        q_blk = qh[:, :, rows]
        m_i = np.full((batch, nheads, len(rows), 1), -np.inf)
        l_i = np.zeros_like(m_i)
        acc = np.zeros((batch, nheads, len(rows), d))
        for c0 in range(0, seqlen_k, block_n):
            cols = np.arange(c0, min(c0 + block_n, seqlen_k))
            # -- compute qk --
            s = _score_mods(q_blk @ kh[:, :, cols].transpose(0, 1, 3, 2), rows, cols,
                            scale=scale, softcap=softcap, alibi_slopes=alibi_slopes,
                            attn_mask=attn_mask, visible=visible, diag_offset=diag_offset)
            # -- update m_i and l_i --
            m_new = np.maximum(m_i, s.max(axis=-1, keepdims=True))
            m_safe = np.where(np.isneginf(m_new), 0.0, m_new)   # no -inf - -inf
            correction = np.exp(m_i - m_safe)
            p = np.exp(s - m_safe)
            l_i = l_i * correction + p.sum(axis=-1, keepdims=True)
            # -- update output accumulator --
            acc = acc * correction + p @ vh[:, :, cols]
            m_i = m_new
        # -- finalize: the sink joins the denominator --
        m_fin = np.maximum(m_i, sink)
        m_safe = np.where(np.isneginf(m_fin), 0.0, m_fin)
        l_fin = l_i * np.exp(m_i - m_safe) + np.exp(sink - m_safe)
        acc = acc * np.exp(m_i - m_safe)
        with np.errstate(divide="ignore", invalid="ignore"):
            out[:, :, rows] = np.where(l_i == 0, 0.0, acc / l_fin)
            lse[:, :, rows] = np.where(l_fin == 0, -np.inf, m_safe + np.log(l_fin))[..., 0]
    return out.transpose(0, 2, 1, 3), lse


def sdpa(query, key, value, attn_mask=None, is_causal=False, scale=None, learnable_sink=None):
    """PyTorch SDPA conventions: (batch, heads, L, E), top-left causal. Returns out only."""
    tr = (lambda x: np.asarray(x).transpose(0, 2, 1, 3))
    out, _ = attention(tr(query), tr(key), tr(value), softmax_scale=scale, causal=is_causal,
                       attn_mask=attn_mask, diag_offset=0, learnable_sink=learnable_sink)
    return out.transpose(0, 2, 1, 3)


# -- fp8 (e4m3) ------------------------------------------------------------------------------

E4M3_MAX = 448.0


def round_to_e4m3(x):
    """x rounded to the nearest float8 e4m3fn value (ties to even), after clamping to
    +-448 (e4m3fn has no infinity: the kernels clamp before they convert). 3 mantissa
    bits, exponents -6..8, subnormals down to 2^-9; NaN stays NaN."""
    x = np.clip(np.asarray(x, dtype=np.float64), -E4M3_MAX, E4M3_MAX)
    a = np.abs(x)
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    step = 2.0 ** (np.maximum(e, -6) - 3)    # below 2^-6 the subnormals' fixed step
    return np.copysign(np.round(a / step) * step, x)


def quantize_e4m3(x, descale):
    """What an fp8 cache stores for x (a key's 16-bit value) with its descale: x / descale
    divided in float32, as the append kernel and torch's `(k.float() / descale).to(
    float8_e4m3fn)` divide (a float64 quotient rounds otherwise where the float32 one lands
    on a tie), then round_to_e4m3; as values (float64). The key it stands for is that
    times descale."""
    quotient = np.asarray(x, dtype=np.float32) / np.asarray(descale, dtype=np.float32)
    return round_to_e4m3(quotient.astype(np.float64))


def round_to_16_bits(x, dtype):
    """x rounded to "float16" or "bfloat16" (nearest, ties to even), as float64 values."""
    x = np.asarray(x, dtype=np.float64)
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float64)
    if dtype != "bfloat16":
        raise ValueError(f"dtype must be 'float16' or 'bfloat16'; got {dtype!r}")
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    finite = np.isfinite(x)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    out = rounded.astype(np.uint32).view(np.float32).astype(np.float64)
    return np.where(finite, out, x)


# -- KV cache ----------------------------------------------------------------------------

def apply_rotary(x, cos, sin, positions, interleaved=True):
    """Rotary embedding: x (batch, seqlen, heads, d) with token (b, t) rotated at position
    positions[b, t]. cos, sin: (seqlen_ro, rotary_dim // 2); the first rotary_dim features
    are rotated in pairs, the rest kept. interleaved pairs (x[2i], x[2i + 1]), else
    (x[i], x[i + rotary_dim // 2]); pair i by angle index i:

        x0' = x0 cos[p, i] - x1 sin[p, i],    x1' = x0 sin[p, i] + x1 cos[p, i]
    """
    x = np.array(x, dtype=np.float64)
    cos, sin = (np.asarray(a, dtype=np.float64) for a in (cos, sin))
    positions = np.asarray(positions)
    half = cos.shape[1]
    if cos.shape != sin.shape or 2 * half > x.shape[-1]:
        raise ValueError(f"rotary_cos {cos.shape} / rotary_sin {sin.shape}: rotary_dim "
                         f"{2 * half} must fit head dim {x.shape[-1]}")
    if positions.shape != x.shape[:2]:
        raise ValueError(f"positions must be {x.shape[:2]}; got {positions.shape}")
    if positions.size and not (0 <= positions.min() and positions.max() < cos.shape[0]):
        raise ValueError(f"rotary positions {positions.min()}..{positions.max()} outside the "
                         f"table's {cos.shape[0]} positions")
    c, s = cos[positions][:, :, None, :], sin[positions][:, :, None, :]
    first, second = ((slice(0, 2 * half, 2), slice(1, 2 * half, 2)) if interleaved
                     else (slice(0, half), slice(half, 2 * half)))
    x0, x1 = x[..., first].copy(), x[..., second].copy()
    x[..., first] = x0 * c - x1 * s
    x[..., second] = x0 * s + x1 * c
    return x


@dataclass
class KvGather:
    """What flash_attn_with_kvcache attends with: q after rotary, and for each sequence b
    its keys and values (1, seqlen_k(b), nheads_k, d) taken from the cache after the
    append; the caches after the append (same layout as given)."""
    q: np.ndarray
    keys: list
    values: list
    k_cache: np.ndarray
    v_cache: np.ndarray


def kvcache_gather(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                   cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                   block_table=None, causal=False, window_size=(-1, -1),
                   rotary_interleaved=True, k_descale=None, v_descale=None,
                   new_keys_as=None):
    """The append (rotary on the new keys, written at cache_seqlens[b] + i) and the gather
    of each sequence's keys, cache positions [leftpad[b], cache_seqlens[b] + seqlen_new).
    q is rotated at cache_seqlens[b] + t when the mask is local (causal, or a window side
    below the cache's capacity), else at cache_seqlens[b]. k_descale / v_descale (batch,
    nheads_k), or one value for all: an fp8 cache, holding e4m3 values; the new keys are
    stored as quantize_e4m3(k, descale) and the gathered keys are the stored values times
    descale (sequence b's row); new_keys_as ("float16", "bfloat16"): given for an fp8
    cache, q's dtype, to which a rotated new key is rounded before it is quantized, as the
    append kernel stores it (docs/api.md); it also marks a cache without descales as fp8
    (a descale of 1). Strict: any value a correct call could not have raises
    ValueError."""
    if new_keys_as is not None:
        k_descale = 1.0 if k_descale is None else k_descale
        v_descale = 1.0 if v_descale is None else v_descale
    q = np.asarray(q, dtype=np.float64)
    k_cache, v_cache = (np.array(c, dtype=np.float64) for c in (k_cache, v_cache))
    batch, seqlen_q = q.shape[:2]
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    seqlen_new = 0 if k is None else k.shape[1]
    if block_table is not None:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx does not apply with block_table")
        block_table = np.asarray(block_table)
        page_size = k_cache.shape[1]
        capacity = block_table.shape[1] * page_size

        def where(b, pos):  # cache index of key positions pos of sequence b
            return block_table[b, pos // page_size], pos % page_size
    else:
        capacity = k_cache.shape[1]
        rows = np.arange(batch) if cache_batch_idx is None else np.asarray(cache_batch_idx)

        def where(b, pos):
            return rows[b], pos
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("cache_seqlens is required with k and v")
        cache_seqlens = capacity
    lens = np.broadcast_to(np.asarray(cache_seqlens, dtype=np.int64), (batch,))
    pad = np.zeros(batch, np.int64) if cache_leftpad is None else np.asarray(cache_leftpad)
    ends = lens + seqlen_new
    if (lens < 0).any() or (ends > capacity).any():
        raise ValueError(f"cache_seqlens {lens} + {seqlen_new} new keys outside [0, {capacity}]")
    if (pad < 0).any() or (pad > lens).any():
        raise ValueError(f"cache_leftpad {pad} outside [0, cache_seqlens {lens}]")
    new_pos = lens[:, None] + np.arange(seqlen_new)[None, :]
    if rotary_cos is not None:
        # flash-attn's rule: q per token when the mask is local, i.e. causal, or a window
        # side within the cache's capacity (a side >= capacity counts as unbounded)
        if causal or any(0 <= side < capacity for side in window_size):
            q_pos = lens[:, None] + np.arange(seqlen_q)[None, :]
        else:
            q_pos = np.repeat(lens[:, None], seqlen_q, axis=1)
        q = apply_rotary(q, rotary_cos, rotary_sin, q_pos, rotary_interleaved)
        if k is not None:
            k = apply_rotary(k, rotary_cos, rotary_sin, new_pos, rotary_interleaved)
            if new_keys_as is not None:
                k = round_to_16_bits(k, new_keys_as)
    nheads_k = k_cache.shape[2]
    k_scale, v_scale = (None if x is None else np.broadcast_to(
        np.asarray(x, dtype=np.float64).reshape(-1, nheads_k) if np.size(x) > 1 else
        np.asarray(x, dtype=np.float64).reshape(1, 1), (batch, nheads_k))[:, None, :, None]
        for x in (k_descale, v_descale))
    for b in range(batch):
        if seqlen_new:
            at = where(b, new_pos[b])
            k_cache[at], v_cache[at] = (
                np.asarray(x[b]) if scale is None else quantize_e4m3(x[b], scale[b])
                for x, scale in ((k, k_scale), (v, v_scale)))
    keys, values = [], []
    for b in range(batch):
        at = where(b, np.arange(pad[b], ends[b]))
        keys.append(k_cache[at][None] * (1.0 if k_scale is None else k_scale[b]))
        values.append(v_cache[at][None] * (1.0 if v_scale is None else v_scale[b]))
    return KvGather(q, keys, values, k_cache, v_cache)


def kvcache_attention(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                      cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                      block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                      softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                      return_softmax_lse=False, *, learnable_sink=None, qv=None,
                      k_descale=None, v_descale=None, new_keys_as=None, attend=attention):
    """flash_attn_with_kvcache in float64 (arguments as NumPy arrays; cache_seqlens an
    array or an int). Each sequence b is attention(q[b], its keys) with masks and ALiBi
    aligned bottom-right against seqlen_k(b) = cache_seqlens[b] + seqlen_new - leftpad[b],
    key index 0 at the leftpad, and the learnable sink. num_splits and return_softmax_lse
    are accepted for the same call signature and change nothing (the sink enters each row
    once, however the keys are split). attend: the per-sequence attention, called as
    attention() is (the GPU tests pass a low-precision one). qv: as in attention() (MLA
    decode in FlashAttention-3's form: k_cache the rotary part k_pe, v_cache the latent
    c_kv, q the rotary queries, qv the absorbed ones). k_descale, v_descale, new_keys_as:
    an fp8 cache (kvcache_gather). Returns (out (batch, seqlen_q,
    nheads, v's head dim), lse (batch, nheads, seqlen_q), k_cache_after, v_cache_after)."""
    g = kvcache_gather(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                       cache_batch_idx, cache_leftpad, block_table, causal, window_size,
                       rotary_interleaved, k_descale, v_descale, new_keys_as)
    outs, lses = [], []
    for b, (keys, values) in enumerate(zip(g.keys, g.values)):
        extra = {} if qv is None else {"qv": np.asarray(qv, dtype=np.float64)[b:b + 1]}
        o, lse = attend(g.q[b:b + 1], keys, values, softmax_scale=softmax_scale,
                        causal=causal, window_size=window_size, softcap=softcap,
                        alibi_slopes=alibi_row(alibi_slopes, b), learnable_sink=learnable_sink,
                        **extra)
        outs.append(o)
        lses.append(lse)
    return np.concatenate(outs), np.concatenate(lses), g.k_cache, g.v_cache


def alibi_row(alibi_slopes, b):
    """Sequence b's slopes (nheads,) from (nheads,) or (batch, nheads) slopes (or None)."""
    if alibi_slopes is None:
        return None
    a = np.asarray(alibi_slopes, dtype=np.float64)
    return a if a.ndim == 1 else a[b]


def merge_states(o_a, lse_a, o_b, lse_b):
    """Attention over the union of two disjoint key sets from each part's (out, lse):
    out (batch, seqlen, nheads, d) with lse (batch, nheads, seqlen), or packed
    (total, nheads, d) with lse (nheads, total). A part with lse -inf weighs 0 (its
    output is not read); both -inf give 0 and -inf. lse +inf, flash-attn 2's mark of a
    row without keys, counts as -inf."""
    o_a, lse_a, o_b, lse_b = (np.asarray(x, dtype=np.float64) for x in (o_a, lse_a, o_b, lse_b))
    lse_a, lse_b = (np.where(np.isposinf(x), -np.inf, x) for x in (lse_a, lse_b))
    lse = np.logaddexp(lse_a, lse_b)
    safe = np.where(np.isneginf(lse), 0.0, lse)
    # lse laid out like out's (..., seqlen, nheads) with a trailing axis over d
    as_out = ((lambda x: x.T[..., None]) if o_a.ndim == 3
              else (lambda x: x.transpose(0, 2, 1)[..., None]))
    out = np.zeros_like(o_a)
    for o_x, lse_x in ((o_a, lse_a), (o_b, lse_b)):
        w = as_out(np.exp(lse_x - safe))
        out += np.where(as_out(np.isneginf(lse_x)), 0.0, w * o_x)
    return out, lse


def paged_layout(batch, capacity, page_size, rng, spare_pages=3):
    """A random page table for `batch` sequences of `capacity` positions (a multiple of
    page_size): (block_table int32 (batch, capacity // page_size), num_pages). The pages
    are a random permutation of num_pages = batch * capacity // page_size + spare_pages,
    so spare_pages pages belong to no sequence."""
    if capacity % page_size:
        raise ValueError(f"capacity {capacity} is not a multiple of page_size {page_size}")
    used = batch * (capacity // page_size)
    order = rng.permutation(used + spare_pages)[:used]
    return order.reshape(batch, capacity // page_size).astype(np.int32), used + spare_pages


def to_paged(cache, block_table, num_pages, fill=0.0):
    """A contiguous cache (batch, capacity, heads, d), NumPy or PyTorch, laid out in
    num_pages pages (num_pages, page_size, heads, d) along block_table (paged_layout);
    pages of no sequence hold `fill`."""
    batch, capacity = cache.shape[:2]
    page_size = capacity // block_table.shape[1]
    shape = (num_pages, page_size) + tuple(cache.shape[2:])
    ids = np.asarray(block_table).reshape(-1)
    if hasattr(cache, "new_full"):  # a torch tensor
        import torch
        pages = cache.new_full(shape, fill)
        ids = torch.as_tensor(ids, dtype=torch.long, device=cache.device)
    else:
        pages = np.full(shape, fill, dtype=cache.dtype)
    pages[ids] = cache.reshape((-1, page_size) + tuple(cache.shape[2:]))
    return pages


def from_paged(pages, block_table):
    """The contiguous (batch, max_pages * page_size, heads, d) view of a paged cache."""
    ids = np.asarray(block_table).reshape(-1)
    if hasattr(pages, "new_full"):  # a torch tensor
        import torch
        ids = torch.as_tensor(ids, dtype=torch.long, device=pages.device)
    gathered = pages[ids]
    return gathered.reshape((np.shape(block_table)[0], -1) + tuple(pages.shape[2:]))
