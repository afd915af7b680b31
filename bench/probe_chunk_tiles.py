#!/usr/bin/env python3
"""Which Hopper tile class suits chunked prefill: packed batches whose sequences have
fewer query rows than keys (a chunk of a prompt after its cached prefix), causal
(bottom-right), 32 query heads over 8 KV heads, fp16, contiguous and paged keys; each
shape timed on the 64-, 128- and 192-row tiles (CUFA_SM90_BLOCK_M), and as the planner
picks, interleaved over ROUNDS rounds, median TFLOP/s.

    python3 bench/probe_chunk_tiles.py [--rounds 3] [--pages 16,256] [--classes planner,192]
        [--shapes 512x4096x8,...] [--head-dims 64,128]
"""
import argparse
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import cufa  # noqa: E402
from bench_fwd import time_events  # noqa: E402  (this script's folder is on sys.path)
from cufa import api, reference  # noqa: E402

# (query rows a sequence, keys a sequence (prefix + chunk), sequences)
SHAPES = ((64, 4096, 32), (128, 2048, 32), (256, 1024, 32), (256, 4096, 16), (512, 1024, 16),
          (512, 4096, 8), (1024, 4096, 8), (512, 512, 32), (128, 128, 128))


def times_us(fn, reps):
    """us of each of reps back-to-back calls (bench_fwd.time_events, after its warm-up)."""
    return [ms * 1e3 for ms in time_events(torch, fn, [()], reps)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--pages", default="16", help="comma list of page sizes")
    ap.add_argument("--classes", default="planner,64,128,192")
    ap.add_argument("--shapes", default=None, help="QxKxB,... (default: SHAPES)")
    args = ap.parse_args()
    classes = tuple(None if c == "planner" else c for c in args.classes.split(","))
    shapes = SHAPES if not args.shapes else tuple(
        tuple(int(x) for x in item.split("x")) for item in args.shapes.split(","))
    page_sizes = [int(x) for x in args.pages.split(",")]
    rng = np.random.default_rng(0)
    h, hk = 32, 8
    cases = {}
    for d in (int(x) for x in args.head_dims.split(",")):
        for sq, sk, batch in shapes:
            q = torch.randn(batch * sq, h, d, device="cuda", dtype=torch.float16)
            k, v = (torch.randn(batch * sk, hk, d, device="cuda", dtype=torch.float16)
                    for _ in range(2))
            dev = (lambda x: torch.tensor(np.asarray(x), dtype=torch.int32, device="cuda"))
            cu_q = dev(np.arange(batch + 1) * sq)
            cu_k = dev(np.arange(batch + 1) * sk)
            layouts = {"contiguous": (k, v, None)}
            for page in page_sizes:
                table, pages = reference.paged_layout(batch, sk, page, rng)
                kp, vp = (reference.to_paged(x.view(batch, sk, hk, d), table, pages)
                          for x in (k, v))
                layouts[f"pages {page}"] = (kp, vp, dev(table))
            flops = 4 * h * d * batch * (sq * (sk - sq) + sq * (sq + 1) / 2)
            for layout, (kk, vv, tab) in layouts.items():

                def call(q=q, kk=kk, vv=vv, tab=tab, cu_q=cu_q, cu_k=cu_k, sq=sq, sk=sk):
                    cufa.flash_attn_varlen_func(q, kk, vv, cu_q, cu_k, sq, sk, causal=True,
                                                block_table=tab)
                for cls in classes:
                    cases[(d, sq, sk, batch, layout, cls)] = (call, flops)
    samples = {key: [] for key in cases}
    for _ in range(args.rounds):
        keys = list(cases)
        random.shuffle(keys)
        for key in keys:
            cls = key[-1]
            if cls is None:
                os.environ.pop("CUFA_SM90_BLOCK_M", None)
            else:
                os.environ["CUFA_SM90_BLOCK_M"] = cls
            api.clear_plans()
            samples[key] += times_us(cases[key][0], 10)
    os.environ.pop("CUFA_SM90_BLOCK_M", None)
    names = ["planner" if c is None else c for c in classes]
    print("| d | q rows | keys | seqs | layout | " + " | ".join(names) + " | (TFLOP/s) |")
    print("|" + " --- |" * (6 + len(names)))
    rows = {}
    for (d, sq, sk, batch, layout, cls), s in samples.items():
        tf = cases[(d, sq, sk, batch, layout, cls)][1] / (statistics.median(s) * 1e-6) / 1e12
        rows.setdefault((d, sq, sk, batch, layout), {})[cls] = tf
    for (d, sq, sk, batch, layout), r in rows.items():
        print(f"| {d} | {sq} | {sk} | {batch} | {layout} | " +
              " | ".join(f"{r[c]:.0f}" for c in classes) + " | |")


if __name__ == "__main__":
    main()
