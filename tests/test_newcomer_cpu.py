"""CPU: what a newcomer meets first: cufa.reference after `import cufa`, the compat module
without PyTorch, and why the GPU tests skip on a machine without a driver."""
import os
import subprocess
import sys
import textwrap

from conftest import no_device_reason


def test_reference_after_import_cufa():
    import cufa
    assert callable(cufa.reference.attention) and "reference" in cufa.__all__


def test_compat_without_pytorch_says_it_needs_pytorch(tmp_path):
    # a torch that fails to import, first on the path, as where PyTorch is not installed
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(
        'raise ImportError("No module named \'torch\'")\n')
    code = textwrap.dedent("""
        import cufa
        try:
            import cufa.compat.flash_attn
        except ImportError as e:
            print(e)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tmp_path)] + [p for p in sys.path if p]))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "cufa.compat.flash_attn needs PyTorch" in run.stdout, run.stdout + run.stderr
    assert "--index-url https://download.pytorch.org/whl/cpu" in run.stdout


class _CUDARuntimeError(Exception):
    pass


def test_skip_reason_without_a_driver_says_there_is_none():
    error = _CUDARuntimeError("cudaErrorInsufficientDriver: CUDA driver version is "
                              "insufficient for CUDA runtime version")
    reason = no_device_reason(error, None)
    assert reason == "no CUDA device (no NVIDIA driver on this machine)"
    # with a driver present, an old one really is the reason: said as CUDA says it
    assert "insufficient" in no_device_reason(error, "libcuda.so.1")
