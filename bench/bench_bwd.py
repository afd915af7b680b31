#!/usr/bin/env python3
"""The backward pass: cufa.flash_attn_backward against PyTorch SDPA's flash and cuDNN
backends' backward, and FlashAttention-4's where flash_attn.cute imports (its column says
why not otherwise: bench/fa4.sh), in one run.

    python3 bench/bench_bwd.py [--out DIR] [--reps 12] [--dtypes bf16] [--head-dims 64,128]
        [--seqlens 1024,4096] [--causal 0,1] [--no-peers] [--fused-dq] [--no-producer] [--mma-sync] [--one-warpgroup]
        [--tiles SPEC]...
        [--with-forward] [--full]

16k tokens a batch (batch = 16384 / seqlen), heads = 2048 / d, GQA off. Each row times the
backward alone: cufa's three launches from the forward's out and lse, a peer's
torch.autograd.grad of its own SDPA output (its forward outside the timing). TFLOP/s at
the backward's 2.5 x the forward's 4 * B * H * N^2 * d (halved for causal), the count
FlashAttention reports. Queued CUDA-event timing, implementations in interleaved rounds in
random order, the median of --reps calls each (bench/_timing.py). --with-forward adds a
second table: the forward and the backward together, as a training step runs attention
(TFLOP/s at 3.5 x). Writes DIR/bench_bwd.{json,md,png}.
"""
import argparse
import json
import os
import re
import statistics
import sys

import _timing as T  # this script's folder is on sys.path
from bench_fwd import load_fa4

ROUNDS = 4
TOKENS = 16384
# the columns beside cufa's default: each a kernel choice's environment variable and value
OPTIONS = {"cufa fused dq": {"CUFA_BWD_FUSED_DQ": "1"}, "cufa mma.sync": {"CUFA_BWD_SM90": "0"},
           "cufa 1 warpgroup": {"CUFA_BWD_SM90_TILES": "dq=64x64,kv=64x64"},
           "cufa no producer": {"CUFA_BWD_SM90_PRODUCER": "0"}}
STEP = "fwd+bwd"  # the suffix of the forward + backward timings' names


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--reps", type=int, default=12, help="timed calls per implementation and row")
    p.add_argument("--dtypes", type=T.dtype_list, default=("bf16",))
    p.add_argument("--head-dims", type=T.int_list, default=[64, 128])
    p.add_argument("--seqlens", type=T.int_list, default=[1024, 4096])
    p.add_argument("--causal", type=T.int_list, default=[0, 1])
    p.add_argument("--no-peers", action="store_true")
    p.add_argument("--full", action="store_true",
                   help="the whole grid: fp16 and bf16, d = 64, 128, 256, N = 512 to 16k "
                        "(overrides --dtypes, --head-dims and --seqlens)")
    p.add_argument("--fused-dq", action="store_true",
                   help="also time cufa with dq fused into the dk/dv kernel (CUFA_BWD_FUSED_DQ), "
                        "the 'cufa fused dq' column")
    p.add_argument("--no-producer", action="store_true",
                   help="also time cufa with Hopper's dq and dk/dv kernels at d = 128 without "
                        "their producer warpgroup (CUFA_BWD_SM90_PRODUCER=0), the "
                        "'cufa no producer' column")
    p.add_argument("--with-forward", action="store_true",
                   help="also time the forward and backward together (a training step's "
                        "attention), a second table")
    p.add_argument("--one-warpgroup", action="store_true",
                   help="also time cufa with Hopper's dq and dk/dv kernels on one warpgroup, "
                        "64 rows and 64 keys a CTA (CUFA_BWD_SM90_TILES=dq=64x64,kv=64x64),"
                        " the 'cufa 1 warpgroup' column")
    p.add_argument("--kernels", action="store_true",
                   help="also profile one backward of cufa and of SDPA cuDNN a row "
                        "(torch.profiler): each kernel's time, a third table")
    p.add_argument("--tiles", action="append", default=[], metavar="SPEC",
                   help="also time cufa with the wgmma kernels' tiles SPEC (CUFA_BWD_SM90_TILES,"
                        " e.g. 'kv=64x128'), a 'cufa SPEC' column; may be given again")
    p.add_argument("--mma-sync", action="store_true",
                   help="also time cufa on the mma.sync kernels where Hopper takes wgmma "
                        "(CUFA_BWD_SM90=0), the 'cufa mma.sync' column")
    args = p.parse_args(argv)
    if args.full:
        args.dtypes, args.head_dims = ("fp16", "bf16"), [64, 128, 256]
        args.seqlens = [512, 1024, 2048, 4096, 8192, 16384]
    return args


