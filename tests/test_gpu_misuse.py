"""GPU: misuse of every public function, with real CUDA tensors, raises an error that
names the argument; and after all of it the CUDA context still computes correctly
(an uncaught device-side assert would have poisoned it for the whole process)."""
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import cufa  # noqa: E402
from _attention_check import check_attention  # noqa: E402

F16, BF16 = torch.float16, torch.bfloat16


def _randn(*shape, dtype=F16, device="cuda"):
    return torch.randn(shape, device=device).to(dtype)


def _ints(values, dtype=torch.int32, device="cuda"):
    return torch.tensor(values, dtype=dtype, device=device)


def _misuse_cases():
    """(id, call, exception, message fragment); tensors are built here, on the GPU."""
    import cupy
    fa, varlen, sdpa = (cufa.flash_attn_func, cufa.flash_attn_varlen_func,
                        cufa.scaled_dot_product_attention)
    q, k, v = _randn(2, 33, 4, 64), _randn(2, 47, 2, 64), _randn(2, 47, 2, 64)
    sq, sk, sv = _randn(2, 4, 33, 64), _randn(2, 4, 47, 64), _randn(2, 4, 47, 64)
    vq, vk, vv = _randn(10, 4, 64), _randn(12, 2, 64), _randn(12, 2, 64)
    cu_q, cu_k = _ints([0, 4, 10]), _ints([0, 5, 12])
    hidden, packed = _randn(2, 33, 8), _randn(4, 8)
    pages = _randn(6, 16, 2, 64)  # a paged cache: 6 pages of 16 rows, vk's heads and head dim

    def vl(**kw):
        args = dict(q=vq, k=vk, v=vv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=6,
                    max_seqlen_k=7)
        args.update(kw)
        return lambda: varlen(**args)

    def qkv_d(d):
        return _randn(2, 33, 4, d), _randn(2, 47, 2, d), _randn(2, 47, 2, d)

    return [
        # flash_attn_func
        ("q float32", lambda: fa(q.float(), k, v), TypeError, "q has dtype float32"),
        ("k bfloat16, q float16", lambda: fa(q, k.to(BF16), v), TypeError,
         "k has dtype bfloat16 but q has float16"),
        ("q on the host", lambda: fa(q.cpu(), k, v), TypeError,
         "cufa needs CUDA device arrays; got a CPU (PyTorch) tensor for q"),
        ("q rank 3", lambda: fa(q[0], k, v), ValueError, "q must be 4-D"),
        ("head dim 0", lambda: fa(*qkv_d(0)), ValueError, "q has head dim 0"),
        ("head dim 520", lambda: fa(*qkv_d(520)), ValueError, "q has head dim 520"),
        ("q last dim strided", lambda: fa(_randn(2, 33, 4, 128)[..., ::2], k, v), ValueError,
         "q must be contiguous in its last dimension"),
        ("GQA heads not divisible", lambda: fa(_randn(2, 33, 6, 64), _randn(2, 47, 4, 64),
                                               _randn(2, 47, 4, 64)),
         ValueError, "q has 6 heads, not a multiple of the 4 heads of k"),
        ("softmax_scale 0", lambda: fa(q, k, v, softmax_scale=0.0), ValueError,
         "softmax_scale must be a finite number > 0"),
        ("softmax_scale -1", lambda: fa(q, k, v, softmax_scale=-1.0), ValueError,
         "softmax_scale must be a finite number > 0"),
        ("softmax_scale nan", lambda: fa(q, k, v, softmax_scale=float("nan")), ValueError,
         "softmax_scale must be a finite number > 0"),
        ("window_size (-2, 0)", lambda: fa(q, k, v, window_size=(-2, 0)), ValueError,
         "window_size left must be an int >= -1"),
        ("softcap -1", lambda: fa(q, k, v, softcap=-1.0), ValueError,
         "softcap must be a finite number >= 0"),
        ("alibi float16", lambda: fa(q, k, v, alibi_slopes=_randn(4)), TypeError,
         "alibi_slopes must be float32"),
        ("alibi shape", lambda: fa(q, k, v, alibi_slopes=_randn(3, dtype=torch.float32)),
         ValueError, "alibi_slopes must have shape (4,) or (2, 4)"),
        ("out shape", lambda: fa(q, k, v, out=_randn(2, 33, 4, 32)), ValueError,
         "out must have q's shape"),
        ("out dtype", lambda: fa(q, k, v, out=torch.empty_like(q, dtype=BF16)), ValueError,
         "out must have q's shape"),
        ("out a cupy array", lambda: fa(q, k, v, out=cupy.empty(tuple(q.shape), cupy.float16)),
         TypeError, "out is a cupy array"),
        # scaled_dot_product_attention
        ("sdpa attn_mask int32", lambda: sdpa(sq, sk, sv, attn_mask=_ints([[1] * 47] * 33)),
         TypeError, "attn_mask must be bool or float16/bfloat16/float32; got int32"),
        ("sdpa attn_mask not broadcastable",
         lambda: sdpa(sq, sk, sv, attn_mask=torch.ones(33, 46, dtype=torch.bool, device="cuda")),
         ValueError, "attn_mask of shape (33, 46) is not broadcastable"),
        ("sdpa enable_gqa missing", lambda: sdpa(sq, sk[:, :2], sv[:, :2]), ValueError,
         "key has 2 heads but query has 4; pass enable_gqa=True"),
        # flash_attn_varlen_func
        ("cu_seqlens int64", vl(cu_seqlens_q=cu_q.long()), TypeError,
         "cu_seqlens_q must be int32"),
        ("cu_seqlens 2-D", vl(cu_seqlens_k=cu_k[None]), ValueError, "cu_seqlens_k must be 1-D"),
        ("cu_seqlens last value", vl(cu_seqlens_q=_ints([0, 4, 9]), check_cu_seqlens=True),
         ValueError, "cu_seqlens_q ends at 9 but the tensor has 10 rows"),
        ("cu_seqlens decreasing", vl(cu_seqlens_k=_ints([0, 13, 12]), check_cu_seqlens=True),
         ValueError, "cu_seqlens_k must be non-decreasing"),
        ("seqused_k shape", vl(seqused_k=_ints([1, 2, 3])), ValueError,
         "seqused_k must be (2,) int32"),
        ("max_seqlen_q negative", vl(max_seqlen_q=-1), ValueError,
         "max_seqlen_q must be an int >= 0"),
        ("page id past the cache, checked",
         vl(k=pages, v=pages, block_table=_ints([[0, 1, 2, 3], [4, 5, 6, 0]]),
            check_cu_seqlens=True),
         ValueError, "block_table[1, 2] = 6 is not a page of the cache (0 to 5)"),
        ("page id negative, checked",
         vl(k=pages, v=pages, block_table=_ints([[0, -1, 2, 3], [4, 5, 1, 0]]),
            check_cu_seqlens=True),
         ValueError, "block_table[0, 1] = -1 is not a page of the cache"),
        # unpad_input / pad_input
        ("unpad mask float", lambda: cufa.unpad_input(hidden, torch.ones(2, 33, device="cuda")),
         TypeError, "attention_mask must be bool or integer, got float32"),
        ("unpad mask on the host",
         lambda: cufa.unpad_input(hidden, torch.ones(2, 33, dtype=torch.bool)), ValueError,
         "attention_mask is on cpu but hidden is on cuda:0"),
        ("pad indices float", lambda: cufa.pad_input(packed, _randn(4, dtype=torch.float32), 2, 33),
         TypeError, "indices must be int64 or int32, got float32"),
        ("pad indices length", lambda: cufa.pad_input(packed, _ints([0, 1, 2]), 2, 33),
         ValueError, "indices has 3 entries but packed has 4 rows"),
        ("pad indices out of range, checked",
         lambda: cufa.pad_input(packed, _ints([0, 1, 2, 66]), 2, 33, check_indices=True),
         ValueError, "indices must lie in [0, batch*seqlen) = [0, 66)"),
    ]


