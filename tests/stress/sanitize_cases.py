"""Small launches of every kernel variant at odd sizes, each call's values checked.

tests/stress/sanitize.sh runs this under compute-sanitizer's memcheck and racecheck.

    python3 tests/stress/sanitize_cases.py                  # every call
    python3 tests/stress/sanitize_cases.py --kvcache-only   # the KV-cache, paged and merge calls

One call per (dtype, head dim family, mask kind, score mods) at sequence lengths 1, 7,
65 and 129 (never a multiple of a tile), the element-wise I/O variants (a head dim off
every padded one, unaligned arrays) of the forward and decode kernels, learnable sinks of
each dtype on the dense, packed and decode paths (split too), packed batches with empty
sequences and sequences without keys, SDPA with broadcast boolean and additive masks, and
the KV-cache kernels: every decode variant (contiguous and paged, split and not, with
appends, rotary and leftpad), malformed lengths and page ids (clamped, never an access
outside), merges and paged packed batches (their decode-sized sequences on the decode
kernel, split).

Every call's out (and lse where it returns one, and the caches after an append) is
checked with the GPU tests' pass rule (tests/_attention_check.py) against the float64
reference; merges against the float64 formula. The low-precision reference multiplies
on the CPU here, so that only cufa's kernels run under the sanitizer. A sequence given
malformed lengths or page ids has no defined result; the other sequences of its call are
checked. The last line counts calls and checks; the exit status is 1 if a check failed.
"""
import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
sys.path[:0] = [os.path.dirname(TESTS), TESTS]

import torch  # noqa: E402

import cufa  # noqa: E402
from cufa import _compile, reference  # noqa: E402
import _attention_check  # noqa: E402
from _attention_check import (  # noqa: E402
    check_attention, check_kvcache, check_merge, cu_seqlens, f64, i32, make_sink, randn)

_attention_check.LOWP_DEVICE = "cpu"
DIMS = {"sm80": (32, 64, 96, 128, 160, 192, 224, 256), "sm90": (64, 128, 192, 256)}
SINK_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
NAN = float("nan")


class Tally:
    """Calls made and their value checks: a failed check is printed and counted, and the
    run goes on, so that the sanitizer still sees every launch."""

    def __init__(self):
        self.calls = 0
        self.failed = 0

    def check(self, label, verify, *args, **kw):
        self.calls += 1
        try:
            verify(*args, label=label, **kw)
        except AssertionError as e:
            self.failed += 1
            message = str(e) if str(e).startswith(label) else f"{label}: {e}"
            print(f"FAILED {message}", flush=True)


def _t(rng, shape, dtype):
    return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).to("cuda", dtype)


def check_cache(cache, expected, label, rows=None):
    """A cache after an append against the reference's float64 cache (both NaN, or within
    one rounding to the cache's dtype: the rotation runs in float32, then rounds once).
    rows: only these block_table rows' pages (the sequences whose result is defined)."""
    got = cache if rows is None else reference.from_paged(cache, rows)
    got = f64(got)
    if rows is not None:
        expected = reference.from_paged(expected, rows)
    fi = torch.finfo(cache.dtype)
    same = (got == expected) | (np.isnan(got) & np.isnan(expected))
    err = np.where(same, 0.0, np.abs(got - expected))
    bound = fi.eps * np.maximum(np.maximum(np.abs(got), np.abs(expected)), fi.tiny)
    bad = ~(err <= bound)
    assert not bad.any(), (f"{label}: {int(bad.sum())} cache values differ from the reference, "
                           f"the first at {tuple(int(i) for i in np.argwhere(bad)[0])}")


def check_call(out, lse, q, k_cache, v_cache, k=None, v=None, *, label, after=None, rows=None,
               **kw):
    """flash_attn_with_kvcache's out and lse, then the caches after it (after: the caches
    as the call left them; k_cache, v_cache: clones from before it)."""
    k_after, v_after = check_kvcache(out, lse, q, k_cache, v_cache, k, v, label=label, **kw)
    for cache, expected, name in zip(after or (), (k_after, v_after), ("k_cache", "v_cache")):
        check_cache(cache, expected, f"{label}: {name}", rows)


