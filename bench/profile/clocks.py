#!/usr/bin/env python3
"""Speed, SM clock and power of calls back to back, by the values the inputs hold: a long
row of the forward or of the MLA decode runs at the card's power limit, where its speed is
the energy a FLOP and the values themselves move it (bench/results/mla_decode_h200.md: the
MLA decode at 128 heads took 1.55-1.7 GHz and 690 W over random caches, 1.98 GHz and 544 W
over constant ones). Each row and value set is timed as bench_fwd.py times it (queued
behind a spinning kernel, CUDA events, interleaved rounds), then run back to back for
--seconds while `nvidia-smi --query-gpu=clocks.sm,power.draw -lms 100` samples the card.

    python3 bench/profile/clocks.py [--fwd 256:8192:1,128:8192:0] [--mla 128:128:8192:2]
        [--values randn,zeros,const] [--peers] [--seconds 1.5] [--dry-run]

--fwd d:N:causal (bf16, 16k tokens a batch, heads = 2048 / d, as bench_fwd.py; --peers adds
SDPA cuDNN beside cufa); --mla heads:B:N:tokens[:e4m3] (bench_mla.py's arguments, pages
of 64; the values are the caches', q stays random). Values: randn, zeros, const (0.5 everywhere).
--dry-run lists the rows without a GPU. Results go in bench/results/ with the card named.
"""
import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import _timing  # noqa: E402  (finds the checkout's cufa when none is on the path)
import bench_mla  # noqa: E402

PAGE, TOKENS = 64, 16384  # (MLA pages of 64, as bench_mla.py's default; 16k tokens a batch)
VALUES = ("randn", "zeros", "const")


def _rows(text, fields, kind):
    """'256:8192:1,128:8192:0' -> [(kind, (256, 8192, 1)), ...]; an MLA row's fifth field,
    e4m3, is kept as a flag."""
    rows = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        parts = item.split(":")
        flag = parts[fields:] == ["e4m3"]
        if len(parts) != fields and not (kind == "mla" and flag):
            raise argparse.ArgumentTypeError(f"--{kind} takes {fields} fields a row; got {item!r}")
        rows.append((kind, tuple(int(x) for x in parts[:fields]) + ((flag,) if kind == "mla" else ())))
    return rows


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fwd", type=lambda t: _rows(t, 3, "fwd"), default=[])
    p.add_argument("--mla", type=lambda t: _rows(t, 4, "mla"), default=[])
    p.add_argument("--values", type=lambda t: [v for v in t.split(",") if v],
                   default=list(VALUES))
    p.add_argument("--peers", action="store_true", help="SDPA cuDNN beside the forward rows")
    p.add_argument("--seconds", type=float, default=1.5)
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    bad = [v for v in args.values if v not in VALUES]
    if bad:
        p.error(f"--values takes {', '.join(VALUES)}; got {', '.join(bad)}")
    if not args.fwd and not args.mla:
        args.fwd = _rows("256:8192:1", 3, "fwd")
        args.mla = _rows("128:128:8192:2", 4, "mla")
    return args


def label(kind, row):
    if kind == "fwd":
        d, n, causal = row
        return f"fwd d={d} N={n}{' causal' if causal else ''} {TOKENS // n}x{2048 // d}"
    heads, b, n, sq, e4m3 = row
    return f"mla {heads} heads B={b} N={n} sq={sq}{' e4m3' if e4m3 else ''}"


def cases(args):
    """(kind, row, values, who) in run order; who: cufa or sdpa_cudnn."""
    out = []
    for kind, row in args.fwd + args.mla:
        for v in args.values:
            out.append((kind, row, v, "cufa"))
            if kind == "fwd" and args.peers:
                out.append((kind, row, v, "sdpa_cudnn"))
    return out


def fill(torch, shape, values, dtype):
    if values == "zeros":
        return torch.zeros(shape, device="cuda", dtype=dtype)
    if values == "const":
        return torch.full(shape, 0.5, device="cuda", dtype=dtype)
    return torch.randn(shape, device="cuda", dtype=dtype)


def build(torch, cufa, kind, row, values, who):
    """(call, its arguments, FLOPs)."""
    import numpy as np
    if kind == "fwd":
        d, n, causal = row
        b, h = TOKENS // n, 2048 // d
        q, k, v = (fill(torch, (b, n, h, d), values, torch.bfloat16) for _ in range(3))
        flops = _timing.attention_flops(b, h, n, n, d, causal)
        if who == "cufa":
            return (lambda q, k, v: cufa.flash_attn_func(q, k, v, causal=bool(causal))), \
                (q, k, v), flops
        from torch.nn.attention import SDPBackend, sdpa_kernel
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def sdpa(q, k, v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))
        return sdpa, (qt, kt, vt), flops
    heads, b, n, sq, e4m3 = row
    kw = bench_mla.call_kwargs(torch, np.random.default_rng(0), b, n, sq, heads, PAGE, e4m3,
                               lambda shape: fill(torch, shape, values, torch.bfloat16))
    return ((lambda kw: cufa.flash_attn_with_kvcache(**kw, causal=True)), (kw,),
            bench_mla.flops(b, heads, sq, n))


def sample(torch, call, call_args, seconds):
    """(min MHz, max MHz, median W) of the card while `call` runs back to back."""
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw",
                            "--format=csv,noheader,nounits", "-lms", "100"],
                           stdout=subprocess.PIPE, text=True)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(16):
            call(*call_args)
        torch.cuda.synchronize()
    smi.terminate()
    lines = smi.communicate()[0].strip().splitlines()[3:]  # (the first samples: the ramp)
    got = [tuple(float(x) for x in line.split(",")) for line in lines if line.count(",") == 1]
    if not got:
        return None
    mhz = [g[0] for g in got]
    watts = sorted(g[1] for g in got)
    return min(mhz), max(mhz), watts[len(watts) // 2]


def main(argv=None):
    args = parse(argv)
    todo = cases(args)
    if args.dry_run:
        for kind, row, values, who in todo:
            print(f"{label(kind, row)}, {values}: {who}")
        return
    torch = _timing.require_torch_cuda("clocks.py")
    cufa = _timing.load_cufa()
    if isinstance(cufa, str):
        sys.exit(cufa)
    print(f"{torch.cuda.get_device_name()}, bf16; calls back to back, queued (median of "
          f"{_timing.ROUNDS} rounds), then {args.seconds} s sampled by nvidia-smi\n")
    print("| row | values | who | us | TFLOP/s | SM MHz | W |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for kind, row, values, who in todo:
        call, call_args, flops = build(torch, cufa, kind, row, values, who)
        got = _timing.run_rounds({who: lambda reps, c=call, a=call_args: _timing.time_events(
            torch, c, [a], reps)}, 8)[who]
        if isinstance(got, dict):
            print(f"| {label(kind, row)} | {values} | {who} | n/a: {got['na'][:80]} | | | |")
            continue
        ms = _timing.median(got)
        card = sample(torch, call, call_args, args.seconds)
        clocks = f"{card[0]:.0f}-{card[1]:.0f} | {card[2]:.0f}" if card else "no samples | "
        print(f"| {label(kind, row)} | {values} | {who} | {ms * 1e3:.1f} | "
              f"{_timing.tflops(flops, ms):.0f} | {clocks} |", flush=True)
        call = call_args = None  # (the inputs freed before the next row)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
