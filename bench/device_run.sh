#!/usr/bin/env bash
# One call on the GPU machine: installs nothing; device info, the GPU tests (every kernel
# family at once), the self-check, (with --bench) the forward benchmark, (with --decode)
# the KV-cache decode benchmark, (with --mla) the MLA decode benchmark, (with --bwd) the
# backward benchmark, (with --train) the
# GPT training comparison and (with --host) the launch-cost table; full logs in
# $OUT/logs.tgz, a short summary last.
#   [WORKERS=2] [FAMILIES="default sm80"] bash bench/device_run.sh [--bench] [--decode] [--mla] [--bwd]
#       [--train] [--host] [pytest args...]
# BENCH_ARGS / DECODE_ARGS / MLA_ARGS / BWD_ARGS / TRAIN_ARGS: extra arguments for
# bench_fwd.py / bench_decode.py / bench_mla.py / bench_bwd.py / train_gpt.py.
set -u
# Each benchmark stops at STEP_LIMIT seconds, so a hung kernel still leaves the logs.
STEP_LIMIT=${STEP_LIMIT:-400}
# Logs are written to a scratch folder and come back as one archive, $OUT/logs.tgz (the
# device tool returns at most 8 files).
OUT=${OUT:-/tmp/cufa-out}
LOGS=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # JAX would otherwise take 75% of the GPU
# The float64 references' BLAS would start a thread a core in each of a dozen processes.
# (Once every family in about 3 minutes on an H100 at WORKERS=2; the suite has grown since:
# at WORKERS=4 the default and sm80 families alone took 400 and 194 s side by side on an
# H200, after a 70 s warmup.)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
bench=0
decode=0
mla=0
bwd=0
train=0
host=0
while [ $# -gt 0 ]; do
  case "$1" in
    --bench) bench=1; shift ;;
    --decode) decode=1; shift ;;
    --mla) mla=1; shift ;;
    --bwd) bwd=1; shift ;;
    --train) train=1; shift ;;
    --host) host=1; shift ;;
    *) break ;;
  esac
done

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv \
  > "$LOGS/nvidia-smi.txt" 2>&1
python3 -m cufa info > "$LOGS/info.txt" 2>&1
# Every variant compiled once, on all cores, before the tests: six processes would each
# compile what they need, at the same time.
python3 -m cufa warmup > "$LOGS/warmup.txt" 2>&1
# The families run side by side (one GPU, several processes): run one after another they
# take longer than one 600 s call on an H100. Each stops at FAMILY_LIMIT seconds, so that
# the logs come back from a call that has a limit of its own. FAMILIES (names) runs some of
# them; WORKERS spreads each over that many pytest-xdist processes, which take work from
# each other's queues (worksteal: under xdist's default split, one of six processes got the
# fp8 forward's heavy cases in a row and ran 260 s while the others were done by 153 s).
family() {  # family NAME [ENV=VALUE...] -- pytest paths...
  local name=$1; shift
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  case " ${FAMILIES:-default sm80 bm64 bm192 tma1 tma2 bwd1wg fdq np ncp} " in *" $name "*) ;; *) return ;; esac
  env "${envs[@]}" CUFA_FAILED_TESTS="$LOGS/failed_$name.txt" \
    timeout -k 10 "${FAMILY_LIMIT:-420}" python3 -m pytest -q -m gpu \
    -p no:cacheprovider --durations=5 ${WORKERS:+-n $WORKERS --dist worksteal} "$@" \
    > "$LOGS/gpu_tests_$name.txt" 2>&1
  echo $? > "$LOGS/rc_$name"
}
family default -- "${@:-tests}" &
# On Hopper the default path is wgmma (sm90); run the portable mma.sync path (sm80) too,
if python3 -c "import cupy,sys; sys.exit(cupy.cuda.Device().compute_capability != '90')"; then
  family sm80 CUFA_KERNEL_FAMILY=sm80 -- "${@:-tests}" &
  # the 64- and 192-row tiles (CUFA_SM90_BLOCK_M; d = 128 takes 192 rows from 1-2k query
  # rows a sequence, which few tests reach) on every forward test, and paged prefill's TMA
  # boxes on them,
  PAGED_PREFILL=tests/test_gpu_kvcache.py::test_varlen_paged_prefill_every_page_size
  for rows in 64 192; do
    family "bm$rows" CUFA_SM90_BLOCK_M=$rows -- \
      tests/test_gpu_forward.py tests/test_gpu_varlen.py "$PAGED_PREFILL" &
  done
  # and the TMA decode kernel on every KV-cache call it can take, one and two units a CTA
  for units in 1 2; do
    family "tma$units" CUFA_DECODE_TMA=$units -- \
      tests/test_gpu_kvcache.py tests/test_gpu_compiled_modes.py &
  done
  # the dq and dk/dv kernels on one warpgroup, 64 rows and keys a CTA, and at every head
  # dim (mma.sync's above d = 128 by default), on every backward test
  family bwd1wg CUFA_BWD_SM90_TILES=dq=64x64,kv=64x64 CUFA_BWD_SM90=all -- \
    tests/test_gpu_backward.py &
  # dq fused into the dk/dv kernel (wgmma at d = 64 and 128, else mma.sync) on every
  # backward test
  family fdq CUFA_BWD_FUSED_DQ=1 -- tests/test_gpu_backward.py &
  # and the dq and dk/dv kernels at d = 128 without their producer warpgroup (the two
  # consumer warpgroups issuing their own copies)
  family np CUFA_BWD_SM90_PRODUCER=0 -- tests/test_gpu_backward.py &
  # and the wgmma backward's steps streamed by cp.async rather than TMA (what arrays the
  # copy engine cannot describe take)
  family ncp CUFA_BWD_SM90_TMA=0 -- tests/test_gpu_backward.py &
