"""Where the Hopper backward's dk/dv launch spends its time, CTA by CTA: a build with
CUFA_TRACE=1 (bwd/bwd_sm90.cu's bwd_trace) stamps each CTA's start, its first step's
arrival, the end of its loop and of its stores, the producer's end and its SM on the global
timer; this reads them back after one backward and splits the SMs' time into the prologue
(start to the first step: K, V and the first Q and dout), the loop, the epilogue (dk and dv
written), the producer's drain past it, the gaps between one CTA's end and the next one's
start on an SM (where one runs at a time), and the tail.

    python3 bench/profile/bwd_timeline.py [--dtype bf16] [--head-dims 128] [--seqlens 1024,4096]
        [--causal 0,1] [--tokens 16384]

Each configuration: batch = tokens / N, heads = 2048 / d (bench_bwd.py's grid). Times of
this build only (the stamps cost a few instructions a CTA), one backward after three that
compile and warm up; the first 8192 CTAs are stamped.
"""
import argparse
import os
import sys

import numpy as np

from _trace import traced_launch

HERE = os.path.dirname(os.path.abspath(__file__))
torch = cufa = None  # main() imports them, with the trace build asked for first

CTAS, FIELDS = 8192, 8  # (bwd_sm90.cu's kBwdTraceCtas, kBwdTraceFields)
START, FIRST_STEP, LOOP_END, STORED, PRODUCER_END, ISSUED, LANDED, SM = 0, 1, 2, 3, 4, 5, 6, 7


def run(dtype, d, n, causal, tokens):
    batch, heads = max(tokens // n, 1), max(2048 // d, 1)
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, n, heads, d, device="cuda", dtype=dtype) for _ in range(3))
    out, lse = cufa.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    dout = torch.randn_like(out)
    for _ in range(3):  # compiles, warms up
        cufa.flash_attn_backward(dout, q, k, v, out, lse, causal=causal)
    torch.cuda.synchronize()
    key, table = traced_launch(
        lambda: cufa.flash_attn_backward(dout, q, k, v, out, lse, causal=causal),
        "bwd_dkdv_sm90", "cufa_bwd_trace", (CTAS, FIELDS),
        lambda t: int(t[:, START].max()) != 0,
        "Hopper dk/dv (the persistent kernel, d = 64 up to 1024 rows, stamps nothing: "
        "CUFA_BWD_PERSISTENT=0 traces its twin of a CTA a key block)")
    return key, table.astype(np.int64)


def _most_at_once(starts, ends):
    """The most of these [start, end) intervals that overlap at one time."""
    events = sorted([(x, 1) for x in starts] + [(x, -1) for x in ends], key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return max(most, 1)


def analyse(t):
    t = t[t[:, START] > 0]
    t0 = t[:, START].min()
    start, first, loop_end, stored = (t[:, f] - t0 for f in (START, FIRST_STEP, LOOP_END, STORED))
    # (CTAs without a producer stamp no producer end: their stores end them)
    producer_end = np.where(t[:, PRODUCER_END] > 0, t[:, PRODUCER_END] - t0, stored)
    end, sm = np.maximum(stored, producer_end), t[:, SM]
    span, sms = end.max(), np.unique(sm)
    # CTAs an SM at once (the d = 64 kernels of one warpgroup run two): the SM-time is
    # that many slots, and gaps between CTAs are told only where there is one
    resident = max(_most_at_once(start[sm == s], end[sm == s]) for s in sms)
    gaps, tail = [], 0
    for s in sms:
        order = np.where(sm == s)[0]
        order = order[np.argsort(start[order])]
        if resident == 1:
            gaps += list(start[order[1:]] - end[order[:-1]])
        tail += resident * span - np.sum(np.sort(end[order])[-resident:])
    total = span * len(sms) * resident
    stepped = first > 0  # (CTAs with a step)
    # the prologue's parts where a producer stamps them: its thread 0's copies of the first
    # step issued, then landed (its own cp.async: lse and D), then the step's arrival at
    # the consumers (every producer warp's copies, Q and dout by TMA, and the consumers'
    # own copies of K and V)
    staged = stepped & (t[:, ISSUED] > 0) & (t[:, LANDED] > 0)
    issued, landed = t[:, ISSUED] - t0, t[:, LANDED] - t0
    parts = ([float(np.median(x[staged])) / 1e3 for x in
              (issued - start, landed - issued, first - landed)] if staged.any() else None)
    return {
        "prologue_parts_us": parts,
        "ctas": len(t), "sms": len(sms), "resident": resident, "span_us": span / 1e3,
        "prologue_us": np.median((first - start)[stepped]) / 1e3,
        "loop_us": np.median((loop_end - first)[stepped]) / 1e3,
        "epilogue_us": np.median(stored - loop_end) / 1e3,
        "drain_us": np.median(np.maximum(producer_end - stored, 0)) / 1e3,
        "gap_us": np.median(gaps) / 1e3 if gaps else float("nan"),
        "share": {"prologue": np.sum((first - start)[stepped]) / total,
                  "loop": np.sum((loop_end - first)[stepped]) / total,
                  "epilogue": np.sum(stored - loop_end) / total,
                  "drain": np.sum(np.maximum(producer_end - stored, 0)) / total,
                  "gaps": np.sum(gaps) / total, "tail": tail / total},
    }


def main():
    global torch, cufa
    os.environ["CUFA_TRACE"] = "1"  # (read when cufa is imported)
    sys.path.insert(0, os.path.dirname(HERE))  # bench/
    import _timing  # (finds the checkout's cufa when none is on the path)
    import torch
    import cufa
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bf16", choices=("fp16", "bf16"))
    p.add_argument("--head-dims", default="128")
    p.add_argument("--seqlens", default="1024,4096")
    p.add_argument("--causal", default="0,1")
    p.add_argument("--tokens", type=int, default=16384)
    args = p.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    print("config | variant | CTAs on SMs (at once) | span us | medians a CTA, us: prologue loop "
          "epilogue drain gap | % of SM-time: prologue loop epilogue drain gaps tail")
    for d in _timing.int_list(args.head_dims):
        for n in _timing.int_list(args.seqlens):
            for causal in (bool(int(c)) for c in args.causal.split(",")):
                key, table = run(dtype, d, n, causal, args.tokens)
                a = analyse(table)
                share = " ".join(f"{100 * a['share'][k]:.1f}" for k in
                                 ("prologue", "loop", "epilogue", "drain", "gaps", "tail"))
                print(f"{args.dtype} d={d} N={n} {'causal' if causal else 'full'} | {key} | "
                      f"{a['ctas']} on {a['sms']} ({a['resident']}) | {a['span_us']:.0f} | "
                      f"{a['prologue_us']:.2f} {a['loop_us']:.2f} {a['epilogue_us']:.2f} "
                      f"{a['drain_us']:.2f} "
                      f"{a['gap_us']:.2f} | {share}", flush=True)
                if a["prologue_parts_us"]:
                    print("    prologue, medians us: copies issued %.2f, landed %.2f, step "
                          "announced %.2f" % tuple(a["prologue_parts_us"]), flush=True)


if __name__ == "__main__":
    main()
