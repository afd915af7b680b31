#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck over tests/stress/sanitize_cases.py (every
# kernel variant at odd sizes, packed batches with empty sequences, SDPA masks, the
# KV-cache kernels; every call's values checked against the reference), for the device's
# kernel family and, on Hopper, its 64- and 192-row tiles (CUFA_SM90_BLOCK_M=64 or 192,
# on every batch), the portable family (CUFA_KERNEL_FAMILY=sm80), and the TMA decode
# kernel on every KV-cache call it can take (CUFA_DECODE_TMA=1 and 2, the KV-cache calls
# only). Logs and a summary table, sanitize_summary.md (per family and tool: calls, value
# checks, sanitizer errors, seconds), under $OUT.
#   bash tests/stress/sanitize.sh [family...]     # default, bm64, bm192, sm80, tma1, tma2
# TOOLS picks the tools (default "memcheck racecheck"); CUFA_TREE names the tree in the
# summary where git cannot.
set -u
OUT=${OUT:-/tmp/cufa-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
families="default"
python3 -c "import cupy,sys; sys.exit(cupy.cuda.Device().compute_capability != '90')" 2> /dev/null \
  && families="default bm64 bm192 sm80 tma1 tma2"
[ $# -gt 0 ] && families="$*"
for family in $families; do
  case $family in
    default | bm64 | bm192 | sm80 | tma1 | tma2) ;;
    *) echo "unknown family $family (default, bm64, bm192, sm80, tma1, tma2)"; exit 2 ;;
  esac
done
tools=${TOOLS:-memcheck racecheck}
summary=$OUT/sanitize_summary.md
tree=${CUFA_TREE:-$(git describe --always --dirty 2> /dev/null || echo "unknown (pass CUFA_TREE)")}
{
  echo "# compute-sanitizer over tests/stress/sanitize_cases.py"
  echo
  echo "- command: TOOLS=\"$tools\" bash tests/stress/sanitize.sh $families"
  echo "- tree: $tree"
  echo "- device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
  echo "- compute-sanitizer: $(compute-sanitizer --version | grep -m1 Version)"
  echo
  echo "| family | tool | calls | value checks passed | failed | sanitizer | exit | seconds |"
  echo "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: |"
} > "$summary"
status=0
for family in $families; do
  for tool in $tools; do
    log="$OUT/sanitize_${tool}_${family}.txt"
    unset CUFA_KERNEL_FAMILY CUFA_SM90_BLOCK_M CUFA_DECODE_TMA
    cases=
    case $family in
      default) ;;
      bm64) export CUFA_SM90_BLOCK_M=64 ;;
      bm192) export CUFA_SM90_BLOCK_M=192 ;;
      sm80) export CUFA_KERNEL_FAMILY=sm80 ;;
      tma1) export CUFA_DECODE_TMA=1; cases=--kvcache-only ;;
      tma2) export CUFA_DECODE_TMA=2; cases=--kvcache-only ;;
    esac
    start=$SECONDS
    compute-sanitizer --tool "$tool" --error-exitcode 3 \
      python3 tests/stress/sanitize_cases.py $cases > "$log" 2>&1
    rc=$?
    status=$((status | rc))
    # "sanitize cases: 147 calls, family sm90; value checks: 147 passed, 0 failed"
    line=$(grep '^sanitize cases:' "$log" | tail -1)
    calls=$(sed -nE 's/^sanitize cases: ([0-9]+) calls.*/\1/p' <<< "$line")
    passed=$(sed -nE 's/.*value checks: ([0-9]+) passed.*/\1/p' <<< "$line")
    failed=$(sed -nE 's/.*passed, ([0-9]+) failed.*/\1/p' <<< "$line")
    found=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1 | sed -E 's/^=+ *//')
    echo "| $family | $tool | ${calls:-?} | ${passed:-?} | ${failed:-?} |" \
      "${found:-no summary: see $(basename "$log")} | $rc | $((SECONDS - start)) |" >> "$summary"
    echo "$tool $family: rc=$rc, ${line:-no summary line}; ${found:-no sanitizer summary}" \
      "($((SECONDS - start)) s)"
  done
done
exit $status
