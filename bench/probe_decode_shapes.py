#!/usr/bin/env python3
"""Decode kernel shapes and split counts forced, against the planner's choice and SDPA
cuDNN: contiguous caches, one CUDA graph replay a sample (CUDA events), median of
interleaved rounds. For rows where cuDNN leads by more than the noise (8 x 16k with 32
KV heads at d = 64 reads ~6 % behind it): whether more bytes in flight an SM (more CTAs
an SM through splits on the four-CTA shape, or the eight-warp shape) closes it.

    python3 bench/probe_decode_shapes.py [--rounds 5] [--shapes 8x16384:32:64,...]

A shape is BxN:HK:D (32 query heads, one query token, fp16). A variant is
KERNEL/SPLITS: KERNEL default, more (_compile.DECODE_MORE_CTAS) or wWsS (W warps of S
cp.async stages each; over 99 KB of shared memory on sm_90 only); SPLITS 0 is the
planner's count for that kernel ("default/0" is the planner's own choice of both). (The
eight-warp shape it also timed lives on branch next/decode-deep.)
"""
import argparse
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import cufa  # noqa: E402
from bench_decode import graph_replay_us  # noqa: E402  (this script's folder is on sys.path)
from cufa import _compile, api, kvcache  # noqa: E402

_plan_kernel = kvcache._kernel_and_splits
_forced = [None]


def _kernel(kind, d):
    if kind == "more":
        return _compile.decode_kernel_with_more_ctas("fp16", d)
    if kind.startswith("w"):
        warps, stages = (int(x) for x in kind[1:].split("s"))
        return _compile.DecodeKernel("decode", "fp16", _compile.padded_head_dim(d), stages=stages,
                                     warps=warps)
    return _compile.decode_kernel("fp16", d)


def _patched(dtype, d, num_splits, units, capacity, device, paged=False):
    if _forced[0] is None:
        return _plan_kernel(dtype, d, num_splits, units, capacity, device, paged)
    kind, splits = _forced[0]
    kernel = _kernel(kind, d)
    if splits == 0:
        splits = kvcache._split_count(0, units, capacity, kernel, device, paged)
    return kernel, splits


kvcache._kernel_and_splits = _patched


def graph_us(fn, reps=20):
    return graph_replay_us(torch, fn, reps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8x16384:32:64,8x16384:8:64,1x32768:32:64,128x2048:8:64,"
                                        "64x4096:8:128,8x16384:32:128")
    ap.add_argument("--variants", default="default/0,more/1,more/2,default/2,more/4")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}")
    variants = [(v.split("/")[0], int(v.split("/")[1])) for v in args.variants.split(",")]
    for shape in args.shapes.split(","):
        bn, hk, d = shape.split(":")
        b, n = (int(x) for x in bn.split("x"))
        hk, d = int(hk), int(d)
        q = torch.randn(b, 1, 32, d, dtype=torch.float16, device="cuda")
        caches = [tuple(torch.randn(b, n, hk, d, dtype=torch.float16, device="cuda") for _ in range(2))
                  for _ in range(2 if b * n * hk * d * 4 < 2**30 else 1)]
        gb = b * n * hk * d * 4 / 1e9
        ref = None
        times = {}

        def cufa_call(k, v):
            return cufa.flash_attn_with_kvcache(q, k, v, cache_seqlens=n)

        for kind, splits in variants:
            _forced[0] = None if (kind, splits) == ("default", 0) else (kind, splits)
            api._plans.clear()
            out = cufa_call(*caches[0])
            if ref is None:
                ref = out.float()
            err = (out.float() - ref).abs().max().item()
            assert err < 2e-2, (shape, kind, splits, err)
        qt = q.transpose(1, 2)

        def cudnn_call(k, v):
            kt, vt = k.transpose(1, 2), v.transpose(1, 2)
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=hk != 32)

        runs = [(f"{k}/{s}", k, s) for k, s in variants] + [("cudnn", None, None)]
        for _ in range(args.rounds):
            random.shuffle(runs)
            for name, kind, splits in runs:
                if kind is None:
                    fn = lambda: [cudnn_call(*c) for c in caches]  # noqa: E731
                else:
                    _forced[0] = None if (kind, splits) == ("default", 0) else (kind, splits)
                    api._plans.clear()
                    fn = lambda: [cufa_call(*c) for c in caches]  # noqa: E731
                times.setdefault(name, []).append(graph_us(fn) / len(caches))
        base = statistics.median(times["cudnn"])
        line = " ".join(f"{name} {statistics.median(t):.1f} ({base / statistics.median(t):.3f})"
                        for name, t in times.items())
        print(f"{shape} ({gb:.2f} GB): {line}", flush=True)
    _forced[0] = None


if __name__ == "__main__":
    main()
