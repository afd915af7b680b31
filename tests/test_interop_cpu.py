"""CPU: a host array (NumPy, which speaks DLPack for the CPU) given to any public
function raises a TypeError that names the argument, whichever argument it is."""
import numpy as np
import pytest

import cufa
from test_validation import arr

host = np.zeros((2, 33, 4, 64), np.float16)
q, k = arr((2, 33, 4, 64)), arr((2, 47, 2, 64))
vq, vk = arr((10, 4, 64)), arr((12, 2, 64))
cu = arr((3,), "int32")
pages, lens, table = arr((6, 16, 2, 64)), arr((2,), "int32"), arr((2, 4), "int32")
lse = arr((2, 4, 33), "float32")

CASES = [
    # (the argument that is a NumPy array, the call)
    ("q", lambda: cufa.flash_attn_func(host, k, k)),
    ("k", lambda: cufa.flash_attn_func(q, np.zeros((2, 47, 2, 64), np.float16), k)),
    ("out", lambda: cufa.flash_attn_func(q, k, k, out=host)),
    ("cu_seqlens_k", lambda: cufa.flash_attn_varlen_func(
        vq, vk, vk, cu, np.array([0, 5, 12], np.int32), 6, 7)),
    ("attn_mask", lambda: cufa.scaled_dot_product_attention(
        arr((2, 4, 33, 64)), arr((2, 4, 47, 64)), arr((2, 4, 47, 64)),
        attn_mask=np.ones((33, 47), bool))),
    ("block_table", lambda: cufa.flash_attn_with_kvcache(
        arr((2, 1, 4, 64)), pages, pages, cache_seqlens=lens,
        block_table=np.zeros((2, 4), np.int32))),
    ("v_cache", lambda: cufa.flash_attn_with_kvcache(
        arr((2, 1, 4, 64)), arr((2, 64, 2, 64)), np.zeros((2, 64, 2, 64), np.float16))),
    ("lse_b", lambda: cufa.merge_attention_states(q, lse, q, np.zeros((2, 4, 33), np.float32))),
]


@pytest.mark.parametrize("name, call", CASES, ids=[c[0] for c in CASES])
def test_a_host_array_is_refused_by_name(name, call):
    with pytest.raises(TypeError, match=rf"\b{name}\b"):
        call()
