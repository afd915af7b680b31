#!/usr/bin/env bash
# One call on the GPU machine: installs nothing; device info, the GPU tests, the
# self-check and (with --bench) the benchmark; full logs under $OUT, a short summary last.
#   bash bench/device_run.sh [--bench] [pytest args...]
set -u
OUT=${OUT:-/tmp/cufa-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # JAX would otherwise take 75% of the GPU
bench=0
if [ "${1:-}" = "--bench" ]; then bench=1; shift; fi

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv \
  > "$OUT/nvidia-smi.txt" 2>&1
python3 -m cufa info > "$OUT/info.txt" 2>&1
python3 -m pytest -q -m gpu -p no:cacheprovider --durations=10 "${@:-tests}" > "$OUT/gpu_tests.txt" 2>&1
tests_rc=$?
python3 -m cufa > "$OUT/check.txt" 2>&1
check_rc=$?
if [ $bench = 1 ]; then
  python3 bench/bench_fwd.py --out "$OUT" > "$OUT/bench.txt" 2>&1
fi

echo "== device"; cat "$OUT/nvidia-smi.txt"; head -4 "$OUT/info.txt"
echo "== GPU tests (rc=$tests_rc)"; grep -E "^(FAILED|ERROR)|passed|failed|error" "$OUT/gpu_tests.txt" | tail -25
echo "== self-check (rc=$check_rc)"; tail -12 "$OUT/check.txt"
if [ $bench = 1 ]; then echo "== bench"; tail -40 "$OUT/bench.txt"; fi
