# temporary: DECODE_FP8_MIN_CTAS probe (deleted after the run)
import sys, runpy
from cufa import _compile
_compile.DECODE_FP8_MIN_CTAS.clear()
_compile.DECODE_FP8_MIN_CTAS.update({128: int(sys.argv[1])} if int(sys.argv[1]) else {})
_compile.decode_kernel.cache_clear()
sys.argv = ["bench_decode.py", "--fp8", "--no-peers", "--no-plot", "--head-dims", "128",
            "--shapes", "1x131072,64x4096,256x1024", "--reps", "24", "--out", "/tmp/probe"]
runpy.run_path("bench/bench_decode.py", run_name="__main__")
