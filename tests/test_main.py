"""CPU: `python -m cufa` — the main job without a GPU, info, and the command line itself."""
import io
import os
import subprocess
import sys

import pytest
from conftest import NO_GPU

import cufa
from cufa import __main__ as cli, _compile


def _run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "cufa", *args], capture_output=True, text=True,
                          timeout=300, env=env)


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


def _main(capsys, *args):
    """`python -m cufa ARGS` in this process: (exit status, stdout, stderr)."""
    try:
        rc = cli.main(list(args))
    except SystemExit as e:   # argparse exits on --version and on usage errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_version(capsys):
    assert _main(capsys, "--version") == (0, f"cufa {cufa.__version__}\n", "")


@pytest.mark.parametrize("args", [("info", "--arch", "sm_90"), ("check", "--only", "fwd_*"),
                                  ("--list",), ("warmup", "--arhc", "sm_90")])
def test_an_option_the_command_does_not_take_is_an_error(capsys, args):
    rc, out, err = _main(capsys, *args)
    assert rc == 2 and out == ""
    assert f"takes no {' '.join(a for a in args if a.startswith('--'))}" in err, err


def test_only_matching_nothing_is_an_error_that_says_how_to_list_the_keys(capsys):
    rc, out, err = _main(capsys, "warmup", "--arch", "sm_90", "--only", "fwd_*_fp4_*")
    assert rc == 2 and out == ""
    assert "--only fwd_*_fp4_*: matches none of the" in err
    assert "python -m cufa warmup --arch sm_90 --list" in err


def test_list_prints_the_matching_keys_and_compiles_nothing(capsys, monkeypatch):
    def compile_into_cache(*args):
        raise AssertionError("--list compiled")

    monkeypatch.setattr(_compile, "compile_into_cache", compile_into_cache)
    rc, out, _ = _main(capsys, "warmup", "--arch", "sm_80", "--only", "fwd_sm80_fp16_hd64_*",
                       "--list")
    keys = out.split()
    assert rc == 0 and len(keys) == 9 and all(k.startswith("fwd_sm80_fp16_hd64_") for k in keys)
    rc, out, _ = _main(capsys, "warmup", "--arch", "sm_80", "--list")
    assert rc == 0 and set(out.split()) == {v.key for v in cufa.all_variants()
                                            if _compile.runs_on(v, 80)}
    assert not [k for k in out.split() if k.startswith("fwd_sm90_")]


def test_warmup_into_a_log_writes_one_line_per_stage_and_no_bar(tmp_path):
    r = _run("warmup", "--arch", "sm_90", "--only", "varlen_schedule",
             env={**os.environ, "CUPY_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "\r" not in r.stdout and "#" not in r.stdout
    assert lines[0] == "compiling 1 variants for sm_90, %d at a time" % os.cpu_count()
    assert lines[1].split()[-1] == "varlen_schedule" and len(lines) == 3
    assert ": 1 compiled into" in lines[2]


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("stdout, drawn", [(_Terminal, True), (io.StringIO, False)])
def test_progress_bar_is_drawn_on_a_terminal_only(monkeypatch, stdout, drawn):
    out = stdout()
    monkeypatch.setattr(sys, "stdout", out)
    for i in (1, 2, 3):
        cli._progress(i, 3, f"step {i}")
    text = out.getvalue()
    if drawn:
        assert text.count("\r") == 3 and text.endswith("\n") and text.count("\n") == 1
        assert "3/3 step 3" in text.rsplit("\r", 1)[1]
    else:
        assert text == ""


def test_without_cupy_the_hint_names_commands_that_work():
    code = ("import sys; sys.modules['cupy'] = None\n"   # an import of cupy now fails
            "from cufa.__main__ import main\n"
            "for command in ('check', 'info', 'warmup'):\n"
            "    print(command, 'exits', main([command]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    text = r.stdout + r.stderr
    assert "check exits 0" in text and "info exits 0" in text and "warmup exits 1" in text
    for start in ("CuPy is not installed", "CuPy/NVRTC unavailable", "NVRTC unavailable"):
        line = next(line for line in text.splitlines() if line.startswith(start))
        assert "pip install -e '.[cuda13]'" in line and "python -m build" in line, line
        assert f"pip install 'dist/cufa-{cufa.__version__}-py3-none-any.whl[cuda13]'" in line
        assert "'cufa[" not in line   # cufa is on no package index
