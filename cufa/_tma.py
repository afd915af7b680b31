"""TMA tensor maps for the Hopper kernels (kernels_cu/sm90.cuh, ``TensorMaps``).

Each of q, k and v is described to the copy engine as a 4-D (columns, rows, heads, batch)
tensor with its own strides, read in boxes of 64 columns (one 128-byte swizzled panel)
by a tile's rows; elements past an end read as zeros. Packed batches add k and v as
(columns, window, heads, start row) views (``tail_view``) for each sequence's last key
block, so that the rows past the sequence read as zeros too. The driver's
``cuTensorMapEncodeTiled`` builds the 128-byte descriptors on the host; CuPy has no
wrapper, so it is called through ctypes. Descriptors depend only on their arguments, so
each (q, k, v) record is cached.
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


@functools.lru_cache(maxsize=1024)
def tensor_maps(dtype, views, tail_views=()):
    """views: (q, k, v) as (ptr, shape, strides, box_rows) tuples, as in map_args;
    tail_views: () or the packed (k, v) tail views. Returns (record, tails) -- the
    TensorMaps record as a ctypes buffer to pass by address (cached: read-only) and
    whether it holds the tail maps -- or None if q, k or v cannot be described. Tails the
    driver refuses are left out (the kernel then copies those blocks itself). Each map is
    encoded straight into the record, from arguments prepared once per layout: a model's
    activations come at new addresses every call."""
    holder = ctypes.create_string_buffer(MAPS_BYTES + 64)
    offset = -ctypes.addressof(holder) % 64  # the driver wants 64-byte aligned maps
    base = ctypes.addressof(holder) + offset
    for i, (ptr, *layout) in enumerate(views):
        if not _encode_at(base + 128 * i, dtype, ptr, *layout):
            return None
    has_tails = bool(tail_views)
    for i, (ptr, *layout) in enumerate(tail_views):
        has_tails = has_tails and _encode_at(base + 128 * (len(views) + i), dtype, ptr, *layout)
    if not has_tails:
        ctypes.memset(base + 128 * len(views), 0, MAPS_BYTES - 128 * len(views))
    return (ctypes.c_char * MAPS_BYTES).from_buffer(holder, offset), has_tails


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


def _encode_at(addr, dtype, ptr, shape, strides, box_rows):
    """Encode one map at `addr` (64-byte aligned); False if it cannot be described."""
    prepared = _prepared(dtype, shape, strides, box_rows)
    if prepared is None:
        return False
    data_type, dims, byte_strides, box, element_strides = prepared
    return _encode_fn()(addr, data_type, 4, ptr, dims, byte_strides, box, element_strides,
                        _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION_128B,
                        _OOB_FILL_ZEROS) == 0
