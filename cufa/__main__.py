"""``python -m cufa [check|info|warmup]``.

check (the default): with a GPU, every kernel family against the float64 reference plus
a short timing table; without one, says so and runs the CPU reference on a small problem.
info: device, architecture, CuPy / CUDA / NVRTC versions, cache location, compiled variants.
warmup: compile every variant into the on-disk kernel cache that calls use, for this GPU
or, with --arch sm_90, for a GPU that is not here (no GPU needed): a second warmup, or a
first call on such a GPU, then compiles nothing. --only GLOB keeps the variants whose key
matches; --list prints their keys and compiles nothing.
"""
import argparse
import ctypes
import fnmatch
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import numpy as np

from . import __version__, _compile, api, reference

# cufa is not on a package index: the hint names what works from a checkout, or from the
# wheel `python -m build` writes into dist/.
INSTALL_HINT = ("install cufa with a CUDA extra: pip install -e '.[cuda13]' in a checkout, or "
                "python -m build there, then pip install "
                f"'dist/cufa-{__version__}-py3-none-any.whl[cuda13]' ([cuda12] for a CUDA 12 "
                "driver)")


def _gpu_status():
    """(True, '') when a CUDA device is usable, else (False, one line saying why)."""
    try:
        import cupy
    except ImportError as e:
        return False, f"CuPy is not installed ({e}); {INSTALL_HINT}"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver, no device, or a broken installation
        if not _driver_installed():  # CUDA then says "driver insufficient": not the news
            return False, "no CUDA device found"
        return False, f"no usable CUDA device: {type(e).__name__}: {e}"
    return (n > 0), ("" if n else "no CUDA device found")


def _driver_installed():
    try:
        ctypes.CDLL("nvcuda.dll" if os.name == "nt" else "libcuda.so.1")
    except OSError:
        return False
    return True


def nvrtc_library():
    """The libnvrtc CuPy loaded (it finds it through cuda.pathfinder: pip wheels first)."""
    from cuda import pathfinder
    return pathfinder.load_nvidia_dynamic_lib("nvrtc").abs_path


def cuda_header_dir():
    """The CUDA runtime headers' folder, found as CuPy finds it."""
    from cuda import pathfinder
    return pathfinder.find_nvidia_header_directory("cudart")


def _cache_dir():
    return os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache"))


def _progress(i, total, label, width=30):
    """A bar redrawn in place, on a terminal only: in a log file it would be one line of
    `total` carriage-return segments. Ends its line at the last step."""
    if not sys.stdout.isatty():
        return
    done = int(width * i / total)
    sys.stdout.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{total} {label:<60}"
                     + ("\n" if i == total else ""))
    sys.stdout.flush()


# -- check -------------------------------------------------------------------------------

def _cpu_check():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, n, 3, 40)) for n in (77, 131, 131))
    worst = 0.0
    for causal in (False, True):
        o_ref, lse_ref = reference.attention(q, k, v, causal=causal)
        o_til, lse_til = reference.attention_tiled(q, k, v, causal=causal, block_m=32, block_n=48)
        err = max(np.abs(o_ref - o_til).max(), np.abs(lse_ref - lse_til).max())
        worst = max(worst, err)
        print(f"  reference, causal={causal!s:5}: naive vs tiled max |diff| = {err:.2e}")
    print("CPU reference OK" if worst < 1e-10 else "CPU reference MISMATCH")
    return worst < 1e-10


def _random(shape, dtype, rng):
    import cupy
    x = cupy.asarray(rng.standard_normal(shape, dtype=np.float32))
    return x.astype(_bf16() if dtype == "bfloat16" else dtype)


def _bf16():
    import ml_dtypes
    return ml_dtypes.bfloat16


