"""CPU: bench/profile/mla_splits.py's rows and columns (its --dry-run)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "profile"))
sys.path.insert(0, str(ROOT / "bench"))

import mla_splits  # noqa: E402


def test_dry_run_lists_each_row_with_its_columns():
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "profile" / "mla_splits.py"),
                          "--dry-run", "--shapes", "1x1024,8x4096", "--heads", "128,16",
                          "--splits", "1,4"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "128 heads 1x1024: plan, s1, s4", "128 heads 8x4096: plan, s1, s4",
        "16 heads 1x1024: plan, s1, s4", "16 heads 8x4096: plan, s1, s4"]


def test_columns_and_shapes():
    assert mla_splits.columns((2, 8)) == [("plan", 0), ("s2", 2), ("s8", 8)]
    assert mla_splits._shapes("1x1024, 8x4096,") == [(1, 1024), (8, 4096)]
