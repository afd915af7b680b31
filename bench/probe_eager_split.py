#!/usr/bin/env python3
"""Probe: a batch-1 split decode called eagerly, back to back (calls issued, then one
sync: host us a call while issuing, wall us a call), with the merge in the decode launch
(the default) and with decode_combine instead, beside graph replays of the call and SDPA's
calls; fp16, 1 x 32k keys, 32/8 heads. Two caches rotate (64 MB at d = 64 outgrows L2).
A second table: the same calls queued behind a spinning kernel (bench_fwd.queue_ahead),
GPU us a call between an event before the first and one after the last: the host hidden.

A third (--profile): each call's kernels by the torch profiler, GPU us each and the span
from the first kernel's start to the last one's end, the calls queued as above.

    python3 bench/probe_eager_split.py [--calls 400] [--head-dims 64,128] [--profile]
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fwd import queue_ahead  # noqa: E402

import cufa  # noqa: E402
from cufa import api  # noqa: E402


def back_to_back(fn, sets, calls):
    for i in range(20):
        fn(*sets[i % len(sets)])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(calls):
        fn(*sets[i % len(sets)])
    issued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return (issued - t0) / calls * 1e6, (done - t0) / calls * 1e6


def queued_gpu(fn, sets, calls):
    """GPU us a call of `calls` calls issued behind a spinning kernel; None where issuing
    outlasted the spin (the queue may have run dry)."""
    for i in range(20):
        fn(*sets[i % len(sets)])
    torch.cuda.synchronize()
    lead_ms = 2 + 0.2 * calls
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    queue_ahead(torch, lead_ms)
    t0 = time.perf_counter()
    a.record()
    for i in range(calls):
        fn(*sets[i % len(sets)])
    b.record()
    issued_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    return a.elapsed_time(b) / calls * 1e3 if issued_ms < 0.9 * lead_ms else None


def profiled(fn, sets, calls=40):
    """-> ({kernel name: median GPU us}, median us from a call's first kernel start to its
    last kernel end), the calls queued behind a spin, one marker kernel between calls."""
    for i in range(10):
        fn(*sets[i % len(sets)])
    torch.cuda.synchronize()
    marker = torch.zeros(1, device="cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        queue_ahead(torch, 2 + 0.2 * calls)
        for i in range(calls):
            marker.add_(1)
            fn(*sets[i % len(sets)])
        marker.add_(1)
        torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    calls_seen, current, times = [], None, {}
    for start, end, name in kernels:
        if "spin" in name.lower():
            continue
        if "add" in name.lower() and "elementwise" in name.lower():  # the marker
            if current:
                calls_seen.append(current)
            current = []
            continue
        if current is not None:
            current.append((start, end, name))
            times.setdefault(name, []).append(end - start)
    spans = sorted(c[-1][1] - c[0][0] for c in calls_seen if c)
    med = {n[:48]: sorted(t)[len(t) // 2] for n, t in times.items()}
    return med, spans[len(spans) // 2] if spans else float("nan")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    profiles = []
    from torch.nn.attention import SDPBackend, sdpa_kernel
    sdpa = torch.nn.functional.scaled_dot_product_attention
    print("| d | sq | cufa eager (merge in launch): host / wall us | cufa eager, combine kernel "
          "| cufa graph replay wall | SDPA flash host / wall | SDPA cuDNN host / wall |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    queued = []
    for d in (int(x) for x in args.head_dims.split(",")):
        for sq in (1, 4):
            sets = []
            for _ in range(2):
                k, v = (torch.randn(1, 32768, 8, d, device="cuda", dtype=torch.float16)
                        for _ in range(2))
                q = torch.randn(1, sq, 32, d, device="cuda", dtype=torch.float16)
                lens = torch.full((1,), 32768, device="cuda", dtype=torch.int32)
                sets.append((q, k, v, lens))

            def call(q, k, v, lens):
                return cufa.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)
            row = [back_to_back(call, sets, args.calls)]
            gpu = [queued_gpu(call, sets, args.calls)]
            prof = [profiled(call, sets)] if args.profile else []
            plans = [pl for key, pl in api._plans.items() if key[0] == "kvcache"]
            for pl in plans:
                pl.merge_in_launch = False
            row.append(back_to_back(call, sets, args.calls))
            gpu.append(queued_gpu(call, sets, args.calls))
            if args.profile:
                prof.append(profiled(call, sets))
            for pl in plans:
                pl.merge_in_launch = True
            graphs = []
            for s in sets:
                call(*s)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    call(*s)
                graphs.append((g,))
            row.append(back_to_back(lambda g: g.replay(), graphs, args.calls))
            gpu.append(queued_gpu(lambda g: g.replay(), graphs, args.calls))
            if args.profile:
                prof.append(profiled(lambda g: g.replay(), graphs))
            bhsd = [tuple(x.transpose(1, 2) for x in s[:3]) for s in sets]
            for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
                with sdpa_kernel(backend):
                    fn = lambda q, k, v: sdpa(q, k, v, enable_gqa=True)  # noqa: E731
                    row.append(back_to_back(fn, bhsd, args.calls))
                    gpu.append(queued_gpu(fn, bhsd, args.calls))
                    if args.profile:
                        prof.append(profiled(fn, bhsd))
            api.clear_plans()
            cells = [f"{h:.1f} / {w:.1f}" for h, w in row]
            cells[2] = f"{row[2][1]:.1f}"
            print(f"| {d} | {sq} | " + " | ".join(cells) + " |", flush=True)
            queued.append((d, sq, gpu))
            profiles.append((d, sq, prof))
    # what moving 64 MB costs alone, against a 1 GB copy: the ramp and tail of any kernel
    # that size (two buffers rotate, as the caches do)
    big = [torch.empty(2**29, dtype=torch.float16, device="cuda") for _ in range(2)]
    rate = 2**31 / (queued_gpu(lambda a, b: b.copy_(a), [tuple(big)], 20) * 1e-6) / 1e12
    del big
    print(f"\n1 GB copy: {rate:.2f} TB/s (bytes read + written)")
    for mb in (32, 64):
        bufs = [torch.empty(mb * 2**19, dtype=torch.float16, device="cuda") for _ in range(4)]
        sets = [(bufs[0], bufs[1]), (bufs[2], bufs[3])]
        us = queued_gpu(lambda a, b: b.copy_(a), sets, args.calls)
        print(f"copy of {mb} MB: {us:.1f} us, {2 * mb * 2**20 / us / 1e6:.2f} TB/s "
              f"({2 * mb * 2**20 / us / 1e6 / rate:.0%} of the 1 GB copy)")
        us = queued_gpu(lambda a, b: a.sum(), sets, args.calls)
        print(f"sum over {mb} MB: {us:.1f} us, {mb * 2**20 / us / 1e6:.2f} TB/s read "
              f"({mb * 2**20 / us / 1e6 / rate:.0%} of the 1 GB copy's rate)")
    print("\nQueued behind a spin, GPU us a call (host hidden; n/a: issuing outlasted the spin)")
    print("| d | sq | cufa eager (merge in launch) | cufa eager, combine kernel | cufa graph "
          "| SDPA flash | SDPA cuDNN |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for d, sq, gpu in queued:
        cells = ["n/a" if us is None else f"{us:.1f}" for us in gpu]
        print(f"| {d} | {sq} | " + " | ".join(cells) + " |")
    if args.profile:
        names = ["cufa eager (merge in launch)", "cufa eager, combine kernel", "cufa graph",
                 "SDPA flash", "SDPA cuDNN"]
        print("\nTorch profiler, calls queued: span of a call's kernels (us) and each kernel's "
              "GPU us")
        for d, sq, prof in profiles:
            for name, (kernels, span) in zip(names, prof):
                each = ", ".join(f"{k} {us:.1f}" for k, us in kernels.items())
                print(f"d={d} sq={sq} {name}: span {span:.1f} | {each}")


if __name__ == "__main__":
    main()
