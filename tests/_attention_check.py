"""Shared by the GPU tests: inputs, the float64 and low-precision references, and the
pass rule.

Pass rule (FlashAttention's, held per row): for every query row of every head and batch
(every index of the output but its last axis), the max error of cufa's output against the
float64 reference, on the same rounded inputs, must be at most twice that row's max error
of a low-precision reference, the naive algorithm whose two matrix products (Q K^T and
P V) round to the input dtype, plus ROW_ROUNDINGS of the dtype's rounding of the row's
largest value. That error is what the dtype itself costs on this very input, row by row,
so the bound scales with fp16 vs bf16, head dim and score range without hand-tuned
tolerances, and a row with small values cannot borrow the allowance of a large one (held
over the whole tensor, the rule passed a bf16 output whose last 128 rows were 10 % off,
one future key too many, or a softmax scale 1 % off). lse (float32 in cufa) gets the same
rule per row against lse from the rounded scores, plus 1e-4 and eight float32 roundings of
the row's lse; rows that see no key must be exactly 0 with lse -inf in both. Where the
low-precision reference overflows in a row (scores near 1e4 in fp16), that row's bound
falls back to the dtype's rounding of its largest value.
"""
import math

import numpy as np
import torch

from cufa import reference

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# Where the low-precision reference runs its two products. The sanitizer workload
# (tests/stress/sanitize_cases.py) sets "cpu", so that only cufa's kernels, and no cuBLAS
# kernel, run under compute-sanitizer.
LOWP_DEVICE = "cuda"


def _torch_dtype(dtype):
    """A torch dtype from its name ("float16") or itself."""
    return DTYPES[dtype] if isinstance(dtype, str) else dtype


def make_sink(rng, nheads, dtype="float32", kind="normal"):
    """A learnable_sink (nheads,) on the GPU in `dtype` (a name or a torch dtype): "normal"
    draws of scale 2 (comparable to the rows' lse), or "huge" ones that take all of a row's
    mass or none (+-1e4, +-60) beside ordinary ones."""
    if kind == "huge":
        values = rng.choice([1e4, -1e4, 60.0, -60.0, 0.5], nheads)
    else:
        values = 2 * rng.standard_normal(nheads)
    return torch.tensor(values, dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype,
                        device="cuda")


def randn(rng, shape, dtype, scale=1.0, layout="bshd"):
    """A CUDA tensor of logical shape (b, s, h, d) (dtype: a name or a torch dtype) stored in
    `layout`:
    bshd (contiguous), bhsd (a transposed view), padded (row stride d + 8), qkv (the middle
    third of (b, s, 3, h, d), the layout of a fused projection's q, k, v), odd (a slice
    at element offset 1 of rows d + 1 long: strides that are no multiple of 8 and a start
    2 bytes off 16) or shifted (contiguous, its start 2 bytes off 16)."""
    b, s, h, d = shape
    if layout == "odd":
        x = torch.from_numpy(rng.standard_normal((b, s, h, d + 1), dtype=np.float32) * scale)
        return x.to("cuda", _torch_dtype(dtype))[..., 1:]
    if layout == "shifted":
        x = torch.from_numpy(rng.standard_normal(b * s * h * d + 1, dtype=np.float32) * scale)
        return x.to("cuda", _torch_dtype(dtype))[1:].view(shape)
    if layout == "bhsd":
        x = torch.from_numpy(rng.standard_normal((b, h, s, d), dtype=np.float32) * scale)
        return x.to("cuda", _torch_dtype(dtype)).transpose(1, 2)
    if layout == "qkv":  # one of three heads' worth in each row, as a fused QKV projection
        x = torch.from_numpy(rng.standard_normal((b, s, 3, h, d), dtype=np.float32) * scale)
        return x.to("cuda", _torch_dtype(dtype))[:, :, 1]
    if layout == "padded":
        x = torch.from_numpy(rng.standard_normal((b, s, h, d + 8), dtype=np.float32) * scale)
        return x.to("cuda", _torch_dtype(dtype))[..., :d]
    x = torch.from_numpy(rng.standard_normal(shape, dtype=np.float32) * scale)
    return x.to("cuda", _torch_dtype(dtype))


def f64(t):
    return t.detach().to(torch.float64).cpu().numpy()


