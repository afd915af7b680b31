"""GPU: head dims above 256, up to 512 (Gemma 4's global layers), on flash_attn_func and
flash_attn_varlen_func (contiguous and paged): the forward kernels (Hopper's wgmma one, the
mma.sync one elsewhere and under CUFA_KERNEL_FAMILY=sm80) on Q and K padded to 512, V's and
O's columns in two halves a query tile; and on flash_attn_with_kvcache: the decode
kernel on 512, V's halves a CTA each, its splits merged by decode_combine. Outputs and lse
against the float64 reference (pass rule in _attention_check.py), out= poisoned with NaN;
odd lengths, empty sequences, GQA, every mask, softcap, ALiBi, a learnable sink, appends,
rotary, leftpad, cache_batch_idx, every split count; the backward refused."""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import cufa  # noqa: E402
from _attention_check import check_attention, randn  # noqa: E402
from test_gpu_kvcache import check_packed_sequences, paged_caches, run_case  # noqa: E402
from test_gpu_varlen import _check_each_sequence, _cu  # noqa: E402

NAN = float("nan")
HEAD_DIMS = [264, 320, 384, 512]
MASKS = {
    "none": {},
    "causal": dict(causal=True),
    "window softcap": dict(window_size=(23, 7), softcap=8.0),
}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("mask", MASKS)
def test_dense(rng, dtype, d, mask):
    """GQA 6/2, 77 query rows against 93 keys (bottom-right masks), lse."""
    q = randn(rng, (2, 77, 6, d), dtype)
    k, v = (randn(rng, (2, 93, 2, d), dtype) for _ in range(2))
    out = torch.full_like(q, NAN)
    res, lse = cufa.flash_attn_func(q, k, v, out=out, return_lse=True, **MASKS[mask])
    assert res is out
    check_attention(out, lse, q, k, v, label=f"{dtype} d={d} {mask}", **MASKS[mask])


@pytest.mark.parametrize("d", [320, 512])
def test_one_row_one_key_alibi_and_sink(rng, d):
    """The smallest call, then 130 rows over 260 keys with ALiBi and a learnable sink."""
    q, k, v = (randn(rng, (1, 1, 2, d), "bfloat16") for _ in range(3))
    out, lse = cufa.flash_attn_func(q, k, v, return_lse=True)
    check_attention(out, lse, q, k, v, label=f"d={d} 1 x 1")
    q = randn(rng, (2, 130, 4, d), "float16")
    k, v = (randn(rng, (2, 260, 4, d), "float16") for _ in range(2))
    alibi = torch.from_numpy(rng.uniform(0, 1, (4,)).astype(np.float32)).cuda()
    sink = torch.from_numpy(2 * rng.standard_normal(4).astype(np.float32)).cuda()
    out, lse = cufa.flash_attn_func(q, k, v, causal=True, alibi_slopes=alibi,
                                    learnable_sink=sink, return_lse=True)
    check_attention(out, lse, q, k, v, causal=True, alibi_slopes=alibi, learnable_sink=sink,
                    label=f"d={d} alibi sink")


@pytest.mark.parametrize("d", [296, 512])
def test_packed_with_empty_and_odd_sequences(rng, d):
    lens_q, lens_k = [0, 1, 65, 130, 7], [5, 1, 200, 130, 0]
    q = randn(rng, (1, sum(lens_q), 4, d), "bfloat16")[0]
    k, v = (randn(rng, (1, sum(lens_k), 2, d), "bfloat16")[0] for _ in range(2))
    out = torch.full_like(q, NAN)
    res, lse = cufa.flash_attn_varlen_func(q, k, v, _cu(lens_q), _cu(lens_k), max(lens_q),
                                           max(lens_k), causal=True, out=out, return_lse=True)
    assert res is out
    _check_each_sequence(out, lse, q, k, v, lens_q, lens_k, causal=True, label=f"d={d}")


@pytest.mark.parametrize("page_size", [16, 64])
def test_paged_prefill_and_decode_sized_sequences(rng, page_size):
    """A serving batch's shape: prefill chunks over a paged cache on the forward kernel,
    one-token sequences on the decode kernel (two CTAs a unit, V's halves)."""
    d, lens_q, lens_k = 384, [1, 90, 1, 33], [150, 120, 17, 64]
    k_cache, v_cache, k_pages, v_pages, table = paged_caches(rng, 4, 192, 2, d, "float16",
                                                             page_size)
    q = randn(rng, (1, sum(lens_q), 8, d), "float16")[0]
    out, lse = cufa.flash_attn_varlen_func(
        q, k_pages, v_pages, _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k), causal=True,
        block_table=torch.from_numpy(table).cuda(), return_lse=True)
    check_packed_sequences(out, lse, q, k_cache, v_cache, lens_q, lens_k,
                           f"paged {page_size}", causal=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [320, 512])
def test_long_rows_and_strided_arrays(rng, d, causal):
    """700 query rows over 900 keys, GQA 4/2 (several tiles a head, every K and V stage
    refilled many times), v a column slice of a wider array, out= a slice of one."""
    q = randn(rng, (2, 700, 4, d), "bfloat16")
    k = randn(rng, (2, 900, 2, d), "bfloat16")
    v = randn(rng, (2, 900, 2, d + 64), "bfloat16")[..., 40:40 + d]
    out_wide = torch.full((2, 700, 4, d + 16), NAN, dtype=q.dtype, device="cuda")
    out = out_wide[..., 8:8 + d]
    res, lse = cufa.flash_attn_func(q, k, v, causal=causal, out=out, return_lse=True)
    assert res.data_ptr() == out.data_ptr()
    assert torch.isnan(out_wide[..., :8]).all() and torch.isnan(out_wide[..., 8 + d:]).all()
    check_attention(out, lse, q, k, v, causal=causal, label=f"d={d} long rows")


