#!/usr/bin/env python3
"""Packed variable-length batches: cufa varlen against PyTorch's varlen_attn and against
a padded dense cufa call of the same batch, in one run.

    python3 bench/bench_varlen.py [--out DIR] [--reps 32] [--batches long,short]
        [--head-dims 64,128] [--no-peers] [--fp8]

Batches: 32 sequences with lengths drawn from 128..4096, and 256 sequences from 64..512
(fixed seeds); head dims 64 and 128 (heads = 2048 / d); fp16; causal and not. Useful
TFLOP/s only: sum over sequences of 4 * H * len^2 * d (halved for causal); padding and
masked-out work do not count. Beside it, each call's least DRAM traffic (q, k, v read and o
written once: 2 bytes an element) over its time, in TB/s: the padded call moves 1.76x the
bytes of the short batch for 2.6x its useful FLOPs. Queued CUDA-event timing; cufa, the
padded call and varlen_attn in ROUNDS interleaved rounds in random order, the median of
--reps calls each (bench/_timing.py). --fp8 adds cufa's fp8 forward on the same values
rounded to float8_e4m3fn (Hopper; its time includes V's transpose). Writes
DIR/bench_varlen.{json,md}.
"""
import argparse
import inspect
import json
import os
import statistics
import sys

import _timing as T  # this script's folder is on sys.path

BATCHES = {"32 x 128..4096": (32, 128, 4096, 0), "256 x 64..512": (256, 64, 512, 1)}
BATCH_NAMES = {"long": "32 x 128..4096", "short": "256 x 64..512"}
ROUNDS = 8


