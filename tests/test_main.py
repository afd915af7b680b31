"""CPU: `python -m cufa` — the main job without a GPU, and info."""
import subprocess
import sys

import pytest
from conftest import NO_GPU


def _run(*args):
    return subprocess.run([sys.executable, "-m", "cufa", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.skipif(not NO_GPU, reason="a CUDA device is present: the GPU self-check runs instead")
def test_main_job_without_gpu_runs_the_cpu_reference():
    r = _run()
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("no CUDA device found")
    assert "driver" not in r.stdout.splitlines()[0]  # no advice to update a driver not needed
    assert "CPU reference OK" in r.stdout


def test_info():
    r = _run("info")
    assert r.returncode == 0, r.stderr
    assert "NVRTC" in r.stdout and "variants the library can launch:" in r.stdout


def test_warmup_without_gpu_needs_an_arch():
    if not NO_GPU:
        pytest.skip("a CUDA device is present")
    r = _run("warmup")
    assert r.returncode == 1 and "--arch" in r.stdout


@pytest.mark.parametrize("arch", ["foo", "sm_75"])
def test_warmup_rejects_an_arch_in_one_line(arch):
    r = _run("warmup", "--arch", arch)
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.splitlines()) == 1, r.stderr
    assert f"--arch {arch}:" in r.stderr and "sm_80 or later" in r.stderr and "sm_90" in r.stderr
