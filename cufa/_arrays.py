"""The arrays of each entry point, by name: one record a function, in the order its call
passes them (and its launch reads their addresses). A record holds whatever stands for an
array at that point -- the caller's arrays, their DeviceArray views, signature entries or
device addresses -- and None for an optional one not given. Planners and checks read
fields by name, so an argument added to an entry point (a descale, a gradient) is a field
here and nowhere a renumbering. Leaf module: imports nothing of cufa."""
from typing import Any, NamedTuple


class Dense(NamedTuple):
    """flash_attn_func."""
    q: Any
    k: Any
    v: Any
    alibi_slopes: Any = None
    learnable_sink: Any = None
    out: Any = None


class Packed(NamedTuple):
    """flash_attn_varlen_func."""
    q: Any
    k: Any
    v: Any
    cu_seqlens_q: Any
    cu_seqlens_k: Any
    seqused_k: Any = None
    alibi_slopes: Any = None
    block_table: Any = None
    learnable_sink: Any = None
    k_descale: Any = None
    v_descale: Any = None
    out: Any = None


class Sdpa(NamedTuple):
    """scaled_dot_product_attention (out is not an argument: always allocated)."""
    query: Any
    key: Any
    value: Any
    attn_mask: Any = None
    learnable_sink: Any = None


class KvCache(NamedTuple):
    """flash_attn_with_kvcache."""
    q: Any
    k_cache: Any
    v_cache: Any
    k: Any = None
    v: Any = None
    rotary_cos: Any = None
    rotary_sin: Any = None
    cache_seqlens: Any = None
    cache_batch_idx: Any = None
    cache_leftpad: Any = None
    block_table: Any = None
    alibi_slopes: Any = None
    learnable_sink: Any = None
    k_descale: Any = None
    v_descale: Any = None
    qv: Any = None
    out: Any = None


class Merge(NamedTuple):
    """merge_attention_states."""
    out_a: Any
    lse_a: Any
    out_b: Any
    lse_b: Any
    out: Any = None
