"""CPU: the KV-cache reference checked against itself, in ways that could fail: paged ==
contiguous, a merge of two key sets == attention over both, rotary is a rotation at the
right positions, leftpad == a cache that starts later, append == a cache that already
holds the keys."""
import math

import numpy as np
import pytest

from cufa import reference


def cache_case(rng, batch=3, capacity=64, nheads=8, nheads_k=2, d=16, seqlen_q=2, new=3):
    q = rng.standard_normal((batch, seqlen_q, nheads, d))
    k_cache, v_cache = (rng.standard_normal((batch, capacity, nheads_k, d)) for _ in range(2))
    k, v = (rng.standard_normal((batch, new, nheads_k, d)) for _ in range(2))
    return q, k_cache, v_cache, k, v


def rotary_table(seqlen_ro, rotary_dim, base=100.0):
    """cos/sin (seqlen_ro, rotary_dim // 2) of angles p * base^(-2i / rotary_dim)."""
    inv_freq = base ** (-np.arange(0, rotary_dim, 2) / rotary_dim)
    angles = np.arange(seqlen_ro)[:, None] * inv_freq[None, :]
    return np.cos(angles), np.sin(angles)


def assert_same(a, b, what, atol=1e-12):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, f"{what}: shapes {a.shape} vs {b.shape}"
    assert np.array_equal(np.isneginf(a), np.isneginf(b)), f"{what}: -inf entries differ"
    fin = np.isfinite(a) & np.isfinite(b)
    err = np.abs(a[fin] - b[fin])
    assert err.max(initial=0) <= atol, (
        f"{what}: max err {err.max(initial=0):.3e}, mean err {err.mean() if err.size else 0:.3e}")


# -- paged == contiguous --------------------------------------------------------------------

@pytest.mark.parametrize("page_size", [1, 4, 16, 64])
@pytest.mark.parametrize("rotary", [False, True])
def test_paged_cache_gives_the_contiguous_result(rng, page_size, rotary):
    capacity = 64
    q, k_cache, v_cache, k, v = cache_case(rng, capacity=capacity)
    lens = np.array([0, 30, capacity - 3], dtype=np.int32)  # the last append fills the cache
    kw = dict(cache_seqlens=lens, causal=True, window_size=(-1, -1), softcap=5.0,
              alibi_slopes=rng.uniform(0, 1, (3, 8)))
    if rotary:
        kw.update(zip(("rotary_cos", "rotary_sin"), rotary_table(capacity, 12)))
    o, lse, kc_after, vc_after = reference.kvcache_attention(q, k_cache, v_cache, k, v, **kw)

    table, num_pages = reference.paged_layout(3, capacity, page_size, rng, spare_pages=2)
    k_pages, v_pages = (reference.to_paged(c, table, num_pages, fill=7.0)
                        for c in (k_cache, v_cache))
    o_p, lse_p, kp_after, vp_after = reference.kvcache_attention(
        q, k_pages, v_pages, k, v, block_table=table, **kw)
    assert_same(o_p, o, "out")
    assert_same(lse_p, lse, "lse")
    assert_same(reference.from_paged(kp_after, table), kc_after, "k_cache after", atol=0)
    assert_same(reference.from_paged(vp_after, table), vc_after, "v_cache after", atol=0)
    spare = np.setdiff1d(np.arange(num_pages), table)
    assert len(spare) == 2 and (kp_after[spare] == 7.0).all() and (vp_after[spare] == 7.0).all()


def test_paged_layout_is_a_permutation_with_spare_pages(rng):
    table, num_pages = reference.paged_layout(4, 48, 16, rng, spare_pages=5)
    assert table.dtype == np.int32 and table.shape == (4, 3) and num_pages == 17
    assert len(np.unique(table)) == 12 and table.min() >= 0 and table.max() < 17
    x = rng.standard_normal((4, 48, 2, 8))
    assert np.array_equal(reference.from_paged(reference.to_paged(x, table, num_pages), table), x)
    with pytest.raises(ValueError, match="multiple of page_size"):
        reference.paged_layout(1, 50, 16, rng)


