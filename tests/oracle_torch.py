"""A second attention oracle, in PyTorch (CPU, float64), written from the formulas in
docs/api.md and not from cufa.reference, so that a misreading shared by the reference
and the kernels shows up as a disagreement. Tensors in, tensors out; no cufa import.

Where docs/api.md is silent, flash-attn 2's documented convention is followed:
- GQA / MQA: query head h reads KV head h // (nheads // nheads_k).
- Rotary: pair i of features is rotated by the angle of column i of cos / sin,
  x0' = x0 cos - x1 sin, x1' = x0 sin + x1 cos; the keys written into the cache are the
  rotated ones.
- SDPA: a row whose mask lets no key take part gives 0 (as every other entry point).
- learnable_sink: the sink-free attention's (out, lse), then the sink added to the
  denominator (add_sink); split-KV attends each part of the keys sink-free, merges the
  parts and adds the sink once. (cufa.reference appends a logit column instead.)

The rules are small module-level functions and one constant (SCORE_STEPS), so that a
test can patch one of them and check that the comparison with the reference then fails.
"""
import math

import torch

NEG_INF = -math.inf

# docs/api.md: the scaled score is capped first, ALiBi is added "after the softcap".
SCORE_STEPS = ("softcap", "alibi")

# docs/api.md: the parts of a split attention are merged sink-free, and the sink is added
# once, after the merge.
SINK_AFTER_MERGE = True


def sink_logit(learnable_sink, scale):
    """docs/api.md: the sink is a logit as it is; softmax_scale, softcap and ALiBi apply to
    the scores only."""
    return torch.as_tensor(learnable_sink, dtype=torch.float64)


def add_sink(out, lse, sink):
    """A sink-free attention's out (batch, seqlen_q, nheads, d) and lse (batch, nheads,
    seqlen_q) with the sink (nheads,) in every row's denominator: lse' = log(exp(lse) +
    exp(sink)), out' = exp(lse - lse') out (a row without keys: 0 and lse' = sink)."""
    sink = sink[None, :, None].expand_as(lse)
    new = torch.logaddexp(lse, sink)
    w = torch.exp(lse - torch.where(torch.isneginf(new), 0.0, new))
    return w.transpose(1, 2)[..., None] * out, new


