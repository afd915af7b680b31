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
    """The producer's coordinates for a packed batch's last key block (fwd_sm90.cu):
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
    _tma.template.cache_clear()
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
