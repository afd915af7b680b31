#!/usr/bin/env python3
"""What a split decode's merge costs inside a CUDA graph: batch-1 decodes replayed from
a graph as they run (decode kernel, then the split combine), with the combine launch
dropped (the output is then wrong: time only), and with it dropped and a 256-byte
memset node before the decode kernel (what a merge fused into the decode kernel would
need under graph capture: a zeroed counter). CUDA events around each replay, median and
best of 5 interleaved rounds. bench/NOTES.md, KV cache, "Next" item 3.

    python3 bench/probe_decode_graph.py
"""
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cupy  # noqa: E402
import torch  # noqa: E402

import cufa  # noqa: E402
from bench_decode import graph_replay_us  # noqa: E402  (this script's folder is on sys.path)
from cufa import kvcache  # noqa: E402

CASES = ("as run", "combine dropped", "combine dropped, memset node")
_launch_decode = kvcache._launch_decode
_case = [CASES[0]]
_counters = torch.zeros(64, dtype=torch.int32, device="cuda")


def _patched(record, launches, workspace, merge_in_launch, pointers, framework, device, stream,
             scratch_ptr, **kw):
    if _case[0] != CASES[0] and launches[-1][0] == "combine":
        launches = launches[:-1]
    if _case[0] == CASES[2]:
        cupy.cuda.runtime.memsetAsync(_counters.data_ptr(), 0, 256, stream)
    return _launch_decode(record, launches, workspace, merge_in_launch, pointers, framework,
                          device, stream, scratch_ptr, **kw)


def graph_us(fn, reps=60):
    return graph_replay_us(torch, fn, reps)


def main():
    kvcache._launch_decode = _patched
    print(f"| batch-1 decode, 32/8 heads, fp16 ({torch.cuda.get_device_name()}) | "
          + " | ".join(f"{c}: us best / median (% of 3.01 TB/s)" for c in CASES) + " |")
    print("|" + " --- |" * (len(CASES) + 1))
    for d, n in ((64, 32768), (128, 32768), (64, 131072)):
        q = torch.randn(1, 1, 32, d, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(1, n, 8, d, device="cuda", dtype=torch.float16) for _ in range(2))
        lens = torch.full((1,), n, device="cuda", dtype=torch.int32)
        mb = 2 * n * 8 * d * 2 / 1e6
        times = {c: [] for c in CASES}
        for _ in range(5):
            for case in random.sample(CASES, len(CASES)):
                _case[0] = case
                times[case].append(graph_us(
                    lambda: cufa.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)))
        cells = [f"{min(t):.1f} / {statistics.median(t):.1f} ({mb / min(t) / 3.01:.0%})"
                 for t in times.values()]
        print(f"| d = {d}, 1 x {n} ({mb:.0f} MB) | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
