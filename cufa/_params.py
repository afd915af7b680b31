"""Python mirrors of the kernels' params structs, passed by value: ``FwdParams`` and
``ScheduleParams`` (kernels_cu/fwd/params.cuh), ``DecodeParams`` and ``MergeParams``
(kernels_cu/decode/params.cuh), ``BwdParams`` (kernels_cu/bwd/params.cuh).

Each field list below is the single Python statement of its layout. Every compile
appends ``static_assert``s generated from it (``layout_asserts``), so a struct that
drifted from its mirror fails to compile instead of reading garbage.
"""
import ctypes
import itertools
import math
import struct

import numpy as np

from . import _dtypes

_PTR, _I64, _I32, _F32 = np.uint64, np.int64, np.int32, np.float32

FWD_FIELDS = [
    ("q", _PTR), ("k", _PTR), ("v", _PTR), ("o", _PTR), ("lse", _PTR),
    ("attn_mask", _PTR), ("alibi_slopes", _PTR),
    ("cu_seqlens_q", _PTR), ("cu_seqlens_k", _PTR), ("seqused_k", _PTR),
    ("tile_list", _PTR), ("tile_count", _PTR), ("tile_counter", _PTR), ("block_table", _PTR),
    ("learnable_sink", _PTR),
    ("q_row_stride", _I64), ("q_head_stride", _I64),
    ("k_row_stride", _I64), ("k_head_stride", _I64),
    ("v_row_stride", _I64), ("v_head_stride", _I64),
    ("o_row_stride", _I64), ("o_head_stride", _I64),
    ("mask_batch_stride", _I64), ("mask_head_stride", _I64),
    ("mask_row_stride", _I64), ("mask_col_stride", _I64),
    ("alibi_batch_stride", _I64), ("block_table_batch_stride", _I64),
    # what a call's sizes set, one run of fields (_fwd_plan._Mover writes them with one pack)
    ("q_batch_stride", _I64), ("k_batch_stride", _I64), ("v_batch_stride", _I64),
    ("o_batch_stride", _I64), ("lse_batch_stride", _I64), ("lse_head_stride", _I64),
    ("batch", _I32), ("seqlen_q", _I32), ("seqlen_k", _I32),
    ("num_m_blocks", _I32), ("heads_per_group", _I32), ("tail_group_head", _I32),
    ("nheads", _I32), ("nheads_k", _I32), ("head_dim", _I32), ("kv_tail_maps", _I32),
    ("bottom_right", _I32), ("window_left", _I32), ("window_right", _I32),
    ("attn_mask_type", _I32), ("page_shift", _I32), ("num_pages", _I32), ("sink_dtype", _I32),
    ("scale", _F32), ("scale_log2", _F32), ("softcap", _F32), ("softcap_inv", _F32),
    # an e4m3 K/V cache's scales (last: the other fields keep their offsets)
    ("k_descale", _PTR), ("v_descale", _PTR),
    ("k_descale_batch_stride", _I64), ("k_descale_head_stride", _I64),
    ("v_descale_batch_stride", _I64), ("v_descale_head_stride", _I64),
    ("head_dim_v", _I32),
    ("q_descale", _PTR), ("q_descale_batch_stride", _I64), ("q_descale_head_stride", _I64),
]

