"""GPU: flash_attn_with_kvcache (decode and appends against a contiguous or paged cache,
rotary, leftpad, cache_batch_idx, split-KV), merge_attention_states, paged
flash_attn_varlen_func and a decode step replayed from a CUDA graph. Every output is
checked against the float64 reference (pass rule in _attention_check.py); after every
call the cache's bytes outside the new tokens are unchanged and the new slots hold the
(rotated) new keys to within 1 ulp."""
import math

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import cufa  # noqa: E402
from cufa import reference  # noqa: E402
from _attention_check import (  # noqa: E402
    append_slots, assert_pass_rule, capture_cuda_graph, check_appended_cache, check_attention, check_kvcache,
    check_merge, cu_seqlens, f64, i32, kvcache_references, make_sink, randn)

NAN = float("nan")


def paged_caches(rng, batch, capacity, heads_k, d, dtype, page_size, nan_past=None):
    """Random caches (batch, capacity, heads_k, d), NaN from key nan_past[b] on in row b
    where given, and their paged copies (pages of no sequence NaN): (k_cache, v_cache,
    k_pages, v_pages, block_table as NumPy)."""
    k_cache, v_cache = (randn(rng, (batch, capacity, heads_k, d), dtype) for _ in range(2))
    for b, n in enumerate(nan_past or ()):
        k_cache[b, n:] = NAN
        v_cache[b, n:] = NAN
    table, num_pages = reference.paged_layout(batch, capacity, page_size, rng)
    k_pages, v_pages = (reference.to_paged(c, table, num_pages, fill=NAN)
                        for c in (k_cache, v_cache))
    return k_cache, v_cache, k_pages, v_pages, table


def check_packed_sequences(out, lse, q, k_cache, v_cache, lens_q, lens_k, label, **kw):
    """Each sequence b of a packed call's out (total, h, d) and lse (h, total) against the
    reference over the first lens_k[b] keys of cache row b; sequences without query rows
    are skipped."""
    starts = np.concatenate([[0], np.cumsum(lens_q)])
    for b, n in enumerate(lens_k):
        s, e = starts[b], starts[b + 1]
        if e > s:
            check_attention(out[s:e][None], lse[:, s:e][None], q[s:e][None],
                            k_cache[b:b + 1, :n], v_cache[b:b + 1, :n],
                            label=f"{label}: seq {b} ({e - s} x {n})", **kw)


# -- building a call ----------------------------------------------------------------------

