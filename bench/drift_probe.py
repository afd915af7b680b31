#!/usr/bin/env python3
"""Does cufa's forward slow down over a lease while cuDNN's holds? (bench/NOTES.md: our
d = 128 2k row read 551-560 TFLOP/s in a lease's first processes and 451-493 after, cuDNN
536-544 throughout.) One process, one shape, cufa and SDPA's cuDNN backend alternating in
blocks of BLOCK_S for TOTAL_S, with nvidia-smi sampling the SM and memory clocks, power,
temperature and the clock event (throttle) reasons every 100 ms. Every REALLOC blocks the
inputs are allocated anew, to tell a placement effect from a thermal one. Prints a line a
block: time since start, implementation, TFLOP/s, the median of the samples inside it.
With long blocks (--block 3) it also gives each one's clock and power at a sustained load
(at long sequences both run at the board's power limit, where the clock, and so the speed,
follow the energy a FLOP costs; bench/NOTES.md, "Where the rest is").

    python3 bench/drift_probe.py [--shape 128:2048:0] [--total 60] [--block 0.5] [--realloc 10]
"""
import argparse
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FIELDS = ("clocks.sm,clocks.mem,power.draw,temperature.gpu,temperature.memory,"
          "clocks_event_reasons.active")


def sampler(samples, stop):
    """nvidia-smi's samples, (epoch s, values) every 100 ms, until stop is set."""
    fields = FIELDS
    probe = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True)
    if probe.returncode != 0:  # an older driver: the throttle reasons' old name
        fields = fields.replace("clocks_event_reasons", "clocks_throttle_reasons")
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits",
                            "-lms", "100"], stdout=subprocess.PIPE, text=True)
    for line in smi.stdout:
        samples.append((time.time(), [x.strip() for x in line.split(",")]))
        if stop.is_set():
            break
    smi.terminate()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="128:2048:0", help="d:N:causal, 16k tokens a batch")
    p.add_argument("--total", type=float, default=60.0)
    p.add_argument("--block", type=float, default=0.5)
    p.add_argument("--realloc", type=int, default=10)
    args = p.parse_args()
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cufa
    d, n, causal = (int(x) for x in args.shape.split(":"))
    causal = bool(causal)
    batch, heads = max(1, 16384 // n), 2048 // d
    flops = 4 * batch * heads * n * n * d / (2 if causal else 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def inputs():
        return [torch.randn(batch, n, heads, d, device="cuda", dtype=torch.float16)
                for _ in range(3)]

    q, k, v = inputs()
    impls = {
        "cufa": lambda: cufa.flash_attn_func(q, k, v, causal=causal),
        "cudnn": lambda: sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                              is_causal=causal),
    }
    samples, stop = [], threading.Event()
    thread = threading.Thread(target=sampler, args=(samples, stop), daemon=True)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        for fn in impls.values():
            fn()
        torch.cuda.synchronize()
        thread.start()
        time.sleep(0.5)
        began, block = time.time(), 0
        rows = []
        while time.time() - began < args.total:
            if args.realloc and block and block % args.realloc == 0:
                q, k, v = inputs()
            for name in (("cufa", "cudnn") if block % 2 == 0 else ("cudnn", "cufa")):
                fn = impls[name]
                t0 = time.time()
                calls, gpu_ms = 0, 0.0
                while time.time() - t0 < args.block:
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(5):
                        fn()
                    end.record()
                    end.synchronize()
                    gpu_ms += start.elapsed_time(end)
                    calls += 5
                rows.append((t0, time.time(), name, flops * calls / gpu_ms / 1e9, block))
            block += 1
        stop.set()
    thread.join(timeout=2)
    print(f"shape d={d} N={n} causal={causal}; fields {FIELDS}")
    print("   t(s)  block impl    TFLOP/s | median of samples inside")
    for t0, t1, name, tflops, blk in rows:
        inside = [v for t, v in samples if t0 <= t <= t1]
        med = []
        for i in range(len(FIELDS.split(","))):
            col = [c[i] for c in inside if len(c) > i]
            try:
                med.append(f"{statistics.median(float(x) for x in col):.0f}")
            except (ValueError, statistics.StatisticsError):
                med.append(",".join(sorted(set(col))) or "-")
        print(f"{t0 - began:7.1f} {blk:5d} {name:6s} {tflops:7.1f} | {' '.join(med)}")
    for name in impls:
        vals = [r[3] for r in rows if r[2] == name]
        third = max(1, len(vals) // 3)
        print(f"{name}: first third {statistics.median(vals[:third]):.1f}, "
              f"last third {statistics.median(vals[-third:]):.1f} TFLOP/s")


if __name__ == "__main__":
    main()
