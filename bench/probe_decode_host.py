#!/usr/bin/env python3
"""Probe: the torch primitives a decode call's host path is made of, each timed alone
(queued, us a call, best of 3), then a split decode call on a cache small enough that the
host sets the pace (1 x 2k keys, 32/8 heads, d = 64), against SDPA's call on it.

    python3 bench/probe_decode_host.py [--calls 5000]
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import cufa  # noqa: E402
from cufa import _interop, api, kvcache  # noqa: E402
from host_breakdown import us_per_call  # noqa: E402  (best of three rounds)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=5000)
    p.add_argument("--keys", type=int, default=2048)
    args = p.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    keys = args.keys
    cache = [torch.randn(1, keys, 8, 64, device="cuda", dtype=torch.float16) for _ in range(2)]
    q = torch.randn(1, 1, 32, 64, device="cuda", dtype=torch.float16)
    lens = torch.full((1,), keys, device="cuda", dtype=torch.int32)
    shape, dt, dev = tuple(q.shape), torch.float16, torch.device("cuda", 0)
    qt, kt, vt = q.transpose(1, 2), cache[0].transpose(1, 2), cache[1].transpose(1, 2)
    raw = torch._C._cuda_getCurrentRawStream
    sdpa = torch.nn.functional.scaled_dot_product_attention
    call = lambda: cufa.flash_attn_with_kvcache(q, *cache, cache_seqlens=lens)  # noqa: E731
    call()
    (plan,) = [pl for key, pl in api._plans.items() if key[0] == "kvcache"]
    empty_strided = torch.empty_strided
    strides = _interop.contiguous_strides(shape)
    steps = {
        "torch.empty(shape, dtype=, device=torch.device)": lambda: torch.empty(
            shape, dtype=dt, device=dev),
        "torch.empty(shape, dtype=, device='cuda')": lambda: torch.empty(
            shape, dtype=dt, device="cuda"),
        "q.new_empty(shape)": lambda: q.new_empty(shape),
        "torch.empty_like(q)": lambda: torch.empty_like(q),
        "torch.empty_like(q, memory_format=contiguous)": lambda: torch.empty_like(
            q, memory_format=torch.contiguous_format),
        "torch.empty_strided(shape, strides, dtype, device)": lambda: empty_strided(
            shape, strides, dtype=dt, device=dev),
        "t.data_ptr()": lambda: q.data_ptr(),
        "t.shape": lambda: q.shape,
        "t.stride()": lambda: q.stride(),
        "t.dtype": lambda: q.dtype,
        "t.get_device()": lambda: q.get_device(),
        "t.requires_grad": lambda: q.requires_grad,
        "t.is_cuda": lambda: q.is_cuda,
        "signature (13 arrays)": lambda: _interop.signature(
            (q, *cache, None, None, None, None, lens, None, None, None, None, None),
            kvcache._ARRAYS),
        "raw current stream": lambda: raw(0),
        "torch.cuda.is_current_stream_capturing()": torch.cuda.is_current_stream_capturing,
        "api.stream_capturing(stream)": lambda: api.stream_capturing(raw(0)),
        "whole cufa call": call,
        "SDPA flash (context outside)": None,
        "SDPA cuDNN (context outside)": None,
    }
    print(f"| step, 1 x {keys} keys, {plan.launches and len(plan.launches)} launches "
          f"({torch.cuda.get_device_name()}) | host us/call |")
    print("| --- | --- |")
    for name, fn in steps.items():
        if fn is None:
            backend = SDPBackend.FLASH_ATTENTION if "flash" in name else SDPBackend.CUDNN_ATTENTION
            with sdpa_kernel(backend):
                t = us_per_call(lambda: sdpa(qt, kt, vt, enable_gqa=True), args.calls)
        else:
            t = us_per_call(fn, args.calls)
        print(f"| {name} | {t:.2f} |", flush=True)
    print("\n| one call and a sync (median of 300) | wall us |\n| --- | --- |")
    for name in ("cufa", "SDPA flash", "SDPA cuDNN"):
        backend = SDPBackend.CUDNN_ATTENTION if "cuDNN" in name else SDPBackend.FLASH_ATTENTION
        fn = call if name == "cufa" else (lambda: sdpa(qt, kt, vt, enable_gqa=True))
        walls = []
        with sdpa_kernel(backend):
            for _ in range(300):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                walls.append(time.perf_counter() - t0)
        walls.sort()
        print(f"| {name} | {walls[len(walls) // 2] * 1e6:.1f} |")


if __name__ == "__main__":
    main()
