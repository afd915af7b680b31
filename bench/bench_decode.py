#!/usr/bin/env python3
"""KV-cache decode: cufa (contiguous cache, paged caches, CUDA-graph replay) against
PyTorch SDPA (flash, cuDNN), one run.

    python3 bench/bench_decode.py --out DIR [--quick] [--dtypes fp16,bf16] [--head-dims 64,128]
        [--shapes 1x32768,64x4096] [--reps 40] [--unaligned] [--no-peers] [--sink] [--no-plot]
        [--list]

Rows: dtype x heads (32 over 8, 32 over 32) x head dim x (batch, cache length N) in
(1, 32k), (1, 128k), (8, 16k), (64, 4k), (128, 2k), (256, 1k) x seqlen_q 1 and 4, every
sequence's cache full (cache_seqlens = N), no mask (seqlen_q 4 non-causal for all).
cufa reads the contiguous cache (batch, N, heads_k, d) and paged copies of it (pages of
16 and 256 rows, in random order); SDPA reads q as a (batch, heads, seqlen_q, d) view and
the contiguous cache as (batch, heads_k, N, d) views, enable_gqa=True when the heads
differ. "cufa graph" replays the contiguous call from a CUDA graph, as servers replay
decode steps. Head dims from 1 to 256: those that are no multiple of 8 run cufa's
element-wise I/O kernels; --unaligned makes q and the contiguous cache slices at element
offset 1 of rows one element longer (strides no multiple of 8, a start 2 bytes off 16),
which take them at any head dim (the paged copies stay aligned). So the cost of an odd head
dim is the rows d = 59 against 64, 111 against 112 and 128 (TB/s counts the bytes of the
true head dim), and that of the element-wise kernels alone a run with --unaligned against
one without. Decode reads the cache once, so the figure is KV bytes / time, TB/s (bytes
= 2 * batch * N * heads_k * d * 2), beside the device's copy bandwidth measured in the
same run (a 1 GiB device-to-device copy: bytes read + written / time). Timing as in
bench_fwd.py (bench/_timing.py): one CUDA event pair per queued call, median; every
implementation in interleaved rounds in random order; caches under 100 MB are two input
sets used in turn (the H100's L2 holds 50 MB). The last column times one call at a time (a
sync after each, host cost included) for cufa and the SDPA peers, as a server that waits
for each step sees it. Then the serving-shaped step (mixed_batch). --sink also times the
contiguous call with a float32 learnable_sink (nheads,) in the same rounds ("cufa sink";
batch 1 rows split the keys, so the sink's merge is timed too) and reports its time over
the call's without one. --fp8 also times the same cache in float8_e4m3fn (contiguous, and
paged as above; per-(batch, KV head) descales) in the same rounds: "cufa fp8" columns, whose
TB/s count the fp8 bytes (half the 16-bit cache's), and the fp8 call's speed over cufa's
16-bit one and over SDPA cuDNN's. Writes DIR/bench_decode.{json,md,png}.
"""
import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys

import _timing as T  # this script's folder is on sys.path
from _timing import (ROUNDS, TORCH_DTYPES, WARMUP, WARMUP_MS, fmt, progress, run_rounds,
                     time_alone, time_events)

SHAPES = ((1, 32768), (1, 131072), (8, 16384), (64, 4096), (128, 2048), (256, 1024))
QUICK_SHAPES = ((1, 131072), (64, 4096), (256, 1024))
HEADS = ((32, 8), (32, 32))
SEQLENS_Q = (1, 4)
PAGE_SIZES = (16, 256)
IMPLS = ("cufa", "cufa_paged16", "cufa_paged256", "cufa_graph", "cufa_sink", "cufa_fp8",
         "cufa_fp8_paged16", "cufa_fp8_paged256", "sdpa_flash", "sdpa_cudnn")
LABELS = {"cufa": "cufa", "cufa_paged16": "cufa pages 16", "cufa_paged256": "cufa pages 256",
          "cufa_graph": "cufa graph", "cufa_sink": "cufa sink", "cufa_fp8": "cufa fp8",
          "cufa_fp8_paged16": "cufa fp8 pages 16", "cufa_fp8_paged256": "cufa fp8 pages 256",
          "sdpa_flash": "SDPA flash", "sdpa_cudnn": "SDPA cuDNN"}
FP8_IMPLS = ("cufa_fp8", "cufa_fp8_paged16", "cufa_fp8_paged256")
CUFA_LAYOUTS = ("cufa", "cufa_paged16", "cufa_paged256")
ROTATE_BELOW = 100 * 2**20      # caches smaller than this: 2 input sets (past the 50 MB L2)
COPY_BYTES = 2**30
ALONE_IMPLS = ("cufa", "sdpa_flash", "sdpa_cudnn")
BIG_CACHE = 0.5e9               # rows held to the copy-bandwidth target
TARGET_COPY, TARGET_BATCH1 = 0.85, 0.75
TARGET_FLASH, TARGET_CUDNN = 1.0, 0.95
TARGET_FP8_SPEEDUP, TARGET_FP8_CUDNN = 1.8, 1.7  # --fp8: over the 16-bit cache's calls
TB = 1e12


