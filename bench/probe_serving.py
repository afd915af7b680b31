#!/usr/bin/env python3
"""Where the serving-shaped step's time goes (bench_decode.py's mixed batch: 4 prefill
chunks of 512 + 124 decodes of 1k-8k keys, pages of 16, d = 128, 32/8, fp16): the one
call, its prefill chunks alone, its decodes alone (flash_attn_with_kvcache) with the
split count forced, with the decodes in the order longest first, and with every decode at
the mean length. Each part against its own byte floor (its keys and values once, at the
copy rate measured here). CUDA events around each call, calls back to back, median of
ROUNDS interleaved rounds.

    python3 bench/probe_serving.py [--splits 0,2,4,8] [--rounds 5]
"""
import argparse
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import cufa  # noqa: E402
from bench_fwd import time_events  # noqa: E402  (this script's folder is on sys.path)
from bench_decode import SERVING_CHUNK as CHUNK, serving_step_inputs  # noqa: E402
from cufa import api, kvcache  # noqa: E402

HK, D = 8, 128
_choose = kvcache.choose_num_splits
_forced = [0]


def _choose_forced(*args, **kwargs):
    return _forced[0] or _choose(*args, **kwargs)


kvcache.choose_num_splits = _choose_forced


def times_us(fn, reps):
    """us of each of reps back-to-back calls (bench_fwd.time_events, after its warm-up)."""
    return [ms * 1e3 for ms in time_events(torch, fn, [()], reps)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--splits", default="0,2,3,4,6,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    s = serving_step_inputs(torch, np.random.default_rng(0))
    prefix, lens_q, lens_k, table, dev = (s[n] for n in ("prefix", "lens_q", "lens_k", "table",
                                                         "dev"))
    q, k_pages, v_pages, cu_q, cu_k, table_t = (s[n] for n in ("q", "k_pages", "v_pages", "cu_q",
                                                               "cu_k", "table_t"))
    dec_lens = lens_k[4:]
    rows = 4 * CHUNK
    cu_q4, cu_k4, table4 = cu_q[:5].clone(), cu_k[:5].clone(), table_t[:4].clone()
    table_dec, lens_dec = table_t[4:].clone(), dev(dec_lens)
    order = np.argsort(dec_lens)[::-1].copy()
    table_sorted = dev(table[4:][order])
    lens_sorted = dev(np.asarray(dec_lens)[order])
    mean = int(np.mean(dec_lens))
    lens_mean = dev([mean] * 124)
    qd = q[rows:, None].contiguous()

    a = torch.empty(2**29, dtype=torch.float16, device="cuda")
    b = torch.empty_like(a)
    copy_tbps = 2 * 2**30 / (statistics.median(times_us(lambda: b.copy_(a), 10)) * 1e-6) / 1e12
    del a, b
    kv = lambda lens: sum(lens) * HK * D * 2 * 2  # noqa: E731
    floors = {"step": kv(lens_k), "chunks": kv(lens_k[:4]), "decodes": kv(dec_lens),
              "mean": kv([mean] * 124)}

    def step():
        cufa.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, CHUNK, max(lens_k),
                                    causal=True, block_table=table_t)

    def chunks():
        cufa.flash_attn_varlen_func(q[:rows], k_pages, v_pages, cu_q4, cu_k4, CHUNK,
                                    max(lens_k[:4]), causal=True, block_table=table4)

    def decodes(tab, lens, splits):
        return lambda: cufa.flash_attn_with_kvcache(qd, k_pages, v_pages, cache_seqlens=lens,
                                                    causal=True, block_table=tab,
                                                    num_splits=splits)

    side = torch.cuda.Stream()

    def two_streams(decode_first):
        dec = decodes(table_dec, lens_dec, 0)

        def run():
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            if decode_first:
                with torch.cuda.stream(side):
                    dec()
                chunks()
            else:
                chunks()
                with torch.cuda.stream(side):
                    dec()
            main.wait_stream(side)
        return run

    cases = {"step (one call)": ("step", step, 0), "chunks alone": ("chunks", chunks, 0),
             "two streams, chunks launched first": ("step", two_streams(False), 0),
             "two streams, decodes launched first": ("step", two_streams(True), 0)}
    for s in (int(x) for x in args.splits.split(",")):
        cases[f"decodes, splits {s or 'auto'}"] = ("decodes", decodes(table_dec, lens_dec, s), 0)
        cases[f"decodes longest first, splits {s or 'auto'}"] = (
            "decodes", decodes(table_sorted, lens_sorted, s), 0)
        cases[f"step, packed decode splits forced {s}"] = ("step", step, s) if s else None
    cases["decodes all at the mean length"] = ("mean", decodes(table_dec, lens_mean, 0), 0)
    cases = {k: v for k, v in cases.items() if v}
    ref = decodes(table_dec, lens_dec, 1)()
    for name, (_, fn, forced) in cases.items():  # each correct against num_splits=1
        if name.startswith("decodes,"):
            torch.testing.assert_close(fn(), ref, atol=2e-3, rtol=0)
    samples = {k: [] for k in cases}
    for _ in range(args.rounds):
        names = list(cases)
        random.shuffle(names)
        for name in names:
            _, fn, forced = cases[name]
            _forced[0] = forced
            api._plans.clear()
            samples[name] += times_us(fn, args.reps)
        _forced[0] = 0
        api._plans.clear()
    print(f"copy {copy_tbps:.2f} TB/s; decode keys {min(dec_lens)}-{max(dec_lens)}, mean {mean}, "
          f"sum {sum(dec_lens)}; prefix {prefix}")
    print("| case | us (median) | best | byte floor us | % of floor |")
    print("| --- | --- | --- | --- | --- |")
    for name, (part, _, _) in cases.items():
        med, best = statistics.median(samples[name]), min(samples[name])
        floor = floors[part] / (copy_tbps * 1e12) * 1e6
        print(f"| {name} | {med:.1f} | {best:.1f} | {floor:.1f} | {100 * floor / med:.0f} |")


if __name__ == "__main__":
    main()
