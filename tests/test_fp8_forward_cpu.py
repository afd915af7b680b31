"""CPU: the fp8 forward's launches (flash_attn_func with q, k, v in float8_e4m3fn on
Hopper): V transposed into the stream's workspace first, then the kE4m3 forward over TMA
maps of q, k and that workspace, e4m3 strides in 16-bit units, the descales' addresses and
strides; and every bad argument's error before any launch."""
import itertools

import pytest

import cufa
from cufa import _compile, _interop, _params, _runtime
from test_launch_path_cpu import (_XlaBuffer, device, map_addresses, memsets,  # noqa: F401
                                  record)

_addresses = itertools.count(0x7D00_0000_0000, 1 << 24)
_SIZES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1,
          "int32": 4, "int64": 8}


def view(shape, dtype="float8_e4m3fn", strides=None):
    return _interop.DeviceArray(None, "cupy", next(_addresses), tuple(shape),
                                strides or _interop.contiguous_strides(shape), dtype, 0,
                                _SIZES[dtype])


def qkv(b=2, sq=300, sk=200, h=8, hk=2, d=128):
    return view((b, sq, h, d)), view((b, sk, hk, d)), view((b, sk, hk, d))


@pytest.fixture
def addresses(device, monkeypatch):  # noqa: F811
    """The addresses the fake device hands out, in order."""
    handed = []

    def allocate(*args, **kwargs):
        native, ptr = device.allocate(*args, **kwargs)
        handed.append(ptr)
        return native, ptr
    monkeypatch.setattr(_interop, "allocate", allocate)
    return handed


