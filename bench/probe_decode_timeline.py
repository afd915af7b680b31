#!/usr/bin/env python3
"""Probe: where a split decode launch's time goes, CTA by CTA. The decode kernel's source is
instrumented here, not in the library: thread 0 of each CTA records %globaltimer (ns,
device-wide) at entry, once Q has landed (the first memory latency), after its key loop,
after the warps' states are staged, after writing its partials, and at exit, and its SM id;
a CTA that merges its unit's splits in the launch also once it knows it is the last. Calls are queued back to back
(caches rotating past L2); the last call's records are read.

    python3 bench/probe_decode_timeline.py [--shapes 1x32768:8:64,1x131072:8:64] [--calls 50]
        [--kernel w4s8 | --tma]

--tma instruments and forces the TMA decode kernel (decode_sm90.cu, d = 64, one unit a
CTA) instead: Q landed is when its consumer warps pass their barrier for Q.

Printed a shape: the spread of CTA starts, Q's latency, each CTA's loop time (min /
median / max), the epilogue, the launch's span from first start to last exit, the CTAs
that finish last, and how many SMs held more than one CTA.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import cufa  # noqa: E402
from cufa import _compile, api  # noqa: E402

MAX_CTAS = 8192
SLOTS = 16  # marks 0-5 and 8, the SM id in the last
MARK = ("if (threadIdx.x == 0) {{ unsigned long long t_; asm volatile(\"mov.u64 %0, %%globaltimer;\""
        " : \"=l\"(t_)); cufa_timeline[((blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x)"
        " % {max}][{i}] = t_; }}\n")  # noqa: E501
# (text in the assembled source, mark index, before or after it); the SM id goes after
# the entry text
ANCHORS = {
    "decode.cu": ([
        ("  if (!s_last) return;\n", 5, "after"),
        ("  write_decode_output<kDtype, kHeadDim, Shape>(p, s, m_block, h_k, split, s_out, s_warp_max,\n", 8, "before"),
        ("  const int m_block = blockIdx.x % p.num_m_blocks, split = blockIdx.x / p.num_m_blocks;\n  const int h_k = blockIdx.y;\n  const int b = p.decode_order", 0, "before"),
        ("  cp_async_wait<Shape::kTilesBeforeQ>();  // Q (the oldest group) has landed\n  __syncthreads();\n", 1, "after"),
        ("  cp_async_wait<0>();  // (the outputs are staged over the cache stages)\n", 2, "after"),
        ("  if (p.num_splits > 1 && p.split_counters)\n    merge_if_last<kDtype, Shape::kThreads>(p, s, m_block, h_k, rows, s_out);\n", 3, "before"),
        ("  if (p.num_splits > 1 && p.split_counters)\n    merge_if_last<kDtype, Shape::kThreads>(p, s, m_block, h_k, rows, s_out);\n", 4, "after"),
    ], "    decode_kernel(const DecodeParams p) {\n"),
    "decode_sm90.cu": ([  # (its source includes decode.cu's merge)
        ("  if (!s_last) return;\n", 5, "after"),
        ("  const u32 full = smem_u32(bars), empty = full + 8 * kStages;\n", 0, "after"),
        ('      asm volatile("bar.sync 2, %0;\\n" ::"n"(32 * kWarps) : "memory");  // Q landed\n', 1, "after"),
        ("    box_count += ring_boxes;\n", 2, "after"),
        ("    write_decode_output<kDtype, kHeadDim, Shape>(p, s, m_block, h_k, split, s_out, s_warp_max,\n", 8, "before"),
        ("    // (one unit a CTA: the split counters are indexed by the grid, as decode_kernel's)\n", 3, "before"),
        ("    __syncthreads();  // the staging read before the next unit's copies overwrite the ring\n", 4, "before"),
    ], "  const u32 full = smem_u32(bars), empty = full + 8 * kStages;\n"),
}


def instrument(filename="decode.cu"):
    """Marks in the decode kernel of `filename` (decode.cu, or decode_sm90.cu: the TMA
    one); -> the list its compiled modules are appended to."""
    anchors, entry = ANCHORS[filename]
    src = _compile.assembled_source(filename)
    head, body = src.split("\n", 1)
    for text, i, where in anchors:
        assert body.count(text) == 1, text
        mark = MARK.format(max=MAX_CTAS, i=i)
        body = body.replace(text, mark + text if where == "before" else text + mark)
    smid = ("if (threadIdx.x == 0) { unsigned s_; asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(s_)); "
            f"cufa_timeline[((blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) % {MAX_CTAS}][{SLOTS - 1}] = s_; }}\n")
    assert body.count(entry) == 1, entry
    body = body.replace(entry, entry + smid)
    first_ns = body.index("namespace cufa {")
    body = body[:first_ns] + f"__device__ unsigned long long cufa_timeline[{MAX_CTAS}][{SLOTS}];\n" + body[first_ns:]
    _compile._source_cache[filename] = head + " timeline\n" + body
    modules = []
    original = _compile.raw_module

    def keep(variant):
        mod = original(variant)
        if variant.source == filename:
            modules.append(mod)
        return mod
    _compile.raw_module = keep
    return modules


def read_timeline(modules, ctas):
    import cupy
    out = []
    for mod in modules:
        ptr = mod.get_global("cufa_timeline")
        arr = cupy.ndarray((MAX_CTAS, SLOTS), dtype=cupy.uint64, memptr=ptr)
        out.append(cupy.asnumpy(arr[:ctas]))
        arr.fill(0)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="1x32768:8:64,1x131072:8:64")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--kernel", help="wWsS: the decode kernel of W warps of S stages, the planner's splits")
    p.add_argument("--tma", action="store_true", help="the TMA decode kernel (forced), d = 64")
    p.add_argument("--before-q", type=int,
                   help="ring tiles a warp issues before Q lands (DecodeShape::kTilesBeforeQ's cap)")
    args = p.parse_args()
    modules = instrument("decode_sm90.cu" if args.tma else "decode.cu")
    if args.before_q is not None:
        cap = "kStages - kStepTiles < 2 ? kStages - kStepTiles : 2;"
        src = _compile._source_cache["decode.cu"]
        assert src.count(cap) == 1, cap
        _compile._source_cache["decode.cu"] = src.replace(cap, cap.replace("2", str(args.before_q)))
    if args.kernel:
        from cufa import kvcache
        warps, stages = (int(x) for x in args.kernel[1:].split("s"))

        def forced(dtype, d, num_splits, units, capacity, device, paged=False):
            kernel = _compile.DecodeKernel("decode", dtype, _compile.padded_head_dim(d),
                                           stages=stages, warps=warps)
            return kernel, kvcache._split_count(num_splits, units, capacity, kernel, device, paged)
        kvcache._kernel_and_splits = forced
    print(f"{torch.cuda.get_device_name()}, fp16, 32 query heads, one token; us from the "
          "launch's first CTA start")
    for shape in args.shapes.split(","):
        bn, hk, d = shape.split(":")
        b, n = (int(x) for x in bn.split("x"))
        hk, d = int(hk), int(d)
        sets = []
        for _ in range(2):
            k, v = (torch.randn(b, n, hk, d, device="cuda", dtype=torch.float16) for _ in range(2))
            q = torch.randn(b, 1, 32, d, device="cuda", dtype=torch.float16)
            lens = torch.full((b,), n, device="cuda", dtype=torch.int32)
            sets.append((q, k, v, lens))
        for merge in (True, False):
            api.clear_plans()
            if args.tma:  # (after clear_plans, which reads the environment's overrides again)
                _compile._overrides[_compile.DECODE_TMA_ENV] = "1"

            def call(q, k, v, lens):
                return cufa.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)
            call(*sets[0])
            plans = [pl for key, pl in api._plans.items() if key[0] == "kvcache"]
            for pl in plans:
                pl.merge_in_launch = pl.merge_in_launch and merge
            for i in range(args.calls):
                call(*sets[i % 2])
            torch.cuda.synchronize()
            read_timeline(modules, MAX_CTAS)  # clear
            call(*sets[0])
            torch.cuda.synchronize()
            # the grid of the last launch: the CTAs that wrote a start
            for t in read_timeline(modules, MAX_CTAS):
                rows = t[t[:, 0] > 0]
                if len(rows):
                    report(shape, merge and any(pl.merge_in_launch for pl in plans), rows)


def report(shape, merged, t):
    t0 = t[:, 0].min()
    rel = (t[:, :9].astype(np.int64) - int(t0)) / 1e3
    start, q, loop_end, written, end, last, _, _, staged = (rel[:, i] for i in range(9))
    loop = loop_end - q
    sms = t[:, SLOTS - 1]
    counts = np.bincount(sms.astype(np.int64))
    span = end.max()
    pct = lambda x: f"{np.min(x):.1f} / {np.median(x):.1f} / {np.max(x):.1f}"  # noqa: E731
    print(f"\n{shape} ({'merge in launch' if merged else 'combine kernel after'}): {len(t)} CTAs on "
          f"{(counts > 0).sum()} SMs ({(counts > 1).sum()} with two or more); span {span:.1f} us")
    print(f"  start {pct(start)} | Q landed after {pct(q - start)} | loop {pct(loop)} | "
          f"states staged after {pct(staged - loop_end)} | partials written after "
          f"{pct(written - staged)} | exit {pct(end)}")
    late = np.argsort(end)[-6:][::-1]
    print("  last to exit (sm: start, loop, exit): " + "; ".join(
        f"{int(sms[i])}: {start[i]:.1f}, {loop[i]:.1f}, {end[i]:.1f}" for i in late))
    print(f"  exit after partials written: {pct(end - written)}")
    merging = t[:, 5] > 0
    if merging.any():
        m = merging
        print(f"  the {m.sum()} merging CTAs, after the partials: knows it is last "
              f"{pct(last[m] - written[m])} | merged {pct(end[m] - last[m])}; their exits "
              f"{pct(end[m])}")
    shared = [i for i in range(len(t)) if counts[int(sms[i])] > 1]
    if shared:
        print(f"  loop on shared SMs {pct(loop[shared])}, alone "
              f"{pct(np.delete(loop, shared))}")


if __name__ == "__main__":
    main()
