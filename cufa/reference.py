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
"""
import math

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


def attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, attn_mask=None, diag_offset=None):
    """Naive attention: the full (seqlen_q, seqlen_k) score matrix, then softmax."""
    qh, kh, vh, scale, visible, attn_mask, diag_offset = _prepare(
        q, k, v, softmax_scale, causal, window_size, attn_mask, diag_offset)
    rows, cols = np.arange(qh.shape[2]), np.arange(kh.shape[2])
    s = _score_mods(qh @ kh.transpose(0, 1, 3, 2), rows, cols, scale=scale, softcap=softcap,
                    alibi_slopes=alibi_slopes, attn_mask=attn_mask, visible=visible,
                    diag_offset=diag_offset)
    m = s.max(axis=-1, keepdims=True) if s.shape[-1] else np.full(s.shape[:-1] + (1,), -np.inf)
    m_safe = np.where(np.isneginf(m), 0.0, m)
    p = np.exp(s - m_safe)
    l = p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(l == 0, 0.0, (p @ vh) / l)
        lse = np.where(l == 0, -np.inf, m_safe + np.log(l))[..., 0]
    return out.transpose(0, 2, 1, 3), lse


def attention_tiled(q, k, v, *, block_m=64, block_n=64, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, attn_mask=None,
                    diag_offset=None):
    """The FlashAttention algorithm: Q row blocks, K/V column blocks, running max m and
    sum l, partial output rescaled whenever the max grows, one division at the end."""
    qh, kh, vh, scale, visible, attn_mask, diag_offset = _prepare(
        q, k, v, softmax_scale, causal, window_size, attn_mask, diag_offset)
    batch, nheads, seqlen_q, d = qh.shape
    seqlen_k = kh.shape[2]
    out = np.zeros_like(qh)
    lse = np.empty((batch, nheads, seqlen_q))
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
        with np.errstate(divide="ignore", invalid="ignore"):
            out[:, :, rows] = np.where(l_i == 0, 0.0, acc / l_i)
            m_safe = np.where(np.isneginf(m_i), 0.0, m_i)
            lse[:, :, rows] = np.where(l_i == 0, -np.inf, m_safe + np.log(l_i))[..., 0]
    return out.transpose(0, 2, 1, 3), lse


def sdpa(query, key, value, attn_mask=None, is_causal=False, scale=None):
    """PyTorch SDPA conventions: (batch, heads, L, E), top-left causal. Returns out only."""
    tr = (lambda x: np.asarray(x).transpose(0, 2, 1, 3))
    out, _ = attention(tr(query), tr(key), tr(value), softmax_scale=scale, causal=is_causal,
                       attn_mask=attn_mask, diag_offset=0)
    return out.transpose(0, 2, 1, 3)