fi
wait
tests_rc=0
for f in "$LOGS"/rc_*; do tests_rc=$((tests_rc + $(cat "$f"))); done
python3 -m cufa > "$LOGS/check.txt" 2>&1
check_rc=$?
if [ $bench = 1 ]; then
  timeout -k 10 "$STEP_LIMIT" python3 bench/bench_fwd.py --out "$LOGS" ${BENCH_ARGS:-} > "$LOGS/bench.txt" 2>&1
fi
if [ $decode = 1 ]; then
  timeout -k 10 "$STEP_LIMIT" python3 bench/bench_decode.py --out "$LOGS" ${DECODE_ARGS:-} > "$LOGS/bench_decode.txt" 2>&1
fi
if [ $mla = 1 ]; then
  timeout -k 10 "$STEP_LIMIT" python3 bench/bench_mla.py --out "$LOGS" ${MLA_ARGS:-} > "$LOGS/bench_mla.txt" 2>&1
fi
if [ $bwd = 1 ]; then
  timeout -k 10 "$STEP_LIMIT" python3 bench/bench_bwd.py --out "$LOGS" ${BWD_ARGS:-} > "$LOGS/bench_bwd.txt" 2>&1
fi
if [ $train = 1 ]; then
  timeout -k 10 "$STEP_LIMIT" python3 bench/train_gpt.py --out "$LOGS" ${TRAIN_ARGS:-} > "$LOGS/train_gpt.txt" 2>&1
fi
if [ $host = 1 ]; then
  timeout -k 10 "$STEP_LIMIT" python3 bench/host_overhead.py > "$LOGS/host_overhead.txt" 2>&1
fi

echo "== device"; cat "$LOGS/nvidia-smi.txt"; head -4 "$LOGS/info.txt"; tail -1 "$LOGS/warmup.txt"
echo "== GPU tests (rc=$tests_rc)"
for f in "$LOGS"/gpu_tests*.txt; do
  echo "-- $(basename "$f") (rc=$(cat "$LOGS/rc_$(basename "$f" .txt | sed s/gpu_tests_//)"))"
  grep -E "^(FAILED|ERROR)|passed|failed|error" "$f" | tail -15
  # (failures as they happened: the summary above is missing where a time limit cut in)
  failed="$LOGS/failed_$(basename "$f" .txt | sed s/gpu_tests_//).txt"
  [ -s "$failed" ] && { echo "   failed so far:"; head -20 "$failed"; }
done
echo "== self-check (rc=$check_rc)"; grep -E "FAIL|self-check|^\|" "$LOGS/check.txt" | tail -20
if [ $bench = 1 ]; then echo "== bench"; tail -40 "$LOGS/bench.txt"; fi
if [ $decode = 1 ]; then echo "== decode bench"; tail -22 "$LOGS/bench_decode.txt"; fi
if [ $mla = 1 ]; then echo "== MLA bench"; tail -22 "$LOGS/bench_mla.txt"; fi
if [ $bwd = 1 ]; then echo "== backward bench"; tail -40 "$LOGS/bench_bwd.txt"; fi
if [ $train = 1 ]; then echo "== training"; tail -8 "$LOGS/train_gpt.txt"; fi
if [ $host = 1 ]; then echo "== launch cost"; grep -E "^\|" "$LOGS/host_overhead.txt"; fi
tar -czf "$OUT/logs.tgz" -C "$LOGS" .
