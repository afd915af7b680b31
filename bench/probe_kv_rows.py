#!/usr/bin/env python3
"""Does a CTA that reads whole cache rows (every KV head of a key range) stream faster than
one that reads one head's stripe of each row? A read-only probe, no attention: K and V of a
contiguous cache (keys, 8 KV heads, d) are read by 128 CTAs, each a rectangle of
(keys / splits) rows x HEADS heads, its threads walking the rectangle in row order with
UNROLL 16-byte loads in flight each. HEADS = 1 is today's decode layout (a CTA a KV head
and a split), 8 is whole rows. Caches rotate over three copies so L2 holds none of them.

With sm_90, also the bulk-copy engine (cp.async.bulk, TMA without a tensor map) reading
each CTA's contiguous share of whole rows, one thread a CTA, STAGES x CHUNK bytes in flight.

    python3 bench/probe_kv_rows.py [--keys 32768] [--d 64] [--rounds 5]
"""
import argparse
import ctypes
import os
import sys

import cupy

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SOURCE = r"""
typedef unsigned long long u64;
template <int kHeads, int kThreads, int kUnroll>
__global__ void __launch_bounds__(kThreads) stream(const uint4* k, const uint4* v, int keys, int keys_per_cta,
                                                   int heads_k, int chunks_a_head, unsigned* out) {
  const int groups = heads_k / kHeads;
  const int group = blockIdx.x % groups, split = blockIdx.x / groups;
  const int row_chunks = kHeads * chunks_a_head;
  const long long row0 = (long long)split * keys_per_cta;
  const long long rows = min((long long)keys_per_cta, max(0ll, keys - row0));  // (the last split)
  const long long n = rows * row_chunks;
  const long long stride = (long long)heads_k * chunks_a_head;
  unsigned acc = 0;
  for (long long base = threadIdx.x; base < n; base += (long long)kThreads * kUnroll) {
    uint4 a[kUnroll], b[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const long long j = base + (long long)u * kThreads;
      if (j < n) {
        const long long at = (row0 + j / row_chunks) * stride + group * row_chunks + j % row_chunks;
        a[u] = __ldcs(k + at);
        b[u] = __ldcs(v + at);
      } else {
        a[u] = make_uint4(0, 0, 0, 0);
        b[u] = a[u];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc ^= a[u].x ^ a[u].w ^ b[u].y ^ b[u].z;
  }
  if (acc == 0x12345678u) out[0] = acc;  // (keeps the loads)
}

// Waits until the mbarrier at `bar` has completed the phase of this parity.
__device__ __forceinline__ void wait_parity(unsigned bar, unsigned parity) {
  asm volatile(
      "{\n.reg .pred p;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra wait_%=;\n}" ::"r"(bar), "r"(parity) : "memory");
}

// The same bytes through the bulk-copy engine (TMA without a tensor map): one thread a CTA
// copies its contiguous share of K and of V (whole rows) in kChunk-byte pieces into a ring
// of kStages shared-memory stages, each piece announcing itself on its stage's mbarrier.
template <int kStages, int kChunk>
__global__ void __launch_bounds__(32) stream_bulk(const char* k, const char* v, long long bytes,
                                                 long long bytes_per_cta) {
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ __align__(8) unsigned long long full[kStages];
  if (threadIdx.x != 0) return;
  const unsigned ring_at = (unsigned)__cvta_generic_to_shared(ring);
  const unsigned bar_at = (unsigned)__cvta_generic_to_shared(full);
  for (int s = 0; s < kStages; ++s)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar_at + 8 * s));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  const long long begin = (long long)blockIdx.x * bytes_per_cta;
  const long long end = begin + bytes_per_cta < bytes ? begin + bytes_per_cta : bytes;
  const int pieces = begin < end ? (int)((end - begin + kChunk - 1) / kChunk) : 0;
  for (int i = 0; i < 2 * pieces + kStages; ++i) {
    const int s = i % kStages;
    if (i >= kStages) {  // the piece issued kStages ago into this stage has landed
      wait_parity(bar_at + 8 * s, ((i - kStages) / kStages) & 1);
    }
    if (i >= 2 * pieces) continue;
    const long long at = begin + (long long)(i / 2) * kChunk;
    const unsigned n = (unsigned)(end - at < kChunk ? end - at : kChunk);
    const char* src = (i % 2 ? v : k) + at;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar_at + 8 * s), "r"(n)
                 : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        ::"r"(ring_at + s * kChunk), "l"(src), "r"(n), "r"(bar_at + 8 * s) : "memory");
  }
}

// One head's stripe through tensor maps (what a decode kernel on TMA would read): one
// thread a CTA copies its (KV head, key range) as boxes of kBoxRows keys x 64 columns
// (kPanels boxes a tile), K and V alternating, into a ring of kStages stages.
template <int kStages, int kBoxRows, int kPanels>
__global__ void __launch_bounds__(32) stream_tma(const void* k_map, const void* v_map, int keys,
                                                int keys_per_cta, int heads_k) {
  extern __shared__ unsigned char tma_ring[];
  __shared__ __align__(8) unsigned long long full[kStages];
  if (threadIdx.x != 0) return;
  constexpr unsigned kPiece = kPanels * kBoxRows * 128;
  const unsigned raw = (unsigned)__cvta_generic_to_shared(tma_ring);
  const unsigned ring_at = (raw + 1023) & ~1023u;  // the 128-byte swizzle's 1 KB period
  const unsigned bar_at = (unsigned)__cvta_generic_to_shared(full);
  for (int s = 0; s < kStages; ++s)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar_at + 8 * s));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  const int head = blockIdx.x % heads_k, split = blockIdx.x / heads_k;
  const int key0 = split * keys_per_cta;
  const int key_end = min(key0 + keys_per_cta, keys);
  const int tiles = key0 < key_end ? (key_end - key0 + kBoxRows - 1) / kBoxRows : 0;
  for (int i = 0; i < 2 * tiles + kStages; ++i) {
    const int s = i % kStages;
    if (i >= kStages) {
      wait_parity(bar_at + 8 * s, ((i - kStages) / kStages) & 1);
    }
    if (i >= 2 * tiles) continue;
    const void* map = i % 2 ? v_map : k_map;
    const int row = key0 + (i / 2) * kBoxRows;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar_at + 8 * s),
                 "r"(kPiece) : "memory");
    for (int panel = 0; panel < kPanels; ++panel)
      asm volatile(
          "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
          " [%0], [%1, {%3, %4, %5, %6}], [%2];"
          ::"r"(ring_at + s * kPiece + panel * kBoxRows * 128), "l"(map), "r"(bar_at + 8 * s),
          "r"(panel * 64), "r"(row), "r"(head), "r"(0) : "memory");
  }
}
"""
BULK = ((4, 16384), (8, 16384), (4, 32768), (6, 32768), (12, 16384))
TMA = ((8, 64), (16, 64), (8, 128), (16, 32), (32, 32))  # (stages, key rows a box)


