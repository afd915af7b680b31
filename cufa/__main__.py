"""``python -m cufa [check|info|warmup]``.

check (the default): with a GPU, every kernel family against the float64 reference plus
a short timing table; without one, says so and runs the CPU reference on a small problem.
info: device, architecture, CuPy / CUDA / NVRTC versions, cache location, compiled variants.
warmup: compile every variant (for the current device, or ``--arch sm_90`` without one).
"""
import argparse
import os
import sys
import time

import numpy as np

from . import _compile, reference


def _gpu_status():
    """(True, '') when a CUDA device is usable, else (False, reason)."""
    try:
        import cupy
    except ImportError as e:
        return False, f"CuPy is not installed ({e}); pip install 'cufa[cuda13]' or 'cufa[cuda12]'"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver, no device, or a broken installation
        return False, f"{type(e).__name__}: {e}"
    return (n > 0), ("" if n else "the CUDA runtime reports 0 devices")


def _progress(i, total, label, width=30):
    done = int(width * i / total)
    sys.stdout.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{total} {label:<60}")
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
    f64 = (lambda x: cupy.asnumpy(x.astype(np.float32)).astype(np.float64))
    failures = 0
    for i, (fam, dt, d, mask, mods) in enumerate(cases, 1):
        _progress(i, len(cases), f"{fam} {dt} d={d} {mask}{' +mods' if mods else ''}")
        os.environ["CUFA_KERNEL_FAMILY"] = fam
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
    print(f"\nself-check: {len(cases) - failures}/{len(cases)} kernel families match the reference")
    return failures == 0


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
        print(f"no CUDA device found: {reason}")
        print("running the CPU reference on a small problem instead")
        return 0 if _cpu_check() else 1
    ok = _gpu_check()
    _timing_table()
    return 0 if ok else 1


# -- info, warmup --------------------------------------------------------------------------

def info():
    try:
        import cupy
        print(f"CuPy {cupy.__version__}")
        from cupy.cuda import nvrtc
        print(f"NVRTC {'.'.join(map(str, nvrtc.getVersion()))}")
    except Exception as e:
        print(f"CuPy/NVRTC unavailable: {e}")
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
        print(f"no CUDA device: {reason}")
    cache = os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache"))
    print(f"kernel cache (CuPy, on disk): {cache}")
    print(f"kernel sources: {_compile.KERNEL_FILES} (fwd_sm80.cu sha256:"
          f"{_compile.source_digest('fwd_sm80.cu')})")
    print(f"variants the library can launch: {len(_compile.all_variants())}")
    for key in _compile.compiled_keys():
        print(f"  compiled in this process: {key}")
    return 0


def warmup(arch=None):
    variants = _compile.all_variants()
    if arch is not None:
        # Each variant for the named arch where it runs: the wgmma family only on Hopper,
        # where it needs the arch-specific target.
        hopper = arch.startswith("sm_90")
        variants = [v for v in variants if getattr(v, "family", "sm80") == "sm80" or hopper]
    if arch is None:
        ok, reason = _gpu_status()
        if not ok:
            print(f"no CUDA device found ({reason}); pass --arch sm_80 (or sm_90) to "
                  "compile without one")
            return 1
        import cupy
        device = cupy.cuda.Device().id
    times = []
    t_all = time.perf_counter()
    for i, v in enumerate(variants, 1):
        _progress(i - 1, len(variants), v.key)
        t0 = time.perf_counter()
        if arch is None:
            _compile.get_kernel(v, device)
        else:
            _compile.compile_for_arch(v, "sm_90a" if "sm_90a" in v.archs else arch)
        times.append((v.key, time.perf_counter() - t0))
    _progress(len(variants), len(variants), "done")
    print()
    for key, t in times:
        print(f"  {t:7.2f} s  {key}")
    print(f"{len(variants)} variants in {time.perf_counter() - t_all:.1f} s"
          + (f" for {arch}" if arch else ""))
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m cufa", description=__doc__.split("\n")[0])
    parser.add_argument("command", nargs="?", default="check", choices=("check", "info", "warmup"))
    parser.add_argument("--arch", help="warmup only: compile for this arch (e.g. sm_90) "
                        "with NVRTC, no GPU needed")
    args = parser.parse_args(argv)
    if args.command == "info":
        return info()
    if args.command == "warmup":
        return warmup(args.arch)
    return check()


if __name__ == "__main__":
    sys.exit(main())
