#!/usr/bin/env python3
"""Packed variable-length batches: cufa varlen against PyTorch's varlen_attn and against
a padded dense cufa call of the same batch, in one run.

    python3 bench/bench_varlen.py [--out DIR] [--reps 20] [--batches short] [--exp base,bn64]

Batches: 32 sequences with lengths drawn from 128..4096, and 256 sequences from 64..512
(fixed seeds); head dims 64 and 128 (heads = 2048 / d); fp16; causal and not. Useful
TFLOP/s only: sum over sequences of 4 * H * len^2 * d (halved for causal) — padding and
masked-out work do not count. Beside it, each call's least DRAM traffic (q, k, v read and o
written once: 2 bytes an element) over its time, in TB/s: the padded call moves 1.76x the
bytes of the short batch for 2.6x its useful FLOPs. CUDA events; cufa (each --exp configuration), the padded call
and varlen_attn are timed in ROUNDS interleaved rounds in random order (so drift in clocks
falls on all alike), each block after bench_fwd's warm-up (at least 30 ms of its own
calls), the median of
--reps calls each. Each experiment keeps its own plans, so switching
between them costs no re-planning.
"""
import argparse
import collections
import inspect
import json
import os
import random
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import cufa  # noqa: E402
from bench_fwd import WARMUP_MS, time_events  # noqa: E402  (this script's folder is on sys.path)

BATCHES = {"32 x 128..4096": (32, 128, 4096, 0), "256 x 64..512": (256, 64, 512, 1)}
BATCH_NAMES = {"long": "32 x 128..4096", "short": "256 x 64..512"}
# --exp: sm90 tile tables to try, name -> {table in cufa/_compile.py: entries patched}
# (as in tune_sm90.py); "bm128" puts the short batch on the 128-row tiles
EXPERIMENTS = {
    "base": {},
    "bn128": {"SM90_TILES": {64: (128, 128), 128: (128, 128)},
              "SM90_TILES_WINDOW": {64: (128, 128), 128: (128, 128)}},
    "bm192": {"SM90_MID_TILES": None},  # d=128 on 192-row tiles at any length
    "bn64": {"SM90_TILES": {64: (128, 64), 128: (128, 64)},
             "SM90_TILES_WINDOW": {64: (128, 64), 128: (128, 64)}},
    "bm128": {"SM90_SHORT_TILES": None, "SM90_SHORT_TILES_WINDOW": None},
    "short_bm64": {"SM90_SHORT_TILES": {128: (64, 64)}},  # d=128 non-causal on 64-row tiles too
    "short_bn64": {"SM90_SHORT_TILES": {64: (64, 64)}, "SM90_SHORT_TILES_WINDOW": {64: (64, 64)}},
    "short_win_bn64": {"SM90_SHORT_TILES_WINDOW": {64: (64, 64)}},  # causal d=64 only
}
ROUNDS = 8


