"""CPU: flash_attn_with_kvcache, merge_attention_states and paged flash_attn_varlen_func
refuse bad input with an error that names the argument, before anything touches a GPU
(arrays described by cufa's own view type, as in test_validation.py)."""
import pytest

import cufa
from test_validation import arr

B, SQ, H, HK, D, CAP = 2, 1, 8, 2, 64, 128
PAGE, PAGES = 16, 20

q0 = arr((B, SQ, H, D))
cache0, v_cache0 = arr((B, CAP, HK, D)), arr((B, CAP, HK, D), ptr=0x7f4000000000)
pages0, v_pages0 = arr((PAGES, PAGE, HK, D)), arr((PAGES, PAGE, HK, D), ptr=0x7f4000000000)
table0 = arr((B, CAP // PAGE), "int32")
lens0 = arr((B,), "int32")
new0 = arr((B, 3, HK, D))
cos0 = arr((CAP, 16))


def contiguous(**changes):
    kw = dict(q=q0, k_cache=cache0, v_cache=v_cache0, cache_seqlens=lens0)
    kw.update(changes)
    return kw


def paged(**changes):
    kw = dict(q=q0, k_cache=pages0, v_cache=v_pages0, cache_seqlens=lens0,
              block_table=table0)
    kw.update(changes)
    return kw


KVCACHE_CASES = [
    # (id, keyword arguments, exception, regex: the argument's name and one key word)
    ("block_table int64", paged(block_table=arr((B, 8), "int64")), TypeError,
     "block_table.*int32"),
    ("block_table 1-D", paged(block_table=arr((B * 8,), "int32")), ValueError,
     "block_table.*shape"),
    ("block_table batch", paged(block_table=arr((B + 1, 8), "int32")), ValueError,
     "block_table.*shape"),
    ("page size 24", paged(k_cache=arr((PAGES, 24, HK, D)), v_cache=arr((PAGES, 24, HK, D))),
     ValueError, "page.*two"),
    ("page size 512", paged(k_cache=arr((PAGES, 512, HK, D)), v_cache=arr((PAGES, 512, HK, D))),
     ValueError, "page.*two"),
    ("cache_seqlens int64", contiguous(cache_seqlens=arr((B,), "int64")), TypeError,
     "cache_seqlens.*int32"),
    ("cache_seqlens shape", contiguous(cache_seqlens=arr((B + 1,), "int32")), ValueError,
     "cache_seqlens.*shape"),
    ("cache_seqlens 2-D", paged(cache_seqlens=arr((B, 1), "int32")), ValueError,
     "cache_seqlens.*shape"),
    ("cache_seqlens negative int", contiguous(cache_seqlens=-1), ValueError, "cache_seqlens"),
    ("cache_seqlens int past capacity", contiguous(k=new0, v=new0, cache_seqlens=CAP - 2),
     ValueError, "cache_seqlens.*128"),
    ("k without cache_seqlens", contiguous(k=new0, v=new0, cache_seqlens=None), ValueError,
     "cache_seqlens.*required"),
    ("cache_batch_idx int64", contiguous(cache_batch_idx=arr((B,), "int64")), TypeError,
     "cache_batch_idx.*int32"),
    ("cache_batch_idx shape", contiguous(cache_batch_idx=arr((B + 1,), "int32")), ValueError,
     "cache_batch_idx.*shape"),
    ("cache_batch_idx with block_table", paged(cache_batch_idx=arr((B,), "int32")), ValueError,
     "cache_batch_idx.*block_table"),
    ("cache_leftpad float32", contiguous(cache_leftpad=arr((B,), "float32")), TypeError,
     "cache_leftpad.*int32"),
    ("cache_leftpad shape", paged(cache_leftpad=arr((1,), "int32")), ValueError,
     "cache_leftpad.*shape"),
    ("k without v", contiguous(k=new0), ValueError, "k and v"),
    ("v without k", paged(v=new0), ValueError, "k and v"),
    ("k head dim", contiguous(k=arr((B, 3, HK, 32)), v=arr((B, 3, HK, 32))), ValueError,
     r"\bk\b.*head dim"),
    ("k heads", contiguous(k=arr((B, 3, H, D)), v=arr((B, 3, H, D))), ValueError, r"\bk\b.*shape"),
    ("k dtype", contiguous(k=arr((B, 3, HK, D), "bfloat16"), v=arr((B, 3, HK, D), "bfloat16")),
     TypeError, r"\bk\b.*dtype"),
    ("k past contiguous capacity", contiguous(k=arr((B, CAP + 1, HK, D)),
                                              v=arr((B, CAP + 1, HK, D))), ValueError,
     r"\bk\b.*129"),
    ("k past paged capacity", paged(k=arr((B, CAP + 1, HK, D)), v=arr((B, CAP + 1, HK, D))),
     ValueError, r"\bk\b.*129"),
    ("q dtype differs from cache", contiguous(q=arr((B, SQ, H, D), "bfloat16")), TypeError,
     "k_cache.*dtype"),
    ("q 3-D", contiguous(q=arr((B, H, D))), ValueError, "q must be 4-D"),
    ("v_cache shape", contiguous(v_cache=arr((B, CAP - 1, HK, D))), ValueError,
     "v_cache.*shape"),
    ("cache batch without cache_batch_idx", contiguous(k_cache=arr((B + 1, CAP, HK, D)),
                                                       v_cache=arr((B + 1, CAP, HK, D))),
     ValueError, "k_cache.*batch"),
    ("heads not divisible", contiguous(k_cache=arr((B, CAP, 3, D)), v_cache=arr((B, CAP, 3, D))),
     ValueError, "heads"),
    ("rotary_cos without rotary_sin", contiguous(rotary_cos=cos0), ValueError, "rotary_sin"),
    ("rotary_sin without rotary_cos", contiguous(rotary_sin=cos0), ValueError, "rotary_cos"),
    ("rotary_sin shape", contiguous(rotary_cos=cos0, rotary_sin=arr((CAP, 8))), ValueError,
     "rotary_sin.*shape"),
    ("rotary_cos 1-D", contiguous(rotary_cos=arr((CAP,)), rotary_sin=arr((CAP,))), ValueError,
     "rotary_cos.*shape"),
    ("rotary_dim > head dim", contiguous(rotary_cos=arr((CAP, 40)), rotary_sin=arr((CAP, 40))),
     ValueError, "rotary_dim"),
    ("rotary_dim 0", contiguous(rotary_cos=arr((CAP, 0)), rotary_sin=arr((CAP, 0))), ValueError,
     "rotary_dim"),
    ("rotary_cos too short", paged(rotary_cos=arr((CAP - 1, 16)), rotary_sin=arr((CAP - 1, 16))),
     ValueError, "rotary_cos.*positions"),
    ("rotary_cos int32", contiguous(rotary_cos=arr((CAP, 16), "int32"),
                                    rotary_sin=arr((CAP, 16), "int32")), TypeError,
     "rotary_cos.*dtype"),
    ("num_splits negative", contiguous(num_splits=-1), ValueError, "num_splits"),
    ("alibi shape", contiguous(alibi_slopes=arr((H + 1,), "float32")), ValueError,
     "alibi_slopes.*shape"),
    ("out shape", contiguous(out=arr((B, SQ, H, 32))), ValueError, "out.*shape"),
    ("num_splits past the merge's", contiguous(num_splits=129), ValueError,
     "num_splits must be an int from 0 to 128"),
    ("rotary_interleaved a string", contiguous(rotary_cos=cos0, rotary_sin=cos0,
                                               rotary_interleaved="no"), TypeError,
     "rotary_interleaved must be a bool"),
    # an append into a cache whose rows share memory, or into one array for k and v
    ("k_cache expanded", contiguous(k_cache=arr((B, CAP, HK, D), strides=(0, HK * D, D, 1)),
                                    k=new0, v=new0), ValueError,
     "k_cache is written, and its elements share memory"),
    ("v_cache heads overlap", paged(v_cache=arr((PAGES, PAGE, HK, D),
                                                               strides=(PAGE * D, D, 32, 1),
                                                               ptr=0x7f5000000000),
                                    k=new0, v=new0), ValueError,
     "v_cache is written, and its elements share memory"),
    ("one array for k_cache and v_cache", contiguous(v_cache=cache0, k=new0, v=new0),
     ValueError, "k_cache and v_cache are one array"),
]


@pytest.mark.parametrize("case", KVCACHE_CASES, ids=[c[0] for c in KVCACHE_CASES])
def test_flash_attn_with_kvcache_rejects(case):
    _, kw, exc, msg = case
    with pytest.raises(exc, match=msg):
        cufa.flash_attn_with_kvcache(**kw)


o_dense, lse_dense = arr((2, 5, 4, 64)), arr((2, 4, 5), "float32")
o_packed, lse_packed = arr((9, 4, 64)), arr((4, 9), "float32")

MERGE_CASES = [
    ("out_b shape", (o_dense, lse_dense, arr((2, 5, 4, 32)), lse_dense), ValueError, "out_b"),
    ("out_b dtype", (o_dense, lse_dense, arr((2, 5, 4, 64), "bfloat16"), lse_dense),
     (TypeError, ValueError), "out_b"),
    ("out_a int32", (arr((2, 5, 4, 64), "int32"), lse_dense, arr((2, 5, 4, 64), "int32"),
                     lse_dense), TypeError, "out_a.*float"),
    ("out_a 2-D", (arr((5, 64)), arr((5,), "float32"), arr((5, 64)), arr((5,), "float32")),
     ValueError, "out_a.*shape"),
    ("lse_a float16", (o_dense, arr((2, 4, 5), "float16"), o_dense, lse_dense), TypeError,
     "lse_a.*float32"),
    ("lse_b shape", (o_dense, lse_dense, o_dense, arr((2, 5, 4), "float32")), ValueError,
     "lse_b.*shape"),
    ("packed out, dense lse", (o_packed, arr((1, 4, 9), "float32"), o_packed, lse_packed),
     ValueError, "lse_a.*shape"),
    ("packed lse transposed", (o_packed, lse_packed, o_packed, arr((9, 4), "float32")),
     ValueError, "lse_b.*shape"),
    ("lse_b other device", (o_dense, lse_dense, o_dense, arr((2, 4, 5), "float32", device=1)),
     ValueError, "lse_b.*cuda:1"),
]


@pytest.mark.parametrize("case", MERGE_CASES, ids=[c[0] for c in MERGE_CASES])
def test_merge_attention_states_rejects(case):
    _, args, exc, msg = case
    with pytest.raises(exc, match=msg):
        cufa.merge_attention_states(*args)


def test_merge_attention_states_rejects_a_bad_out():
    with pytest.raises(ValueError, match="out.*shape"):
        cufa.merge_attention_states(o_dense, lse_dense, o_dense, lse_dense,
                                    out=arr((2, 5, 4, 32)))


VARLEN_PAGED_CASES = [
    ("block_table int64", dict(block_table=arr((2, 4), "int64")), TypeError, "block_table.*int32"),
    ("block_table batch", dict(block_table=arr((3, 4), "int32")), ValueError,
     "block_table.*shape"),
    ("block_table 1-D", dict(block_table=arr((8,), "int32")), ValueError, "block_table.*shape"),
    ("page size 24", dict(k=arr((10, 24, 2, 64)), v=arr((10, 24, 2, 64))), ValueError,
     "page.*two"),
    ("paged k head dim", dict(k=arr((10, 16, 2, 32)), v=arr((10, 16, 2, 32))), ValueError,
     r"\bk\b.*head dim"),
]


@pytest.mark.parametrize("case", VARLEN_PAGED_CASES, ids=[c[0] for c in VARLEN_PAGED_CASES])
def test_paged_flash_attn_varlen_func_rejects(case):
    _, changes, exc, msg = case
    kw = dict(q=arr((10, 4, 64)), k=arr((10, 16, 2, 64)), v=arr((10, 16, 2, 64)),
              cu_seqlens_q=arr((3,), "int32"), cu_seqlens_k=arr((3,), "int32"),
              max_seqlen_q=6, max_seqlen_k=64, block_table=arr((2, 4), "int32"))
    kw.update(changes)
    with pytest.raises(exc, match=msg):
        cufa.flash_attn_varlen_func(**kw)
