"""CPU: bench/profile/bwd_timeline.py's split of the dk/dv launch's SM-time, on a table of
stamps made up by hand (the GPU fills it in a CUFA_TRACE=1 build), and that importing the
script asks for no trace build."""
import os
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "profile"))

import bwd_timeline  # noqa: E402


def stamps(*ctas):
    table = np.zeros((bwd_timeline.CTAS, bwd_timeline.FIELDS), dtype=np.int64)
    for i, (start, first, loop_end, stored, producer_end, sm) in enumerate(ctas):
        table[i, [0, 1, 2, 3, 4, 7]] = start, first, loop_end, stored, producer_end, sm
    return table


def test_phases_gaps_and_tail_share_the_sms_time():
    # SM 5: two CTAs 1 us apart, the first one's producer done before its stores, the
    # second one's 1 us after them (drain); SM 6: one CTA without a producer stamp, idle for
    # the launch's last 2 us (the tail). Global-timer ns; the launch starts at 1 us.
    a = bwd_timeline.analyse(stamps((1000, 2000, 9000, 10000, 9500, 5),
                                    (11000, 12000, 19000, 20000, 21000, 5),
                                    (1000, 2500, 18000, 19000, 0, 6)))
    assert (a["ctas"], a["sms"], a["span_us"]) == (3, 2, 20.0)
    assert (a["prologue_us"], a["loop_us"], a["epilogue_us"]) == (1.0, 7.0, 1.0)
    assert (a["drain_us"], a["gap_us"]) == (0.0, 1.0)
    share = a["share"]
    assert share["prologue"] == pytest.approx(3.5 / 40)   # (1 + 1 + 1.5) of 2 x 20 us
    assert share["loop"] == pytest.approx(29.5 / 40)      # 7 + 7 + 15.5
    assert share["epilogue"] == pytest.approx(3 / 40)
    assert share["drain"] == pytest.approx(1 / 40)
    assert share["gaps"] == pytest.approx(1 / 40)
    assert share["tail"] == pytest.approx(2 / 40)
    assert sum(share.values()) == pytest.approx(1.0)


def test_a_stepless_cta_counts_no_prologue_or_loop():
    a = bwd_timeline.analyse(stamps((1000, 0, 3000, 4000, 0, 1), (1000, 2000, 9000, 10000, 0, 2)))
    assert (a["prologue_us"], a["loop_us"]) == (1.0, 7.0)


def test_importing_asks_for_no_trace_build():
    assert os.environ.get("CUFA_TRACE") in (None, "")
    assert bwd_timeline.torch is None


def test_two_ctas_an_sm_count_two_slots_and_no_gaps():
    # one SM running two CTAs side by side, then a third in the first one's slot
    a = bwd_timeline.analyse(stamps((1000, 2000, 9000, 10000, 0, 3),
                                    (1000, 2000, 11000, 11000, 0, 3),
                                    (10000, 11000, 20000, 21000, 0, 3)))
    assert a["resident"] == 2 and a["span_us"] == 20.0
    assert np.isnan(a["gap_us"]) and a["share"]["gaps"] == 0
    assert a["share"]["tail"] == pytest.approx(10 / 40)  # the second slot idle from 10 us
    assert a["share"]["loop"] == pytest.approx(25 / 40)  # 7 + 9 + 9
