"""One forward configuration, launched a few times: a target for ncu / compute-sanitizer.

    ncu --kernel-name regex:fwd --launch-skip 2 --launch-count 1 python3 bench/profile_one.py --d 128
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import cufa  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--d", type=int, default=128)
parser.add_argument("--n", type=int, default=16384)
parser.add_argument("--dtype", default="float16")
parser.add_argument("--causal", action="store_true")
parser.add_argument("--launches", type=int, default=4)
args = parser.parse_args()

batch, heads = 16384 // args.n, 2048 // args.d
q, k, v = (torch.randn(batch, args.n, heads, args.d, device="cuda",
                       dtype=getattr(torch, args.dtype)) for _ in range(3))
for _ in range(args.launches):
    cufa.flash_attn_func(q, k, v, causal=args.causal)
torch.cuda.synchronize()
print("done", batch, args.n, heads, args.d)
