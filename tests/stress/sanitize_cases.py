"""Small launches of every kernel variant at odd sizes: the workload for compute-sanitizer.

    python3 bench/sanitize_cases.py            # what bench/sanitize.sh runs under each tool
    python3 bench/sanitize_cases.py --kvcache-only   # the KV-cache, paged and merge calls alone

One call per (dtype, head dim family, mask kind, score mods) at sequence lengths 1, 7,
65 and 129 (never a multiple of a tile), packed batches with empty sequences and
sequences without keys, SDPA with broadcast boolean and additive masks, and the KV-cache
kernels: every decode variant (contiguous and paged, split and not, with appends, rotary
and leftpad), malformed lengths and page ids (clamped, never an access outside), merges
and paged packed batches (their decode-sized sequences on the decode kernel, split). Checks
values loosely (the GPU tests do that strictly); the point is to touch every code path
while the sanitizer watches.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import cufa  # noqa: E402
from cufa import _compile, reference  # noqa: E402

DIMS = {"sm80": (32, 64, 96, 128, 160, 192, 224, 256), "sm90": (64, 128, 192, 256)}


def _t(rng, shape, dtype):
    return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).to("cuda", dtype)


def _close(out, ref, what):
    err = (out.double().cpu() - torch.from_numpy(ref)).abs().max().item()
    if not err < 5e-2:
        raise SystemExit(f"{what}: max error {err:.3e}")


def main():
    rng = np.random.default_rng(0)
    family = _compile.family_for(torch.cuda.get_device_capability()[0] * 10
                                 + torch.cuda.get_device_capability()[1])
    if sys.argv[1:] == ["--kvcache-only"]:
        calls = kvcache_cases(rng)
        torch.cuda.synchronize()
        print(f"sanitize cases: {calls} calls (KV-cache only), family {family}")
        return
    calls = 0
    for dtype in (torch.float16, torch.bfloat16):
        for d in DIMS[family]:
            for causal in (False, True):
                for mods in (False, True):
                    # causal is the window kernel; a two-sided window takes its other branches
                    window = (9, 3) if causal and mods else (-1, -1)
                    for sq, sk in ((1, 7), (65, 129), (129, 65)):
                        q, k, v = _t(rng, (2, sq, 4, d), dtype), *(_t(rng, (2, sk, 2, d), dtype)
                                                                 for _ in range(2))
                        kw = dict(causal=causal and not mods, window_size=window)
                        if mods:
                            kw.update(softcap=5.0, alibi_slopes=torch.rand(4, device="cuda"))
                        out = cufa.flash_attn_func(q, k, v, **kw)
                        ref, _ = reference.attention(
                            *(x.double().cpu().numpy() for x in (q, k, v)),
                            causal=kw["causal"], window_size=window,
                            softcap=kw.get("softcap", 0.0),
                            alibi_slopes=kw["alibi_slopes"].cpu().numpy() if mods else None)
                        _close(out, ref, f"{dtype} d={d} causal={causal} mods={mods} {sq}x{sk}")
                        calls += 1
    # packed batches: empty sequences, sequences without keys, seqused_k
    lens_q, lens_k = [0, 1, 7, 65, 129, 0], [3, 0, 7, 129, 65, 1]
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32, device="cuda")
    used = torch.tensor([2, 0, 7, 100, 65, 1], dtype=torch.int32, device="cuda")
    for causal in (False, True):
        q = _t(rng, (sum(lens_q), 4, 64), torch.float16)
        k, v = (_t(rng, (sum(lens_k), 1, 64), torch.float16) for _ in range(2))
        cufa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 129, 129, causal=causal,
                                    seqused_k=used)
        calls += 1
    # SDPA: broadcast boolean and additive masks at odd sizes
    for mask_dtype in (torch.bool, torch.float16):
        q = _t(rng, (2, 4, 65, 64), torch.float16)
        k, v = (_t(rng, (2, 4, 129, 64), torch.float16) for _ in range(2))
        mask = torch.from_numpy(rng.random((2, 1, 65, 129)) > 0.3).cuda()
        mask = mask if mask_dtype == torch.bool else mask.to(mask_dtype) * -3.0
        cufa.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
        calls += 1
    calls += kvcache_cases(rng)
    torch.cuda.synchronize()
    print(f"sanitize cases: {calls} calls, family {family}")


def kvcache_cases(rng):
    """Every decode variant once at odd lengths, then the paths the values steer."""
    calls = 0
    i32 = (lambda x: torch.tensor(x, dtype=torch.int32, device="cuda"))
    for dtype in (torch.float16, torch.bfloat16):
        for d in _compile.DECODE_HEAD_DIMS:
            q = _t(rng, (3, 2, 8, d), dtype)
            cache = _t(rng, (3, 97, 2, d), dtype)
            new = _t(rng, (3, 3, 2, d), dtype)
            for splits in (1, 5):
                cufa.flash_attn_with_kvcache(q, cache, cache.clone(), new, new,
                                             cache_seqlens=i32([0, 50, 94]), causal=True,
                                             num_splits=splits, return_softmax_lse=True)
                calls += 1
    # 512 CTAs at d = 64 and 128: the shapes with four CTAs an SM, unsplit
    # (kvcache._kernel_and_splits)
    for dm in (64, 128):
        q = _t(rng, (64, 1, 8, dm), torch.float16)
        cache = _t(rng, (64, 512, 8, dm), torch.float16)
        cufa.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=i32(rng.integers(0, 513, 64)))
        calls += 1
    d, page = 128, 16
    pages = _t(rng, (20, page, 2, d), torch.float16)
    table = i32(rng.permutation(20)[:18].reshape(3, 6))
    cos = sin = _t(rng, (6 * page, 32), torch.float16)
    q = _t(rng, (3, 4, 8, d), torch.float16)
    new = _t(rng, (3, 2, 2, d), torch.float16)
    for lens, leftpad in (([0, 17, 94], [0, 3, 90]), ([1000, -5, 96], [-1, 200, 0])):
        # the second row: lengths past the capacity, negative, leftpad past the end -- clamped
        cufa.flash_attn_with_kvcache(q, pages, pages.clone(), new, new, rotary_cos=cos,
                                     rotary_sin=sin, cache_seqlens=i32(lens),
                                     cache_leftpad=i32(leftpad), block_table=table,
                                     window_size=(20, 0), softcap=10.0, num_splits=3,
                                     alibi_slopes=torch.rand(8, device="cuda"))
        calls += 1
    bad_table = i32([[0, 99, -7, 5, 1, 2], [3] * 6, [19] * 6])  # ids outside the cache
    cufa.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=i32([96, 96, 96]),
                                 block_table=bad_table)
    lens_q, lens_k = [0, 7, 65], [5, 0, 96]
    cu_q = i32(np.concatenate([[0], np.cumsum(lens_q)]))
    cu_k = i32(np.concatenate([[0], np.cumsum(lens_k)]))
    qp = _t(rng, (sum(lens_q), 8, d), torch.float16)
    cufa.flash_attn_varlen_func(qp, pages, pages, cu_q, cu_k, 65, 96, causal=True,
                                block_table=table)
    # paged prefill on the Hopper kernels' TMA boxes (pages of 8 rows and up; the portable
    # kernels elsewhere): ids outside the cache and a length past the capacity, clamped
    for page_rows, dp in ((8, 64), (64, 256), (256, 128)):
        width = 512 // page_rows
        kv = _t(rng, (2 * width + 1, page_rows, 2, dp), torch.float16)
        ids = rng.permutation(2 * width).reshape(2, width)
        ids[1, 1], ids[1, -1] = -3, 10**6
        qf = _t(rng, (170, 8, dp), torch.float16)
        cufa.flash_attn_varlen_func(qf, kv, kv, i32([0, 40, 170]), i32([0, 300, 10299]), 130,
                                    9999, causal=True, block_table=i32(ids))
        calls += 1
    # decode-sized sequences of a paged packed batch on the decode kernel, split over long
    # keys (2 sequences x 1 KV head: the splits' last merges), malformed lengths clamped
    big = _t(rng, (300, page, 1, d), torch.float16)
    big_table = i32(rng.permutation(300).reshape(2, 150))
    for lens_k in ([2400, 1700], [5000, -3]):
        qd = _t(rng, (3, 8, d), torch.float16)
        cu_kd = i32([0] + [int(x) for x in np.cumsum(lens_k)])
        cufa.flash_attn_varlen_func(qd, big, big, i32([0, 1, 3]), cu_kd, 2, 2400, causal=True,
                                    block_table=big_table, return_lse=True)
        calls += 1
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        oa, ob = _t(rng, (2, 7, 3, 72), dtype), _t(rng, (2, 7, 3, 72), dtype)
        la, lb = _t(rng, (2, 3, 7), torch.float32), _t(rng, (2, 3, 7), torch.float32)
        lb[0] = float("-inf")
        cufa.merge_attention_states(oa, la, ob, lb)
        calls += 1
    return calls + 2


if __name__ == "__main__":
    main()
