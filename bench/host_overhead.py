#!/usr/bin/env python3
"""Host time per call on a problem too small to keep the GPU busy: what launching costs
from Python, cufa against PyTorch SDPA (flash). Queues N calls, then syncs once. "New
signature": every call has sizes no recent call had (a batch size out of a cycle of
CYCLE, more than cufa keeps plans for), as a server's next packed batch or a new sequence
length; "new layout": every call has a head count no recent call had, so nothing planned
before applies. Also a training step's calls (the forward recorded by autograd, forward
and backward, flash_attn_backward alone) against SDPA's, a decode call against SDPA's,
and, where JAX with buffer_callback is installed, a jitted cufa call against
jax.nn.dot_product_attention.

    python3 bench/host_overhead.py [--calls 1000] [--rounds 5] [--profile]

The lent machines' host CPUs are shared and drift by up to 2x within a minute, so every
case runs in each of --rounds rounds, the cases in a new random order each round, and
the table gives the best round (noise only adds time) and the median.

--profile adds cProfile's top functions (own time) for cufa.flash_attn_func, the decode
call and a training step's forward and backward (on one thread), and
torch.profiler's host events of a training step's forward and backward, cufa's
and SDPA's. The CuPy rows take the same memory as CuPy arrays (the caller's stream is then
CuPy's current stream).
"""
import argparse
import random
import time

import _timing  # noqa: F401  (this script's folder is on sys.path; it finds cufa)
import numpy as np
import torch

import cufa

CYCLE = 5000  # distinct sizes (or head counts) cycled: more than cufa's 4096 plans