def _shape_list(text):
    try:
        shapes = tuple(tuple(int(x) for x in item.split("x")) for item in text.split(","))
    except ValueError:
        shapes = ()
    if not shapes or any(len(sh) != 2 or min(sh) < 1 for sh in shapes):
        raise argparse.ArgumentTypeError(f"expected BATCHxKEYS[,...]; got {text!r}")
    return shapes


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results", help="folder for bench_decode.{json,md,png}")
    p.add_argument("--dtypes", type=T.dtype_list, default="fp16,bf16",
                   help="comma list of fp16, bf16")
    p.add_argument("--head-dims", type=T.int_list, default=(64, 128))
    p.add_argument("--quick", action="store_true",
                   help=f"shapes {QUICK_SHAPES}, heads 32/8, seqlen_q 1 only")
    p.add_argument("--shapes", type=_shape_list, default=None,
                   help="comma list of BATCHxKEYS (e.g. 1x32768,64x4096) instead of the grid's "
                        "(heads, head dims and query tokens as chosen otherwise)")
    p.add_argument("--reps", type=int, default=40,
                   help="timed calls per implementation and row (median), split over the rounds")
    p.add_argument("--unaligned", action="store_true",
                   help="q and the contiguous cache as slices at an odd offset (cufa's "
                        "element-wise kernels)")
    p.add_argument("--no-peers", action="store_true", help="time cufa only")
    p.add_argument("--sink", action="store_true",
                   help="also time cufa with a learnable sink (the 'cufa sink' column)")
    p.add_argument("--fp8", action="store_true",
                   help="also time the cache in float8_e4m3fn (the 'cufa fp8' columns)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--list", action="store_true", help="print the rows and exit (no GPU)")
    p.add_argument("--mixed-only", action="store_true",
                   help="time the serving-shaped mixed step alone (printed, no files)")
    args = p.parse_args(argv)
    if any(not 1 <= d <= (256 if args.fp8 else 512) for d in args.head_dims):
        p.error("--head-dims must be from 1 to 512 (to 256 with --fp8)")
    if args.reps < 1:
        p.error("--reps must be >= 1")
    return args


def caches(args):
    """(dtype, nheads, nheads_k, head_dim, batch, N) of each cache; its rows are the seqlen_q."""
    shapes, heads = (QUICK_SHAPES, HEADS[:1]) if args.quick else (SHAPES, HEADS)
    shapes = args.shapes or shapes
    return [(dt, h, hk, d, b, n) for dt in args.dtypes for h, hk in heads
            for d in args.head_dims for b, n in shapes]


def seqlens_q(args):
    return SEQLENS_Q[:1] if args.quick else SEQLENS_Q


def kv_bytes(batch, n, nheads_k, head_dim):
    return 2 * batch * n * nheads_k * head_dim * 2


def case_name(r):
    return (f"{r['dtype']} d={r['head_dim']}{' unaligned' if r.get('unaligned') else ''} "
            f"{r['nheads']}/{r['nheads_k']} B={r['batch']} N={r['seqlen']} sq={r['seqlen_q']}")


