"""GPU: head dims that are no multiple of 8 (1 to 256) and arrays whose strides or start are
not 16-byte aligned, which the element-wise I/O kernel variants read and write in place
(flash-attn pads such head dims by copying). Every entry point: dense, packed (with empty
sequences), SDPA, paged packed, the KV cache (append, rotary, splits) and the merge of
attention states. Outputs against the float64 reference (pass rule in _attention_check.py),
out= poisoned with NaN."""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import cufa  # noqa: E402
from _attention_check import (  # noqa: E402
    check_attention, check_merge, cu_seqlens, i32, randn)
from test_gpu_forward import _check_sdpa  # noqa: E402
from test_gpu_kvcache import (  # noqa: E402
    check_packed_sequences, merge_parts, paged_caches, run_case)
from test_gpu_varlen import _check_each_sequence, _cu  # noqa: E402

NAN = float("nan")
HEAD_DIMS = [1, 3, 59, 111, 200, 255, 256]
MASKS = {
    "none": {},
    "causal": dict(causal=True),
    "window softcap alibi": dict(window_size=(23, 7), softcap=8.0),
}


def poisoned(rng, shape, dtype, layout):
    """An out= of `layout`, every element NaN."""
    return randn(rng, shape, dtype, layout=layout).fill_(NAN)


def alibi_for(rng, mask, heads):
    if mask != "window softcap alibi":
        return None
    return torch.from_numpy(rng.uniform(0, 1, (heads,)).astype(np.float32)).cuda()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("layout", ["bshd", "odd"], ids=["contiguous", "odd strides"])
@pytest.mark.parametrize("mask", MASKS)
def test_dense(rng, dtype, d, layout, mask):
    """GQA 6/2, 77 query rows against 93 keys (bottom-right masks), lse; contiguous arrays
    (aligned at d = 256: the 16-byte kernels) or slices at an odd offset (q, k, v and
    out)."""
    q = randn(rng, (2, 77, 6, d), dtype, layout=layout)
    k, v = (randn(rng, (2, 93, 2, d), dtype, layout=layout) for _ in range(2))
    alibi = alibi_for(rng, mask, 6)
    out = poisoned(rng, q.shape, dtype, layout)
    res, lse = cufa.flash_attn_func(q, k, v, out=out, return_lse=True, alibi_slopes=alibi,
                                    **MASKS[mask])
    assert res is out
    check_attention(out, lse, q, k, v, alibi_slopes=alibi, label=f"{dtype} d={d} {layout} {mask}",
                    **MASKS[mask])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_aligned_head_dim_with_unaligned_strides_or_start(rng, dtype):
    """d = 64 with q a slice at an odd offset, k starting 2 bytes off 16, out both; and the
    same shapes aligned before and after, which keep their own (16-byte) plan."""
    shape_q, shape_k = (2, 130, 4, 64), (2, 200, 2, 64)
    for name, layouts in (("aligned", ("bshd",) * 4),
                          ("odd q, shifted k", ("odd", "shifted", "bshd", "bshd")),
                          ("shifted v and out", ("bshd", "bshd", "shifted", "shifted")),
                          ("odd out", ("bshd", "bshd", "bshd", "odd")),
                          ("aligned again", ("bshd",) * 4)):
        q = randn(rng, shape_q, dtype, layout=layouts[0])
        k = randn(rng, shape_k, dtype, layout=layouts[1])
        v = randn(rng, shape_k, dtype, layout=layouts[2])
        out = poisoned(rng, shape_q, dtype, layouts[3])
        res, lse = cufa.flash_attn_func(q, k, v, causal=True, out=out, return_lse=True)
        assert res is out
        check_attention(out, lse, q, k, v, causal=True, label=f"{dtype} {name}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [3, 59, 111, 255])
@pytest.mark.parametrize("mask", ["causal", "window softcap alibi"])
def test_packed_with_empty_sequences(rng, dtype, d, mask):
    """flash_attn_varlen_func: sequences of 0 to 300 rows (some without keys), the rows a
    slice at an odd offset."""
    lens_q = [0, 1, 7, 65, 0, 129, 200, 3]
    lens_k = [5, 0, 7, 300, 1, 129, 64, 3]
    h, hk = 4, 2
    q = randn(rng, (1, sum(lens_q), h, d), dtype, layout="odd")[0]
    k, v = (randn(rng, (1, sum(lens_k), hk, d), dtype, layout="odd")[0] for _ in range(2))
    alibi = alibi_for(rng, mask, h)
    out = torch.full_like(q, NAN)
    res, lse = cufa.flash_attn_varlen_func(q, k, v, _cu(lens_q), _cu(lens_k), max(lens_q),
                                           max(lens_k), out=out, return_lse=True,
                                           alibi_slopes=alibi, **MASKS[mask])
    assert res is out and lse.shape == (h, sum(lens_q))
    _check_each_sequence(out, lse, q, k, v, lens_q, lens_k, alibi=alibi,
                         label=f"{dtype} d={d} {mask}", **MASKS[mask])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [1, 59, 200])
