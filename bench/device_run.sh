#!/usr/bin/env bash
# One call on the GPU machine: installs nothing; device info, the GPU tests, the
# self-check, (with --bench) the forward benchmark, (with --decode) the KV-cache decode
# benchmark and (with --host) the launch-cost table; full logs under $OUT, a short summary
# last.
#   bash bench/device_run.sh [--bench] [--decode] [--host] [pytest args...]
# BENCH_ARGS / DECODE_ARGS: extra arguments for bench_fwd.py / bench_decode.py.
set -u
OUT=${OUT:-/tmp/cufa-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # JAX would otherwise take 75% of the GPU
bench=0
decode=0
host=0
while [ $# -gt 0 ]; do
  case "$1" in
    --bench) bench=1; shift ;;
    --decode) decode=1; shift ;;
    --host) host=1; shift ;;
    *) break ;;
  esac
done

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv \
  > "$OUT/nvidia-smi.txt" 2>&1
python3 -m cufa info > "$OUT/info.txt" 2>&1
python3 -m pytest -q -m gpu -p no:cacheprovider --durations=10 "${@:-tests}" > "$OUT/gpu_tests.txt" 2>&1
tests_rc=$?
# On Hopper the default path is wgmma (sm90); run the portable mma.sync path (sm80) too.
if python3 -c "import cupy,sys; sys.exit(cupy.cuda.Device().compute_capability != '90')"; then
  CUFA_KERNEL_FAMILY=sm80 python3 -m pytest -q -m gpu -p no:cacheprovider "${@:-tests}" \
    > "$OUT/gpu_tests_sm80.txt" 2>&1
  tests_rc=$((tests_rc + $?))
  # The 64-row tiles of short packed batches (CUFA_SM90_BLOCK_M) on every forward test,
  # dense ones included, and paged prefill's TMA boxes on them.
  PAGED_PREFILL=tests/test_gpu_kvcache.py::test_varlen_paged_prefill_every_page_size
  CUFA_SM90_BLOCK_M=64 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_gpu_forward.py tests/test_gpu_varlen.py "$PAGED_PREFILL" \
    > "$OUT/gpu_tests_sm90_bm64.txt" 2>&1
  tests_rc=$((tests_rc + $?))
  # and the 192-row tiles (d = 128 takes them from 1-2k query rows a sequence, which few
  # tests reach)
  CUFA_SM90_BLOCK_M=192 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_gpu_forward.py tests/test_gpu_varlen.py "$PAGED_PREFILL" \
    > "$OUT/gpu_tests_sm90_bm192.txt" 2>&1
  tests_rc=$((tests_rc + $?))
  # and the TMA decode kernel on every KV-cache call it can take, one and two units a CTA
  for units in 1 2; do
    CUFA_DECODE_TMA=$units python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/test_gpu_kvcache.py tests/test_gpu_compiled_modes.py \
      > "$OUT/gpu_tests_decode_tma$units.txt" 2>&1
    tests_rc=$((tests_rc + $?))
  done
fi
python3 -m cufa > "$OUT/check.txt" 2>&1
check_rc=$?
if [ $bench = 1 ]; then
  python3 bench/bench_fwd.py --out "$OUT" ${BENCH_ARGS:-} > "$OUT/bench.txt" 2>&1
fi
if [ $decode = 1 ]; then
  python3 bench/bench_decode.py --out "$OUT" ${DECODE_ARGS:-} > "$OUT/bench_decode.txt" 2>&1
fi
if [ $host = 1 ]; then
  python3 bench/host_overhead.py > "$OUT/host_overhead.txt" 2>&1
fi

echo "== device"; cat "$OUT/nvidia-smi.txt"; head -4 "$OUT/info.txt"
echo "== GPU tests (rc=$tests_rc)"
for f in "$OUT"/gpu_tests*.txt; do
  echo "-- $(basename "$f")"; grep -E "^(FAILED|ERROR)|passed|failed|error" "$f" | tail -15
done
echo "== self-check (rc=$check_rc)"; grep -E "FAIL|self-check|^\|" "$OUT/check.txt" | tail -20
if [ $bench = 1 ]; then echo "== bench"; tail -40 "$OUT/bench.txt"; fi
if [ $decode = 1 ]; then echo "== decode bench"; tail -22 "$OUT/bench_decode.txt"; fi
if [ $host = 1 ]; then echo "== launch cost"; grep -E "^\|" "$OUT/host_overhead.txt"; fi
