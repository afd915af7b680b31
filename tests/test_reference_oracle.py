"""CPU: cufa.reference against a second oracle (tests/oracle_torch.py), written in PyTorch
from docs/api.md alone, on fresh random inputs: every score step and their combinations
(softcap, ALiBi, window, causal, bottom-right alignment, GQA), SDPA's masks, the KV cache
(append, leftpad, cache_batch_idx, pages, rotary), the learnable sink (under split-KV too)
and the merge. Then mutants of the oracle's rules, each of which these comparisons must
reject."""
import math

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="the second oracle (tests/oracle_torch.py) is written in PyTorch: "
    "pip install torch (the CPU build is enough)")

import oracle_torch as oracle  # noqa: E402

from cufa import reference  # noqa: E402

RTOL = 1e-10  # float64 against float64: only summation order differs


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The oracle's tensors are tiny: with several threads PyTorch spends ~100x longer in
    thread hand-offs than in arithmetic on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def t(x):
    return None if x is None else torch.from_numpy(np.asarray(x))


def assert_close(got, want, what):
    """got (NumPy, the reference) against want (a tensor, the oracle): same shape, -inf in
    the same places, no NaN, the rest within RTOL of the result's scale."""
    got, want = np.asarray(got, dtype=np.float64), want.numpy()
    assert got.shape == want.shape, f"{what}: shape {got.shape}, oracle {want.shape}"
    assert not np.isnan(got).any() and not np.isnan(want).any(), f"{what}: NaN"
    assert np.array_equal(np.isneginf(got), np.isneginf(want)), (
        f"{what}: -inf at {np.argwhere(np.isneginf(got) != np.isneginf(want))[:4].tolist()}")
    fin = np.isfinite(want)
    err = np.abs(got[fin] - want[fin])
    tol = RTOL * max(1.0, np.abs(want[fin]).max(initial=0))
    assert err.max(initial=0) <= tol, (
        f"{what}: max err {err.max():.3e} at {np.argwhere(fin)[err.argmax()].tolist()}, "
        f"mean err {err.mean():.3e}, allowed {tol:.1e}")


# -- flash_attn_func: the score pipeline -------------------------------------------------

SHAPES = [  # (seqlen_q, seqlen_k, nheads, nheads_k)
    (1, 1, 3, 3), (1, 7, 6, 2), (7, 1, 6, 1), (5, 13, 6, 3), (13, 5, 4, 2), (9, 9, 3, 1),
    (17, 30, 2, 2), (0, 4, 2, 1), (4, 0, 2, 2),
]
WINDOWS = [(-1, -1), (3, 0), (0, 2), (2, 5), (-1, 1), (4, -1), (0, 0)]


def sink_values(rng, nheads, kind):
    """A learnable sink (nheads,): "normal" draws, "huge" ones (+-1e4, which take all the
    mass or none), or None."""
    if kind is None:
        return None
    if kind == "huge":
        return rng.choice([-1e4, 1e4, 40.0, -40.0], nheads)
    return 2 * rng.standard_normal(nheads)


def check_attention(rng, seqlen_q, seqlen_k, nheads, nheads_k, *, batch=2, d=10, alibi=None,
                    sink=None, num_splits=1, **kw):
    """One flash_attn_func case; alibi: None, "heads" ((nheads,) slopes) or "batch"; sink:
    sink_values' kind; num_splits: the oracle attends the keys in that many parts."""
    q = 2 * rng.standard_normal((batch, seqlen_q, nheads, d))  # scores large enough to cap
    k, v = (rng.standard_normal((batch, seqlen_k, nheads_k, d)) for _ in range(2))
    if alibi is not None:
        kw["alibi_slopes"] = rng.uniform(0.05, 1.0, (nheads,) if alibi == "heads"
                                         else (batch, nheads))
    kw["learnable_sink"] = sink_values(rng, nheads, sink)
    o, lse = reference.attention(q, k, v, **kw)
    o_want, lse_want = oracle.attention(t(q), t(k), t(v), num_splits=num_splits, **{
        n: t(x) if n in ("alibi_slopes", "learnable_sink") else x for n, x in kw.items()})
    what = (f"sq={seqlen_q} sk={seqlen_k} h={nheads}/{nheads_k} alibi={alibi} sink={sink} "
            f"splits={num_splits} "
            f"{ {n: x for n, x in kw.items() if n not in ('alibi_slopes', 'learnable_sink')} }")
    assert_close(o, o_want, "out " + what)
    assert_close(lse, lse_want, "lse " + what)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("alibi", [None, "heads", "batch"])
