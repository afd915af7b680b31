#!/usr/bin/env bash
# A/B of kernel revisions on the packed-batch benchmark (with BENCH=decode, the KV-cache
# decode benchmark; with BENCH=fwd, dense forward shapes through bench/ab_fwd_probe.py),
# each tree in its own process, in a new random order each round, so that clock and
# thermal drift fall on all of them alike.
#   here:       bash bench/ab_varlen.sh prepare REV [REV...]   # git trees into _ab/ (ignored)
#   on the GPU: bash bench/ab_varlen.sh run                    # (device tool: carry ["_ab"])
#               bash bench/ab_varlen.sh test [pytest args]     # each tree's own GPU tests
#                                                              # (SANITIZE=1: and the KV-cache
#                                                              # cases under compute-sanitizer,
#                                                              # tests/stress/sanitize_cases.py)
# ROUNDS (3), REPS (30) and BATCHES (short) from the environment; with BENCH=decode,
# DECODE_ARGS (default: --shapes 1x32768,1x131072,64x4096 --dtypes fp16 --no-peers); with
# BENCH=fwd, FWD_SHAPES (d:N:causal[:bf16],...; default: ab_fwd_probe.py's) and PEERS
# (SDPA backends timed beside the trees: "cudnn flash").
set -eu
case "${1:-}" in
prepare)
  shift
  rm -rf _ab
  for rev in "$@"; do
    dir=_ab/$(git rev-parse --short "$rev")
    mkdir -p "$dir"
    git archive "$rev" cufa kernels_cu bench tests | tar -x -C "$dir"
    echo "$(basename "$dir") $rev" >> _ab/ORDER  # the first is the baseline of the summary
  done
  cat _ab/ORDER ;;
test)
  # Candidate branches checked in one device call: each tree's GPU tests (default kernel
  # family) against that tree's own code, then optionally the sanitizer.
  shift
  OUT=${OUT:-/tmp/cufa-ab}
  mkdir -p "$OUT"
  export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
  status=0
  for tree in _ab/*/; do
    name=$(basename "$tree")
    (cd "$tree" && PYTHONPATH=$PWD python3 -m pytest -q -m gpu -p no:cacheprovider "${@:-tests}") \
      > "$OUT/$name.tests.log" 2>&1 || status=1
    echo "$name tests: $(grep -E 'passed|failed|error|skipped' "$OUT/$name.tests.log" | tail -1)"
    if [ "${SANITIZE:-0}" = 1 ]; then
      cases=tests/stress/sanitize_cases.py
      [ -e "$tree/$cases" ] || cases=bench/sanitize_cases.py  # a tree from before the move
      for tool in memcheck racecheck; do
        (cd "$tree" && PYTHONPATH=$PWD compute-sanitizer --tool $tool --error-exitcode 3 \
          python3 "$cases" --kvcache-only) > "$OUT/$name.$tool.log" 2>&1 || status=1
        echo "$name $tool: $(grep -E 'sanitize cases|ERROR SUMMARY|RACECHECK SUMMARY' \
          "$OUT/$name.$tool.log" | tr '\n' ' ')"
      done
    fi
  done
  exit $status ;;
run)
  OUT=${OUT:-/tmp/cufa-ab}
  mkdir -p "$OUT"
  export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
  # SM clock, power and temperature every 100 ms (read only), to tell a slower tree from
  # a slower spell of the card; the forward summary matches them to each shape's samples
  sampler=
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu \
      --format=csv,noheader,nounits -lms 100 > "$OUT/clocks.csv" 2> /dev/null &
    sampler=$!
  fi
  for round in $(seq "${ROUNDS:-3}"); do
    # the trees in a new random order each round: the clocks drift over a round (the
    # first process of a round read up to 10 % high in some leases), so no tree may
    # always run first or last; with BENCH=fwd the PEERS are shuffled in among them
    names=$(ls -d _ab/*/)
    if [ "${BENCH:-varlen}" = fwd ]; then
      for peer in ${PEERS:-}; do names+=$'\n'"peer:$peer"; done
    fi
    for tree in $(echo "$names" | shuf); do
      name=$(basename "$tree")
      if [ "${BENCH:-varlen}" = fwd ]; then
        case $tree in
          peer:*) probe=(. --peer "${tree#peer:}") ;;  # SDPA's backend; cufa from here, unused
          *) probe=("$tree") ;;
        esac
        python3 bench/ab_fwd_probe.py "${probe[@]}" --reps "${REPS:-30}" \
          ${FWD_SHAPES:+--shapes "$FWD_SHAPES"} >> "$OUT/ab_fwd.jsonl" 2>> "$OUT/ab_fwd.log"
      elif [ "${BENCH:-varlen}" = decode ]; then
        PYTHONPATH=$PWD/$tree python3 "$tree/bench/bench_decode.py" --reps "${REPS:-30}" \
          ${DECODE_ARGS:---shapes 1x32768,1x131072,64x4096 --dtypes fp16 --no-peers} \
          --no-plot --out "$OUT/$name.$round" > "$OUT/$name.$round.log" 2>&1
      else
        PYTHONPATH=$PWD/$tree python3 "$tree/bench/bench_varlen.py" --batches "${BATCHES:-short}" \
          --reps "${REPS:-30}" --out "$OUT/$name.$round" > "$OUT/$name.$round.log" 2>&1
      fi
    done
  done
  if [ -n "$sampler" ]; then kill "$sampler" 2> /dev/null || true; fi
  if [ "${BENCH:-varlen}" = fwd ]; then
    python3 - "$OUT" <<'PY'
