"""CPU: MLA decode through flash_attn_with_kvcache(qv=...) (FlashAttention-3's form: q and
k_cache the 64 rotary dims, qv and v_cache the 512 latent ones) -- what it plans from
shapes alone (the MLA kernel, its grid and splits, the params record, the combine and the
append) and what it refuses, with the compile and the device queries stubbed out."""
import math

import numpy as np
import pytest

from cufa import _compile, _heuristics, _runtime, _tma
from cufa._interop import DeviceArray
from test_fp8_cache_cpu import SIZES
from test_kvcache_plan_cpu import arr, planner, record  # noqa: F401 (planner: a fixture)

ROPE, LATENT = _compile.MLA_ROPE_DIM, _compile.MLA_LATENT_DIM


@pytest.fixture(autouse=True)
def hopper_family(monkeypatch):
    """The kernel family from the device (sm_90 in `planner`), whatever the environment."""
    monkeypatch.setitem(_compile._overrides, _compile.FAMILY_ENV, None)


@pytest.fixture(autouse=True)
def encoded(monkeypatch):
    """A stand-in for the driver's map encoder (no driver here): the (dims, byte strides,
    box) of each map it is asked for, and a map that stores them."""
    import ctypes
    calls = []

    def encode(addr, data_type, rank, ptr, dims, strides, box, *rest):
        calls.append((tuple(dims[:4]), tuple(strides[:3]), tuple(box[:4])))
        fields = (ptr, *dims[:4], *strides[:3], *box[:4])
        ctypes.memmove(addr, b"".join(int(f).to_bytes(8, "little") for f in fields), 96)
        return 0

    monkeypatch.setattr(_tma, "_encode_fn", lambda: encode)
    monkeypatch.setattr(_tma, "_learned_field", None)  # (the driver moves the addresses)
    for table in ("_kind_maps", "_kind_words", "_kind_parts"):
        monkeypatch.setattr(_tma, table, {})
    _tma.template.cache_clear()
    yield calls
    _tma.template.cache_clear()


def bf(shape, **kw):
    return arr(shape, "bfloat16", **kw)


