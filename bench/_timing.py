"""How every benchmark here times a call, and its peers.

- Queued (`time_events`): one CUDA event pair per call, the calls issued behind a kernel
  that spins on one SM (`queue_ahead`), so the queue stays ahead of the GPU as inside a
  model and each pair brackets the call's GPU work even where the host's cost outlasts the
  kernels. Before each timed block at least WARMUP calls and WARMUP_MS of them: the GPU's
  clocks follow what ran before.
- One call at a time (`time_alone`): wall clock from the call to the sync after it, from
  an idle queue: the host's cost counts, as for a server that waits for each step.
- Host-timed (`time_host`): JAX, wall clock to block_until_ready.
- Interleaved rounds (`run_rounds`): every implementation of a row in ROUNDS rounds, in a
  fresh random order each round (fixed seed), so a slow spell of the machine falls on all
  of them; the figure is the median of all the calls.
- Cold L2 (`rotating_sets`): inputs rotate among enough copies that none is still in L2
  (50 MB on an H100) when it comes round again.
- Peers (`load_peers`): PyTorch SDPA with only its flash backend (FlashAttention-2's
  kernels) or only cuDNN, each entered once outside the timed calls.

Only cufa's public API is used, so one benchmark script times any cufa tree put first
on PYTHONPATH (bench/ab.sh).
"""
import math
import os
import random
import statistics
import sys
import time
import warnings

# The checkout's cufa when nothing on PYTHONPATH (or installed) provides one: appended,
# not prepended, so that `PYTHONPATH=TREE python3 bench/...` times TREE's cufa.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX would take 75% of the GPU

TORCH_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}
WARMUP = 5          # calls before each timed block, at least
WARMUP_MS = 30      # and at least this long of them
ROUNDS = 4          # interleaved rounds a row
QUEUE_AHEAD_MS = 2.0
ALONE_CALLS = 12    # one-call-at-a-time samples an implementation and row
ROTATE_BYTES = 256 * 2**20  # input bytes cycled a timing loop: 5x an H100's L2
MAX_SETS = 8
TB = 1e12


# -- arguments and reports -------------------------------------------------------------------

def int_list(text):
    """'1,2,3' -> (1, 2, 3)."""
    return tuple(int(x) for x in text.split(",") if x.strip())


def dtype_list(text):
    """--dtypes: a comma list of fp16, bf16."""
    import argparse
    dtypes = tuple(d.strip() for d in text.split(",") if d.strip())
    bad = [d for d in dtypes if d not in TORCH_DTYPES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown {bad}; expected fp16 and/or bf16")
    return dtypes


def fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def progress(i, total, label, width=30):
    """A one-line bar on stderr (stdout stays the report), only on a terminal."""
    if not sys.stderr.isatty():
        return
    done = int(width * i / max(total, 1))
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{total} {label:<50}")
    sys.stderr.flush()


def require_torch_cuda(script):
    try:
        import torch
    except ImportError as e:
        sys.exit(f"{script}: PyTorch is required ({e}); run on a GPU machine")
    if not torch.cuda.is_available():
        sys.exit(f"{script}: torch.cuda.is_available() is False: no usable CUDA device")
    return torch


def versions(torch):
    """Library versions for a results file's metadata, and where cufa came from."""
    v = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
         "cudnn": torch.backends.cudnn.version()}
    for mod in ("cupy", "jax", "cufa"):
        m = sys.modules.get(mod)
        v[mod] = getattr(m, "__version__", None) if m else None
    cufa = sys.modules.get("cufa")
    v["cufa_path"] = os.path.dirname(cufa.__file__) if cufa else None
    return v


# -- FLOPs, bytes, inputs --------------------------------------------------------------------

def attention_flops(batch, nheads, seqlen_q, seqlen_k, head_dim, causal):
    """4 * B * H * Nq * Nk * d (two matrix products), halved for causal."""
    full = 4 * batch * nheads * seqlen_q * seqlen_k * head_dim
    return full / 2 if causal else full


def tflops(flops, ms):
    return flops / (ms * 1e-3) / 1e12


def rotating_sets(bytes_per_set, rotate_bytes=ROTATE_BYTES, most=MAX_SETS):
    """How many input sets to cycle so that no set is still in L2 when it comes round."""
    return max(2, min(most, math.ceil(rotate_bytes / bytes_per_set)))


# -- timers ------------------------------------------------------------------------------------

_sleep_cycles_per_ms = None


def queue_ahead(torch, ms):
    """Queue a kernel that spins ~ms on one SM (torch.cuda._sleep), so the calls issued
    next wait behind it: their host cost is hidden, as behind a model's other layers. The
    spin rate is measured once."""
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


