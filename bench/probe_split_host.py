#!/usr/bin/env python3
"""Host side of split decodes: for batch-1 caches (split-KV, so a decode launch and a merge),
the host time to queue a call, the time a call takes when calls are queued back to back
(the larger of host and GPU), and one call followed by a sync. One JSON line a shape, for
A/B of trees (each in its own process, as bench/ab_varlen.sh runs them):

    PYTHONPATH=TREE python3 bench/probe_split_host.py [--calls 400] [--tag NAME]
"""
import argparse
import json
import os
import sys
import time

import torch

import cufa

SHAPES = ((64, 32768, 1), (64, 32768, 4), (128, 32768, 1), (64, 131072, 1))  # d, keys, query rows


def timings(fn, calls):
    for _ in range(30):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    queued_host = time.perf_counter() - t0
    torch.cuda.synchronize()
    queued = time.perf_counter() - t0
    alone = []
    for _ in range(calls // 4):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        alone.append(time.perf_counter() - t)
    alone.sort()
    return dict(host_us=queued_host / calls * 1e6, queued_us=queued / calls * 1e6,
                one_at_a_time_us=alone[len(alone) // 2] * 1e6)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--tag", default=os.path.basename(os.environ.get("PYTHONPATH", "")))
    args = p.parse_args()
    for d, n, sq in SHAPES:
        cache = [torch.randn(1, n, 8, d, device="cuda", dtype=torch.float16) for _ in range(2)]
        q = torch.randn(1, sq, 32, d, device="cuda", dtype=torch.float16)
        lens = torch.full((1,), n, device="cuda", dtype=torch.int32)
        row = timings(lambda: cufa.flash_attn_with_kvcache(q, *cache, cache_seqlens=lens),
                      args.calls)
        print(json.dumps(dict(tree=args.tag, d=d, keys=n, sq=sq, **row)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
