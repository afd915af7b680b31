"""One forward configuration, launched a few times: a target for ncu / compute-sanitizer.

    ncu --kernel-name regex:fwd --launch-skip 2 --launch-count 1 python3 bench/profile/profile_one.py --d 128
    ... python3 bench/profile/profile_one.py --varlen    # bench_varlen's 256 x 64..512 packed batch
    ncu --kernel-name regex:fprop ... python3 bench/profile/profile_one.py --peer cudnn  # the peer
    ncu --kernel-name regex:bwd_dkdv ... python3 bench/profile/profile_one.py --backward
    ncu --kernel-name regex:decode_mla ... python3 bench/profile/profile_one.py --mla 128 128 8192 [--fp8]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import _timing  # noqa: E402,F401  (finds the checkout's cufa when none is on the path)
import torch  # noqa: E402

import cufa  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--d", type=int, default=128)
parser.add_argument("--n", type=int, default=16384)
parser.add_argument("--dtype", default="float16")
parser.add_argument("--causal", action="store_true")
parser.add_argument("--launches", type=int, default=4)
parser.add_argument("--varlen", action="store_true", help="256 sequences of 64..512 rows, packed")
parser.add_argument("--peer", choices=("cudnn", "flash"),
                    help="launch PyTorch SDPA's cuDNN or flash backend instead (same shape)")
parser.add_argument("--backward", action="store_true",
                    help="launch the backward (after one forward) instead of the forward")
parser.add_argument("--mla", nargs=3, type=int, metavar=("HEADS", "BATCH", "SEQLEN"),
                    help="MLA decode instead (qv=, bf16, one token, pages of 64 in random "
                         "order, HEADS query heads over one latent head)")
parser.add_argument("--fp8", action="store_true",
                    help="with --mla: the caches in float8_e4m3fn, descales per sequence")
args = parser.parse_args()

if args.mla:
    heads, batch, n = args.mla
    pages = batch * -(-n // 64)
    table = torch.randperm(pages, device="cuda").to(torch.int32).view(batch, -1)
    kw = dict(q=torch.randn(batch, 1, heads, 64, device="cuda", dtype=torch.bfloat16),
              qv=torch.randn(batch, 1, heads, 512, device="cuda", dtype=torch.bfloat16),
              k_cache=torch.randn(pages, 64, 1, 64, device="cuda", dtype=torch.bfloat16),
              v_cache=torch.randn(pages, 64, 1, 512, device="cuda", dtype=torch.bfloat16),
              cache_seqlens=torch.full((batch,), n, device="cuda", dtype=torch.int32),
              block_table=table)
    if args.fp8:
        for name in ("k_cache", "v_cache"):
            kw[name] = kw[name].to(torch.float8_e4m3fn)
        kw["k_descale"] = kw["v_descale"] = torch.full((batch, 1), 0.5, device="cuda")
    for _ in range(args.launches):
        cufa.flash_attn_with_kvcache(**kw, causal=True)
    torch.cuda.synchronize()
    print("done mla", heads, batch, n)
    sys.exit(0)

if args.varlen:
    import numpy as np
    from bench_varlen import BATCHES
    batch, lo, hi, seed = BATCHES["256 x 64..512"]
    lens = np.random.default_rng(seed).integers(lo, hi + 1, batch)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(int(lens.sum()), 2048 // args.d, args.d, device="cuda",
                           dtype=getattr(torch, args.dtype)) for _ in range(3))
    for _ in range(args.launches):
        cufa.flash_attn_varlen_func(q, k, v, cu, cu, int(lens.max()), int(lens.max()),
                                    causal=args.causal)
    torch.cuda.synchronize()
    print("done varlen", len(lens), int(lens.sum()), args.d)
    sys.exit(0)

batch, heads = 16384 // args.n, 2048 // args.d
q, k, v = (torch.randn(batch, args.n, heads, args.d, device="cuda",
                       dtype=getattr(torch, args.dtype)) for _ in range(3))
if args.backward:
    dout = torch.randn_like(q)
    if args.peer:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = {"cudnn": SDPBackend.CUDNN_ATTENTION,
                   "flash": SDPBackend.FLASH_ATTENTION}[args.peer]
        qt, kt, vt = (x.transpose(1, 2).requires_grad_() for x in (q, k, v))
        with sdpa_kernel(backend):
            o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal)
            for _ in range(args.launches):
                torch.autograd.grad(o, (qt, kt, vt), dout.transpose(1, 2), retain_graph=True)
    else:
        out, lse = cufa.flash_attn_func(q, k, v, causal=args.causal, return_lse=True)
        for _ in range(args.launches):
            cufa.flash_attn_backward(dout, q, k, v, out, lse, causal=args.causal)
elif args.peer:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[args.peer]
    with sdpa_kernel(backend):
        for _ in range(args.launches):
            torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=args.causal)
else:
    for _ in range(args.launches):
        cufa.flash_attn_func(q, k, v, causal=args.causal)
torch.cuda.synchronize()
print("done", batch, args.n, heads, args.d)
