#!/usr/bin/env python3
"""The launch path's Python cost on a machine without a GPU: the device layer replaced by
stand-ins (a launch records nothing, an allocation returns a fake address, the driver's
TMA encode writes a map where docs/decisions.md's layout model says the H100's driver keeps
dims, strides and the address), arrays by DeviceArray views. It times what
bench/host_overhead.py times on the device (repeated call, new sizes of a known layout,
a new layout, packed), minus what the frameworks and the driver cost there. The lent
hosts run this Python 2.5-3x slower than a fast dev CPU.

    python3 bench/host_cpu.py [--calls 20000] [--rounds 5] [--profile CASE]
"""
import argparse
import ctypes
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cufa  # noqa: E402
from cufa import _compile, _decode_plan, _fwd_plan, _interop, _runtime, _tma  # noqa: E402

_LAUNCHERS = (_runtime, _fwd_plan, _decode_plan)

_KIND_BYTES = bytes(range(128))


def _encode(map_address, data_type, rank, ptr, dims, byte_strides, box, *rest):
    """A map as the H100's driver (580) lays it out, per _tma's model, address at byte 0."""
    kind = bytearray(_KIND_BYTES)
    kind[0] = data_type
    kind[40] = box[1] & 0xFF  # anything per kind outside the dims/strides fields
    made = _tma._with_layout(bytes(kind), tuple(dims), tuple(byte_strides))
    ctypes.memmove(map_address, made, 128)
    return _replace(map_address, ptr)


def _replace(map_address, ptr):
    ctypes.memmove(map_address, ptr.to_bytes(8, "little"), 8)
    return 0


class _Stream:
    def __init__(self, framework, device, stream=None):
        self.stream = stream

    def __enter__(self):
        return 7 if self.stream is None else self.stream

    def __exit__(self, *exc):
        pass


_next = [1 << 32]


def _allocate(framework, shape, dtype, device, stream, like=None):
    _next[0] += 1 << 20
    return None, _next[0]


def mock_device():
    for name, stand_in in (
            ("caller_stream", _Stream), ("driver_launch", lambda *args: None),
            ("stream_tile_counter", lambda framework, device, stream: (None, 0xC0)),
            ("stream_workspace",
             lambda framework, device, stream, nbytes, capturing=None: (None, 0xD000_0000)),
            ("stream_split_counters", lambda framework, device, stream, nbytes: (None, 0xE0)),
            ("stream_capturing", lambda stream: False)):
        for module in _LAUNCHERS:  # (the launch path binds _runtime's functions)
            if hasattr(module, name):
                setattr(module, name, stand_in)
    _interop.allocate = _allocate
    _compile.function_pointer = lambda variant, device: 0xF00
    _runtime.compute_capability = lambda device: "90"
    _runtime.sm_count = lambda device: 132
    _runtime.smem_per_sm = lambda device: 228 * 1024
    _tma._encode_fn = lambda: _encode
    _tma._replace_fn = lambda: _replace


def view(shape, dtype="float16", address=1 << 33):
    itemsize = 4 if dtype in ("float32", "int32") else 2
    return _interop.DeviceArray(None, "cupy", address, tuple(shape),
                                _interop.contiguous_strides(shape), dtype, 0, itemsize)


def cases():
    q, k, v = (view((1, 128, 2, 64), address=(1 << 33) + i * 4096) for i in range(3))
    packed = [view((256, 2, 64), address=(1 << 34) + i * 65536) for i in range(3)]
    cu = view((3,), "int32", 1 << 35)
    cache = view((8, 1024, 2, 64), address=1 << 36)
    q1 = view((8, 1, 8, 64), address=1 << 37)
    lens = view((8,), "int32", 1 << 38)

    def dense():
        return cufa.flash_attn_func(q, k, v, causal=True)

    def varlen():
        return cufa.flash_attn_varlen_func(*packed, cu, cu, 128, 128, causal=True)

    def unplanned(fn):
        _runtime.plans.clear()
        _tma.template.cache_clear()
        return fn()

    def unlaid(fn):
        _fwd_plan.layouts.clear()
        return unplanned(fn)

    return {
        "flash_attn_func": dense,
        "flash_attn_func, new signature": lambda: unplanned(dense),
        "flash_attn_func, new layout": lambda: unlaid(dense),
        "flash_attn_varlen_func": varlen,
        "flash_attn_varlen_func, new signature": lambda: unplanned(varlen),
        "flash_attn_varlen_func, new layout": lambda: unlaid(varlen),
        "flash_attn_with_kvcache (decode)": lambda: cufa.flash_attn_with_kvcache(
            q1, cache, cache, cache_seqlens=lens),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--profile", help="a case's name: cProfile of its calls instead")
    args = p.parse_args()
    mock_device()
    table = cases()
    for fn in table.values():
        fn()
    if args.profile:
        import cProfile
        import pstats
        fn = table[args.profile]
        cProfile.runctx("for _ in range(n): fn()", {}, dict(fn=fn, n=args.calls))
        return
    best = {name: float("inf") for name in table}
    for _ in range(args.rounds):
        for name, fn in table.items():
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / args.calls * 1e6)
    print("| call (device layer mocked, this CPU) | us/call, best |")
    print("| --- | --- |")
    for name, us in best.items():
        print(f"| {name} | {us:.2f} |")


if __name__ == "__main__":
    main()