def build(rng, *, dtype="float16", batch=3, seqlen_q=1, heads=(8, 2), d=64, capacity=160,
          page_size=None, new=0, lens=None, batch_idx=False, leftpad=None, rotary=None,
          rotary_dim=None, rotary_fp32=False, alibi=None, q_layout="bshd", cache_layout="bshd",
          poison=False, sink=None, **call_kw):
    """Random inputs of one flash_attn_with_kvcache call -> (its keyword arguments, the
    cache slots the append writes as an index (cache rows or pages, positions)).

    lens: cache_seqlens as a list, a Python int, "none" (the argument left out), or None
    (random, leaving room for the new tokens and for q's rotary positions). page_size:
    a paged cache in random page order with 3 spare pages of NaN. rotary: "interleaved"
    or "half", over rotary_dim features (default d), tables in q's dtype or float32.
    alibi: "heads" (nheads,) or "batch" (batch, nheads). sink: a learnable_sink (nheads,)
    of this dtype ("float32", "float16" or "bfloat16"), draws of scale 2. poison: NaN in
    every cache slot that is not one of a sequence's keys (before the leftpad, from
    cache_seqlens on, rows no sequence uses), the new slots included: the append
    overwrites those.
    """
    h, hk = heads
    q = randn(rng, (batch, seqlen_q, h, d), dtype, layout=q_layout)
    rows = batch + 2 if batch_idx else batch
    k_cache, v_cache = (randn(rng, (rows, capacity, hk, d), dtype, layout=cache_layout)
                        for _ in range(2))
    room = capacity - max(new, seqlen_q)
    if lens is None:
        lens = [int(x) for x in rng.integers(0, room + 1, batch)]
    seqlens = np.broadcast_to(np.asarray(capacity if lens == "none" else lens), (batch,))
    assert (seqlens + new <= capacity).all(), (lens, new, capacity)
    kw = dict(q=q, **call_kw)
    if lens != "none":
        kw["cache_seqlens"] = lens if isinstance(lens, int) else i32(lens)
    idx = np.arange(batch)
    if batch_idx:
        idx = rng.permutation(rows)[:batch]
        kw["cache_batch_idx"] = i32(idx)
    pad = np.zeros(batch, np.int64)
    if leftpad is not None:
        pad = np.asarray(leftpad)
        kw["cache_leftpad"] = i32(pad)
    if new:
        kw["k"], kw["v"] = (randn(rng, (batch, new, hk, d), dtype) for _ in range(2))
    if rotary:
        rd = rotary_dim or d
        angles = rng.uniform(-math.pi, math.pi, (capacity, rd // 2))
        table_dtype = torch.float32 if rotary_fp32 else q.dtype
        kw["rotary_cos"], kw["rotary_sin"] = (
            torch.from_numpy(f(angles)).to("cuda", table_dtype) for f in (np.cos, np.sin))
        kw["rotary_interleaved"] = rotary == "interleaved"
    if alibi:
        shape = (h,) if alibi == "heads" else (batch, h)
        kw["alibi_slopes"] = torch.from_numpy(rng.uniform(0, 1, shape).astype(np.float32)).cuda()
    if sink:
        kw["learnable_sink"] = make_sink(rng, h, sink)
    if poison:
        keep = torch.zeros(rows, capacity, dtype=torch.bool, device="cuda")
        for b in range(batch):
            keep[idx[b], pad[b]:seqlens[b]] = True
        for c in (k_cache, v_cache):
            c[~keep] = NAN
    positions = seqlens[:, None] + np.arange(new)[None, :]          # (batch, new)
    if page_size:
        table, num_pages = reference.paged_layout(batch, capacity, page_size, rng)
        k_cache, v_cache = (reference.to_paged(c, table, num_pages, fill=NAN)
                            for c in (k_cache, v_cache))
        kw["block_table"] = i32(table)
    kw["k_cache"], kw["v_cache"] = k_cache, v_cache
    return kw, append_slots(positions, idx, table if page_size else None, page_size)


def snapshot(kw):
    return {n: kw[n].clone() for n in ("k_cache", "v_cache")}


def call_and_check(kw, before, slots, label, refs=None, **extra):
    """One call, out poisoned with NaN; out and lse against the references (computed here
    unless given: kvcache_references of the call before it), then the cache."""
    out = torch.full_like(kw["q"], NAN)
    res, lse = cufa.flash_attn_with_kvcache(**kw, **extra, out=out, return_softmax_lse=True)
    assert res is out, f"{label}: out= was not returned"
    assert lse.dtype == torch.float32 and lse.shape == (out.shape[0], out.shape[2], out.shape[1])
    ref, lowp, k_after, v_after = refs or kvcache_references(**{**kw, **before})
    assert_pass_rule(out, lse, ref, lowp, kw["q"].dtype, label)
    for n, after in (("k_cache", k_after), ("v_cache", v_after)):
        check_appended_cache(kw[n], before[n], after, slots, f"{label}: {n}",
                             rotated="rotary_cos" in kw)
    return out, lse


def run_case(rng, label, **spec):
    kw, slots = build(rng, **spec)
    return call_and_check(kw, snapshot(kw), slots, label)


# -- decode and append: the cases ---------------------------------------------------------

CASES = {
    # layouts, heads, head dims, dtypes
    "fp16 d64 GQA 32/8 q1": dict(heads=(32, 8)),
    "bf16 d128 MHA 4/4 q1": dict(dtype="bfloat16", heads=(4, 4), d=128),
    "fp16 d72 MQA 8/1 q4 causal": dict(heads=(8, 1), d=72, seqlen_q=4, causal=True),
    "bf16 d40 GQA q37 causal": dict(dtype="bfloat16", d=40, seqlen_q=37, causal=True,
                                    capacity=300),
    "fp16 d128 q37 non-causal": dict(d=128, seqlen_q=37, heads=(6, 2), capacity=129),
    "fp16 d256 GQA q4": dict(d=256, seqlen_q=4, capacity=100),
    "q a (b, h, s, d) view, cache row stride d+8": dict(seqlen_q=4, q_layout="bhsd",
                                                        cache_layout="padded", causal=True),
    # 512 units at d = 64: the three-stage shape, four CTAs an SM, unsplit
    "fp16 d64 64 x 512 GQA 32/8 q1 append": dict(batch=64, heads=(32, 8), capacity=512, new=1),
    "bf16 d64 64 x 512 GQA 32/8 q4 causal paged 16": dict(
        dtype="bfloat16", batch=64, heads=(32, 8), capacity=512, seqlen_q=4, causal=True,
        page_size=16),
    # and at d = 128 (d = 96 too): two warps of three stages, four CTAs an SM, unsplit
    "fp16 d128 64 x 512 GQA 32/8 q1 append": dict(batch=64, heads=(32, 8), capacity=512, new=1,
                                                  d=128),
    "bf16 d96 64 x 512 GQA 32/8 q4 causal paged 16 softcap": dict(
        dtype="bfloat16", batch=64, heads=(32, 8), capacity=512, seqlen_q=4, causal=True,
        page_size=16, d=96, softcap=8.0),
    # 1024 units (over two waves of the default shape, within two of the four-CTA one)
    "bf16 d128 128 x 80 GQA 32/8 q1 append": dict(dtype="bfloat16", batch=128, heads=(32, 8),
                                                  capacity=80, new=2, d=128),
    # paged
    "paged 1 append 1": dict(page_size=1, capacity=48, new=1),
    "paged 16 append 1 GQA 32/8": dict(page_size=16, heads=(32, 8), new=1),
    "paged 64 append 5 q4 causal bf16": dict(dtype="bfloat16", page_size=64, capacity=256, new=5,
                                             seqlen_q=4, causal=True),
    "paged 256 append 3 d128": dict(page_size=256, capacity=512, new=3, d=128),
    "paged 16 MQA d72 q37": dict(page_size=16, capacity=96, heads=(8, 1), d=72, seqlen_q=37,
                                 causal=True),
    # appends, lengths
    "append 1": dict(new=1),
    "append 7 q4 causal": dict(new=7, seqlen_q=4, causal=True),
    "append 4 q1 non-causal": dict(new=4),
    "cache_seqlens 0 append 2 q4 causal": dict(lens=[0, 0, 0], new=2, seqlen_q=4, causal=True),
    "cache_seqlens 0 no append": dict(lens=[0, 5, 0], seqlen_q=4),
    "cache_seqlens int": dict(lens=77, seqlen_q=4, causal=True),
    "cache_seqlens int append 3": dict(lens=41, new=3, page_size=16),
    "cache_seqlens int 0 append 2": dict(lens=0, new=2, seqlen_q=2, causal=True),
    "cache_seqlens left out (whole cache)": dict(lens="none", capacity=97, seqlen_q=4,
                                                 causal=True),
    "append fills the whole cache": dict(lens=[157, 150, 157], new=3, capacity=160),
    "cache_batch_idx": dict(batch_idx=True, new=2, seqlen_q=2, causal=True),
    "cache_leftpad": dict(leftpad=[0, 30, 50], lens=[10, 90, 50], seqlen_q=4, causal=True),
    "cache_leftpad append window alibi": dict(leftpad=[3, 70, 0], lens=[3, 100, 20], new=2,
                                              window_size=(25, 0), alibi="batch"),
    # masks and score mods
    "causal q1 sees everything": dict(causal=True),
    "window (40, 0)": dict(window_size=(40, 0), capacity=300),
    "window (17, 3) q4": dict(window_size=(17, 3), seqlen_q=4, new=2),
    "window (0, 0) q37": dict(window_size=(0, 0), seqlen_q=37, capacity=200),
    "softcap": dict(softcap=12.0, seqlen_q=4),
    "ALiBi (nheads,) causal": dict(alibi="heads", causal=True, seqlen_q=4),
    "ALiBi (batch, nheads) softcap bf16": dict(alibi="batch", softcap=5.0, dtype="bfloat16"),
    "softmax_scale 0.3": dict(softmax_scale=0.3, seqlen_q=4),
    # rotary
    "rotary interleaved causal append": dict(rotary="interleaved", causal=True, new=3,
                                             seqlen_q=3),
    "rotary half rotary_dim 32 < d 128": dict(rotary="half", rotary_dim=32, d=128, new=2,
                                              seqlen_q=4, causal=True),
    "rotary non-causal: q at one position": dict(rotary="interleaved", rotary_dim=48, new=1,
                                                 seqlen_q=4),
    "rotary window: q per token": dict(rotary="half", window_size=(30, 5), new=2, seqlen_q=3),
    "rotary window as wide as the cache: q at one position": dict(
        rotary="interleaved", window_size=(160, -1), capacity=160, new=2, seqlen_q=3),
    "rotary float32 tables bf16 paged 16": dict(rotary="half", rotary_fp32=True, dtype="bfloat16",
                                                page_size=16, new=3, seqlen_q=2, causal=True),
    "rotary q only (no append)": dict(rotary="interleaved", rotary_dim=16, seqlen_q=2,
                                      causal=True),
    "rotary with leftpad": dict(rotary="interleaved", leftpad=[5, 0, 12], lens=[40, 8, 12], new=2,
                                causal=True),
    "rotary cache_batch_idx": dict(rotary="half", batch_idx=True, new=1),
}


@pytest.mark.parametrize("name", CASES)
def test_case(rng, name):
    run_case(rng, name, **CASES[name])


@pytest.mark.parametrize("seed", range(16))
def test_random_calls(seed):
    rng = np.random.default_rng(1700 + seed)
    spec = random_spec(rng)
    run_case(rng, f"seed {seed}: {spec}", **spec)


def random_spec(rng):
    """A random flash_attn_with_kvcache case (build's arguments); tests/stress/fuzz.py draws
    from it too."""
    pick = (lambda options: options[int(rng.integers(len(options)))])
    page_size = pick([None, None, 1, 16, 64, 256])
    seqlen_q = pick([1, 1, 2, 4, 37])
    new = pick([0, 1, 3])
    step = page_size or 1
    capacity = step * int(rng.integers(1, max(2, 400 // step) + 1))
    capacity = -(-max(capacity, seqlen_q, new) // step) * step
    batch = int(rng.integers(1, 6))
    spec = dict(dtype=pick(["float16", "bfloat16"]), batch=batch, seqlen_q=seqlen_q,
                heads=pick([(32, 8), (8, 1), (4, 4), (6, 2)]),
                d=pick([40, 64, 72, 96, 128, 256, 3, 59, 111, 250]),  # (element-wise I/O: odd)
                capacity=capacity, page_size=page_size, new=new,
                causal=bool(rng.random() < 0.5), num_splits=pick([0, 0, 1, 3]))
    if rng.random() < 0.3:  # a side of -1 with the other set, and right sides past the keys
        spec["window_size"] = pick([
            (int(rng.integers(0, 100)), int(rng.integers(-1, 10))),
            (-1, int(rng.integers(0, 10))), (-1, int(rng.integers(capacity, capacity + 50))),
            (int(rng.integers(0, 100)), -1)])
    if rng.random() < 0.3:
        spec["sink"] = pick(["float32", "float16", "bfloat16"])
    if rng.random() < 0.3:
        spec["softcap"] = 8.0
    if rng.random() < 0.3:
        spec["alibi"] = pick(["heads", "batch"])
    if rng.random() < 0.4:
        spec.update(rotary=pick(["interleaved", "half"]), rotary_fp32=bool(rng.random() < 0.5),
                    rotary_dim=2 * int(rng.integers(1, spec["d"] // 2 + 1)))
    if not page_size and rng.random() < 0.3:
        spec["batch_idx"] = True
    room = capacity - max(new, seqlen_q)
    lens = [int(x) for x in rng.integers(0, room + 1, batch)]
    if rng.random() < 0.3:
        lens[0] = 0
    spec["lens"] = lens
    if not page_size and rng.random() < 0.3:
        spec["leftpad"] = [int(rng.integers(0, n + 1)) for n in lens]
    return spec


# -- page boundaries, empty caches --------------------------------------------------------

@pytest.mark.parametrize("page_size, lens", [
    (16, [13, 14, 16, 0, 29, 61]),      # fills a page exactly; crosses; starts a page; ...
    (1, [0, 1, 7, 45, 2, 3]),
    (256, [253, 254, 256, 0, 100, 509]),
])
def test_appends_at_page_boundaries(rng, page_size, lens):
    capacity = max(64, 2 * page_size)
    run_case(rng, f"page {page_size}", page_size=page_size, capacity=capacity, lens=lens, new=3,
             batch=len(lens), seqlen_q=3, causal=True)


def test_empty_caches_give_zero_and_minus_inf(rng):
    """cache_seqlens 0, no new keys: no row sees a key; with 2 new keys and 4 causal
    queries, rows 0 and 1 see none (bottom-right alignment) and rows 2, 3 only new keys."""
    out, lse = run_case(rng, "empty", lens=[0, 0], batch=2, seqlen_q=4, causal=True)
    assert (out == 0).all() and torch.isneginf(lse).all()
    out, lse = run_case(rng, "empty + 2 new", lens=[0, 0], batch=2, new=2, seqlen_q=4,
                        causal=True, page_size=16)
    assert (out[:, :2] == 0).all() and torch.isneginf(lse[:, :, :2]).all()
    assert torch.isfinite(lse[:, :, 2:]).all()


def test_garbage_outside_the_keys_is_never_used(rng):
    """NaN before the leftpads, from cache_seqlens on and in unused rows and pages: masked
    keys must not let 0 x NaN into the sums."""
    for spec in (dict(leftpad=[4, 0, 33], lens=[20, 9, 60], batch_idx=True),
                 dict(page_size=16, lens=[20, 0, 47]),
                 dict(page_size=64, capacity=192, lens=[64, 1, 100])):
        for new, seqlen_q in ((0, 1), (3, 4)):
            run_case(rng, f"poisoned {spec} new={new}", poison=True, new=new, seqlen_q=seqlen_q,
                     causal=seqlen_q > 1, **spec)


# -- split-KV -----------------------------------------------------------------------------

SPLIT_CASES = {
    "1 x 4000 keys fp16 d128 32/8": dict(batch=1, heads=(32, 8), d=128, capacity=4096,
                                          lens=[4000], splits=(1, 2, 7, 0, 128)),
    "paged 64 bf16 d64 q4 causal append rotary ALiBi window": dict(
        dtype="bfloat16", page_size=64, capacity=1024, batch=3, seqlen_q=4, causal=True, new=2,
        rotary="half", alibi="heads", window_size=(300, -1)),
    "MQA d72 q1 window both sides": dict(heads=(8, 1), d=72, capacity=777, batch=2,
                                         window_size=(200, 50), lens=[700, 13]),
}


@pytest.mark.parametrize("name", SPLIT_CASES)
def test_num_splits_agree(rng, name):
    """num_splits 2, 7, 0 (heuristic) against num_splits=1, row by row to fp32-accumulation
    noise (2 ulps of the output's dtype at the row's largest value), and each against the
    reference."""
    spec = dict(SPLIT_CASES[name])
    splits = spec.pop("splits", (1, 2, 7, 0))
    kw, slots = build(rng, **spec)
    before = snapshot(kw)
    refs = kvcache_references(**{**kw, **before})
    results = {}
    for n in splits:       # appends rewrite the same keys at the same places every time
        out, lse = call_and_check(kw, before, slots, f"{name} num_splits={n}", refs,
                                  num_splits=n)
        results[n] = (f64(out), lse.double().cpu().numpy())
    o1, lse1 = results[1]
    eps = torch.finfo(kw["q"].dtype).eps
    for n, (o, lse) in results.items():
        diff, bound = np.abs(o - o1).max(-1), 2 * eps * np.abs(o1).max(-1)
        worst = np.unravel_index(int(np.argmax(diff - bound)), diff.shape)
        assert (diff <= bound).all(), (
            f"{name}: num_splits={n} vs 1: {int((diff > bound).sum())} rows over 2 ulps of "
            f"their largest value; row {worst}: {diff[worst]:.3e} > {bound[worst]:.3e}")
        assert np.array_equal(np.isneginf(lse), np.isneginf(lse1))
        fin = np.isfinite(lse1)
        ldiff = np.abs(lse[fin] - lse1[fin])
        assert (ldiff <= 1e-4 + 1e-5 * np.abs(lse1[fin])).all(), (
            f"{name}: lse num_splits={n} vs 1: max diff {ldiff.max():.3e}")


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("ramp", ["large keys first", "large keys last"])
@pytest.mark.parametrize("seqlen_q", [1, 4])
def test_row_max_rising_along_the_cache(rng, d, ramp, seqlen_q):
    """Cached keys scaled 1..14x along their positions: a row's scores span about ±100 and,
    in one of the two orders, its running max rises step after step (with random keys
    alone it hardly moves after a warp's first tile), so every rescale of O and every
    split's merge weight is exercised far from 1. Unsplit, split by the planner and split
    5 ways."""
    capacity = 2048
    kw, slots = build(rng, batch=2, seqlen_q=seqlen_q, heads=(32, 8), d=d, capacity=capacity,
                      lens=[2000, 1337], causal=seqlen_q > 1)
    factor = torch.linspace(1.0, 14.0, capacity, device="cuda")
    if ramp == "large keys first":
        factor = factor.flip(0)
    kw["k_cache"] = (kw["k_cache"].float() * factor[None, :, None, None]).to(kw["k_cache"].dtype)
    before = snapshot(kw)
    refs = kvcache_references(**{**kw, **before})
    for n in (1, 0, 5):
        call_and_check(kw, before, slots, f"{ramp} num_splits={n}", refs, num_splits=n)


def test_back_to_back_split_decodes_share_the_stream_workspace(rng):
    """Split-KV partials live in a buffer each stream keeps and grows (the forward's
    packed work list too): decodes queued without a sync, growing and shrinking it, on
    two streams at once, with forward calls between them, each match the reference (a
    buffer freed or shared while a queued call still used it would mix their
    partials)."""
    shapes = [(1, 512, (8, 2), 64, 3), (2, 3000, (32, 8), 128, 16), (1, 100, (4, 4), 64, 2),
              (4, 2000, (16, 2), 128, 9), (1, 1, (2, 1), 64, 2)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    calls, forwards = [], []
    for rep in range(3):
        for i, (batch, n, heads, d, splits) in enumerate(shapes):
            kw, _ = build(rng, batch=batch, heads=heads, d=d, capacity=n, lens=[n] * batch)
            stream = streams[(i + rep) % 2]
            stream.wait_stream(torch.cuda.current_stream())
            qf = randn(rng, (1, 70 + i, 4, 64), "float16")
            kf = randn(rng, (1, 90, 2, 64), "float16")
            with torch.cuda.stream(stream):
                out, lse = cufa.flash_attn_with_kvcache(**kw, num_splits=splits,
                                                        return_softmax_lse=True)
                dense = cufa.flash_attn_func(qf, kf, kf, causal=True)
            calls.append((out, lse, kw, f"{batch} x {n} {heads} d{d} splits {splits}"))
            forwards.append((dense, qf, kf))
    torch.cuda.synchronize()
    for out, lse, kw, label in calls:
        check_kvcache(out, lse, label=label, **kw)
    for dense, qf, kf in forwards:
        check_attention(dense, None, qf, kf, kf, label=f"forward {tuple(qf.shape)}", causal=True)


# -- merge_attention_states ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("split", [0, 29, 71], ids=["empty first", "middle", "empty second"])
def test_merge_equals_attention_over_all_keys(rng, dtype, packed, split):
    """Keys [0, split) and [split, 71) attended by flash_attn_func, then merged. An empty
    part is out NaN (never read) with lse -inf."""
    b = 1 if packed else 2
    q = randn(rng, (b, 13, 4, 72), dtype)
    k, v = (randn(rng, (b, 71, 2, 72), dtype) for _ in range(2))
    parts = []
    for lo, hi in ((0, split), (split, 71)):
        if lo == hi:
            parts += [torch.full_like(q, NAN),
                      torch.full((b, 4, 13), -math.inf, dtype=torch.float32, device="cuda")]
        else:
            parts += list(cufa.flash_attn_func(q, k[:, lo:hi], v[:, lo:hi], softcap=20.0,
                                               return_lse=True))
    if packed:   # (total, nheads, d) with lse (nheads, total)
        parts = [x[0] for x in parts]
    out = torch.full_like(parts[0], NAN)
    res, lse = cufa.merge_attention_states(*parts, out=out)
    assert res is out and lse.dtype == torch.float32 and lse.shape == parts[1].shape
    if packed:
        res, lse = res[None], lse[None]
    check_attention(res, lse, q, k, v, softcap=20.0, label=f"merge split at {split}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_merge_rows_with_empty_parts(rng, dtype, packed):
    """Rows where one part, or both, saw no key (lse -inf, or flash-attn 2's +inf; output
    NaN: not read), and rows whose lse differ by 60: against reference.merge_states."""
    shape, lse_shape = ((23, 3, 40), (3, 23)) if packed else ((2, 23, 3, 40), (2, 3, 23))
    tdt = getattr(torch, dtype)
    o_a, o_b = (torch.from_numpy(rng.standard_normal(shape)).to("cuda", tdt) for _ in range(2))
    lse_a, lse_b = (torch.from_numpy(rng.standard_normal(lse_shape) * 3).float().cuda()
                    for _ in range(2))
    at = (lambda r: (slice(None), r) if packed else (slice(None), slice(None), r))
    out_at = (lambda r: (r,) if packed else (slice(None), r))
    lse_a[at(0)], o_a[out_at(0)] = -math.inf, NAN        # row 0: only part b
    lse_b[at(1)], o_b[out_at(1)] = -math.inf, NAN        # row 1: only part a
    lse_a[at(2)] = lse_b[at(2)] = -math.inf               # row 2: neither
    o_a[out_at(2)] = o_b[out_at(2)] = NAN
    lse_a[at(3)], lse_b[at(3)] = 30.0, -30.0              # row 3: part b weighs e^-60
    lse_a[at(4)], o_a[out_at(4)] = math.inf, NAN         # row 4: +inf, flash-attn 2's "no key"
    got, got_lse = cufa.merge_attention_states(o_a, lse_a, o_b, lse_b)
    check_merge(got, got_lse, (o_a, lse_a, o_b, lse_b), dtype)
    assert (f64(got)[out_at(2)] == 0).all() and torch.isneginf(got_lse[at(2)]).all()


# -- CUDA graphs ---------------------------------------------------------------------------

@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "paged 16"])
def test_decode_step_replayed_from_a_cuda_graph(rng, page_size):
    """One decode step (append 1 token, attend, split-KV on: 2 x 2 KV heads over 1024
    positions) captured once; each replay with new lengths, page table, q and new keys
    copied into the captured tensors."""
    batch, capacity = 2, 1024
    kw, _ = build(rng, batch=batch, heads=(16, 2), d=128, capacity=capacity, page_size=page_size,
                  new=1, lens=[5, 700], causal=True)
    out = torch.full_like(kw["q"], NAN)
    graph, (_, lse) = capture_cuda_graph(
        lambda: cufa.flash_attn_with_kvcache(**kw, out=out, return_softmax_lse=True))
    for replay in range(3):
        lens = rng.integers(0, capacity, batch)
        lens[replay % batch] = capacity - 1 if replay == 1 else 0
        kw["cache_seqlens"].copy_(i32(lens))
        if page_size:  # the same pages (not the spare ones, of NaN), dealt out anew
            table = rng.permutation(kw["block_table"].cpu().numpy().ravel()).reshape(batch, -1)
            kw["block_table"].copy_(i32(table))
        for n in ("q", "k", "v"):
            kw[n].copy_(torch.randn_like(kw[n]))
        before = snapshot(kw)
        out.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        label = f"replay {replay} lens {lens.tolist()}"
        positions = lens[:, None]
        if page_size:
            slots = (table[np.arange(batch)[:, None], positions // page_size],
                     positions % page_size)
        else:
            slots = (np.arange(batch)[:, None], positions)
        slots = tuple(s.ravel() for s in slots)
        k_after, v_after = check_kvcache(out, lse, label=label, **{**kw, **before})
        for n, after in (("k_cache", k_after), ("v_cache", v_after)):
            check_appended_cache(kw[n], before[n], after, slots, f"{label}: {n}",
                                 rotated="rotary_cos" in kw)


@pytest.mark.parametrize("d, heads, seqlen_q, num_splits, page_size", [
    (64, (12, 3), 1, 3, None),    # a warp a row (3 KV heads: one a CTA, no head pairs)
    (72, (8, 2), 1, 5, 16),       # 9 column chunks: groups do not divide the CTA's threads
    (128, (4, 4), 1, 12, None),   # decode_combine's CTA a row
    (64, (3, 3), 1, 40, 16),      # more splits than a warp's lanes (3 KV heads: no head pairs)
    (256, (4, 2), 1, 3, None),    # a 64-thread decode CTA
    (59, (8, 2), 1, 3, None),     # the element-wise I/O kernels: partial rows of 64 floats
    (111, (4, 4), 1, 12, 16),     # the same, decode_combine's CTA a row
], ids=["d64 3 splits", "d72 paged 5 splits", "d128 12 splits", "d64 paged 40 splits",
        "d256 3 splits", "d59 3 splits", "d111 paged 12 splits"])
@pytest.mark.parametrize("tma", ["0", "1"], ids=["cp.async", "tma"])
def test_eager_merge_gives_the_bits_of_the_graph_merge(rng, monkeypatch, d, heads, seqlen_q,
                                                       num_splits, page_size, tma):
    """An eager split call whose merge one pass of the decode CTA covers merges in the
    decode launch, from an idle stream and behind queued work alike (the counters the
    kernel leaves zeroed serve the next call); a graph replay of it merges in
    decode_combine. Both sum in the same order, so the bits agree."""
    from cufa import _compile, _decode_plan, _runtime
    # both decode kernels where they run (the TMA one: contiguous d = 64 on Hopper)
    monkeypatch.setitem(_compile._overrides, _compile.DECODE_TMA_ENV, tma)
    _runtime.plans.clear()
    taken, counters = [], _runtime.stream_split_counters
    monkeypatch.setattr(_decode_plan, "stream_split_counters",
                        lambda *args: taken.append(args) or counters(*args))
    kw, _ = build(rng, batch=2, heads=heads, d=d, seqlen_q=seqlen_q, capacity=1024,
                  page_size=page_size, lens=[1000, 333], num_splits=num_splits)
    torch.cuda.synchronize()
    eager_out, eager_lse = cufa.flash_attn_with_kvcache(**kw, return_softmax_lse=True)
    assert taken, "the eager call was to merge in its decode launch"
    # (a call whose outputs are freed, so the queued call's come from the allocator's cache:
    # a fresh cudaMalloc may wait for the device, and the queue would be empty again)
    spare = cufa.flash_attn_with_kvcache(**kw, return_softmax_lse=True)
    del spare
    merged = len(taken)
    torch.cuda._sleep(1_000_000)  # (work queued ahead)
    queued_out, queued_lse = cufa.flash_attn_with_kvcache(**kw, return_softmax_lse=True)
    assert len(taken) == merged + 1, "behind queued work too the launch was to merge"
    assert torch.equal(queued_out.view(torch.int16), eager_out.view(torch.int16))
    assert torch.equal(queued_lse.view(torch.int32), eager_lse.view(torch.int32))
    out = torch.full_like(kw["q"], NAN)
    graph, (_, lse) = capture_cuda_graph(
        lambda: cufa.flash_attn_with_kvcache(**kw, out=out, return_softmax_lse=True))
    out.fill_(NAN)
    lse.fill_(NAN)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), eager_out.view(torch.int16))
    assert torch.equal(lse.view(torch.int32), eager_lse.view(torch.int32))
    check_kvcache(eager_out, eager_lse, label="eager", **kw)


# -- paged varlen ---------------------------------------------------------------------------

@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize("seqused", [False, True], ids=["cu_seqlens_k", "seqused_k"])
def test_varlen_with_block_table(rng, page_size, seqused):
    """Packed queries against a paged cache: sequence b's keys are its positions 0..len-1
    through block_table[b] (len = seqused_k[b], else from cu_seqlens_k)."""
    lens_q = [1, 7, 0, 33, 5, 64]
    lens_k = [40, 7, 3, 300, 0, 512]
    used = [17, 7, 0, 257, 0, 1] if seqused else lens_k
    batch, capacity, h, hk, d = len(lens_q), 512, 8, 2, 64 if page_size == 16 else 128
    dtype = "float16" if page_size == 16 else "bfloat16"
    q = randn(rng, (1, sum(lens_q), h, d), dtype)[0]
    k_cache, v_cache, k_pages, v_pages, table = paged_caches(rng, batch, capacity, hk, d, dtype,
                                                             page_size)
    out = torch.full_like(q, NAN)
    res, lse = cufa.flash_attn_varlen_func(
        q, k_pages, v_pages, cu_seqlens(lens_q), cu_seqlens(lens_k), max(lens_q), max(lens_k),
        causal=True, return_lse=True, out=out, block_table=i32(table),
        seqused_k=i32(used) if seqused else None)
    assert res is out and lse.shape == (h, sum(lens_q))
    check_packed_sequences(out, lse, q, k_cache, v_cache, lens_q, used,
                           f"paged varlen page {page_size}", causal=True)


PAGED_PREFILL_OPTIONS = {
    # head dim, dtype and options: Hopper key blocks of 128, 64 and 32 rows here (80, in
    # boxes of 16 rows, under CUFA_SM90_BLOCK_M=192: bench/device_run.sh); d = 96 on the
    # d = 128 tiles, its last 32 columns past the map's end
    "d64": (64, "float16", dict(causal=True)),
    "d128 bf16": (128, "bfloat16", dict(causal=True)),
    "d96 window": (96, "float16", dict(causal=True, window_size=(100, 0))),
    "d256": (256, "float16", {}),
    "d256 softcap": (256, "bfloat16", dict(causal=True, softcap=20.0)),
}


@pytest.mark.parametrize("page_size", [1, 4, 8, 16, 32, 64, 128, 256])
@pytest.mark.parametrize("name", PAGED_PREFILL_OPTIONS)
def test_varlen_paged_prefill_every_page_size(rng, page_size, name):
    """Chunked prefill against a paged cache, every page size (Hopper: key blocks by TMA
    boxes inside pages from 8 rows, the sequence's last block by cp.async): each
    sequence's keys past its length hold NaN in its own pages, which must not reach the
    output; lengths that end on a page, inside one, and on a key block's end."""
    d, dtype, options = PAGED_PREFILL_OPTIONS[name]
    lens_q = [37, 200, 0, 129, 64, 7]
    lens_k = [300, 200, 5, 1000, 1024, 7]
    batch, h, hk = len(lens_q), 4, 1
    capacity = 1024
    q = randn(rng, (1, sum(lens_q), h, d), dtype)[0]
    k_cache, v_cache, k_pages, v_pages, table = paged_caches(rng, batch, capacity, hk, d, dtype,
                                                             page_size, nan_past=lens_k)
    out = torch.full_like(q, NAN)
    res, lse = cufa.flash_attn_varlen_func(
        q, k_pages, v_pages, cu_seqlens(lens_q), cu_seqlens(lens_k), max(lens_q), max(lens_k),
        return_lse=True, out=out, block_table=i32(table), **options)
    check_packed_sequences(out, lse, q, k_cache, v_cache, lens_q, lens_k,
                           f"{name} pages of {page_size}", **options)


@pytest.mark.parametrize("page_size", [8, 16, 256])
def test_varlen_paged_prefill_reads_kv_pages_interleaved(rng, page_size):
    """K and V as views of one (num_pages, 2, page_size, nheads_k, d) cache (FlashInfer's
    layout): pages twice as far apart as a page's rows, read through the maps' strides."""
    lens_q, lens_k = [100, 9, 300], [400, 9, 777]
    batch, h, hk, d, capacity = 3, 8, 2, 128, 1024
    q = randn(rng, (1, sum(lens_q), h, d), "float16")[0]
    k_cache, v_cache, *pages, table = paged_caches(rng, batch, capacity, hk, d, "float16",
                                                   page_size, nan_past=lens_k)
    kv = torch.stack(pages, dim=1)
    k_pages, v_pages = kv[:, 0], kv[:, 1]
    assert k_pages.stride(0) == 2 * page_size * hk * d
    out = torch.full_like(q, NAN)
    res, lse = cufa.flash_attn_varlen_func(
        q, k_pages, v_pages, cu_seqlens(lens_q), cu_seqlens(lens_k), max(lens_q), max(lens_k),
        causal=True, return_lse=True, out=out, block_table=i32(table))
    check_packed_sequences(out, lse, q, k_cache, v_cache, lens_q, lens_k,
                           f"interleaved pages of {page_size}", causal=True)


PAGED_MIXED_CASES = {
    # heads (T = 16 // group query rows go to the decode kernel), lens_q, lens_k, options
    "GQA 8/2 causal": ((8, 2), [1, 2, 3, 4, 5, 0, 1, 4, 40], [90, 2, 700, 1, 33, 5, 0, 4, 300],
                       dict(causal=True)),
    "MQA 16/1 window softcap": ((16, 1), [1, 2, 3, 1, 64], [500, 1, 2, 0, 200],
                                dict(causal=True, window_size=(37, 0), softcap=15.0)),
    "MHA 4/4 ALiBi, not causal": ((4, 4), [16, 17, 1, 9], [60, 61, 1, 200],
                                  dict(alibi_slopes=True)),
    "2 sequences, long keys: split": ((8, 1), [1, 2], [3000, 2100], dict(causal=True)),
}


@pytest.mark.parametrize("name", PAGED_MIXED_CASES)
def test_varlen_paged_short_sequences_take_the_decode_kernel(rng, name):
    """A serving batch: sequences of up to 16 / group query rows go to the decode kernel
    (each GQA group one tile), the rest to the forward; the out and lse of every sequence,
    whichever kernel took it, match the reference (out poisoned before the call)."""
    (h, hk), lens_q, lens_k, options = PAGED_MIXED_CASES[name]
    batch, d, page_size = len(lens_q), 128, 16
    capacity = -(-max(lens_k) // page_size) * page_size
    q = randn(rng, (1, sum(lens_q), h, d), "float16")[0]
    k_cache, v_cache, k_pages, v_pages, table = paged_caches(rng, batch, capacity, hk, d,
                                                             "float16", page_size)
    kw = dict(options)
    if kw.pop("alibi_slopes", False):
        kw["alibi_slopes"] = torch.from_numpy(rng.uniform(0, 1, h).astype(np.float32)).cuda()
    cu_q = cu_seqlens(lens_q)
    out = torch.full_like(q, NAN)
    res, lse = cufa.flash_attn_varlen_func(
        q, k_pages, v_pages, cu_q, cu_seqlens(lens_k), max(lens_q), max(lens_k),
        return_lse=True, out=out, block_table=i32(table), **kw)
    check_packed_sequences(out, lse, q, k_cache, v_cache, lens_q, lens_k, name, **kw)


# -- device values: checked, or clamped ------------------------------------------------------

def test_check_inputs_refuses_bad_device_values(rng):
    kw, _ = build(rng, page_size=16, capacity=64, new=2, lens=[10, 20, 30])
    before = snapshot(kw)
    num_pages = kw["k_cache"].shape[0]
    call = (lambda **changes: cufa.flash_attn_with_kvcache(**{**kw, **changes},
                                                           check_inputs=True))
    for bad_id in (num_pages, -1):
        table = kw["block_table"].clone()
        table[1, 2] = bad_id
        with pytest.raises(ValueError, match="block_table"):
            call(block_table=table)
    for lens in ([10, 63, 30], [-1, 20, 30]):    # 63 + 2 new > 64 positions
        with pytest.raises(ValueError, match="cache_seqlens"):
            call(cache_seqlens=i32(lens))
    flat, _ = build(rng, capacity=64, lens=[10, 20, 30])
    with pytest.raises(ValueError, match="cache_leftpad"):
        cufa.flash_attn_with_kvcache(**flat, cache_leftpad=i32([0, 21, 0]), check_inputs=True)
    for n in before:   # refused before any launch: nothing appended
        assert torch.equal(kw[n].view(torch.int16), before[n].view(torch.int16))
    call()             # the good values pass


def test_bad_values_without_the_check_stay_inside_the_arrays(rng):
    """Page ids outside the cache, negative and too-large lengths, cache_batch_idx and
    leftpads out of range, without check_inputs: the call returns, the device stays
    healthy, and the guard regions around the cache and out are untouched."""
    for paged in (True, False):
        batch, h, hk, d, capacity = 3, 8, 2, 64, 64
        kw, _ = build(rng, batch=batch, heads=(h, hk), d=d, capacity=capacity, new=2,
                      page_size=16 if paged else None, batch_idx=not paged, lens=[1, 2, 3])
        guarded = {}
        for n in ("k_cache", "v_cache"):
            buf = torch.full((kw[n].shape[0] + 2,) + kw[n].shape[1:], 7.0, dtype=kw[n].dtype,
                             device="cuda")
            buf[1:-1] = kw[n]
            kw[n], guarded[n] = buf[1:-1], buf
        out_buf = torch.full((batch + 2, 1, h, d), 7.0, dtype=kw["q"].dtype, device="cuda")
        kw["cache_seqlens"] = i32([-3, 10**6, capacity - 1])
        if paged:
            kw["block_table"] = i32([[0, 1000, -5, 2], [-1, 2**30, 3, 3], [9, 0, 0, 1]])
        else:
            kw["cache_batch_idx"] = i32([batch + 7, -1, 0])
            kw["cache_leftpad"] = i32([100, -4, 70])
        cufa.flash_attn_with_kvcache(**kw, out=out_buf[1:-1], num_splits=3)
        cufa.flash_attn_with_kvcache(**kw, out=out_buf[1:-1])
        torch.cuda.synchronize()
        for n, buf in guarded.items():
            assert (buf[0] == 7).all() and (buf[-1] == 7).all(), f"{n}: guard region written"
        assert (out_buf[0] == 7).all() and (out_buf[-1] == 7).all(), "out: guard region written"
    run_case(rng, "a good call after the bad ones", page_size=16, new=1)


# -- cache_leftpad on a paged cache ---------------------------------------------------------

@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
@pytest.mark.parametrize("new, rotary", [(0, None), (3, None), (2, "interleaved"), (0, "half")],
                         ids=["no append", "append 3", "append 2 rotary", "rotary q only"])
@pytest.mark.parametrize("num_splits", [1, 3], ids=["unsplit", "3 splits"])
def test_cache_leftpad_on_a_paged_cache(rng, page_size, new, rotary, num_splits):
    """Sequence b's keys start at cache position leftpad[b] of its pages: 0, inside the
    first page, on a page's first row, and at the old keys' end (only new keys, or none:
    0 and lse -inf). Pages of 256 read whole pages only without a leftpad, so with one
    they take the per-key page lookup. NaN before each leftpad and past each sequence's
    keys must not reach the output."""
    capacity = max(2 * page_size, 128)
    lens = [70, 100, capacity - 8, 40]
    leftpad = [0, 17, page_size, 40]
    run_case(rng, f"pages of {page_size} leftpad {leftpad}", page_size=page_size,
             capacity=capacity, batch=4, lens=lens, leftpad=leftpad, new=new, seqlen_q=4,
             causal=True, rotary=rotary, poison=True, num_splits=num_splits,
             d=128 if page_size == 256 else 64)


# -- appends without queries, calls without new keys ------------------------------------------

@pytest.mark.parametrize("seqlen_q, new", [(0, 3), (2, 0), (0, 0)],
                         ids=["0 query rows, 3 new keys", "k and v of 0 tokens",
                              "0 query rows, 0 new keys"])
@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "paged 16"])
def test_append_with_zero_query_rows_or_zero_new_keys(rng, seqlen_q, new, page_size):
    """q of 0 rows (an append alone, as a chunked prefill writes its keys before
    attending) and k, v of 0 tokens (an append of nothing): out and lse of q's 0 or 2
    rows, the new keys (rotated) in their slots and every other cache byte unchanged."""
    kw, slots = build(rng, seqlen_q=seqlen_q, new=new, page_size=page_size,
                      rotary="interleaved", causal=True, lens=[0, 37, 100])
    if not new:
        kw["k"], kw["v"] = (randn(rng, (3, 0, 2, 64), "float16") for _ in range(2))
    out, lse = call_and_check(kw, snapshot(kw), slots, f"q {seqlen_q} rows, {new} new keys")
    assert out.shape == (3, seqlen_q, 8, 64) and lse.shape == (3, 8, seqlen_q)


# -- bfloat16 CuPy arrays ------------------------------------------------------------------

def cupy_bf16(t):
    """A bfloat16 CuPy array on t's memory (CuPy takes bfloat16 through ml_dtypes; DLPack
    hands it over as int16)."""
    import cupy
    import ml_dtypes
    return cupy.from_dlpack(t.view(torch.int16)).view(ml_dtypes.bfloat16)


def test_bfloat16_cupy_arrays_decode_and_append(rng):
    """Every array of a paged append with rotary (tables in bfloat16), ALiBi and 3 splits
    as CuPy arrays, the bfloat16 ones on the memory of torch tensors: the cache written
    in place, out and lse against the reference."""
    cupy = pytest.importorskip("cupy")
    pytest.importorskip("ml_dtypes")
    kw, slots = build(rng, dtype="bfloat16", page_size=16, new=2, seqlen_q=3, causal=True,
                      rotary="half", alibi="heads", lens=[5, 0, 90])
    before = snapshot(kw)
    out = torch.full_like(kw["q"], NAN)
    as_cupy = {n: cupy_bf16(x) if x.dtype == torch.bfloat16 else cupy.from_dlpack(x)
               for n, x in kw.items() if isinstance(x, torch.Tensor)}
    torch.cuda.synchronize()
    res, lse = cufa.flash_attn_with_kvcache(**{**kw, **as_cupy}, out=cupy_bf16(out),
                                            num_splits=3, return_softmax_lse=True)
    cupy.cuda.get_current_stream().synchronize()
    assert isinstance(res, cupy.ndarray) and res.dtype.name == "bfloat16"
    assert res.data.ptr == out.data_ptr() and isinstance(lse, cupy.ndarray)
    ref, lowp, k_after, v_after = kvcache_references(**{**kw, **before})
    assert_pass_rule(out, torch.from_dlpack(lse), ref, lowp, torch.bfloat16, "cupy bf16")
    for n, after in (("k_cache", k_after), ("v_cache", v_after)):
        check_appended_cache(kw[n], before[n], after, slots, f"cupy bf16: {n}", rotated=True)


# -- merge_attention_states: in place, strided, NaN ------------------------------------------

def merge_parts(rng, dtype, packed, special_rows=True, d=72):
    """Random (out_a, lse_a, out_b, lse_b), dense (2, 29, 3, d) or packed (29, 3, d); with
    special_rows, row 0 of part a has lse NaN, row 1 of part b NaN with part a -inf, row
    2 both -inf and row 3 part a -inf; outputs no one reads are NaN."""
    shape, lse_shape = ((29, 3, d), (3, 29)) if packed else ((2, 29, 3, d), (2, 3, 29))
    o_a, o_b = (torch.from_numpy(rng.standard_normal(shape)).to("cuda", getattr(torch, dtype))
                for _ in range(2))
    lse_a, lse_b = (torch.from_numpy(rng.standard_normal(lse_shape) * 3).float().cuda()
                    for _ in range(2))
    if special_rows:
        row = (lambda r: (slice(None), r) if packed else (slice(None), slice(None), r))
        out_row = (lambda r: (r,) if packed else (slice(None), r))
        lse_a[row(0)] = NAN
        lse_b[row(1)], lse_a[row(1)], o_a[out_row(1)] = NAN, -math.inf, NAN
        lse_a[row(2)] = lse_b[row(2)] = -math.inf
        o_a[out_row(2)] = o_b[out_row(2)] = NAN
        lse_a[row(3)], o_a[out_row(3)] = -math.inf, NAN
    return o_a, lse_a, o_b, lse_b


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("into", ["out_a", "out_b"])
def test_merge_into_one_of_its_inputs(rng, dtype, packed, into):
    """out= is out_a or out_b (a merge in place), with NaN and -inf lse rows: each
    element is read before it is written, and an unread part's NaN never gets in. NaN
    lse gives a NaN row (docs/api.md)."""
    parts = merge_parts(rng, dtype, packed)
    before = tuple(x.clone() for x in parts)
    target = parts[0] if into == "out_a" else parts[2]
    res, lse = cufa.merge_attention_states(*parts, out=target)
    assert res is target
    check_merge(res, lse, before, f"{dtype} into {into}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_merge_strided_inputs_and_out(rng, dtype, packed):
    """Every input a strided view: out_a transposed from a (heads, rows) buffer, out_b every
    other column of a buffer twice as wide, lse_a transposed, lse_b every other row; out
    with a row stride of d + 8 (its padding untouched), and out left to cufa."""
    contiguous = merge_parts(rng, dtype, packed)
    o_a, lse_a, o_b, lse_b = (x.clone() for x in contiguous)
    rows_first = (lambda x: x.transpose(0, 1)) if packed else (lambda x: x.transpose(1, 2))
    o_a = rows_first(rows_first(o_a).contiguous())
    wide = torch.from_numpy(rng.standard_normal(o_b.shape[:-1] + (2 * o_b.shape[-1],))).to(o_b)
    wide[..., ::2] = o_b
    o_b = wide[..., ::2]
    lse_a = lse_a.transpose(-1, -2).contiguous().transpose(-1, -2)
    spread = torch.full(lse_b.shape[:-1] + (2 * lse_b.shape[-1],), 5.0, device="cuda")
    spread[..., ::2] = lse_b
    lse_b = spread[..., ::2]
    assert not any(x.is_contiguous() for x in (o_a, o_b, lse_a, lse_b))
    d = o_a.shape[-1]
    padded = torch.full(o_a.shape[:-1] + (d + 8,), 7.0, device="cuda", dtype=o_a.dtype)
    res, lse = cufa.merge_attention_states(o_a, lse_a, o_b, lse_b, out=padded[..., :d])
    check_merge(res, lse, contiguous, f"{dtype} strided, out= strided")
    assert (padded[..., d:] == 7).all(), "out's padding columns written"
    res, lse = cufa.merge_attention_states(o_a, lse_a, o_b, lse_b)
    assert res.is_contiguous() and lse.is_contiguous()
    check_merge(res, lse, contiguous, f"{dtype} strided, out allocated")
