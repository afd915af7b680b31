#!/usr/bin/env python3
"""SM clock, board power and TFLOP/s while one kernel runs back to back for 3 s: cufa
against SDPA's cuDNN backend on the same shapes (nvidia-smi sampled every 100 ms). At long
sequences both run at the board's power limit, where the clock, and so the speed, follow
the energy a FLOP costs (bench/NOTES.md, "Where the rest is").

    python3 bench/clock_probe.py
"""
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import cufa  # noqa: E402

SHAPES = [(128, 16384, 1, 16, False), (64, 16384, 1, 32, False), (128, 512, 32, 16, False)]


def sample(fn, seconds=3.0):
    """(calls a second, mean SM MHz, mean W, mean degrees C) while fn runs back to back."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                            "--format=csv,noheader,nounits", "-lms", "100"],
                           stdout=subprocess.PIPE, text=True)
    t0, calls = time.time(), 0
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    while time.time() - t0 < seconds:
        for _ in range(20):
            fn()
        calls += 20
        torch.cuda.synchronize()
    stop.record()
    torch.cuda.synchronize()
    smi.terminate()
    lines = smi.communicate()[0].strip().splitlines()[5:-2]  # skip the ramp at both ends
    values = [[float(x) for x in line.split(",")] for line in lines if line.count(",") == 2]
    means = [sum(c) / len(c) for c in zip(*values)] if values else [0.0, 0.0, 0.0]
    return (start.elapsed_time(stop) / calls, *means)


def main():
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for d, n, batch, heads, causal in SHAPES:
        q, k, v = (torch.randn(batch, n, heads, d, device="cuda", dtype=torch.float16)
                   for _ in range(3))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return sdpa(qt, kt, vt, is_causal=causal)

        flops = 4 * batch * heads * n * n * d / (2 if causal else 1)
        for name, fn in (("cufa", lambda: cufa.flash_attn_func(q, k, v, causal=causal)),
                         ("cuDNN", cudnn)):
            ms, mhz, watts, temp = sample(fn)
            print(f"d={d} N={n} causal={int(causal)} {name:5s} {flops / ms / 1e9:6.1f} TFLOP/s"
                  f"  SM {mhz:5.0f} MHz  {watts:4.0f} W  {temp:3.0f} C")


if __name__ == "__main__":
    main()
