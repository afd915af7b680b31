#!/usr/bin/env python3
"""Where a repeated flash_attn_func call's host time goes: each step of the launch path
timed alone, on the inputs of bench/host_overhead.py's first row, beside the whole call,
SDPA flash and the framework primitives any launch needs (torch.empty, one launch).

    python3 bench/host_breakdown.py [--calls 5000] [--new-signature | --decode]

--new-signature: instead, the parts of a call whose signature has no plan yet (a new
shape): planning with and without the TMA descriptors, their encoding and their check,
and cProfile's view of such calls. --decode: the same for a split-KV decode call (batch 1,
32 query heads over 8 KV heads, 4k keys: small enough that the host, not the GPU, sets the
pace), beside SDPA's calls on the same cache.

The steps overlap a little (each is timed with its own call overhead), so their sum reads
a few us over the whole call.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import cufa  # noqa: E402
from cufa import _interop, _params, _tma, api  # noqa: E402


def us_per_call(fn, calls):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):  # best of three: the lent machines' host CPUs are noisy
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - t0)
        torch.cuda.synchronize()
    return best / calls * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=5000)
    p.add_argument("--new-signature", action="store_true")
    p.add_argument("--decode", action="store_true")
    p.add_argument("--decode-keys", type=int, default=4096, help="the decode cache's length")
    args = p.parse_args()
    if args.decode:
        return decode_breakdown(args.calls, args.decode_keys)
    q, k, v = (torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    call = lambda: cufa.flash_attn_func(q, k, v, causal=True)  # noqa: E731
    call()
    if args.new_signature:
        return new_signature(call, q, k, v, args.calls // 5)
    (plan,) = api._plans.values()
    arrays, names = (q, k, v, None, None), api._DENSE_ARRAYS
    _, (qp, kp, vp, _, _) = _interop.signature(arrays, names)
    stream = torch.cuda.current_stream().cuda_stream
    o_ptr = torch.empty_like(q).data_ptr()

    def launch_only():  # what _launch does for this plan, less the tile counter lookup
        params = _params.FWD.with_pointer_values(plan.params, (
            qp, kp, vp, o_ptr, 0, 0, 0, 0, 0, 0, 0, 0, counter, 0))
        args = (params,)
        if plan.tma_template is not None:
            args = (params, _tma.with_addresses(plan.tma_template, qp, kp, vp))
        api.driver_launch(plan.function, plan.num_blocks, plan.variant.threads,
                          plan.variant.smem_bytes, stream, args)

    def stream_only():
        with api.caller_stream("torch", 0) as s:
            return s

    _, counter = api.stream_tile_counter("torch", 0, stream)
    steps = {
        "whole call: cufa.flash_attn_func": call,
        "torch SDPA flash (same inputs)": lambda: torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True),
        "output: _interop.allocate": lambda: _interop.allocate("torch", plan.out_shape,
                                                              plan.dtype, 0, stream),
        "tile counter (per stream)": lambda: api.stream_tile_counter("torch", 0, stream),
        "signature of (q, k, v, None, None)": lambda: _interop.signature(arrays, names),
        "options + key + plan lookup": lambda: api._plans.get(("dense", (
            api._window((-1, -1), True), api._check_scale(None, "s"), api._softcap(0.0)))
            + _interop.signature(arrays, names)[0]),
        "checks (_reject_unsupported, compiling, tracing)": lambda: (
            api._reject_unsupported(0.0, False, "x"), api._torch_ops.compiling(q),
            api._jax.tracing(q, k, v, None)),
        "params record with pointers": lambda: _params.FWD.with_pointer_values(
            plan.params, (1,) * 14),
        "TMA maps (cached address)": lambda: plan.tma_template is not None and (
            _tma.with_addresses(plan.tma_template, qp, kp, vp)),
        "TMA maps (new addresses: copy, 3 address replacements)": lambda: (
            plan.tma_template is not None and _tma.with_addresses.__wrapped__(
                plan.tma_template, qp, kp, vp)),
        "caller_stream": stream_only,
        "record + maps + driver launch": launch_only,
    }
    device = torch.cuda.get_device_name()
    print(f"| step ({device}) | host us/call |")
    print("| --- | --- |")
    for name, fn in steps.items():
        print(f"| {name} | {us_per_call(fn, args.calls):.2f} |")
    jax_breakdown(2000)


def new_signature(call, q, k, v, calls):
    """A new signature's host time, part by part (bench/host_overhead.py's row clears the
    plans and the descriptor templates before each call, as a new shape would need)."""
    import cProfile
    import pstats
    (plan,) = api._plans.values()
    views = (((1, 128, 2, 64), (16384, 128, 64), plan.variant.block_m),
             ((1, 128, 2, 64), (16384, 128, 64), plan.variant.block_n),
             ((1, 128, 2, 64), (16384, 128, 64), plan.variant.block_n))

    def unplanned():
        api._plans.clear()
        _tma.template.cache_clear()
        return call()

    def planned_maps():  # the plan again, the layout's descriptors cached
        api._plans.clear()
        return call()

    def encode3():
        holder, base = _tma._aligned_record()
        for i, layout in enumerate(views):
            _tma._encode_at(base + 128 * i, "float16", _tma._PLACEHOLDER_ADDRESS, *layout)

    record = _tma.template.__wrapped__("float16", views).record
    cu = torch.tensor([0, 60, 128], device="cuda", dtype=torch.int32)
    qp = q[0]

    def varlen_unplanned():
        api._plans.clear()
        _tma.template.cache_clear()
        return cufa.flash_attn_varlen_func(qp, qp, qp, cu, cu, 68, 68, causal=True)

    steps = {
        "repeated call": call,
        "new signature (plans and templates cleared)": unplanned,
        "new signature, templates kept (planning alone)": planned_maps,
        "template(): 3 maps encoded + checked": lambda: _tma.template.__wrapped__(
            "float16", views),
        "3 maps encoded (cuTensorMapEncodeTiled)": encode3,
        "_address_words: the check (3 driver moves, a new kind)": lambda: _tma._address_words(
            record, 3, object()),
        "packed new signature (plans and templates cleared)": varlen_unplanned,
    }
    print(f"| new-signature step ({torch.cuda.get_device_name()}) | host us/call |")
    print("| --- | --- |")
    for name, fn in steps.items():
        print(f"| {name} | {us_per_call(fn, calls):.2f} |")
    for name, fn in (("dense", unplanned), ("packed", varlen_unplanned)):
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            fn()
        profiler.disable()
        torch.cuda.synchronize()
        print(f"\ncProfile, {calls} {name} new-signature calls")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(22)


def decode_breakdown(calls, keys):
    """A repeated split-KV decode call, step by step (kvcache._run's path); then one call
    and a sync, against SDPA's, and what the GPU takes for each (CUDA events)."""
    from cufa import kvcache
    from torch.nn.attention import SDPBackend, sdpa_kernel
    cache = [torch.randn(1, keys, 8, 64, device="cuda", dtype=torch.float16) for _ in range(2)]
    q = torch.randn(1, 1, 32, 64, device="cuda", dtype=torch.float16)
    lens = torch.full((1,), keys, device="cuda", dtype=torch.int32)
    call = lambda: cufa.flash_attn_with_kvcache(q, *cache, cache_seqlens=lens)  # noqa: E731
    call()
    (plan,) = [pl for key, pl in api._plans.items() if key[0] == "kvcache"]
    arrays = (q, *cache, None, None, None, None, lens, None, None, None, None, None)
    stream = torch.cuda.current_stream().cuda_stream
    _, ptrs = _interop.signature(arrays, kvcache._ARRAYS)
    decode = next(entry for entry in plan.launches if entry[0] == "decode")
    x, y, z = decode[2]
    qt, kt, vt = q.transpose(1, 2), cache[0].transpose(1, 2), cache[1].transpose(1, 2)

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt,
                                                                        enable_gqa=True)
        return run

    def context_only():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            pass

    def stream_only():
        with api.caller_stream("torch", 0) as s:
            return s

    recorded, real_launch = [], api.driver_launch
    api.driver_launch = lambda *launch: (recorded.append(launch), real_launch(*launch))
    kept = call()  # (its output stays alive: the recorded launch writes it)
    api.driver_launch = real_launch

    def launch_only():  # the call's decode launch again, as recorded
        real_launch(*recorded[-1])

    steps = {
        f"whole call: flash_attn_with_kvcache ({len(plan.launches)} launches planned, "
        "the combine's dropped eagerly)": call,
        "torch SDPA flash, same decode (sdpa_kernel entered each call)": sdpa(
            SDPBackend.FLASH_ATTENTION),
        "torch SDPA cuDNN, same decode (sdpa_kernel entered each call)": sdpa(
            SDPBackend.CUDNN_ATTENTION),
        "sdpa_kernel context alone": context_only,
        "signature of the 13 arrays": lambda: _interop.signature(arrays, kvcache._ARRAYS),
        "output: _interop.allocate": lambda: _interop.allocate("torch", q.shape, "float16", 0,
                                                              stream),
        "caller_stream": stream_only,
        "stream_capturing": lambda: api.stream_capturing(stream),
        "stream_workspace": lambda: api.stream_workspace("torch", 0, stream, 4096),
        "stream_split_counters": lambda: api.stream_split_counters("torch", 0, stream,
                                                                   4 * x * y * z),
        "params record with pointers": lambda: _params.DECODE.with_pointer_values(
            plan.params, (1,) * 21),
        "one driver launch (decode kernel)": launch_only,
    }
    print(f"| decode step, 1 x {keys} keys ({torch.cuda.get_device_name()}) | host us/call |")
    print("| --- | --- |")
    for name, fn in steps.items():
        print(f"| {name} | {us_per_call(fn, calls):.2f} |")
    print("\n| one call and a sync | us (median) | GPU us (events, median) |\n| --- | --- | --- |")
    for name, fn in (("cufa", call), ("SDPA flash", sdpa(SDPBackend.FLASH_ATTENTION)),
                     ("SDPA cuDNN", sdpa(SDPBackend.CUDNN_ATTENTION))):
        walls, gpus = [], []
        for _ in range(200):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) * 1e6)
            gpus.append(start.elapsed_time(stop) * 1e3)
        print(f"| {name} | {np.median(walls):.1f} | {np.median(gpus):.1f} |")


