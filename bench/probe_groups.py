"""bench_fwd.py with the persistent scheduler's head groups changed (a probe of its
tail; cufa's public API otherwise):
  PROBE_GROUP=all | half | N   heads a group (unset: _heuristics.heads_per_group's)
  PROBE_TAIL=X                 _heuristics.TAIL_BALANCE (0: no tail rule, the last
                               group as short as it falls)

    PROBE_TAIL=0 python3 bench/probe_groups.py --head-dims 256 --causal 1 --no-peers ...
"""
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402,F401  (finds the checkout's cufa)
from cufa import _heuristics  # noqa: E402

rule = _heuristics.heads_per_group
forced = os.environ.get("PROBE_GROUP")


def forced_heads_per_group(heads, *args):
    if forced == "all":
        return heads
    if forced == "half":
        return max(1, -(-heads // 2))
    return min(heads, int(forced)) if forced else rule(heads, *args)


_heuristics.heads_per_group = forced_heads_per_group
if os.environ.get("PROBE_TAIL"):
    _heuristics.TAIL_BALANCE = float(os.environ["PROBE_TAIL"])
sys.argv[0] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_fwd.py")
runpy.run_path(sys.argv[0], run_name="__main__")