def main(argv=None):
    args = parse_args(argv)
    torch = T.require_torch_cuda("bench_bwd.py")
    cufa = T.load_cufa()
    from cufa import _compile
    from torch.nn.attention import SDPBackend, sdpa_kernel
    F = torch.nn.functional
    peers = {} if args.no_peers else {"SDPA flash": SDPBackend.FLASH_ATTENTION,
                                      "SDPA cuDNN": SDPBackend.CUDNN_ATTENTION}
    fa4 = None if args.no_peers else load_fa4()  # FlashAttention-4, or why it is not there
    options = [name for name, wanted in (("cufa fused dq", args.fused_dq),
                                         ("cufa no producer", args.no_producer),
                                         ("cufa mma.sync", args.mma_sync),
                                         ("cufa 1 warpgroup", args.one_warpgroup)) if wanted]
    for spec in args.tiles:
        OPTIONS[f"cufa {spec}"] = {"CUFA_BWD_SM90_TILES": spec}
        options.append(f"cufa {spec}")
    from_environment = {env: _compile._overrides.get(env)
                        for values in OPTIONS.values() for env in values}
    rows = []
    cases = [(dt, d, n, c) for dt in args.dtypes for d in args.head_dims for n in args.seqlens
             for c in args.causal]
    for i, (dtype_name, d, n, causal) in enumerate(cases):
        T.progress(i, len(cases), f"{dtype_name} d={d} N={n} causal={causal}")
        dtype_name = T.TORCH_DTYPES[dtype_name]
        dtype = getattr(torch, dtype_name)
        b, h = max(1, TOKENS // n), 2048 // d
        q, k, v, dout = (torch.randn(b, n, h, d, device="cuda", dtype=dtype) for _ in range(4))
        out, lse = cufa.flash_attn_func(q, k, v, causal=bool(causal), return_lse=True)

        def choose(option=None):  # option: one of OPTIONS' {variable: value}, or the default
            # (the default: the environment's own values, so that e.g. CUFA_BWD_SM90=all
            # given to the script reaches the cufa column)
            for env in {env for values in OPTIONS.values() for env in values}:
                _compile._overrides[env] = (option or {}).get(env, from_environment[env])

        def backward(option=None):
            choose(option)
            return cufa.flash_attn_backward(dout, q, k, v, out, lse, causal=bool(causal))
        timers = {"cufa": lambda reps: T.time_events(torch, backward, [()], reps)}
        for name in options:
            timers[name] = lambda reps, env=OPTIONS[name]: T.time_events(
                torch, lambda: backward(env), [()], reps)
        qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
        for name, backend in peers.items():
            def peer_timer(reps, backend=backend):
                with sdpa_kernel(backend):
                    o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=bool(causal))
                    g = dout.transpose(1, 2)
                    return T.time_events(torch, lambda: torch.autograd.grad(
                        o, (qt, kt, vt), g, retain_graph=True), [()], reps)
            timers[name] = peer_timer
        if fa4 is not None:
            def fa4_timer(reps):
                if isinstance(fa4, str):
                    raise RuntimeError(fa4)
                qf, kf, vf = (x.detach().requires_grad_() for x in (q, k, v))
                o = fa4(qf, kf, vf, causal=bool(causal))
                o = o[0] if isinstance(o, tuple) else o  # ((out, lse) in the releases seen)
                return T.time_events(torch, lambda: torch.autograd.grad(
                    o, (qf, kf, vf), dout, retain_graph=True), [()], reps)
            timers["FA4"] = fa4_timer
        if args.with_forward:  # a training step's attention: the forward, then the backward
            qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

            def step(option=None):
                choose(option)
                o = cufa.flash_attn_func(qg, kg, vg, causal=bool(causal))
                return torch.autograd.grad(o, (qg, kg, vg), dout)
            for name in ["cufa"] + options:
                timers[f"{name} {STEP}"] = lambda reps, env=OPTIONS.get(name): T.time_events(
                    torch, lambda: step(env), [()], reps)
            for name, backend in peers.items():
                def peer_step(reps, backend=backend):
                    def once():
                        with sdpa_kernel(backend):
                            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=bool(causal))
                            return torch.autograd.grad(o, (qt, kt, vt), dout.transpose(1, 2))
                    return T.time_events(torch, once, [()], reps)
                timers[f"{name} {STEP}"] = peer_step
        timed = T.run_rounds(timers, max(1, -(-args.reps // ROUNDS)), rounds=ROUNDS)
        choose()
        kernels = {}
        if args.kernels:
            try:
                kernels["cufa"] = kernel_times(torch, backward)
                if "SDPA cuDNN" in peers:
                    with sdpa_kernel(peers["SDPA cuDNN"]):
                        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=bool(causal))
                        kernels["SDPA cuDNN"] = kernel_times(torch, lambda: torch.autograd.grad(
                            o, (qt, kt, vt), dout.transpose(1, 2), retain_graph=True))
            except Exception as e:  # (a profiler that fails leaves the timings)
                print(f"--kernels: {type(e).__name__}: {e}", file=sys.stderr)
        flops = T.attention_flops(b, h, n, n, d, bool(causal))
        row = dict(dtype=dtype_name, head_dim=d, seqlen=n, batch=b, nheads=h,
                   causal=bool(causal), impls={}, kernels=kernels)
        for name, ms in timed.items():
            if isinstance(ms, dict):
                row["impls"][name] = ms
            else:
                med = statistics.median(ms)
                # (the backward: 2.5 x the forward's FLOPs; forward and backward: 3.5 x)
                row["impls"][name] = dict(ms=med, tflops=T.tflops(
                    (3.5 if name.endswith(STEP) else 2.5) * flops, med))
        rows.append(row)
    T.progress(len(cases), len(cases), "done")
    names = ["cufa"] + options + list(peers) + (["FA4"] if fa4 is not None else [])
    report = render(rows, names, torch.cuda.get_device_name(), args.with_forward)
    print(report)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_bwd.md"), "w") as f:
        f.write(report + "\n")
    with open(os.path.join(args.out, "bench_bwd.json"), "w") as f:
        json.dump({"meta": T.versions(torch), "rows": rows}, f, indent=1)
    plot(rows, names, torch.cuda.get_device_name(), os.path.join(args.out, "bench_bwd.png"))


def render(rows, names, device, with_forward=False):
    """The Markdown: the backward's table, and with_forward the forward + backward one; ms
    (TFLOP/s) a cell, and cufa's time against the best peer's."""
    head = (f"Backward pass, {device}: ms (TFLOP/s at 2.5 x the forward's FLOPs); {TOKENS} "
            "tokens a batch, heads = 2048 / d; the backward alone (the forward outside the "
            "timing)")
    text = _table(rows, names, head, "")
    reasons = {}
    for r in rows:
        for name, v in r["impls"].items():
            if "na" in v:
                reasons.setdefault(name, v["na"])
    if reasons:
        text += "\n\nn/a:\n" + "\n".join(f"- {n}: {why}" for n, why in reasons.items())
    if with_forward:
        head = (f"Forward + backward (a training step's attention), {device}: ms (TFLOP/s at "
                "3.5 x the forward's FLOPs); the forward with inputs that require grad, then "
                "torch.autograd.grad")
        text += "\n\n" + _table(rows, names, head, f" {STEP}")
    kernels = render_kernels(rows)
    return text + ("\n\n" + kernels if kernels else "")


def kernel_times(torch, fn, calls=3):
    """{kernel name: µs a call} of fn's GPU kernels (torch.profiler, `calls` calls after
    one unprofiled); cufa's by their template's name, others' cut to 60 characters."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None)
        if us is None:
            us = getattr(e, "cuda_time_total", 0)
        if us and getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type):
            name = kernel_label(e.key)
            times[name] = times.get(name, 0.0) + us / calls
    return times


def kernel_label(name):
    """cufa's kernels by their template's name ('void cufa::bwd_dq_sm90_kernel<1, ...>(...)'
    -> 'bwd_dq_sm90_kernel'), others cut to 60 characters."""
    m = re.search(r"cufa::(\w+)", name)
    return m.group(1) if m else name[:60]


def render_kernels(rows):
    """The third table: each row's kernels, µs a call, largest first, by implementation."""
    lines = ["Kernels of one backward (torch.profiler; µs a call)", "",
             "| dtype | d | N | causal | implementation | kernels |", "|" + " --- |" * 6]
    for r in rows:
        for impl, times in r.get("kernels", {}).items():
            cells = ", ".join(f"{name} {us:.0f}" for name, us in
                              sorted(times.items(), key=lambda kv: -kv[1]))
            lines.append(f"| {r['dtype']} | {r['head_dim']} | {r['seqlen']} | {r['causal']} | "
                         f"{impl} | {cells} (sum {sum(times.values()):.0f}) |")
    return "\n".join(lines) if len(lines) > 4 else ""


def _table(rows, names, head, suffix):
    lines = [head, "", "| dtype | d | N | causal | " + " | ".join(names)
             + " | cufa / best peer (time) |", "|" + " --- |" * (5 + len(names))]
    for r in rows:
        cells, peer_ms = [], []
        for name in names:
            v = r["impls"].get(name + suffix, {})
            cells.append(f"{v['ms']:.3f} ({v['tflops']:.0f})" if "ms" in v else "n/a")
            if not name.startswith("cufa") and "ms" in v:
                peer_ms.append(v["ms"])
        mine = r["impls"].get("cufa" + suffix, {})
        ratio = f"{min(peer_ms) / mine['ms']:.2f}" if peer_ms and "ms" in mine else "-"
        lines.append(f"| {r['dtype']} | {r['head_dim']} | {r['seqlen']} | {r['causal']} | "
                     + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


def plot(rows, names, device, path):
    """TFLOP/s of the backward, one line an implementation over the rows; nothing without
    matplotlib."""
    plt = T.pyplot()
    if plt is None:
        return
    labels = [f"{r['dtype'][:4]} d{r['head_dim']} N{r['seqlen']}{' c' if r['causal'] else ''}"
              for r in rows]
    fig, ax = plt.subplots(figsize=(min(24, max(6, 0.4 * len(rows) + 2)), 4))
    for name in names:
        ax.plot(range(len(rows)), [r["impls"].get(name, {}).get("tflops") for r in rows],
                marker="o", lw=1, label=name)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("backward TFLOP/s")
    ax.set_title(f"Backward, {device}, {TOKENS} tokens a batch")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
