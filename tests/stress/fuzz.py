"""Randomized differential test against the float64 reference, for a chosen time.

    python3 bench/fuzz.py --minutes 5 [--seed 0]       # run; prints the case count
    python3 bench/fuzz.py --seed 0 --case 1234          # replay one case

Each case draws from its own generator, seeded by (seed, case index), so any failure is
reproducible from the two numbers it prints. Cases mix padded and packed batches, SDPA
with masks, fp16 and bf16, head dims 8..256, lengths 0..600 (odd ones on purpose),
GQA, every mask kind and combination, strided layouts, and KV-cache calls (contiguous and
paged, appends, rotary, leftpad, splits; drawn as tests/test_gpu_kvcache.py's random
cases). The pass rule is the GPU tests' (tests/_attention_check.py).
"""
import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import torch  # noqa: E402

import cufa  # noqa: E402
from _attention_check import DTYPES, check_attention, randn  # noqa: E402

LENGTHS = (0, 1, 2, 7, 31, 64, 65, 127, 128, 129, 191, 257, 600)


def _masks(rng, h, batch):
    kw = {}
    if rng.random() < 0.5:
        kw["causal"] = True
    w = rng.integers(0, 4)
    if w:
        kw["window_size"] = (int(rng.integers(-1, 80)) if w != 2 else -1,
                             int(rng.integers(-1, 40)) if w != 1 else -1)
    if rng.random() < 0.3:
        kw["softcap"] = float(rng.choice([1.0, 5.0, 50.0]))
    if rng.random() < 0.3:
        shape = (h,) if rng.random() < 0.5 else (batch, h)
        kw["alibi_slopes"] = torch.from_numpy(rng.uniform(0, 2, shape).astype(np.float32)).cuda()
    if rng.random() < 0.3:
        kw["softmax_scale"] = float(rng.uniform(0.01, 1.0))
    return kw


def run_case(seed, index):
    rng = np.random.default_rng([seed, index])
    dtype = str(rng.choice(list(DTYPES)))
    d = int(rng.integers(1, 33)) * 8
    h_k = int(rng.choice([1, 2, 4]))
    h = h_k * int(rng.choice([1, 2, 3]))
    kind = str(rng.choice(["dense", "varlen", "sdpa", "kvcache"]))
    if kind == "kvcache":
        import test_gpu_kvcache
        spec = test_gpu_kvcache.random_spec(rng)
        test_gpu_kvcache.run_case(rng, f"kvcache {spec}", **spec)
    elif kind == "dense":
        b = int(rng.integers(1, 4))
        sq, sk = (int(rng.choice(LENGTHS[1:])) for _ in range(2))
        layout = str(rng.choice(["bshd", "bhsd", "padded"]))
        q = randn(rng, (b, sq, h, d), dtype, layout=layout)
        k, v = (randn(rng, (b, sk, h_k, d), dtype, layout=layout) for _ in range(2))
        kw = _masks(rng, h, b)
        out, lse = cufa.flash_attn_func(q, k, v, return_lse=True, **kw)
        check_attention(out, lse, q, k, v, label=f"dense {dtype} d={d}", **kw)
    elif kind == "varlen":
        b = int(rng.integers(1, 9))
        lens_q = [int(x) for x in rng.choice(LENGTHS, b)]
        lens_k = [int(x) for x in rng.choice(LENGTHS, b)]
        q = randn(rng, (1, sum(lens_q), h, d), dtype)[0]
        k, v = (randn(rng, (1, sum(lens_k), h_k, d), dtype)[0] for _ in range(2))
        cu = [torch.tensor(np.concatenate([[0], np.cumsum(x)]), dtype=torch.int32, device="cuda")
              for x in (lens_q, lens_k)]
        kw = _masks(rng, h, b)
        out, lse = cufa.flash_attn_varlen_func(q, k, v, *cu, max(lens_q), max(lens_k),
                                               return_lse=True, **kw)
        cq, ck = np.concatenate([[0], np.cumsum(lens_q)]), np.concatenate([[0], np.cumsum(lens_k)])
        for i in range(b):
            if lens_q[i] == 0:
                continue
            kw_i = dict(kw)
            if "alibi_slopes" in kw and kw["alibi_slopes"].ndim == 2:
                kw_i["alibi_slopes"] = kw["alibi_slopes"][i]
            s, e, ks, ke = cq[i], cq[i + 1], ck[i], ck[i + 1]
            check_attention(out[s:e][None], lse[:, s:e][None], q[s:e][None], k[ks:ke][None],
                            v[ks:ke][None], label=f"varlen {dtype} d={d} seq {i}", **kw_i)
    else:
        b = int(rng.integers(1, 3))
        sq, sk = (int(rng.choice(LENGTHS[1:])) for _ in range(2))
        q = randn(rng, (b, sq, h, d), dtype).transpose(1, 2)
        k, v = (randn(rng, (b, sk, h_k, d), dtype).transpose(1, 2) for _ in range(2))
        mask = None
        if rng.random() < 0.7:
            shape = [b, h, sq, sk]
            for axis in range(3):
                if rng.random() < 0.5:
                    shape[axis] = 1
            mask = torch.from_numpy(rng.random(shape) > 0.2).cuda()
            if rng.random() < 0.5:
                mask = torch.where(mask, 0.0, -5.0).to(torch.float32)
        causal = bool(rng.random() < 0.5)
        out = cufa.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                enable_gqa=True)
        ref_mask = None if mask is None else (mask.cpu().numpy() if mask.dtype == torch.bool
                                              else mask.double().cpu().numpy())
        tr = (lambda x: x.transpose(1, 2))
        check_attention(tr(out), None, tr(q), tr(k), tr(v), attn_mask=ref_mask, causal=causal,
                        diag_offset=0, label=f"sdpa {dtype} d={d}")
    return kind


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--case", type=int, help="replay this one case")
    args = parser.parse_args()
    if args.case is not None:
        print(run_case(args.seed, args.case), "case passed")
        return 0
    deadline = time.monotonic() + 60 * args.minutes
    counts, failures = {}, []
    index = 0
    while time.monotonic() < deadline and len(failures) < 20:
        try:
            kind = run_case(args.seed, index)
            counts[kind] = counts.get(kind, 0) + 1
        except AssertionError as e:  # keep going: one run should show every kind of failure
            failures.append(index)
            print(f"FAILED seed={args.seed} case={index}: {e}")
            print(f"replay: python3 bench/fuzz.py --seed {args.seed} --case {index}")
        index += 1
    torch.cuda.synchronize()
    print(f"fuzz: {index} cases, {len(failures)} failed, in {args.minutes} min "
          f"(seed {args.seed}; passed by kind {counts}), device {torch.cuda.get_device_name()}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