def estimate_s(args, impls=len(IMPLS), rate=2.5e12, setup_s=0.3):
    """Rough seconds of a run: warm-up blocks, timed calls at `rate` bytes/s, and setup."""
    per_round = -(-args.reps // ROUNDS)
    total = 0.0
    for *_, hk, d, b, n in caches(args):
        call = kv_bytes(b, n, hk, d) / rate
        total += setup_s + len(seqlens_q(args)) * impls * ROUNDS * (
            max(WARMUP_MS / 1e3, WARMUP * call) + per_round * call)
    return total


# -- inputs ----------------------------------------------------------------------------------

def paged_layout(batch, capacity, page_size, rng):
    """A block table (int32 (batch, capacity // page_size)) over a random permutation of
    the pages, and the page count."""
    pages = batch * (capacity // page_size)
    return rng.permutation(pages).reshape(batch, -1).astype("int32"), pages


def to_paged(torch, cache, table, num_pages):
    """The contiguous cache (batch, capacity, heads, d) laid out in num_pages pages along
    the block table."""
    batch, capacity = cache.shape[:2]
    page = capacity // table.shape[1]
    pages = cache.new_empty((num_pages, page) + tuple(cache.shape[2:]))
    ids = torch.as_tensor(table.reshape(-1), dtype=torch.long, device=cache.device)
    pages[ids] = cache.reshape((-1, page) + tuple(cache.shape[2:]))
    return pages


def make_caches(torch, cfg, gen, rng, unaligned=False, fp8=False):
    """Input sets: the contiguous cache (unaligned: a slice at element offset 1 of rows d + 1
    long), its paged copies (page size -> (k pages, v pages, block_table)), cache_seqlens =
    N. Two sets where the cache is under ROTATE_BELOW. fp8: also the cache in e4m3 (the
    16-bit values rounded; "k8", "v8", paged copies "paged8" along the same tables) and
    descales (batch, nheads_k) of 1."""
    dt, _, hk, d, b, n = cfg
    dtype = getattr(torch, TORCH_DTYPES[dt])
    count = 2 if kv_bytes(b, n, hk, d) < ROTATE_BELOW else 1
    extra = 1 if unaligned else 0
    sets = []
    for _ in range(count):
        k, v = (torch.randn(b, n, hk, d + extra, device="cuda", dtype=dtype,
                            generator=gen)[..., extra:] for _ in range(2))
        paged = {}
        for ps in PAGE_SIZES:
            table, num_pages = paged_layout(b, n, ps, rng)
            paged[ps] = (to_paged(torch, k, table, num_pages),
                         to_paged(torch, v, table, num_pages),
                         torch.tensor(table, dtype=torch.int32, device="cuda"))
        s = dict(k=k, v=v, paged=paged, lens=torch.full((b,), n, dtype=torch.int32, device="cuda"))
        if fp8:
            s["k8"], s["v8"] = (x.to(torch.float8_e4m3fn) for x in (k, v))
            s["paged8"] = {ps: tuple(to_paged(torch, x.view(torch.uint8), table, kp.shape[0])
                                     .view(torch.float8_e4m3fn) for x in (s["k8"], s["v8"]))
                           + (table,) for ps, (kp, _, table) in paged.items()}
            s["descale"] = torch.ones((b, hk), dtype=torch.float32, device="cuda")
        sets.append(s)
    return sets


# -- one row -----------------------------------------------------------------------------------

def load_impls(torch, no_peers, sink=False, fp8=False):
    """name -> handle, or a string saying why it is not available (the cufa module stands
    for the cufa columns)."""
    cufa = T.load_cufa()
    impls = {name: cufa for name in IMPLS[:4] + (("cufa_sink",) if sink else ())
             + (FP8_IMPLS if fp8 else ())}
    return impls if no_peers else {**impls, **T.load_peers(torch)}


def time_row(torch, impls, cfg, sq, sets, reps, gen, unaligned=False):
    """All implementations on the same caches, interleaved; -> the row."""
    dt, h, hk, d, b, n = cfg
    dtype = getattr(torch, TORCH_DTYPES[dt])
    extra = 1 if unaligned else 0
    qs = [torch.randn(b, sq, h, d + extra, device="cuda", dtype=dtype, generator=gen)[..., extra:]
          for _ in sets]
    sdpa_kw = {"enable_gqa": True} if h != hk else {}
    graphs = []
    sink = torch.randn(h, device="cuda", generator=gen) if "cufa_sink" in impls else None

    def cufa_args(name):
        """(q, k, v, cache_seqlens, block_table) per set, for the layout of `name`."""
        if name in ("cufa", "cufa_graph", "cufa_sink"):
            return [(q, s["k"], s["v"], s["lens"], None) for q, s in zip(qs, sets)]
        if name == "cufa_fp8":
            return [(q, s["k8"], s["v8"], s["lens"], None) for q, s in zip(qs, sets)]
        if name.startswith("cufa_fp8_paged"):
            ps = int(name[len("cufa_fp8_paged"):])
            return [(q,) + s["paged8"][ps][:2] + (s["lens"], s["paged8"][ps][2])
                    for q, s in zip(qs, sets)]
        kp, vp, table = zip(*(s["paged"][int(name[len("cufa_paged"):])] for s in sets))
        return [(q, kp[i], vp[i], s["lens"], table[i]) for i, (q, s) in enumerate(zip(qs, sets))]

    def timer(name, impl):
        if isinstance(impl, str):
            return impl
        if name.startswith("sdpa"):
            sdpa_kernel, backend = impl
            bhsd = [(q.transpose(1, 2), s["k"].transpose(1, 2), s["v"].transpose(1, 2))
                    for q, s in zip(qs, sets)]
            fn = (lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                                                  **sdpa_kw))

            def timed(count):
                with sdpa_kernel(backend):  # entered once, outside the timed calls
                    return time_events(torch, fn, bhsd, count)
            return timed

        # (learnable_sink and the descales only where asked: bench/ab.sh times trees from
        # before them)
        sink_kw = {"learnable_sink": sink} if name == "cufa_sink" else {}
        if name in FP8_IMPLS:
            sink_kw = {"k_descale": sets[0]["descale"], "v_descale": sets[0]["descale"]}

        def call(q, k, v, lens, table):
            return impl.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, block_table=table,
                                                **sink_kw)

        if name == "cufa_graph":
            def timed(count):
                if not graphs:     # captured inside measure(): a failure is a reason
                    graphs.extend(T.capture_graphs(torch, call, cufa_args(name)))
                return time_events(torch, lambda g: g.replay(), [(g,) for g in graphs], count)
            return timed
        return lambda count: time_events(torch, call, cufa_args(name), count)

    per_round = -(-reps // ROUNDS)
    timed = run_rounds({name: timer(name, impl) for name, impl in impls.items()}, per_round)
    row = dict(dtype=dt, head_dim=d, nheads=h, nheads_k=hk, batch=b, seqlen=n, seqlen_q=sq,
               kv_bytes=kv_bytes(b, n, hk, d), sets=len(sets), unaligned=unaligned, impls={})
    for name, got in timed.items():
        if isinstance(got, dict):
            row["impls"][name] = got
            continue
        ms = statistics.median(got)
        nbytes = row["kv_bytes"] // 2 if name in FP8_IMPLS else row["kv_bytes"]
        row["impls"][name] = {"us": ms * 1e3, "us_min": min(got) * 1e3, "calls": len(got),
                              "tbps": nbytes / (ms * 1e-3) / TB}
    row["one_at_a_time_us"] = one_at_a_time(torch, impls, cufa_args("cufa"), qs, sets, sdpa_kw)
    row["max_abs_diff"] = check_outputs(torch, impls, qs[0], sets[0], sdpa_kw)
    del graphs[:]
    return row


def one_at_a_time(torch, impls, cufa_sets, qs, sets, sdpa_kw, calls=20):
    """Wall time of one call followed by a sync (median us): the host's launch cost
    counts, as in a server that waits for each step -- cufa contiguous and the SDPA
    peers. (The table's other columns queue calls back to back, which hides it.)"""
    fns = {}
    if not isinstance(impls.get("cufa"), str):
        cufa = impls["cufa"]
        fns["cufa"] = (lambda q, k, v, lens, table: cufa.flash_attn_with_kvcache(
            q, k, v, cache_seqlens=lens, block_table=table), cufa_sets, None)
    for name in ("sdpa_flash", "sdpa_cudnn"):
        if isinstance(impls.get(name), tuple):
            sdpa_kernel, backend = impls[name]
            bhsd = [(q.transpose(1, 2), s["k"].transpose(1, 2), s["v"].transpose(1, 2))
                    for q, s in zip(qs, sets)]
            fns[name] = (lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, **sdpa_kw), bhsd, (sdpa_kernel, backend))
    out = {}
    for name, (fn, arg_sets, backend) in fns.items():
        try:
            with (backend[0](backend[1]) if backend else contextlib.nullcontext()):
                out[name] = statistics.median(time_alone(torch, fn, arg_sets, calls)) * 1e3
        except Exception as e:  # a peer that refuses the shape: its reason is in the table
            out[name] = None
            print(f"one-at-a-time {name}: {type(e).__name__}: {e}", file=sys.stderr)
    return out


