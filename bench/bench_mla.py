#!/usr/bin/env python3
"""MLA decode (DeepSeek's latent attention): cufa's flash_attn_with_kvcache(qv=...) on
Hopper, against the card's limits measured in the same run.

    python3 bench/bench_mla.py --out DIR [--quick] [--heads 128] [--page 64] [--reps 40]
        [--fp8] [--list]

Rows: bf16, one latent KV head under `--heads` query heads (128: DeepSeek-V3 on one GPU;
16: eight-way tensor parallel), pages of `--page` rows in random order, every sequence's
cache full, (batch, cache length N) in (1, 1k) .. (128, 64k) x query tokens 1 and 2
(speculative decode). A key is a 512-dim latent row c_kv and a 64-dim rotary row k_pe, so
the cache holds 2 * B * N * 576 bytes (--fp8: e4m3 caches with per-sequence descales,
B * N * 576), read once (TB/s, and its share of the copy
bandwidth measured in the same run); the work is 2 * B * H * sq * N * (576 + 512) FLOPs
(scores over 576 dims, P V over 512), TFLOP/s beside the card's dense fp16 matrix rate
(an 8192^3 product, same run). At 128 heads a cache byte carries about 240 FLOPs at one
token, so the rows are bound by the matrix units, not by memory; at 16 heads by memory.
Timing as in bench_fwd.py (bench/_timing.py): CUDA events a queued call, the median over
interleaved rounds; caches under 100 MB rotate input sets past L2. No peer runs here
(FlashMLA and FlashAttention-3 are not in the GPU image): the limits are the yardstick.
Writes DIR/bench_mla.{json,md}.
"""
import argparse
import datetime
import json
import os
import sys

import _timing as T  # this script's folder is on sys.path

SHAPES = ((1, 1024), (1, 8192), (1, 65536), (8, 8192), (32, 4096), (64, 8192), (128, 1024),
          (128, 8192))
QUICK_SHAPES = ((1, 65536), (64, 8192), (128, 8192))
SEQLENS_Q = (1, 2)
ROPE, LATENT = 64, 512
ROTATE_BELOW = 100 * 2**20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results", help="folder for bench_mla.{json,md}")
    p.add_argument("--quick", action="store_true", help=f"shapes {QUICK_SHAPES} only")
    p.add_argument("--heads", type=int, default=128, help="query heads over the latent head")
    p.add_argument("--page", type=int, default=64, help="page size (rows), a power of two")
    p.add_argument("--reps", type=int, default=40, help="timed calls a row, over the rounds")
    p.add_argument("--fp8", action="store_true",
                   help="float8_e4m3fn caches (k_descale, v_descale per sequence)")
    p.add_argument("--list", action="store_true", help="print the rows and exit (no GPU)")
    args = p.parse_args(argv)
    if args.page < 1 or args.page & (args.page - 1):
        p.error("--page must be a power of two")
    if args.heads < 1 or args.reps < 1:
        p.error("--heads and --reps must be >= 1")
    return args


def rows(args):
    return [(b, n, sq) for b, n in (QUICK_SHAPES if args.quick else SHAPES)
            for sq in SEQLENS_Q]


def call_kwargs(torch, rng, batch, n, sq, heads, page, fp8, make_cache=None):
    """flash_attn_with_kvcache's arguments for one row: random q and qv, caches of
    make_cache(shape) (default torch.randn's values), pages of `page` rows in rng's random
    order, every sequence full; fp8: the caches x 4 in e4m3, descales per sequence."""
    from cufa import reference
    make_cache = make_cache or (lambda shape: torch.randn(shape, device="cuda",
                                                          dtype=torch.bfloat16))
    table, pages = reference.paged_layout(batch, n, page, rng, spare_pages=0)
    kw = dict(q=torch.randn(batch, sq, heads, ROPE, device="cuda", dtype=torch.bfloat16),
              qv=torch.randn(batch, sq, heads, LATENT, device="cuda", dtype=torch.bfloat16),
              k_cache=make_cache((pages, page, 1, ROPE)),
              v_cache=make_cache((pages, page, 1, LATENT)),
              cache_seqlens=torch.full((batch,), n, dtype=torch.int32, device="cuda"),
              block_table=torch.from_numpy(table).cuda())
    if fp8:
        for name in ("k_cache", "v_cache"):
            kw[name] = (kw[name] * 4).to(torch.float8_e4m3fn)
        kw["k_descale"], kw["v_descale"] = (
            torch.rand(batch, 1, device="cuda") * 0.5 + 0.05 for _ in range(2))
    return kw


