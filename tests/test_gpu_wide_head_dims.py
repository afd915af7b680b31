"""GPU: head dims above 256, up to 512 (Gemma 4's global layers), on flash_attn_func and
flash_attn_varlen_func (contiguous and paged): the mma.sync kernel on Q and K padded to 512,
V's and O's columns in two halves a query tile. Outputs and lse against the float64
reference (pass rule in _attention_check.py), out= poisoned with NaN; odd lengths, empty
sequences, GQA, every mask, softcap, ALiBi and a learnable sink; the backward refused."""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import cufa  # noqa: E402
from _attention_check import check_attention, randn  # noqa: E402
from test_gpu_kvcache import check_packed_sequences, paged_caches  # noqa: E402
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
    """A serving batch's shape: prefill chunks and one-token sequences over a paged cache,
    all on the forward kernel (the decode kernels stop at 256)."""
    d, lens_q, lens_k = 384, [1, 90, 1, 33], [150, 120, 17, 64]
    k_cache, v_cache, k_pages, v_pages, table = paged_caches(rng, 4, 192, 2, d, "float16",
                                                             page_size)
    q = randn(rng, (1, sum(lens_q), 8, d), "float16")[0]
    out, lse = cufa.flash_attn_varlen_func(
        q, k_pages, v_pages, _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k), causal=True,
        block_table=torch.from_numpy(table).cuda(), return_lse=True)
    check_packed_sequences(out, lse, q, k_cache, v_cache, lens_q, lens_k,
                           f"paged {page_size}", causal=True)


def test_torch_backward_is_refused(rng):
    q, k, v = (randn(rng, (1, 40, 2, 320), "bfloat16").requires_grad_() for _ in range(3))
    out, lse = cufa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    check_attention(out.detach(), lse.detach(), q.detach(), k.detach(), v.detach(),
                    causal=True, label="d=320 requires grad")
    with pytest.raises(NotImplementedError, match="the backward takes head dims up to 256"):
        out.sum().backward()
