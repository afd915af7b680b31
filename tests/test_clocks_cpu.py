"""CPU: bench/profile/clocks.py's rows (its --dry-run) and its argument checks."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "bench" / "profile" / "clocks.py")


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, "--dry-run", *args], capture_output=True,
                          text=True, timeout=120)


def test_dry_run_lists_each_row_by_values_and_caller():
    got = run("--fwd", "64:4096:0", "--mla", "16:8:1024:1:e4m3", "--values", "randn,zeros",
              "--peers")
    assert got.returncode == 0, got.stderr
    assert got.stdout.splitlines() == [
        "fwd d=64 N=4096 4x32, randn: cufa", "fwd d=64 N=4096 4x32, randn: sdpa_cudnn",
        "fwd d=64 N=4096 4x32, zeros: cufa", "fwd d=64 N=4096 4x32, zeros: sdpa_cudnn",
        "mla 16 heads B=8 N=1024 sq=1 e4m3, randn: cufa",
        "mla 16 heads B=8 N=1024 sq=1 e4m3, zeros: cufa"]


def test_bad_rows_and_values_are_refused_by_name():
    bad = run("--fwd", "128:4096")
    assert bad.returncode == 2 and "--fwd takes 3 fields a row" in bad.stderr
    bad = run("--values", "ones")
    assert bad.returncode == 2 and "--values takes randn, zeros, const" in bad.stderr
