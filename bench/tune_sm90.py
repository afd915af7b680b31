#!/usr/bin/env python3
"""Kernel experiments on Hopper: the same shapes under several sm90 tile widths, SDPA
flash alongside, one table.

    python3 bench/tune_sm90.py [--exp base,s3,...] [--shapes 128:8192:0,...] [--reps 20]

Each configuration patches cufa._compile's tables (the variant key changes, so each
compiles separately) and checks its output against SDPA flash before timing it. Used to
pick the defaults in cufa/_compile.py; the measured outcomes go to bench/NOTES.md.
"""
import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import cufa  # noqa: E402
from cufa import _compile, api  # noqa: E402
from bench_fwd import Shape, time_events  # noqa: E402

# name -> (tiles {head_dim: (block_m, block_n)} for masks "none", the same for
# "window" (causal, local)[, the same for short causal sequences' 64-row tiles])
EXPERIMENTS = {
    "base": ({}, {}),
    "short_bn64": ({}, {}, {64: (64, 64)}),  # causal d = 64 up to 1k rows on 64-key blocks
    "win_wide": ({}, {64: (128, 192)}),
    "narrow": ({64: (128, 128), 256: (128, 64)}, {}),
    "d256_bn64": ({256: (128, 64)}, {256: (128, 64)}),
    "d256_win64": ({}, {256: (128, 64)}),  # causal d = 256 on 64-key blocks
}
DEFAULT_SHAPES = ("64:512:0,64:512:1,64:2048:1,64:8192:0,128:512:0,128:512:1,128:2048:0,"
                  "128:2048:1,128:8192:0,128:8192:1,256:512:1,256:8192:0")


def configure(name):
    tiles, window_tiles, *short_window_tiles = EXPERIMENTS[name]
    _compile.SM90_TILES = {**BASE_TILES, **tiles}
    _compile.SM90_TILES_WINDOW = {**BASE_WINDOW_TILES, **window_tiles}
    _compile.SM90_SHORT_TILES_WINDOW = {**BASE_SHORT_WINDOW_TILES, **dict(*short_window_tiles)}
    # an experiment's head dims take its tiles at every length
    _compile.SM90_MID_TILES = {hd: t for hd, t in BASE_MID_TILES.items()
                               if hd not in tiles and hd not in window_tiles}
    _compile.fwd_variant.cache_clear()  # it caches the variant picked from the tables
    api.clear_plans()  # plans hold the variant picked from the old tables


def run(shape_text, names, reps):
    d, n, causal = (int(x) for x in shape_text.split(":"))
    shape = Shape("fp16", d, n, 16384 // n, 2048 // d, 2048 // d)
    gen = torch.Generator(device="cuda").manual_seed(0)
    sets = [tuple(torch.randn(shape.batch, n, shape.nheads, d, device="cuda", dtype=torch.float16,
                              generator=gen) for _ in range(3)) for _ in range(max(2, shape.sets()))]
    bhnd = [tuple(x.transpose(1, 2) for x in s) for s in sets]
    row = {}
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        sdpa = torch.nn.functional.scaled_dot_product_attention
        ref = sdpa(*bhnd[0], is_causal=bool(causal)).transpose(1, 2)
        ms = statistics.median(time_events(torch, lambda q, k, v: sdpa(q, k, v, is_causal=bool(causal)),
                                           bhnd, reps))
    row["flash"] = shape.flops(causal) / ms / 1e9
    for name in names:
        configure(name)
        try:
            out = cufa.flash_attn_func(*sets[0], causal=bool(causal))
            err = (out.float() - ref.float()).abs().max().item()
            if not err < 2e-2:
                row[name] = f"ERR {err:.2g}"
                continue
            ms = statistics.median(time_events(
                torch, lambda q, k, v: cufa.flash_attn_func(q, k, v, causal=bool(causal)), sets, reps))
            row[name] = shape.flops(causal) / ms / 1e9
        except Exception as e:  # a configuration that does not compile or fit: say so, go on
            row[name] = f"{type(e).__name__}"
            print(f"{shape_text} {name}: {e}"[:2000], file=sys.stderr)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--exp", default=",".join(EXPERIMENTS))
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="head_dim:seqlen:causal,...")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    names = args.exp.split(",")
    cols = ["flash"] + names
    print(f"TFLOP/s, fp16, {torch.cuda.get_device_name()}; 16k tokens, 2048 hidden")
    print("| d:N:causal | " + " | ".join(cols) + " |")
    print("|" + " --- |" * (len(cols) + 1))
    for shape_text in args.shapes.split(","):
        row = run(shape_text, names, args.reps)
        cells = [f"{row[c]:.0f}" if isinstance(row[c], float) else row[c] for c in cols]
        print(f"| {shape_text} | " + " | ".join(cells) + " |", flush=True)


BASE_TILES = dict(_compile.SM90_TILES)
BASE_WINDOW_TILES = dict(_compile.SM90_TILES_WINDOW)
BASE_MID_TILES = dict(_compile.SM90_MID_TILES)
BASE_SHORT_WINDOW_TILES = dict(_compile.SM90_SHORT_TILES_WINDOW)

if __name__ == "__main__":
    main()