def test_fp8_forward_transposes_v_then_runs_the_e4m3_kernel(device, addresses):  # noqa: F811
    q, k, v = qkv()
    qd, kd, vd = view((2, 2), "float32"), view((2, 2), "float32"), view((), "float32")
    out, lse = cufa.flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd,
                                    v_descale=vd, return_lse=True)
    # out, lse, and V^T (batch, nheads_k, d, keys padded to 256) from the caller's allocator
    assert device.allocations == [((2, 300, 8, 128), "bfloat16"), ((2, 8, 300), "float32"),
                                  ((2 * 2 * 128 * 256,), "uint8")]
    vt = addresses[2]
    transpose, forward = device.launches
    assert transpose[1] == (256 // 64 * 2 * 2, 2, 1)  # (key tiles of every pair in x)
    t = record(transpose, _params.TRANSPOSE_V)
    assert (t["v"], t["vt"], t["padded_seqlen"], t["seqlen"]) == (v.ptr, vt, 256, 200)
    assert (t["v_batch_stride"], t["v_row_stride"], t["v_head_stride"]) == (51200, 256, 128)
    r = record(forward)
    assert (r["q"], r["k"], r["v"]) == (q.ptr, k.ptr, vt)
    # e4m3 rows move as 16-bit pairs: byte strides halved; out's in its own elements
    assert (r["q_batch_stride"], r["q_row_stride"], r["q_head_stride"]) == (153600, 512, 64)
    assert (r["k_batch_stride"], r["k_row_stride"], r["k_head_stride"]) == (25600, 128, 64)
    assert (r["o_batch_stride"], r["o_row_stride"], r["o_head_stride"]) == (307200, 1024, 128)
    assert (r["q_descale"], r["k_descale"], r["v_descale"]) == (qd.ptr, kd.ptr, vd.ptr)
    assert (r["q_descale_batch_stride"], r["q_descale_head_stride"]) == (2, 1)
    assert (r["v_descale_batch_stride"], r["v_descale_head_stride"]) == (0, 0)
    assert map_addresses(forward)[:3] == [q.ptr, k.ptr, vt]
    assert forward[1] == 3 * 8 * 2  # tiles (fewer than the 132 SMs a persistent grid fills)


def test_fp8_forward_variant_and_default_descales(device):  # noqa: F811
    q, k, v = qkv(d=96)
    o = view((2, 300, 8, 96), "float16")
    cufa.flash_attn_func(q, k, v, out=o)
    _, forward = device.launches
    r = record(forward)
    assert r["o"] == o.ptr and (r["q_descale"], r["k_descale"], r["v_descale"]) == (0, 0, 0)
    assert r["head_dim"] == 96
    variant = _compile.fwd_fp8_variant("fp16", 96, "none")
    assert variant.fp8 and variant.head_dim == 128 and variant.key.endswith("_fp8")
    assert variant.name_expression.endswith(", true>")


def test_fp8_forward_without_keys_and_size_one_dims(device):  # noqa: F811
    """No keys: no transpose, and the forward (every row 0, lse -inf) over a V map of one
    key block; a head of one with an odd head stride still makes maps (stride 0)."""
    q, k, v = qkv(sk=0)
    cufa.flash_attn_func(q, k, v)
    (forward,) = device.launches
    assert record(forward)["seqlen_k"] == 0
    q = view((2, 300, 1, 128), strides=(300 * 144, 144, 17, 1))
    k = view((2, 200, 1, 128), strides=(200 * 144, 144, 17, 1))
    cufa.flash_attn_func(q, k, view((2, 200, 1, 128)))
    assert len(device.launches) == 3


def test_fp8_variants_compile_in_the_catalog():
    keys = {v.key for v in _compile.all_variants()}
    for dt in _compile.DTYPES:
        for hd in _compile.FP8_HEAD_DIMS:
            for mask in _compile.MASKS:
                assert _compile.fwd_fp8_variant(dt, hd, mask).key in keys


@pytest.mark.parametrize("change, error, match", [
    (dict(k=view((2, 200, 2, 128), "float16")), TypeError, "k has dtype float16"),
    (dict(q=view((2, 300, 8, 72)), k=view((2, 200, 2, 72)), v=view((2, 200, 2, 72))),
     ValueError, "multiples of 16"),
    (dict(q=view((2, 300, 7, 128))), ValueError, "not a multiple"),
    (dict(v=view((2, 201, 2, 128))), ValueError, "alike"),
    (dict(k_descale=view((2, 3), "float32")), ValueError, "k_descale must be float32"),
    (dict(q_descale=view((2, 2), "float16")), TypeError, "q_descale must be float32"),
    (dict(out=view((2, 300, 8, 128), "float32")), ValueError, "float16 or bfloat16"),
    (dict(q=view((2, 300, 8, 128), strides=(300 * 8 * 136, 8 * 136, 136, 1))),
     NotImplementedError, "16-byte chunks"),
    (dict(softcap=5.0), NotImplementedError, "softcap"),
])
def test_fp8_forward_bad_arguments(device, change, error, match):  # noqa: F811
    q, k, v = qkv()
    args = {**dict(q=q, k=k, v=v), **change}
    with pytest.raises(error, match=match):
        cufa.flash_attn_func(**args)
    assert device.launches == []


def test_fp8_forward_before_hopper(device, monkeypatch):  # noqa: F811
    monkeypatch.setattr(_runtime, "compute_capability", lambda device: "80")
    with pytest.raises(NotImplementedError, match="Hopper"):
        cufa.flash_attn_func(*qkv())
    assert device.launches == []


def test_fp8_varlen_schedules_transposes_then_runs(device, addresses):  # noqa: F811
    """A packed batch: the work list from cu_seqlens_q, V^T of the whole batch in the packed
    layout (vt_packed_keys; the transpose reads cu_seqlens_k), then the forward with the
    sequences' pointers, k's tail maps and V^T's map of one batch entry."""
    q, k, v = view((300, 8, 128)), view((500, 2, 128)), view((500, 2, 128))
    cu_q, cu_k, used = view((4,), "int32"), view((4,), "int32"), view((3,), "int32")
    kd = view((3, 2), "float32")
    out, lse = cufa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 200, 300, causal=True,
                                           seqused_k=used, k_descale=kd, return_lse=True)
    vt_keys = 128 * (500 // 128 + 3 + 1)
    assert device.allocations == [((300, 8, 128), "bfloat16"), ((8, 300), "float32"),
                                  ((2 * 128 * vt_keys,), "uint8")]
    vt = addresses[2]
    schedule, transpose, forward = device.launches
    s = record(schedule, _params.SCHEDULE)
    assert (s["cu_seqlens_q"], s["cu_seqlens_k"], s["seqused_k"]) == (cu_q.ptr, cu_k.ptr,
                                                                      used.ptr)
    assert transpose[1] == (vt_keys // 64 * 2, 2, 1)  # (KV heads' key tiles in x)
    t = record(transpose, _params.TRANSPOSE_V)
    assert (t["cu_seqlens_k"], t["padded_seqlen"], t["batch"], t["vt"]) == (cu_k.ptr, vt_keys,
                                                                           3, vt)
    assert (t["v_row_stride"], t["v_head_stride"]) == (256, 128)
    r = record(forward)
    assert (r["q"], r["k"], r["v"], r["cu_seqlens_q"], r["cu_seqlens_k"], r["seqused_k"]) == (
        q.ptr, k.ptr, vt, cu_q.ptr, cu_k.ptr, used.ptr)
    assert r["kv_tail_maps"] == 1 and r["tile_list"] and r["tile_counter"] == s["tile_counter"]
    assert (r["q_batch_stride"], r["q_row_stride"], r["q_head_stride"]) == (0, 512, 64)
    assert (r["k_batch_stride"], r["k_row_stride"], r["k_head_stride"]) == (0, 128, 64)
    assert (r["k_descale"], r["k_descale_batch_stride"]) == (kd.ptr, 2)
    assert (r["lse_batch_stride"], r["lse_head_stride"]) == (0, 300)
    assert map_addresses(forward) == [q.ptr, k.ptr, vt, k.ptr, vt]  # (v's tail: never read)
    assert t["seqused_k"] == used.ptr  # (zeros past the used keys)


def test_fp8_paged_batch_gathers_its_pages_then_runs_as_packed(device, addresses):  # noqa: F811
    """A paged cache (block_table): its pages gathered first into rows laid out as a packed
    batch's k and v (batch x capacity rows, from the caller's allocator with the sequences'
    starts and keys used after them), then the packed route over those rows: the work list,
    V's transpose and the forward all read the gathered rows, starts and keys used, not the
    cache, cu_seqlens_k or seqused_k."""
    q = view((300, 8, 128))
    k_cache = view((9, 16, 2, 128), strides=(16 * 4 * 128, 4 * 128, 128, 1))  # (heads 2 of 4)
    v_cache = view((9, 16, 2, 128))
    cu_q, cu_k, used = view((4,), "int32"), view((4,), "int32"), view((3,), "int32")
    table = view((3, 5), "int32", strides=(8, 1))
    cufa.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 200, 300, causal=True,
                                seqused_k=used, block_table=table)
    rows = 3 * 5 * 16  # (batch x the table's capacity)
    row_bytes = -(-rows * 2 * 128 // 256) * 256
    vt_keys = 128 * (rows // 128 + 3 + 1)
    assert device.allocations == [((300, 8, 128), "bfloat16"),
                                  ((2 * row_bytes + 4 * (3 + 1 + 3),), "uint8"),
                                  ((2 * 128 * vt_keys,), "uint8")]
    gathered, vt = addresses[1], addresses[2]
    gather, schedule, transpose, forward = device.launches
    g = record(gather, _params.GATHER_PAGES)
    assert (g["k_cache"], g["v_cache"], g["block_table"], g["cu_seqlens_k"], g["seqused_k"]) == (
        k_cache.ptr, v_cache.ptr, table.ptr, cu_k.ptr, used.ptr)
    cu_rows, used_rows = gathered + 2 * row_bytes, gathered + 2 * row_bytes + 4 * 4
    assert (g["k_out"], g["v_out"], g["cu_seqlens_out"], g["seqused_out"]) == (
        gathered, gathered + row_bytes, cu_rows, used_rows)
    assert (g["k_page_stride"], g["k_row_stride"], g["k_head_stride"]) == (8192, 512, 128)
    assert (g["v_page_stride"], g["v_row_stride"], g["v_head_stride"]) == (4096, 256, 128)
    assert (g["page_shift"], g["num_pages"], g["max_pages"], g["table_stride"], g["batch"],
            g["nheads_k"], g["head_dim"]) == (4, 9, 5, 8, 3, 2, 128)
    assert gather[1] == (2, 3, 1)  # (80 keys: two 64-key tiles a sequence, in y)
    s = record(schedule, _params.SCHEDULE)
    t = record(transpose, _params.TRANSPOSE_V)
    r = record(forward)
    assert s["seqused_k"] == t["seqused_k"] == r["seqused_k"] == used_rows
    assert s["cu_seqlens_k"] == t["cu_seqlens_k"] == r["cu_seqlens_k"] == cu_rows
    assert s["cu_seqlens_q"] == r["cu_seqlens_q"] == cu_q.ptr
    assert (t["v"], t["seqlen"], t["padded_seqlen"], t["vt"]) == (gathered + row_bytes, rows,
                                                                 vt_keys, vt)
    assert (t["v_row_stride"], t["v_head_stride"]) == (256, 128)
    assert (r["k"], r["v"]) == (gathered, vt)
    assert (r["k_batch_stride"], r["k_row_stride"], r["k_head_stride"]) == (0, 128, 64)
    assert map_addresses(forward)[:4] == [q.ptr, gathered, vt, gathered]


@pytest.mark.parametrize("batch, max_pages, page_size, grid", [
    (8, 8, 256, (32, 8, 1)),      # (each sequence's 64-key tiles in x)
    (1, 4096, 16, (1024, 1, 1)),  # (one long table: ~1,024 CTAs, looping over the rest)
    (70000, 1, 16, (1, 65535, 1)),  # (y's limit: the sequences past it by the loop)
])
def test_gather_pages_grid(device, batch, max_pages, page_size, grid):  # noqa: F811
    from cufa import _checks, _fp8
    pages = view((9, page_size, 2, 128))
    paged = dict(_checks.check_block_table(view((batch, max_pages), "int32"), pages,
                                           view((1, 8, 128)), batch), table=0x1000)
    _fp8.launch_gather_pages(pages, pages, paged, batch, 0x2000, 0x3000, 0x4000, 0x5000,
                             0x6000, 0, 0, 0)
    (launch,) = device.launches
    assert launch[1] == grid
    g = record(launch, _params.GATHER_PAGES)
    assert (g["batch"], g["max_pages"], g["page_shift"]) == (batch, max_pages,
                                                            page_size.bit_length() - 1)


def test_fp8_paged_scratch_under_jax_holds_the_gathered_rows(device):  # noqa: F811
    """fp8_scratch_bytes of a paged call: the packed call's over the gathered rows (batch x
    capacity), then the two rows' buffers 256-aligned, the starts and the keys used."""
    from cufa import _checks, _fwd_plan
    window = _checks.check_options(None, False, (-1, -1), 0.0)[0]
    q, pages = view((300, 8, 128)), view((9, 16, 2, 128))
    paged = _checks.check_block_table(view((3, 5), "int32"), pages, q, 3)
    plain = _fwd_plan.fp8_scratch_bytes(q, view((240, 2, 128)), 3, window, True)
    got = _fwd_plan.fp8_scratch_bytes(q, pages, 3, window, True, paged=paged)
    assert got == -(-plain // 256) * 256 + 2 * 240 * 2 * 128 + 4 * (3 + 1 + 3)


def test_fp8_varlen_with_q_descale_returns_attn_probs(device, monkeypatch):  # noqa: F811
    monkeypatch.setattr(_interop, "empty_of", lambda o: "S_dmask")  # (the fake's out is a str)
    got = cufa.flash_attn_varlen_func(
        view((300, 8, 128)), view((500, 2, 128)), view((500, 2, 128)), view((4,), "int32"),
        view((4,), "int32"), 200, 300, q_descale=view((), "float32"), return_attn_probs=True)
    assert len(got) == 3 and got[2] == "S_dmask"


@pytest.mark.parametrize("change, error, match", [
    (dict(block_table=view((3, 4), "int32")), ValueError, "k must be 4-D .num_pages"),
    (dict(block_table=view((3, 4), "int32"), k=view((9, 16, 2, 128)), v=view((9, 8, 2, 128))),
     ValueError, "k and v must be .num_pages, page_size, nheads_k, headdim. with block_table "
     "alike"),
    (dict(block_table=view((2, 4), "int32"), k=view((9, 16, 2, 128)), v=view((9, 16, 2, 128))),
     ValueError, r"block_table must be 2-D \(3, max_pages"),
    (dict(block_table=view((3, 4), "int64"), k=view((9, 16, 2, 128)), v=view((9, 16, 2, 128))),
     TypeError, "block_table must be int32"),
    (dict(block_table=view((3, 4), "int32"), k=view((9, 24, 2, 128)), v=view((9, 24, 2, 128))),
     ValueError, "pages of 24 rows"),
    (dict(block_table=view((3, 4), "int32"), k=view((9, 16, 2, 128)), v=view((9, 16, 2, 128)),
          k_descale=view((3, 3), "float32")), ValueError, "k_descale"),
    (dict(cu_seqlens_k=view((4,), "int64")), TypeError, "cu_seqlens_k must be int32"),
    (dict(cu_seqlens_k=view((5,), "int32")), ValueError, "cu_seqlens_k has 5"),
    (dict(k=view((500, 2, 128), "bfloat16")), TypeError, "k has dtype bfloat16"),
    (dict(q_descale=view((2, 2), "float32")), ValueError, "q_descale must be float32"),
])
def test_fp8_varlen_bad_arguments(device, change, error, match):  # noqa: F811
    args = {**dict(q=view((300, 8, 128)), k=view((500, 2, 128)), v=view((500, 2, 128)),
                   cu_seqlens_q=view((4,), "int32"), cu_seqlens_k=view((4,), "int32"),
                   max_seqlen_q=200, max_seqlen_k=300), **change}
    with pytest.raises(error, match=match):
        cufa.flash_attn_varlen_func(**args)
    assert device.launches == []


@pytest.mark.parametrize("packed", [False, True])
def test_fp8_under_jax_takes_vt_and_counters_from_xla_scratch(device, memsets,  # noqa: F811
                                                               packed):
    """Under jax.jit the fp8 forward allocates nothing: its scratch output (planned at
    trace time by fp8_scratch_bytes) holds the tile counter, zeroed in XLA's stream, or a
    packed batch's work list, then V^T from the next 256 bytes; q, k, v cross as bytes
    and are read as e4m3 by the spec's layouts; lse goes to XLA's buffer."""
    jax = pytest.importorskip("jax")
    from cufa import _checks, _fwd_plan, _jax
    window = _checks.check_options(None, True, (-1, -1), 0.0)[0]
    sds = jax.ShapeDtypeStruct
    if packed:
        q, k = sds((300, 8, 128), "float8_e4m3fn"), sds((500, 2, 128), "float8_e4m3fn")
        cu = sds((4,), "int32")
        names = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")
        arrays, lse = (q, k, k, cu, cu), (8, 300)
        entry, batch = "flash_attn_varlen_fp8", 3
    else:
        q, k = sds((2, 300, 8, 128), "float8_e4m3fn"), sds((2, 200, 2, 128), "float8_e4m3fn")
        names, arrays, lse = ("q", "k", "v"), (q, k, k), (2, 8, 300)
        entry, batch = "flash_attn_fp8", 2
    needed = _fwd_plan.fp8_scratch_bytes(view(q.shape), view(k.shape), batch, window, packed)
    vt_bytes = 2 * 128 * (128 * (500 // 128 + 3 + 1) if packed else 2 * 256)
    assert needed % 256 == 0 and needed - vt_bytes == (needed - vt_bytes) // 256 * 256 > 0
    scratch = sds((needed,), "uint8")
    spec = _jax.Call(entry, names, tuple(str(a.dtype) for a in arrays),
                     ("bfloat16", "float32", "uint8"),
                     dict(softmax_scale=None, causal=True, window_size=(-1, -1)), (),
                     tuple(_jax._layout(a) for a in arrays),
                     (_jax._layout(sds(q.shape, "bfloat16")), _jax._layout(sds(lse, "float32")),
                      _jax._layout(scratch)), True)
    bufs = [_XlaBuffer(a.shape, "|u1" if a.dtype.itemsize == 1 else "<i4") for a in arrays]
    outs = [_XlaBuffer(q.shape, "<u2"), _XlaBuffer(lse, "<f4"), _XlaBuffer((needed,), "|u1")]

    class Context:
        stream = 0x5EED
    _jax.on_device(spec, Context, outs, bufs)
    base = outs[2].__cuda_array_interface__["data"][0]
    r = record(device.launches[-1])
    assert device.allocations == []
    assert r["v"] == base + needed - vt_bytes and r["lse"] == outs[1].__cuda_array_interface__[
        "data"][0]
    assert r["q"] == bufs[0].__cuda_array_interface__["data"][0]
    if packed:
        assert r["tile_list"] == base and memsets == []  # (the schedule zeroes its counter)
    else:
        assert r["tile_counter"] == base and memsets == [(base, 8, 0x5EED)]


def test_fp8_scratch_is_planned_only_where_the_kernel_runs(device, monkeypatch):  # noqa: F811
    """jax.jit plans the fp8 call's scratch at trace time: a GPU before Hopper is refused
    there (not later inside XLA's callback), and so is a V^T past int32 indexing."""
    from cufa import _checks, _fwd_plan
    window = _checks.check_options(None, False, (-1, -1), 0.0)[0]
    q, k, _ = qkv()
    assert _fwd_plan.fp8_scratch_bytes(q, k, 2, window, False) == 256 + 2 * 2 * 128 * 256
    many = view((64, 2**30, 4, 128))  # (2^30 / 64 key tiles x 4 heads x 64 sequences)
    with pytest.raises(ValueError, match="exceeds its int32 indexing"):
        _fwd_plan.fp8_scratch_bytes(view((64, 300, 8, 128)), many, 64, window, False)
    monkeypatch.setattr(_runtime, "compute_capability", lambda device: "80")
    with pytest.raises(NotImplementedError, match="Hopper"):
        _fwd_plan.fp8_scratch_bytes(q, k, 2, window, False)