def test_cache_batch_idx_picks_cache_rows(rng):
    q, k_cache, v_cache, k, v = cache_case(rng, batch=3)
    big_k, big_v = (rng.standard_normal((5,) + k_cache.shape[1:]) for _ in range(2))
    idx = np.array([4, 0, 2], dtype=np.int32)
    big_k[idx], big_v[idx] = k_cache, v_cache
    lens = np.array([5, 17, 40], dtype=np.int32)
    o, lse, kc, _ = reference.kvcache_attention(q, k_cache, v_cache, k, v, cache_seqlens=lens)
    o_i, lse_i, big_kc, _ = reference.kvcache_attention(q, big_k, big_v, k, v, cache_seqlens=lens,
                                                        cache_batch_idx=idx)
    assert_same(o_i, o, "out")
    assert_same(lse_i, lse, "lse")
    assert_same(big_kc[idx], kc, "k_cache rows", atol=0)
    untouched = [1, 3]
    assert np.array_equal(big_kc[untouched], big_k[untouched])


def test_cache_seqlens_int_equals_array_and_none_means_full(rng):
    q, k_cache, v_cache, _, _ = cache_case(rng)
    o_int, lse_int, _, _ = reference.kvcache_attention(q, k_cache, v_cache, cache_seqlens=20)
    o_arr, lse_arr, _, _ = reference.kvcache_attention(
        q, k_cache, v_cache, cache_seqlens=np.full(3, 20, np.int32))
    assert_same(o_int, o_arr, "out")
    o_none, _, _, _ = reference.kvcache_attention(q, k_cache, v_cache)
    o_full, _, _, _ = reference.kvcache_attention(q, k_cache, v_cache, cache_seqlens=64)
    assert_same(o_none, o_full, "out")


def test_rows_without_keys_give_zero_and_minus_inf(rng):
    q, k_cache, v_cache, _, _ = cache_case(rng, seqlen_q=3)
    lens = np.array([0, 2, 9], dtype=np.int32)
    o, lse, _, _ = reference.kvcache_attention(q, k_cache, v_cache, cache_seqlens=lens,
                                               causal=True)
    # sequence 0 has no key; sequence 1 has 2 keys for 3 queries: its first row sees none
    assert (o[0] == 0).all() and np.isneginf(lse[0]).all()
    assert (o[1, 0] == 0).all() and np.isneginf(lse[1, :, 0]).all()
    assert np.isfinite(lse[1, :, 1:]).all() and np.isfinite(lse[2]).all()


def test_bad_arguments_raise(rng):
    q, k_cache, v_cache, k, v = cache_case(rng)
    table, _ = reference.paged_layout(3, 64, 16, rng)
    with pytest.raises(ValueError, match="cache_seqlens"):
        reference.kvcache_attention(q, k_cache, v_cache, k, v)
    with pytest.raises(ValueError, match="cache_batch_idx"):
        reference.kvcache_attention(q, k_cache, v_cache, cache_batch_idx=np.arange(3),
                                    block_table=table)
    with pytest.raises(ValueError, match="k and v"):
        reference.kvcache_attention(q, k_cache, v_cache, k, cache_seqlens=0)
    with pytest.raises(ValueError, match="cache_seqlens"):
        reference.kvcache_attention(q, k_cache, v_cache, k, v, cache_seqlens=62)
    with pytest.raises(ValueError, match="cache_leftpad"):
        reference.kvcache_attention(q, k_cache, v_cache, cache_seqlens=4,
                                    cache_leftpad=np.array([0, 5, 0]))


# -- merge ------------------------------------------------------------------------------