def _gpu_check():
    import cupy
    import cufa
    rng = np.random.default_rng(0)
    dtypes = ["float16", "bfloat16"]
    try:
        _bf16()
    except ImportError:
        dtypes = ["float16"]
        print("  (bfloat16 skipped: CuPy needs the ml_dtypes package for bfloat16 arrays)")
    native = _compile.family_for(cupy.cuda.Device().compute_capability)
    families = [native] + [f for f in ("sm80",) if f != native]   # Hopper checks both paths
    dims = {"sm80": _compile.SM80_HEAD_DIMS, "sm90": _compile.SM90_HEAD_DIMS}
    cases = [(fam, dt, d, mask, mods) for fam in families for dt in dtypes for d in dims[fam]
             for mask in _compile.MASKS for mods in (False, True)]
    # the element-wise I/O variants (one a padded head dim, for every mask and mods): a head
    # dim 3 below each padded one, no multiple of 8
    cases += [("sm80", dt, d - 3, "window", True) for dt in dtypes for d in dims["sm80"]]
    f64 = (lambda x: cupy.asnumpy(x.astype(np.float32)).astype(np.float64))
    failures = 0
    print(f"checking {len(cases)} dense variants against the float64 reference", flush=True)
    for i, (fam, dt, d, mask, mods) in enumerate(cases, 1):
        _progress(i, len(cases), f"{fam} {dt} d={d} {mask}{' +mods' if mods else ''}")
        os.environ["CUFA_KERNEL_FAMILY"] = fam
        api.clear_plans()   # plans read the override when they are made
        b, sq, sk, h, hk = 2, 97, 133, 4, 2
        q, k, v = (_random((b, n, hh, d), dt, rng) for n, hh in ((sq, h), (sk, hk), (sk, hk)))
        kw = dict(causal=mask == "window")
        if mods:
            kw.update(softcap=20.0, alibi_slopes=cupy.asarray(rng.uniform(0, 0.5, h), np.float32))
        o, lse = cufa.flash_attn_func(q, k, v, return_lse=True, **kw)
        kw_ref = dict(kw)
        if mods:
            kw_ref["alibi_slopes"] = cupy.asnumpy(kw["alibi_slopes"])
        o_ref, lse_ref = reference.attention(f64(q), f64(k), f64(v), **kw_ref)
        failures += not _matches(f64(o), cupy.asnumpy(lse), o_ref, lse_ref, dt,
                                 f"{fam} {dt} d={d} {mask} mods={mods}")
    for fam in families:   # packed batches: the device-built work list, per-sequence bounds
        os.environ["CUFA_KERNEL_FAMILY"] = fam
        api.clear_plans()
        lens = [0, 1, 130, 77, 300]
        cu = cupy.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
        q, k, v = (_random((sum(lens), hh, 64), "float16", rng) for hh in (4, 2, 2))
        o, lse = cufa.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                             return_lse=True)
        ok = True
        for s, e in zip(np.cumsum([0] + lens[:-1]), np.cumsum(lens)):
            if e > s:
                o_ref, lse_ref = reference.attention(*(f64(x[s:e])[None] for x in (q, k, v)),
                                                     causal=True)
                ok &= _matches(f64(o[s:e])[None], cupy.asnumpy(lse[:, s:e])[None], o_ref,
                               lse_ref, "float16", f"{fam} varlen sequence {s}:{e}")
        cases.append((fam, "varlen"))
        failures += not ok
    os.environ.pop("CUFA_KERNEL_FAMILY")
    api.clear_plans()
    for page_size, splits, d in ((None, 1, 64), (None, 0, 64), (16, 5, 64), (16, 3, 59)):
        cases.append(("decode", page_size, splits, d))  # the KV-cache kernels
        failures += not _decode_check(rng, f64, page_size, splits, d)
    print(f"self-check: {len(cases) - failures}/{len(cases)} kernel families match the reference")
    return failures == 0


def _decode_check(rng, f64, page_size, num_splits, d):
    """flash_attn_with_kvcache appending 2 tokens to a cache of 3 sequences (GQA 8/2),
    contiguous or paged, against the reference over the cache it should leave."""
    import cupy
    import cufa
    b, cap, h, hk, new = 3, 256, 8, 2, 2
    lens = np.array([200, 0, 77], dtype=np.int32)
    q = _random((b, 2, h, d), "float16", rng)
    k_new, v_new = (_random((b, new, hk, d), "float16", rng) for _ in range(2))
    k_cache, v_cache = (_random((b, cap, hk, d), "float16", rng) for _ in range(2))
    k_ref, v_ref = f64(k_cache), f64(v_cache)
    for i, n in enumerate(lens):
        k_ref[i, n:n + new], v_ref[i, n:n + new] = f64(k_new[i]), f64(v_new[i])
    table = None
    if page_size:  # the same keys, scattered over shuffled pages
        pages = cap // page_size
        order = rng.permutation(b * pages + 3)[:b * pages].reshape(b, pages).astype(np.int32)
        k_pages, v_pages = (cupy.zeros((b * pages + 3, page_size, hk, d), cupy.float16)
                            for _ in range(2))
        slots = cupy.asarray(order.ravel())
        k_pages[slots] = k_cache.reshape(b * pages, page_size, hk, d)
        v_pages[slots] = v_cache.reshape(b * pages, page_size, hk, d)
        k_cache, v_cache, table = k_pages, v_pages, cupy.asarray(order)
    o, lse = cufa.flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=cupy.asarray(lens), causal=True,
        block_table=table, num_splits=num_splits, return_softmax_lse=True)
    ok = True
    for i, n in enumerate(lens):
        o_ref, lse_ref = reference.attention(f64(q[i:i + 1]), k_ref[i:i + 1, :n + new],
                                             v_ref[i:i + 1, :n + new], causal=True)
        ok &= _matches(f64(o[i:i + 1]), cupy.asnumpy(lse[i:i + 1]), o_ref, lse_ref, "float16",
                       f"decode d={d} page_size={page_size} num_splits={num_splits} "
                       f"sequence {i}")
    return ok


