"""CPU: tests/stress/fuzz.py draws every kind of case it counts (its --dry-run launches
nothing), so the script cannot break, or stop drawing a kind, between its GPU runs."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")  # (the fuzz imports it, and the GPU tests' helpers)

FUZZ = Path(__file__).resolve().parent / "stress" / "fuzz.py"


def test_dry_run_draws_every_kind():
    run = subprocess.run([sys.executable, str(FUZZ), "--seed", "1", "--dry-run", "600"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    counts = {}
    for line in run.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 3 and cells[1].isdigit():
            counts[cells[0]] = int(cells[1])
    fuzz = _load_fuzz()
    assert set(counts) == set(fuzz.TAGS)
    never = [tag for tag, n in counts.items() if n == 0]
    assert not never, f"kinds a 600-case dry run never drew: {never}"


@pytest.mark.parametrize("seed", [2, 3])
def test_draws_reach_the_newest_kernels(seed):
    """Any head dim 1..256, unaligned layouts, sinks of every dtype, windows with -1 on
    either side: each drawn within 400 cases of a seed."""
    fuzz = _load_fuzz()
    dims, sinks, windows, layouts = set(), set(), set(), set()
    for index in range(400):
        _, s = fuzz.case(seed, index)
        spec = s.get("spec", s)
        dims.add(spec.get("d", 0))
        masks = s.get("masks", {})
        sinks.add(masks.get("sink") or s.get("sink") or spec.get("sink"))
        window = masks.get("window_size") or spec.get("window_size")
        if window:
            windows.add((window[0] < 0, window[1] < 0))
        layouts.add(s.get("layout"))
    assert any(d % 8 for d in dims) and any(d % 8 == 0 for d in dims) and max(dims) > 128
    assert {"float32", "float16", "bfloat16"} <= sinks
    assert {(True, False), (False, True), (False, False)} <= windows
    assert {"odd", "shifted"} <= layouts


_module = None


def _load_fuzz():
    global _module
    if _module is None:
        spec = importlib.util.spec_from_file_location("cufa_fuzz", FUZZ)
        _module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_module)
    return _module