def check_packed(out, lse, q, seq_keys, lens_q, *, label, **kw):
    """A packed call's sequences b (lens_q[b] query rows; seq_keys: b -> (k, v) of the
    sequence, (1, keys, heads_k, d), or None where its result is undefined)."""
    starts = np.concatenate([[0], np.cumsum(lens_q)])
    for b, (s, e) in enumerate(zip(starts[:-1], starts[1:])):
        kv = seq_keys(b)
        if e > s and kv is not None:
            check_attention(out[s:e][None], None if lse is None else lse[:, s:e][None],
                            q[s:e][None], *kv, label=f"{label}: seq {b}", **kw)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kvcache-only", action="store_true",
                        help="only the KV-cache, paged and merge calls")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    capability = torch.cuda.get_device_capability()
    family = _compile.family_for(capability[0] * 10 + capability[1])
    tally = Tally()
    if args.kvcache_only:
        kvcache_cases(rng, tally)
        what = " (KV-cache only)"
    else:
        forward_cases(rng, tally, family)
        kvcache_cases(rng, tally)
        what = ""
    torch.cuda.synchronize()
    print(f"sanitize cases: {tally.calls} calls{what}, family {family}; value checks: "
          f"{tally.calls - tally.failed} passed, {tally.failed} failed")
    return 1 if tally.failed else 0


def forward_cases(rng, tally, family):
    for dtype in (torch.float16, torch.bfloat16):
        for d in DIMS[family]:
            for causal in (False, True):
                for mods in (False, True):
                    # causal is the window kernel; a two-sided window takes its other branches
                    window = (9, 3) if causal and mods else (-1, -1)
                    for sq, sk in ((1, 7), (65, 129), (129, 65)):
                        q, k, v = _t(rng, (2, sq, 4, d), dtype), *(_t(rng, (2, sk, 2, d), dtype)
                                                                 for _ in range(2))
                        kw = dict(causal=causal and not mods, window_size=window)
                        if mods:
                            kw.update(softcap=5.0, alibi_slopes=torch.rand(4, device="cuda"))
                        # without lse (the kernels skip it) at one size; out= at another
                        want_lse = (sq, sk) != (65, 129)
                        out = torch.full_like(q, NAN) if (sq, sk) == (129, 65) else None
                        res = cufa.flash_attn_func(q, k, v, return_lse=want_lse, out=out, **kw)
                        res, lse = res if want_lse else (res, None)
                        tally.check(f"{dtype} d={d} causal={causal} mods={mods} {sq}x{sk}",
                                    check_attention, res, lse, q, k, v, **kw)
    # the element-wise I/O variants: a head dim 3 under every padded one, unaligned arrays,
    # a sink of each dtype in turn
    for i, (dtype, d) in enumerate((dt, d) for dt in (torch.float16, torch.bfloat16)
                                   for d in _compile.SM80_HEAD_DIMS):
        q = randn(rng, (2, 65, 4, d - 3), dtype, layout="odd")
        k, v = (randn(rng, (2, 129, 2, d - 3), dtype, layout="odd") for _ in range(2))
        kw = dict(causal=bool(i % 2), learnable_sink=make_sink(rng, 4, SINK_DTYPES[i % 3]))
        out, lse = cufa.flash_attn_func(q, k, v, return_lse=True, **kw)
        tally.check(f"element-wise {dtype} d={d - 3} causal={kw['causal']} sink "
                    f"{kw['learnable_sink'].dtype}", check_attention, out, lse, q, k, v, **kw)
    # sinks on the device's own family's dense kernels (one per sink dtype), and packed
    for i, sink_dtype in enumerate(SINK_DTYPES):
        d = DIMS[family][i % len(DIMS[family])]
        q, k, v = _t(rng, (2, 65, 4, d), torch.bfloat16), *(_t(rng, (2, 129, 2, d), torch.bfloat16)
                                                           for _ in range(2))
        kw = dict(causal=i != 1, learnable_sink=make_sink(rng, 4, sink_dtype))
        out, lse = cufa.flash_attn_func(q, k, v, return_lse=True, **kw)
        tally.check(f"sink {sink_dtype} d={d}", check_attention, out, lse, q, k, v, **kw)
    # packed batches: empty sequences, sequences without keys, seqused_k
    lens_q, lens_k = [0, 1, 7, 65, 129, 0], [3, 0, 7, 129, 65, 1]
    used = [2, 0, 7, 100, 65, 1]
    starts_k = np.concatenate([[0], np.cumsum(lens_k)])
    for causal in (False, True):
        q = _t(rng, (sum(lens_q), 4, 64), torch.float16)
        k, v = (_t(rng, (sum(lens_k), 1, 64), torch.float16) for _ in range(2))
        sink = {"learnable_sink": make_sink(rng, 4, torch.float32)} if causal else {}
        out = cufa.flash_attn_varlen_func(q, k, v, cu_seqlens(lens_q), cu_seqlens(lens_k), 129, 129,
                                          causal=causal, seqused_k=i32(used), **sink)
        tally.check(f"varlen seqused_k causal={causal}{' sink' if sink else ''}", check_packed,
                    out, None, q,
                    lambda b: tuple(x[starts_k[b]:starts_k[b] + used[b]][None] for x in (k, v)),
                    lens_q, causal=causal, **sink)
    # SDPA: broadcast boolean and additive masks at odd sizes
    for mask_dtype in (torch.bool, torch.float16):
        q = _t(rng, (2, 4, 65, 64), torch.float16)
        k, v = (_t(rng, (2, 4, 129, 64), torch.float16) for _ in range(2))
        mask = torch.from_numpy(rng.random((2, 1, 65, 129)) > 0.3).cuda()
        mask = mask if mask_dtype == torch.bool else mask.to(mask_dtype) * -3.0
        out = cufa.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
        tr = (lambda x: x.transpose(1, 2))
        tally.check(f"sdpa {mask_dtype} mask", check_attention, tr(out), None, tr(q), tr(k),
                    tr(v), attn_mask=mask, causal=True, diag_offset=0)


