"""TMA tensor maps for the Hopper kernels (kernels_cu/common/sm90.cuh, ``TensorMaps``).

Each of q, k and v is described to the copy engine as a 4-D (columns, rows, heads, batch)
tensor with its own strides, read in boxes of 64 columns (one 128-byte swizzled panel)
by a tile's rows; elements past an end read as zeros. Packed batches add k and v as
(columns, window, heads, start row) views (``tail_view``) for each sequence's last key
block, so that the rows past the sequence read as zeros too. The driver's
``cuTensorMapEncodeTiled`` builds the 128-byte descriptors on the host; CuPy has no
wrapper, so it is called through ctypes. A layout's record is made once (template): the
driver encodes one map per kind (element type and box), and a new layout's maps are that
map with their dims and strides written in, where the driver's own encodes show them
stored as _with_layout writes them (else the driver encodes every layout). A call's
record is a copy with the addresses replaced (with_addresses).
"""
import ctypes
import functools
import struct

MAPS_BYTES = 5 * 128                     # q, k, v, k_tail, v_tail (TensorMaps, common/sm90.cuh)
_MAPS_BUFFER = ctypes.c_char * MAPS_BYTES  # a record's type as a launch argument
PADS = [bytes(MAPS_BYTES - 128 * n) for n in range(6)]  # a record of n maps to MAPS_BYTES
NO_MAPS = _MAPS_BUFFER()  # the maps argument of a kernel that takes maps and reads none
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


class Template:
    """A layout's TensorMaps record, every map encoded at a placeholder address. (A plain
    class: a new shape makes one, and a frozen dataclass's fields cost a setattr each.)"""
    __slots__ = ("record", "has_tails", "address_words")

    def __init__(self, record, has_tails, address_words):
        self.record = record                # bytes
        self.has_tails = has_tails          # the record holds the packed k/v tail maps
        self.address_words = address_words  # per map (byte offset, bits kept, shift) of the
        # 64-bit word that holds its address; () where only the driver may move them


@functools.lru_cache(maxsize=4096)
def template(dtype, views, tail_views=()):
    """views: (q, k, v) as (shape, strides, box_rows) tuples, as in map_args; tail_views:
    () or the packed (k, v) tail views. Returns the layout's Template, or None if q, k or
    v cannot be described. Tails the driver refuses are left out (the kernel then copies
    those blocks itself). with_addresses points a copy at a call's arrays."""
    made = _kind_template(dtype, views, tail_views)
    if made is not None:
        return made
    maps = {}  # layout -> its map at the placeholder; equal layouts have equal maps (k
    # and v of one shape, their tails)

    def make(layout):
        if layout not in maps:
            maps[layout] = _map(dtype, layout)
        return maps[layout]

    record = [make(layout) for layout in views]
    if None in record:
        return None
    tails = [make(layout) for layout in tail_views]
    has_tails = bool(tails) and None not in tails
    record = b"".join(record + tails if has_tails else record)
    record += bytes(MAPS_BYTES - len(record))
    # what the driver's encoding can depend on besides shapes and strides: the element
    # type and the boxes (the rank, swizzle and fill are the same for every map here)
    kind = (dtype, tuple(view[2] for view in views),
            tuple(view[2] for view in tail_views) if has_tails else ())
    words = _kind_words.get(kind)
    if words is None:
        words = _address_words(record, len(views) + has_tails * 2, kind)
        if all(_kind_maps.get((dtype, box)) for box in kind[1] + kind[2]):
            # every map is its kind's with dims and strides written in, which leave the
            # address field as it is: the next record of this kind has the same words
            field = _address_field()
            if field is not None and not _DIMS_AND_STRIDES[0] - 8 < field[0] < _DIMS_AND_STRIDES[1]:
                _kind_words[kind] = words
    return Template(record, has_tails, words)


def _kind_template(dtype, views, tail_views):
    """template() of a kind seen before whose maps are all kind maps (_kind_map): each
    map one struct pack of its dims and strides into its kind's map, the address words
    the kind's. None where that does not hold (the general path then decides), e.g. a
    layout map_args refuses."""
    q, k, v = views
    kind = (dtype, (q[2], k[2], v[2]), (tail_views[0][2], tail_views[1][2]) if tail_views else ())
    words = _kind_words.get(kind)
    if words is None:
        return None
    record, previous = [], None
    for layout in views + tail_views:
        if layout != previous:  # k and v of one shape (and their tails) share a map
            previous, made = layout, _written_map(_kind_parts[dtype, layout[2]], *layout)
            if made is None:
                return None
        record.append(made)
    record.append(PADS[len(record)])
    return Template(b"".join(record), bool(tail_views), words)