import datetime, json, os, statistics, sys
rows = [json.loads(line) for line in open(os.path.join(sys.argv[1], "ab_fwd.jsonl"))]
order = [line.split()[0] for line in open("_ab/ORDER")] + os.environ.get("PEERS", "").split()
# every shape any process timed, in first-seen order (the SDPA peers skip softcap shapes)
shapes = list(dict.fromkeys(k for r in rows for k in r
                            if k != "tree" and not k.endswith((":us", ":t"))))
print(f"TFLOP/s, median over rounds (max), ratio of medians to {order[0]}")
print("d:N:causal".ljust(18), *[t.ljust(22) for t in order])
for shape in shapes:
    base = statistics.median(r[shape] for r in rows if r["tree"] == order[0])
    cells = []
    for tree in order:
        values = [r[shape] for r in rows if r["tree"] == tree and shape in r]
        cells.append((f"{statistics.median(values):6.1f} ({max(values):6.1f}) "
                      f"{statistics.median(values) / base:4.2f}" if values else "-").ljust(22))
    print(shape.ljust(18), *cells)
# clocks: each process's samples of a shape, in run order (tree, TFLOP/s, SM MHz, W)
clock_file = os.path.join(sys.argv[1], "clocks.csv")
samples = []
for line in open(clock_file) if os.path.exists(clock_file) else ():
    try:
        stamp, mhz, watts, temp = (x.strip() for x in line.split(","))
        when = datetime.datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()
        samples.append((when, float(mhz), float(watts), float(temp)))
    except ValueError:
        continue
if samples:
    print("\nper process in run order: TFLOP/s @ median SM MHz / W / deg C over its samples")
    for shape in shapes:
        cells = []
        for r in rows:
            t0, t1 = r.get(shape + ":t", (0, 0))
            inside = [s for s in samples if t0 <= s[0] <= t1]
            if inside:
                mhz, watts, temp = (statistics.median(s[i] for s in inside) for i in (1, 2, 3))
                cells.append(f"{r['tree'][:7]} {r[shape]:.0f}@{mhz:.0f}/{watts:.0f}/{temp:.0f}")
        print(shape.ljust(18), " ".join(cells))
PY
    exit 0
  fi
  if [ "${BENCH:-varlen}" = decode ]; then
    python3 - "$OUT" <<'PY'
import collections, glob, json, os, sys
rows = collections.defaultdict(lambda: collections.defaultdict(list))
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.*", "bench_decode.json"))):
    tree = os.path.basename(os.path.dirname(f)).rsplit(".", 1)[0]
    for r in json.load(open(f))["rows"]:
        key = (r["dtype"], r["head_dim"], f'{r["nheads"]}/{r["nheads_k"]}', r["batch"],
               r["seqlen"], r["seqlen_q"])
        rows[key][tree].append(" ".join(f'{n} {v["us"]:.1f}' for n, v in r["impls"].items()
                                        if isinstance(v, dict) and "us" in v))
print("cufa decode us per round (dtype, d, heads, batch, keys, query tokens): tree -> rounds")
for key, trees in rows.items():
    print(key, dict(trees))
# each column's best round per tree, and its ratio to the baseline tree's (ORDER's first)
order = [line.split()[0] for line in open("_ab/ORDER")] if os.path.exists("_ab/ORDER") else []
names = [t for t in order if any(t in trees for trees in rows.values())] or sorted(
    {t for trees in rows.values() for t in trees})
base = names[0]
print(f"\nbest round, us (ratio to {base}):")
for key, trees in rows.items():
    cells = []
    for tree in names:
        best = {}
        for text in trees.get(tree, []):
            words = text.split()
            for name, value in zip(words[::2], words[1::2]):
                best[name] = min(best.get(name, float("inf")), float(value))
        cells.append((tree, best))
    base_best = cells[0][1]
    line = " | ".join(
        f"{tree}: " + " ".join(f"{n} {v:.1f}" + (f" ({v / base_best[n]:.3f})" if tree != base
                                                  and n in base_best else "")
                               for n, v in best.items()) for tree, best in cells)
    print(key, line)
PY
    exit 0
  fi
  python3 - "$OUT" <<'PY'
import collections, glob, json, os, sys
rows = collections.defaultdict(lambda: collections.defaultdict(list))
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.*", "bench_varlen.json"))):
    tree = os.path.basename(os.path.dirname(f)).rsplit(".", 1)[0]
    for r in json.load(open(f))["rows"]:
        rows[(r["batch"], r["d"], r["causal"])][tree].append(
            f'{r["cufa_tflops"]:.0f}/{r["padded_tflops"]:.0f}')
print("cufa varlen / padded dense TFLOP/s per round (batch, d, causal): tree -> rounds")
for key, trees in rows.items():
    print(key, dict(trees))
PY
  ;;
*) sed -n 2,6p "$0"; exit 2 ;;
esac
