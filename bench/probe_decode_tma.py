#!/usr/bin/env python3
"""The TMA decode kernel (kernels_cu/decode_sm90.cu) against the cp.async one on the same
calls: CUFA_DECODE_TMA forced to 0 (cp.async), 1 and 2 (TMA, one or two units a CTA) and
the planner's own choice, beside SDPA cuDNN; contiguous caches, d = 64, fp16, 32 query
heads, one query token; one CUDA graph replay a sample, median of interleaved rounds.

First written as a standalone kernel (bench/NOTES.md, KV cache: "A decode kernel on
TMA"); this is what chose kvcache._tma_route's rule.

    python3 bench/probe_decode_tma.py [--shapes 8x16384:32,...] [--rounds 4]
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
from cufa import _compile, api  # noqa: E402

ROUTES = {"cp.async": "0", "tma": "1", "tma x2": "2", "planned": None}


def graph_us(fn, reps=20):
    return graph_replay_us(torch, fn, reps)


def route(forced):
    api.clear_plans()  # (reads the environment's overrides again: set ours after it)
    _compile._overrides[_compile.DECODE_TMA_ENV] = forced


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8x16384:32,1x131072:32,1x131072:8,8x16384:8,1x32768:8,"
                                        "64x4096:8,128x2048:8")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}")
    for shape in args.shapes.split(","):
        bn, hk = shape.split(":")
        b, n = (int(x) for x in bn.split("x"))
        hk, d = int(hk), 64
        q = torch.randn(b, 1, 32, d, dtype=torch.float16, device="cuda")
        k, v = (torch.randn(b, n, hk, d, dtype=torch.float16, device="cuda") for _ in range(2))
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        outs = {}
        for name, forced in ROUTES.items():
            route(forced)
            outs[name] = cufa.flash_attn_with_kvcache(q, k, v, cache_seqlens=n).float()
        worst = max((o - outs["cp.async"]).abs().max().item() for o in outs.values())
        runs = list(ROUTES.items()) + [("cudnn", "cudnn")]
        times = {}
        for _ in range(args.rounds):
            random.shuffle(runs)
            for name, forced in runs:
                if forced == "cudnn":
                    def fn():
                        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=hk != 32)
                else:
                    route(forced)

                    def fn():
                        return cufa.flash_attn_with_kvcache(q, k, v, cache_seqlens=n)
                times.setdefault(name, []).append(graph_us(fn))
        route(None)
        base = statistics.median(times["cp.async"])
        line = " ".join(f"{nm} {statistics.median(times[nm]):.1f} ({statistics.median(times[nm]) / base:.3f})"
                        for nm in list(ROUTES) + ["cudnn"])
        print(f"{shape} ({2 * k.numel() * 2 / 1e9:.2f} GB, routes agree to {worst:.1e}): {line}",
              flush=True)


if __name__ == "__main__":
    main()
