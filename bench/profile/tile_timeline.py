"""Where a Hopper forward launch's time goes, tile by tile: a build with CUFA_TRACE=1
(fwd/sm90_trace.cuh) stamps each tile's wait for Q, Q's arrival and both consumers' ends
with the SM clock and the global timer; this reads them back after one launch and splits
the launch's SM-time into key blocks, each tile's fixed cost, waits for Q and the tail.

    python3 bench/profile/tile_timeline.py [--dtype bf16] [--head-dims 256] [--seqlens 4096,8192]
        [--causal 0,1] [--tokens 16384] [--fp8]

--fp8 traces the fp8 forward instead: q, k, v the same values in float8_e4m3fn, out in
--dtype (its transpose of V, where a pre-pass makes it, is another launch, not traced).

Each configuration: batch = tokens / N, heads = 2048 / d (bench_fwd.py's grid). The
split: a tile's time from Q's arrival to consumer 0's end is fitted as fixed + blocks x
per_block (least squares over the launch's tiles); "blocks" is every tile's key blocks at
the fitted rate, "fixed" what the tiles cost beyond that, "Q waits" consumer 0's waits
for a tile's Q (the producer's scheduling and the TMA load under the previous tile's
end), "tail" each CTA's idle time from its last tile's end to the launch's. Where every
tile has as many blocks (full attention of one length) the fit cannot tell a tile's
fixed cost from its blocks: it is all counted as blocks there. Times of
this build only: the stamps cost a few instructions a tile.
"""
import argparse
import os
import sys

os.environ["CUFA_TRACE"] = "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import _timing  # noqa: E402,F401  (finds the checkout's cufa when none is on the path)
import numpy as np  # noqa: E402
import torch  # noqa: E402

import cufa  # noqa: E402
from _trace import traced_launch  # noqa: E402

FIELDS = ("wait", "ready", "end0", "end1", "ns_ready", "ns_end0", "head_block", "batch_blocks",
          "first_p", "loop_end")


def run(dtype, d, n, causal, tokens, fp8=False):
    batch, heads = max(tokens // n, 1), max(2048 // d, 1)
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, n, heads, d, device="cuda", dtype=dtype) for _ in range(3))
    out = None
    if fp8:
        q, k, v = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
        out = torch.empty(q.shape, device="cuda", dtype=dtype)
    cufa.flash_attn_func(q, k, v, causal=causal, out=out)  # compiles
    torch.cuda.synchronize()
    key, table = traced_launch(lambda: cufa.flash_attn_func(q, k, v, causal=causal, out=out),
                               "fwd_sm90", "cufa_tile_trace", (264, 512, len(FIELDS)),
                               lambda t: int(t[:, :, 1].max()) != 0, "Hopper forward")
    return key, batch, heads, table  # ((264, 512): sm90_trace.cuh's kTraceCtas, kTraceTiles)


def _fit(blocks, cycles):
    """(fixed, per block) of cycles = fixed + per_block x blocks, least squares. Where every
    tile has as many blocks (full attention of one length) the two cannot be told apart:
    all of it counts as blocks, fixed 0 (say so when reading a full-attention row)."""
    if len(blocks) < 3:
        return np.nan, np.nan
    if np.ptp(blocks) == 0:
        return 0.0, float(np.mean(cycles) / max(blocks[0], 1))
    a = np.vstack([np.ones_like(blocks), blocks]).T
    (fixed, per_block), *_ = np.linalg.lstsq(a, cycles, rcond=None)
    return fixed, per_block


