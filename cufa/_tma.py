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


def encode(dtype, ptr, dims, byte_strides, box):
    """The 128-byte descriptor, or None if the driver refuses the arguments."""
    buf = ctypes.create_string_buffer(128 + 64)
    addr = (ctypes.addressof(buf) + 63) & ~63  # the driver wants it 64-byte aligned
    rc = _encode_fn()(addr, _DATA_TYPES[dtype], 4, ptr, (ctypes.c_uint64 * 4)(*dims),
                      (ctypes.c_uint64 * 3)(*byte_strides), (ctypes.c_uint32 * 4)(*box),
                      (ctypes.c_uint32 * 4)(1, 1, 1, 1), _INTERLEAVE_NONE, _SWIZZLE_128B,
                      _L2_PROMOTION_128B, _OOB_FILL_ZEROS)
    return ctypes.string_at(addr, 128) if rc == 0 else None


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
    driver refuses are left out (the kernel then copies those blocks itself)."""
    descriptors = [_describe(dtype, view) for view in views]
    if None in descriptors:
        return None
    tails = [_describe(dtype, view) for view in tail_views]
    has_tails = bool(tails) and None not in tails
    record = b"".join(descriptors + (tails if has_tails else [])).ljust(MAPS_BYTES, b"\0")
    return ctypes.create_string_buffer(record, MAPS_BYTES), has_tails


def _describe(dtype, view):
    ptr, shape, strides, box_rows = view
    args = map_args(shape, strides, 2, box_rows)
    return encode(dtype, ptr, *args) if args else None
