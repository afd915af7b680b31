"""CPU: any head dim from 1 to 256 and any strides (last dim contiguous). Which arrays are
chunk-aligned (_checks.chunk_aligned), and that a call with one that is not takes the
element-wise I/O variants on every GPU (Hopper's wgmma and TMA kernels need aligned rows),
with a plan of its own: an aligned call's plan is never reused for it. The device layer is
test_launch_path_cpu's recorder; the variants a plan compiles are recorded here."""
import numpy as np
import pytest

import cufa
from cufa import _arrays, _checks, _compile, _decode_plan, _interop, _params, _runtime
from test_launch_path_cpu import _last_plan, device, h100, record, view  # noqa: F401

_addresses = iter(range(1 << 41, 1 << 42, 1 << 24))


def strided(shape, strides, offset=0, dtype="float16"):
    """A view at a 16 MB aligned address plus `offset` bytes."""
    itemsize = 4 if dtype in ("float32", "int32") else 2
    return _interop.DeviceArray(None, "cupy", next(_addresses) + offset, tuple(shape),
                                tuple(strides), dtype, 0, itemsize)


def sliced(shape):
    """shape as a slice at element offset 1 of a buffer whose rows are one element
    longer: strides that are no multiple of 8, a start 2 bytes off 16."""
    wide = tuple(shape[:-1]) + (shape[-1] + 1,)
    return strided(shape, _interop.contiguous_strides(wide), 2)


@pytest.fixture
def compiled(device, monkeypatch):
    """The variants the plans ask for, in order."""
    seen = []
    monkeypatch.setattr(_compile, "function_pointer",
                        lambda variant, device: seen.append(variant) or 0xF00)
    return seen


def fields(params, record_type=_params.FWD):
    return np.frombuffer(params, dtype=record_type.dtype)[0]


# -- the checks ------------------------------------------------------------------------------

def test_chunk_aligned():
    ok = _checks.chunk_aligned
    assert ok((2, 33, 4, 64), (33 * 256, 256, 64, 1), 0x1000)
    assert not ok((2, 33, 4, 59), (33 * 236, 236, 59, 1), 0x1000)  # head dim
    assert not ok((2, 33, 4, 64), (33 * 256, 256, 64, 1), 0x1002)  # start
    assert not ok((2, 33, 4, 64), (33 * 260, 260, 65, 1), 0x1000)  # strides
    assert ok((1, 1, 4, 64), (5, 3, 64, 1), 0x1000)  # strides of one-element dims unused
    assert not ok((1, 2, 4, 64), (5, 3, 64, 1), 0x1000)
    assert ok((2, 0, 4, 59), (0, 236, 59, 1), 0x1002)  # empty: nothing is moved
    assert ok((3, 4, 8), (32, 8, 1), 0x10) and not ok((3, 4, 7), (28, 7, 1), 0x10)


@pytest.mark.parametrize("d", [1, 3, 59, 111, 200, 255, 256])
def test_any_head_dim_is_accepted(d):
    q, k = view((2, 5, 4, d)), view((2, 7, 2, d))
    assert _checks.check_dense(_arrays.Dense(q, k, k), None) == (d % 8 == 0)


def test_head_dims_outside_1_to_512_and_strided_last_dims_are_named():
    for d in (0, 513):  # (above 256: tests/test_wide_head_dims_cpu.py)
        q = view((2, 5, 4, d))
        with pytest.raises(ValueError, match=f"q has head dim {d}; cufa supports head dims "
                                             "from 1 to 512"):
            _checks.check_dense(_arrays.Dense(q, q, q), None)
    q = strided((2, 5, 4, 59), (5 * 4 * 118, 4 * 118, 118, 2))
    with pytest.raises(ValueError, match="q must be contiguous in its last dimension"):
        _checks.check_dense(_arrays.Dense(q, view((2, 5, 4, 59)), view((2, 5, 4, 59))), None)


