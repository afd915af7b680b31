#!/usr/bin/env python3
"""cufa's forward kernel and SDPA cuDNN's on the same shapes under ncu, side by side: one
launch each (the third), a few counters that tell where the cycles go. Clocks are as ncu
sets them, so cycles and ratios compare; durations do not compare with bench_fwd.py.

    python3 bench/profile/ncu_compare.py --shapes 64:512:1,256:512:1,128:512:0 [--out DIR]
    python3 bench/profile/ncu_compare.py --backward --shapes 128:4096:0  # dq, dk/dv, cuDNN's

A shape is d:N:causal; 16k tokens a batch (B = 16384 / N) and H = 2048 / d, as bench_fwd.py.
"""
import argparse
import csv
import io
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
METRICS = {  # label: ncu metric
    "us": "gpu__time_duration.sum",
    "cycles": "sm__cycles_elapsed.max",
    "instr (M)": "smsp__inst_executed.sum",
    "tensor %": ("sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
                 "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
                 "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"),
    "issue %": "sm__inst_issued.avg.pct_of_peak_sustained_active",
    "cyc/issue": "smsp__average_warp_latency_per_inst_issued.ratio",
    "eligible": "smsp__warps_eligible.avg.per_cycle_active",
    "DRAM MB": "dram__bytes.sum",
    "MUFU (M)": "smsp__inst_executed_pipe_xu.sum",
    "regs": "launch__registers_per_thread",
    "smem KB": "launch__shared_mem_per_block_dynamic",
    "grid": "launch__grid_size",
    "L1/smem %": "l1tex__throughput.avg.pct_of_peak_sustained_active",
}
# stall reasons, cycles a warp spends in each per issued instruction
STALLS = ("wait", "barrier", "long_scoreboard", "short_scoreboard", "math_pipe_throttle",
          "mio_throttle", "dispatch_stall", "selected", "not_selected", "sleeping", "no_instruction",
          "branch_resolving", "lg_throttle", "membar", "tex_throttle", "drain", "misc")


def stall_metric(reason):
    return f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio"


def known_metrics():
    """The base names of the metrics this GPU's ncu has (a name it lacks fails the run)."""
    text = subprocess.run(["ncu", "--query-metrics"], capture_output=True, text=True).stdout
    names = {line.split()[0] for line in text.splitlines() if line.strip() and "__" in line.split()[0]}
    return names | {m + ".ratio" for m in names}  # (stall ratios are listed without it)


def pick(known):
    """METRICS with each entry's first candidate that ncu knows (None where none)."""
    picked = {}
    for label, names in METRICS.items():
        names = (names,) if isinstance(names, str) else names
        picked[label] = next((m for m in names
                              if m.startswith("launch__") or m.split(".")[0] in known), None)
    return picked


def profile(shape, peer, metrics, known, kernel=None, backward=False):
    """kernel: the name's regex (default: the forward's, ours or cuDNN's)."""
    d, n, causal = shape.split(":")
    kernel = kernel or ("fprop|cudnn" if peer else "fwd_sm90")
    cmd = ["ncu", "--csv", "--page", "raw", "--launch-skip", "2", "--launch-count", "1",
           "--kernel-name", "regex:" + kernel,
           "--metrics", ",".join([m for m in metrics.values() if m] + [
               stall_metric(s) for s in STALLS if stall_metric(s) in known]),
           sys.executable, os.path.join(HERE, "profile_one.py"), "--d", d, "--n", n]
    cmd += ["--causal"] if causal == "1" else []
    cmd += ["--peer", "cudnn"] if peer else []
    cmd += ["--backward"] if backward else []
    run = subprocess.run(cmd, capture_output=True, text=True)
    rows = [r for r in csv.reader(io.StringIO(run.stdout[run.stdout.find('"ID"'):])) if r]
    if len(rows) < 3:
        raise SystemExit(f"ncu gave no kernel for {shape} {peer}:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    head, units, values = rows[0], rows[1], rows[2]
    got, unit = dict(zip(head, values)), dict(zip(head, units))
    to_base = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1, "us": 1, "msecond": 1e3, "ms": 1e3,
               "byte": 1, "Kbyte": 1e3,
               "Mbyte": 1e6, "Gbyte": 1e9}  # -> microseconds, bytes

    def num(metric):
        if metric is None:
            return float("nan")
        try:
            return float(got[metric].replace(",", "")) * to_base.get(unit.get(metric), 1)
        except (KeyError, ValueError):
            return float("nan")
    out = {label: num(m) for label, m in metrics.items()}
    out["instr (M)"] /= 1e6
    out["MUFU (M)"] /= 1e6
    out["DRAM MB"] /= 1e6
    out["smem KB"] /= 1024
    out["stalls"] = {s: num(stall_metric(s)) for s in STALLS}
    out["kernel"] = got.get("Kernel Name", "?")[:60]
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="64:512:1,256:512:1,128:512:0")
    parser.add_argument("--out", help="also write the table here (ncu_compare.md)")
    parser.add_argument("--backward", action="store_true",
                        help="the backward's kernels: cufa's dq and dk/dv, cuDNN's bprop")
    args = parser.parse_args()
    known = known_metrics()
    metrics = pick(known)
    print("metrics:", metrics, flush=True)
    lines = []
    for shape in args.shapes.split(","):
        if args.backward:
            cols = {"cufa dq": profile(shape, False, metrics, known, "bwd_dq", True),
                    "cufa dk/dv": profile(shape, False, metrics, known, "bwd_dkdv", True),
                    "cuDNN": profile(shape, True, metrics, known, "bprop|dgrad", True)}
        else:
            cols = {"cufa": profile(shape, False, metrics, known),
                    "cuDNN": profile(shape, True, metrics, known)}
        names = list(cols)
        lines.append(f"\n### d:N:causal {shape}  ("
                     + "; ".join(f"{n}: {c['kernel']}" for n, c in cols.items()) + ")")
        lines.append("| counter | " + " | ".join(names) + f" | {names[0]} / {names[-1]} |")
        lines.append("|" + " --- |" * (len(names) + 2))
        for label in METRICS:
            vals = [cols[n][label] for n in names]
            ratio = vals[0] / vals[-1] if vals[-1] else float("nan")
            lines.append(f"| {label} | " + " | ".join(f"{x:.4g}" for x in vals)
                         + f" | {ratio:.3f} |")
        lines.append("| stalls a issued instruction: |" + " |" * (len(names) + 1))
        for s in STALLS:
            vals = [cols[n]["stalls"][s] for n in names]
            if max(vals) >= 0.05:
                lines.append(f"| {s} | " + " | ".join(f"{x:.2f}" for x in vals)
                             + f" | {vals[0] - vals[-1]:+.2f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "ncu_compare.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
