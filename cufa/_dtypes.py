"""The element types cufa reads and writes, in one table: each dtype's size and the code or
name every part of the library knows it by (the kernels' enums, the variant keys). A new
element type (fp8) is a new row here, not a fork of the tables that grew from it."""
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Dtype:
    name: str                       # the arrays' dtype name
    size: int                       # bytes an element
    key: Optional[str] = None       # in variant keys; a dtype the kernels compute in has one
    kernel: Optional[int] = None    # Dtype in common/types.cuh: q, k, v, out, the caches
    merge: Optional[int] = None     # MergeDtype in decode/merge.cu: merged parts and out
    rotary: Optional[int] = None    # DecodeParams.rotary_dtype: rotary cos/sin tables
    sink: Optional[int] = None      # SinkDtype in common/softmax.cuh: learnable_sink
    attn_mask: Optional[int] = None  # FwdParams.attn_mask_type (0: no mask)


TABLE = (
    Dtype("float16", 2, key="fp16", kernel=0, merge=0, rotary=0, sink=1, attn_mask=2),
    Dtype("bfloat16", 2, key="bf16", kernel=1, merge=1, rotary=1, sink=2, attn_mask=3),
    Dtype("float32", 4, key="fp32", merge=2, rotary=2, sink=0, attn_mask=4),
    Dtype("bool", 1, attn_mask=1),
    Dtype("float8_e4m3fn", 1, key="e4m3"),  # KV caches (flash_attn_with_kvcache)
)
BY_NAME = {d.name: d for d in TABLE}
BY_KEY = {d.key: d for d in TABLE if d.key}


def codes(role):
    """{dtype name: its code in `role`} for the dtypes that have one ("kernel", "merge",
    "rotary", "sink", "attn_mask")."""
    return {d.name: getattr(d, role) for d in TABLE if getattr(d, role) is not None}


def keys_by_code(role):
    """The variant keys of the dtypes with a code in `role`, in code order (index = code)."""
    ranked = sorted((getattr(d, role), d.key) for d in TABLE if getattr(d, role) is not None)
    assert [code for code, _ in ranked] == list(range(len(ranked))), role
    return tuple(key for _, key in ranked)


def size_of(key):
    """Bytes an element of the dtype whose variant key is `key` ("fp16")."""
    return BY_KEY[key].size
