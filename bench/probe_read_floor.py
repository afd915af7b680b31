#!/usr/bin/env python3
"""How close can a decode call over a small cache come to the copy bandwidth, timed as
bench_decode.py times it? Against cufa and SDPA cuDNN on the same caches, read-only
kernels that stream the cache's K and V and do nothing else (probe_kv_rows.py's: the
bulk-copy engine over whole rows, tensor-map boxes of one KV head's stripe as the TMA
decode kernel reads, per-thread loads of a stripe and of whole rows; 128 CTAs, one an SM),
and an empty kernel: the launch and the event pair alone. Every column is a call between its own CUDA event pair, queued
behind a spinning kernel (bench_fwd.time_events), rounds interleaved in random order, two
cache sets rotated as bench_decode.py rotates caches under 100 MB.

    python3 bench/probe_read_floor.py [--caches 1x32768:8:64,1x32768:8:128] [--reps 60]
"""
import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import bench_decode  # noqa: E402
import bench_fwd  # noqa: E402
import probe_kv_rows  # noqa: E402

EMPTY = r"""extern "C" __global__ void empty_kernel() {}"""
STAGES, CHUNK = 4, 32768  # bulk copies in flight a CTA (probe_kv_rows: 24.2-24.4 us at 64 MB)


def _caches(text):
    out = []
    for item in text.split(","):
        bn, hk, d = item.split(":")
        b, n = bn.split("x")
        out.append((int(b), int(n), int(hk), int(d)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--caches", type=_caches, default=_caches("1x32768:8:64,1x32768:8:128"),
                    help="comma list of BATCHxKEYS:KV_HEADS:HEAD_DIM (32 query heads, fp16)")
    ap.add_argument("--reps", type=int, default=60, help="timed calls a column, over 4 rounds")
    args = ap.parse_args()
    import cupy
    import torch
    import cufa
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy_tbps = bench_decode.measure_copy(torch)
    print(f"{torch.cuda.get_device_name()}: copy {copy_tbps:.2f} TB/s, {sms} SMs")
    read_name = f"stream_bulk<{STAGES},{CHUNK}>"
    loads = {"stripe": (1, 256, 16), "rows": (8, 512, 16)}  # (heads a CTA, threads, loads)
    load_names = {k: f"stream<{h},{t},{u}>" for k, (h, t, u) in loads.items()}
    tma_names = {d: f"stream_tma<8,64,{d // 64}>" for d in (64, 128)}
    mod = cupy.RawModule(code=probe_kv_rows.SOURCE, options=("-std=c++17",),
                         name_expressions=[read_name, *load_names.values(), *tma_names.values()])
    read = mod.get_function(read_name)
    read.max_dynamic_shared_size_bytes = STAGES * CHUNK
    empty = cupy.RawKernel(EMPTY, "empty_kernel")
    gen = torch.Generator(device="cuda").manual_seed(0)
    print("| cache | MB | empty launch | whole rows, bulk copies | one head's stripe, tensor-map "
          "boxes | one head's stripe, loads | whole rows, loads | cufa | cufa graph | SDPA cuDNN |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for b, n, hk, d in args.caches:
        h = 32
        sets = []
        for _ in range(2):
            k = torch.randn(b, n, hk, d, device="cuda", dtype=torch.float16, generator=gen)
            v = torch.randn(b, n, hk, d, device="cuda", dtype=torch.float16, generator=gen)
            q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.float16, generator=gen)
            lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
            sets.append((q, k, v, lens))
        nbytes = 2 * sets[0][1].numel() * 2
        views = [(cupy.asarray(k), cupy.asarray(v)) for _, k, v, _ in sets]
        scratch = cupy.zeros(1, dtype=cupy.uint32)

        def read_call(ctas):
            per_cta = -(-nbytes // 2 // ctas // 16) * 16
            return lambda i: read((ctas,), (32,), (views[i][0], views[i][1],
                                                   cupy.int64(nbytes // 2), cupy.int64(per_cta)),
                                  shared_mem=STAGES * CHUNK)

        def load_call(kind):
            heads, threads, _ = loads[kind]
            fn = mod.get_function(load_names[kind])
            splits = 128 // (hk // heads)
            return lambda i: fn((128,), (threads,), (
                views[i][0], views[i][1], cupy.int32(b * n), cupy.int32(-(-b * n // splits)),
                cupy.int32(hk), cupy.int32(d // 8), scratch))

        def tma_call():
            fn = mod.get_function(tma_names[d])
            smem = 8 * (d // 64) * 64 * 128 + 1024
            fn.max_dynamic_shared_size_bytes = smem
            maps = [tuple(probe_kv_rows._tensor_map(x, b * n, hk, d, 64) for x in pair)
                    for pair in views]
            return lambda i: fn((128,), (32,), (maps[i][0], maps[i][1], cupy.int32(b * n),
                                                cupy.int32(-(-b * n // (128 // hk))),
                                                cupy.int32(hk)), shared_mem=smem)

        def cufa_call(q, k, v, lens):
            return cufa.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)

        graphs = bench_decode.capture_graphs(torch, cufa_call, sets)
        bhsd = [(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)) for q, k, v, _ in sets]

        def sdpa(q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=h != hk)

        def sdpa_timer(count):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return bench_fwd.time_events(torch, sdpa, bhsd, count)

        index = [(0,), (1,)]
        timers = {
            "empty": lambda c: bench_fwd.time_events(torch, lambda i: empty((1,), (32,), ()), index, c),
            "bulk_rows": lambda c: bench_fwd.time_events(torch, read_call(128), index, c),
            "tma_stripe": lambda c: bench_fwd.time_events(torch, tma_call(), index, c),
            "loads_stripe": lambda c: bench_fwd.time_events(torch, load_call("stripe"), index, c),
            "loads_rows": lambda c: bench_fwd.time_events(torch, load_call("rows"), index, c),
            "cufa": lambda c: bench_fwd.time_events(torch, cufa_call, sets, c),
            "cufa_graph": lambda c: bench_fwd.time_events(torch, lambda g: g.replay(),
                                                          [(g,) for g in graphs], c),
            "cudnn": sdpa_timer,
        }
        got = bench_fwd.run_rounds(timers, -(-args.reps // bench_fwd.ROUNDS))
        cells = []
        for name in timers:
            ms = got[name]
            if isinstance(ms, dict):
                cells.append(f"n/a ({ms['na']})")
                continue
            us = statistics.median(ms) * 1e3
            cells.append(f"{us:.1f}" if name == "empty" else
                         f"{us:.1f} ({nbytes / (us * 1e-6) / 1e12 / copy_tbps:.0%})")
        print(f"| {b} x {n}, {h}/{hk}, d = {d} | {nbytes / 2**20:.0f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
