"""TMA tensor maps for the Hopper kernels (kernels_cu/sm90.cuh, ``TensorMaps``).

Each of q, k and v is described to the copy engine as a 4-D (columns, rows, heads, batch)
tensor with its own strides, read in boxes of 64 columns (one 128-byte swizzled panel)
by a tile's rows; elements past an end read as zeros. Packed batches add k and v as
(columns, window, heads, start row) views (``tail_view``) for each sequence's last key
block, so that the rows past the sequence read as zeros too. The driver's
``cuTensorMapEncodeTiled`` builds the 128-byte descriptors on the host; CuPy has no
wrapper, so it is called through ctypes. A layout's record is encoded once (template);
a call's record is a copy with the addresses replaced (with_addresses), cached per
addresses.
"""
import ctypes
import functools

MAPS_BYTES = 5 * 128                     # q, k, v, k_tail, v_tail (TensorMaps, sm90.cuh)
PANEL_COLUMNS = 64                       # 128 bytes of 16-bit elements: the swizzle width
_DATA_TYPES = {"float16": 6, "bfloat16": 9}  # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 / _BFLOAT16
_INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION_128B, _OOB_FILL_ZEROS = 0, 3, 2, 0
_MAX_STRIDE = 1 << 40


def map_args(shape, strides, itemsize, box_rows):
    """Arguments of one descriptor: shape and element strides are (batch, rows, heads,
    columns) with unit column stride. Returns (dims, byte strides of dims 1..3, box), or
    None where the copy engine cannot describe the tensor (the caller then uses the
    portable kernels)."""
    batch, rows, heads, cols = shape
    dims = (cols, max(rows, 1), max(heads, 1), max(batch, 1))
    byte_strides = []
    for n, s in ((rows, strides[1]), (heads, strides[2]), (batch, strides[0])):
        s *= itemsize
        if n <= 1 and s == 0:
            s = 16          # a dimension of one element: its stride is never used
        if s <= 0 or s % 16 or s >= _MAX_STRIDE:
            return None
        byte_strides.append(s)
    if max(dims) >= 1 << 32:
        return None
    return dims, tuple(byte_strides), (PANEL_COLUMNS, box_rows, 1, 1)


@functools.lru_cache(maxsize=None)
def _encode_fn():
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuTensorMapEncodeTiled
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p,
                   u32p, u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def tail_view(rows, heads, cols, row_stride, head_stride, box_rows):
    """A packed k or v as a (start row, window, heads, columns) view for map_args, as
    (shape, strides, box_rows): the window of box_rows rows and the start row both step
    one row, so a box at window position box_rows - r reads r rows from its start and
    zeros after them."""
    return (rows, box_rows, heads, cols), (row_stride, row_stride, head_stride), box_rows


@functools.lru_cache(maxsize=4096)
def template(dtype, views, tail_views=()):
    """views: (q, k, v) as (shape, strides, box_rows) tuples, as in map_args; tail_views:
    () or the packed (k, v) tail views. Returns (record, tails) -- the TensorMaps record's
    bytes, encoded at a placeholder address, and whether it holds the tail maps -- or
    None if q, k or v cannot be described. Tails the driver refuses are left out (the
    kernel then copies those blocks itself). with_addresses points a copy at the
    arrays."""
    holder, base = _aligned_record()
    for i, layout in enumerate(views):
        if not _encode_at(base + 128 * i, dtype, _PLACEHOLDER_ADDRESS, *layout):
            return None
    has_tails = bool(tail_views)
    for i, layout in enumerate(tail_views):
        has_tails = has_tails and _encode_at(base + 128 * (len(views) + i), dtype,
                                             _PLACEHOLDER_ADDRESS, *layout)
    if not has_tails:
        ctypes.memset(base + 128 * len(views), 0, MAPS_BYTES - 128 * len(views))
    return ctypes.string_at(base, MAPS_BYTES), has_tails


@functools.lru_cache(maxsize=1024)
def with_addresses(template, q, k, v):
    """A template's record with its maps pointed at q, k and v (the tail maps at k and
    v), as a ctypes buffer to pass by address (cached per addresses: read-only). A model's
    activations come at new addresses every call, and cuTensorMapReplaceAddress costs a
    fraction of encoding each map afresh."""
    record, has_tails = template
    holder, base = _aligned_record()
    ctypes.memmove(base, record, MAPS_BYTES)
    replace = _replace_fn()
    for i, ptr in enumerate((q, k, v, k, v) if has_tails else (q, k, v)):
        if replace(base + 128 * i, ptr) != 0:
            raise RuntimeError(f"cuTensorMapReplaceAddress refused address {ptr:#x}")
    return (ctypes.c_char * MAPS_BYTES).from_buffer(holder, base - ctypes.addressof(holder))


def _aligned_record():
    """A buffer holding one TensorMaps record at a 64-byte aligned address (the driver
    wants aligned maps): (buffer, that address)."""
    holder = ctypes.create_string_buffer(MAPS_BYTES + 64)
    return holder, ctypes.addressof(holder) + (-ctypes.addressof(holder) % 64)


_PLACEHOLDER_ADDRESS = 1 << 20  # aligned for any map; replaced before every launch


@functools.lru_cache(maxsize=None)
def _prepared(dtype, shape, strides, box_rows):
    """cuTensorMapEncodeTiled's arguments but the address, for one layout; None if the
    copy engine cannot describe it."""
    args = map_args(shape, strides, 2, box_rows)
    if args is None:
        return None
    dims, byte_strides, box = args
    return (_DATA_TYPES[dtype], (ctypes.c_uint64 * 4)(*dims),
            (ctypes.c_uint64 * 3)(*byte_strides), (ctypes.c_uint32 * 4)(*box),
            (ctypes.c_uint32 * 4)(1, 1, 1, 1))


@functools.lru_cache(maxsize=None)
def _replace_fn():
    fn = ctypes.CDLL("libcuda.so.1").cuTensorMapReplaceAddress
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def _encode_at(addr, dtype, ptr, shape, strides, box_rows):
    """Encode one map at `addr` (64-byte aligned); False if it cannot be described."""
    prepared = _prepared(dtype, shape, strides, box_rows)
    if prepared is None:
        return False
    data_type, dims, byte_strides, box, element_strides = prepared
    return _encode_fn()(addr, data_type, 4, ptr, dims, byte_strides, box, element_strides,
                        _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION_128B,
                        _OOB_FILL_ZEROS) == 0