def analyse(t):
    used = t[:, :, 1] != 0  # Q's arrival stamped
    ctas = np.nonzero(used.any(axis=1))[0]
    rec = t[used]
    wait, ready, end0, end1, ns_ready, ns_end0 = (rec[:, i].astype(np.float64) for i in range(6))
    blocks = (rec[:, 7] & 0xFFFFFFFF).astype(np.float64)
    dur = end0 - ready
    # the SM clock against the global timer, over every tile (MHz)
    clock_per_ns = np.sum(dur) / max(np.sum(ns_end0 - ns_ready), 1.0)
    (fixed, per_block) = _fit(blocks, dur)
    start_ns = min(t[c][used[c]][:, 4].min() for c in ctas)
    end_ns = max(t[c][used[c]][:, 5].max() for c in ctas)
    span = (end_ns - start_ns) * clock_per_ns  # cycles
    total = span * len(ctas)
    tail = sum((end_ns - t[c][used[c]][:, 5].max()) * clock_per_ns for c in ctas)
    first_wait = sum(t[c][used[c]][:, 4].min() - start_ns for c in ctas) * clock_per_ns
    q_waits = np.sum(ready - wait)
    lag1 = np.where(end1 > 0, end1 - end0, 0)
    # consumer 0's phases: Q to its first block's P (block 0's S and softmax, nothing to
    # overlap them), the loop to its last P V, and the epilogue (O / l written)
    first_p, loop_end = rec[:, 8].astype(np.float64), rec[:, 9].astype(np.float64)
    peeled = (first_p > 0) & (blocks > 1)
    loop_fixed, loop_per_block = _fit(blocks[peeled] - 1, (loop_end - first_p)[peeled])
    out = {
        "prologue_cycles": float(np.median((first_p - ready)[peeled])) if peeled.any() else np.nan,
        "loop_per_block": loop_per_block, "loop_fixed": loop_fixed,
        "epilogue_cycles": float(np.median(end0 - loop_end)),
        "q_wait_cycles": float(np.median(ready - wait)),
        "ctas": len(ctas), "tiles": len(rec), "MHz": clock_per_ns * 1e3,
        "span_us": span / clock_per_ns / 1e3,
        "per_block_cycles": per_block, "fixed_cycles": fixed,
        "fixed_in_blocks": fixed / per_block if per_block else float("nan"),
        "blocks_mean": blocks.mean(),
        "share_blocks": per_block * blocks.sum() / total,
        "share_fixed": (dur.sum() - per_block * blocks.sum()) / total,
        "share_q_waits": q_waits / total,
        "share_tail": tail / total,
        "share_late_start": first_wait / total,
        "consumer1_lag_cycles": float(np.median(lag1)),
        "tile_residual_rms": float(np.sqrt(np.mean((dur - fixed - per_block * blocks) ** 2))),
    }
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bf16", choices=("fp16", "bf16"))
    p.add_argument("--head-dims", default="256")
    p.add_argument("--seqlens", default="4096,8192")
    p.add_argument("--causal", default="0,1")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--fp8", action="store_true", help="the fp8 forward (q, k, v in e4m3)")
    args = p.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    print("config | variant | CTAs tiles | span us | cycles a block, fixed a tile (blocks) | "
          "blocks fixed Q-waits tail late-start (% of SM-time) | consumer 1 lag | fit rms")
    for d in (int(x) for x in args.head_dims.split(",")):
        for n in (int(x) for x in args.seqlens.split(",")):
            for causal in (bool(int(x)) for x in args.causal.split(",")):
                key, batch, heads, t = run(dtype, d, n, causal, args.tokens, args.fp8)
                r = analyse(t)
                print(f"{args.dtype} d={d} N={n} {'causal' if causal else 'full'} {batch}x{heads} | "
                      f"{key} | {r['ctas']} {r['tiles']} | {r['span_us']:.1f} | "
                      f"{r['per_block_cycles']:.0f}, {r['fixed_cycles']:.0f} "
                      f"({r['fixed_in_blocks']:.2f}; mean {r['blocks_mean']:.1f} a tile) | "
                      f"{100 * r['share_blocks']:.1f} {100 * r['share_fixed']:.1f} "
                      f"{100 * r['share_q_waits']:.1f} {100 * r['share_tail']:.1f} "
                      f"{100 * r['share_late_start']:.1f} | {r['consumer1_lag_cycles']:.0f} | "
                      f"{r['tile_residual_rms']:.0f}  ({r['MHz']:.0f} MHz)", flush=True)
                print(f"    consumer 0, cycles (medians): Q wait {r['q_wait_cycles']:.0f}, to block 0's P "
                      f"{r['prologue_cycles']:.0f}, loop {r['loop_per_block']:.0f} a block + "
                      f"{r['loop_fixed']:.0f}, epilogue {r['epilogue_cycles']:.0f}", flush=True)


if __name__ == "__main__":
    main()
