"""CPU: `python -m cufa warmup --arch` fills the on-disk cache that calls read, so a
second warmup (or a call on a GPU of that arch) compiles nothing."""
import os
import subprocess
import sys
import time

import pytest

from cufa import _compile

# six small kernels (3 s to compile, where nine of the sm80 forward's took 28): the full
# set's numbers are in the README
SUBSET = "decode_combine_*_fp16*"


def _warmup(*args, env):
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "cufa", "warmup", *args], capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.splitlines()[-1], time.perf_counter() - t0


def test_second_warmup_compiles_nothing_and_takes_under_5_s(tmp_path):
    env = {**os.environ, "CUPY_CACHE_DIR": str(tmp_path)}
    first, t_first = _warmup("--arch", "sm_90", "--only", SUBSET, env=env)
    second, t_second = _warmup("--arch", "sm_90", "--only", SUBSET, env=env)
    print(f"\nwarmup --arch sm_90 --only {SUBSET}: first {t_first:.1f} s ({first}), "
          f"second {t_second:.1f} s ({second})")
    assert ": 6 compiled into" in first and ": 0 compiled into" in second
    assert t_second < 5


class _Compiled(Exception):
    pass


def _call_on_sm90(variant):
    """What a call's first use of `variant` on an sm_90 GPU does, minus the GPU: 'hit'
    when it finds the module in the disk cache, 'compiled' when it would compile."""
    import cupy
    try:
        _compile.raw_module(variant).module
    except _Compiled:
        return "compiled"
    except (cupy.cuda.runtime.CUDARuntimeError, cupy.cuda.driver.CUDADriverError):
        pass  # found; loading it needs a GPU of that arch
    return "hit"


def test_warmup_writes_the_entries_a_call_reads(tmp_path, monkeypatch):
    # This reaches into CuPy's compiler (it must, to run a call's compile path without a
    # GPU); if CuPy changes there, warmup --arch may no longer fill the calls' entries.
    from cupy._core import raw
    from cupy.cuda import compiler
    from cupy.cuda._compiler_cache import DiskKernelCacheBackend

    def no_compile(*args, **kwargs):
        raise _Compiled

    monkeypatch.setattr(compiler, "_kernel_cache_backend", DiskKernelCacheBackend(str(tmp_path)))
    warmed = [_compile.VARLEN_SCHEDULE, _compile.fwd_variant("fp16", 64, "none", False, "sm90")]
    cold = _compile.fwd_variant("fp16", 64, "none", False)
    with _compile.arch_flags_without_a_device():
        for v in warmed:
            _compile.compile_into_cache(v, 90)
        monkeypatch.setattr(compiler, "_get_arch", lambda: "90")          # the device's arch
        monkeypatch.setattr(raw, "_get_raw_module", raw._get_raw_module.__wrapped__)  # its memo asks the device
        monkeypatch.setattr(compiler, "_compile_using_nvrtc_no_warning", no_compile)
        assert [_call_on_sm90(v) for v in warmed] == ["hit", "hit"]
        assert _call_on_sm90(cold) == "compiled"


@pytest.mark.parametrize("cc, expected", [(80, {"sm80"}), (89, {"sm80"}), (90, {"sm80", "sm90"}),
                                          (120, {"sm80"})])
def test_variants_that_run_on_an_arch(cc, expected):
    variants = [v for v in _compile.all_variants() if _compile.runs_on(v, cc)]
    assert {v.family for v in variants if hasattr(v, "family")} == expected
    assert _compile.VARLEN_SCHEDULE in variants