def lowp_attention(q, k, v, exact_scores=False, **kw):
    """Naive attention with Q K^T and P V in the inputs' dtype (torch, on LOWP_DEVICE);
    exact_scores: Q K^T exact (float64) instead, P and P V still rounded to the dtype. qv
    (MLA's absorbed queries, (batch, seqlen_q, nheads, v's head dim), as in
    reference.attention): the scores gain qv V^T, likewise."""
    qv = kw.get("qv")
    scale = kw.get("softmax_scale")
    if qv is not None and scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1] + qv.shape[-1])
    qh, kh, vh, scale, visible, attn_mask, diag = reference._prepare(
        f64(q), f64(k), f64(v), scale, kw.get("causal", False),
        kw.get("window_size", (-1, -1)), kw.get("attn_mask"), kw.get("diag_offset"))
    dt = q.dtype
    to = (lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(LOWP_DEVICE, dt))
    s = (qh @ kh.transpose(0, 1, 3, 2) if exact_scores
         else (to(qh) @ to(kh).transpose(-1, -2)).double().cpu().numpy())
    if qv is not None:
        qvh = (f64(qv) if isinstance(qv, torch.Tensor) else np.asarray(qv)).transpose(0, 2, 1, 3)
        qvh = qvh.astype(np.float64)
        s = s + (qvh @ vh.transpose(0, 1, 3, 2) if exact_scores
                 else (to(qvh) @ to(vh).transpose(-1, -2)).double().cpu().numpy())
    rows, cols = np.arange(qh.shape[2]), np.arange(kh.shape[2])
    s = reference._score_mods(s, rows, cols, scale=scale, softcap=kw.get("softcap", 0.0),
                              alibi_slopes=kw.get("alibi_slopes"), attn_mask=attn_mask,
                              visible=visible, diag_offset=diag)
    s = reference.with_sink_column(s, kw.get("learnable_sink"))
    m = s.max(axis=-1, keepdims=True) if s.shape[-1] else np.full(s.shape[:-1] + (1,), -np.inf)
    m = np.where(np.isneginf(m), 0.0, m)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p_norm = np.where(l == 0, 0.0, p / l)[..., :len(cols)]  # (the sink adds no value)
        lse = np.where(l == 0, -np.inf, m + np.log(l))[..., 0]
    out = (to(p_norm) @ to(vh)).double().cpu().numpy()
    return out.transpose(0, 2, 1, 3), lse


def check_attention(out, lse, q, k, v, label="", **kw):
    """Assert the pass rule for out (b, sq, h, d) and lse (b, h, sq) against the references."""
    kw_np = {key: (f64(val) if isinstance(val, torch.Tensor) and key != "attn_mask" else val)
             for key, val in kw.items()}
    if isinstance(kw.get("attn_mask"), torch.Tensor):
        m = kw["attn_mask"]
        kw_np["attn_mask"] = m.cpu().numpy() if m.dtype == torch.bool else f64(m)
    o_ref, lse_ref = reference.attention(f64(q), f64(k), f64(v), **kw_np)
    lowp = [lowp_attention(q, k, v, exact_scores=exact, **kw_np) for exact in (False, True)]
    return assert_pass_rule(out, lse, (o_ref, lse_ref), lowp, q.dtype, label,
                            lse_extra=softcap_lse_error(kw.get("softcap", 0.0)))


def softcap_lse_error(softcap):
    """What the kernels' tanh (1 - 2 / (e^2x + 1), absolute error ~1e-7) may move lse by
    with a softcap: a score is cap * tanh, so up to cap x 2^-22 (1e-3 at a cap of 1e4)."""
    return softcap * 2.0 ** -22 if softcap else 0.0


# The terms of a row's bound that scale with the row itself, in roundings of the dtype at
# the row's largest value (eps x it): half a rounding beside twice the row's low-precision
# error, and never less than one rounding in all (a row whose low-precision error is 0 by
# luck, as a row that sees one key or one that takes all from one key, may still be one
# rounding off). Small enough that a row 1 % off fails in bf16 too (a CPU emulation of the
# kernels' arithmetic stays under 0.65 of the bound; every mutant of test_pass_rule_cpu.py
# is over 1.2 times it).
ROW_ROUNDINGS = 0.5
MIN_ROUNDINGS = 1.0
ABS_FLOOR = 1e-6  # rows whose values are all near 0
# Head dims under this are checked on groups of consecutive query rows of at least this
# many values: the max over one row of 1-16 values is too noisy a draw (a row of d = 1 whose
# low-precision error is 1e-7 by luck beside cufa's 2e-4 at the same P roundings).
MIN_ROW_VALUES = 32


