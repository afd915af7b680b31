#!/usr/bin/env python3
"""Attention forward: cufa against PyTorch SDPA (flash, cuDNN) and JAX cuDNN, one run.

    python3 bench/bench_fwd.py --out DIR [--quick] [--dtypes fp16,bf16] [--head-dims 64,128,256]
        [--seqlens 512,1024,...] [--causal 0,1] [--reps 48] [--no-peers] [--no-plot]
        [--no-memory] [--list]

Shapes: 16,384 tokens per batch (batch = 16384 // N), heads = 2048 // headdim, plus one GQA
shape (d=128, N=4096, batch 4, 32 query / 8 kv heads). TFLOP/s = 4*B*H*N^2*d, halved for
causal. GPU-side implementations are timed with one pair of CUDA events per call, the calls
queued behind a spinning kernel so the host's cost stays hidden (`queue_ahead`), median of
--reps, rotating among input sets that together exceed the 50 MB L2. The calls of a row are
taken in 4 interleaved rounds (the implementations in a fresh random order each round, at
least 5 warm-up calls and 30 ms before each block), so a slow spell of the machine, or the
clocks left by the kernel before, fall on all of them rather than on whichever ran then. JAX is
host-timed (wall clock to block_until_ready). Then cufa and the SDPA peers one call at a
time (each call from an idle queue and waited for, wall clock: the host's cost counts, as
for a lone call), median of ALONE_CALLS, in the table's last column. Writes
DIR/bench_fwd.{json,md,png} and DIR/bench_fwd_bf16.png.
"""
import argparse
import datetime
import json
import math
import os
import random
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from functools import partial

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX would take 75% of the GPU
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this cufa

TOKENS, HIDDEN = 16384, 2048
SEQLENS, QUICK_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384), (1024, 4096, 16384)
GQA = dict(head_dim=128, seqlen=4096, batch=4, nheads=32, nheads_k=8)
WARMUP = 5
ROUNDS = 4   # interleaved rounds per row, each in a random order (see the docstring)
WARMUP_MS = 30  # at least this long of warm-up calls before each timed block
ALONE_CALLS = 12  # one-call-at-a-time samples per implementation and row
ALONE_IMPLS = ("cufa", "sdpa_flash", "sdpa_cudnn")
ROTATE_BYTES = 256 * 2**20      # q,k,v bytes cycled per timing loop: 5x the H100's 50 MB L2
MAX_SETS = 8
MEM_SEQLENS = (1024, 4096, 16384)
IMPLS = ("cufa", "sdpa_flash", "sdpa_cudnn", "jax_cudnn")
LABELS = {"cufa": "cufa", "sdpa_flash": "SDPA flash", "sdpa_cudnn": "SDPA cuDNN",
          "jax_cudnn": "JAX cuDNN*"}
TORCH_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}


@dataclass(frozen=True)
class Shape:
    dtype: str      # "fp16" | "bf16"
    head_dim: int
    seqlen: int
    batch: int
    nheads: int
    nheads_k: int

    @property
    def gqa(self):
        return self.nheads_k != self.nheads

    def flops(self, causal):
        full = 4 * self.batch * self.nheads * self.seqlen ** 2 * self.head_dim
        return full / 2 if causal else full

    def qkv_bytes(self):
        return self.batch * self.seqlen * (self.nheads + 2 * self.nheads_k) * self.head_dim * 2

    def sets(self):
        """Input sets to rotate: enough that no set is still in L2 when it comes round again."""
        return max(2, min(MAX_SETS, math.ceil(ROTATE_BYTES / self.qkv_bytes())))


# -- the sweep -------------------------------------------------------------------------------

def _ints(text):
    return tuple(int(x) for x in text.split(",") if x.strip())