def new_shape_template(dtype, views, tail_views=()):
    """template(), for a shape not seen before (a plan moved to new sizes): the kind maps'
    path without the cache's lookup and insertion, else template()."""
    return _kind_template(dtype, views, tail_views) or template(dtype, views, tail_views)


def _written_map(parts, shape, strides, box_rows):
    """_with_layout(kind map, *map_args(shape, strides, 2, box_rows)[:2]) from the kind
    map's parts (_kind_parts), straight-line (a new shape writes three to five of these);
    None where map_args would refuse the layout."""
    batch, rows, heads, cols = shape
    batch_stride, row_stride, head_stride = strides
    # strides in 16-byte units (2-byte elements); a dimension of one element may have
    # stride 0, which is never used
    u0 = row_stride >> 3 if row_stride or rows > 1 else 1
    u1 = head_stride >> 3 if head_stride or heads > 1 else 1
    u2 = batch_stride >> 3 if batch_stride or batch > 1 else 1
    if (min(row_stride, head_stride, batch_stride) < 0 or (row_stride | head_stride | batch_stride) & 7
            or (u0 | u1 | u2) >> 36 or not (u0 and u1 and u2) or (rows | heads | batch | cols) >> 32):
        return None
    head, middle, high, pad, tail = parts
    return _MAP.pack(head, u0 & _LOW32, u1 & _LOW32, u2 & _LOW32, middle,
                     high | u0 >> 32 | u1 >> 32 << 4 | u2 >> 32 << 8, pad, cols - 1,
                     rows - 1 if rows > 1 else 0, heads - 1 if heads > 1 else 0,
                     batch - 1 if batch > 1 else 0, tail)


# A moved plan's maps (_fwd_plan._Mover): a layout's map with only its batch, rows and batch
# stride left to write, the rest (the kind's bytes, columns, heads, row and head
# strides) packed once a layout.
_MOVED_MAP = struct.Struct("<20sI4sH6sI4sI80s")


def map_writers(template, dtype, boxes):
    """What moved_map needs of each map of `template` (a layout's record, its maps of box
    rows `boxes`) besides its batch, rows and batch stride: the map's bytes around those
    fields. None unless every map is its kind's with dims and strides written in
    (_kind_parts), so that moved_map's maps are what _written_map would write."""
    if not all((dtype, box) in _kind_parts for box in boxes):
        return None
    writers, record = [], template.record
    for at in range(0, 128 * len(boxes), 128):
        made = record[at:at + 128]
        high = int.from_bytes(made[28:30], "little") & ~0xF00  # the batch stride's nibble out
        writers.append((made[:20], made[24:28], high, made[30:36], made[40:44], made[48:]))
    return writers


def moved_map(writer, batch, rows, batch_stride):
    """_written_map of the writer's layout at a new batch, rows and batch stride (in
    elements); None where map_args would refuse them."""
    u2 = batch_stride >> 3 if batch_stride or batch > 1 else 1
    if batch_stride < 0 or batch_stride & 7 or u2 >> 36 or not u2 or (rows | batch) >> 32:
        return None
    start, middle, high, columns, heads, tail = writer
    return _MOVED_MAP.pack(start, u2 & _LOW32, middle, high | u2 >> 32 << 8, columns,
                           rows - 1 if rows > 1 else 0, heads, batch - 1 if batch > 1 else 0,
                           tail)


def with_addresses(template, q, k, v, tails=None):
    """The template's record with its maps pointed at q, k and v (the tail maps at k and
    v, or at the pair `tails`), as a ctypes buffer to pass by address (the launch copies
    it). A model's activations come at new addresses every call: the addresses are written
    into a copy of the record where their place in it is known (_address_field), else
    moved by cuTensorMapReplaceAddress, one driver call a map."""
    pointers = (q, k, v) + ((tails or (k, v)) if template.has_tails else ())
    if not template.address_words:
        return _moved_by_driver(template, pointers)
    record = _MAPS_BUFFER.from_buffer_copy(template.record)  # (create_string_buffer costs more)
    for (offset, kept, shift), ptr in zip(template.address_words, pointers):
        _WORD.pack_into(record, offset, kept | ptr >> shift)
    return record