def _row_max(x):
    """max |x| over the last axis (NaN-free input), one value a row; rows of fewer than
    MIN_ROW_VALUES values pooled with their neighbours along the query axis (the one before
    the heads: (b, s, h) or (t, h) after the reduction), in groups from the first row; the
    rows after the last whole group with the group's worth of rows that ends at the last
    row, so no row stands alone (fuzz seed 43's case 375: d = 2, row 64 of 65, 1.10 x
    its own lone bound on the H200)."""
    m = np.abs(x).max(axis=-1, initial=0) if x.shape[-1] else np.zeros(x.shape[:-1])
    group = -(-MIN_ROW_VALUES // max(x.shape[-1], 1))
    if group == 1 or m.ndim < 2 or m.shape[-2] <= 1:
        return m
    rows = m.shape[-2]
    pad = -rows % group
    tail = m[..., max(rows - group, 0):, :].max(axis=-2)
    m = np.concatenate([m, np.zeros(m.shape[:-2] + (pad, m.shape[-1]))], axis=-2) if pad else m
    pooled = m.reshape(m.shape[:-2] + (-1, group, m.shape[-1])).max(axis=-2)
    if pad:  # the last rows, fewer than a group: pooled with the rows before them too
        pooled[..., -1, :] = tail
    return np.repeat(pooled, group, axis=-2)[..., :rows, :]


def row_bound(o_ref, lowps, dtype, roundings=ROW_ROUNDINGS):
    """Each row's allowed max error: 2 x its low-precision error (the largest of the
    references in lowps, a list of outputs) + `roundings` x eps x its largest value, at
    least MIN_ROUNDINGS x that (+ ABS_FLOOR); rows where a low-precision reference
    overflowed take eps x their largest value as its error."""
    eps = float(torch.finfo(dtype).eps)
    scale = _row_max(o_ref)
    with np.errstate(invalid="ignore"):
        err_lp = _largest_error([_row_max(o_lp - o_ref) for o_lp in lowps], eps * scale)
    bound = np.maximum(2 * err_lp + roundings * eps * scale, MIN_ROUNDINGS * eps * scale)
    return bound + ABS_FLOOR, err_lp


def _largest_error(errors, overflowed):
    """Each row's largest of the low-precision references' errors, `overflowed` (per row)
    standing in for an error that is not finite (a reference that overflowed there)."""
    return np.maximum.reduce([np.where(np.isfinite(e), e, overflowed) for e in errors])


def _worst_row(ratio, label, what, err, bound, err_lp=None):
    idx = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    n_bad = int((ratio > 1).sum())
    lp = f", its low-precision err {err_lp[idx]:.3e}" if err_lp is not None else ""
    return (f"{label}: {what} over the per-row bound in {n_bad} of {ratio.size} rows; worst "
            f"row {tuple(int(i) for i in idx)}: err {err[idx]:.3e} > bound {bound[idx]:.3e} "
            f"({ratio[idx]:.2f} x){lp}")


def assert_pass_rule(out, lse, ref, lowp, dtype, label, roundings=ROW_ROUNDINGS, lse_extra=0.0):
    """out/lse (torch; lse may be None) against ref = (out, lse) in float64 and lowp = a
    low-precision reference's (out, lse), or a list of them (each row held to the larger
    of their errors: one whose score rounding cancels the error of its rounded inputs in a
    row by luck is covered by one with exact scores), row by row (every index but the last
    axis of out; every element of lse). roundings: the row-scaled term, in the dtype's
    roundings of the row's largest value (more where the result is rounded more often
    than once, as a merge of rounded parts). lse_extra: an absolute allowance for lse (the
    kernels' tanh under a softcap). Returns (the largest row error over its bound, the
    largest low-precision row error)."""
    (o_ref, lse_ref) = ref
    lowps = [lowp] if isinstance(lowp, tuple) else list(lowp)
    o = f64(out)
    assert o.shape == o_ref.shape, (o.shape, o_ref.shape)
    assert not np.isnan(o).any(), f"{label}: NaN in output"
    err = _row_max(o - o_ref)
    bound, err_lp = row_bound(o_ref, [o_lp for o_lp, _ in lowps], dtype, roundings)
    ratio = err / bound
    assert (ratio <= 1).all(), _worst_row(ratio, label, "out", err, bound, err_lp)
    if lse is not None:
        lse = lse.double().cpu().numpy()
        assert lse.shape == lse_ref.shape
        empty = np.isneginf(lse_ref)
        assert np.array_equal(np.isneginf(lse), empty), f"{label}: -inf lse rows differ"
        assert np.all(o[empty.transpose(0, 2, 1)] == 0), f"{label}: rows with no key not 0"
        fin = ~empty
        with np.errstate(invalid="ignore"):
            lerr_lp = _largest_error(
                [np.where(fin, np.abs(lse_lp - lse_ref), 0.0) for _, lse_lp in lowps],
                float(torch.finfo(torch.float32).eps) * np.abs(lse_ref))
            lerr = np.where(fin, np.abs(lse - lse_ref), 0.0)
        # lse is float32: a value of magnitude L carries about eps * L per rounding (the
        # max, its scaling, the log), which for huge scores exceeds the absolute 1e-4
        rounding = 8 * float(torch.finfo(torch.float32).eps) * np.where(fin, np.abs(lse_ref), 0)
        lbound = 2 * lerr_lp + 1e-4 + rounding + lse_extra
        lratio = lerr / lbound
        assert (lratio <= 1).all(), _worst_row(lratio, label, "lse", lerr, lbound)
    return float(ratio.max(initial=0)), float(err_lp.max(initial=0))


def capture_cuda_graph(fn, stream=None):
    """fn captured in a torch CUDA graph, after a warm-up call (compile, plan) on a side
    stream, as PyTorch asks; -> (graph, what the captured call returned). stream: the
    capture stream (torch.cuda.graph's default: one a process)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        result = fn()
    return graph, result


def host(x):
    """A torch tensor as NumPy (floats in float64); anything else as it is."""
    if not isinstance(x, torch.Tensor):
        return x
    return f64(x) if x.is_floating_point() else x.cpu().numpy()


def kvcache_references(q, k_cache, v_cache, k=None, v=None, **kw):
    """reference.kvcache_attention on the arrays as they were before the call (k_cache and
    v_cache: clones taken before it) -> (ref (out, lse), lowp (out, lse), k_cache after,
    v_cache after). The low-precision reference attends each sequence to the keys the
    reference gathered, with the rotated q and keys rounded to q's dtype (what the
    kernels attend with)."""
    kw = {key: host(val) for key, val in kw.items() if key not in ("out", "check_inputs")}
    if "float8" in str(k_cache.dtype):  # (a rotated new key: rounded to q's dtype, then
        kw["new_keys_as"] = str(q.dtype).replace("torch.", "")  # quantized, as stored)
    args = [host(x) for x in (q, k_cache, v_cache, k, v)]
    o_ref, lse_ref, k_after, v_after = reference.kvcache_attention(*args, **kw)

    def lowp(exact_scores, round_k=True):
        def attend(qb, kb, vb, **attn_kw):
            to = (lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(LOWP_DEVICE, q.dtype))
            k = to(kb) if round_k else torch.from_numpy(np.ascontiguousarray(kb))
            return lowp_attention(to(qb), k, to(vb), exact_scores=exact_scores, **attn_kw)
        return reference.kvcache_attention(*args, **kw, attend=attend)[:2]

    lowps = [lowp(False), lowp(True)]
    # An fp8 cache's keys reach the kernels' products exact (e4m3 values in 16 bits, the
    # descale on the scores), while the two above round the dequantized keys to q's dtype:
    # in a row where that rounding cancels a rotated q's by luck, the kernels' error (the
    # rotated q's rounding alone) looked 1.2-1.5x too large. One more reference rounds
    # only q, with exact scores.
    if "float8" in str(k_cache.dtype):
        lowps.append(lowp(True, round_k=False))
    return (o_ref, lse_ref), lowps, k_after, v_after


def check_kvcache(out, lse, q, k_cache, v_cache, k=None, v=None, label="", **kw):
    """The pass rule for flash_attn_with_kvcache's out and lse (kvcache_references'
    arguments); returns the reference's caches after the append."""
    ref, lowp, k_after, v_after = kvcache_references(q, k_cache, v_cache, k, v, **kw)
    assert_pass_rule(out, lse, ref, lowp, q.dtype, label,
                     lse_extra=softcap_lse_error(kw.get("softcap", 0.0)))
    return k_after, v_after