def jax_breakdown(calls):
    """Under jax.jit: the per-call time, the time spent inside cufa's callback (the rest
    is XLA's callback mechanism), and cProfile's view of the callback (run on XLA's
    thread, so profiled from inside it)."""
    try:
        import jax
        import jax.numpy as jnp
        from cufa import _jax
    except ImportError as e:
        print(f"(JAX not timed: {e})")
        return
    import cProfile
    import pstats
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 128, 2, 64)), jnp.float16)
    fn = jax.jit(lambda q: cufa.flash_attn_func(q, q, q, causal=True))
    inner, spent = _jax.on_device, [0.0]
    profiler = cProfile.Profile()

    def timed(*args):
        t0 = time.perf_counter()
        inner(*args)
        spent[0] += time.perf_counter() - t0

    def profiled(*args):
        profiler.enable()
        inner(*args)
        profiler.disable()

    for wrapper in (timed, profiled):
        _jax.on_device = wrapper
        fn(q).block_until_ready()
        spent[0] = 0.0
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn(q)
        out.block_until_ready()
        total = (time.perf_counter() - t0) / calls * 1e6
        if wrapper is timed:
            print(f"\njax.jit: {total:.1f} us a call, {spent[0] / calls * 1e6:.1f} us of it "
                  "inside cufa's callback")
    _jax.on_device = inner
    pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
    # A block of several ops, as in a model: there XLA may record the launches into a
    # command buffer (CUDA graph) and replay them without calling back into Python.
    w = jnp.asarray(np.random.default_rng(1).standard_normal((128, 128)) / 11, jnp.float16)

    def block(attention):
        def f(x):
            q = (x @ w).reshape(1, 128, 2, 64)
            a = attention(q).reshape(128, 128)
            return jax.nn.gelu(a @ w) + x * 0.5
        return jax.jit(f)

    x = jnp.asarray(np.random.default_rng(2).standard_normal((128, 128)), jnp.float16)
    calls = [0]

    def counted(*args):
        calls[0] += 1
        inner(*args)

    for name, attention in (
            ("cufa", lambda q: cufa.flash_attn_func(q, q, q, causal=True)),
            ("jax.nn.dot_product_attention",
             lambda q: jax.nn.dot_product_attention(q, q, q, is_causal=True))):
        fn = block(attention)
        _jax.on_device = counted
        fn(x).block_until_ready()
        calls[0] = 0
        t0 = time.perf_counter()
        for _ in range(2000):
            out = fn(x)
        out.block_until_ready()
        total = (time.perf_counter() - t0) / 2000 * 1e6
        print(f"jitted 5-op block with {name}: {total:.1f} us a call, "
              f"{calls[0] / 2000:.2f} callbacks into Python a call")
    _jax.on_device = inner


if __name__ == "__main__":
    main()