@functools.lru_cache(maxsize=1024)
def _moved_by_driver(template, pointers):
    """with_addresses through the driver (cached per addresses: read-only)."""
    holder, base = _aligned_record()
    ctypes.memmove(base, template.record, MAPS_BYTES)
    for i, ptr in enumerate(pointers):
        if _replace_fn()(base + 128 * i, ptr) != 0:
            raise RuntimeError(f"cuTensorMapReplaceAddress refused address {ptr:#x}")
    return (ctypes.c_char * MAPS_BYTES).from_buffer(holder, base - ctypes.addressof(holder))


def _map(dtype, layout):
    """The map of `layout` ((shape, strides, box_rows), as map_args) at the placeholder
    address: its kind's map with the layout's dims and strides written in, or where that
    kind's maps do not store them as _with_layout writes them, the driver's encode. None
    if the copy engine cannot describe the layout."""
    shape, strides, box_rows = layout
    args = map_args(shape, strides, 2, box_rows)
    if args is None:
        return None
    kind_map = _kind_map(dtype, box_rows)
    if kind_map is not None:
        return _with_layout(kind_map, args[0], args[1])
    holder, base = _aligned_record()
    if not _encode_at(base, dtype, _PLACEHOLDER_ADDRESS, *layout):
        return None
    return ctypes.string_at(base, 128)


# Where a map keeps its dims and strides (CUtensorMap is opaque; read off the driver's
# encodes of 661 layouts on an H100, driver 580): dim - 1 in four 32-bit words from byte
# 32; stride / 16 in 36 bits each, the low 32 in three words from byte 12, the high 4 in
# consecutive nibbles from byte 28. Trusted for a kind only after the driver's encodes of
# _KIND_PROBES matched it (_kind_map).
_MAP = struct.Struct("<12s3I4sH2s4I80s")  # the pieces of a map around those fields
_DIMS_AND_STRIDES = (12, 48)  # the bytes _with_layout writes
_LOW32 = 0xFFFFFFFF


def _with_layout(kind_map, dims, byte_strides):
    """kind_map (128 bytes) with the dims and byte strides (dims 1..3) of map_args."""
    u0, u1, u2 = (s >> 4 for s in byte_strides)
    high = (int.from_bytes(kind_map[28:30], "little") & ~0xFFF
            | u0 >> 32 | u1 >> 32 << 4 | u2 >> 32 << 8)
    return _MAP.pack(kind_map[:12], u0 & _LOW32, u1 & _LOW32, u2 & _LOW32, kind_map[24:28],
                     high, kind_map[30:32], dims[0] - 1, dims[1] - 1, dims[2] - 1,
                     dims[3] - 1, kind_map[48:])


# (shape, strides) of layouts whose driver encodes must match _with_layout on a kind's
# map: small and large dims, strides across the 40-bit range (high nibbles set)
_KIND_PROBES = (
    ((3, 1000, 8, 64), (8 * 64 * 1000, 8 * 64, 64)),
    ((0xFFFF, 0xFFFF_FFF1, 0xABCD, 64), (0x3_B2A1_9080, 0x7F_FFFF_FFF8, 0x9_1A2B_3C48)),
    ((1, 1, 1, 64), (0, 0, 0)),
)
_kind_maps = {}  # (dtype, box_rows) -> the kind's map at the placeholder, or None
_kind_words = {}  # template's kind -> the address words of its records made of kind maps
_kind_parts = {}  # (dtype, box_rows) -> its kind map around the fields (_written_map)


def _kind_map(dtype, box_rows):
    """The map the driver encodes for a kind at the placeholder, if its encodes of every
    _KIND_PROBES layout equal that map with the probe's dims and strides written in
    (_with_layout); else None. Learned once a kind, not while the driver cannot encode."""
    kind = (dtype, box_rows)
    if kind in _kind_maps:
        return _kind_maps[kind]
    holder, base = _aligned_record()
    maps = []
    for shape, strides in _KIND_PROBES:
        if not _encode_at(base, dtype, _PLACEHOLDER_ADDRESS, shape, strides, box_rows):
            return None  # no driver to ask yet (or it refuses): not remembered
        maps.append((ctypes.string_at(base, 128), map_args(shape, strides, 2, box_rows)))
    kind_map = maps[0][0]
    holds = all(_with_layout(kind_map, args[0], args[1]) == m for m, args in maps)
    _kind_maps[kind] = kind_map if holds else None
    if holds:
        _kind_parts[kind] = (kind_map[:12], kind_map[24:28],
                             int.from_bytes(kind_map[28:30], "little") & ~0xFFF,
                             kind_map[30:32], kind_map[48:])
    return _kind_maps[kind]


