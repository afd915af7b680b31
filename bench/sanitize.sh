#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck over bench/sanitize_cases.py (every kernel
# variant at odd sizes, packed batches with empty sequences, SDPA masks), for the
# device's kernel family and, on Hopper, the portable one too. Logs under $OUT.
#   bash bench/sanitize.sh
set -u
OUT=${OUT:-/tmp/cufa-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
families="default"
python3 -c "import cupy,sys; sys.exit(cupy.cuda.Device().compute_capability != '90')" \
  && families="default sm80"
status=0
for family in $families; do
  for tool in memcheck racecheck; do
    log="$OUT/sanitize_${tool}_${family}.txt"
    if [ "$family" = default ]; then unset CUFA_KERNEL_FAMILY; else export CUFA_KERNEL_FAMILY=$family; fi
    compute-sanitizer --tool "$tool" --error-exitcode 3 python3 bench/sanitize_cases.py > "$log" 2>&1
    rc=$?
    status=$((status | rc))
    echo "$tool $family: rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|sanitize cases' "$log" | tr '\n' ' ')"
  done
done
exit $status