def test_misuse_raises_named_errors_and_leaves_the_context_usable():
    failures = []
    for name, call, exc, fragment in _misuse_cases():
        try:
            call()
        except exc as e:
            if fragment not in str(e):
                failures.append(f"{name}: {type(e).__name__}({str(e)!r}) lacks {fragment!r}")
        except Exception as e:  # noqa: BLE001 -- a wrong exception type is a finding too
            failures.append(f"{name}: expected {exc.__name__}, got {type(e).__name__}: {e}")
        else:
            failures.append(f"{name}: no error")
    assert not failures, "\n".join(failures)

    # Unchecked out-of-range indices (negative, >= batch * seqlen) on CUDA: dropped, no assert.
    padded = cufa.pad_input(torch.ones(4, 8, dtype=F16, device="cuda"),
                            _ints([0, -1, 66, 65], torch.int64), 2, 33)
    torch.cuda.synchronize()
    assert padded.shape == (2, 33, 8) and padded.float().sum().item() == 16.0
    assert padded[0, 0].eq(1).all().item() and padded[1, 32].eq(1).all().item()

    # A valid call on fresh inputs still runs and is right.
    torch.manual_seed(0)
    q, k, v = _randn(2, 65, 4, 64), _randn(2, 80, 2, 64), _randn(2, 80, 2, 64)
    out = cufa.flash_attn_func(q, k, v, causal=True)
    torch.cuda.synchronize()
    check_attention(out, None, q, k, v, causal=True, label="after the misuse table")
