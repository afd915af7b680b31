"""CPU: bench/profile/mla_timeline.py's split of an MLA decode launch, on a table of stamps
made up by hand (the GPU fills it in a CUFA_TRACE=1 build), its rows argument, and that
importing the script asks for no trace build."""
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "profile"))

import mla_timeline as M  # noqa: E402


def stamps(*ctas):
    table = np.zeros((M.CTAS, M.FIELDS), dtype=np.int64)
    for i, (start, q, first_p, loop_end, written, producer_end, blocks, sm) in enumerate(ctas):
        table[i] = start, q, first_p, loop_end, written, producer_end, blocks, sm
    return table


def test_phases_are_medians_over_the_ctas_with_blocks():
    # global-timer ns: three CTAs on two SMs, the launch from 1 us; the third has no key
    # blocks (a split past its sequence's end: no first P), and counts in the span alone
    a = M.analyse(stamps((1000, 4000, 5000, 7000, 9000, 8000, 2, 0),
                         (1200, 5200, 6200, 8200, 11200, 12200, 2, 1),
                         (1100, 0, 0, 1500, 1600, 1500, 0, 1)))
    assert (a["ctas"], a["sms"]) == (3, 2)
    assert a["span_us"] == 11.2  # the producer's end, 12.2 us, past its stores
    assert (a["q_us"], a["first_block_us"], a["loop_us"]) == (3.5, 1.0, 2.0)
    assert a["epilogue_us"] == 2.5 and a["blocks"] == 2 and a["start_spread_us"] == 0.2


def test_rows_argument():
    assert M.rows_arg("128x1x1024, 16x8x4096,") == [(128, 1, 1024), (16, 8, 4096)]


def test_importing_asks_for_no_trace_build():
    assert os.environ.get("CUFA_TRACE") in (None, "")
    assert M.torch is None
