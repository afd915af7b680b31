#!/usr/bin/env python3
"""One tree's dense forward on a few shapes, for kernel A/Bs (`BENCH=fwd bash
bench/ab_varlen.sh run`): each tree in its own process, the trees in a new random order
each round, so that clock and power drift fall on all of them alike. Prints one JSON line,
TFLOP/s (and µs) per shape.

    python3 bench/ab_fwd_probe.py TREE [--shapes d:N:causal[:bf16][:sc],...] [--reps 30]
                                       [--peer cudnn|flash]

16k tokens a batch and heads = 2048 / d, as in bench_fwd.py. N may be NQxNK (query rows x
keys, 16k query rows a batch): a sweep of NK at one NQ separates a tile's fixed cost from
its cost a key block. --peer times PyTorch SDPA's backend instead of the tree's cufa. After a
warm-up of at least WARMUP_S, each sample is three calls back to back between one pair of
CUDA events (host cost hidden); the median is reported, with the wall-clock span of the
warm-up and samples (epoch seconds), which ab_varlen.sh matches with its nvidia-smi clock
and power samples. A shape marked :sc runs with softcap 30 (the score-mods kernels); the
SDPA peers have no softcap and skip it.
"""
import argparse
import json
import os
import statistics
import sys
import time

WARMUP_S = 0.2  # of calls before each shape's samples (bench_fwd.py: 30 ms a block, in rounds)
DEFAULT_SHAPES = ("64:2048:0,64:8192:0,64:16384:1,128:512:0,128:2048:0,128:8192:0,"
                  "128:16384:0,128:16384:1,128:1024:1,256:8192:0")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("tree", help="folder holding the cufa package to time")
    p.add_argument("--shapes", default=DEFAULT_SHAPES)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--peer", choices=("cudnn", "flash"))
    args = p.parse_args()
    sys.path.insert(0, os.path.abspath(args.tree))
    import torch
    import cufa

    attend = lambda q, k, v, causal, softcap: cufa.flash_attn_func(  # noqa: E731
        q, k, v, causal=causal, softcap=softcap)
    if args.peer:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
        context = sdpa_kernel(backend[args.peer])
        context.__enter__()  # for the whole process
        sdpa = torch.nn.functional.scaled_dot_product_attention
        attend = lambda q, k, v, causal, softcap: sdpa(  # noqa: E731
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    result = {"tree": args.peer or os.path.basename(os.path.abspath(args.tree))}
    for text in args.shapes.split(","):
        d, n, causal, *flags = text.split(":")
        n, n_k = (int(x) for x in (n.split("x") if "x" in n else (n, n)))
        d, causal = int(d), bool(int(causal))
        dt = torch.bfloat16 if "bf16" in flags else torch.float16
        softcap = 30.0 if "sc" in flags else 0.0
        if softcap and args.peer:
            continue
        batch, heads = max(1, 16384 // n), 2048 // d
        q = torch.randn(batch, n, heads, d, device="cuda", dtype=dt)
        k, v = (torch.randn(batch, n_k, heads, d, device="cuda", dtype=dt) for _ in range(2))
        # Warm-up: 10 calls, then calls until WARMUP_S has passed, so that the samples are
        # taken under the shape's sustained load, as bench_fwd.py's are (10 calls of a
        # short shape are ~5 ms; the SM clock under tensor work read 1500-1980 MHz in
        # nvidia-smi's samples, bench/NOTES.md, so a few ms need not have settled it).
        for _ in range(10):
            attend(q, k, v, causal, softcap)
        torch.cuda.synchronize()
        began = time.time()
        warm_until = began + WARMUP_S
        while time.time() < warm_until:
            for _ in range(5):
                attend(q, k, v, causal, softcap)
            torch.cuda.synchronize()
        samples = []
        for _ in range(args.reps):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(3):
                attend(q, k, v, causal, softcap)
            stop.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(stop) / 3)
        flops = 4 * batch * heads * n * n_k * d / (2 if causal else 1)
        result[text] = round(flops / statistics.median(samples) / 1e9, 1)
        result[text + ":us"] = round(statistics.median(samples) * 1e3, 2)
        result[text + ":t"] = (round(began, 3), round(time.time(), 3))  # warm-up and samples
    print(json.dumps(result))


if __name__ == "__main__":
    main()
