#!/usr/bin/env python3
"""Where a decode call's time goes, for a few bench_decode shapes: host µs to issue one
call (queued, no sync), wall µs per call queued, the GPU time of each kernel (torch
profiler), and cProfile's top functions for the first shape.

    python3 bench/profile/profile_decode.py [--calls 400] [--no-cprofile]
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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--no-cprofile", action="store_true")
    args = p.parse_args()
    print(f"| shape ({torch.cuda.get_device_name()}) | host us | wall us | kernels (GPU us each) |")
    print("| --- | --- | --- | --- |")
    first = None
    for dt, h, hk, d, b, n in SHAPES:
        dtype = getattr(torch, dt)
        q = torch.randn(b, 1, h, d, device="cuda", dtype=dtype)
        k, v = (torch.randn(b, n, hk, d, device="cuda", dtype=dtype) for _ in range(2))
        lens = torch.full((b,), n, device="cuda", dtype=torch.int32)

        def call(q=q, k=k, v=v, lens=lens):
            return cufa.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)
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
        print(f"| {dt} {h}/{hk} d={d} {b}x{n} | {host:.1f} | {wall:.1f} | {text} |")
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