def test_every_array_a_kernel_moves_counts():
    """q, k, v and out= (a new output is contiguous: aligned where the head dim is a
    multiple of 8); of a KV-cache call q, the cache and out=, not the new keys (written into
    the cache an element at a time)."""
    q, kv = view((2, 5, 4, 64)), view((2, 9, 2, 64))
    assert _checks.check_dense(_arrays.Dense(q, kv, kv), None)
    for i in range(4):
        arrays = [q, kv, kv, None]
        arrays[i] = sliced(arrays[i].shape if i < 3 else q.shape)
        assert not _checks.check_dense(_arrays.Dense(*arrays[:3], out=arrays[3]), arrays[3]), i
    packed, cu = view((9, 4, 64)), view((3,), "int32")
    out = sliced((9, 4, 64))
    assert _checks.check_packed(_arrays.Packed(packed, packed, packed, cu, cu), None)[2]
    assert not _checks.check_packed(_arrays.Packed(packed, packed, packed, cu, cu, out=out), out)[2]
    assert not _checks.check_sdpa(_arrays.Sdpa(*(view((2, 4, 5, 59)) for _ in range(3))), False)
    q1, cache = view((2, 1, 4, 64)), view((2, 64, 2, 64))
    lens = view((2,), "int32")

    def kvcache(q=q1, cache=cache, new=None, out=None):
        return _checks.check_kvcache(_arrays.KvCache(q, cache, cache, new, new, cache_seqlens=lens,
                                                     out=out), out, None)[-1]
    assert kvcache() and kvcache(new=sliced((2, 1, 2, 64)))
    assert not kvcache(q=sliced((2, 1, 4, 64)))
    assert not kvcache(cache=sliced((2, 64, 2, 64)))
    assert not kvcache(out=sliced((2, 1, 4, 64)))


# -- the planners' choice --------------------------------------------------------------------

@pytest.mark.parametrize("cc", ["80", "90"])
@pytest.mark.parametrize("case", ["d59", "d111", "d1", "odd rows", "2-byte start", "out="])
def test_unaligned_dense_calls_take_the_element_wise_variant(compiled, monkeypatch, cc, case):
    monkeypatch.setattr(_runtime, "compute_capability", lambda device: cc)
    d = {"d59": 59, "d111": 111, "d1": 1}.get(case, 64)
    q, k = view((2, 77, 4, d)), view((2, 93, 2, d))
    out = None
    if case == "odd rows":
        q = sliced((2, 77, 4, 64))
    elif case == "2-byte start":
        k = strided((2, 93, 2, 64), _interop.contiguous_strides((2, 93, 2, 64)), 2)
    elif case == "out=":
        out = sliced((2, 77, 4, 64))
    cufa.flash_attn_func(q, k, k, causal=True, out=out)
    plan = _last_plan()
    variant = plan.variant
    assert variant == _compile.fwd_element_io_variant("fp16", d) and variant in compiled
    assert variant.family == "sm80" and plan.tma_template is None
    assert (variant.head_dim, variant.mask, variant.score_mods, variant.element_io) == (
        _compile.padded_head_dim(d), "window", True, True)
    assert variant.key.endswith("_window_mods_elem")
    r = fields(plan.params)
    assert r["head_dim"] == d and (r["window_left"], r["window_right"]) == (
        _checks.UNBOUNDED, 0)
    assert (r["q_row_stride"], r["q_head_stride"]) == q.strides[1:3]
    assert (r["k_row_stride"], r["k_batch_stride"]) == (k.strides[1], k.strides[0])
    if out is not None:
        assert (r["o_batch_stride"], r["o_row_stride"]) == out.strides[:2]
    # no window, no mods: the same variant, with an unbounded window
    cufa.flash_attn_func(q, k, k, out=out)
    assert _last_plan().variant == variant
    assert fields(_last_plan().params)["window_right"] == _checks.UNBOUNDED