def test_more_tiles_than_ctas(rng):
    """More work units than a wave of CTAs (Hopper's persistent kernel: an H200's 132 CTAs
    take 384 dense and 448 packed halves, three or more each): the one Q stage reused after
    O was staged through it, the K and V stages' phases across tiles, a tile's half carried
    to the consumers on each; dense causal, and packed with a one-row sequence."""
    q = randn(rng, (1, 1536, 16, 512), "bfloat16")
    k, v = (randn(rng, (1, 1536, 8, 512), "bfloat16") for _ in range(2))
    out = torch.full_like(q, NAN)
    res, lse = cufa.flash_attn_func(q, k, v, causal=True, out=out, return_lse=True)
    assert res is out
    check_attention(out, lse, q, k, v, causal=True, label="d=512 1536 rows, 16/8 heads")
    lens = [700, 1, 900, 333, 1200]
    q = randn(rng, (1, sum(lens), 8, 384), "float16")[0]
    k, v = (randn(rng, (1, sum(lens), 4, 384), "float16")[0] for _ in range(2))
    out = torch.full_like(q, NAN)
    res, lse = cufa.flash_attn_varlen_func(q, k, v, _cu(lens), _cu(lens), max(lens), max(lens),
                                           out=out, return_lse=True)
    assert res is out
    _check_each_sequence(out, lse, q, k, v, lens, lens, causal=False, label="d=384 packed")


@pytest.mark.parametrize("spec", ["64x16", "64x64"])
def test_other_key_blocks(rng, monkeypatch, spec):
    """The mma.sync kernel (CUFA_KERNEL_FAMILY=sm80 on Hopper) on CUFA_WIDE_TILES' tiles
    (to time them): 16-key blocks (the planner's where a block gets under 112 KB) and
    64-key ones, dense and packed, where the GPU grants their shared memory."""
    from cufa import _compile, _runtime
    keys = int(spec.split("x")[1])
    if (64 * 512 + keys * 768) * 2 > _runtime.smem_per_block(torch.cuda.current_device()):
        pytest.skip(f"{spec} takes more shared memory than this GPU grants a block")
    try:
        with monkeypatch.context() as env:  # (the caller's settings back at its end)
            env.setenv(_compile.WIDE_TILES_ENV, spec)
            env.setenv(_compile.FAMILY_ENV, "sm80")
            cufa.api.clear_plans()
            test_dense(rng, "bfloat16", 384, "causal")
            test_dense(rng, "float16", 512, "window softcap")
            test_packed_with_empty_and_odd_sequences(rng, 296)
    finally:
        cufa.api.clear_plans()


def test_torch_backward_is_refused(rng):
    q, k, v = (randn(rng, (1, 40, 2, 320), "bfloat16").requires_grad_() for _ in range(3))
    out, lse = cufa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    check_attention(out.detach(), lse.detach(), q.detach(), k.detach(), v.detach(),
                    causal=True, label="d=320 requires grad")
    with pytest.raises(NotImplementedError, match="the backward takes head dims up to 256"):
        out.sum().backward()


KVCACHE_CASES = {
    "d320 GQA 8/2 q1 append": dict(d=320, new=1),
    "d512 q4 causal paged 16 append 3": dict(d=512, seqlen_q=4, causal=True, page_size=16, new=3),
    "d512 bf16 paged 1": dict(d=512, dtype="bfloat16", page_size=1, capacity=48, new=1),
    "d384 paged 64 q37 causal": dict(d=384, page_size=64, capacity=256, seqlen_q=37, causal=True),
    "d512 MQA 16/1 q4 (four query blocks)": dict(d=512, heads=(16, 1), seqlen_q=4, causal=True),
    "d512 64 x 96 GQA 16/4 q1 (unsplit)": dict(d=512, batch=64, heads=(16, 4), capacity=96,
                                               new=1),
    "d320 empty caches": dict(d=320, lens=[0, 0, 0], seqlen_q=2),
    "d512 cache_batch_idx": dict(d=512, batch_idx=True, new=2, seqlen_q=2, causal=True),
    "d512 leftpad window ALiBi": dict(d=512, leftpad=[3, 70, 0], lens=[3, 100, 20], new=2,
                                      window_size=(25, 0), alibi="batch"),
    "d512 rotary interleaved append": dict(d=512, rotary="interleaved", causal=True, new=3,
                                           seqlen_q=3),
    "d448 rotary half 64 paged 16 bf16": dict(d=448, rotary="half", rotary_dim=64, page_size=16,
                                              dtype="bfloat16", new=2, seqlen_q=2, causal=True),
    "d512 softcap sink": dict(d=512, softcap=8.0, sink="float32", seqlen_q=4, causal=True),
    "d512 one split": dict(d=512, num_splits=1, capacity=300),
    "d512 3 splits": dict(d=512, num_splits=3, capacity=300, seqlen_q=2, causal=True),
    "d264 16 splits": dict(d=264, num_splits=16, capacity=300),
    # decode_combine in slices of 128 columns (many splits of wide rows, no merge in the
    # decode launch): 4 slices; 3 whose last is one chunk wide; with a sink
    "d512 40 splits (sliced combine)": dict(d=512, num_splits=40, capacity=2000),
    "d264 48 splits (sliced, a narrow last slice)": dict(d=264, num_splits=48, capacity=2000,
                                                         seqlen_q=2, causal=True),
    "d512 128 splits sink (sliced)": dict(d=512, num_splits=128, capacity=4000,
                                          sink="float32"),
}


@pytest.mark.parametrize("name", KVCACHE_CASES)
def test_kvcache(rng, name):
    run_case(rng, name, **KVCACHE_CASES[name])
