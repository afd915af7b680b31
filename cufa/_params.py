"""Python mirror of ``FwdParams`` (kernels_cu/params.cuh), passed to kernels by value.

The field list below is the single Python statement of the layout. Every compile
appends ``static_assert``s generated from it (``layout_asserts``), so a struct that
drifted from this mirror fails to compile instead of reading garbage.
"""
import ctypes
import struct

import numpy as np

_PTR, _I64, _I32, _F32 = np.uint64, np.int64, np.int32, np.float32

FWD_FIELDS = [
    ("q", _PTR), ("k", _PTR), ("v", _PTR), ("o", _PTR), ("lse", _PTR),
    ("attn_mask", _PTR), ("alibi_slopes", _PTR),
    ("cu_seqlens_q", _PTR), ("cu_seqlens_k", _PTR), ("seqused_k", _PTR),
    ("tile_list", _PTR), ("tile_count", _PTR), ("tile_counter", _PTR),
    ("q_batch_stride", _I64), ("q_row_stride", _I64), ("q_head_stride", _I64),
    ("k_batch_stride", _I64), ("k_row_stride", _I64), ("k_head_stride", _I64),
    ("v_batch_stride", _I64), ("v_row_stride", _I64), ("v_head_stride", _I64),
    ("o_batch_stride", _I64), ("o_row_stride", _I64), ("o_head_stride", _I64),
    ("lse_batch_stride", _I64), ("lse_head_stride", _I64),
    ("mask_batch_stride", _I64), ("mask_head_stride", _I64),
    ("mask_row_stride", _I64), ("mask_col_stride", _I64),
    ("alibi_batch_stride", _I64),
    ("batch", _I32), ("nheads", _I32), ("nheads_k", _I32),
    ("seqlen_q", _I32), ("seqlen_k", _I32), ("head_dim", _I32),
    ("num_m_blocks", _I32), ("heads_per_group", _I32), ("kv_tail_maps", _I32),
    ("bottom_right", _I32), ("window_left", _I32), ("window_right", _I32),
    ("attn_mask_type", _I32),
    ("scale", _F32), ("scale_log2", _F32), ("softcap", _F32), ("softcap_inv", _F32),
]

FWD_DTYPE = np.dtype(FWD_FIELDS, align=True)
_FWD_NAMES = frozenset(FWD_DTYPE.names)

# The pointers lead the record, so a call's addresses go in with one struct.pack.
POINTER_FIELDS = tuple(name for name, kind in FWD_FIELDS if kind is _PTR)
assert all(FWD_DTYPE.fields[n][1] == 8 * i for i, n in enumerate(POINTER_FIELDS))
_POINTERS = struct.Struct(f"<{len(POINTER_FIELDS)}Q")

# AttnMaskType in params.cuh
ATTN_MASK_NONE, ATTN_MASK_BOOL, ATTN_MASK_FP16, ATTN_MASK_BF16, ATTN_MASK_FP32 = range(5)


def layout_asserts(struct_name="cufa::FwdParams", dtype=FWD_DTYPE):
    """C++ static_asserts pinning the size and every field offset to this mirror
    (``cufa::field_offset`` in params.cuh finds an offset at compile time)."""
    lines = [f"static_assert(sizeof({struct_name}) == {dtype.itemsize}, "
             f"\"{struct_name} size differs from cufa/_params.py\");"]
    for name in dtype.names:
        field_type, offset = dtype.fields[name][:2]
        marker = "1.0000001f" if field_type.kind == "f" else "1"   # lowest byte non-zero
        lines.append(f"static_assert(cufa::field_offset(&{struct_name}::{name}, "
                     f"decltype({struct_name}::{name})({marker})) == {offset}, "
                     f"\"{struct_name}::{name} offset differs from cufa/_params.py\");")
    return "\n".join(lines) + "\n"


def pack_fwd_params(fields):
    """{field: value} -> the record passed by value to the kernel (fields left out are
    0). One conversion: cheaper than setting fields of a record one by one."""
    unknown = fields.keys() - _FWD_NAMES
    if unknown:
        raise KeyError(f"not FwdParams fields: {sorted(unknown)}")
    return np.array(tuple(fields.get(name, 0) for name in FWD_DTYPE.names), dtype=FWD_DTYPE)


def with_pointers(record, pointers):
    """A copy of `record` (bytes of a pack_fwd_params record) with the POINTER_FIELDS set
    to `pointers`, as a ctypes buffer to pass by address."""
    buffer = ctypes.create_string_buffer(record, len(record))
    _POINTERS.pack_into(buffer, 0, *pointers)
    return buffer
