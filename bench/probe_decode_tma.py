#!/usr/bin/env python3
"""The TMA decode kernel (kernels_cu/decode_sm90.cu) against the cp.async one on the same
calls: CUFA_DECODE_TMA forced to 0 (cp.async), 1 and 2 (TMA, one or two units a CTA), the
TMA kernel on other ring depths (--stages: "tma sN", one unit a CTA) and the planner's own
choice, beside SDPA cuDNN; contiguous caches, d = 64, 32 query heads, one query token.
Each sample is one CUDA graph replay (graph) or one call queued behind a spinning kernel
(queued: bench_decode's cufa column, where a split call merges in its launch), CUDA
events, median of interleaved rounds; caches under 100 MB rotate two sets (L2).

First written as a standalone kernel (bench/NOTES.md, KV cache: "A decode kernel on
TMA"); this is what chose kvcache._tma_route's rule.

    python3 bench/probe_decode_tma.py [--shapes 8x16384:32,...] [--rounds 4] [--stages 6,8]
        [--dtype bf16] [--routes cp.async,tma] [--splits 0,32]
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
from bench_fwd import time_events  # noqa: E402
from cufa import _compile, api  # noqa: E402

ROUTES = {"cp.async": "0", "tma": "1", "tma x2": "2", "planned": None}
_stages = [0]  # the ring depth a forced TMA route compiles (0: DECODE_TMA_STAGES)
_tma_kernel = _compile.decode_tma_kernel


def _tma_kernel_of_depth(dtype, head_dim, units):
    if not _stages[0]:
        return _tma_kernel(dtype, head_dim, units)
    return _compile.DecodeKernel("decode_tma", dtype, head_dim, units=units, stages=_stages[0],
                                 archs=("sm_90",))


_compile.decode_tma_kernel = _tma_kernel_of_depth


def graph_us(fn, reps=20):
    return graph_replay_us(torch, fn, reps)


def queued_us(fn, sets, reps=20):
    return statistics.median(time_events(torch, fn, sets, reps)) * 1e3


def route(forced):
    """forced: a CUFA_DECODE_TMA value, or "sN" (TMA, one unit a CTA, a ring of N)."""
    api.clear_plans()  # (reads the environment's overrides again: set ours after it)
    _stages[0] = int(forced[1:]) if forced and forced.startswith("s") else 0
    _compile._overrides[_compile.DECODE_TMA_ENV] = "1" if _stages[0] else forced


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8x16384:32,1x131072:32,1x131072:8,8x16384:8,1x32768:8,"
                                        "64x4096:8,128x2048:8")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--stages", default="", help="comma list of TMA ring depths to time too")
    ap.add_argument("--routes", default=",".join(ROUTES), help="comma list of " + ", ".join(ROUTES))
    ap.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"))
    ap.add_argument("--splits", default="0", help="comma list of num_splits each route takes "
                    "(0: the planner's)")
    args = ap.parse_args()
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    routes = {name: ROUTES[name] for name in args.routes.split(",")}
    routes.update({f"tma s{n}": f"s{n}" for n in args.stages.split(",") if n})
    routes = {(f"{name} n{ns}" if ns else name): (forced, ns) for name, forced in routes.items()
              for ns in (int(x) for x in args.splits.split(","))}
    print(f"device: {torch.cuda.get_device_name()}, {args.dtype}; graph replay / queued us "
          "(ratio to the first route's)")
    for shape in args.shapes.split(","):
        bn, hk = shape.split(":")
        b, n = (int(x) for x in bn.split("x"))
        hk, d = int(hk), 64
        q = torch.randn(b, 1, 32, d, dtype=dtype, device="cuda")
        sets = [tuple(torch.randn(b, n, hk, d, dtype=dtype, device="cuda") for _ in range(2))
                for _ in range(2 if 2 * b * n * hk * d * 2 < 100e6 else 1)]
        lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
        outs = {}
        for name, (forced, ns) in routes.items():
            route(forced)
            outs[name] = cufa.flash_attn_with_kvcache(q, *sets[0], cache_seqlens=lens,
                                                      num_splits=ns).float()
        first = next(iter(routes))
        worst = max((o - outs[first]).abs().max().item() for o in outs.values())
        runs = list(routes.items()) + [("cudnn", ("cudnn", 0))]
        times = {}
        for _ in range(args.rounds):
            random.shuffle(runs)
            for name, (forced, ns) in runs:
                if forced == "cudnn":
                    def fn(k, v):
                        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                            return F.scaled_dot_product_attention(
                                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                enable_gqa=hk != 32)
                else:
                    route(forced)

                    def fn(k, v, ns=ns):
                        return cufa.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens,
                                                           num_splits=ns)
                g = graph_us(lambda: [fn(*c) for c in sets]) / len(sets)
                times.setdefault(name, []).append((g, queued_us(fn, sets)))
        route(None)
        med = {nm: [statistics.median(t[i] for t in times[nm]) for i in range(2)] for nm in times}
        line = " | ".join(f"{nm} {med[nm][0]:.1f} ({med[nm][0] / med[first][0]:.3f}) / "
                          f"{med[nm][1]:.1f} ({med[nm][1] / med[first][1]:.3f})" for nm in med)
        print(f"{shape} ({2 * sets[0][0].numel() * 2 / 1e9:.3f} GB, routes agree to {worst:.1e}): "
              f"{line}", flush=True)


if __name__ == "__main__":
    main()
