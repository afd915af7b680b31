#!/usr/bin/env bash
# A/B of cufa trees: this checkout's bench_fwd.py, bench_varlen.py, bench_decode.py,
# bench_bwd.py and bench_mla.py, run once per tree per round with PYTHONPATH=_ab/<tree> (the scripts use
# only cufa's public API), the trees in a new random order each round, then one table per
# benchmark: each row's time per tree (median over rounds), the spread between rounds, and
# the ratio to the first tree given to prepare.
#   here:        bash bench/ab.sh prepare OLD NEW [REV...]  # each rev's cufa, kernels_cu and
#                                                          # tests into _ab/<short hash>/ (ignored)
#   on the GPU:  bash bench/ab.sh run [fwd] [varlen] [decode] [bwd] [mla]  # default: first three;
#                                                          # carry ["_ab"]
#                bash bench/ab.sh test [pytest args]       # each tree's own GPU tests
#                bash bench/ab.sh table [DIR]              # the tables again from a run's files
# Environment: ROUNDS (3), OUT (/tmp/cufa-ab), WARMUP (1: compile each tree's kernels with
# `python -m cufa warmup` before the rounds; 0: the first round compiles what it uses),
# FWD_ARGS, VARLEN_ARGS, DECODE_ARGS, BWD_ARGS, MLA_ARGS (default: each script's grid, cufa
# only; two trees take ~5 min for `run fwd varlen` and ~7 min for `run decode` on an H200,
# so the A/B rule's run is two calls on one warm machine; `run bwd` is for a change to
# the backward's kernels, `run mla` for the MLA decode kernel's). Each round prints the
# time so far; a run cut short keeps its files, and `table` prints what they hold; a
# finished run leaves $OUT/table.txt and $OUT/rounds.tgz (the rounds' files, which `table`
# also reads). The A/B rule (a row over the baseline by more than 3 % and its spread is
# SLOWER): docs/benchmarks.md.
# ROUNDS=0 only compiles (one call), then WARMUP=0 times (the next call, same machine).
set -eu
FWD_ARGS=${FWD_ARGS:---reps 24 --no-peers --no-memory --no-plot}
VARLEN_ARGS=${VARLEN_ARGS:---reps 32 --no-peers}
DECODE_ARGS=${DECODE_ARGS:---reps 24 --no-peers --no-plot}
BWD_ARGS=${BWD_ARGS:---reps 12 --no-peers}
MLA_ARGS=${MLA_ARGS:---reps 24}
OUT=${OUT:-/tmp/cufa-ab}
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1

trees() {  # the prepared trees, the baseline first
  [ -f _ab/ORDER ] || { echo "no _ab/ORDER: run 'bash bench/ab.sh prepare OLD NEW' first" >&2; exit 2; }
  cut -d' ' -f1 _ab/ORDER
}

