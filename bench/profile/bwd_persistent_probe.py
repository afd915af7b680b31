"""The d = 64 backward on the persistent dk/dv kernel (CUFA_BWD_PERSISTENT=1) against a CTA
a key block (=0), interleaved rounds, bench_bwd.py's shapes (16k tokens a batch, heads =
2048 / d): where the persistent kernel's rule (_compile.bwd_persistent_wanted) should
stand, after a change to either kernel.
    PYTHONPATH=$PWD python3 bench/profile/bwd_persistent_probe.py [--seqlens 512,1024,4096]
"""
import argparse
import os
import statistics as st
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import _timing  # noqa: E402
import torch  # noqa: E402

import cufa  # noqa: E402
from cufa import api  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", type=_timing.int_list, default=[512, 1024, 2048, 4096, 16384])
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    d, heads = 64, 2048 // 64
    for n in args.seqlens:
        for causal in (False, True):
            batch = max(1, 16384 // n)
            flops = 2.5 * 4 * batch * heads * n * n * d / (2 if causal else 1)

            def make():
                q, k, v = (torch.randn(batch, n, heads, d, device="cuda", dtype=dtype)
                           for _ in range(3))
                out, lse = cufa.flash_attn_func(q, k, v, causal=causal, return_lse=True)
                return q, k, v, out, lse, torch.randn_like(out)
            sets = [make() for _ in range(_timing.rotating_sets(6 * batch * n * heads * d * 2))]

            def fn(q, k, v, out, lse, do):
                return cufa.flash_attn_backward(do, q, k, v, out, lse, causal=causal)
            times = {"0": [], "1": []}
            for r in range(args.rounds):
                for mode in (("0", "1") if r % 2 == 0 else ("1", "0")):
                    os.environ["CUFA_BWD_PERSISTENT"] = mode
                    api.clear_plans()  # (the plans read the variable again)
                    fn(*sets[0])
                    times[mode].append(st.median(_timing.time_events(torch, fn, sets, 12)))
            line = f"d=64 N={n} {'causal' if causal else 'full'}:"
            for mode, name in (("0", "a CTA a key block"), ("1", "persistent")):
                ms = st.median(times[mode])
                spread = (max(times[mode]) - min(times[mode])) / ms * 100
                line += f"  {name} {ms * 1e3:.0f} us ({spread:.1f} %) {flops / (ms * 1e9):.0f} TFLOP/s"
            line += f"  persistent / a block {st.median(times['1']) / st.median(times['0']):.3f}"
            print(line, flush=True)
    os.environ.pop("CUFA_BWD_PERSISTENT", None)
    api.clear_plans()


if __name__ == "__main__":
    main()
