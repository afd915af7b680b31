#!/usr/bin/env python3
"""Where a decode call's time goes, for a few bench_decode shapes: host µs to issue one
call (queued, no sync), wall µs per call queued, the GPU time of each kernel (torch
profiler), and cProfile's top functions for the first shape. --mla: MLA decode's calls
(qv=, bf16, pages of 64 in random order, 128 and 16 query heads over one latent head)
instead.

    python3 bench/profile/profile_decode.py [--calls 400] [--no-cprofile] [--mla]
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import _timing  # noqa: E402,F401  (finds the checkout's cufa when none is on the path)
import torch  # noqa: E402

import cufa  # noqa: E402

# (dtype, nheads, nheads_k, head_dim, batch, seqlen)
SHAPES = [("float16", 32, 8, 64, 1, 32768), ("float16", 32, 8, 64, 8, 16384),
          ("float16", 32, 8, 64, 1, 131072), ("float16", 32, 8, 64, 64, 4096),
          ("float16", 32, 32, 64, 1, 131072), ("float16", 32, 8, 128, 1, 32768)]
# (query heads, batch, seqlen): bench_mla.py's small and large rows
MLA_SHAPES = [(128, 1, 1024), (128, 1, 8192), (128, 1, 65536), (128, 128, 8192),
              (16, 1, 1024), (16, 1, 8192), (16, 1, 65536), (16, 128, 8192)]


def decode_calls():
    for dt, h, hk, d, b, n in SHAPES:
        dtype = getattr(torch, dt)
        q = torch.randn(b, 1, h, d, device="cuda", dtype=dtype)
        k, v = (torch.randn(b, n, hk, d, device="cuda", dtype=dtype) for _ in range(2))
        lens = torch.full((b,), n, device="cuda", dtype=torch.int32)
        yield f"{dt} {h}/{hk} d={d} {b}x{n}", (
            lambda q=q, k=k, v=v, lens=lens: cufa.flash_attn_with_kvcache(
                q, k, v, cache_seqlens=lens))


def mla_calls(page=64):
    for h, b, n in MLA_SHAPES:
        pages = b * -(-n // page)
        table = torch.randperm(pages, device="cuda").to(torch.int32).view(b, -1)
        kw = dict(q=torch.randn(b, 1, h, 64, device="cuda", dtype=torch.bfloat16),
                  qv=torch.randn(b, 1, h, 512, device="cuda", dtype=torch.bfloat16),
                  k_cache=torch.randn(pages, page, 1, 64, device="cuda", dtype=torch.bfloat16),
                  v_cache=torch.randn(pages, page, 1, 512, device="cuda", dtype=torch.bfloat16),
                  cache_seqlens=torch.full((b,), n, device="cuda", dtype=torch.int32),
                  block_table=table)
        yield f"MLA bf16 {h}/1 {b}x{n} pages of {page}", (
            lambda kw=kw: cufa.flash_attn_with_kvcache(**kw, causal=True))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--no-cprofile", action="store_true")
    p.add_argument("--mla", action="store_true", help="MLA decode's shapes (Hopper)")
    args = p.parse_args()
    print(f"| shape ({torch.cuda.get_device_name()}) | host us | wall us | kernels (GPU us each) |")
    print("| --- | --- | --- | --- |")
    first = None
    for label, call in (mla_calls() if args.mla else decode_calls()):
        first = first or call
        for _ in range(20):
            call()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            call()
        host = (time.perf_counter() - t0) / args.calls * 1e6
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / args.calls * 1e6
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                call()
            torch.cuda.synchronize()
        kernels = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kernels.setdefault(e.name, []).append(e.device_time)
        text = ", ".join(f"{name[:40]} {sorted(t)[len(t) // 2]:.1f}" for name, t in kernels.items())
        print(f"| {label} | {host:.1f} | {wall:.1f} | {text} |")
    if not args.no_cprofile:
        import cProfile
        import pstats
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.calls):
            first()
        profiler.disable()
        torch.cuda.synchronize()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
