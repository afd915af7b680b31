#!/usr/bin/env bash
# The recorded stress runs in one device call: compute-sanitizer's memcheck and racecheck
# over every kernel family (sanitize.sh, one process a family and tool, side by side) and the fuzz
# (fuzz.py, one process a seed, side by side), all on the one GPU at once; then one
# summary, $OUT/stress_summary.md, and the logs in $OUT/stress_logs.tgz (a device call
# returns at most 8 files).
#   CUFA_TREE=<commit, named on this side> [FUZZ_SEEDS="41 42 43 44"] [FUZZ_MINUTES=3]
#       [FAMILIES="default bm64 bm192 sm80 tma1 tma2"] [STRESS_LIMIT=540] bash tests/stress/record.sh
# The fuzz minutes add up over the seeds (4 x 3 = 12 minutes of cases). Meant to fit one
# 10-minute call (the slowest family and tool, sm80 racecheck, took 3.4 minutes on an H100
# beside four others, before the workload gained the element-wise variants and sinks); run
# with `timeout` and fewer FAMILIES if a first run says otherwise. The GPU machine's copy
# of the checkout can carry an older .git, so CUFA_TREE must name the tree. Every process
# stops at STRESS_LIMIT seconds (a sanitizer row it had not finished says so), so that the
# summary comes back from a call that has a limit of its own.
set -u
: "${CUFA_TREE:?name the tree: CUFA_TREE=<commit>, as git on the GPU machine may be stale}"
OUT=${OUT:-/tmp/cufa-out}
LOGS=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 CUFA_TREE
seeds=${FUZZ_SEEDS:-41 42 43 44}
minutes=${FUZZ_MINUTES:-3}
families=${FAMILIES-default bm64 bm192 sm80 tma1 tma2}  # (FAMILIES="": the fuzz alone)
limit=${STRESS_LIMIT:-540}
start=$SECONDS
python3 -m cufa warmup > "$LOGS/warmup.txt" 2>&1  # (each process would compile alike)
tools="memcheck racecheck"
for family in $families; do
  for tool in $tools; do
    mkdir -p "$LOGS/sanitize_${family}_$tool"
    OUT=$LOGS/sanitize_${family}_$tool TOOLS=$tool timeout -k 10 "$limit" \
      bash tests/stress/sanitize.sh "$family" \
      > "$LOGS/sanitize_${family}_$tool.log" 2>&1 &
  done
done
for seed in $seeds; do
  timeout -k 10 "$limit" python3 tests/stress/fuzz.py --minutes "$minutes" --seed "$seed" \
    --out "$LOGS/fuzz_$seed.md" > "$LOGS/fuzz_$seed.log" 2>&1 &
done
wait
{
  echo "# Recorded stress runs"
  echo
  echo "- tree: $CUFA_TREE"
  echo "- device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
  echo "- command: FUZZ_SEEDS=\"$seeds\" FUZZ_MINUTES=$minutes FAMILIES=\"$families\"" \
    "STRESS_LIMIT=$limit" \
    "bash tests/stress/record.sh ($((SECONDS - start)) s, everything side by side)"
  echo
  echo "## compute-sanitizer"
  echo
  first=1
  for family in $families; do
    for tool in $tools; do
      s=$LOGS/sanitize_${family}_$tool/sanitize_summary.md
      if [ ! -f "$s" ]; then echo "- $family $tool: no summary (see its log)"; continue; fi
      grep -E '^\| ' "$s" | grep -qvE '^\| (family|---)' \
        || { echo "- $family $tool: unfinished at ${limit} s (see its log)"; continue; }
      if [ $first = 1 ]; then
        grep -E '^- compute-sanitizer' "$s"; echo; grep -E '^\| (family|---)' "$s"; first=0
      fi
      grep -E '^\| ' "$s" | grep -vE '^\| (family|---)'
    done
  done
  echo
  echo "## Fuzz"
  echo
  echo "| seed | minutes | cases | failed |"
  echo "| ---: | ---: | ---: | ---: |"
  for seed in $seeds; do
    f=$LOGS/fuzz_$seed.md
    if [ ! -f "$f" ]; then echo "| $seed | ? | no summary (see its log) | ? |"; continue; fi
    ran=$(sed -nE 's/^- seed: [0-9]+; minutes: ([0-9.]+) ran.*/\1/p' "$f")
    cases=$(sed -nE 's/^- cases: ([0-9]+), failed: ([0-9]+)/\1/p' "$f")
    failed=$(sed -nE 's/^- cases: ([0-9]+), failed: ([0-9]+)/\2/p' "$f")
    echo "| $seed | $ran | $cases | $failed |"
  done
  for seed in $seeds; do
    [ -f "$LOGS/fuzz_$seed.md" ] && grep -q '^## Failures' "$LOGS/fuzz_$seed.md" \
      && { echo; echo "### Seed $seed's failures"; sed -n '/^## Failures/,$p' "$LOGS/fuzz_$seed.md" | tail -n +2; }
  done
} > "$OUT/stress_summary.md"
tar -czf "$OUT/stress_logs.tgz" -C "$LOGS" .
cat "$OUT/stress_summary.md"