def time_interleaved(fns, reps):
    """Median ms of each function over ROUNDS rounds of reps / ROUNDS calls, in a fresh
    random order each round (fixed seed), so no function always follows the same one."""
    names = list(fns)
    order = random.Random(0)
    times = {name: [] for name in names}
    for _ in range(ROUNDS):
        for name in order.sample(names, len(names)):
            # (bench_fwd's timer: at least WARMUP_MS of warm-up before each block)
            times[name] += time_events(torch, fns[name], [()], max(1, -(-reps // ROUNDS)))
    return {name: statistics.median(t) for name, t in times.items()}


def varlen_attn_peer():
    """PyTorch's varlen_attn and how it spells causal in this release, or (None, reason)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception as e:  # older PyTorch
        return None, f"{type(e).__name__}: {e}"
    params = inspect.signature(varlen_attn).parameters
    if "is_causal" in params:
        return (lambda *a, causal: varlen_attn(*a, is_causal=causal)), str(inspect.signature(varlen_attn))
    if "window_size" in params:
        return (lambda *a, causal: varlen_attn(*a, window_size=(-1, 0) if causal else (-1, -1))), \
            str(inspect.signature(varlen_attn))
    return (lambda *a, causal: varlen_attn(*a) if not causal else None), \
        "no causal argument: " + str(inspect.signature(varlen_attn))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--reps", type=int, default=30, help="timed calls per implementation")
    parser.add_argument("--batches", default="long,short", help="long,short")
    parser.add_argument("--exp", default="base", help="experiments: " + ",".join(EXPERIMENTS))
    args = parser.parse_args()
    from cufa import _compile, _fwd_plan, _runtime
    tables = {name: dict(getattr(_compile, name))
              for name in ("SM90_TILES", "SM90_TILES_WINDOW", "SM90_MID_TILES",
                           "SM90_SHORT_TILES", "SM90_SHORT_TILES_WINDOW")}

    exps = ["base"] + [e for e in args.exp.split(",") if e != "base"]
    plans = {}  # experiment -> its own plan cache (plans hold the variant picked)

    def configure(exp):
        if len(exps) == 1:  # base only: time the bare call
            return
        for name, table in tables.items():
            patch = EXPERIMENTS[exp].get(name, {})
            setattr(_compile, name, {} if patch is None else {**table, **patch})
        _compile.fwd_variant.cache_clear()  # it caches the variant picked from the tables
        _runtime.plans = _fwd_plan.plans = plans.setdefault(exp, collections.OrderedDict())

    os.makedirs(args.out, exist_ok=True)
    peer, peer_note = varlen_attn_peer()
    print(f"varlen_attn: {peer_note}")
    rows = []
    for name, (batch, lo, hi, seed) in BATCHES.items():
        if not any(BATCH_NAMES[b] == name for b in args.batches.split(",")):
            continue
        lens = np.random.default_rng(seed).integers(lo, hi + 1, batch)
        total, max_len = int(lens.sum()), int(lens.max())
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
        for d in (64, 128):
            h = 2048 // d
            q, k, v = (torch.randn(total, h, d, device="cuda", dtype=torch.float16) for _ in range(3))
            dense = [torch.randn(batch, max_len, h, d, device="cuda", dtype=torch.float16)
                     for _ in range(3)]
            for causal in (False, True):
                flops = sum(4 * h * int(n) ** 2 * d for n in lens) / (2 if causal else 1)
                row = dict(batch=name, d=d, causal=causal, total_tokens=total, max_len=max_len)
                # q, k, v read and o written once (2-byte elements): the least DRAM traffic
                packed_bytes = 4 * total * h * d * 2
                padded_bytes = 4 * batch * max_len * h * d * 2

                def packed_call(exp):
                    def call():
                        configure(exp)
                        return cufa.flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len,
                                                           causal=causal)
                    return call

                first = None
                for exp in exps:
                    out = packed_call(exp)().float()
                    first = out if first is None else first
                    row[f"cufa_{exp}_diff"] = (out - first).abs().max().item()
                fns = {("cufa" if exp == "base" else f"cufa_{exp}"): packed_call(exp)
                       for exp in exps}

                def padded_call():
                    configure("base")
                    return cufa.flash_attn_func(*dense, causal=causal)

                fns["padded"] = padded_call
                configure("base")
                row["peer_ms"] = None
                if peer is not None:
                    try:
                        out = peer(q, k, v, cu, cu, max_len, max_len, causal=causal)
                        if out is not None:
                            ours = cufa.flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len,
                                                               causal=causal)
                            row["max_diff_vs_peer"] = (ours.float() - out.float()).abs().max().item()
                            fns["peer"] = lambda: peer(q, k, v, cu, cu, max_len, max_len,
                                                       causal=causal)
                    except Exception as e:
                        row["peer_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                row.update({f"{name}_ms": ms for name, ms in time_interleaved(fns, args.reps).items()})
                row["cufa_base_ms"] = row["cufa_ms"]
                for key in ["cufa", "padded", "peer"] + [f"cufa_{e}" for e in args.exp.split(",")]:
                    ms = row[f"{key}_ms"]
                    row[f"{key}_tflops"] = flops / ms / 1e9 if ms else None
                row["cufa_tbps"] = packed_bytes / row["cufa_ms"] / 1e9
                row["padded_tbps"] = padded_bytes / row["padded_ms"] / 1e9
                rows.append(row)
                print(f"{name} d={d} causal={causal}: cufa " + ", ".join(
                    f"{e} {row[f'cufa_{e}_tflops']:.0f} (diff {row[f'cufa_{e}_diff']:.1e})" for e in args.exp.split(",")) +
                    f" TFLOP/s; padded {row['padded_tflops']:.0f}", file=sys.stderr)

    fmt = (lambda x: "n/a" if x is None else f"{x:.0f}")
    ratio = (lambda a, b: "n/a" if not (a and b) else f"{a / b:.2f}")
    lines = [f"Packed (varlen) forward, fp16, {torch.cuda.get_device_name()}, useful TFLOP/s "
             f"(padding excluded), CUDA events, median of {args.reps} calls in {ROUNDS} interleaved "
             f"rounds (random order, {WARMUP_MS} ms warm-up per block).", "",
             "| batch | d | causal | tokens | cufa varlen | torch varlen_attn | cufa padded dense "
             "| cufa / varlen_attn | cufa / padded | least traffic, TB/s: cufa / padded |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['d']} | {r['causal']} | {r['total_tokens']} | "
                     f"{fmt(r['cufa_tflops'])} | {fmt(r['peer_tflops'])} | "
                     f"{fmt(r['padded_tflops'])} | {ratio(r['cufa_tflops'], r['peer_tflops'])} | "
                     f"{ratio(r['cufa_tflops'], r['padded_tflops'])} | "
                     f"{r['cufa_tbps']:.2f} / {r['padded_tbps']:.2f} |")
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(args.out, "bench_varlen.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(args.out, "bench_varlen.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                       varlen_attn=peer_note, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