@pytest.mark.parametrize("cc", ["80", "90"])
def test_an_aligned_plan_is_not_reused_two_bytes_off(compiled, monkeypatch, cc):
    """The plans are keyed on each array's address mod 16 and strides: the same shapes at
    a 2-byte-aligned start, or a slice with odd strides, get a plan of their own."""
    monkeypatch.setattr(_runtime, "compute_capability", lambda device: cc)
    shape = (2, 77, 4, 64)
    aligned = view(shape)
    cufa.flash_attn_func(aligned, aligned, aligned)
    assert not _last_plan().variant.element_io
    assert _last_plan().variant.family == ("sm90" if cc == "90" else "sm80")
    off = strided(shape, aligned.strides, 2)
    cufa.flash_attn_func(off, aligned, aligned)
    assert _last_plan().variant.element_io and len(_runtime.plans) == 2
    cufa.flash_attn_func(strided(shape, aligned.strides, 16), aligned, aligned)
    assert len(_runtime.plans) == 2  # the first's plan
    by_q_start = {key[2][-1]: plan.variant.element_io for key, plan in _runtime.plans.items()}
    assert by_q_start == {0: False, 2: True}  # (q's entry: its address mod 16 last)
    cufa.flash_attn_func(aligned, aligned, aligned, out=sliced(shape))
    assert _last_plan().variant.element_io and len(_runtime.plans) == 3


@pytest.mark.parametrize("cc", ["80", "90"])
def test_unaligned_packed_and_sdpa_calls(compiled, monkeypatch, cc):
    monkeypatch.setattr(_runtime, "compute_capability", lambda device: cc)
    q, kv, cu = view((300, 4, 59)), view((400, 2, 59)), view((5,), "int32")
    cufa.flash_attn_varlen_func(q, kv, kv, cu, cu, 100, 100, causal=True)
    assert _last_plan().variant == _compile.fwd_element_io_variant("fp16", 59)
    assert _last_plan().work_list is not None  # (the packed schedule, as for any packed call)
    query = view((2, 4, 77, 111), "bfloat16")
    cufa.scaled_dot_product_attention(query, query, query, is_causal=True)
    assert _last_plan().variant == _compile.fwd_element_io_variant("bf16", 111)
    r = fields(_last_plan().params)
    assert (r["head_dim"], r["q_row_stride"], r["bottom_right"]) == (111, 111, 0)


@pytest.mark.parametrize("cc", ["80", "90"])
def test_unaligned_paged_packed_batch_and_its_decode_part(compiled, monkeypatch, cc):
    """A paged batch: the forward's element-wise variant (Hopper's paged TMA path needs
    aligned pages) and the decode kernel's for its short sequences."""
    monkeypatch.setattr(_runtime, "compute_capability", lambda device: cc)
    total, h, hk, d, pages, page = 300, 8, 2, 59, 40, 16
    q, cache = view((total, h, d)), view((pages, page, hk, d))
    cu, table = view((5,), "int32"), view((4, 10), "int32")
    cufa.flash_attn_varlen_func(q, cache, cache, cu, cu, 64, 64, block_table=table,
                                causal=True)
    plan = _last_plan()
    assert plan.variant == _compile.fwd_element_io_variant("fp16", d)
    assert plan.tma_template is None
    assert _compile.decode_kernel("fp16", d, element_io=True) in compiled
    assert fields(plan.decode.params, _params.DECODE)["head_dim"] == d
    split = plan.decode.launches[1:]
    if split:  # partial rows of whole 8-column chunks, merged by the element-wise combine
        assert compiled[-1].kind == "combine" and compiled[-1].element_io


def _kv_plan():
    return next(p for p in reversed(list(_runtime.plans.values()))
                if isinstance(p, _decode_plan._KvPlan))