def warm_up(torch, fn, sets):
    """WARMUP calls and at least WARMUP_MS of them (the same calls right after a lighter
    kernel measured up to 10 % faster)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    i = 0
    while i < WARMUP or (time.perf_counter() - start) * 1e3 < WARMUP_MS:
        fn(*sets[i % len(sets)])
        i += 1
        if i % 4 == 0:
            torch.cuda.synchronize()


def time_events(torch, fn, sets, reps):
    """ms of each of reps queued calls of fn(*sets[i % len(sets)]), one CUDA event pair
    each, after warm_up. The spin ahead is lengthened and the block retried where issuing
    the calls outlasted it (a slow spell of the host)."""
    warm_up(torch, fn, sets)
    lead_ms = max(QUEUE_AHEAD_MS, 0.3 * reps)
    for _ in range(4):
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


def time_alone(torch, fn, sets, calls):
    """ms of each of `calls` calls, each from an idle queue and waited for (wall clock
    from the call to the sync after it). Three calls first (plans, compiles)."""
    for i in range(3):
        fn(*sets[i % len(sets)])
    torch.cuda.synchronize()
    ms = []
    for i in range(calls):
        t0 = time.perf_counter()
        fn(*sets[i % len(sets)])
        torch.cuda.synchronize()
        ms.append((time.perf_counter() - t0) * 1e3)
    return ms


def time_host(fn, sets, reps):
    """JAX: ms of each call, wall clock from dispatch to block_until_ready."""
    for i in range(WARMUP):
        fn(*sets[i % len(sets)]).block_until_ready()
    ms = []
    for i in range(reps):
        args = sets[(WARMUP + i) % len(sets)]
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        ms.append((time.perf_counter() - t0) * 1e3)
    return ms


def capture_graphs(torch, fn, arg_sets):
    """One CUDA graph of fn(*args) per set, after a warm-up call of each on a side stream
    (compiles and plans happen outside the capture, as PyTorch asks)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for args in arg_sets:
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graphs = []
    for args in arg_sets:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(*args)
        graphs.append(g)
    torch.cuda.synchronize()
    return graphs


def measure(timer, *timer_args):
    """The ms list of timer(*timer_args), or {'na': reason}: an unsupported shape, a
    missing kernel or an out-of-memory is a reason in the table, not a crash."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return timer(*timer_args)
        except Exception as e:
            why = " | ".join([f"{type(e).__name__}: {e}"] + [str(w.message) for w in caught[:2]])
            return {"na": " ".join(why.split())[:400]}


def run_rounds(timers, per_round, rounds=ROUNDS):
    """Each timer (a function of a call count returning that many call times, or a string
    saying why there is none) in `rounds` rounds of per_round calls, the timers in a fresh
    random order each round. -> {name: list of ms, or {'na': reason}}; a timer that fails
    runs no further rounds."""
    failed, samples = {}, {name: [] for name in timers}
    order = random.Random(0)
    for _ in range(rounds):
        for name in order.sample(list(timers), len(timers)):
            t = timers[name]
            if name in failed:
                continue
            got = {"na": t} if isinstance(t, str) else measure(t, per_round)
            if isinstance(got, dict):
                failed[name] = got
            else:
                samples[name] += got
    return {name: failed.get(name) or samples[name] for name in timers}


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or None (said on stderr) where
    matplotlib is not installed: the tables do not need it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"plot skipped: matplotlib not installed ({e})", file=sys.stderr)
        return None
    return plt


def median(values):
    return statistics.median(values)


# -- what the results are set against ----------------------------------------------------------

def load_cufa():
    """The cufa module, or a string saying why it cannot be imported."""
    try:
        import cufa
        return cufa
    except Exception as e:
        return f"import cufa failed: {type(e).__name__}: {e}"


def load_peers(torch):
    """{'sdpa_flash': (sdpa_kernel, backend), 'sdpa_cudnn': ...}, or strings saying why."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except (ImportError, AttributeError) as e:
        why = f"torch.nn.attention unavailable: {e}"
        return {"sdpa_flash": why, "sdpa_cudnn": why}
    return {"sdpa_flash": (sdpa_kernel, SDPBackend.FLASH_ATTENTION),
            "sdpa_cudnn": (sdpa_kernel, SDPBackend.CUDNN_ATTENTION)}


def sdpa_kwargs(causal, gqa):
    return {"is_causal": causal, **({"enable_gqa": True} if gqa else {})}


def sink_summary(rows, case_name):
    """What the sink costs over the rows (--sink): its time over cufa's without one, a row
    at a time (case_name(row) names a row)."""
    costs = sorted((r["sink_cost"], case_name(r)) for r in rows if r.get("sink_cost") is not None)
    if not costs:
        return None
    median = statistics.median(c for c, _ in costs)
    return (f"learnable sink: cufa with a sink over cufa without, {len(costs)} rows: median "
            f"{median:+.1%}, from {costs[0][0]:+.1%} ({costs[0][1]}) to {costs[-1][0]:+.1%} "
            f"({costs[-1][1]}); rows over +2 %: {sum(c > 0.02 for c, _ in costs)}")


def copy_tbps(torch, nbytes=2**30, reps=20):
    """The device's copy bandwidth: a device-to-device copy of nbytes, (bytes read +
    written) / median time, TB/s."""
    a = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda")
    b = torch.empty_like(a)
    ms = median(time_events(torch, lambda x, y: y.copy_(x), [(a, b)], reps))
    del a, b
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3) / TB


def matmul_tflops(torch, n=8192, reps=10):
    """The device's fp16 matrix-product rate on an n^3 product, TFLOP/s."""
    a = torch.randn(n, n, device="cuda", dtype=torch.float16)
    ms = median(time_events(torch, lambda x: x @ x, [(a,)], reps))
    del a
    return 2 * n**3 / (ms * 1e-3) / 1e12