def _matches(o, lse, o_ref, lse_ref, dtype, label):
    """Loose bounds for a quick check (the tests apply the strict rule)."""
    err = np.abs(o - o_ref).max()
    fin = np.isfinite(lse_ref)
    lse_err = np.abs(lse[fin] - lse_ref[fin]).max(initial=0)
    ok = err < (2e-2 if dtype == "bfloat16" else 4e-3) and lse_err < 1e-3 and \
        np.array_equal(np.isneginf(lse), ~fin)
    if not ok:
        print(f"\n  FAIL {label}: max |out err| {err:.2e}, max |lse err| {lse_err:.2e}")
    return ok


def _timing_table():
    import cupy
    import cufa
    rng = np.random.default_rng(1)
    print("\n| dtype | batch x seqlen x heads x d | causal | ms | TFLOP/s |")
    print("| --- | --- | --- | --- | --- |")
    for d in (64, 128):
        for causal in (False, True):
            b, n, h = 4, 4096, 2048 // d
            q, k, v = (_random((b, n, h, d), "float16", rng) for _ in range(3))
            for _ in range(3):
                cufa.flash_attn_func(q, k, v, causal=causal)
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            reps = 10
            start.record()
            for _ in range(reps):
                cufa.flash_attn_func(q, k, v, causal=causal)
            stop.record()
            stop.synchronize()
            ms = cupy.cuda.get_elapsed_time(start, stop) / reps
            flops = 4 * b * h * n * n * d / (2 if causal else 1)
            print(f"| float16 | {b} x {n} x {h} x {d} | {causal} | {ms:.3f} | "
                  f"{flops / ms / 1e9:.0f} |")


def check():
    ok, reason = _gpu_status()
    if not ok:
        print(f"{reason}; running the CPU reference on a small problem instead")
        return 0 if _cpu_check() else 1
    ok = _gpu_check()
    _timing_table()
    return 0 if ok else 1


# -- info, warmup --------------------------------------------------------------------------

def info():
    try:
        import cupy
        print(f"CuPy {cupy.__version__} ({cupy.__file__})")
        from cupy.cuda import nvrtc
        print(f"NVRTC {'.'.join(map(str, nvrtc.getVersion()))} ({nvrtc_library()})")
        print(f"CUDA headers, which CuPy puts on every compile's include path: "
              f"{cuda_header_dir() or 'not found; ' + INSTALL_HINT}")
    except Exception as e:  # no CuPy, or CuPy without NVRTC
        print(f"CuPy/NVRTC unavailable ({str(e).splitlines()[0]}); {INSTALL_HINT}")
        return 0
    ok, reason = _gpu_status()
    if ok:
        rt = cupy.cuda.runtime
        dev = cupy.cuda.Device()
        props = rt.getDeviceProperties(dev.id)
        print(f"device {dev.id}: {props['name'].decode()}, sm_{dev.compute_capability}, "
              f"{props['multiProcessorCount']} SMs")
        print(f"CUDA runtime {rt.runtimeGetVersion()}, driver {rt.driverGetVersion()}")
    else:
        print(reason)
    print(f"kernel cache (CuPy, on disk): {_cache_dir()}")
    print(f"kernel sources: {_compile.KERNEL_FILES} (fwd/fwd_sm80.cu sha256:"
          f"{_compile.source_digest('fwd/fwd_sm80.cu')})")
    print(f"variants the library can launch: {len(_compile.all_variants())}")
    for key in _compile.compiled_keys():
        print(f"  compiled in this process: {key}")
    return 0