@pytest.mark.parametrize("split", [0, 1, 20, 47])
@pytest.mark.parametrize("packed", [False, True])
def test_merge_of_two_key_sets_is_attention_over_both(rng, split, packed):
    """Keys 0..split-1 and split..46 attended separately, then merged. A random boolean
    mask leaves some rows without keys in one part or in both."""
    b, sq, sk, h, d = (1 if packed else 2), 9, 47, 4, 16
    q = rng.standard_normal((b, sq, h, d))
    k, v = (rng.standard_normal((b, sk, h, d)) for _ in range(2))
    mask = rng.random((b, h, sq, sk)) < 0.6
    mask[:, :, 0, :split] = False           # row 0: nothing in part a
    mask[:, :, 1, split:] = False           # row 1: nothing in part b
    mask[:, :, 2, :] = False                # row 2: nothing in either
    kw = dict(softcap=4.0)
    o, lse = reference.attention(q, k, v, attn_mask=mask, **kw)
    o_a, lse_a = reference.attention(q, k[:, :split], v[:, :split], attn_mask=mask[..., :split],
                                     **kw)
    o_b, lse_b = reference.attention(q, k[:, split:], v[:, split:], attn_mask=mask[..., split:],
                                     **kw)
    o_a[np.broadcast_to(np.isneginf(lse_a).transpose(0, 2, 1)[..., None], o_a.shape)] = np.nan
    # ^ a part's output is not read where its lse is -inf
    if packed:
        o, lse, o_a, lse_a, o_b, lse_b = (x[0] for x in (o, lse, o_a, lse_a, o_b, lse_b))
    got_o, got_lse = reference.merge_states(o_a, lse_a, o_b, lse_b)
    assert_same(got_lse, lse, "lse", atol=1e-12)
    assert_same(got_o, o, "out", atol=1e-12)
    assert not np.isnan(got_o).any()
    empty = np.isneginf(lse)
    assert empty.any() and (got_o[(empty.T if packed else empty.transpose(0, 2, 1))] == 0).all()


def test_merge_takes_plus_inf_lse_as_no_keys(rng):
    """flash-attn 2 marks rows without keys with lse +inf."""
    o_a, o_b = (rng.standard_normal((4, 2, 8)) for _ in range(2))
    lse_a, lse_b = (rng.standard_normal((2, 4)) for _ in range(2))
    lse_a[0, 1], o_a[1, 0] = np.inf, np.nan
    got, got_lse = reference.merge_states(o_a, lse_a, o_b, lse_b)
    assert np.array_equal(got[1, 0], o_b[1, 0]) and got_lse[0, 1] == lse_b[0, 1]
    lse_b[0, 1] = np.inf
    got, got_lse = reference.merge_states(o_a, lse_a, o_b, lse_b)
    assert (got[1, 0] == 0).all() and np.isneginf(got_lse[0, 1])


def test_merge_is_symmetric(rng):
    o_a, o_b = (rng.standard_normal((2, 5, 3, 8)) for _ in range(2))
    lse_a, lse_b = (rng.standard_normal((2, 3, 5)) * 4 for _ in range(2))
    lse_a[0, 0, 0] = -np.inf
    one = reference.merge_states(o_a, lse_a, o_b, lse_b)
    other = reference.merge_states(o_b, lse_b, o_a, lse_a)
    for x, y, n in zip(one, other, ("out", "lse")):
        assert_same(x, y, n, atol=1e-12)
    assert np.allclose(one[0][0, 0, 0], o_b[0, 0, 0])   # the -inf part passes the other through


# -- rotary -----------------------------------------------------------------------------