@pytest.mark.parametrize("softcap", [0.0, 2.5])
def test_attention_matches_the_oracle(rng, softcap, alibi, window, causal):
    for n, shape in enumerate(SHAPES):
        scale = None if n % 2 else 0.37
        check_attention(rng, *shape, softcap=softcap, alibi=alibi, window_size=window,
                        causal=causal, softmax_scale=scale)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 8])
@pytest.mark.parametrize("sink", ["normal", "huge"])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (3, 0)),
                                           (True, (2, 5))], ids=str)
def test_attention_with_a_sink_matches_the_oracle(rng, causal, window, sink, num_splits):
    """The reference's logit column against the oracle's sink added once to the merge of
    num_splits sink-free parts of the keys (GQA, softcap, ALiBi, rows without keys)."""
    for n, shape in enumerate(SHAPES):
        check_attention(rng, *shape, sink=sink, num_splits=num_splits, window_size=window,
                        causal=causal, softcap=(0.0, 2.5)[n % 2], alibi=(None, "heads")[n % 3 == 0],
                        softmax_scale=(None, 0.37)[n % 2])


def test_the_oracle_draws_the_documented_masks():
    """The two matrices docs/api.md draws for seqlen_q = 2, seqlen_k = 5."""
    def drawn(**kw):
        return oracle.visible(2, 5, diag=3, **kw).int().tolist()
    assert drawn(causal=True, window_size=(-1, -1)) == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert drawn(causal=False, window_size=(1, 0)) == [[0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]


# -- scaled_dot_product_attention --------------------------------------------------------

SDPA_MASKS = ["none", "bool LS", "bool B1LS", "bool 1H1S", "float LS", "float BHLS"]


def sdpa_mask(rng, kind, batch, nheads, seqlen_q, seqlen_k):
    if kind == "none":
        return None
    dims = dict(B=batch, H=nheads, L=seqlen_q, S=seqlen_k, **{"1": 1})
    shape = tuple(dims[c] for c in kind.split()[1])
    if kind.startswith("bool"):
        m = rng.random(shape) > 0.35
        if m.shape[-2] > 1:
            m[..., 0, :] = False  # a row in which no key takes part
        return m
    m = 1.5 * rng.standard_normal(shape)
    m[rng.random(shape) < 0.2] = -np.inf
    return m


def check_sdpa(rng, seqlen_q, seqlen_k, nheads, nheads_k, *, kind, is_causal, scale=None,
               batch=2, d=12, sink=None):
    query = rng.standard_normal((batch, nheads, seqlen_q, d))
    key, value = (rng.standard_normal((batch, nheads_k, seqlen_k, d)) for _ in range(2))
    mask = sdpa_mask(rng, kind, batch, nheads, seqlen_q, seqlen_k)
    learnable_sink = sink_values(rng, nheads, sink)
    out = reference.sdpa(query, key, value, attn_mask=mask, is_causal=is_causal, scale=scale,
                         learnable_sink=learnable_sink)
    want, _ = oracle.sdpa(t(query), t(key), t(value), attn_mask=t(mask), is_causal=is_causal,
                          scale=scale, enable_gqa=True, learnable_sink=t(learnable_sink))
    assert_close(out, want, f"sdpa L={seqlen_q} S={seqlen_k} h={nheads}/{nheads_k} {kind} "
                 f"causal={is_causal} scale={scale} sink={sink}")


@pytest.mark.parametrize("sink", [None, "normal"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("kind", SDPA_MASKS)
def test_sdpa_matches_the_oracle(rng, kind, is_causal, sink):
    for n, shape in enumerate(SHAPES[:7]):
        check_sdpa(rng, *shape, kind=kind, is_causal=is_causal, scale=None if n % 2 else 0.45,
                   sink=sink)


@pytest.mark.parametrize("kind", SDPA_MASKS)
def test_the_oracle_sdpa_matches_pytorch(rng, kind):
    """The oracle's reading of SDPA against PyTorch's own, on rows where a key takes part
    (PyTorch leaves rows without keys undefined); causal folded into the mask, since
    PyTorch refuses both at once."""
    batch, nheads, nheads_k, seqlen_q, seqlen_k, d = 2, 6, 2, 11, 7, 12
    query = torch.from_numpy(rng.standard_normal((batch, nheads, seqlen_q, d)))
    key, value = (torch.from_numpy(rng.standard_normal((batch, nheads_k, seqlen_k, d)))
                  for _ in range(2))
    mask = t(sdpa_mask(rng, kind, batch, nheads, seqlen_q, seqlen_k))
    want, lse = oracle.sdpa(query, key, value, attn_mask=mask, scale=0.3, enable_gqa=True)
    got = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=0.3, enable_gqa=True)
    rows = torch.isfinite(lse)
    assert rows.any()
    torch.testing.assert_close(got[rows], want[rows], rtol=1e-12, atol=1e-12)


# -- flash_attn_with_kvcache -------------------------------------------------------------

CAPACITY, BATCH, NHEADS, NHEADS_K, D = 32, 3, 6, 2, 10
LAYOUTS = ["contiguous", "cache_batch_idx", "pages of 1", "pages of 4", "pages of 16"]
KV_MASKS = [
    dict(),
    dict(causal=True),
    dict(window_size=(3, 1)),
    dict(window_size=(-1, 0), softcap=1.5, alibi="heads"),
    dict(causal=True, window_size=(5, -1), softcap=2.0, alibi="batch"),
    dict(window_size=(2, -1), alibi="batch"),
]


def cache_layout(rng, layout, capacity=CAPACITY):
    """(k_cache, v_cache, extra arguments) for BATCH sequences of `capacity` positions;
    every row outside the sequences' keys holds random values too."""
    shape = (capacity, NHEADS_K, D)
    if layout.startswith("pages"):
        page = int(layout.split()[-1])
        pages_each = capacity // page
        num_pages = BATCH * pages_each + 2  # two pages that belong to no sequence
        table = rng.permutation(num_pages)[: BATCH * pages_each].reshape(BATCH, pages_each)
        caches = (rng.standard_normal((num_pages, page) + shape[1:]) for _ in range(2))
        return (*caches, dict(block_table=table.astype(np.int32)))
    if layout == "cache_batch_idx":
        caches = (rng.standard_normal((BATCH + 2,) + shape) for _ in range(2))
        idx = rng.permutation(BATCH + 2)[:BATCH].astype(np.int32)
        return (*caches, dict(cache_batch_idx=idx))
    return (*(rng.standard_normal((BATCH,) + shape) for _ in range(2)), {})


def rotary_table(rng, seqlen_ro, rotary_dim):
    """cos, sin of a random angle per (position, pair): a position or pair off by one turns
    a vector by a wrong angle, not by a slightly wrong one."""
    angles = rng.uniform(-math.pi, math.pi, (seqlen_ro, rotary_dim // 2))
    return np.cos(angles), np.sin(angles)


def check_kvcache(rng, layout, *, seqlen_q, append, rotary=None, rotary_dim=D, leftpad=False,
                  lens=None, alibi=None, sink=None, num_splits=1, **kw):
    """One flash_attn_with_kvcache case against the oracle: out, lse and both caches after
    the append. lens: the cache_seqlens (an array, an int or None); by default the first
    sequence's cache is empty, the last one is filled to capacity by the append. sink:
    sink_values' kind; num_splits: the oracle's split of each sequence's keys (the
    reference takes and ignores it)."""
    k_cache, v_cache, extra = cache_layout(rng, layout)
    kw.update(extra)
    q = 2 * rng.standard_normal((BATCH, seqlen_q, NHEADS, D))
    k = v = None
    if append:
        k, v = (rng.standard_normal((BATCH, append, NHEADS_K, D)) for _ in range(2))
    if lens is None:
        lens = np.array([0, rng.integers(1, CAPACITY - append), CAPACITY - append], np.int32)
    kw["cache_seqlens"] = lens
    if leftpad:
        kw["cache_leftpad"] = np.array([rng.integers(0, n + 1) for n in
                                        np.broadcast_to(lens, (BATCH,))], np.int32)
    if rotary:
        kw.update(zip(("rotary_cos", "rotary_sin"),
                      rotary_table(rng, CAPACITY + seqlen_q, rotary_dim)))
        kw["rotary_interleaved"] = rotary == "interleaved"
    if alibi is not None:
        kw["alibi_slopes"] = rng.uniform(0.05, 1.0, (NHEADS,) if alibi == "heads"
                                         else (BATCH, NHEADS))
    if sink is not None:
        kw["learnable_sink"] = sink_values(rng, NHEADS, sink)
    o, lse, kc, vc = reference.kvcache_attention(q, k_cache, v_cache, k, v,
                                                 num_splits=num_splits, **kw)
    o_w, lse_w, kc_w, vc_w = oracle.kvcache_attention(
        t(q), t(k_cache), t(v_cache), t(k), t(v), num_splits=num_splits,
        **{n: x if isinstance(x, (bool, float, int, tuple)) else t(x) for n, x in kw.items()})
    pads = kw.get("cache_leftpad")
    what = (f"{layout} seqlen_q={seqlen_q} append={append} rotary={rotary}/{rotary_dim} "
            f"leftpad={None if pads is None else pads.tolist()} "
            f"lens={np.asarray(lens).tolist()} causal={kw.get('causal')} "
            f"window={kw.get('window_size')} alibi={alibi} sink={sink} splits={num_splits}")
    assert_close(o, o_w, "out " + what)
    assert_close(lse, lse_w, "lse " + what)
    assert_close(kc, kc_w, "k_cache after " + what)
    assert_close(vc, vc_w, "v_cache after " + what)


@pytest.mark.parametrize("leftpad", [False, True])
@pytest.mark.parametrize("append", [0, 1, 4])
@pytest.mark.parametrize("rotary", [None, "interleaved", "halves"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kvcache_matches_the_oracle(rng, layout, rotary, append, leftpad):
    for n, mask in enumerate(KV_MASKS):
        check_kvcache(rng, layout, seqlen_q=(1, 3, 5)[n % 3], append=append, rotary=rotary,
                      rotary_dim=(D, 6)[n % 2], leftpad=leftpad, **mask)


@pytest.mark.parametrize("layout", ["contiguous", "pages of 4"])
def test_kvcache_lens_as_int_none_and_no_query_rows(rng, layout):
    check_kvcache(rng, layout, seqlen_q=2, append=3, lens=7, causal=True, rotary="halves")
    check_kvcache(rng, layout, seqlen_q=3, append=0, lens=None, window_size=(4, 2))
    check_kvcache(rng, layout, seqlen_q=0, append=5, rotary="interleaved", leftpad=True)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 5])
@pytest.mark.parametrize("layout", ["contiguous", "pages of 4"])
def test_kvcache_with_a_sink_and_splits_matches_the_oracle(rng, layout, num_splits):
    """Split-KV's exactness: the oracle attends each sequence's keys in num_splits parts,
    merges them and adds the sink once; the reference never splits. Sequences with an
    empty cache (rows without keys) included."""
    for n, mask in enumerate(KV_MASKS):
        check_kvcache(rng, layout, seqlen_q=(1, 3, 4)[n % 3], append=(0, 2)[n % 2],
                      sink=("normal", "huge")[n % 2], num_splits=num_splits, **mask)


@pytest.mark.parametrize("window", [(CAPACITY, -1), (-1, CAPACITY + 5)], ids=str)
def test_kvcache_rotary_with_a_window_as_wide_as_the_cache(rng, window):
    check_kvcache(rng, "contiguous", seqlen_q=3, append=2, rotary="halves", window_size=window)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_merge_matches_the_oracle(rng):
    o_a, o_b = (rng.standard_normal((2, 5, 3, 8)) for _ in range(2))
    lse_a, lse_b = (rng.standard_normal((2, 3, 5)) * 3 for _ in range(2))
    lse_a[0, 0, :2] = -np.inf                  # a part without keys: its output is not read
    o_a[0, :2, 0] = np.nan
    lse_b[0, 0, 1:3] = np.inf                  # flash-attn 2's mark of a row without keys
    o_b[0, 1:3, 0] = np.inf
    o, lse = reference.merge_states(o_a, lse_a, o_b, lse_b)
    o_w, lse_w = oracle.merge_attention_states(t(o_a), t(lse_a), t(o_b), t(lse_b))
    assert torch.isneginf(lse_w[0, 0, 1]) and (o_w[0, 1, 0] == 0).all()
    assert_close(o, o_w, "merged out")
    assert_close(lse, lse_w, "merged lse")


# -- mutants: a wrong rule in the oracle must make these comparisons fail -----------------

def _visible_swapped(seqlen_q, seqlen_k, *, causal, window_size, diag, _orig=oracle.visible):
    return _orig(seqlen_q, seqlen_k, causal=causal, window_size=window_size[::-1], diag=diag)


def _visible_shifted(seqlen_q, seqlen_k, *, causal, window_size, diag, _orig=oracle.visible):
    return _orig(seqlen_q, seqlen_k, causal=causal, window_size=window_size, diag=diag + 1)


def _visible_top_left(seqlen_q, seqlen_k, *, causal, window_size, diag, _orig=oracle.visible):
    return _orig(seqlen_q, seqlen_k, causal=causal, window_size=window_size, diag=0)


def _visible_bottom_right(seqlen_q, seqlen_k, *, causal, window_size, diag,
                          _orig=oracle.visible):
    return _orig(seqlen_q, seqlen_k, causal=causal, window_size=window_size,
                 diag=seqlen_k - seqlen_q)


def _alibi_unaligned(slopes, seqlen_q, seqlen_k, diag, _orig=oracle.alibi_bias):
    return _orig(slopes, seqlen_q, seqlen_k, 0)


def _query_positions_plus_one(cache_seqlen, seqlen_q, *, causal, window_size, capacity,
                              _orig=oracle.query_positions):
    return _orig(cache_seqlen, seqlen_q, causal=causal, window_size=window_size,
                 capacity=capacity) + 1


def _query_positions_never_local(cache_seqlen, seqlen_q, *, causal, window_size, capacity,
                                 _orig=oracle.query_positions):
    return _orig(cache_seqlen, seqlen_q, causal=False, window_size=(-1, -1), capacity=capacity)


def _rotate_other_pairs(x, cos, sin, positions, interleaved, _orig=oracle.rotate):
    return _orig(x, cos, sin, positions, not interleaved)


def _rotate_backwards(x, cos, sin, positions, interleaved, _orig=oracle.rotate):
    return _orig(x, cos, -sin, positions, interleaved)


def _attention_case(**kw):
    return lambda rng: check_attention(rng, 6, 11, 6, 2, **kw)


def _kvcache_case(**kw):
    return lambda rng: check_kvcache(rng, "pages of 4", seqlen_q=3, append=2, **kw)


MUTANTS = {  # name: (what to patch in the oracle, the wrong rule, a case that uses the rule)
    "window sides swapped": ("visible", _visible_swapped, _attention_case(window_size=(4, 1))),
    "softcap after ALiBi": ("SCORE_STEPS", ("alibi", "softcap"),
                            _attention_case(softcap=2.0, alibi="heads")),
    "causal diagonal shifted": ("visible", _visible_shifted, _attention_case(causal=True)),
    "masks aligned top-left": ("visible", _visible_top_left, _attention_case(causal=True)),
    "SDPA causal bottom-right": ("visible", _visible_bottom_right,
                                 lambda rng: check_sdpa(rng, 5, 9, 4, 2, kind="none",
                                                        is_causal=True)),
    "ALiBi aligned top-left": ("alibi_bias", _alibi_unaligned, _attention_case(alibi="batch")),
    "ALiBi sign flipped": ("alibi_bias", lambda *args, _orig=oracle.alibi_bias: -_orig(*args),
                           _attention_case(alibi="heads")),
    "leftpad ignored": ("cache_keys", lambda leftpad, lens, new: range(0, lens + new),
                        _kvcache_case(leftpad=True)),
    "KV heads interleaved": ("kv_head", lambda h, nheads, nheads_k: h % nheads_k,
                             _attention_case()),
    "query rotary position + 1": ("query_positions", _query_positions_plus_one,
                                  _kvcache_case(rotary="interleaved")),
    "query rotary position ignores causal": ("query_positions", _query_positions_never_local,
                                             _kvcache_case(rotary="halves", causal=True)),
    "key rotary position + 1": ("key_positions", lambda lens, new: lens + 1 + torch.arange(new),
                                _kvcache_case(rotary="halves")),
    "rotary pairs swapped": ("rotate", _rotate_other_pairs, _kvcache_case(rotary="halves")),
    "rotation backwards": ("rotate", _rotate_backwards, _kvcache_case(rotary="interleaved")),
    "sink added to every split": ("SINK_AFTER_MERGE", False,
                                  _kvcache_case(sink="normal", num_splits=3)),
    "sink scaled by softmax_scale": ("sink_logit", lambda sink, scale: scale * torch.as_tensor(
        sink, dtype=torch.float64), _attention_case(sink="normal", softmax_scale=0.4)),
    "sink ignored": ("sink_logit", lambda sink, scale: torch.full(
        (len(sink),), oracle.NEG_INF, dtype=torch.float64), _attention_case(sink="normal")),
}


@pytest.mark.parametrize("name", list(MUTANTS))
def test_a_wrong_rule_is_caught(rng, monkeypatch, name):
    attr, wrong, case = MUTANTS[name]
    seed = int(rng.integers(2**32))
    case(np.random.default_rng(seed))  # the case passes with the documented rule
    monkeypatch.setattr(oracle, attr, wrong)
    with pytest.raises(AssertionError):
        case(np.random.default_rng(seed))