DECODE_FIELDS = [
    ("q", _PTR), ("k", _PTR), ("v", _PTR), ("o", _PTR), ("lse", _PTR),
    ("o_partial", _PTR), ("lse_partial", _PTR),
    ("cache_seqlens", _PTR), ("cache_batch_idx", _PTR), ("cache_leftpad", _PTR),
    ("block_table", _PTR), ("alibi_slopes", _PTR),
    ("k_new", _PTR), ("v_new", _PTR), ("q_source", _PTR), ("rotary_cos", _PTR),
    ("rotary_sin", _PTR), ("cu_seqlens_q", _PTR), ("cu_seqlens_k", _PTR), ("seqused_k", _PTR),
    ("split_counters", _PTR), ("decode_order", _PTR), ("learnable_sink", _PTR),
    ("k_descale", _PTR), ("v_descale", _PTR), ("qv", _PTR),
    ("q_batch_stride", _I64), ("q_row_stride", _I64), ("q_head_stride", _I64),
    ("k_batch_stride", _I64), ("k_row_stride", _I64), ("k_head_stride", _I64),
    ("v_batch_stride", _I64), ("v_row_stride", _I64), ("v_head_stride", _I64),
    ("o_batch_stride", _I64), ("o_row_stride", _I64), ("o_head_stride", _I64),
    ("block_table_batch_stride", _I64), ("alibi_batch_stride", _I64),
    ("k_new_batch_stride", _I64), ("k_new_row_stride", _I64), ("k_new_head_stride", _I64),
    ("v_new_batch_stride", _I64), ("v_new_row_stride", _I64), ("v_new_head_stride", _I64),
    ("q_source_batch_stride", _I64), ("q_source_row_stride", _I64),
    ("q_source_head_stride", _I64), ("lse_batch_stride", _I64), ("lse_head_stride", _I64),
    ("k_descale_batch_stride", _I64), ("k_descale_head_stride", _I64),
    ("v_descale_batch_stride", _I64), ("v_descale_head_stride", _I64),
    ("qv_batch_stride", _I64), ("qv_row_stride", _I64), ("qv_head_stride", _I64),
    ("batch", _I32), ("seqlen_q", _I32), ("nheads", _I32), ("nheads_k", _I32), ("group", _I32),
    ("head_dim", _I32), ("head_dim_v", _I32), ("total_q", _I32), ("cache_seqlen_fixed", _I32),
    ("seqlen_new", _I32),
    ("capacity", _I32), ("cache_rows", _I32), ("page_shift", _I32), ("max_pages", _I32),
    ("num_splits", _I32), ("num_m_blocks", _I32), ("combine_row_threads", _I32),
    ("window_left", _I32), ("window_right", _I32),
    ("rotary_dim", _I32), ("seqlen_ro", _I32), ("rotary_dtype", _I32),
    ("rotary_interleaved", _I32), ("rotary_q_per_token", _I32), ("sink_dtype", _I32),
    ("scale", _F32), ("scale_log2", _F32), ("softcap", _F32), ("softcap_inv", _F32),
]

MERGE_FIELDS = [(n, _PTR) for n in ("out_a", "lse_a", "out_b", "lse_b", "out", "lse")] + [
    (f"{x}_{d}_stride", _I64) for x in ("out_a", "out_b", "out")
    for d in ("batch", "row", "head", "col")] + [
    (f"{x}_{d}_stride", _I64) for x in ("lse_a", "lse_b", "lse")
    for d in ("batch", "head", "row")] + [
    ("batch", _I32), ("seqlen", _I32), ("nheads", _I32), ("head_dim", _I32)]


TRANSPOSE_V_FIELDS = [("v", _PTR), ("vt", _PTR)] + [
    (f"v_{d}_stride", _I64) for d in ("batch", "row", "head")] + [
    (n, _I32) for n in ("batch", "seqlen", "nheads_k", "head_dim", "padded_seqlen")] + [
    ("cu_seqlens_k", _PTR), ("seqused_k", _PTR)]


GATHER_PAGES_FIELDS = [(n, _PTR) for n in (
    "k_cache", "v_cache", "k_out", "v_out", "block_table", "cu_seqlens_k", "seqused_k",
    "cu_seqlens_out", "seqused_out")] + [
    (f"{x}_{d}_stride", _I64) for x in ("k", "v") for d in ("page", "row", "head")] + [
    (n, _I32) for n in ("batch", "nheads_k", "head_dim", "page_shift", "num_pages",
                        "max_pages", "table_stride")]


