"""CPU: the TMA descriptor arguments (cufa/_tma.py) and the params record (cufa/_params.py)."""
from cufa import _tma


def test_bshd_tensor():
    # (batch 2, rows 33, heads 4, head dim 72): rows 4 * 72 elements apart, heads 72
    dims, strides, box = _tma.map_args((2, 33, 4, 72), (33 * 288, 288, 72), 2, 128)
    assert dims == (72, 33, 4, 2)
    assert strides == (576, 144, 33 * 576)
    assert box == (64, 128, 1, 1)


def test_packed_batch_and_single_head_get_a_usable_stride():
    dims, strides, _ = _tma.map_args((1, 100, 1, 64), (0, 64, 0), 2, 176)
    assert dims == (64, 100, 1, 1) and strides == (128, 16, 16)


def test_empty_dimensions_still_describe_one_element():
    dims, _, _ = _tma.map_args((0, 0, 4, 64), (0, 256, 64), 2, 128)
    assert dims == (64, 1, 4, 1)


def test_layouts_the_copy_engine_cannot_describe():
    assert _tma.map_args((2, 8, 4, 64), (8 * 260, 260, 65), 2, 64) is None  # not 16-byte strides
    assert _tma.map_args((2, 8, 4, 64), (0, 256, 64), 2, 64) is None  # batch broadcast
    assert _tma.map_args((1, 8, 4, 64), (0, 1 << 40, 64), 2, 64) is None  # stride too large


def test_maps_record_is_five_descriptors():
    assert _tma.MAPS_BYTES == 5 * 128  # q, k, v, k_tail, v_tail