@pytest.mark.parametrize("cc", ["80", "90"])
def test_unaligned_kvcache_takes_the_element_wise_decode_and_combine(compiled, monkeypatch, cc,
                                                                     h100):
    """d = 59 with an append and rotary (rotary_dim 16), split four ways: the element-wise
    decode kernel (never the TMA one), decode_combine's element-wise variant, partial
    rows of 64 floats."""
    monkeypatch.setattr(_runtime, "compute_capability", lambda device: cc)
    batch, h, hk, d = 2, 8, 2, 59
    q, cache = view((batch, 1, h, d)), view((batch, 4096, hk, d))
    new, lens = view((batch, 1, hk, d)), view((batch,), "int32")
    cos = view((4096, 8))
    compiled.clear()
    cufa.flash_attn_with_kvcache(q, cache, view(cache.shape), new, new, rotary_cos=cos,
                                 rotary_sin=cos,
                                 cache_seqlens=lens, num_splits=4, causal=True)
    plan = _kv_plan()
    kinds = [e[0] for e in plan.launches]
    assert kinds == ["append", "decode", "combine"]
    decode = _compile.decode_kernel("fp16", d, element_io=True)
    assert decode in compiled and decode.key == "decode_fp16_hd64_s4_elem"
    combine = [v for v in compiled if v.kind == "combine"]
    assert combine and all(v.element_io for v in combine) and combine[0].key.endswith("_elem")
    r = fields(plan.params, _params.DECODE)
    assert (r["head_dim"], r["rotary_dim"], r["num_splits"]) == (d, 16, 4)
    rows = batch * 1 * h
    total, o_part, lse_part, q_rot = plan.workspace
    assert lse_part - o_part >= 4 * rows * 64  # rows of 64 floats, not 59
    assert q_rot >= lse_part + 4 * rows and plan.maps is None
    # the same at d = 64 on a 2-byte-aligned cache: element-wise too; aligned: the fast kernels
    for offset, elem in ((2, True), (0, False)):
        cache = strided((1, 131072, 8, 64), _interop.contiguous_strides((1, 131072, 8, 64)),
                        offset)
        compiled.clear()
        cufa.flash_attn_with_kvcache(view((1, 1, 32, 64)), cache, cache, cache_seqlens=131072)
        plan = _kv_plan()
        decode_kind = next(e[0] for e in plan.launches if e[0].startswith("decode"))
        if elem:
            assert decode_kind == "decode" and plan.maps is None
            assert all(v.element_io for v in compiled if v.kind in ("decode", "combine"))
        else:
            assert not any(v.element_io for v in compiled)
            assert decode_kind == ("decode_tma" if cc == "90" else "decode")


def test_merge_takes_any_head_dim_and_strides(device):
    """merge_attention_states moves elements (any head dim and strides already)."""
    oa, ob = sliced((1, 10, 2, 59)), view((1, 10, 2, 59))
    la, lb = view((1, 2, 10), "float32"), view((1, 2, 10), "float32")
    cufa.merge_attention_states(oa, la, ob, lb)
    r = record(device.launches[-1], _params.MERGE)
    assert (r["head_dim"], r["out_a_row_stride"], r["out_b_row_stride"]) == (59, 120, 118)


# -- the catalog -----------------------------------------------------------------------------

def test_one_element_wise_variant_per_dtype_and_padded_head_dim():
    variants = _compile.all_variants()
    for kind in ("fwd", "decode"):
        elem = [v for v in variants if v.key.endswith("_elem")
                and (v.key.startswith("fwd_") if kind == "fwd" else getattr(v, "kind", "") == kind)]
        assert {(v.dtype, v.head_dim) for v in elem} == {
            (dt, hd) for dt in _compile.DTYPES for hd in _compile.SM80_HEAD_DIMS}
        assert len(elem) == len(_compile.DTYPES) * len(_compile.SM80_HEAD_DIMS)
        assert all(v.element_io and "sm_80" in v.archs and "sm_90" in v.archs for v in elem)
    combine = [v for v in variants if v.key.startswith("decode_combine") and v.element_io]
    assert {(v.dtype, v.rows) for v in combine} == {(dt, r) for dt in _compile.DTYPES
                                                   for r in (1, 4)}
    assert _compile.fwd_element_io_variant("bf16", 200).key == (
        "fwd_sm80_bf16_hd224_bm64_bn64_window_mods_elem")
    assert _compile.fwd_element_io_variant("fp16", 59).name_expression == (
        "cufa::fwd_kernel<0, 64, 1, true, 128, 64, true>")
    assert _compile.decode_kernel("bf16", 111, element_io=True).name_expression == (
        "cufa::decode_kernel<1, 128, 2, 4, true>")
    # the 16-byte variants' names are unchanged (their template's default is false)
    assert _compile.fwd_variant("fp16", 64, "none", False).name_expression == (
        "cufa::fwd_kernel<0, 64, 0, false, 128, 64>")