def mla_args(batch=4, sq=1, heads=128, keys=4096, paged=None):
    """q, k_cache (k_pe), v_cache (c_kv), qv and cache_seqlens of a DeepSeek-shaped step."""
    q, qv = bf((batch, sq, heads, ROPE)), bf((batch, sq, heads, LATENT), ptr=0x7f1000000000)
    rows = (batch * keys // paged, paged) if paged else (batch, keys)
    k_pe, c_kv = bf(rows + (1, ROPE)), bf(rows + (1, LATENT), ptr=0x7f3000000000)
    return q, k_pe, c_kv, qv, arr((batch,), "int32")


@pytest.mark.parametrize("batch, heads, sq, splits", [
    (128, 128, 1, 1),   # 256 CTAs of rows: two waves, unsplit
    (1, 128, 1, 26),    # 2 CTAs of rows over 128 blocks: 5 blocks a split (64 splits
                        # would read 2 each, but merge 128 CTAs' shares)
    (4, 16, 2, 22),     # tensor-parallel heads, speculative tokens: one 32-row CTA
])
def test_mla_plans_its_kernel_rows_and_splits(planner, batch, heads, sq, splits):
    q, k_pe, c_kv, qv, lens = mla_args(batch, sq, heads)
    plan = planner(q, k_pe, c_kv, cache_seqlens=lens, qv=qv)
    rec = record(plan)
    m_blocks = -(-sq * heads // _compile.MLA_ROWS)
    assert (rec["head_dim"], rec["head_dim_v"], rec["num_m_blocks"]) == (ROPE, LATENT, m_blocks)
    assert rec["num_splits"] == splits
    assert math.isclose(rec["scale"], 1 / math.sqrt(ROPE + LATENT), rel_tol=1e-6)
    assert (rec["qv_batch_stride"], rec["qv_row_stride"], rec["qv_head_stride"]) == (
        sq * heads * LATENT, heads * LATENT, LATENT)
    assert (rec["o_batch_stride"], rec["o_row_stride"]) == (sq * heads * LATENT, heads * LATENT)
    assert plan.out_shape == (batch, sq, heads, LATENT)
    assert not plan.out_like_q  # (a new out is not torch.empty_like(q), 64 wide: a GPU fault)
    kernel = _compile.MlaVariant("bf16")
    kind, function, grid, threads, smem = plan.launches[0]
    assert (kind, grid, threads, smem) == ("decode_mla", (m_blocks * splits, 1, batch), 384,
                                           kernel.smem_bytes)
    assert smem <= _compile.SM90_SMEM_LIMIT and kernel in set(_compile.all_variants())
    assert not plan.merge_in_launch  # (the MLA kernel writes partials; decode_combine merges)
    if splits > 1:
        assert plan.launches[1][0] == "combine"
        assert rec["combine_row_threads"] == _heuristics.combine_row_threads(LATENT, splits)
        rows = batch * sq * heads
        assert plan.workspace[:3] == (-(-splits * rows * LATENT // 64) * 64
                                      + -(-splits * rows // 64) * 64, 0,
                                      -(-splits * rows * LATENT // 64) * 64)
    else:
        assert len(plan.launches) == 1 and plan.workspace[0] == 0


@pytest.mark.parametrize("heads, batch, keys, splits", [
    (128, 1, 1024, 11), (128, 1, 8192, 32), (128, 1, 16384, 47),  # one sequence
    (128, 8, 1024, 4), (128, 8, 4096, 8), (128, 32, 1024, 1),      # 8 and 32 of them
    (16, 1, 8192, 64), (16, 8, 4096, 16), (16, 32, 1024, 4),
    (128, 128, 8192, 1),                                           # past a wave: unsplit
])
def test_mla_split_rule_on_the_sweep(monkeypatch, heads, batch, keys, splits):
    """The split rule's picks for bench/profile/mla_splits.py's rows (one token, one latent
    head) on 132 SMs, each at or beside that sweep's fastest count (H200:
    bench/results/mla_decode_h200.md)."""
    monkeypatch.setattr(_runtime, "sm_count", lambda device: 132)
    ctas = batch * -(-heads // _compile.MLA_ROWS)
    assert _heuristics.mla_splits(0, ctas, batch * heads, keys, 0) == splits
    assert _heuristics.mla_splits(5, ctas, batch * heads, keys, 0) == 5  # (asked for: as given)


@pytest.mark.parametrize("heads, batch, keys, splits", [
    (128, 1, 1024, 16), (128, 1, 8192, 43), (128, 32, 1024, 2),
    (16, 1, 1024, 32), (16, 8, 1024, 11), (128, 128, 8192, 1),
])
def test_mla_split_rule_over_an_e4m3_cache(monkeypatch, heads, batch, keys, splits):
    """An e4m3 block costs more (its producer widens it), so the same shapes split finer:
    each pick at or beside the e4m3 sweep's fastest count (H200:
    bench/results/mla_decode_h200.md), and more splits than the 16-bit cache's but past a
    wave."""
    monkeypatch.setattr(_runtime, "sm_count", lambda device: 132)
    ctas = batch * -(-heads // _compile.MLA_ROWS)
    got = _heuristics.mla_splits(0, ctas, batch * heads, keys, 0, fp8_cache=True)
    assert got == splits
    assert got > _heuristics.mla_splits(0, ctas, batch * heads, keys, 0) or splits == 1


def test_mla_paged_and_appending(planner):
    """Pages of 64 and one new token: the append writes k's 64 rotary dims into k_cache and
    v's 512 latent ones into v_cache (DecodeParams' head_dim and head_dim_v), then the MLA
    kernel reads them."""
    q, k_pe, c_kv, qv, lens = mla_args(batch=8, heads=128, paged=64)
    table = arr((8, 4096 // 64), "int32")
    k_new, v_new = bf((8, 1, 1, ROPE)), bf((8, 1, 1, LATENT))
    plan = planner(q, k_pe, c_kv, k_new, v_new, cache_seqlens=lens, block_table=table, qv=qv)
    assert [entry[0] for entry in plan.launches][:2] == ["append", "decode_mla"]
    rec = record(plan)
    assert (rec["page_shift"], rec["max_pages"], rec["seqlen_new"]) == (6, 64, 1)
    assert (rec["head_dim"], rec["head_dim_v"]) == (ROPE, LATENT)
    assert rec["v_new_batch_stride"] == LATENT and rec["k_new_batch_stride"] == ROPE


def test_mla_rejects_what_it_does_not_take(planner, monkeypatch):
    q, k_pe, c_kv, qv, lens = mla_args(batch=2, heads=16, keys=256)

    def call(**kw):
        a = dict(q=q, k_cache=k_pe, v_cache=c_kv, cache_seqlens=lens, qv=qv)
        a.update(kw)
        return planner(a.pop("q"), a.pop("k_cache"), a.pop("v_cache"), **a)
    with pytest.raises(ValueError, match=r"qv must be \(batch, seqlen_q, nheads, 512\)"):
        call(qv=bf((2, 1, 8, LATENT)))
    with pytest.raises(ValueError, match="q .*must be 4-D with head dim 64"):
        call(q=bf((2, 1, 16, 128)))
    with pytest.raises(ValueError, match="v_cache .*head dim 512"):
        call(v_cache=bf((2, 256, 1, 256)))
    with pytest.raises(ValueError, match="k_cache .*head dim 64"):
        call(k_cache=bf((2, 256, 1, 576)))
    with pytest.raises(ValueError, match="v_cache must be"):
        call(v_cache=bf((2, 128, 1, LATENT)))
    with pytest.raises(TypeError, match="qv has dtype float16 but q has bfloat16"):
        call(qv=arr((2, 1, 16, LATENT), "float16"))
    with pytest.raises(ValueError, match="qv needs rows that move in 16-byte chunks"):
        call(qv=bf((2, 1, 16, LATENT), ptr=0x7f0000000002))
    with pytest.raises(NotImplementedError, match="learnable_sink is not supported with qv"):
        call(learnable_sink=arr((16,), "float32"))
    with pytest.raises(NotImplementedError, match="alibi_slopes is not supported with qv"):
        call(alibi_slopes=arr((16,), "float32"))
    with pytest.raises(NotImplementedError, match="softcap is not supported with qv"):
        call(softcap=30.0)
    with pytest.raises(ValueError, match="out must have the shape of q with v's head dim"):
        call(out=bf((2, 1, 16, ROPE)))
    with pytest.raises(ValueError, match=r"v must be \(batch, seqlen_new, nheads_k, headdim\)"):
        call(k=bf((2, 1, 1, ROPE)), v=bf((2, 1, 1, ROPE)))
    monkeypatch.setattr(_runtime, "compute_capability", lambda device: "80")
    _runtime.plans.clear()
    with pytest.raises(NotImplementedError, match=r"qv \(MLA decode\) runs on Hopper"):
        call()


@pytest.mark.parametrize("paged", [None, 64])
def test_mla_whole_blocks_come_through_maps(planner, encoded, paged):
    """A cache the copy engine can describe gets the kernel's TMA variant and two maps in
    boxes of a key block's rows and one 128-byte panel: k_cache (the rope, 64 columns) and
    v_cache (the latent, 512: eight boxes a block), over pages (paged) or sequences."""
    q, k_pe, c_kv, qv, lens = mla_args(batch=8, heads=128, paged=paged)
    kw = dict(block_table=arr((8, 4096 // 64), "int32")) if paged else {}
    plan = planner(q, k_pe, c_kv, cache_seqlens=lens, qv=qv, **kw)
    kind, function = plan.launches[0][:2]
    assert kind == "decode_mla" and function == hash(_compile.MlaVariant("bf16", tma=True).key)
    assert plan.maps is not None
    rows, outer = (64, 8 * 4096 // 64) if paged else (4096, 8)
    box = (64, _compile.MLA_KEYS, 1, 1)
    for cols in (ROPE, LATENT):
        assert ((cols, rows, 1, outer), (2 * cols, 2 * cols, 2 * cols * rows), box) in encoded
    # Q too: qv's and q's (columns, heads, tokens, batch) views in boxes of a CTA's 64 rows
    for cols in (ROPE, LATENT):
        assert ((cols, 128, 1, 8), (2 * cols, 2 * cols * 128, 2 * cols * 128),
                (64, _compile.MLA_ROWS, 1, 1)) in encoded


def test_mla_q_maps_follow_the_q_the_kernel_reads(planner, encoded):
    """With rotary embedding the kernel reads a rotated copy of q (contiguous), and q's map
    describes that copy, not the caller's q; a q whose views the copy engine cannot take
    leaves the call without maps (the kernel copies Q and every block)."""
    from test_kvcache_plan_cpu import arr as make
    q, k_pe, c_kv, qv, lens = mla_args(batch=2, sq=2, heads=16)
    strided = make((2, 2, 16, ROPE), "bfloat16", strides=(16 * 4 * ROPE, 16 * 2 * ROPE, 2 * ROPE, 1))
    cos = make((4096, ROPE // 2), "float32")
    plan = planner(strided, k_pe, c_kv, cache_seqlens=lens, qv=qv, rotary_cos=cos,
                   rotary_sin=cos)
    assert plan.maps is not None and plan.maps.has_tails
    assert ((ROPE, 16, 2, 2), (2 * ROPE, 2 * ROPE * 16, 2 * ROPE * 16 * 2),
            (64, _compile.MLA_ROWS, 1, 1)) in encoded


def test_mla_without_maps_copies_every_block(planner, monkeypatch):
    """Where no map describes the cache (the encoder refuses it), the kernel's copying
    variant runs, with no maps."""
    monkeypatch.setattr(_tma, "_encode_fn", lambda: lambda *args: 1)  # (CUDA_ERROR_INVALID_VALUE)
    q, k_pe, c_kv, qv, lens = mla_args(batch=2, heads=128)
    plan = planner(q, k_pe, c_kv, cache_seqlens=lens, qv=qv)
    assert plan.launches[0][1] == hash(_compile.MlaVariant("bf16").key) and plan.maps is None


def e4m3(shape, **kw):
    return fp8_arr(shape, "float8_e4m3fn", **kw)


def fp8_arr(shape, dtype, ptr=0x7f0000000000):
    """A CuPy view (as the rest of these calls' arrays: one framework a call) of an fp8
    cache or its float32 descales."""
    strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    return DeviceArray(None, "cupy", ptr, tuple(shape), strides, dtype, 0, SIZES[dtype])


def test_mla_over_an_fp8_cache(planner, encoded):
    """e4m3 k_pe and c_kv with per-(sequence, KV head) descales: the MLA kernel's e4m3
    variant (three 16-bit buffers, two staged e4m3 blocks, within sm_90's shared memory),
    c_kv's bytes described to the copy engine as bfloat16 pairs (256 columns of 2 bytes,
    boxes of 128 values), the descales' strides in the record, and an append that
    quantizes k into k_cache's 64 dims and v into v_cache's 512."""
    q, _, _, qv, lens = mla_args(batch=4, heads=128, paged=64)
    k_pe, c_kv = (e4m3((4 * 4096 // 64, 64, 1, ROPE)),
                 e4m3((4 * 4096 // 64, 64, 1, LATENT), ptr=0x7f3000000000))
    descale = fp8_arr((4, 1), "float32", ptr=0x7f2000000000)
    table = arr((4, 4096 // 64), "int32")
    k_new, v_new = bf((4, 1, 1, ROPE)), bf((4, 1, 1, LATENT))
    plan = planner(q, k_pe, c_kv, k_new, v_new, cache_seqlens=lens, block_table=table, qv=qv,
                   k_descale=descale, v_descale=descale)
    kernel = _compile.MlaVariant("bf16", tma=True, fp8_cache=True)
    assert kernel.key == "decode_mla_bf16_e4m3_tma" and kernel.stages == (3, 2)
    assert kernel.name_expression == "cufa::decode_mla_kernel<1, true, true>"
    pages = 4 * 4096 // 64
    assert ((LATENT // 2, 64, 1, pages), (LATENT, LATENT, 64 * LATENT),
            (64, _compile.MLA_KEYS, 1, 1)) in encoded
    assert kernel.smem_bytes <= _compile.SM90_SMEM_LIMIT and kernel in set(_compile.all_variants())
    kinds = [entry[0] for entry in plan.launches]
    assert kinds[:2] == ["append", "decode_mla"]
    assert plan.launches[0][1] == hash(_compile.AppendVariant("bf16", True).key)
    assert plan.launches[1][1] == hash(kernel.key)
    assert plan.launches[1][4] == kernel.smem_bytes
    rec = record(plan)
    assert (rec["head_dim"], rec["head_dim_v"]) == (ROPE, LATENT)
    assert (rec["k_descale_batch_stride"], rec["v_descale_head_stride"]) == (1, 1)
    assert (rec["v_batch_stride"], rec["v_row_stride"]) == (64 * LATENT, LATENT)  # (bytes)
    assert plan.out_shape == (4, 1, 128, LATENT) and not plan.out_like_q


def test_mla_fp8_cache_errors(planner):
    q, k_pe, c_kv, qv, lens = mla_args(batch=2, heads=16, keys=256)
    k8, v8 = e4m3((2, 256, 1, ROPE)), e4m3((2, 256, 1, LATENT))
    scale = fp8_arr((2, 1), "float32", ptr=0x7f2000000000)
    with pytest.raises(TypeError, match="k_cache has dtype float8_e4m3fn but v_cache has bfloat16"):
        planner(q, k8, c_kv, cache_seqlens=lens, qv=qv)
    with pytest.raises(TypeError, match="k_descale applies to float8_e4m3fn caches"):
        planner(q, k_pe, c_kv, cache_seqlens=lens, qv=qv, k_descale=scale)
    with pytest.raises(ValueError, match=r"v_descale must be float32 \(batch, nheads_k\)"):
        planner(q, k8, v8, cache_seqlens=lens, qv=qv,
                v_descale=fp8_arr((2, 2), "float32", ptr=0x7f2000000000))
    with pytest.raises(NotImplementedError, match="an fp8 cache is read in 16-byte chunks"):
        planner(q, k8, e4m3((2, 256, 1, LATENT), ptr=0x7f0000000008), cache_seqlens=lens, qv=qv)


def test_mla_fp8_cache_without_maps_copies_every_block(planner, monkeypatch):
    """An e4m3 cache no map describes (the encoder refuses it) runs the e4m3 variant that
    copies every block, not a 16-bit one (MlaVariant's second field is tma)."""
    monkeypatch.setattr(_tma, "_encode_fn", lambda: lambda *args: 1)  # (CUDA_ERROR_INVALID_VALUE)
    q, _, _, qv, lens = mla_args(batch=2, heads=16, keys=256)
    k8, v8 = e4m3((2, 256, 1, ROPE)), e4m3((2, 256, 1, LATENT))
    plan = planner(q, k8, v8, cache_seqlens=lens, qv=qv)
    kernel = _compile.MlaVariant("bf16", fp8_cache=True)
    assert (kernel.tma, kernel.fp8_cache) == (False, True) and plan.maps is None
    assert plan.launches[0][1] == hash(kernel.key)


def test_mla_launch_points_its_maps_at_qv_k_v_and_q(planner, monkeypatch):
    """The launch points the record's five maps at qv, k_cache, v_cache, q and q (its q
    and tail slots: the kernel's Q boxes)."""
    import ctypes
    from cufa import _decode_plan, _params

    def replace(addr, ptr):  # (a driver that keeps a map's address in its first word)
        ctypes.memmove(addr, ptr.to_bytes(8, "little"), 8)
        return 0
    monkeypatch.setattr(_tma, "_replace_fn", lambda: replace)
    _tma._moved_by_driver.cache_clear()
    q, k_pe, c_kv, qv, lens = mla_args(batch=2, heads=128)
    plan = planner(q, k_pe, c_kv, cache_seqlens=lens, qv=qv)
    assert plan.maps is not None and plan.maps.has_tails
    fields = _params.DECODE.pointer_fields
    at = {"q": 0x1000, "k": 0x2000, "v": 0x3000, "qv": 0x4000}
    launched = []
    monkeypatch.setattr(_decode_plan, "driver_launch",
                        lambda fn, grid, threads, smem, stream, args: launched.append(args))
    _decode_plan._launch_decode(plan.params, plan.launches, plan.workspace, False,
                                lambda at_offset, counters: [at.get(n, 0) for n in fields],
                                "cupy", 0, 0, scratch_ptr=0x9000_0000, maps=plan.maps)
    (args,) = [a for a in launched if len(a) == 2]
    record = bytes(args[1])
    words = [int.from_bytes(record[128 * i:128 * i + 8], "little") for i in range(5)]
    assert words == [at["qv"], at["k"], at["v"], at["q"], at["q"]]
    _tma._moved_by_driver.cache_clear()
