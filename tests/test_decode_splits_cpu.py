"""CPU: bench/profile/decode_splits.py's rows and columns (its --dry-run), and that its
forcing of one or two KV heads a CTA goes through the planner's own head_pairs rule."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "profile"))
sys.path.insert(0, str(ROOT / "bench"))

import decode_splits  # noqa: E402


def test_dry_run_lists_each_row_with_its_columns():
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "profile" / "decode_splits.py"),
                          "--dry-run", "--shapes", "256x1024,1x131072", "--heads", "32/8",
                          "--splits", "1,4"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == 2 * 2 * 2  # shapes x head dims x caches
    assert lines[0] == "256x1024 32/8 d=64 e4m3: plan, 2h s1, 1h s1, 2h s4, 1h s4"
    assert "1x131072 32/8 d=128 fp16: plan, s1, s4" in lines


def test_columns_and_bad_caches():
    assert decode_splits.columns("e4m3", 128, (2,)) == [("plan", None, 0), ("s2", None, 2)]
    assert decode_splits.columns("e4m3", 64, (2,))[1:] == [("2h s2", 2, 2), ("1h s2", 1, 2)]
    assert decode_splits._pairs("256x1024, 32/8") == [(256, 1024), (32, 8)]
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "profile" / "decode_splits.py"),
                          "--dry-run", "--caches", "e5m2"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0 and "--caches takes e4m3" in run.stderr