def _tma_box(memory, dims, byte_strides, itemsize, coords, box):
    """What a tiled TMA copy reads: element (i0..i3) of the box is at coords + i, zero
    where any coordinate leaves [0, dim)."""
    import numpy as np
    strides = (1,) + tuple(s // itemsize for s in byte_strides)  # in elements
    out = np.zeros(box[::-1], memory.dtype)
    for idx in np.ndindex(*box[::-1]):
        pos = [c + i for c, i in zip(coords, idx[::-1])]
        if all(0 <= x < n for x, n in zip(pos, dims)):
            out[idx] = memory[sum(x * s for x, s in zip(pos, strides))]
    return out


def test_tail_view_reads_the_sequence_end_and_zeros():
    """The producer's coordinates for a packed batch's last key block (fwd/sm90_producer.cuh):
    the rows of the sequence, then zeros, never the next sequence's rows."""
    import numpy as np
    rows, heads, cols, block_n = 40, 2, 8, 16
    kv = np.arange(1, rows * heads * cols + 1, dtype=np.int64)  # (rows, heads, cols), no zeros
    view = _tma.tail_view(rows, heads, cols, heads * cols, cols, block_n)
    dims, byte_strides, _ = _tma.map_args(*view[:2], 2, block_n)
    dense = kv.reshape(rows, heads, cols)
    for k_start, seqlen_k, key0 in ((10, 21, 16), (9, 9, 0), (20, 20, 16), (39, 1, 0)):
        shift = key0 + block_n - seqlen_k
        row = k_start + key0
        assert row >= shift  # else the kernel copies the block with cp.async
        box = _tma_box(kv, dims, byte_strides, 2, (0, shift, 1, row - shift),
                       (cols, block_n, 1, 1))[0, 0]
        valid = seqlen_k - key0
        np.testing.assert_array_equal(box[:valid], dense[row:row + valid, 1])
        assert not box[valid:].any()


def test_template_encodes_each_distinct_layout_once(monkeypatch):
    """Equal layouts (k and v of one shape, their tails) get the first one's bytes, not
    another driver encode: the record equals one encoded map by map."""
    import ctypes
    calls = []

    def encode(addr, data_type, rank, ptr, dims, strides, box, *rest):
        calls.append(addr)
        fields = (ptr, *dims, *strides, *box)
        ctypes.memmove(addr, b"".join(int(f).to_bytes(8, "little") for f in fields), 96)
        return 0

    monkeypatch.setattr(_tma, "_encode_fn", lambda: encode)
    monkeypatch.setattr(_tma, "_learned_field", None)  # no address field: the driver moves
    monkeypatch.setattr(_tma, "_kind_maps", {})
    monkeypatch.setattr(_tma, "_kind_words", {})  # (this driver's maps fail the layout model)
    monkeypatch.setattr(_tma, "_kind_parts", {})
    _tma.template.cache_clear()
    for kind in (("float16", 128),):  # learn the kind first: its probes are encodes too
        assert _tma._kind_map(*kind) is None
    calls.clear()
    q = ((1, 300, 8, 64), (0, 512, 64), 128)
    kv = ((1, 300, 2, 64), (0, 128, 64), 128)
    tails = tuple(_tma.tail_view(300, 2, 64, 128, 64, 128) for _ in range(2))
    t = _tma.template("float16", (q, kv, kv), tails)
    assert len(calls) == 3 and t.has_tails  # q, k, k's tail; v and v's tail copied
    maps = [t.record[128 * i:128 * i + 128] for i in range(5)]
    assert maps[1] == maps[2] and maps[3] == maps[4] and len({maps[0], maps[1], maps[3]}) == 3
    calls.clear()
    other = ((1, 300, 2, 64), (0, 256, 64), 128)  # v with another row stride: its own map
    t2 = _tma.template("float16", (q, kv, other), ())
    assert len(calls) == 3 and t2.record[256:384] != t2.record[128:256]
    _tma.template.cache_clear()


def _model_encode(calls, dims_minus=1):
    """A fake cuTensorMapEncodeTiled storing a map as the driver was read to (_tma's
    layout model): address in word 0, dim - 1 in 32-bit words from byte 32, stride / 16
    split into 32 low bits from byte 12 and 4 high bits from bit 224; element type and box
    in bytes of their own; the rest a pattern. dims_minus=0: a driver that stores dims
    otherwise."""
    import ctypes

    def encode(addr, data_type, rank, ptr, dims, strides, box, *rest):
        calls.append((tuple(dims), tuple(strides)))
        x = int.from_bytes(bytes(range(128, 256)), "little")
        x = x & ~((1 << 64) - 1) | ptr
        for i in range(4):
            x = x & ~(0xFFFFFFFF << 256 + 32 * i) | (dims[i] - dims_minus) << 256 + 32 * i
        for i in range(3):
            unit = strides[i] >> 4
            x = x & ~(0xFFFFFFFF << 96 + 32 * i) | (unit & 0xFFFFFFFF) << 96 + 32 * i
            x = x & ~(0xF << 224 + 4 * i) | (unit >> 32) << 224 + 4 * i
        x = x & ~(0xFFFF << 800) | data_type << 800 | (box[1] - 1) << 808
        ctypes.memmove(addr, x.to_bytes(128, "little"), 128)
        return 0
    return encode


def _random_layouts(rng, count):
    """(q, k, v) views for _tma.template, strides across the 40-bit range."""
    out = []
    for _ in range(count):
        views = []
        for box in (rng.choice((64, 128, 192)), 80, 80):
            shape = (rng.randrange(1, 1 << 16), rng.randrange(1, 1 << 31), rng.randrange(1, 300), 64)
            strides = tuple(8 * rng.randrange(1, 1 << rng.choice((8, 20, 36))) for _ in range(3))
            views.append((shape, strides, box))
        out.append(tuple(views))
    return out


def test_new_layouts_are_written_into_a_kind_map_not_encoded(monkeypatch):
    """Where the driver's maps store dims and strides as the layout model says, a new
    layout costs no encode (only each kind's probes do), and its record equals the one
    the driver encodes map by map."""
    import ctypes
    import random
    calls = []

    def replace(addr, ptr):  # the model's driver moves word 0
        ctypes.memmove(addr, ptr.to_bytes(8, "little"), 8)
        return 0

    monkeypatch.setattr(_tma, "_encode_fn", lambda: _model_encode(calls))
    monkeypatch.setattr(_tma, "_replace_fn", lambda: replace)
    monkeypatch.setattr(_tma, "_learned_field", _tma._UNKNOWN)
    monkeypatch.setattr(_tma, "_verified_kinds", set())
    monkeypatch.setattr(_tma, "_kind_maps", {})
    monkeypatch.setattr(_tma, "_kind_words", {})
    monkeypatch.setattr(_tma, "_kind_parts", {})
    _tma.template.cache_clear()
    layouts = _random_layouts(random.Random(3), 40)
    templates = [_tma.template("bfloat16", views) for views in layouts]
    written = [t.record for t in templates]
    kinds = {("bfloat16", box) for views in layouts for _, _, box in views}
    assert len(calls) == len(_tma._KIND_PROBES) * len(kinds) + 1  # + the address field's
    assert all(m is not None for m in _tma._kind_maps.values()) and _tma._kind_words
    q, k, v = 0x7F00_1234_5670, 0x7F00_0000_0100, 0x10  # the kinds' address words reused
    for t in templates:
        moved = b"".join(p.to_bytes(8, "little") + t.record[i + 8:i + 128]
                         for i, p in zip((0, 128, 256), (q, k, v)))
        assert bytes(_tma.with_addresses(t, q, k, v)) == moved + t.record[384:]
    monkeypatch.setattr(_tma, "_kind_map", lambda dtype, box_rows: None)  # the driver only
    monkeypatch.setattr(_tma, "_kind_words", {})
    _tma.template.cache_clear()
    encoded = [_tma.template("bfloat16", views).record for views in layouts]
    assert written == encoded and len(set(written)) == len(layouts)
    _tma.template.cache_clear()


def test_a_written_map_is_the_layout_model_of_map_args(monkeypatch):
    """_written_map (a new shape's maps, straight-line) refuses exactly the layouts
    map_args refuses and otherwise writes what _with_layout writes, edge strides included
    (zero under a size of one, unaligned, past 40 bits)."""
    import random
    monkeypatch.setattr(_tma, "_encode_fn", lambda: _model_encode([]))
    monkeypatch.setattr(_tma, "_kind_maps", {})
    monkeypatch.setattr(_tma, "_kind_parts", {})
    kind_map = _tma._kind_map("float16", 128)
    parts = _tma._kind_parts["float16", 128]
    rng = random.Random(5)
    sizes = (0, 1, 2, 3, 1000, (1 << 32) - 1, 1 << 32)
    strides = (0, -8, 4, 8, 64, 8 * 3, (1 << 39) - 8, 1 << 39, 8 * 0xF_1234_5678)
    refused = 0
    for _ in range(4000):
        shape = (rng.choice(sizes), rng.choice(sizes), rng.choice(sizes), rng.choice((64, 8)))
        layout = (shape, tuple(rng.choice(strides) for _ in range(3)), 128)
        args = _tma.map_args(*layout[:2], 2, 128)
        written = _tma._written_map(parts, *layout)
        if args is None:
            assert written is None, layout
            refused += 1
        else:
            assert written == _tma._with_layout(kind_map, args[0], args[1]), layout
    assert 0 < refused < 4000


def test_a_moved_map_is_the_written_map_of_its_new_sizes(monkeypatch):
    """_tma.moved_map (a moved plan's maps: a layout's pieces with only batch, rows and
    batch stride written) writes what _written_map writes for the layout at those sizes,
    and refuses what it refuses (edge sizes and strides included)."""
    import random
    monkeypatch.setattr(_tma, "_encode_fn", lambda: _model_encode([]))
    monkeypatch.setattr(_tma, "_kind_maps", {})
    monkeypatch.setattr(_tma, "_kind_parts", {})
    assert _tma._kind_map("float16", 128) is not None
    parts = _tma._kind_parts["float16", 128]
    rng = random.Random(6)
    sizes = (1, 2, 3, 1000, (1 << 32) - 1, 1 << 32)
    strides = (0, -8, 4, 8, 64, 8 * 3, (1 << 39) - 8, 1 << 39, 8 * 0xF_1234_5678)
    refused = 0
    for _ in range(300):
        heads, cols = rng.choice((1, 2, 40)), rng.choice((64, 8))
        row_stride, head_stride = 8 * rng.randrange(1, 1 << 33), rng.choice(strides[1:])
        layout = ((rng.choice(sizes), rng.choice(sizes), heads, cols),
                  (rng.choice(strides), row_stride, head_stride), 128)
        made = _tma._written_map(parts, *layout)
        if made is None:
            continue
        (writer,) = _tma.map_writers(_tma.Template(made, False, ()), "float16", (128,))
        for _ in range(20):
            batch, rows, batch_stride = rng.choice(sizes), rng.choice(sizes), rng.choice(strides)
            expected = _tma._written_map(parts, (batch, rows, heads, cols),
                                         (batch_stride, row_stride, head_stride), 128)
            assert _tma.moved_map(writer, batch, rows, batch_stride) == expected
            refused += expected is None
    assert refused


def test_a_driver_storing_layouts_otherwise_encodes_every_layout(monkeypatch):
    import random
    calls = []
    monkeypatch.setattr(_tma, "_encode_fn", lambda: _model_encode(calls, dims_minus=0))
    monkeypatch.setattr(_tma, "_learned_field", None)
    monkeypatch.setattr(_tma, "_kind_maps", {})
    monkeypatch.setattr(_tma, "_kind_words", {})
    monkeypatch.setattr(_tma, "_kind_parts", {})
    _tma.template.cache_clear()
    layouts = _random_layouts(random.Random(4), 10)
    records = [_tma.template("float16", views).record for views in layouts]
    assert set(_tma._kind_maps.values()) == {None}
    assert len(calls) == len(_tma._KIND_PROBES) * len(_tma._kind_maps) + 3 * len(layouts)
    holder, base = _tma._aligned_record()
    for views, record in zip(layouts, records):  # byte for byte the driver's own maps
        for i, view in enumerate(views):
            assert _tma._encode_at(base, "float16", _tma._PLACEHOLDER_ADDRESS, *view)
            assert record[128 * i:128 * i + 128] == __import__("ctypes").string_at(base, 128)
    _tma.template.cache_clear()


def test_no_driver_yet_is_not_remembered(monkeypatch):
    monkeypatch.setattr(_tma, "_encode_fn", lambda: lambda *args: 1)  # every encode fails
    monkeypatch.setattr(_tma, "_kind_maps", {})
    monkeypatch.setattr(_tma, "_kind_words", {})
    monkeypatch.setattr(_tma, "_kind_parts", {})
    assert _tma._kind_map("float16", 128) is None and _tma._kind_maps == {}


def test_params_record_from_named_fields():
    from cufa import _params
    import numpy as np
    packed = _params.FWD.pack({"q": 0x7f0000000000, "seqlen_k": 77, "scale": 0.5,
                               "window_left": -3, "softcap_inv": 0.25})
    assert len(packed) == _params.FWD.dtype.itemsize
    rec = np.frombuffer(packed, dtype=_params.FWD.dtype)[0]
    assert int(rec["q"]) == 0x7f0000000000 and int(rec["seqlen_k"]) == 77
    assert float(rec["scale"]) == 0.5 and int(rec["k"]) == 0
    assert int(rec["window_left"]) == -3 and float(rec["softcap_inv"]) == 0.25
    import pytest
    with pytest.raises(KeyError, match="seqlen"):
        _params.FWD.pack({"seqlen": 1})
