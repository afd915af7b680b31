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


def test_maps_record_is_three_descriptors():
    assert _tma.MAPS_DTYPE.itemsize == 384


def test_params_record_from_named_fields():
    from cufa import _params
    rec = _params.pack_fwd_params({"q": 0x7f0000000000, "seqlen_k": 77, "scale": 0.5})
    assert int(rec["q"]) == 0x7f0000000000 and int(rec["seqlen_k"]) == 77
    assert float(rec["scale"]) == 0.5 and int(rec["k"]) == 0 and rec.dtype == _params.FWD_DTYPE
    import pytest
    with pytest.raises(KeyError, match="seqlen"):
        _params.pack_fwd_params({"seqlen": 1})
