#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck over bench/sanitize_cases.py (every kernel
# variant at odd sizes, packed batches with empty sequences, SDPA masks), for the
# device's kernel family and, on Hopper, its 64- and 192-row tiles (CUFA_SM90_BLOCK_M=64 or
# 192, on every batch), the portable family, and the TMA decode kernel on every KV-cache
# call it can take (CUFA_DECODE_TMA=1 and 2, the KV-cache cases only). Logs under $OUT.
#   bash bench/sanitize.sh [family...]     # default, bm64, bm192, sm80, tma1, tma2
set -u
OUT=${OUT:-/tmp/cufa-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
families="default"
python3 -c "import cupy,sys; sys.exit(cupy.cuda.Device().compute_capability != '90')" \
  && families="default bm64 bm192 sm80 tma1 tma2"
[ $# -gt 0 ] && families="$*"
status=0
for family in $families; do
  for tool in memcheck racecheck; do
    log="$OUT/sanitize_${tool}_${family}.txt"
    unset CUFA_KERNEL_FAMILY CUFA_SM90_BLOCK_M CUFA_DECODE_TMA
    cases=
    case $family in
      bm64) export CUFA_SM90_BLOCK_M=64 ;;
      bm192) export CUFA_SM90_BLOCK_M=192 ;;
      sm80) export CUFA_KERNEL_FAMILY=sm80 ;;
      tma1) export CUFA_DECODE_TMA=1; cases=--kvcache-only ;;
      tma2) export CUFA_DECODE_TMA=2; cases=--kvcache-only ;;
    esac
    compute-sanitizer --tool "$tool" --error-exitcode 3 python3 bench/sanitize_cases.py $cases > "$log" 2>&1
    rc=$?
    status=$((status | rc))
    echo "$tool $family: rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|sanitize cases' "$log" | tr '\n' ' ')"
  done
done
exit $status