def _parse_arch(text, supported):
    """"sm_90", "sm_90a" or "90" -> 90; None for what cufa cannot compile for."""
    m = re.fullmatch(r"(?:sm_?)?(\d+)a?", text.strip().lower())
    cc = int(m.group(1)) if m else None
    return cc if cc in supported else None


def warmup(arch=None, only="*", list_only=False):
    """Compile every variant that runs on the GPU (or on `arch`) into CuPy's on-disk cache,
    the one calls read: afterwards a call compiles nothing, nor does a second warmup.
    `only` keeps the variants whose key matches that glob; `list_only` prints their keys
    and compiles nothing."""
    try:
        from cupy.cuda import compiler, nvrtc
        nvrtc_version = ".".join(map(str, nvrtc.getVersion()))
        supported = [cc for cc in nvrtc.getSupportedArchs() if cc >= 80]
    except Exception as e:  # no CuPy, or CuPy without NVRTC
        print(f"NVRTC unavailable ({str(e).splitlines()[0]}); {INSTALL_HINT}")
        return 1
    if arch is None:
        ok, reason = _gpu_status()
        if not ok:
            print(f"{reason}; pass --arch (e.g. --arch sm_90) to compile for a GPU that is "
                  "not here")
            return 1
        cc = int(compiler._get_arch())  # the device's, as CuPy compiles calls for it
    else:
        cc = _parse_arch(arch, supported)
        if cc is None:
            print(f"--arch {arch}: not an architecture cufa compiles for; it needs sm_80 or "
                  f"later, and NVRTC {nvrtc_version} here supports "
                  f"{', '.join(f'sm_{a}' for a in supported)}", file=sys.stderr)
            return 2
    runnable = [v for v in _compile.all_variants() if _compile.runs_on(v, cc)]
    variants = [v for v in runnable if fnmatch.fnmatch(v.key, only)]
    if not variants:
        print(f"--only {only}: matches none of the {len(runnable)} variants for sm_{cc}; "
              f"list their keys with: python -m cufa warmup --arch sm_{cc} --list",
              file=sys.stderr)
        return 2
    if list_only:
        print("\n".join(v.key for v in variants))
        return 0
    cache = _cache_dir()
    before = _cubins(cache)
    times = {}
    t_all = time.perf_counter()
    print(f"compiling {len(variants)} variants for sm_{cc}, {os.cpu_count()} at a time",
          flush=True)
    # NVRTC releases the GIL: one compile per core
    with _compile.arch_flags_without_a_device(), ThreadPoolExecutor(os.cpu_count()) as pool:
        jobs = {pool.submit(_timed, _compile.compile_into_cache, v, cc): v for v in variants}
        for i, job in enumerate(as_completed(jobs), 1):
            times[jobs[job].key] = job.result()
            _progress(i, len(variants), jobs[job].key)
    for v in variants:
        print(f"  {times[v.key]:7.2f} s  {v.key}")
    compiled = len(_cubins(cache) - before)
    print(f"{len(variants)} variants for sm_{cc} in {time.perf_counter() - t_all:.1f} s: "
          f"{compiled} compiled into {cache}, {len(variants) - compiled} were there already")
    return 0


def _timed(fn, *args):
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _cubins(folder):
    return set(os.listdir(folder)) if os.path.isdir(folder) else set()


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m cufa", description=__doc__.split("\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"cufa {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="{check,info,warmup}")
    commands.add_parser("check", help="(the default) every kernel family against the float64 "
                        "reference, then timings; without a GPU, the CPU reference")
    commands.add_parser("info", help="device, CuPy / CUDA / NVRTC versions, kernel cache")
    warm = commands.add_parser("warmup", help="compile every variant into the kernel cache")
    warm.add_argument("--arch", help="fill the cache for a GPU of this architecture (sm_80 or "
                      "later, e.g. sm_90) instead of this one; no GPU needed")
    warm.add_argument("--only", default="*", metavar="GLOB",
                      help="the variants whose key matches, e.g. 'fwd_*_bf16_*'")
    warm.add_argument("--list", action="store_true",
                      help="print the keys of the variants it would compile; compile nothing")
    # parse_known_args, to say which command the stray options were given to
    args, stray = parser.parse_known_args(argv)
    command = args.command or "check"
    if stray:
        parser.error(f"{command} takes no {' '.join(stray)} "
                     f"(see python -m cufa {command} --help)")
    if command == "info":
        return info()
    if command == "warmup":
        return warmup(args.arch, args.only, args.list)
    return check()


if __name__ == "__main__":
    sys.exit(main())
