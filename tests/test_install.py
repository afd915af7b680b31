"""CPU: the package works as installed, not only in the checkout: kernel sources from a
zipped install, and (in .ci/run's installed stage) cufa, NVRTC and the CUDA headers
all from the virtual environment's site-packages."""
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import cufa
from cufa import __main__ as cli, _compile


def test_kernel_sources_load_from_a_zipped_install(tmp_path):
    # A zip on sys.path has no file paths: the sources must be read as text.
    site = tmp_path / "site.zip"
    with zipfile.ZipFile(site, "w") as z:
        for f in Path(cufa.__file__).parent.glob("*.py"):
            z.write(f, f"cufa/{f.name}")

        def add(folder, name):  # the kernel sources, subfolders included
            for f in folder.iterdir():
                if f.is_dir():
                    add(f, f"{name}/{f.name}")
                elif f.name.endswith((".py", ".cu", ".cuh")):
                    z.writestr(f"{name}/{f.name}", f.read_text())
        add(_compile.KERNEL_FILES, "cufa/kernels_cu")
    code = ("import cufa, cufa._compile as c; assert 'site.zip' in cufa.__file__, cufa.__file__; "
            "print(c.source_digest('fwd/fwd_sm90.cu'), c.source_digest('fwd/varlen_schedule.cu'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(site)}, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [_compile.source_digest("fwd/fwd_sm90.cu"),
                                _compile.source_digest("fwd/varlen_schedule.cu")]


def test_version():
    assert cufa.__version__.count(".") == 2


@pytest.mark.skipif(not os.environ.get("CUFA_TEST_INSTALLED"),
                    reason="only in .ci/run's installed stage (CUFA_TEST_INSTALLED=1)")
def test_everything_comes_from_site_packages():
    """Fails when the tests would import the checkout instead of the installed wheel, or
    when NVRTC or the CUDA headers come from a system toolkit instead of the extras."""
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    found = {"cufa": cufa.__file__, "kernel sources": str(_compile.KERNEL_FILES),
             "libnvrtc": cli.nvrtc_library(), "CUDA headers": cli.cuda_header_dir()}
    outside = {k: p for k, p in found.items() if site not in Path(p).resolve().parents}
    assert not outside, f"not from {site}: {outside}"