def kvcache_cases(rng, tally):
    """Every decode variant once at odd lengths, then the paths the values steer."""
    for dtype in (torch.float16, torch.bfloat16):
        for d in _compile.DECODE_HEAD_DIMS:
            q = _t(rng, (3, 2, 8, d), dtype)
            cache = _t(rng, (3, 97, 2, d), dtype)
            new = _t(rng, (3, 3, 2, d), dtype)
            for splits in (1, 5):
                v_cache = cache.clone()
                before = cache.clone(), v_cache.clone()
                kw = dict(cache_seqlens=i32([0, 50, 94]), causal=True, num_splits=splits)
                out, lse = cufa.flash_attn_with_kvcache(q, cache, v_cache, new, new, **kw,
                                                        return_softmax_lse=True)
                tally.check(f"decode {dtype} d={d} splits={splits}", check_call, out, lse, q,
                            *before, new, new, after=(cache, v_cache), **kw)
    # the element-wise decode variants (a head dim 3 under every padded one, the cache
    # unaligned), with an append, a sink and splits
    for i, d in enumerate(_compile.DECODE_HEAD_DIMS):
        dd = d - 3
        q = randn(rng, (3, 2, 8, dd), torch.float16, layout="odd")
        cache, v_cache = (randn(rng, (3, 97, 2, dd), torch.float16, layout="odd")
                          for _ in range(2))
        new = _t(rng, (3, 1, 2, dd), torch.float16)
        before = cache.clone(), v_cache.clone()
        kw = dict(cache_seqlens=i32([0, 50, 95]), causal=True, num_splits=1 + 2 * (i % 2),
                  learnable_sink=make_sink(rng, 8, SINK_DTYPES[i % 3]))
        out, lse = cufa.flash_attn_with_kvcache(q, cache, v_cache, new, new, **kw,
                                                return_softmax_lse=True)
        tally.check(f"decode element-wise d={dd} splits={kw['num_splits']} sink", check_call,
                    out, lse, q, *before, new, new, after=(cache, v_cache), **kw)
    # 512 CTAs at d = 64 and 128: the shapes with four CTAs an SM, unsplit
    # (_heuristics.decode_kernel_and_splits)
    for dm in (64, 128):
        q = _t(rng, (64, 1, 8, dm), torch.float16)
        cache = _t(rng, (64, 512, 8, dm), torch.float16)
        kw = dict(cache_seqlens=i32(rng.integers(0, 513, 64)))
        out = cufa.flash_attn_with_kvcache(q, cache, cache, **kw)
        tally.check(f"decode 64 x 512 d={dm}", check_call, out, None, q, cache, cache, **kw)
    d, page = 128, 16
    pages = _t(rng, (20, page, 2, d), torch.float16)
    table = rng.permutation(20)[:18].reshape(3, 6)
    # two rows past the capacity: sequence 2 fills its cache, and its last query rows sit
    # past it (q rotates per token under the window)
    cos = sin = _t(rng, (6 * page + 2, 32), torch.float16)
    q = _t(rng, (3, 4, 8, d), torch.float16)
    new = _t(rng, (3, 2, 2, d), torch.float16)
    options = dict(rotary_cos=cos, rotary_sin=sin, window_size=(20, 0), softcap=10.0,
                   alibi_slopes=torch.rand(8, device="cuda"))
    # the second call: lengths past the capacity, negative, leftpad past the end (clamped;
    # sequences 0 and 1 undefined, sequence 2 checked)
    for lens, leftpad, defined in (([0, 17, 94], [0, 3, 90], slice(0, 3)),
                                   ([1000, -5, 40], [-1, 200, 3], slice(2, 3))):
        v_pages = pages.clone()
        before = pages.clone(), v_pages.clone()
        out, lse = cufa.flash_attn_with_kvcache(
            q, pages, v_pages, new, new, cache_seqlens=i32(lens), cache_leftpad=i32(leftpad),
            block_table=i32(table), num_splits=3, return_softmax_lse=True, **options)
        rows = table[defined]
        tally.check(f"paged rotary leftpad {lens}", check_call, out[defined], lse[defined],
                    q[defined], *before, new[defined], new[defined], after=(pages, v_pages),
                    rows=None if len(rows) == len(table) else rows,
                    cache_seqlens=i32(lens[defined]), cache_leftpad=i32(leftpad[defined]),
                    block_table=i32(rows), **options)
    # page ids outside the cache in sequence 0 (clamped; undefined); 1 and 2 read one page
    # six times
    bad_table = np.array([[0, 99, -7, 5, 1, 2], [3] * 6, [19] * 6])
    out = cufa.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=i32([96, 96, 96]),
                                       block_table=i32(bad_table))
    tally.check("paged, bad page ids", check_call, out[1:], None, q[1:], pages, pages,
                cache_seqlens=i32([96, 96]), block_table=i32(bad_table[1:]))
    lens_q, lens_k = [0, 7, 65], [5, 0, 96]
    qp = _t(rng, (sum(lens_q), 8, d), torch.float16)
    out = cufa.flash_attn_varlen_func(qp, pages, pages, cu_seqlens(lens_q), cu_seqlens(lens_k), 65, 96,
                                      causal=True, block_table=i32(table))
    keys = reference.from_paged(pages, table)
    tally.check("paged varlen", check_packed, out, None, qp,
                lambda b: (keys[b:b + 1, :lens_k[b]],) * 2, lens_q, causal=True)
    # paged prefill on the Hopper kernels' TMA boxes (pages of 8 rows and up; the portable
    # kernels elsewhere): ids outside the cache and a length past the capacity in sequence
    # 1 (clamped; undefined), sequence 0 checked
    for page_rows, dp in ((8, 64), (64, 256), (256, 128)):
        width = 512 // page_rows
        kv = _t(rng, (2 * width + 1, page_rows, 2, dp), torch.float16)
        ids = rng.permutation(2 * width).reshape(2, width)
        ids[1, 1], ids[1, -1] = -3, 10**6
        qf = _t(rng, (170, 8, dp), torch.float16)
        out = cufa.flash_attn_varlen_func(qf, kv, kv, i32([0, 40, 170]), i32([0, 300, 10299]),
                                          130, 9999, causal=True, block_table=i32(ids))
        keys = reference.from_paged(kv, ids[:1])[:, :300]
        tally.check(f"paged prefill, pages of {page_rows}", check_packed, out, None, qf,
                    lambda b: (keys, keys) if b == 0 else None, [40, 130], causal=True)
    # decode-sized sequences of a paged packed batch on the decode kernel, split over long
    # keys (2 sequences x 1 KV head: the splits' last merges); then sequence 0 malformed
    # (a negative length, then one past the capacity: clamped, undefined), sequence 1
    # checked
    big = _t(rng, (300, page, 1, d), torch.float16)
    big_table = rng.permutation(300).reshape(2, 150)
    keys = reference.from_paged(big, big_table)
    for lens_k, defined in (([2400, 1700], (0, 1)), ([-3, 1700], (1,)), ([5000, 1700], (1,))):
        qd = _t(rng, (3, 8, d), torch.float16)
        out, lse = cufa.flash_attn_varlen_func(qd, big, big, i32([0, 1, 3]), cu_seqlens(lens_k), 2, 2400,
                                               causal=True, block_table=i32(big_table),
                                               return_lse=True)
        tally.check(f"paged decode-sized, keys {lens_k}", check_packed, out, lse, qd,
                    lambda b: (keys[b:b + 1, :lens_k[b]],) * 2 if b in defined else None,
                    [1, 2], causal=True)
    # merges: part b without keys in batch 0 (its output NaN: never read); out= given
    # (NaN first), or out_a itself
    for dtype, out_as in ((torch.float16, None), (torch.bfloat16, "new"),
                          (torch.float32, "out_a")):
        oa, ob = _t(rng, (2, 7, 3, 72), dtype), _t(rng, (2, 7, 3, 72), dtype)
        la, lb = _t(rng, (2, 3, 7), torch.float32), _t(rng, (2, 3, 7), torch.float32)
        lb[0], ob[0] = float("-inf"), NAN
        parts = tuple(x.clone() for x in (oa, la, ob, lb))
        out = {None: None, "new": torch.full_like(oa, NAN), "out_a": oa}[out_as]
        res, lse = cufa.merge_attention_states(oa, la, ob, lb, out=out)
        tally.check(f"merge {dtype} out={out_as}", check_merge, res, lse, parts)


if __name__ == "__main__":
    sys.exit(main())