def _bits_and_values(x):
    """A 16-bit float array (torch, JAX or NumPy) on the host: (its bit patterns as int16,
    its values in float64)."""
    if isinstance(x, torch.Tensor):
        return x.detach().view(torch.int16).cpu().numpy(), f64(x)
    x = np.asarray(x)
    return x.view(np.int16), x.astype(np.float64)


def check_appended_cache(after, before, expected, slots, label, rotated=False):
    """A KV cache after an append (torch, JAX or NumPy, float16 or bfloat16): outside
    `slots` (an index of the cache's first two axes, as reference.kvcache_gather writes
    them: (rows or pages, positions)) bit for bit `before`; in them `expected` (the
    reference's float64 cache after the append). An append is a copy, so without rotary
    the new slots must hold the new keys exactly; rotated keys are computed in float32
    and rounded once, so within 1 ulp of the cache's dtype."""
    got_bits, got = _bits_and_values(after)
    before_bits, _ = _bits_and_values(before)
    assert got.shape == expected.shape, (label, got.shape, expected.shape)
    written = np.zeros(got.shape[:2], dtype=bool)
    written[slots] = True
    changed = (got_bits != before_bits) & ~written[..., None, None]
    assert not changed.any(), (
        f"{label}: {int(changed.sum())} values outside the new tokens changed, the first at "
        f"{tuple(int(i) for i in np.argwhere(changed)[0])}")
    got, exp = got[written], expected[written]
    assert not np.isnan(got).any(), f"{label}: NaN in the new slots"
    err = np.abs(got - exp)
    if not rotated:
        assert (err == 0).all(), (f"{label}: {int((err > 0).sum())} new-slot values differ "
                                  f"from the new keys (max err {err.max(initial=0):.3e})")
        return
    fi = torch.finfo(DTYPES[str(after.dtype).replace("torch.", "")])
    mag = np.maximum(np.maximum(np.abs(got), np.abs(exp)), fi.tiny)
    bound = np.exp2(np.floor(np.log2(mag))) * fi.eps + 2**-22 * np.abs(exp).max(initial=0)
    assert (err <= bound).all(), (
        f"{label}: new slots differ from the rotated new keys by up to "
        f"{(err / bound).max():.2f} x 1 ulp (max err {err.max():.3e}, mean {err.mean():.3e})")