BWD_FIELDS = [(n, _PTR) for n in ("dout", "dq", "dk", "dv", "softmax_d", "dsink", "dlse",
                                  "dmask", "dq_accum", "kv_tile_list", "kv_tile_count")] + [
    (f"{x}_{d}_stride", _I64) for x in ("dout", "dq", "dk", "dv")
    for d in ("batch", "row", "head")] + [
    (f"dmask_{d}_stride", _I64) for d in ("batch", "head", "row", "col")] + [
    (f"dq_accum_{d}_stride", _I64) for d in ("batch", "row", "head")] + [
    ("dq_accum_floats", _I64), ("num_n_blocks", _I32), ("rows", _I32), ("tile_counter", _PTR),
    ("kv_heads_per_group", _I32), ("kv_tail_group_head", _I32)]


SCHEDULE_FIELDS = [(n, _PTR) for n in ("cu_seqlens_q", "scratch", "tile_list", "tile_count",
                                       "tile_counter", "cu_seqlens_k", "seqused_k",
                                       "decode_order")] + [
    (n, _I32) for n in ("batch", "total_q", "block_m", "num_buckets", "decode_rows",
                        "capacity", "key_shift")]


class Record:
    """One params struct: its NumPy layout, and the pointer fields that lead it (so a
    call's addresses go in with one struct.pack)."""

    def __init__(self, struct_name, fields):
        self.struct_name = struct_name
        self.dtype = np.dtype(fields, align=True)
        self.names = frozenset(self.dtype.names)
        # (the leading run: pointers after it, FwdParams' descales, are set by name)
        self.pointer_fields = tuple(itertools.takewhile(lambda f: f[1] is _PTR, fields))
        self.pointer_fields = tuple(name for name, _ in self.pointer_fields)
        assert all(self.dtype.fields[n][1] == 8 * i for i, n in enumerate(self.pointer_fields))
        self._pointers = struct.Struct(f"<{len(self.pointer_fields)}Q")
        self._buffer = ctypes.c_char * self.dtype.itemsize
        self._record = struct.Struct(_struct_format(self.dtype))
        self._zeros = dict.fromkeys(self.dtype.names, 0)  # fields left out; in layout order
        codes = _struct_codes()
        self._fields = {name: (struct.Struct("<" + codes[self.dtype.fields[name][0]]),
                               self.dtype.fields[name][1]) for name in self.dtype.names}

    def pack(self, fields):
        """{field: value} -> the record's bytes, passed by value to the kernel (fields left
        out are 0). One struct.pack of the layout (a plan for a new signature makes one)."""
        values = self._zeros.copy()
        values.update(fields)
        if len(values) != len(self._zeros):
            unknown = fields.keys() - self.names
            raise KeyError(f"not {self.struct_name} fields: {sorted(unknown)}")
        return self._record.pack(*values.values())

    def with_fields(self, record, fields):
        """A copy of `record` (bytes of a packed record) with `fields` ({field: value})
        set, as bytes."""
        buffer = bytearray(record)
        for name, value in fields.items():
            packer, offset = self._fields[name]
            packer.pack_into(buffer, offset, value)
        return bytes(buffer)

    def setter(self, names):
        """A function (record, values) -> a copy of record (bytes) with the fields `names`
        set to `values` (in that order): with_fields for a set of fields set often (a moved
        plan's sizes), their packers looked up once."""
        packers = tuple(self._fields[name] for name in names)
        offsets = [offset for _, offset in packers]
        ends = [offset + packer.size for packer, offset in packers]
        if offsets[1:] == ends[:-1]:  # one run of fields, in order: one pack
            run = struct.Struct("<" + "".join(packer.format[1:] for packer, _ in packers))
            start = offsets[0]

            def set_run(record, values):
                buffer = bytearray(record)
                run.pack_into(buffer, start, *values)
                return bytes(buffer)
            return set_run

        def set_fields(record, values):
            buffer = bytearray(record)
            for (packer, offset), value in zip(packers, values):
                packer.pack_into(buffer, offset, value)
            return bytes(buffer)
        return set_fields

    def argument(self, record):
        """`record` (bytes of a packed record) as a ctypes buffer to pass by address."""
        return self._buffer.from_buffer_copy(record)

    def with_pointer_values(self, record, values):
        """A copy of `record` (bytes of a packed record) with the pointer fields set to
        `values`, in pointer_fields order, as a ctypes buffer to pass by address."""
        buffer = self._buffer.from_buffer_copy(record)  # (create_string_buffer costs more)
        self._pointers.pack_into(buffer, 0, *values)
        return buffer