def launches_us(launch, reps):
    """µs a launch of `reps` launch(i) back to back (after three), by one CUDA event pair."""
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    for i in range(3):
        launch(i)
    start.record()
    for i in range(reps):
        launch(i)
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) * 1e3 / reps


def _tensor_map(cache, keys, heads_k, d, box_rows):
    """The cache's tensor map (cufa._tma's encoding: 64-column boxes, 128-byte swizzle) in
    device memory."""
    import numpy as np
    from cufa import _tma
    holder = ctypes.create_string_buffer(128 + 64)
    addr = ctypes.addressof(holder) + (-ctypes.addressof(holder) % 64)
    ok = _tma._encode_at(addr, "float16", cache.data.ptr, (1, keys, heads_k, d),
                         (keys * heads_k * d, heads_k * d, d, 1), box_rows)
    assert ok, "the driver would not encode the map"
    return cupy.asarray(np.frombuffer(ctypes.string_at(addr, 128), dtype=np.uint8))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=32768)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--heads-k", type=int, default=8)
    ap.add_argument("--ctas", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--no-bulk", action="store_true", help="skip the bulk-copy (sm_90) rows")
    args = ap.parse_args()
    dev = cupy.cuda.Device()
    print(f"device: {cupy.cuda.runtime.getDeviceProperties(dev.id)['name'].decode()}")
    chunks = args.d // 8
    shape = (args.keys, args.heads_k, args.d)
    caches = [(cupy.random.random(shape, dtype=cupy.float32).astype(cupy.float16),
               cupy.random.random(shape, dtype=cupy.float32).astype(cupy.float16)) for _ in range(3)]
    nbytes = 2 * caches[0][0].nbytes
    out = cupy.zeros(1, dtype=cupy.uint32)
    variants = []
    for heads in (1, 2, 4, 8):
        if args.heads_k % heads:
            continue
        for threads, unroll in ((128, 8), (128, 16), (256, 8), (256, 16), (512, 8)):
            name = f"stream<{heads},{threads},{unroll}>"
            variants.append((heads, threads, unroll, name))
    bulk = [] if args.no_bulk else [(stages, chunk, f"stream_bulk<{stages},{chunk}>") for stages, chunk in BULK]
    panels = args.d // 64
    tma = [] if args.no_bulk or args.d % 64 else [
        (stages, rows, f"stream_tma<{stages},{rows},{panels}>") for stages, rows in TMA
        if stages * panels * rows * 128 + 1024 <= 227 * 1024]
    mod = cupy.RawModule(code=SOURCE, options=("-std=c++17",),
                         name_expressions=[v[3] for v in variants] + [b[2] for b in bulk] +
                         [t[2] for t in tma])
    fns = {v[3]: mod.get_function(v[3]) for v in variants}
    results = {v[3]: [] for v in variants}
    for rnd in range(args.rounds):
        for heads, threads, unroll, name in variants:
            groups = args.heads_k // heads
            splits = args.ctas // groups
            keys_per_cta = -(-args.keys // splits)
            fn = fns[name]

            def launch(i):
                k, v = caches[i % 3]
                fn((splits * groups,), (threads,),
                   (k, v, cupy.int32(args.keys), cupy.int32(keys_per_cta), cupy.int32(args.heads_k),
                    cupy.int32(chunks), out))
            results[name].append(launches_us(launch, args.reps))
    for stages, chunk, name in bulk:
        fn = mod.get_function(name)
        fn.max_dynamic_shared_size_bytes = stages * chunk
        total = caches[0][0].nbytes
        per_cta = -(-total // args.ctas // 16) * 16
        times = []
        for rnd in range(args.rounds):
            def launch(i):
                k, v = caches[i % 3]
                fn((args.ctas,), (32,), (k, v, cupy.int64(total), cupy.int64(per_cta)),
                   shared_mem=stages * chunk)
            times.append(launches_us(launch, args.reps))
        results[name] = times
    for stages, rows, name in tma:
        fn = mod.get_function(name)
        smem = stages * panels * rows * 128 + 1024
        fn.max_dynamic_shared_size_bytes = smem
        maps = [tuple(_tensor_map(x, args.keys, args.heads_k, args.d, rows) for x in c) for c in caches]
        splits = args.ctas // args.heads_k
        keys_per_cta = -(-args.keys // splits)
        times = []
        for rnd in range(args.rounds):
            def launch(i):
                km, vm = maps[i % 3]
                fn((splits * args.heads_k,), (32,),
                   (km, vm, cupy.int32(args.keys), cupy.int32(keys_per_cta), cupy.int32(args.heads_k)),
                   shared_mem=smem)
            times.append(launches_us(launch, args.reps))
        results[name] = times
    print(f"cache {nbytes / 2**20:.0f} MB (K and V), {args.keys} keys x {args.heads_k} heads x d {args.d}, "
          f"{args.ctas} CTAs; median of {args.rounds} rounds, {args.reps} launches each")
    print("| heads a CTA | threads | loads in flight a thread | KB in flight a CTA | us | TB/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for heads, threads, unroll, name in variants:
        t = sorted(results[name])[len(results[name]) // 2]
        print(f"| {heads} | {threads} | {2 * unroll} | {threads * 2 * unroll * 16 // 1024} | {t:.1f} "
              f"| {nbytes / t / 1e6:.2f} |")
    for stages, rows, name in tma:
        t = sorted(results[name])[len(results[name]) // 2]
        kb = stages * panels * rows * 128 // 1024
        print(f"| 1, tensor-map boxes of {rows} keys | 1 | {stages} boxes | {kb} | {t:.1f} | {nbytes / t / 1e6:.2f} |")
    for stages, chunk, name in bulk:
        t = sorted(results[name])[len(results[name]) // 2]
        print(f"| whole rows, bulk copies | 1 | {stages} x {chunk // 1024} KB | {stages * chunk // 1024} | "
              f"{t:.1f} | {nbytes / t / 1e6:.2f} |")


if __name__ == "__main__":
    main()