def per_call_us(fn, calls):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host / calls * 1e6, (time.perf_counter() - t0) / calls * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    q, k, v = (torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    packed = tuple(x.reshape(256, 2, 64) for x in (torch.cat([q, q]), torch.cat([k, k]),
                                                   torch.cat([v, v])))
    cu = torch.tensor([0, 128, 256], device="cuda", dtype=torch.int32)

    def varlen():
        return cufa.flash_attn_varlen_func(*packed, cu, cu, 128, 128, causal=True)

    # New sizes and new layouts as views of one buffer, so no allocation is timed: a
    # batch of 1..CYCLE sequences of 16 rows; 1..CYCLE heads of 16 rows; packed batches
    # of 2 sequences and 2..CYCLE + 1 tokens.
    turn = iter(range(1 << 62))
    by_batch = torch.randn(CYCLE, 16, 2, 64, device="cuda", dtype=torch.float16)
    by_heads = torch.randn(1, 16, CYCLE, 64, device="cuda", dtype=torch.float16)
    by_tokens = torch.randn(CYCLE + 1, 2, 64, device="cuda", dtype=torch.float16)
    packed_heads = torch.randn(32, CYCLE, 64, device="cuda", dtype=torch.float16)
    cu_tokens = torch.tensor([[0, n // 2, n] for n in range(2, CYCLE + 2)], device="cuda",
                             dtype=torch.int32)
    cu_16 = torch.tensor([0, 16, 32], device="cuda", dtype=torch.int32)

    def new_sizes():
        x = by_batch[:1 + next(turn) % CYCLE]
        return cufa.flash_attn_func(x, x, x, causal=True)

    def new_layout():
        x = by_heads[:, :, :1 + next(turn) % CYCLE]
        return cufa.flash_attn_func(x, x, x, causal=True)

    def varlen_new_sizes():
        i = next(turn) % CYCLE
        x = by_tokens[:i + 2]
        return cufa.flash_attn_varlen_func(x, x, x, cu_tokens[i], cu_tokens[i],
                                           (i + 3) // 2, (i + 3) // 2, causal=True)

    def varlen_new_layout():
        x = packed_heads[:, :1 + next(turn) % CYCLE]
        return cufa.flash_attn_varlen_func(x, x, x, cu_16, cu_16, 16, 16, causal=True)

    # Inputs at addresses the launch has not seen (more sets than its descriptor cache
    # holds), as a model's activations are: on Hopper each call then points a copy of
    # its layout's TMA descriptors at them.
    fresh = [tuple(torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.float16)
                   for _ in range(3)) for _ in range(2048)]

    def new_addresses():
        qn, kn, vn = fresh[next(turn) % len(fresh)]
        return cufa.flash_attn_func(qn, kn, vn, causal=True)

    cases = {
        "cufa.flash_attn_func": lambda: cufa.flash_attn_func(q, k, v, causal=True),
        "cufa.flash_attn_func, new input addresses": new_addresses,
        "cufa.flash_attn_func, new signature": new_sizes,
        "cufa.flash_attn_func, new layout": new_layout,
        "cufa.flash_attn_varlen_func (2 sequences)": varlen,
        "cufa.flash_attn_varlen_func, new signature": varlen_new_sizes,
        "cufa.flash_attn_varlen_func, new layout": varlen_new_layout,
        "cufa.scaled_dot_product_attention": lambda: cufa.scaled_dot_product_attention(qt, kt, vt, is_causal=True),
        "torch SDPA (flash)": lambda: sdpa(qt, kt, vt, is_causal=True),
    }
    # A training step's calls: the forward with autograd recording it, forward and
    # backward, and flash_attn_backward alone (its plan kept from the second call on);
    # autograd's own floor beside them
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    dout = torch.randn_like(q)
    out_lse = cufa.flash_attn_func(q, k, v, causal=True, return_lse=True)

    def cufa_fwd_bwd():
        cufa.flash_attn_func(qg, kg, vg, causal=True).backward(dout)

    def sdpa_fwd_bwd():
        sdpa(*(x.transpose(1, 2) for x in (qg, kg, vg)), is_causal=True).backward(
            dout.transpose(1, 2))
    cases.update({
        "cufa.flash_attn_func, q k v require grad": lambda: cufa.flash_attn_func(
            qg, kg, vg, causal=True),
        "cufa.flash_attn_func + .backward()": cufa_fwd_bwd,
        "cufa.flash_attn_backward": lambda: cufa.flash_attn_backward(dout, q, k, v, *out_lse,
                                                                     causal=True),
        "torch SDPA (flash), q k v require grad": lambda: sdpa(
            *(x.transpose(1, 2) for x in (qg, kg, vg)), is_causal=True),
        "torch SDPA (flash) + .backward()": sdpa_fwd_bwd,
        "(q * 1.0).backward(): autograd's floor": lambda: (qg * 1.0).backward(dout),
    })

    def on_calling_thread(step):  # (the backward on the caller's thread, not autograd's)
        def run():
            with torch.autograd.set_multithreading_enabled(False):
                step()
        return run
    cases["cufa.flash_attn_func + .backward(), one thread"] = on_calling_thread(cufa_fwd_bwd)
    cases["torch SDPA (flash) + .backward(), one thread"] = on_calling_thread(sdpa_fwd_bwd)
    cache = torch.randn(8, 1024, 2, 64, device="cuda", dtype=torch.float16)
    q1 = torch.randn(8, 1, 8, 64, device="cuda", dtype=torch.float16)
    lens = torch.full((8,), 1000, device="cuda", dtype=torch.int32)
    cases["cufa.flash_attn_with_kvcache (8 x 1k, decode)"] = (
        lambda: cufa.flash_attn_with_kvcache(q1, cache, cache, cache_seqlens=lens))
    cases["torch SDPA (flash), same decode"] = (
        lambda: sdpa(q1.transpose(1, 2), cache.transpose(1, 2), cache.transpose(1, 2),
                     enable_gqa=True))
    try:  # the same calls on CuPy arrays (views of the same memory)
        import cupy
        qc, cachec, q1c, lensc = (cupy.from_dlpack(x) for x in (q, cache, q1, lens))
        cases["cufa.flash_attn_func, CuPy arrays"] = (
            lambda: cufa.flash_attn_func(qc, qc, qc, causal=True))
        cases["cufa.flash_attn_with_kvcache, CuPy arrays"] = (
            lambda: cufa.flash_attn_with_kvcache(q1c, cachec, cachec, cache_seqlens=lensc))
    except ImportError:
        pass
    rounds = {name: [] for name in cases}
    order = list(cases)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        for _ in range(args.rounds):
            random.shuffle(order)
            for name in order:
                rounds[name].append(per_call_us(cases[name], args.calls))
    print(f"| call ({torch.cuda.get_device_name()}) | host us/call, best | median | "
          "wall us/call, best |")
    print("| --- | --- | --- | --- |")
    for name, times in rounds.items():
        host = sorted(h for h, _ in times)
        print(f"| {name} | {host[0]:.1f} | {host[len(host) // 2]:.1f} | "
              f"{min(w for _, w in times):.1f} |")
    jax_table(args.calls, args.rounds)
    if args.profile:
        import cProfile
        import pstats
        for name in ("cufa.flash_attn_func", "cufa.flash_attn_with_kvcache (8 x 1k, decode)"):
            print(f"\ncProfile, {name}:")
            profiler = cProfile.Profile()
            profiler.runcall(per_call_us, cases[name], args.calls)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        # (autograd runs a CUDA backward on its own thread, which cProfile does not see,
        # unless the step runs on one thread: then cufa's backward's Python too)
        name = "cufa.flash_attn_func + .backward(), one thread"
        print(f"\ncProfile, {name}:")
        profiler = cProfile.Profile()
        profiler.runcall(per_call_us, cases[name], args.calls)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
        # (torch.profiler's host-side events cover both threads)
        from torch.profiler import ProfilerActivity, profile
        for name in ("cufa.flash_attn_func + .backward()", "torch SDPA (flash) + .backward()"):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                per_call_us(cases[name], args.calls // 10)
            print(f"\ntorch.profiler, host events, {name} ({args.calls // 10} calls):")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20,
                                            max_name_column_width=70))


def jax_table(calls, rounds):
    """Per-call time of a jitted function holding one attention call: cufa (a
    buffer_callback into Python) against jax.nn.dot_product_attention, rounds interleaved
    as above."""
    try:
        import jax
        import jax.numpy as jnp
    except ImportError as e:
        print(f"\n(JAX not timed: {e})")
        return
    try:
        from jax.experimental.buffer_callback import buffer_callback
    except ImportError:
        print(f"\n(JAX {jax.__version__} has no buffer_callback: cufa cannot run under jit)")
        return
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 128, 2, 64)), jnp.float16)
    fns = {"cufa.flash_attn_func under jax.jit": jax.jit(
               lambda q: cufa.flash_attn_func(q, q, q, causal=True)),
           "jax.nn.dot_product_attention under jax.jit": jax.jit(
               lambda q: jax.nn.dot_product_attention(q, q, q, is_causal=True)),
           # the mechanism alone: a callback that returns at once (its output unwritten)
           "a no-op buffer_callback under jax.jit (the floor)": jax.jit(
               lambda q: buffer_callback(lambda ctx, out, x: None,
                                         jax.ShapeDtypeStruct(q.shape, q.dtype))(q))}
    times = {name: ([], []) for name in fns}
    order = list(fns)
    for fn in fns.values():
        for _ in range(20):
            fn(q).block_until_ready()
    for _ in range(rounds):
        random.shuffle(order)
        for name in order:
            fn = fns[name]
            t0 = time.perf_counter()
            for _ in range(calls):
                out = fn(q)
            out.block_until_ready()
            times[name][0].append((time.perf_counter() - t0) / calls * 1e6)
            t0 = time.perf_counter()
            for _ in range(calls // 4):
                fn(q).block_until_ready()
            times[name][1].append((time.perf_counter() - t0) / (calls // 4) * 1e6)
    print(f"\n| jitted call ({jax.devices()[0].device_kind}) | us/call queued, best | median "
          "| one at a time, best | median |")
    print("| --- | --- | --- | --- | --- |")
    for name, (queued, single) in times.items():
        queued, single = sorted(queued), sorted(single)
        print(f"| {name} | {queued[0]:.1f} | {queued[len(queued) // 2]:.1f} | "
              f"{single[0]:.1f} | {single[len(single) // 2]:.1f} |")


if __name__ == "__main__":
    main()