def check_merge(out, lse, parts, label=""):
    """merge_attention_states' out and lse against reference.merge_states of parts (out_a,
    lse_a, out_b, lse_b as they were before the call): out within one rounding to its
    dtype plus 4e-6 of the largest output (the kernel weighs and sums in float32), lse
    within 1e-5 relative; rows where neither part saw a key exactly 0 with lse -inf; a
    NaN lse in a part gives a NaN row (docs/api.md), in out and lse alike."""
    expected, expected_lse = reference.merge_states(*(host(x) for x in parts))
    got, got_lse = f64(out), f64(lse)
    assert got.shape == expected.shape and got_lse.shape == expected_lse.shape, (
        f"{label}: shapes {got.shape} {got_lse.shape}, expected {expected.shape} "
        f"{expected_lse.shape}")
    assert np.array_equal(np.isnan(got_lse), np.isnan(expected_lse)), (
        f"{label}: NaN lse rows differ")
    assert np.array_equal(np.isnan(got), np.isnan(expected)), f"{label}: NaN out rows differ"
    empty = np.isneginf(expected_lse)
    assert np.array_equal(np.isneginf(got_lse), empty), f"{label}: -inf lse rows differ"
    rows = empty.T if got.ndim == 3 else empty.transpose(0, 2, 1)  # lse laid out as out
    assert (got[rows] == 0).all(), f"{label}: rows where neither part saw a key are not 0"
    fi = torch.finfo(out.dtype)
    fin = ~np.isnan(expected)
    err = np.abs(got[fin] - expected[fin])
    bound = (fi.eps * np.maximum(np.abs(expected[fin]), fi.tiny)
             + 4e-6 * np.abs(expected[fin]).max(initial=0))
    assert (err <= bound).all(), (
        f"{label}: merged out max err {err.max(initial=0):.3e} "
        f"({(err / bound).max(initial=0):.2f} x bound), mean {err.mean():.3e}")
    fin = np.isfinite(expected_lse)
    lerr = np.abs(got_lse[fin] - expected_lse[fin])
    assert (lerr <= 1e-5 * (1 + np.abs(expected_lse[fin]))).all(), (
        f"{label}: lse max err {lerr.max(initial=0):.3e}")


def i32(values):
    """An int32 CUDA tensor of values (cache_seqlens, block tables, ...)."""
    return torch.tensor(np.asarray(values), dtype=torch.int32, device="cuda")


def append_slots(positions, rows, table=None, page_size=None):
    """Where an append's positions (batch, new) live: (cache rows, or pages of `table`,
    and the row in each), flattened; rows: each sequence's cache row (contiguous)."""
    if table is not None:
        slots = (table[np.arange(len(positions))[:, None], positions // page_size],
                 positions % page_size)
    else:
        slots = (np.broadcast_to(np.asarray(rows)[:, None], positions.shape), positions)
    return tuple(s.ravel() for s in slots)


def cu_seqlens(lens):
    """cu_seqlens (int32, CUDA) of sequence lengths."""
    return i32(np.concatenate([[0], np.cumsum(lens)]))
