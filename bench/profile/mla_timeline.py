"""Where an MLA decode launch spends its time, CTA by CTA: a build with CUFA_TRACE=1
(decode/decode_mla_sm90.cu's mla_trace) stamps each CTA's start, Q's arrival, its first P,
the end of its loop and of its stores, the producer's end, its key blocks and its SM on the
global timer; this reads them back after one call and splits a CTA's time into Q's wait
(start to Q in shared memory), the first block (Q to the first P), the loop (the first P to
the loop's end), the epilogue (the stores) and the launch's span, for each row given.

    python3 bench/profile/mla_timeline.py [--rows 128x1x1024,16x1x1024] [--tokens 1]
        [--splits 0] [--page 64] [--fp8]

A row is HEADSxBATCHxKEYS: bench_mla.py's shapes (bf16, one latent head, pages of --page in
random order, every cache full). Times of this build only (the stamps cost a few
instructions a CTA, and the build spills 8-128 bytes), one call after three that compile and
warm up; the first 4096 CTAs are stamped. The split's combine (a launch of its own) is not
in the span: bench_mla.py times the call.
"""
import argparse
import os
import re
import sys

import numpy as np

from _trace import traced_launch

HERE = os.path.dirname(os.path.abspath(__file__))
torch = cufa = None  # main() imports them, with the trace build asked for first

CTAS, FIELDS = 4096, 8  # (decode_mla_sm90.cu's kMlaTraceCtas, kMlaTraceFields)
START, Q_READY, FIRST_P, LOOP_END, WRITTEN, PRODUCER_END, BLOCKS, SM = range(8)


def rows_arg(text):
    """'128x1x1024,16x8x4096' -> [(128, 1, 1024), (16, 8, 4096)]."""
    return [tuple(int(x) for x in re.split("x", item.strip())) for item in text.split(",")
            if item.strip()]


def run(heads, batch, keys, tokens, splits, page, fp8):
    from cufa import reference
    rng = np.random.default_rng(0)
    table, pages = reference.paged_layout(batch, keys, page, rng, spare_pages=0)
    kw = dict(q=torch.randn(batch, tokens, heads, 64, device="cuda", dtype=torch.bfloat16),
              qv=torch.randn(batch, tokens, heads, 512, device="cuda", dtype=torch.bfloat16),
              k_cache=torch.randn(pages, page, 1, 64, device="cuda", dtype=torch.bfloat16),
              v_cache=torch.randn(pages, page, 1, 512, device="cuda", dtype=torch.bfloat16),
              cache_seqlens=torch.full((batch,), keys, dtype=torch.int32, device="cuda"),
              block_table=torch.from_numpy(table).cuda(), causal=True, num_splits=splits)
    if fp8:
        for name in ("k_cache", "v_cache"):
            kw[name] = kw[name].to(torch.float8_e4m3fn)
        kw["k_descale"] = kw["v_descale"] = torch.full((batch, 1), 1.0, device="cuda")
    for _ in range(3):  # compiles, warms up
        cufa.flash_attn_with_kvcache(**kw)
    torch.cuda.synchronize()
    key, table = traced_launch(lambda: cufa.flash_attn_with_kvcache(**kw), "decode_mla",
                               "cufa_mla_trace", (CTAS, FIELDS),
                               lambda t: int(t[:, START].max()) != 0, "MLA decode")
    return key, table.astype(np.int64)


def analyse(t):
    """Medians over the CTAs with key blocks (us) and the launch's span; the first block
    counts Q's wait apart."""
    t = t[t[:, START] > 0]
    worked = (t[:, BLOCKS] > 0) & (t[:, FIRST_P] > 0)
    t0 = t[:, START].min()
    start, q_ready, first_p, loop_end, written = (
        t[:, f] - t0 for f in (START, Q_READY, FIRST_P, LOOP_END, WRITTEN))
    span = np.max(np.maximum(written, np.where(t[:, PRODUCER_END] > 0,
                                               t[:, PRODUCER_END] - t0, written)))
    blocks = t[worked, BLOCKS]

    def med(x):
        return float(np.median(x[worked])) / 1e3 if worked.any() else float("nan")
    return {"ctas": len(t), "sms": len(np.unique(t[:, SM])), "span_us": span / 1e3,
            "blocks": float(np.median(blocks)) if len(blocks) else 0.0,
            "start_spread_us": float(np.ptp(start)) / 1e3,
            "q_us": med(q_ready - start), "first_block_us": med(first_p - q_ready),
            "loop_us": med(loop_end - first_p), "epilogue_us": med(written - loop_end)}


def main():
    global torch, cufa
    os.environ["CUFA_TRACE"] = "1"  # (read when cufa is imported)
    sys.path.insert(0, os.path.dirname(HERE))  # bench/
    import _timing  # noqa: F401  (finds the checkout's cufa when none is on the path)
    import torch
    import cufa
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=rows_arg, default=rows_arg("128x1x1024,16x1x1024,128x128x8192"))
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--splits", type=int, default=0, help="num_splits (0: the planner's)")
    p.add_argument("--page", type=int, default=64)
    p.add_argument("--fp8", action="store_true")
    args = p.parse_args()
    print("row | variant | CTAs on SMs | span us | key blocks a CTA | medians a CTA, us: "
          "Q's wait, first block, loop, epilogue | starts spread over us")
    for heads, batch, keys in args.rows:
        key, table = run(heads, batch, keys, args.tokens, args.splits, args.page, args.fp8)
        a = analyse(table)
        print(f"{heads} heads B={batch} N={keys} sq={args.tokens} | {key} | {a['ctas']} on "
              f"{a['sms']} | {a['span_us']:.1f} | {a['blocks']:.0f} | {a['q_us']:.2f} "
              f"{a['first_block_us']:.2f} {a['loop_us']:.2f} {a['epilogue_us']:.2f} | "
              f"{a['start_spread_us']:.2f}", flush=True)


if __name__ == "__main__":
    main()