def _address_field():
    """(byte offset, shift) such that a map keeps its address as address >> shift in the
    low 64 - shift bits of the little-endian word at that offset, the word's other bits
    untouched by a move; None if no such field explains the driver's moves. CUtensorMap is
    opaque, so this is learned from the driver: one map, encoded at the placeholder and
    moved by cuTensorMapReplaceAddress to addresses with varied bits, must match the
    model byte for byte at every one. Learned once a process; not while the driver cannot
    encode at all (no CUDA context yet)."""
    global _learned_field
    if _learned_field is not _UNKNOWN:
        return _learned_field
    holder, base = _aligned_record()
    if not _encode_at(base, "float16", _PLACEHOLDER_ADDRESS, (1, 64, 1, 64), (0, 64, 64), 64):
        return None
    _learned_field = _fitted_field(base, ctypes.string_at(base, 128))
    return _learned_field


def _fitted_field(base, encoded):
    """_address_field's search, on the map `encoded` (also at base)."""
    moved = {_PLACEHOLDER_ADDRESS: encoded}
    for address in _PROBE_ADDRESSES:
        ctypes.memmove(base, encoded, 128)
        if _replace_fn()(base, address) != 0:
            return None
        moved[address] = ctypes.string_at(base, 128)
    for offset in range(128 - 7):
        for shift in range(5):
            if all(_patched(encoded, offset, shift, a) == m for a, m in moved.items()):
                return offset, shift
    return None


def _address_words(record, count, kind):
    """Template.address_words of a record of `count` maps, or () unless every map keeps
    the placeholder in _address_field and, the first time a record of this `kind` is
    seen, writing one test address there gives the driver's own move of the whole record.
    (The check costs a driver move a map, a third of a new shape's descriptor cost, and
    where a map's address sits does not change with its dims: once a kind is enough.)"""
    field = _address_field()
    if field is None:
        return ()
    offset, shift = field
    mask = _U64 >> shift
    words = []
    for i in range(count):
        at = 128 * i + offset
        word = int.from_bytes(record[at:at + 8], "little")
        if word & mask != _PLACEHOLDER_ADDRESS >> shift:
            return ()
        words.append((at, word & ~mask, shift))
    if kind in _verified_kinds:
        return tuple(words)
    expected = record
    for at, _, _ in words:
        expected = _patched(expected, at, shift, _PROBE_ADDRESSES[0])
    holder, base = _aligned_record()
    ctypes.memmove(base, record, MAPS_BYTES)
    for i in range(count):
        if _replace_fn()(base + 128 * i, _PROBE_ADDRESSES[0]) != 0:
            return ()
    if ctypes.string_at(base, MAPS_BYTES) != expected:
        return ()
    _verified_kinds.add(kind)
    return tuple(words)


def _patched(record, offset, shift, address):
    """record with address written into the field at offset (see _address_field)."""
    word = int.from_bytes(record[offset:offset + 8], "little")
    word = word & ~(_U64 >> shift) | address >> shift
    return record[:offset] + word.to_bytes(8, "little") + record[offset + 8:]


def _aligned_record():
    """A buffer holding one TensorMaps record at a 64-byte aligned address (the driver
    wants aligned maps): (buffer, that address)."""
    holder = ctypes.create_string_buffer(MAPS_BYTES + 64)
    return holder, ctypes.addressof(holder) + (-ctypes.addressof(holder) % 64)


_PLACEHOLDER_ADDRESS = 1 << 20  # aligned for any map; replaced before every launch
_UNKNOWN = object()
_learned_field = _UNKNOWN
_verified_kinds = set()  # _address_words' kinds whose records matched the driver's moves
# 16-byte aligned, with varied bits over the 49-bit range of device addresses
_PROBE_ADDRESSES = (0x7F12_3456_7890, 0x1_0000_0010, 0x0F0F_0F0F_0F00, 0x1555_5555_5550)
_U64 = (1 << 64) - 1
_WORD = struct.Struct("<Q")


@functools.lru_cache(maxsize=4096)
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