def check_outputs(torch, impls, q, s, sdpa_kw):
    """A timing of a wrong kernel means nothing: cufa's paged outputs and SDPA flash's
    against cufa's contiguous one (max abs difference; None where one is missing)."""
    if isinstance(impls.get("cufa"), str):
        return None
    cufa = impls["cufa"]
    base = cufa.flash_attn_with_kvcache(q, s["k"], s["v"], cache_seqlens=s["lens"]).float()
    diffs = {}
    for ps in PAGE_SIZES:
        kp, vp, table = s["paged"][ps]
        out = cufa.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=s["lens"], block_table=table)
        diffs[f"paged{ps}"] = float((out.float() - base).abs().max())
    if "k8" in s:  # the fp8 cache against the 16-bit call on its own (dequantized) values
        out = cufa.flash_attn_with_kvcache(q, s["k8"], s["v8"], cache_seqlens=s["lens"],
                                           k_descale=s["descale"], v_descale=s["descale"])
        same = cufa.flash_attn_with_kvcache(q, s["k8"].to(q.dtype), s["v8"].to(q.dtype),
                                            cache_seqlens=s["lens"])
        diffs["fp8"] = float((out.float() - same.float()).abs().max())
    if isinstance(impls.get("sdpa_flash"), tuple):
        sdpa_kernel, backend = impls["sdpa_flash"]
        try:
            with sdpa_kernel(backend):
                ref = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), s["k"].transpose(1, 2), s["v"].transpose(1, 2), **sdpa_kw)
            diffs["sdpa_flash"] = float((ref.transpose(1, 2).float() - base).abs().max())
        except Exception:  # flash n/a for this shape: nothing to compare against
            pass
    return diffs


def add_ratios(row, copy_tbps):
    """Fraction of the copy bandwidth per implementation; cufa's speed over the peers'."""
    for v in row["impls"].values():
        if "tbps" in v:
            v["frac_copy"] = v["tbps"] / copy_tbps
    t = {k: v.get("us") for k, v in row["impls"].items()}
    for peer, key in (("sdpa_flash", "ratio_vs_flash"), ("sdpa_cudnn", "ratio_vs_cudnn")):
        row[key] = t[peer] / t["cufa"] if t.get("cufa") and t.get(peer) else None
    if t.get("cufa_fp8"):  # the fp8 cache's speed over the 16-bit cache's and over cuDNN's
        row["fp8_speedup"] = t["cufa"] / t["cufa_fp8"] if t.get("cufa") else None
        row["fp8_vs_cudnn"] = t["sdpa_cudnn"] / t["cufa_fp8"] if t.get("sdpa_cudnn") else None
    if "cufa_sink" in t:  # the sink's cost: its median time over cufa's, less 1
        row["sink_cost"] = t["cufa_sink"] / t["cufa"] - 1 if t["cufa"] and t["cufa_sink"] else None


FP8_BIG_CACHE = 0.25e9  # fp8 bytes from which a row is held to the copy-bandwidth target


def fp8_summary(rows):
    """--fp8: the fp8 cache's speed over the 16-bit cache's and over SDPA cuDNN's, and the
    fraction of the copy bandwidth its big rows read at (None without fp8 columns)."""
    def span(values):
        values = sorted(v for v in values if v)
        return (f"{values[0]:.2f}-{values[-1]:.2f} (median {statistics.median(values):.2f})"
                if values else "n/a")
    if not any("cufa_fp8" in r["impls"] for r in rows):
        return None
    big = [r["impls"]["cufa_fp8"].get("frac_copy") for r in rows
           if r["kv_bytes"] / 2 >= FP8_BIG_CACHE and "cufa_fp8" in r["impls"]]
    return (f"fp8 cache (contiguous): cufa fp8 over cufa 16-bit {span(r.get('fp8_speedup') for r in rows)}; "
            f"over SDPA cuDNN (16-bit cache) {span(r.get('fp8_vs_cudnn') for r in rows)}; "
            f"rows with >= {FP8_BIG_CACHE / 1e9:.2f} GB of fp8 cache at "
            f"{span(big)} of the copy bandwidth")