@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("rotary_dim", [2, 6, 16])
def test_rotary_is_a_rotation_of_pairs(rng, interleaved, rotary_dim):
    x = rng.standard_normal((2, 5, 3, 16))
    cos, sin = rotary_table(40, rotary_dim)
    pos = rng.integers(0, 40, (2, 5))
    y = reference.apply_rotary(x, cos, sin, pos, interleaved)
    half = rotary_dim // 2
    if interleaved:
        first, second = np.arange(0, rotary_dim, 2), np.arange(1, rotary_dim, 2)
    else:
        first, second = np.arange(half), np.arange(half, rotary_dim)
    norm = (lambda t: np.hypot(t[..., first], t[..., second]))
    assert np.allclose(norm(y), norm(x), rtol=1e-13, atol=1e-13)
    assert np.array_equal(y[..., rotary_dim:], x[..., rotary_dim:])
    # the angle of each pair grows by the table's angle at that position
    turn = (np.arctan2(y[..., second], y[..., first]) - np.arctan2(x[..., second], x[..., first]))
    expect = np.arctan2(sin[pos], cos[pos])[:, :, None, :]
    assert np.allclose(np.angle(np.exp(1j * (turn - expect))), 0, atol=1e-12)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_matches_a_hand_computation(interleaved):
    x = np.array([1.0, 2, 3, 4, 5, 6]).reshape(1, 1, 1, 6)
    angles = np.array([[0.0, 0.0], [math.pi / 2, math.pi / 3]])     # position 1: 90 and 60 degrees
    y = reference.apply_rotary(x, np.cos(angles), np.sin(angles), np.array([[1]]), interleaved)
    r3 = math.sqrt(3)
    if interleaved:   # pairs (1, 2) by 90, (3, 4) by 60
        expect = [-2, 1, 1.5 - 2 * r3, 1.5 * r3 + 2, 5, 6]
    else:             # pairs (1, 3) by 90, (2, 4) by 60
        expect = [-3, 1 - 2 * r3, 1, r3 + 2, 5, 6]
    assert np.allclose(y.ravel(), expect, atol=1e-14), y.ravel()
    same = reference.apply_rotary(x, np.cos(angles), np.sin(angles), np.array([[0]]), interleaved)
    assert np.allclose(same, x, atol=1e-15)


def test_rotary_dot_products_depend_on_relative_position_only(rng):
    q, k = (rng.standard_normal((1, 1, 1, 32)) for _ in range(2))
    cos, sin = rotary_table(100, 32)

    def dot(p, r):
        rq = reference.apply_rotary(q, cos, sin, np.array([[p]]), True)
        rk = reference.apply_rotary(k, cos, sin, np.array([[r]]), True)
        return float((rq * rk).sum())
    assert math.isclose(dot(10, 3), dot(50, 43), rel_tol=1e-12, abs_tol=1e-12)
    assert not math.isclose(dot(10, 3), dot(10, 4), rel_tol=1e-6)


def test_rotary_positions_outside_the_table_raise(rng):
    cos, sin = rotary_table(8, 4)
    with pytest.raises(ValueError, match="positions"):
        reference.apply_rotary(rng.standard_normal((1, 2, 1, 8)), cos, sin, np.array([[7, 8]]))


@pytest.mark.parametrize("causal, window, per_token", [
    (False, (-1, -1), False), (True, (-1, -1), True), (False, (5, 2), True),
    (False, (63, -1), True), (False, (-1, 0), True),
    (False, (64, -1), False), (False, (64, 100), False)])   # sides >= capacity: unbounded
def test_kvcache_rotates_new_keys_at_their_cache_position_and_q_by_mask(rng, causal, window,
                                                                         per_token):
    """New key i of sequence b at cache_seqlens[b] + i (the leftpad does not shift it); q
    token t at cache_seqlens[b] + t when the mask is local (causal, or a window side below
    the cache's 64 positions, as flash-attn decides), else all at cache_seqlens[b]."""
    q, k_cache, v_cache, k, v = cache_case(rng, seqlen_q=3)
    cos, sin = rotary_table(64, 8)
    lens = np.array([0, 10, 33], dtype=np.int32)
    pad = np.array([0, 4, 33], dtype=np.int32)
    g = reference.kvcache_gather(q, k_cache, v_cache, k, v, cos, sin, cache_seqlens=lens,
                                 cache_leftpad=pad, causal=causal, window_size=window,
                                 rotary_interleaved=False)
    for b, n in enumerate(lens):
        pos_new = np.arange(n, n + 3)[None]
        k_rot = reference.apply_rotary(k[b:b + 1], cos, sin, pos_new, False)
        assert np.allclose(g.k_cache[b, n:n + 3], k_rot[0], atol=1e-14)
        assert np.array_equal(g.v_cache[b, n:n + 3], v[b])
        assert np.array_equal(g.k_cache[b, n + 3:], k_cache[b, n + 3:])
        assert np.array_equal(g.k_cache[b, :n], k_cache[b, :n])
        pos_q = np.arange(n, n + 3)[None] if per_token else np.full((1, 3), n)
        assert np.allclose(g.q[b:b + 1], reference.apply_rotary(q[b:b + 1], cos, sin, pos_q,
                                                                 False), atol=1e-14)
        assert g.keys[b].shape == (1, n + 3 - pad[b], 2, 16)