table() {
  python3 - "$1" <<'PY'
import glob, json, os, statistics, sys

out = sys.argv[1]
order = [line.split()[0] for line in open("_ab/ORDER")] if os.path.exists("_ab/ORDER") else []
# The rule for a kernel, tile, route or launch change (docs/benchmarks.md): a row is slower
# where the tree's time is over the baseline's by more than 3 % and by more than the larger
# of the two trees' spreads over the rounds
SLOWER = 1.03
if os.path.exists("_ab/ORDER"):
    print("trees (the first is the baseline):")
    for line in open("_ab/ORDER"):
        print("  " + line.rstrip())


def head_dims(r):
    """A row's head dim, "q/v" where v has one of its own (bench_fwd.py --deepseek)."""
    return f"{r['head_dim']}/{r['head_dim_v']}" if r.get("head_dim_v") else r["head_dim"]


def fwd_rows(data):
    for r in data["rows"]:
        name = (f"{r['dtype']} d={head_dims(r)} N={r['seqlen']} "
                f"{'causal' if r['causal'] else 'full'}"
                + (f" {r['nheads']}/{r['nheads_k']}" if r["nheads"] != r["nheads_k"] else ""))
        if "ms" in r["impls"].get("cufa", {}):
            yield name, r["impls"]["cufa"]["ms"] * 1e3
        if "ms" in r["impls"].get("cufa_fp8", {}):  # (bench_fwd.py --fp8)
            yield name + " fp8", r["impls"]["cufa_fp8"]["ms"] * 1e3


def varlen_rows(data):
    for r in data["rows"]:
        name = f"{r['batch']} d={r['d']} {'causal' if r['causal'] else 'full'}"
        for key, label in (("cufa_ms", "varlen"), ("padded_ms", "padded"), ("fp8_ms", "fp8")):
            if r.get(key):
                yield f"{name} {label}", r[key] * 1e3


def decode_rows(data):
    for r in data["rows"]:
        name = (f"{r['dtype']} d={r['head_dim']} {r['nheads']}/{r['nheads_k']} "
                f"{r['batch']}x{r['seqlen']} sq={r['seqlen_q']}")
        for impl, v in r["impls"].items():
            if impl.startswith("cufa") and "us" in v:
                yield f"{name} {impl[4:].lstrip('_') or 'contiguous'}", v["us"]
    mixed = data.get("mixed") or {}
    if "us" in mixed:
        yield "serving step, one call", mixed["us"]
        yield "serving step, two calls", mixed["two_calls_us"]
    if mixed.get("fp8_us"):
        yield "serving step, fp8 cache", mixed["fp8_us"]


def reasons(data):
    """Why cufa has no time in a results file's rows (the benchmarks' "na" entries)."""
    for r in data["rows"]:
        for impl, v in r.get("impls", {}).items():
            if impl.startswith("cufa") and isinstance(v, dict) and "na" in v:
                yield v["na"]


def bwd_rows(data):
    for r in data["rows"]:
        name = (f"{r['dtype']} d={head_dims(r)} N={r['seqlen']} "
                f"{'causal' if r['causal'] else 'full'}")
        for impl, v in r["impls"].items():
            if impl.startswith("cufa") and "ms" in v:
                yield f"{name} {impl[4:].strip() or 'backward'}", v["ms"] * 1e3


def mla_rows(data):
    for r in data["rows"]:
        if "ms" in r:
            yield (f"{r['heads']} heads B={r['batch']} N={r['seqlen']} sq={r['seqlen_q']} "
                   f"pages {r['page']}"), r["ms"] * 1e3


READERS = {"fwd": fwd_rows, "varlen": varlen_rows, "decode": decode_rows, "bwd": bwd_rows,
           "mla": mla_rows}
missing = 0
for bench, read in READERS.items():
    files = sorted(glob.glob(os.path.join(out, bench, "*.*", f"bench_{bench}.json")))
    if not files:
        continue
    times = {}  # row -> tree -> [us per round]
    why = {}    # tree -> a reason a row went untimed
    for f in files:
        tree = os.path.basename(os.path.dirname(f)).rsplit(".", 1)[0]
        data = json.load(open(f))
        for row, us in read(data):
            times.setdefault(row, {}).setdefault(tree, []).append(us)
        for reason in reasons(data):
            why.setdefault(tree, reason)
    seen = {t for per_tree in times.values() for t in per_tree}
    # A tree that timed nothing (or fewer rows than the others) is said, not dropped: a
    # tree whose API lacks an argument the script passes would otherwise vanish from the
    # table without a word
    for t in order + sorted(set(why) - set(order)):
        rows_of_t = sum(1 for per_tree in times.values() if t in per_tree)
        if rows_of_t < len(times):
            missing += 1
            print(f"\n!! bench_{bench}: tree {t} has {rows_of_t} of {len(times)} rows"
                  + (f"; first reason: {why[t]}" if t in why else ""))
    names = [t for t in order if t in seen] + sorted(seen - set(order))
    base = names[0]
    width = max(len(r) for r in times) + 2
    meta = json.load(open(files[0]))["meta"]
    print(f"\n== bench_{bench} on {meta.get('device', '?')}: us a call, median over rounds "
          f"(spread: (max - min) / median over rounds); ratio: tree / {base}; * where the "
          "ratio is off 1 by more than the larger spread; SLOWER / faster where it is also "
          f"off by more than {SLOWER - 1:.0%}")
    print("row".ljust(width) + "".join(f"{t:>20}" for t in names)
          + "".join(f"{t + '/' + base[:7]:>18}" for t in names[1:]))
    ratios = {t: [] for t in names[1:]}
    slower = {t: [] for t in names[1:]}
    for row, per_tree in times.items():
        cells, stats = [], {}
        for t in names:
            got = per_tree.get(t, [])
            if got:
                med = statistics.median(got)
                spread = (max(got) - min(got)) / med
                stats[t] = (med, spread)
                cells.append(f"{med:10.1f} ({100 * spread:4.1f} %)")
            else:
                cells.append("-")
        line = row.ljust(width) + "".join(f"{c:>20}" for c in cells)
        for t in names[1:]:
            if t in stats and base in stats:
                ratio = stats[t][0] / stats[base][0]
                ratios[t].append(ratio)
                spread = max(stats[t][1], stats[base][1])
                off = abs(ratio - 1) > spread
                mark = "*" if off else " "
                if off and ratio > SLOWER:
                    mark = "* SLOWER"
                    slower[t].append(f"{row} {ratio:.3f}")
                elif off and ratio < 2 - SLOWER:
                    mark = "* faster"
                line += f"{ratio:17.3f}{mark:<9}"
            else:
                line += f"{'-':>18}"
        print(line)
    for t, rs in ratios.items():
        if rs:
            gmean = statistics.geometric_mean(rs)
            print(f"{t} / {base}: {len(rs)} rows, geometric mean {gmean:.3f}, "
                  f"range {min(rs):.3f}-{max(rs):.3f}, rounds a tree "
                  f"{min(len(v.get(t, [])) for v in times.values())}; "
                  f"{len(slower[t])} rows SLOWER" + "".join(f"\n  SLOWER {x}" for x in slower[t]))
sys.exit(1 if missing else 0)
PY
}

