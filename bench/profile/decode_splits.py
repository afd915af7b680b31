#!/usr/bin/env python3
"""The sweep behind the decode split rules (_heuristics.choose_num_splits, FILL_WAVES_E4M3,
E4M3_SPLIT_CTAS_PER_SM, head_pairs, pairs_keep_the_merge): each shape's time at every
split count given, and at d = 64 (e4m3 and 16-bit caches) with one KV head a CTA as well
as two, beside the planner's own choice ("plan"). fp16 q, one query token by default, contiguous caches; back-to-back
calls timed by CUDA events, the median of interleaved rounds (clocks follow what ran
before, so every column of a row runs in each round). The fastest column of each row is
starred.

    python3 bench/profile/decode_splits.py [--shapes 256x1024,1x131072] [--heads 32/8]
        [--head-dims 64,128] [--caches e4m3,fp16] [--splits 1,2,4,8,16,32,64,128]
        [--tokens 1] [--rounds 5] [--calls 40] [--dry-run]

--dry-run lists the rows and columns without a GPU. Results go in bench/results/ with the
card named (e.g. the probes in bench/results/ab_h200_e4m3_unsplit.md).
"""
import argparse
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import _timing  # noqa: E402,F401  (finds the checkout's cufa when none is on the path)
from cufa._compile import PAIRED_HEAD_DIM  # noqa: E402  (where an e4m3 cache takes head pairs)


def _pairs(text):
    """'256x1024,1x131072' or '32/8,32/32' -> [(256, 1024), (1, 131072)]."""
    return [tuple(int(x) for x in re.split(r"[x/]", item.strip())) for item in text.split(",")
            if item.strip()]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=_pairs, default=[(256, 1024), (1, 131072), (8, 16384)],
                   help="batch x keys, comma separated")
    p.add_argument("--heads", type=_pairs, default=[(32, 8)], help="query/KV heads")
    p.add_argument("--head-dims", type=_timing.int_list, default=(64, 128))
    p.add_argument("--caches", default="e4m3,fp16")
    p.add_argument("--splits", type=_timing.int_list, default=(1, 2, 4, 8, 16, 32, 64, 128))
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    args.caches = tuple(c.strip() for c in args.caches.split(",") if c.strip())
    if any(c not in ("e4m3", "fp16") for c in args.caches):
        p.error(f"--caches takes e4m3 and/or fp16; got {args.caches}")
    return args


def columns(cache, d, splits):
    """(label, heads a CTA or None for the planner's, num_splits): the planner's choice,
    then each split count; at d = 64 each count with one head and with two."""
    cols = [("plan", None, 0)]
    both = d == PAIRED_HEAD_DIM
    for s in splits:
        if both:
            cols += [(f"2h s{s}", 2, s), (f"1h s{s}", 1, s)]
        else:
            cols.append((f"s{s}", None, s))
    return cols


def rows(args):
    return [(b, n, hq, hk, d, cache) for b, n in args.shapes for hq, hk in args.heads
            for d in args.head_dims for cache in args.caches]


def main(argv=None):
    args = parse(argv)
    if args.dry_run:
        for row in rows(args):
            b, n, hq, hk, d, cache = row
            labels = [c[0] for c in columns(cache, d, args.splits)]
            print(f"{b}x{n} {hq}/{hk} d={d} {cache}: {', '.join(labels)}")
        return
    import torch

    import cufa
    import cufa.api
    from cufa import _heuristics
    planner_pairs, planner_merge = _heuristics.head_pairs, _heuristics.pairs_keep_the_merge

    def heads_a_cta(count):  # None: the planner's rules; 1 or 2 forced (where layout allows)
        _heuristics.head_pairs = planner_pairs if count is None else (
            lambda *a, **kw: count == 2 and planner_pairs(*a, **kw))
        _heuristics.pairs_keep_the_merge = planner_merge if count is None else (
            lambda *a, **kw: True)
        cufa.api.clear_plans()

    print(f"decode, us a call (median of {args.rounds} rounds x {args.calls} calls), "
          f"{torch.cuda.get_device_name()}, fp16 q, {args.tokens} token(s), contiguous")
    try:
        for b, n, hq, hk, d, cache in rows(args):
            g = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(b, args.tokens, hq, d, device="cuda", dtype=torch.float16, generator=g)
            kv = [torch.randn(b, n, hk, d, device="cuda", dtype=torch.float16, generator=g)
                  for _ in range(2)]
            if cache == "e4m3":
                kv = [x.to(torch.float8_e4m3fn) for x in kv]
            cols = columns(cache, d, args.splits)
            times = {c: [] for c in cols}
            for _ in range(args.rounds):
                for c in cols:
                    label, heads, splits = c
                    heads_a_cta(heads)
                    for _ in range(3):
                        cufa.flash_attn_with_kvcache(q, *kv, num_splits=splits)
                    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                    torch.cuda.synchronize()
                    start.record()
                    for _ in range(args.calls):
                        cufa.flash_attn_with_kvcache(q, *kv, num_splits=splits)
                    end.record()
                    end.synchronize()
                    times[c].append(start.elapsed_time(end) / args.calls * 1e3)
            med = {c: statistics.median(t) for c, t in times.items()}
            best = min(med.values())
            cells = [f"{c[0]} {m:.1f}{'*' if m == best else ''}" for c, m in med.items()]
            mb = 2 * kv[0].numel() * kv[0].element_size() / 1e6
            print(f"{b}x{n} {hq}/{hk} d={d} {cache} ({mb:.0f} MB): " + " | ".join(cells),
                  flush=True)
            del q, kv
    finally:
        heads_a_cta(None)


if __name__ == "__main__":
    main()