def _struct_codes():
    return {np.dtype(_PTR): "Q", np.dtype(_I64): "q", np.dtype(_I32): "i", np.dtype(_F32): "f"}


def _struct_format(dtype):
    """The struct module's format of an aligned NumPy record dtype (padding as pad bytes)."""
    codes = _struct_codes()
    fmt, at = "<", 0
    for name in dtype.names:
        kind, offset = dtype.fields[name][:2]
        fmt += "x" * (offset - at) + codes[kind]
        at = offset + kind.itemsize
    return fmt + "x" * (dtype.itemsize - at)


FWD = Record("cufa::FwdParams", FWD_FIELDS)
DECODE = Record("cufa::DecodeParams", DECODE_FIELDS)
MERGE = Record("cufa::MergeParams", MERGE_FIELDS)
SCHEDULE = Record("cufa::ScheduleParams", SCHEDULE_FIELDS)
BWD = Record("cufa::BwdParams", BWD_FIELDS)
TRANSPOSE_V = Record("cufa::TransposeVParams", TRANSPOSE_V_FIELDS)
GATHER_PAGES = Record("cufa::GatherPagesParams", GATHER_PAGES_FIELDS)
# marker in a kernel source -> the record whose layout checks a compile of it appends
RECORDS = {"struct FwdParams {": FWD, "struct DecodeParams {": DECODE,
           "struct MergeParams {": MERGE, "struct ScheduleParams {": SCHEDULE,
           "struct BwdParams {": BWD, "struct TransposeVParams {": TRANSPOSE_V,
           "struct GatherPagesParams {": GATHER_PAGES}

# AttnMaskType in fwd/params.cuh
ATTN_MASK_NONE = 0  # (a mask's dtype gives the other codes: _dtypes.TABLE's attn_mask)
# SinkDtype in common/softmax.cuh: learnable_sink's dtype, read by the kernels
SINK_DTYPES = _dtypes.codes("sink")


def layout_asserts(record):
    """C++ static_asserts pinning the size and every field offset to a Record
    (``cufa::field_offset`` in common/types.cuh finds an offset at compile time)."""
    struct_name, dtype = record.struct_name, record.dtype
    lines = [f"static_assert(sizeof({struct_name}) == {dtype.itemsize}, "
             f"\"{struct_name} size differs from cufa/_params.py\");"]
    for name in dtype.names:
        field_type, offset = dtype.fields[name][:2]
        marker = "1.0000001f" if field_type.kind == "f" else "1"   # lowest byte non-zero
        lines.append(f"static_assert(cufa::field_offset(&{struct_name}::{name}, "
                     f"decltype({struct_name}::{name})({marker})) == {offset}, "
                     f"\"{struct_name}::{name} offset differs from cufa/_params.py\");")
    return "\n".join(lines) + "\n"


_LOG2_E = math.log2(math.e)


def score_fields(window, scale, softcap, d, alibi):
    """The mask and score fields that FwdParams and DecodeParams share."""
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    return dict(window_left=window[0], window_right=window[1], scale=scale,
                scale_log2=scale * _LOG2_E, softcap=softcap,
                softcap_inv=1.0 / softcap if softcap > 0 else 0.0,
                alibi_batch_stride=alibi.strides[0] if alibi is not None and alibi.ndim == 2
                else 0)