def key_splits(seqlen_k, num_splits):
    """Boolean masks of the keys of each split: num_splits runs of ceil(seqlen_k /
    num_splits) keys (the last ones possibly empty)."""
    per = max(1, -(-seqlen_k // num_splits))
    split = torch.arange(seqlen_k) // per
    return [split == n for n in range(num_splits)]


def kv_head(h, nheads, nheads_k):
    """The KV head that query head h reads: consecutive query heads share one."""
    return h // (nheads // nheads_k)


def visible(seqlen_q, seqlen_k, *, causal, window_size, diag):
    """Boolean (seqlen_q, seqlen_k): query i sees key j iff
    i + diag - left <= j <= i + diag + right, a side of -1 unbounded, causal -> right 0.
    diag is seqlen_k - seqlen_q for flash-attn's bottom-right corner, 0 for SDPA's top-left."""
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(seqlen_q)[:, None]
    j = torch.arange(seqlen_k)[None, :]
    keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if left >= 0:
        keep &= j >= i + diag - left
    if right >= 0:
        keep &= j <= i + diag + right
    return keep


def alibi_bias(slopes, seqlen_q, seqlen_k, diag):
    """-slope * |i + diag - j|, slopes (batch, nheads) -> (batch, nheads, seqlen_q, seqlen_k)."""
    i = torch.arange(seqlen_q, dtype=torch.float64)[:, None]
    j = torch.arange(seqlen_k, dtype=torch.float64)[None, :]
    return -slopes[:, :, None, None] * (i + diag - j).abs()


def _softmax_attend(s, v):
    """s (batch, nheads, seqlen_q, seqlen_k) with -inf for keys that take no part, v
    (batch, seqlen_k, nheads, d) -> out (batch, seqlen_q, nheads, d), lse (batch, nheads,
    seqlen_q); a row without keys gives 0 and -inf."""
    lse = torch.logsumexp(s, dim=-1)
    empty = torch.isneginf(lse)
    p = torch.exp(s - torch.where(empty, 0.0, lse)[..., None])
    out = torch.einsum("bhij,bjhd->bihd", p, v)
    return out, lse


def _attend_with_sink(s, v, learnable_sink, scale, num_splits=1):
    """_softmax_attend over num_splits parts of the keys, merged, with the sink added once
    (SINK_AFTER_MERGE) or to every part."""
    sink = None if learnable_sink is None else sink_logit(learnable_sink, scale)
    parts = [_softmax_attend(s.masked_fill(~keys, NEG_INF), v)
             for keys in key_splits(s.shape[-1], num_splits)]
    if sink is not None and not SINK_AFTER_MERGE:
        parts = [add_sink(o, lse, sink) for o, lse in parts]
    out, lse = parts[0]
    for o, part_lse in parts[1:]:
        out, lse = merge_attention_states(out, lse, o, part_lse)
    if sink is not None and SINK_AFTER_MERGE:
        out, lse = add_sink(out, lse, sink)
    return out, lse


def _gqa(k, nheads):
    nheads_k = k.shape[2]
    if nheads % nheads_k:
        raise ValueError(f"nheads {nheads} is not a multiple of nheads_k {nheads_k}")
    idx = torch.tensor([kv_head(h, nheads, nheads_k) for h in range(nheads)])
    return k[:, :, idx]


def _slopes(alibi_slopes, batch, nheads):
    """(nheads,) or (batch, nheads) -> (batch, nheads)."""
    slopes = torch.as_tensor(alibi_slopes, dtype=torch.float64)
    return slopes.expand(batch, nheads) if slopes.ndim == 1 else slopes


def attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
              softcap=0.0, alibi_slopes=None, learnable_sink=None, num_splits=1):
    """flash_attn_func: q (batch, seqlen_q, nheads, d), k, v (batch, seqlen_k, nheads_k, d)
    -> out (batch, seqlen_q, nheads, d), lse (batch, nheads, seqlen_q); the keys attended
    in num_splits parts, merged."""
    batch, seqlen_q, nheads, d = q.shape
    seqlen_k = k.shape[1]
    diag = seqlen_k - seqlen_q
    k, v = _gqa(k, nheads), _gqa(v, nheads)
    scale = 1 / math.sqrt(d) if softmax_scale is None else softmax_scale
    s = scale * torch.einsum("bihd,bjhd->bhij", q, k)
    for step in SCORE_STEPS:
        if step == "softcap" and softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        if step == "alibi" and alibi_slopes is not None:
            s = s + alibi_bias(_slopes(alibi_slopes, batch, nheads), seqlen_q, seqlen_k, diag)
    keep = visible(seqlen_q, seqlen_k, causal=causal, window_size=window_size, diag=diag)
    return _attend_with_sink(s.masked_fill(~keep, NEG_INF), v, learnable_sink, scale, num_splits)


def sdpa(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False,
         learnable_sink=None):
    """PyTorch's scaled_dot_product_attention: (batch, heads, L, E), causal top-left, a
    boolean mask (True takes part) or an additive one, broadcast to (batch, heads, L, S).
    Returns (out (batch, heads, L, E), lse (batch, heads, L))."""
    batch, nheads, seqlen_q, d = query.shape
    seqlen_k = key.shape[2]
    if key.shape[1] != nheads and not enable_gqa:
        raise ValueError("key has other heads than query; pass enable_gqa=True")
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    k, v = _gqa(k, nheads), _gqa(v, nheads)
    scale = 1 / math.sqrt(d) if scale is None else scale
    s = scale * torch.einsum("bihd,bjhd->bhij", q, k)
    if attn_mask is not None:
        mask = attn_mask.expand(batch, nheads, seqlen_q, seqlen_k)
        s = s.masked_fill(~mask, NEG_INF) if mask.dtype == torch.bool else s + mask
    if is_causal:
        keep = visible(seqlen_q, seqlen_k, causal=True, window_size=(-1, -1), diag=0)
        s = s.masked_fill(~keep, NEG_INF)
    out, lse = _attend_with_sink(s, v, learnable_sink, scale)
    return out.transpose(1, 2), lse


def rotate(x, cos, sin, positions, interleaved):
    """x (seqlen, nheads, d) with row t at position positions[t]; cos, sin (seqlen_ro,
    rotary_dim / 2). The first rotary_dim features turn in pairs, (2i, 2i + 1) when
    interleaved, else (i, i + rotary_dim / 2); the rest are kept."""
    half = cos.shape[1]
    x = x.clone()
    c = cos[positions][:, None, :]
    s = sin[positions][:, None, :]
    if interleaved:
        first, second = slice(0, 2 * half, 2), slice(1, 2 * half, 2)
    else:
        first, second = slice(0, half), slice(half, 2 * half)
    x0, x1 = x[..., first].clone(), x[..., second].clone()
    x[..., first] = x0 * c - x1 * s
    x[..., second] = x0 * s + x1 * c
    return x


def query_positions(cache_seqlen, seqlen_q, *, causal, window_size, capacity):
    """Rotary positions of the new queries: cache_seqlens + t when causal or windowed, else
    all at cache_seqlens (flash-attn's rule). A window side counts only below the cache's
    capacity: a wider one hides no key."""
    t = torch.arange(seqlen_q)
    local = causal or any(0 <= side < capacity for side in window_size)
    return cache_seqlen + t if local else torch.full_like(t, cache_seqlen)


def key_positions(cache_seqlen, seqlen_new):
    """Rotary positions of the new keys: key i at cache_seqlens + i."""
    return cache_seqlen + torch.arange(seqlen_new)


def cache_keys(leftpad, cache_seqlen, seqlen_new):
    """The cache positions sequence b attends to: from its leftpad to its last new key."""
    return range(leftpad, cache_seqlen + seqlen_new)


def kvcache_attention(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                      cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                      block_table=None, softmax_scale=None, causal=False,
                      window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                      alibi_slopes=None, learnable_sink=None, num_splits=1):
    """flash_attn_with_kvcache -> (out, lse, k_cache after, v_cache after); the given caches
    are not modified. Each sequence's keys are attended in num_splits parts (split-KV)."""
    batch, seqlen_q, nheads, d = q.shape
    seqlen_new = 0 if k is None else k.shape[1]
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    if block_table is not None:
        page_size = k_cache.shape[1]
        capacity = block_table.shape[1] * page_size

        def slot(b, pos):  # key position pos of sequence b: a row of one page
            return int(block_table[b, pos // page_size]), pos % page_size
    else:
        capacity = k_cache.shape[1]

        def slot(b, pos):
            return (b if cache_batch_idx is None else int(cache_batch_idx[b])), pos

    if cache_seqlens is None:
        cache_seqlens = capacity
    lens = [int(x) for x in torch.as_tensor(cache_seqlens).expand(batch)]
    pads = [0] * batch if cache_leftpad is None else [int(x) for x in cache_leftpad]
    rotary = rotary_cos is not None

    outs, lses = [], []
    for b in range(batch):
        if seqlen_new:
            k_new = k[b]
            if rotary:
                k_new = rotate(k_new, rotary_cos, rotary_sin,
                               key_positions(lens[b], seqlen_new), rotary_interleaved)
            for i in range(seqlen_new):  # written in place at cache_seqlens + i
                k_cache[slot(b, lens[b] + i)] = k_new[i]
                v_cache[slot(b, lens[b] + i)] = v[b, i]
        slots = [slot(b, p) for p in cache_keys(pads[b], lens[b], seqlen_new)]
        rows, cols = (torch.tensor([x[n] for x in slots], dtype=torch.long) for n in (0, 1))
        keys, vals = k_cache[rows, cols], v_cache[rows, cols]
        q_b = q[b]
        if rotary:
            q_b = rotate(q_b, rotary_cos, rotary_sin,
                         query_positions(lens[b], seqlen_q, causal=causal,
                                         window_size=window_size, capacity=capacity), rotary_interleaved)
        slopes = None
        if alibi_slopes is not None:
            slopes = _slopes(alibi_slopes, batch, nheads)[b : b + 1]
        o, lse = attention(q_b[None], keys[None], vals[None], softmax_scale=softmax_scale,
                           causal=causal, window_size=window_size, softcap=softcap,
                           alibi_slopes=slopes, learnable_sink=learnable_sink,
                           num_splits=num_splits)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.stack(outs), torch.stack(lses), k_cache, v_cache


def merge_attention_states(out_a, lse_a, out_b, lse_b):
    """lse = log(exp(lse_a) + exp(lse_b)), out = exp(lse_a - lse) out_a + exp(lse_b - lse)
    out_b for out (batch, seqlen, nheads, d), lse (batch, nheads, seqlen); a part with lse
    -inf (or +inf, flash-attn 2's mark of a row without keys) weighs 0 and is not read."""
    lse_a, lse_b = (torch.where(torch.isposinf(x), NEG_INF, x) for x in (lse_a, lse_b))
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isneginf(lse), 0.0, lse)

    def weighted(o, part):
        w = torch.exp(part - safe).transpose(1, 2)[..., None]
        return torch.where(torch.isneginf(part).transpose(1, 2)[..., None], 0.0, w * o)

    return weighted(out_a, lse_a) + weighted(out_b, lse_b), lse