case "${1:-}" in
prepare)
  shift
  [ $# -ge 1 ] || { sed -n 7,8p "$0" >&2; exit 2; }
  rm -rf _ab
  mkdir -p _ab
  for rev in "$@"; do
    short=$(git rev-parse --short "$rev")
    [ ! -d "_ab/$short" ] || { echo "$rev: tree $short given twice" >&2; exit 2; }
    mkdir -p "_ab/$short"
    paths=()
    for p in cufa kernels_cu tests setup.cfg pyproject.toml; do
      if git cat-file -e "$rev:$p" 2> /dev/null; then paths+=("$p"); fi
    done
    git archive "$rev" "${paths[@]}" | tar -x -C "_ab/$short"
    echo "$short $rev $(git log -1 --format='%cs %s' "$rev")" >> _ab/ORDER
  done
  cat _ab/ORDER ;;
run)
  shift
  benches=("$@")
  [ ${#benches[@]} -gt 0 ] || benches=(fwd varlen decode)
  for b in "${benches[@]}"; do
    case $b in fwd|varlen|decode|bwd|mla) ;; *) echo "unknown benchmark $b: fwd, varlen, decode, bwd or mla" >&2; exit 2 ;; esac
  done
  names=$(trees)
  # CUFA_* overrides build or route other kernels than the trees' own (CUFA_SPIN_LIMIT's
  # guarded waits halve the MLA kernel's speed): a run times each tree as users get it
  if [ "${AB_KEEP_ENV:-0}" != 1 ]; then
    for v in $(env | sed -n 's/^\(CUFA_[A-Z0-9_]*\)=.*/\1/p'); do
      echo "ab.sh run: $v unset for the timings (AB_KEEP_ENV=1 keeps it)"; unset "$v"
    done
  fi
  mkdir -p "$OUT"
  start=$SECONDS
  # each tree's kernels compiled before any timing (CuPy's disk cache keeps them)
  if [ "${WARMUP:-1}" = 1 ]; then
    for t in $names; do
      PYTHONPATH=$PWD/_ab/$t python3 -m cufa warmup > "$OUT/warmup.$t.log" 2>&1 \
        || echo "$t: warmup failed (see $OUT/warmup.$t.log); its first round compiles instead"
    done
    echo "warmup done at $((SECONDS - start)) s"
  fi
  failed=0
  for round in $(seq "${ROUNDS:-3}"); do
    for b in "${benches[@]}"; do
      case $b in fwd) args=$FWD_ARGS ;; varlen) args=$VARLEN_ARGS ;; decode) args=$DECODE_ARGS ;;
        bwd) args=$BWD_ARGS ;; mla) args=$MLA_ARGS ;; esac
      for t in $(echo "$names" | shuf); do  # a new order each round: drift falls on every tree
        dir=$OUT/$b/$t.$round
        mkdir -p "$dir"
        # shellcheck disable=SC2086  # the arguments are word lists
        if ! PYTHONPATH=$PWD/_ab/$t python3 "bench/bench_$b.py" $args --out "$dir" \
            > "$dir.log" 2>&1; then
          echo "round $round bench_$b $t failed: tail of $dir.log"; tail -5 "$dir.log"; failed=1
        fi
      done
    done
    echo "round $round done at $((SECONDS - start)) s"
  done
  # The device tool returns a few files and no deep folders: the table and one archive of
  # the rounds (`table DIR` reads either)
  table "$OUT" > "$OUT/table.txt" || failed=1
  cat "$OUT/table.txt"
  tar czf "$OUT/rounds.tgz" -C "$OUT" "${benches[@]}" && rm -rf "${benches[@]/#/$OUT/}"
  exit $failed ;;
table)
  dir=${2:-$OUT}
  if [ -f "$dir/rounds.tgz" ]; then
    tmp=$(mktemp -d); tar xzf "$dir/rounds.tgz" -C "$tmp"; dir=$tmp
  fi
  table "$dir" ;;
test)
  shift
  mkdir -p "$OUT"
  status=0
  for t in $(trees); do
    (cd "_ab/$t" && PYTHONPATH=$PWD python3 -m pytest -q -m gpu -p no:cacheprovider "${@:-tests}") \
      > "$OUT/$t.tests.log" 2>&1 || status=1
    echo "$t tests: $(grep -E 'passed|failed|error|skipped' "$OUT/$t.tests.log" | tail -1)"
  done
  exit $status ;;
*)
  sed -n 2,21p "$0" >&2; exit 2 ;;
esac
