#!/usr/bin/env python3
"""The sweep behind the MLA decode split rule (_heuristics.mla_splits): each shape's time at
every split count given, beside the planner's own choice ("plan", with the count it takes).
bf16, one latent head, pages of 64 in random order, every cache full; back-to-back calls
queued behind a spinning kernel (host cost hidden) and timed by CUDA events, the median of
interleaved rounds (every column of a row runs in each round). The fastest column of each
row is starred.

    python3 bench/profile/mla_splits.py [--shapes 1x1024,1x8192,8x1024] [--heads 128,16]
        [--splits 1,2,4,8,16,32,64] [--tokens 1] [--fp8] [--rounds 5] [--calls 40] [--dry-run]

--fp8: float8_e4m3fn caches with per-sequence descales (an e4m3 block costs more: the
rule's MLA_E4M3_BLOCK_COST).

--dry-run lists the rows and columns without a GPU. Results go in bench/results/ with the
card named (bench/results/mla_decode_h200.md).
"""
import argparse
import os
import re
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import _timing  # noqa: E402  (finds the checkout's cufa when none is on the path)

ROPE, LATENT, PAGE = 64, 512, 64


def _shapes(text):
    """'1x1024,8x4096' -> [(1, 1024), (8, 4096)]."""
    return [tuple(int(x) for x in re.split("x", item.strip())) for item in text.split(",")
            if item.strip()]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=_shapes,
                   default=_shapes("1x1024,1x4096,1x8192,1x16384,4x1024,8x1024,8x4096,32x1024"),
                   help="batch x keys, comma separated")
    p.add_argument("--heads", type=_timing.int_list, default=(128, 16))
    p.add_argument("--splits", type=_timing.int_list, default=(1, 2, 4, 8, 16, 32, 64))
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--fp8", action="store_true", help="float8_e4m3fn caches")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--dry-run", action="store_true")
    return p.parse_args(argv)


def rows(args):
    return [(h, b, n) for h in args.heads for b, n in args.shapes]


def columns(splits):
    """(label, num_splits): the planner's choice (0), then each count."""
    return [("plan", 0)] + [(f"s{s}", s) for s in splits]


def main(argv=None):
    args = parse(argv)
    if args.dry_run:
        for h, b, n in rows(args):
            print(f"{h} heads {b}x{n}: {', '.join(c[0] for c in columns(args.splits))}")
        return
    import torch

    import cufa
    from cufa import _compile, _heuristics, reference
    rng = np.random.default_rng(0)
    print(f"MLA decode, us a call (median of {args.rounds} rounds x {args.calls} calls), "
          f"{torch.cuda.get_device_name()}, bf16{' over e4m3 caches' if args.fp8 else ''}, "
          f"{args.tokens} token(s), pages of {PAGE}")
    for h, b, n in rows(args):
        table, pages = reference.paged_layout(b, n, PAGE, rng, spare_pages=0)
        kw = dict(q=torch.randn(b, args.tokens, h, ROPE, device="cuda", dtype=torch.bfloat16),
                  qv=torch.randn(b, args.tokens, h, LATENT, device="cuda", dtype=torch.bfloat16),
                  k_cache=torch.randn(pages, PAGE, 1, ROPE, device="cuda", dtype=torch.bfloat16),
                  v_cache=torch.randn(pages, PAGE, 1, LATENT, device="cuda",
                                      dtype=torch.bfloat16),
                  cache_seqlens=torch.full((b,), n, dtype=torch.int32, device="cuda"),
                  block_table=torch.from_numpy(table).cuda(), causal=True)
        if args.fp8:
            for name in ("k_cache", "v_cache"):
                kw[name] = kw[name].to(torch.float8_e4m3fn)
            kw["k_descale"], kw["v_descale"] = (
                torch.rand(b, 1, device="cuda") * 0.5 + 0.05 for _ in range(2))
        cols = columns(args.splits)
        times = {c: [] for c in cols}
        for _ in range(args.rounds):
            for c in cols:
                for _ in range(3):
                    cufa.flash_attn_with_kvcache(**kw, num_splits=c[1])
                start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                torch.cuda.synchronize()
                # (behind a spinning kernel: a small cache's call is shorter than its host
                # cost, and back to back the events would time the host)
                _timing.queue_ahead(torch, 0.3 * args.calls)
                start.record()
                for _ in range(args.calls):
                    cufa.flash_attn_with_kvcache(**kw, num_splits=c[1])
                end.record()
                end.synchronize()
                times[c].append(start.elapsed_time(end) / args.calls * 1e3)
        med = {c: statistics.median(t) for c, t in times.items()}
        best = min(med.values())
        units = b * -(-args.tokens * h // _compile.MLA_ROWS)
        planned = _heuristics.mla_splits(0, units, b * args.tokens * h, n,
                                         torch.cuda.current_device(), fp8_cache=args.fp8)
        cells = [f"{c[0]}{f' ({planned})' if c[1] == 0 else ''} {m:.1f}"
                 f"{'*' if m == best else ''}" for c, m in med.items()]
        cache_mb = (1 if args.fp8 else 2) * b * n * (ROPE + LATENT) / 1e6
        print(f"{h} heads {b}x{n} ({cache_mb:.0f} MB): " + " | ".join(cells), flush=True)
        del kw


if __name__ == "__main__":
    main()