# -- leftpad and append -----------------------------------------------------------------

@pytest.mark.parametrize("append", [False, True])
def test_leftpad_equals_a_cache_that_starts_later(rng, append):
    """Keys from leftpad on, with masks and ALiBi counting from the leftpad, are the same
    as a cache whose row starts at the leftpad (no rotary: its positions are absolute)."""
    q, k_cache, v_cache, k, v = cache_case(rng, seqlen_q=4)
    lens = np.array([9, 40, 12], dtype=np.int32)
    pad = np.array([0, 25, 12], dtype=np.int32)      # the last: only the new keys remain
    new = (k, v) if append else (None, None)
    kw = dict(causal=True, window_size=(6, -1), alibi_slopes=rng.uniform(0, 1, 8), softcap=3.0)
    o, lse, kc, vc = reference.kvcache_attention(q, k_cache, v_cache, *new, cache_seqlens=lens,
                                                 cache_leftpad=pad, **kw)
    shifted_k, shifted_v = np.zeros_like(k_cache), np.zeros_like(v_cache)
    for b, p in enumerate(pad):
        shifted_k[b, :64 - p], shifted_v[b, :64 - p] = k_cache[b, p:], v_cache[b, p:]
    o_s, lse_s, kc_s, _ = reference.kvcache_attention(q, shifted_k, shifted_v, *new,
                                                      cache_seqlens=lens - pad, **kw)
    assert_same(o, o_s, "out")
    assert_same(lse, lse_s, "lse")
    for b, p in enumerate(pad):
        assert np.array_equal(kc[b, p:lens[b] + 3], kc_s[b, :lens[b] + 3 - p])
    if not append and pad[2] == lens[2]:
        assert (o[2] == 0).all() and np.isneginf(lse[2]).all()


@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)),
                                            (False, (3, 1))])
def test_append_equals_a_cache_that_already_holds_the_keys(rng, causal, window):
    q, k_cache, v_cache, k, v = cache_case(rng, seqlen_q=3, new=5)
    lens = np.array([0, 7, 59], dtype=np.int32)       # 59 + 5 fills the cache
    kw = dict(causal=causal, window_size=window, alibi_slopes=rng.uniform(0, 1, (3, 8)))
    o, lse, kc, vc = reference.kvcache_attention(q, k_cache, v_cache, k, v, cache_seqlens=lens,
                                                 **kw)
    held_k, held_v = k_cache.copy(), v_cache.copy()
    for b, n in enumerate(lens):
        held_k[b, n:n + 5], held_v[b, n:n + 5] = k[b], v[b]
    assert np.array_equal(kc, held_k) and np.array_equal(vc, held_v)
    o_h, lse_h, kc_h, _ = reference.kvcache_attention(q, held_k, held_v, cache_seqlens=lens + 5,
                                                      **kw)
    assert_same(o, o_h, "out")
    assert_same(lse, lse_h, "lse")
    assert np.array_equal(kc_h, held_k)


def test_decode_row_against_a_hand_softmax(rng):
    """One query, 3 keys, no mask: out = softmax(q.k * scale) v, lse = log sum exp."""
    q = rng.standard_normal((1, 1, 1, 4))
    k_cache, v_cache = (rng.standard_normal((1, 8, 1, 4)) for _ in range(2))
    o, lse, _, _ = reference.kvcache_attention(q, k_cache, v_cache, cache_seqlens=3,
                                               softmax_scale=0.7)
    s = 0.7 * (k_cache[0, :3, 0] @ q[0, 0, 0])
    p = np.exp(s - s.max())
    assert np.allclose(o[0, 0, 0], (p / p.sum()) @ v_cache[0, :3, 0], atol=1e-14)
    assert math.isclose(lse[0, 0, 0], math.log(np.exp(s).sum()), rel_tol=1e-14)