def cache_bytes(batch, n, fp8=False):
    return (1 if fp8 else 2) * batch * n * (ROPE + LATENT)


def flops(batch, heads, sq, n):
    return 2 * batch * heads * sq * n * (ROPE + 2 * LATENT)


def main(argv=None):
    args = parse_args(argv)
    if args.list:
        for b, n, sq in rows(args):
            print(f"B={b} N={n} sq={sq} heads={args.heads}: "
                  f"{cache_bytes(b, n, args.fp8) / 1e6:.0f} MB, "
                  f"{flops(b, args.heads, sq, n) / 1e9:.1f} GFLOP")
        return 0
    torch = T.require_torch_cuda("bench_mla.py")
    cufa = T.load_cufa()
    if isinstance(cufa, str):
        sys.exit(cufa)
    import numpy as np
    copy = T.copy_tbps(torch)
    matmul = T.matmul_tflops(torch)
    device = torch.cuda.get_device_name()
    results = []
    rng = np.random.default_rng(0)
    todo = rows(args)
    for i, (b, n, sq) in enumerate(todo):
        T.progress(i, len(todo), f"B={b} N={n} sq={sq}")
        size = cache_bytes(b, n, args.fp8)
        sets = 1 if size >= ROTATE_BELOW else T.rotating_sets(size)
        arg_sets = []
        for _ in range(sets):
            arg_sets.append((call_kwargs(torch, rng, b, n, sq, args.heads, args.page,
                                         args.fp8),))

        def call(kw):
            cufa.flash_attn_with_kvcache(**kw, causal=True)
        got = T.run_rounds({"cufa": lambda reps: T.time_events(torch, call, arg_sets, reps)},
                           -(-args.reps // T.ROUNDS))["cufa"]
        row = dict(batch=b, seqlen=n, seqlen_q=sq, heads=args.heads, page=args.page,
                   bytes=size, flops=flops(b, args.heads, sq, n))
        if isinstance(got, dict):
            row["na"] = got["na"]
        else:
            ms = T.median(got)
            row.update(ms=ms, tbps=row["bytes"] / (ms * 1e-3) / T.TB,
                       tflops=T.tflops(row["flops"], ms))
        results.append(row)
        arg_sets = None  # (the caches freed before the next row)
        torch.cuda.empty_cache()
    T.progress(len(todo), len(todo), "done")
    lines = [f"MLA decode, {device}, bf16{' over an e4m3 cache' if args.fp8 else ''}, "
             f"{args.heads} query heads over one latent head, "
             f"pages of {args.page}; copy bandwidth {copy:.2f} TB/s, fp16 matmul "
             f"{matmul:.0f} TFLOP/s (same run); median of {args.reps} calls a row", "",
             "| B x N | sq | cache MB | GFLOP | us | TB/s | % of copy | TFLOP/s | % of matmul |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        head = (f"| {r['batch']} x {r['seqlen']} | {r['seqlen_q']} | {r['bytes'] / 1e6:.0f} | "
                f"{r['flops'] / 1e9:.1f} |")
        if "na" in r:
            lines.append(f"{head} n/a: {r['na'][:120]} | | | | |")
        else:
            lines.append(f"{head} {r['ms'] * 1e3:.1f} | {r['tbps']:.2f} | "
                         f"{r['tbps'] / copy:.0%} | {r['tflops']:.0f} | "
                         f"{r['tflops'] / matmul:.0%} |")
    table = "\n".join(lines)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_mla.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(args.out, "bench_mla.json"), "w") as f:
        meta = dict(device=device, date=datetime.date.today().isoformat(), copy_tbps=copy,
                    matmul_tflops=matmul, heads=args.heads, page=args.page, fp8=args.fp8,
                    versions=T.versions(torch))
        json.dump(dict(meta=meta, rows=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
