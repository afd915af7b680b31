"""CPU: tools/decode_plans.py, the planner's view of bench_decode.py's rows with the device
stubbed -- run as a user runs it (its own process: it stubs the runtime), its rows checked
against what the planner's rules say for them."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rows(*args):
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "decode_plans.py"), *args],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("batch x keys | heads")
    return {tuple(c.strip() for c in line.split("|")[:6]): [c.strip() for c in line.split("|")[6:]]
            for line in lines[1:]}


def test_plans_of_the_rows_follow_the_split_rules():
    rows = _rows("--shapes", "256x1024,1x131072", "--head-dims", "64,128")
    # (2 shapes x 2 head counts x 2 token counts x 2 head dims x 2 caches x 3 layouts)
    assert len(rows) == 96
    # e4m3 at d = 64, one token: two KV heads a CTA, unsplit from one wave up (1024 pair
    # CTAs, 1.94 waves of 528)
    kernel, splits, ctas, waves = rows[("256x1024", "32/8", "1", "64", "e4m3", "-")]
    assert kernel.endswith("_pairs") and (splits, ctas, waves) == ("1", "1024", "1.94")
    # under one wave: splits for two CTAs an SM (4 pair units x 64 = 256 CTAs)
    assert rows[("1x131072", "32/8", "1", "64", "e4m3", "-")][1:3] == ["64", "256"]
    # the 16-bit cache on an H100 (one CTA an SM keeps up there): 8 units x 16 = 128 CTAs
    h100 = _rows("--device", "h100", "--shapes", "1x131072", "--head-dims", "128")
    assert h100[("1x131072", "32/8", "1", "128", "fp16", "-")][1:3] == ["16", "128"]