def test_sdpa(rng, dtype, d):
    """scaled_dot_product_attention (top-left causal, GQA) at head dims off 8."""
    q = randn(rng, (2, 33, 4, d), dtype).transpose(1, 2)
    k, v = (randn(rng, (2, 47, 2, d), dtype).transpose(1, 2) for _ in range(2))
    out = cufa.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    _check_sdpa(out, q, k, v, is_causal=True)


@pytest.mark.parametrize("page_size", [1, 16, 256])
@pytest.mark.parametrize("d, dtype", [(59, "float16"), (111, "bfloat16"), (3, "float16")])
def test_paged_packed(rng, page_size, d, dtype):
    """flash_attn_varlen_func over a paged cache: sequences of 1 to 4 query rows go to the
    decode kernel's element-wise variant, longer ones to the forward's; empty ones too."""
    lens_q = [1, 7, 0, 33, 4, 64, 2]
    lens_k = [40, 7, 3, 300, 0, 512, 129]
    batch, capacity, h, hk = len(lens_q), 512, 8, 2
    q = randn(rng, (1, sum(lens_q), h, d), dtype, layout="odd")[0]
    k_cache, v_cache, k_pages, v_pages, table = paged_caches(rng, batch, capacity, hk, d, dtype,
                                                             page_size)
    out = torch.full_like(q, NAN)
    res, lse = cufa.flash_attn_varlen_func(
        q, k_pages, v_pages, cu_seqlens(lens_q), cu_seqlens(lens_k), max(lens_q), max(lens_k),
        causal=True, return_lse=True, out=out, block_table=i32(table))
    assert res is out
    check_packed_sequences(out, lse, q, k_cache, v_cache, lens_q, lens_k,
                           f"paged varlen d={d} page {page_size}", causal=True)


KVCACHE_CASES = {
    "d59 append 3 rotary 16 (half) q2 causal 3 splits": dict(
        d=59, heads=(8, 2), new=3, rotary="half", rotary_dim=16, seqlen_q=2, causal=True,
        num_splits=3, capacity=300),
    "d59 interleaved rotary 16 paged 16 append 1 chosen splits": dict(
        d=59, batch=1, heads=(8, 2), page_size=16, capacity=2048, lens=[1900], new=1,
        rotary="interleaved", rotary_dim=16),
    "d59 bf16 long cache chosen splits": dict(d=59, dtype="bfloat16", batch=1, heads=(32, 8),
                                              capacity=8192, lens=[8000]),
    "d111 bf16 window softcap alibi 5 splits": dict(
        d=111, dtype="bfloat16", window_size=(40, 0), softcap=8.0, alibi="heads", num_splits=5,
        capacity=300, seqlen_q=4, new=2),
    "d3 q4 causal append 2": dict(d=3, seqlen_q=4, causal=True, new=2),
    "d1 append 1 leftpad": dict(d=1, new=1, leftpad=[0, 30, 50], lens=[10, 90, 50]),
    "d200 GQA 32/8 4 splits paged 64": dict(d=200, heads=(32, 8), num_splits=4, page_size=64,
                                           capacity=256, new=1),
    "d255 rotary 254 (half) paged 1 append 2": dict(d=255, page_size=1, capacity=48, new=2,
                                                    rotary="half", rotary_dim=254, seqlen_q=2,
                                                    causal=True),
    "d256 q and cache slices at an odd offset 3 splits": dict(
        d=256, q_layout="odd", cache_layout="odd", num_splits=3, seqlen_q=4, causal=True),
    "d64 cache a slice at an odd offset, q 2 bytes off": dict(
        q_layout="shifted", cache_layout="odd", new=2, seqlen_q=3, causal=True, num_splits=2),
    "d64 cache batch idx, cache 2 bytes off": dict(cache_layout="shifted", batch_idx=True,
                                                   new=1, rotary="interleaved", rotary_dim=16),
}


@pytest.mark.parametrize("name", KVCACHE_CASES)
def test_kvcache(rng, name):
    """flash_attn_with_kvcache (out poisoned; the cache after the append checked too)."""
    run_case(rng, name, **KVCACHE_CASES[name])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_merge_d59(rng, dtype, packed):
    """merge_attention_states at d = 59: into a new output, into out_a (in place), and into
    a slice at an odd offset."""
    parts = merge_parts(rng, dtype, packed, d=59)
    before = tuple(x.clone() for x in parts)
    res, lse = cufa.merge_attention_states(*parts)
    check_merge(res, lse, before, f"{dtype} d59")
    wide = torch.full(parts[0].shape[:-1] + (60,), 7.0, device="cuda", dtype=parts[0].dtype)
    res, lse = cufa.merge_attention_states(*parts, out=wide[..., 1:])
    check_merge(res, lse, before, f"{dtype} d59 into an odd slice")
    assert (wide[..., 0] == 7).all(), "the column before out written"
    res, lse = cufa.merge_attention_states(*parts, out=parts[0])
    check_merge(res, lse, before, f"{dtype} d59 into out_a")
