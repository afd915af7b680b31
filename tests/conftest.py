import os
import zlib

import numpy as np
import pytest


def _cuda_device_reason():
    """'' when a CUDA device is usable, else why not."""
    try:
        import cupy
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no CuPy, no driver, no device
        return f"no CUDA device ({type(e).__name__}: {e})"
    return "" if n else "no CUDA device (0 devices)"


NO_GPU = _cuda_device_reason()
# JAX would otherwise reserve 75% of the GPU at import, starving PyTorch in the same process.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def pytest_report_header(config):
    import cufa
    return f"cufa {cufa.__version__} under test: {os.path.dirname(cufa.__file__)}"


def pytest_collection_modifyitems(config, items):
    if not NO_GPU:
        return
    skip = pytest.mark.skip(reason=NO_GPU)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """A generator seeded from the test's id: fixed across runs, different per case."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