def _dtype_list(text):
    """--dtypes: a comma list of fp16, bf16."""
    dtypes = tuple(d.strip() for d in text.split(",") if d.strip())
    bad = [d for d in dtypes if d not in TORCH_DTYPES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown {bad}; expected fp16 and/or bf16")
    return dtypes


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results", help="folder for bench_fwd.{json,md,png}")
    p.add_argument("--dtypes", type=_dtype_list, default="fp16,bf16",
                   help="comma list of fp16, bf16")
    p.add_argument("--head-dims", type=_ints, default=(64, 128, 256))
    p.add_argument("--seqlens", type=_ints, default=None, help=f"default {SEQLENS}")
    p.add_argument("--causal", type=_ints, default=(0, 1), help='"0", "1" or "0,1"')
    p.add_argument("--quick", action="store_true", help=f"seqlens {QUICK_SEQLENS} only")
    p.add_argument("--reps", type=int, default=48,
                   help="timed calls per case (median), split over the rounds")
    p.add_argument("--no-peers", action="store_true", help="time cufa only")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory table")
    p.add_argument("--list", action="store_true", help="print the cases and exit (no GPU)")
    args = p.parse_args(argv)
    if args.seqlens is None:
        args.seqlens = QUICK_SEQLENS if args.quick else SEQLENS
    elif args.quick:
        args.seqlens = tuple(n for n in args.seqlens if n in QUICK_SEQLENS)
    if any(n <= 0 or TOKENS % n for n in args.seqlens):
        p.error(f"--seqlens must divide {TOKENS}")
    if any(d <= 0 or d % 8 or d > 256 or HIDDEN % d for d in args.head_dims):
        p.error(f"--head-dims must be multiples of 8 up to 256 that divide {HIDDEN}")
    args.causal = tuple(bool(c) for c in args.causal)
    if args.reps < 1:
        p.error("--reps must be >= 1")
    return args


def sweep(args):
    """The shapes to time (each for every causal value), GQA last."""
    shapes = [Shape(dt, d, n, TOKENS // n, HIDDEN // d, HIDDEN // d)
              for dt in args.dtypes for d in args.head_dims for n in args.seqlens]
    if GQA["head_dim"] in args.head_dims and GQA["seqlen"] in args.seqlens:
        shapes += [Shape(dt, **GQA) for dt in args.dtypes]
    return shapes


def case_name(r):
    s = f"{r['dtype']} d={r['head_dim']} N={r['seqlen']} {'causal' if r['causal'] else 'full'}"
    return s + (f" GQA {r['nheads']}/{r['nheads_k']}" if r["nheads"] != r["nheads_k"] else "")


def progress(i, total, label, width=30):
    """A one-line bar on stderr, so stdout stays the report."""
    done = int(width * i / max(total, 1))
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{total} {label:<50}")
    sys.stderr.flush()


# -- timing ----------------------------------------------------------------------------------

def time_events(torch, fn, sets, reps):
    """ms of each of reps calls of fn, one CUDA event pair each, rotating sets. Warm-up:
    WARMUP calls and at least WARMUP_MS, since the GPU's clocks follow what ran before (the
    same calls right after a lighter kernel measured up to 10 % faster). The timed calls are
    issued behind a spinning kernel (queue_ahead), so the queue stays ahead of the GPU as
    inside a model and each event pair brackets this call's GPU work, even for a call whose
    host cost outlasts its kernels (there the queue would otherwise run dry and the pairs
    read the host); time_alone is the view where the host's cost counts."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    i = 0
    while i < WARMUP or (time.perf_counter() - start) * 1e3 < WARMUP_MS:
        fn(*sets[i % len(sets)])
        i += 1
        if i % 4 == 0:
            torch.cuda.synchronize()
    lead_ms = max(QUEUE_AHEAD_MS, 0.3 * reps)
    for _ in range(4):  # (a longer lead where issuing outlasted it: a slow spell of the host)
        torch.cuda.synchronize()
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                 for _ in range(reps)]
        queue_ahead(torch, lead_ms)
        issue_start = time.perf_counter()
        for i, (start, stop) in enumerate(pairs):
            args = sets[i % len(sets)]
            start.record()
            fn(*args)
            stop.record()
        issue_ms = (time.perf_counter() - issue_start) * 1e3
        torch.cuda.synchronize()
        if issue_ms < 0.8 * lead_ms:
            break
        lead_ms = 2 * issue_ms
    return [a.elapsed_time(b) for a, b in pairs]


QUEUE_AHEAD_MS = 2.0
_sleep_cycles_per_ms = None


def queue_ahead(torch, ms):
    """Queue a kernel that spins ~ms on one SM (torch.cuda._sleep), so the calls issued
    next wait in the queue behind it: their host cost is hidden, as behind a model's other
    layers. The spin rate is measured once."""
    global _sleep_cycles_per_ms
    if _sleep_cycles_per_ms is None:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        a.record()
        torch.cuda._sleep(2_000_000)
        b.record()
        torch.cuda.synchronize()
        _sleep_cycles_per_ms = 2_000_000 / max(a.elapsed_time(b), 1e-3)
    torch.cuda._sleep(int(ms * _sleep_cycles_per_ms))


def time_alone(torch, fn, sets, calls):
    """ms of each of `calls` calls of fn, each from an idle queue and waited for (wall
    clock from the call to the sync after it): the host's cost counts, as for a lone call
    in a server that waits for each step. Three calls first (plans, compiles)."""
    for i in range(3):
        fn(*sets[i % len(sets)])
    torch.cuda.synchronize()
    ms = []
    for i in range(calls):
        t0 = time.perf_counter()
        fn(*sets[i % len(sets)])
        torch.cuda.synchronize()  # (so the next call starts from an idle queue too)
        ms.append((time.perf_counter() - t0) * 1e3)
    return ms


def time_host(fn, sets, reps):
    """JAX: ms of each call, wall clock from dispatch to block_until_ready (includes launch
    latency)."""
    for i in range(WARMUP):
        fn(*sets[i % len(sets)]).block_until_ready()
    ms = []
    for i in range(reps):
        args = sets[(WARMUP + i) % len(sets)]
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        ms.append((time.perf_counter() - t0) * 1e3)
    return ms


def measure(timer, *timer_args):
    """The ms list of timer(*timer_args), or {'na': reason}; PyTorch's 'why not'
    warnings kept."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return timer(*timer_args)
        except Exception as e:  # unsupported shape, missing kernel, OOM: a reason, not a crash
            why = " | ".join([f"{type(e).__name__}: {e}"] + [str(w.message) for w in caught[:2]])
            return {"na": " ".join(why.split())[:400]}


def run_rounds(timers, per_round, rounds=ROUNDS):
    """Each timer (a function of a call count returning that many call times, or a string
    saying why there is none) in `rounds` rounds of per_round calls, the timers in a fresh
    random order each round (fixed seed): no implementation always follows the same one.
    -> {name: list of ms, or {'na': reason}}; a timer that fails runs no further rounds."""
    failed, samples = {}, {name: [] for name in timers}
    order = random.Random(0)
    for _ in range(rounds):
        for name in order.sample(list(timers), len(timers)):
            t = timers[name]
            if name in failed:      # not available, or failed in an earlier round
                continue
            got = {"na": t} if isinstance(t, str) else measure(t, per_round)
            if isinstance(got, dict):
                failed[name] = got
            else:
                samples[name] += got
    return {name: failed.get(name) or samples[name] for name in timers}


def summarize(ms, shape, causal):
    """{'ms' (median), 'ms_min', 'calls', 'tflops'} of a list of call times."""
    median = statistics.median(ms)
    return {"ms": median, "ms_min": min(ms), "calls": len(ms),
            "tflops": shape.flops(causal) / median / 1e9}


# -- implementations -------------------------------------------------------------------------

def load_impls(torch, no_peers, jax=True):
    """name -> module-ish handle, or a string saying why it is not available (JAX only
    with jax=True)."""
    impls = {}
    try:
        import cufa
        impls["cufa"] = cufa
    except Exception as e:
        impls["cufa"] = f"import cufa failed: {type(e).__name__}: {e}"
    if no_peers:
        return impls
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        impls["sdpa_flash"] = (sdpa_kernel, SDPBackend.FLASH_ATTENTION)
        impls["sdpa_cudnn"] = (sdpa_kernel, SDPBackend.CUDNN_ATTENTION)
    except (ImportError, AttributeError) as e:
        impls.setdefault("sdpa_flash", f"torch.nn.attention unavailable: {e}")
        impls.setdefault("sdpa_cudnn", f"torch.nn.attention unavailable: {e}")
    if not jax:
        return impls
    try:
        import jax
        gpus = jax.devices("gpu")
        impls["jax_cudnn"] = jax if gpus else "JAX sees no GPU"
    except ImportError as e:
        impls["jax_cudnn"] = f"JAX not installed ({e})"
    except Exception as e:  # jax without CUDA plugin raises RuntimeError on devices("gpu")
        impls["jax_cudnn"] = f"JAX has no GPU backend: {type(e).__name__}: {e}"
    return impls


def torch_inputs(torch, shape, gen):
    """shape.sets() random-normal (q, k, v) sets in (B, N, H, d) for cufa, and the same
    values contiguous in (B, H, N, d), the layout SDPA is documented and tuned for."""
    dt = getattr(torch, TORCH_DTYPES[shape.dtype])
    bnhd = [tuple(torch.randn(shape.batch, shape.seqlen, h, shape.head_dim, device="cuda",
                              dtype=dt, generator=gen)
                  for h in (shape.nheads, shape.nheads_k, shape.nheads_k))
            for _ in range(shape.sets())]
    bhnd = [tuple(x.transpose(1, 2).contiguous() for x in s) for s in bnhd]
    return bnhd, bhnd


def jax_inputs(jax, shape, rng):
    """Host numpy once per shape; each set is its own device buffer (L2 keys on addresses)."""
    import numpy as np
    dt = jax.numpy.float16 if shape.dtype == "fp16" else jax.numpy.bfloat16
    host = [rng.standard_normal((shape.batch, shape.seqlen, h, shape.head_dim),
                                dtype=np.float32).astype(dt)
            for h in (shape.nheads, shape.nheads_k, shape.nheads_k)]
    return [tuple(jax.device_put(x) for x in host) for _ in range(shape.sets())]


def sdpa_kwargs(causal, gqa):
    return {"is_causal": causal, **({"enable_gqa": True} if gqa else {})}


def time_shape(torch, impls, shape, causals, reps, gen, rng, jax_fns):
    """One row per causal value; all implementations on the same inputs, back to back."""
    bnhd, bhnd = torch_inputs(torch, shape, gen)
    jax_sets = []

    def time_jax(jax, causal, reps):
        if not jax_sets:        # built inside measure(), so a failure is a reason, not a crash
            jax_sets.extend(jax_inputs(jax, shape, rng))
        if causal not in jax_fns:
            jax_fns[causal] = jax.jit(partial(jax.nn.dot_product_attention, is_causal=causal,
                                              implementation="cudnn"))
        torch.cuda.synchronize()
        return time_host(jax_fns[causal], jax_sets, reps)

    def timer(name, impl, causal, time_calls=time_events):
        """A function of a call count returning that many call times (time_calls: queued,
        time_events; one at a time, time_alone), or a reason."""
        if isinstance(impl, str):
            return impl
        if name == "cufa":
            fn = partial(impl.flash_attn_func, causal=causal)
            return lambda n: time_calls(torch, fn, bnhd, n)
        if name.startswith("sdpa"):
            sdpa_kernel, backend = impl
            fn = partial(torch.nn.functional.scaled_dot_product_attention,
                         **sdpa_kwargs(causal, shape.gqa))

            def timed(n):
                with sdpa_kernel(backend):  # entered once, outside the timed calls
                    return time_calls(torch, fn, bhnd, n)
            return timed
        return lambda n: time_jax(impl, causal, n)

    per_round = -(-reps // ROUNDS)
    rows = []
    for causal in causals:
        row = dict(asdict(shape), causal=causal, gqa=shape.gqa, sets=shape.sets(),
                   gflop=shape.flops(causal) / 1e9)
        timed = run_rounds({name: timer(name, impl, causal) for name, impl in impls.items()},
                           per_round)
        row["impls"] = {name: got if isinstance(got, dict) else summarize(got, shape, causal)
                        for name, got in timed.items()}
        # one call at a time (host cost counts), after the queued rounds, in one round
        alone = run_rounds({name: timer(name, impls[name], causal, time_alone)
                            for name in ALONE_IMPLS if name in impls}, ALONE_CALLS, rounds=1)
        row["one_at_a_time_us"] = {name: None if isinstance(got, dict)
                                   else statistics.median(got) * 1e3
                                   for name, got in alone.items()}
        if "jax_cudnn" in row["impls"] and "na" not in row["impls"]["jax_cudnn"]:
            row["impls"]["jax_cudnn"]["timing"] = "host wall clock"
        diff = check_vs_flash(torch, impls, bnhd[0], bhnd[0], causal, shape)
        row["max_abs_diff_cufa_vs_flash"] = diff
        if diff is not None and not diff < 0.05:
            print(f"\nwarning: {case_name(row)}: cufa differs from SDPA flash by {diff:.3g}",
                  file=sys.stderr)
        add_ratios(row)
        rows.append(row)
    del bnhd, bhnd, jax_sets[:]
    torch.cuda.empty_cache()
    return rows


def check_vs_flash(torch, impls, qkv, qkv_bhnd, causal, shape):
    """A timing of a wrong kernel means nothing: cufa's output against SDPA flash's."""
    if isinstance(impls.get("cufa"), str) or not isinstance(impls.get("sdpa_flash"), tuple):
        return None
    sdpa_kernel, backend = impls["sdpa_flash"]
    try:
        out = impls["cufa"].flash_attn_func(*qkv, causal=causal)
        with sdpa_kernel(backend):
            ref = torch.nn.functional.scaled_dot_product_attention(
                *qkv_bhnd, **sdpa_kwargs(causal, shape.gqa))
        return float((out.float() - ref.transpose(1, 2).float()).abs().max())
    except Exception:  # flash n/a for this shape: nothing to compare against
        return None


def add_ratios(row):
    t = {k: v.get("tflops") for k, v in row["impls"].items()}
    for peer, key in (("sdpa_flash", "ratio_vs_flash"), ("sdpa_cudnn", "ratio_vs_cudnn")):
        row[key] = t["cufa"] / t[peer] if t.get("cufa") and t.get(peer) else None


# -- memory ----------------------------------------------------------------------------------

def peak_extra(torch, fn, *args):
    """Peak bytes allocated by one call on top of what was allocated before it (inputs)."""
    out = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    try:
        out = fn(*args)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    except torch.cuda.OutOfMemoryError:
        return "OOM"
    except Exception as e:
        return f"{type(e).__name__}: {e}"[:200]
    finally:
        del out                 # free it before the next measurement
        torch.cuda.empty_cache()


def memory_table(torch, impls, gen, seqlens=MEM_SEQLENS, b=1, h=16, d=128):
    """cufa's extra memory is O(N*d) (out + lse); PyTorch's math backend holds N^2 scores."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def rnd(n):
        return torch.randn(b, n, h, d, device="cuda", dtype=torch.float16, generator=gen)

    cufa = None if isinstance(impls.get("cufa"), str) else impls["cufa"]
    with sdpa_kernel(SDPBackend.MATH):  # a first small call creates cuBLAS's workspace,
        small = [rnd(128).transpose(1, 2) for _ in range(3)]  # so it is not counted below
        sdpa(*small)
        if cufa:
            cufa.flash_attn_func(*(x.transpose(1, 2) for x in small))  # compiles the variant
    rows = []
    for n in seqlens:
        q, k, v = (rnd(n) for _ in range(3))
        row = dict(seqlen=n, batch=b, nheads=h, head_dim=d,
                   expected_bytes=b * n * h * d * 2 + b * h * n * 4,
                   cufa_bytes=peak_extra(torch, cufa.flash_attn_func, q, k, v) if cufa else None)
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        del q, k, v
        with sdpa_kernel(SDPBackend.MATH):
            row["math_bytes"] = peak_extra(torch, sdpa, qt, kt, vt)
        del qt, kt, vt
        rows.append(row)
    return rows


# -- report ----------------------------------------------------------------------------------

def _fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def markdown(rows, names):
    head = ["dtype", "d", "causal", "N", "B x H/Hkv"] + [LABELS[n] for n in names] \
        + ["cufa/flash", "cufa/cuDNN", "one at a time: cufa / flash / cuDNN us"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        cells = [r["dtype"], r["head_dim"], "yes" if r["causal"] else "no", r["seqlen"],
                 f"{r['batch']} x {r['nheads']}/{r['nheads_k']}"]
        cells += [_fmt(r["impls"].get(n, {}).get("tflops"), ".0f") for n in names]
        cells += [_fmt(r.get("ratio_vs_flash"), ".2f"), _fmt(r.get("ratio_vs_cudnn"), ".2f")]
        single = r.get("one_at_a_time_us", {})
        cells.append(" / ".join(_fmt(single.get(n), ".0f") for n in ALONE_IMPLS))
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def alone_summary(rows):
    """The one-call-at-a-time view in a line: cuDNN's time over cufa's (>= 1: cufa is
    faster) over the rows with both."""
    ratios = sorted(r["one_at_a_time_us"]["sdpa_cudnn"] / r["one_at_a_time_us"]["cufa"]
                    for r in rows if r.get("one_at_a_time_us", {}).get("cufa")
                    and r["one_at_a_time_us"].get("sdpa_cudnn"))
    if not ratios:
        return "one call at a time: no row has both cufa and SDPA cuDNN"
    return (f"one call at a time (each call from an idle queue, waited for; host cost "
            f"counts), SDPA cuDNN's time over cufa's over {len(ratios)} rows: "
            f"{ratios[0]:.2f}-{ratios[-1]:.2f}, median {statistics.median(ratios):.2f}; "
            f"cufa as fast or faster on {sum(x >= 1 for x in ratios)}")


def summary(rows):
    ratios = [(r["ratio_vs_flash"], r) for r in rows if r.get("ratio_vs_flash") is not None]
    if not ratios:
        return {"min_ratio_vs_flash": None, "all_ge_1": None, "rows_compared": 0}, \
            "cufa/SDPA-flash: no row has both numbers"
    lo, worst = min(ratios, key=lambda t: t[0])
    ok = all(x >= 1.0 for x, _ in ratios)
    missing = len(rows) - len(ratios)
    line = (f"min cufa/SDPA-flash over {len(ratios)} rows: {lo:.2f}x ({case_name(worst)}); "
            f"cufa >= 1.0x flash on every row: {'yes' if ok else 'NO'}"
            + (f" ({missing} rows without both numbers)" if missing else ""))
    return {"min_ratio_vs_flash": lo, "worst_case": case_name(worst), "all_ge_1": ok,
            "rows_compared": len(ratios)}, line


def memory_markdown(mem):
    def mb(x):  # bytes, None (not measured) or a reason such as "OOM"
        return x if isinstance(x, str) else _fmt(None if x is None else x / 2**20, ".1f")

    lines = ["| fp16 d=128, B=1, H=16, N | out+lse O(N*d) MiB | cufa peak extra MiB | "
             "cufa/expected | math peak extra MiB |", "|" + " --- |" * 5]
    for r in mem:
        c = r["cufa_bytes"]
        ratio = _fmt(c / r["expected_bytes"] if isinstance(c, int) else None, ".2f")
        lines.append(f"| {r['seqlen']} | {mb(r['expected_bytes'])} | {mb(c)} | {ratio} | "
                     f"{mb(r['math_bytes'])} |")
    return "\n".join(lines)


def plot(rows, names, out_dir, device):
    """TFLOP/s against N, one line per implementation, a panel per (head dim, causal)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"plot skipped: matplotlib not installed ({e})", file=sys.stderr)
        return []
    written = []
    for dtype, fname in (("fp16", "bench_fwd.png"), ("bf16", "bench_fwd_bf16.png")):
        rs = [r for r in rows if r["dtype"] == dtype and not r["gqa"]]  # GQA: table only
        if not rs:
            continue
        dims, causals = sorted({r["head_dim"] for r in rs}), sorted({r["causal"] for r in rs})
        fig, axes = plt.subplots(len(dims), len(causals), squeeze=False, sharex=True,
                                 figsize=(5.5 * len(causals), 3.2 * len(dims)))
        for i, d in enumerate(dims):
            for j, c in enumerate(causals):
                ax = axes[i][j]
                for n in names:
                    pts = sorted((r["seqlen"], r["impls"][n]["tflops"]) for r in rs
                                 if r["head_dim"] == d and r["causal"] == c
                                 and "tflops" in r["impls"].get(n, {}))
                    if pts:
                        ax.plot(*zip(*pts), marker="o", label=LABELS[n])
                ns = sorted({r["seqlen"] for r in rs})
                ax.set_xscale("log", base=2)
                ax.set_xticks(ns)
                ax.set_xticklabels([str(x) for x in ns])
                ax.set_ylim(bottom=0)
                ax.grid(alpha=0.3)
                ax.set_title(f"d={d}, {'causal' if c else 'non-causal'}", fontsize=10)
                ax.set_ylabel("TFLOP/s")
                if i == len(dims) - 1:
                    ax.set_xlabel("seqlen N (16k tokens per batch)")
                if i == 0 and j == 0:
                    ax.legend(fontsize=8)
        fig.suptitle(f"attention forward {dtype}, {device} (* host-timed)")
        fig.tight_layout()
        path = os.path.join(out_dir, fname)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def versions(torch):
    v = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
         "cudnn": torch.backends.cudnn.version()}
    for mod in ("cupy", "jax", "cufa"):
        m = sys.modules.get(mod)
        v[mod] = getattr(m, "__version__", None) if m else None
    return v


# -- main ------------------------------------------------------------------------------------

def require_torch_cuda(script="bench_fwd"):
    try:
        import torch
    except ImportError as e:
        sys.exit(f"{script}: PyTorch is required ({e}); run on the GPU machine")
    if not torch.cuda.is_available():
        sys.exit(f"{script}: torch.cuda.is_available() is False: no usable CUDA device")
    return torch


def main(argv=None):
    args = parse_args(argv)
    shapes = sweep(args)
    cases = [(s, c) for s in shapes for c in args.causal]
    if args.list:
        for s, c in cases:
            print(case_name(dict(asdict(s), causal=c)), f"B={s.batch} sets={s.sets()}")
        print(f"{len(cases)} cases")
        return 0
    if args.reps < 20:
        print(f"warning: --reps {args.reps} < 20; medians will be noisy", file=sys.stderr)
    torch = require_torch_cuda()
    import numpy as np
    os.makedirs(args.out, exist_ok=True)
    impls = load_impls(torch, args.no_peers)
    names = [n for n in IMPLS if n in impls]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rng, jax_fns, rows = np.random.default_rng(0), {}, []
    for s in shapes:
        progress(len(rows), len(cases), case_name(dict(asdict(s), causal=args.causal[0])))
        rows += time_shape(torch, impls, s, args.causal, args.reps, gen, rng, jax_fns)
    progress(len(rows), len(cases), "done")
    sys.stderr.write("\n")
    mem = []
    if not args.no_memory:
        try:
            mem = memory_table(torch, impls, gen)
        except Exception as e:  # e.g. a torch without torch.nn.attention: keep the timings
            print(f"memory table skipped: {type(e).__name__}: {e}", file=sys.stderr)

    table = markdown(rows, names)
    summ, line = summary(rows)
    device = torch.cuda.get_device_name()
    head = (f"Attention forward, {device}, TFLOP/s (4*B*H*N^2*d, halved for causal); median of "
            f"{-(-args.reps // ROUNDS) * ROUNDS} calls in {ROUNDS} interleaved rounds (random "
            f"order) of {-(-args.reps // ROUNDS)} after {WARMUP} warm-ups and {WARMUP_MS} ms "
            "each, CUDA events (calls queued behind a spinning kernel), inputs "
            "rotated past L2. "
            "* JAX is host-timed (wall clock to block_until_ready).")
    report = "\n\n".join([head, table, line, alone_summary(rows)]
                           + ([memory_markdown(mem)] if mem else []))
    print(report)
    with open(os.path.join(args.out, "bench_fwd.md"), "w") as f:
        f.write(report + "\n")
    meta = {"device": device, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "versions": versions(torch), "argv": sys.argv[1:], "reps": args.reps,
            "warmup": WARMUP, "rounds": ROUNDS,
            "timing": {"cufa/sdpa": "CUDA event pair per call, median",
                       "one_at_a_time_us": f"wall clock, call + sync from an idle queue, "
                                           f"median of {ALONE_CALLS}",
                       "jax_cudnn": "host wall clock to block_until_ready, median"},
            "flops": "4*B*H*Nq*Nk*d, halved for causal", "unavailable":
            {n: i for n, i in impls.items() if isinstance(i, str)}}
    with open(os.path.join(args.out, "bench_fwd.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "summary": summ, "memory": mem}, f, indent=1)
    if not args.no_plot:
        for path in plot(rows, names, args.out, device):
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