def random_page_table(lens_k, page, rng):
    """A block table (int32, sequences x most pages) over one cache whose pages are a
    random permutation, each sequence holding the pages of its lens_k keys; and the cache's
    page count."""
    import numpy as np
    pages_per = [-(-n // page) for n in lens_k]
    ids = rng.permutation(sum(pages_per))
    table = np.zeros((len(lens_k), max(pages_per)), np.int32)
    at = 0
    for b, n in enumerate(pages_per):
        table[b, :n] = ids[at:at + n]
        at += n
    return table, sum(pages_per)


SERVING_HEADS, SERVING_HEADS_K, SERVING_HEAD_DIM, SERVING_PAGE, SERVING_CHUNK = 32, 8, 128, 16, 512
SERVING_SEED = 0  # its own draw: the same step whichever rows ran before it


def serving_step_inputs(torch, rng):
    """mixed_batch's arrays, drawn from rng: 4 prefill chunks of SERVING_CHUNK rows after
    0-4k cached keys, then 124 one-row decodes of 1k-8k keys, in one paged cache. A dict:
    prefix, lens_q, lens_k (lists), table (NumPy) and on the GPU q, k_pages, v_pages, cu_q,
    cu_k, table_t; dev makes an int32 GPU tensor."""
    import numpy as np
    h, hk, d, page, chunk = (SERVING_HEADS, SERVING_HEADS_K, SERVING_HEAD_DIM, SERVING_PAGE,
                             SERVING_CHUNK)
    prefix = [int(x) for x in rng.integers(0, 4097, 4)]
    lens_q = [chunk] * 4 + [1] * 124
    lens_k = [p + chunk for p in prefix] + [int(x) for x in rng.integers(1024, 8193, 124)]
    table, num_pages = random_page_table(lens_k, page, rng)
    dev = (lambda x: torch.tensor(np.asarray(x), dtype=torch.int32, device="cuda"))
    k_pages, v_pages = (torch.randn(num_pages, page, hk, d, device="cuda",
                                    dtype=torch.float16) for _ in range(2))
    return dict(prefix=prefix, lens_q=lens_q, lens_k=lens_k, table=table, dev=dev,
                cu_q=dev(np.concatenate([[0], np.cumsum(lens_q)])),
                cu_k=dev(np.concatenate([[0], np.cumsum(lens_k)])), k_pages=k_pages,
                v_pages=v_pages, table_t=dev(table),
                q=torch.randn(sum(lens_q), h, d, device="cuda", dtype=torch.float16))


def mixed_batch(torch, rng, copy_tbps, reps=40, fp8=False):
    """The serving-shaped step: 4 prefill chunks of 512 tokens (each after 0-4k cached keys)
    and 124 decode requests (1k-8k cached keys), one paged cache (page 16), fp16, d = 128,
    32 query heads over 8 KV heads, as one flash_attn_varlen_func call with block_table.
    Its median time against max(FLOP floor, byte floor): FLOPs at the bf16/fp16 matmul
    rate measured in this run, bytes (the visible keys and values once, q and out) at the
    copy rate. fp8: the same step over the cache in float8_e4m3fn too (fp8_us)."""
    import cufa
    h, hk, d, chunk = SERVING_HEADS, SERVING_HEADS_K, SERVING_HEAD_DIM, SERVING_CHUNK
    s = serving_step_inputs(torch, rng)
    prefix, lens_q, lens_k, q = s["prefix"], s["lens_q"], s["lens_k"], s["q"]
    k_pages, v_pages, cu_q, cu_k, table_t = (s[n] for n in ("k_pages", "v_pages", "cu_q", "cu_k",
                                                           "table_t"))
    dev = s["dev"]

    def step(q):
        return cufa.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max(lens_q),
                                           max(lens_k), causal=True, block_table=table_t)

    # the same step as two calls: the chunks packed, the decodes through the decode kernel
    chunk_rows = 4 * chunk
    cu_q_chunks, cu_k_chunks = cu_q[:5].clone(), cu_k[:5].clone()
    table_chunks, table_decode = table_t[:4].clone(), table_t[4:].clone()
    decode_lens = dev(lens_k[4:])

    def two_calls(q):
        cufa.flash_attn_varlen_func(q[:chunk_rows], k_pages, v_pages, cu_q_chunks, cu_k_chunks,
                                    chunk, max(lens_k[:4]), causal=True,
                                    block_table=table_chunks)
        return cufa.flash_attn_with_kvcache(q[chunk_rows:, None], k_pages, v_pages,
                                            cache_seqlens=decode_lens, causal=True,
                                            block_table=table_decode)
    us = statistics.median(time_events(torch, step, [(q,)], reps)) * 1e3
    split_us = statistics.median(time_events(torch, two_calls, [(q,)], reps)) * 1e3
    fp8_us = None
    if fp8:
        k8, v8 = (x.to(torch.float8_e4m3fn) for x in (k_pages, v_pages))
        scale = torch.ones(len(lens_q), hk, device="cuda")

        def step8(q):
            return cufa.flash_attn_varlen_func(q, k8, v8, cu_q, cu_k, max(lens_q), max(lens_k),
                                               causal=True, block_table=table_t,
                                               k_descale=scale, v_descale=scale)
        try:
            fp8_us = statistics.median(time_events(torch, step8, [(q,)], reps)) * 1e3
        except (TypeError, NotImplementedError) as e:
            # an older tree (an A/B's baseline) without fp8 caches in the varlen entry:
            # its other rows still count
            print(f"serving step over an fp8 cache: not run ({type(e).__name__}: {e})")
    mm_tflops = T.matmul_tflops(torch)
    pairs = sum(sq * (sk - sq) + sq * (sq + 1) / 2 for sq, sk in zip(lens_q, lens_k))
    flops = 4 * h * d * pairs
    moved = (sum(lens_k) * hk * d * 2 + 2 * sum(lens_q) * h * d) * 2
    flop_floor_us = flops / (mm_tflops * 1e12) * 1e6
    byte_floor_us = moved / (copy_tbps * 1e12) * 1e6
    floor = max(flop_floor_us, byte_floor_us)
    return dict(us=us, two_calls_us=split_us, fp8_us=fp8_us, flop_floor_us=flop_floor_us,
                byte_floor_us=byte_floor_us,
                matmul_tflops=mm_tflops, tflops=flops / (us * 1e-6) / 1e12,
                kv_tbps=moved / (us * 1e-6) / TB, floor_fraction=floor / us,
                prefix=prefix, decode_keys=(min(lens_k[4:]), max(lens_k[4:]), sum(lens_k[4:])))


def mixed_markdown(m):
    floor = max(m["flop_floor_us"], m["byte_floor_us"])
    return (f"Serving-shaped step (one flash_attn_varlen_func call, paged cache page 16, fp16, "
            f"d=128, 32/8 heads; 4 prefill chunks of 512 after {m['prefix']} cached keys + 124 "
            f"decode requests with {m['decode_keys'][0]}-{m['decode_keys'][1]} keys): "
            f"{m['us']:.1f} us; FLOP floor {m['flop_floor_us']:.1f} us (matmul "
            f"{m['matmul_tflops']:.0f} TFLOP/s in this run), byte floor {m['byte_floor_us']:.1f} us; "
            f"{100 * m['floor_fraction']:.0f} % of the floor max(FLOP, byte) "
            f"({m['tflops']:.0f} TFLOP/s, {m['kv_tbps']:.2f} TB/s). The same step as two calls "
            f"(the chunks through flash_attn_varlen_func, the decodes through "
            f"flash_attn_with_kvcache): {m['two_calls_us']:.1f} us, "
            f"{100 * floor / m['two_calls_us']:.0f} % of the floor."
            + (f" With the cache in float8_e4m3fn (the same one call): {m['fp8_us']:.1f} us, "
               f"{m['us'] / m['fp8_us']:.2f}x the 16-bit step's speed."
               if m.get("fp8_us") else ""))


# -- report ----------------------------------------------------------------------------------

def targets(rows, names):
    """[(text, met (True / False / None: nothing to judge), failing rows)]."""
    out = []

    def judge(text, pairs, minimum):
        vals = [(x, r) for x, r in pairs if x is not None]
        bad = [f"{case_name(r)}: {x:.2f}" for x, r in vals if x < minimum]
        out.append((text + (f" ({len(pairs) - len(vals)} rows without numbers)"
                            if len(vals) < len(pairs) else ""),
                    None if not vals else not bad, bad))

    if "sdpa_flash" in names:
        judge(f"every contiguous row >= {TARGET_FLASH:.2f}x SDPA flash",
              [(r["ratio_vs_flash"], r) for r in rows], TARGET_FLASH)
    if "sdpa_cudnn" in names:
        judge(f"every contiguous row >= {TARGET_CUDNN:.2f}x SDPA cuDNN",
              [(r["ratio_vs_cudnn"], r) for r in rows], TARGET_CUDNN)
    for name in (n for n in FP8_IMPLS if n in names):
        frac = (lambda r: r["impls"].get(name, {}).get("frac_copy"))
        judge(f"{LABELS[name]}: every fp8 cache >= {FP8_BIG_CACHE / 1e9:.2f} GB at >= "
              f"{TARGET_COPY:.0%} of copy bandwidth",
              [(frac(r), r) for r in rows if r["kv_bytes"] / 2 >= FP8_BIG_CACHE], TARGET_COPY)
    if "cufa_fp8" in names:
        big = [r for r in rows if r["kv_bytes"] / 2 >= FP8_BIG_CACHE]
        judge(f"cufa fp8: those rows >= {TARGET_FP8_SPEEDUP:.1f}x cufa's 16-bit cache",
              [(r.get("fp8_speedup"), r) for r in big], TARGET_FP8_SPEEDUP)
        if "sdpa_cudnn" in names:
            judge(f"cufa fp8: those rows >= {TARGET_FP8_CUDNN:.1f}x SDPA cuDNN's 16-bit cache",
                  [(r.get("fp8_vs_cudnn"), r) for r in big], TARGET_FP8_CUDNN)
    for name in CUFA_LAYOUTS:
        frac = (lambda r: r["impls"].get(name, {}).get("frac_copy"))
        judge(f"{LABELS[name]}: every cache >= {BIG_CACHE / 1e9:.1f} GB at >= "
              f"{TARGET_COPY:.0%} of copy bandwidth",
              [(frac(r), r) for r in rows if r["kv_bytes"] >= BIG_CACHE], TARGET_COPY)
        judge(f"{LABELS[name]}: batch 1 at 32k and 128k >= {TARGET_BATCH1:.0%} of copy bandwidth",
              [(frac(r), r) for r in rows if r["batch"] == 1], TARGET_BATCH1)
    return out


def markdown(rows, names):
    head = ["dtype", "d", "H/Hkv", "B x N", "sq", "KV MB"] + [LABELS[n] for n in names] \
        + ["cufa/flash", "cufa/cuDNN", "one at a time: cufa / flash / cuDNN us"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        cells = [r["dtype"], f"{r['head_dim']}{' unaligned' if r.get('unaligned') else ''}",
                 f"{r['nheads']}/{r['nheads_k']}",
                 f"{r['batch']} x {r['seqlen']}", r["seqlen_q"], f"{r['kv_bytes'] / 2**20:.0f}"]
        for n in names:
            v = r["impls"].get(n, {})
            cells.append("n/a" if "us" not in v else
                         f"{v['us']:.1f} ({v['tbps']:.2f}, {v.get('frac_copy', 0):.0%})")
        cells += [fmt(r.get("ratio_vs_flash"), ".2f"), fmt(r.get("ratio_vs_cudnn"), ".2f")]
        single = r.get("one_at_a_time_us", {})
        cells.append(" / ".join(fmt(single.get(n), ".0f") for n in ALONE_IMPLS))
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def targets_markdown(judged):
    lines = []
    for text, met, bad in judged:
        mark = {True: "met", False: "NOT met", None: "not measured"}[met]
        lines.append(f"- {mark}: {text}")
        lines += [f"    - {b}" for b in bad[:12]] + ([f"    - ... {len(bad) - 12} more"]
                                                     if len(bad) > 12 else [])
    return "\n".join(lines)


def unavailable(rows):
    """name -> the first reason an implementation was n/a, and on how many rows."""
    why = {}
    for r in rows:
        for n, v in r["impls"].items():
            if "na" in v:
                reason, count = why.get(n, (v["na"], 0))
                why[n] = (reason, count + 1)
    return why


def summary_table(rows, names, judged):
    """A few lines to read last: per implementation its rows, median TB/s and the least
    fraction of copy bandwidth over big caches; then the targets."""
    lines = [f"{'implementation':<16} {'rows':>4} {'median TB/s':>11}  min % copy (>= 0.5 GB)"]
    for n in names:
        got = [r["impls"][n]["tbps"] for r in rows if "tbps" in r["impls"].get(n, {})]
        big = [r["impls"][n]["frac_copy"] for r in rows
               if r["kv_bytes"] >= BIG_CACHE and "frac_copy" in r["impls"].get(n, {})]
        median = fmt(statistics.median(got) if got else None, ".2f")
        least = fmt(100 * min(big) if big else None, ".0f")
        lines.append(f"{LABELS[n]:<16} {len(got):>4} {median:>11}  {least}")
    lines += [f"{'met' if met else 'NOT met' if met is False else 'n/a'}: {text}"
              for text, met, _ in judged]
    return "\n".join(lines)


def plot(rows, names, out_dir, device, copy_tbps):
    """KV TB/s per (batch, N), a line per implementation; a panel per (dtype, heads, d);
    seqlen_q 1 rows only (the table has all)."""
    plt = T.pyplot()
    if plt is None:
        return None
    rs = [r for r in rows if r["seqlen_q"] == 1]
    panels = sorted({(r["head_dim"], r["dtype"], r["nheads_k"]) for r in rs})
    if not panels:
        return None
    cols = sorted({(p[1], p[2]) for p in panels}, key=lambda c: (c[0] != "fp16", c))
    dims = sorted({p[0] for p in panels})
    fig, axes = plt.subplots(len(dims), len(cols), squeeze=False, sharey=True,
                             figsize=(4.2 * len(cols), 3.4 * len(dims)))
    for i, d in enumerate(dims):
        for j, (dt, hk) in enumerate(cols):
            ax = axes[i][j]
            sel = [r for r in rs if (r["head_dim"], r["dtype"], r["nheads_k"]) == (d, dt, hk)]
            shapes = [f"{r['batch']}x{r['seqlen'] // 1024}k" for r in sel]
            for n in names:
                pts = [(x, r["impls"][n]["tbps"]) for x, r in enumerate(sel)
                       if "tbps" in r["impls"].get(n, {})]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=LABELS[n])
            ax.axhline(copy_tbps, color="gray", ls="--", lw=1)
            ax.axhline(TARGET_COPY * copy_tbps, color="gray", ls=":", lw=1)
            ax.set_xticks(range(len(shapes)))
            ax.set_xticklabels(shapes, fontsize=8)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.set_title(f"{dt} d={d}, 32/{hk} heads", fontsize=10)
            if j == 0:
                ax.set_ylabel("KV TB/s")
            if i == 0 and j == 0:
                ax.legend(fontsize=7)
    fig.suptitle(f"decode, seqlen_q 1, {device} (dashed: copy bandwidth; dotted: "
                 f"{TARGET_COPY:.0%} of it)")
    fig.tight_layout()
    path = os.path.join(out_dir, "bench_decode.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- main ------------------------------------------------------------------------------------

def main(argv=None):
    args = parse_args(argv)
    cfgs = caches(args)
    total = len(cfgs) * len(seqlens_q(args))
    if args.list:
        for cfg in cfgs:
            dt, h, hk, d, b, n = cfg
            for sq in seqlens_q(args):
                r = dict(dtype=dt, head_dim=d, nheads=h, nheads_k=hk, batch=b, seqlen=n,
                         seqlen_q=sq, unaligned=args.unaligned)
                mb = kv_bytes(b, n, hk, d) / 2**20
                print(case_name(r), f"KV {mb:.0f} MB sets={2 if mb * 2**20 < ROTATE_BELOW else 1}")
        print(f"{total} rows, about {estimate_s(args) / 60:.1f} min on an H100")
        return 0
    torch = T.require_torch_cuda("bench_decode")
    import numpy as np
    os.makedirs(args.out, exist_ok=True)
    impls = load_impls(torch, args.no_peers, args.sink, args.fp8)
    names = [n for n in IMPLS if n in impls]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rng = np.random.default_rng(0)
    copy_tbps = T.copy_tbps(torch, COPY_BYTES)
    print(f"device-to-device copy: {copy_tbps:.2f} TB/s (read + written)", file=sys.stderr)
    if args.mixed_only:
        print(mixed_markdown(mixed_batch(torch, np.random.default_rng(SERVING_SEED), copy_tbps,
                                         fp8=args.fp8)))
        return 0
    rows = []
    for cfg in cfgs:
        sets = make_caches(torch, cfg, gen, rng, args.unaligned, args.fp8)
        for sq in seqlens_q(args):
            dt, h, hk, d, b, n = cfg
            progress(len(rows), total, case_name(dict(dtype=dt, head_dim=d, nheads=h, nheads_k=hk,
                                                      batch=b, seqlen=n, seqlen_q=sq,
                                                      unaligned=args.unaligned)))
            row = time_row(torch, impls, cfg, sq, sets, args.reps, gen, args.unaligned)
            add_ratios(row, copy_tbps)
            worst = max((row["max_abs_diff"] or {}).values(), default=0.0)
            if not worst < 0.05:
                print(f"\nwarning: {case_name(row)}: outputs differ by {worst:.3g} "
                      f"({row['max_abs_diff']})", file=sys.stderr)
            rows.append(row)
        del sets
        torch.cuda.empty_cache()
    progress(len(rows), total, "done")
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    mixed = mixed_batch(torch, np.random.default_rng(SERVING_SEED), copy_tbps, fp8=args.fp8)

    device = torch.cuda.get_device_name()
    judged = targets(rows, names)
    head = (f"KV-cache decode, {device}: per implementation median µs (KV TB/s, % of copy "
            f"bandwidth {copy_tbps:.2f} TB/s); KV bytes = 2 * B * N * Hkv * d * 2, every cache "
            f"full, no mask. Median of {-(-args.reps // ROUNDS) * ROUNDS} calls in {ROUNDS} "
            f"interleaved rounds (random order), each block after {WARMUP} warm-ups and "
            f"{WARMUP_MS} ms, CUDA events, the calls queued behind a spinning kernel (host cost "
            f"hidden, as inside a model); caches under {ROTATE_BELOW // 2**20} MB rotate 2 "
            "input sets. cufa/flash and cufa/cuDNN: the peer's time over cufa's (contiguous).")
    why = unavailable(rows)
    na = "\n".join(f"- {LABELS[n]} n/a on {c} rows: {reason}" for n, (reason, c) in why.items())
    sink_line = T.sink_summary(rows, case_name)
    fp8_line = fp8_summary(rows)
    if fp8_line:
        sink_line = "\n\n".join(x for x in (sink_line, fp8_line) if x)
    report = "\n\n".join([head, markdown(rows, names), mixed_markdown(mixed),
                           "Targets:\n\n" + targets_markdown(judged)] + ([na] if na else [])
                         + ([sink_line] if sink_line else []))
    with open(os.path.join(args.out, "bench_decode.md"), "w") as f:
        f.write(report + "\n")
    meta = {"device": device, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "versions": T.versions(torch), "argv": sys.argv[1:] if argv is None else argv,
            "reps": args.reps, "warmup": WARMUP, "warmup_ms": WARMUP_MS, "rounds": ROUNDS,
            "copy_tbps": copy_tbps, "copy_bytes": COPY_BYTES,
            "kv_bytes": "2 * batch * N * nheads_k * head_dim * 2",
            "timing": "CUDA event pair per call, median",
            "unavailable": {n: i for n, i in impls.items() if isinstance(i, str)}}
    summ = [{"target": t, "met": m, "failing": b} for t, m, b in judged]
    with open(os.path.join(args.out, "bench_decode.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "mixed": mixed, "targets": summ}, f, indent=1)
    if not args.no_plot:
        path = plot(rows, names, args.out, device, copy_tbps)
        if path:
            print(f"wrote {path}", file=sys.stderr)
    print(report)
    print()
    print(summary_table(rows, names, judged))
    return 0


if __name__ == "__main__":
    sys.exit(main())