def time_interleaved(torch, fns, reps):
    """Median ms of each function over ROUNDS interleaved rounds."""
    per_round = max(1, -(-reps // ROUNDS))
    timed = T.run_rounds({name: (lambda n, fn=fn: T.time_events(torch, fn, [()], n))
                          for name, fn in fns.items()}, per_round, rounds=ROUNDS)
    return {name: None if isinstance(ms, dict) else statistics.median(ms)
            for name, ms in timed.items()}


def varlen_attn_peer(torch):
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--reps", type=int, default=32, help="timed calls per implementation")
    p.add_argument("--batches", default="long,short", help="long,short")
    p.add_argument("--head-dims", type=T.int_list, default=(64, 128))
    p.add_argument("--no-peers", action="store_true", help="time cufa only (varlen and padded)")
    p.add_argument("--fp8", action="store_true",
                   help="also time cufa's fp8 varlen forward on the same values in "
                        "float8_e4m3fn (the 'cufa fp8' column; Hopper, head dims in 16s)")
    args = p.parse_args(argv)
    bad = [b for b in args.batches.split(",") if b not in BATCH_NAMES]
    if bad:
        p.error(f"--batches: unknown {bad}; expected long and/or short")
    if any(d <= 0 or d % 8 or d > 256 or 2048 % d for d in args.head_dims):
        p.error("--head-dims must be multiples of 8 up to 256 that divide 2048")
    return args


def time_batch(torch, cufa, peer, name, batch, lo, hi, seed, head_dim, reps, fp8=False):
    """The rows of one batch at one head dim (causal and not)."""
    import numpy as np
    lens = np.random.default_rng(seed).integers(lo, hi + 1, batch)
    total, max_len = int(lens.sum()), int(lens.max())
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
    d, h = head_dim, 2048 // head_dim
    q, k, v = (torch.randn(total, h, d, device="cuda", dtype=torch.float16) for _ in range(3))
    dense = [torch.randn(batch, max_len, h, d, device="cuda", dtype=torch.float16)
             for _ in range(3)]
    e4m3 = [x.to(torch.float8_e4m3fn) for x in (q, k, v)] if fp8 and d % 16 == 0 else None
    rows = []
    for causal in (False, True):
        flops = sum(T.attention_flops(1, h, int(n), int(n), d, causal) for n in lens)
        row = dict(batch=name, d=d, causal=causal, total_tokens=total, max_len=max_len)
        fns = {"cufa": lambda: cufa.flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len,
                                                           causal=causal),
               "padded": lambda: cufa.flash_attn_func(*dense, causal=causal)}
        if e4m3 is not None:
            fns["fp8"] = lambda: cufa.flash_attn_varlen_func(*e4m3, cu, cu, max_len, max_len,
                                                             causal=causal)
        if peer is not None:
            try:
                out = peer(q, k, v, cu, cu, max_len, max_len, causal=causal)
                if out is not None:
                    ours = fns["cufa"]()
                    row["max_diff_vs_peer"] = (ours.float() - out.float()).abs().max().item()
                    fns["peer"] = lambda: peer(q, k, v, cu, cu, max_len, max_len, causal=causal)
            except Exception as e:
                row["peer_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        row.update({f"{key}_ms": ms for key, ms in time_interleaved(torch, fns, reps).items()})
        for key in ("cufa", "padded", "peer", "fp8"):
            ms = row.get(f"{key}_ms")
            row[f"{key}_tflops"] = T.tflops(flops, ms) if ms else None
        # q, k, v read and o written once (2-byte elements): the least DRAM traffic
        for key, tokens in (("cufa", total), ("padded", batch * max_len)):
            ms = row[f"{key}_ms"]
            row[f"{key}_tbps"] = 4 * tokens * h * d * 2 / (ms * 1e-3) / T.TB if ms else None
        rows.append(row)
        print(f"{name} d={d} causal={causal}: cufa {T.fmt(row['cufa_tflops'], '.0f')} TFLOP/s, "
              f"padded {T.fmt(row['padded_tflops'], '.0f')}"
              + (f", fp8 {T.fmt(row['fp8_tflops'], '.0f')}" if e4m3 is not None else ""),
              file=sys.stderr)
    return rows


def markdown(rows, device, reps, fp8=False):
    ratio = (lambda a, b: "n/a" if not (a and b) else f"{a / b:.2f}")
    lines = [f"Packed (varlen) forward, fp16, {device}, useful TFLOP/s (padding excluded), "
             f"CUDA events, median of {reps} calls in {ROUNDS} interleaved rounds (random "
             f"order, {T.WARMUP_MS} ms warm-up per block).", "",
             "| batch | d | causal | tokens | cufa varlen | torch varlen_attn | cufa padded dense "
             "| cufa / varlen_attn | cufa / padded | least traffic, TB/s: cufa / padded |"
             + (" cufa fp8 | fp8 / cufa |" if fp8 else ""),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
             + (" --- | --- |" if fp8 else "")]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['d']} | {r['causal']} | {r['total_tokens']} | "
                     f"{T.fmt(r['cufa_tflops'], '.0f')} | {T.fmt(r['peer_tflops'], '.0f')} | "
                     f"{T.fmt(r['padded_tflops'], '.0f')} | "
                     f"{ratio(r['cufa_tflops'], r['peer_tflops'])} | "
                     f"{ratio(r['cufa_tflops'], r['padded_tflops'])} | "
                     f"{T.fmt(r['cufa_tbps'], '.2f')} / {T.fmt(r['padded_tbps'], '.2f')} |"
                     + (f" {T.fmt(r.get('fp8_tflops'), '.0f')} | "
                        f"{ratio(r.get('fp8_tflops'), r['cufa_tflops'])} |" if fp8 else ""))
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    torch = T.require_torch_cuda("bench_varlen")
    cufa = T.load_cufa()
    if isinstance(cufa, str):
        sys.exit(f"bench_varlen: {cufa}")
    os.makedirs(args.out, exist_ok=True)
    peer, peer_note = (None, "not timed (--no-peers)") if args.no_peers else varlen_attn_peer(torch)
    print(f"varlen_attn: {peer_note}", file=sys.stderr)
    wanted = {BATCH_NAMES[b] for b in args.batches.split(",")}
    rows = []
    for name, (batch, lo, hi, seed) in BATCHES.items():
        if name in wanted:
            for d in args.head_dims:
                rows += time_batch(torch, cufa, peer, name, batch, lo, hi, seed, d, args.reps,
                                   args.fp8)
                torch.cuda.empty_cache()
    device = torch.cuda.get_device_name()
    table = markdown(rows, device, args.reps, args.fp8)
    print(table)
    with open(os.path.join(args.out, "bench_varlen.md"), "w") as f:
        f.write(table + "\n")
    meta = dict(device=device, versions=T.versions(torch), varlen_attn=peer_note,
                argv=sys.argv[1:] if argv is None else argv, reps=args.reps, rounds=ROUNDS)
    with open(os.path.join(args.out, "bench_varlen.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
