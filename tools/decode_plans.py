#!/usr/bin/env python3
"""The KV-cache decode plans of bench/bench_decode.py's rows, from the planner alone, with
the device stubbed (its SM count, shared memory and bandwidth): each row's kernel, split
count, CTAs and waves of the kernel's slots. Run it in two trees and diff: a change to a
route or split rule that moves no row of the grid needs no A/B for those rows, and the rows
it moves are the ones to time. No GPU needed.

    python3 tools/decode_plans.py [--device h200|h100] [--shapes 1x131072,64x4096]
        [--head-dims 64,128] [--extra-shapes 14x16384]

The stub: 132 SMs, 228 KB of shared memory an SM, and the card's peak bandwidth (H200
4.8 TB/s: one decode CTA an SM does not keep up; H100 3.35 TB/s: it does); the TMA decode
kernel is left out (it needs the card); fp16 q, contiguous caches and pages of 16 and 256,
16-bit and e4m3.
"""
import argparse
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

DEVICES = {"h200": 4.8e12, "h100": 2 * 2619e6 * 5120 / 8}
SIZES = {"float16": 2, "float8_e4m3fn": 1, "int32": 4}


def _shapes(text):
    return [tuple(int(x) for x in item.split("x")) for item in text.split(",") if item]


def stub_device(peak_bytes_per_s):
    """The planner's view of a 132-SM Hopper card; launches recorded, not run."""
    from cufa import _compile, _decode_plan, _heuristics, _runtime
    _compile.function_pointer = lambda kernel, device: kernel.key
    _runtime.sm_count = lambda device: 132
    _runtime.smem_per_sm = lambda device: _compile.SM90_SMEM_PER_SM
    _runtime.compute_capability = lambda device: "90"
    _runtime.peak_bytes_per_s = lambda device: peak_bytes_per_s
    _heuristics.tma_device = lambda device, forced=None: False
    _heuristics._keeps_up.clear()
    planned = []
    _decode_plan._run = lambda plan, *args: planned.append(plan) or plan
    return planned


def _array(shape, dtype="float16", ptr=0x7f0000000000):
    from cufa._interop import DeviceArray
    strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    return DeviceArray(None, "torch", ptr, tuple(shape), strides, dtype, 0, SIZES[dtype])


def plan_row(planned, batch, keys, heads, seqlen_q, d, cache_dtype, page):
    """(kernel key, splits, CTAs) of one row's decode launch."""
    import cufa
    from cufa import _params, _runtime
    _runtime.plans.clear()
    hq, hk = heads
    q = _array((batch, seqlen_q, hq, d))
    seqlens = _array((batch,), "int32", ptr=0x7d0000000000)
    kw = dict(cache_seqlens=seqlens)
    if page:
        shape = (batch * keys // page, page, hk, d)
        kw["block_table"] = _array((batch, keys // page), "int32", ptr=0x7e0000000000)
    else:
        shape = (batch, keys, hk, d)
    cufa.flash_attn_with_kvcache(q, _array(shape, cache_dtype),
                                 _array(shape, cache_dtype, ptr=0x7f8000000000), **kw)
    plan = planned[-1]
    record = np.frombuffer(plan.params, dtype=_params.DECODE.dtype)[0]
    decode = next(e for e in plan.launches if e[0] == "decode")
    grid = decode[2] if isinstance(decode[2], tuple) else (decode[2], 1, 1)
    return decode[1], int(record["num_splits"]), int(np.prod(grid))


def main(argv=None):
    import bench_decode
    from cufa import _compile
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=sorted(DEVICES), default="h200")
    p.add_argument("--shapes", type=_shapes, default=list(bench_decode.SHAPES))
    p.add_argument("--extra-shapes", type=_shapes, default=[],
                   help="more batch x keys shapes, after the grid's")
    p.add_argument("--head-dims", default="64,128")
    args = p.parse_args(argv)
    planned = stub_device(DEVICES[args.device])
    kernels = {v.key: v for v in _compile.all_variants()}
    print("batch x keys | heads | q tokens | d | cache | pages | kernel | splits | CTAs | waves")
    for batch, keys in args.shapes + args.extra_shapes:
        for heads in bench_decode.HEADS:
            for seqlen_q in bench_decode.SEQLENS_Q:
                for d in (int(x) for x in args.head_dims.split(",")):
                    for cache in ("float16", "float8_e4m3fn"):
                        for page in (0,) + bench_decode.PAGE_SIZES:
                            key, splits, ctas = plan_row(planned, batch, keys, heads, seqlen_q,
                                                         d, cache, page)
                            slots = 132 * kernels[key].ctas_per_sm_on(_compile.SM90_SMEM_PER_SM)
                            print(f"{batch}x{keys} | {heads[0]}/{heads[1]} | {seqlen_q} | {d} | "
                                  f"{'e4m3' if cache != 'float16' else 'fp16'} | "
                                  f"{page or '-'} | {key} | {splits} | {ctas} | "
                                  f"{ctas / slots:.2f}")


if __name__ == "__main__":
    main()
