import os
import zlib

import numpy as np
import pytest


def no_device_reason(error, driver_library):
    """Why the GPU tests skip, from the error that asking for the device count raised and
    the driver library found (ctypes.util.find_library("cuda"), or None). Without a driver
    CUDA says its "driver version is insufficient", which reads as an old driver to fix;
    say that there is none."""
    if driver_library is None and "InsufficientDriver" in f"{type(error).__name__} {error}":
        return "no CUDA device (no NVIDIA driver on this machine)"
    return f"no CUDA device ({type(error).__name__}: {error})"


def _cuda_devices():
    """(the CUDA devices' count, '' when one is usable else why not)."""
    try:
        import cupy
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no CuPy, no driver, no device
        import ctypes.util
        return 0, no_device_reason(e, ctypes.util.find_library("cuda"))
    return n, "" if n else "no CUDA device (0 devices)"


def _torch_import_error():
    """'' when torch imports, else why not."""
    try:
        import torch  # noqa: F401
    except Exception as e:  # not installed, or a broken install
        return f"{type(e).__name__}: {e}"
    return ""


GPU_COUNT, NO_GPU = _cuda_devices()
SEVERAL_GPUS = GPU_COUNT > 1
# JAX would otherwise reserve 75% of the GPU at import, starving PyTorch in the same process.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def pytest_report_header(config):
    import cufa
    return f"cufa {cufa.__version__} under test: {os.path.dirname(cufa.__file__)}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A GPU test module skipped at import because torch does not import is an error where
    there is a GPU: the GPU tests need torch, and a suite of skips would read as a pass."""
    outcome = yield
    report = outcome.get_result()
    if (report.skipped and not NO_GPU and isinstance(collector, pytest.Module)
            and collector.path.name.startswith("test_gpu_")):
        # (asked only here, after the module's own import of torch: importing torch
        # earlier would change when cufa registers its torch ops)
        reason = _torch_import_error()
        if reason:
            report.outcome = "failed"
            report.longrepr = (f"{collector.path.name}: a CUDA device is present but PyTorch "
                               f"does not import ({reason}); the GPU tests need it")


def pytest_runtest_logreport(report):
    """CUFA_FAILED_TESTS=FILE: each failing test's id appended to FILE as it fails (under
    xdist too: the controller sees every report), so that a run cut short by a time limit,
    whose summary never prints, still names its failures (bench/device_run.sh)."""
    path = os.environ.get("CUFA_FAILED_TESTS")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"{report.nodeid} ({report.when})\n")


def pytest_collection_modifyitems(config, items):
    if not NO_GPU:
        return
    skip = pytest.mark.skip(reason=NO_GPU)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_jax_brought_up = []


@pytest.fixture(autouse=True)
def _cuda0_current(request):
    """On a host with several GPUs, every GPU test starts with cuda:0 current (the tests
    make their tensors with device="cuda"), with JAX's GPUs brought up beforehand: XLA
    sets up every GPU in the thread that first uses JAX and leaves the last one's context
    current (cuda:1 on a two-GPU host), which moved torch's current device, and the
    tensors of every later test in that process, to cuda:1."""
    if not SEVERAL_GPUS or "gpu" not in request.keywords:
        return
    if not _jax_brought_up:
        _jax_brought_up.append(True)
        try:
            import jax
            jax.devices()
        except Exception:  # (no JAX, or none for CUDA: nothing to bring up)
            pass
    import torch
    torch.cuda.set_device(0)


@pytest.fixture
def rng(request):
    """A generator seeded from the test's id: fixed across runs, different per case."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def jax_cpu_callbacks(monkeypatch):
    """cufa's JAX route on JAX's CPU backend (skipped without JAX or its buffer_callback):
    the CPU backend passes for the CUDA one and no scratch is planned; a test then replaces
    cufa._jax.on_device, the launch. -> the cufa._jax module."""
    pytest.importorskip("jax")
    from cufa import _jax
    if not _jax.available():
        pytest.skip("this JAX has no buffer_callback")
    monkeypatch.setattr(_jax, "cuda_backend", lambda: True)
    monkeypatch.setattr(_jax, "_scratch_bytes", lambda entry, present, options: 0)
    return _jax
