"""CPU: the launch path of every entry point, with the device layer replaced by a recorder:
each argument's address lands in its field of the params record, outputs are allocated
only where asked for, a repeated signature reuses its plan, and a new address is read
afresh. Views (DeviceArray) stand in for arrays, as under jax.jit."""
import ctypes

import numpy as np
import pytest

import cufa
from cufa import (_arrays, _compile, _decode_plan, _fwd_plan, _heuristics, _interop, _params, _runtime,
                  _tma, api)


class _Device:
    """Records launches; hands out fresh fake addresses."""

    def __init__(self):
        self.launches, self.allocations, self.next = [], [], 1 << 20
        self.capturing, self.memsets = False, []

    def allocate(self, framework, shape, dtype, device, stream, like=None):
        self.allocations.append((shape, dtype))
        self.next += 1 << 20
        return f"array@{self.next:#x}", self.next

    def launch(self, function, blocks, threads, smem, stream, args):
        for a in args:  # (the driver takes each by its address: a ctypes object, not bytes)
            ctypes.addressof(a)
        self.launches.append((function, blocks, [bytes(a) for a in args], stream))


class _Stream:
    def __init__(self, framework, device, stream=None):
        self.stream = stream

    def __enter__(self):
        return 7 if self.stream is None else self.stream

    def __exit__(self, *exc):
        pass


@pytest.fixture
def device(monkeypatch):
    fake = _Device()

    def stream_memory(address):  # (as _runtime._stream_buffer: no jax.jit replay of it)
        def taken(*args, **kw):
            _runtime.recording.replayable = False
            return None, address
        return taken
    for name, stand_in in (
            ("caller_stream", _Stream), ("driver_launch", fake.launch),
            ("stream_tile_counter", stream_memory(_COUNTERS)),
            ("stream_workspace", stream_memory(_WORKSPACE)),
            ("stream_split_counters", stream_memory(_SPLIT_COUNTERS)),
            ("stream_capturing", lambda stream: fake.capturing)):
        _patch_launchers(monkeypatch, name, stand_in)
    import cupy  # (XLA scratch's counter is zeroed in the stream: recorded, not run)
    monkeypatch.setattr(cupy.cuda.runtime, "memsetAsync",
                        lambda ptr, value, nbytes, stream: fake.memsets.append((ptr, nbytes)))
    monkeypatch.setattr(_interop, "allocate", fake.allocate)
    monkeypatch.setattr(_compile, "function_pointer", lambda variant, device: 0xF00)
    monkeypatch.setattr(_runtime, "compute_capability", lambda device: "90")
    monkeypatch.setattr(_runtime, "sm_count", lambda device: 132)
    monkeypatch.setattr(_runtime, "smem_per_sm", lambda device: 228 * 1024)
    monkeypatch.setattr(_runtime, "smem_per_block", lambda device: 227 * 1024)
    monkeypatch.setattr(_tma, "_encode_fn", lambda: _fake_encode)
    monkeypatch.setattr(_tma, "_replace_fn", lambda: _fake_replace)
    _clear_tma_caches()
    api.clear_plans()
    yield fake
    api.clear_plans()
    _clear_tma_caches()


def _patch_launchers(monkeypatch, name, value):
    """`name` replaced where the launch path calls it (_runtime's function, bound by the
    modules that launch)."""
    for module in (_runtime, _fwd_plan, _decode_plan):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, value)


_WORKSPACE = 0xD000_0000  # the per-stream split-KV workspace's (fake) address
_COUNTERS = 0xC0          # the per-stream counters' (fake) address
_SPLIT_COUNTERS = 0xE0    # the per-stream split-KV counters' (fake) address


def _clear_tma_caches():
    for cached in (_tma.template, _tma._moved_by_driver):
        cached.cache_clear()
    _tma._learned_field = _tma._UNKNOWN
    _tma._verified_kinds.clear()
    _tma._kind_maps.clear()
    _tma._kind_words.clear()
    _tma._kind_parts.clear()


def _fake_encode(map_address, data_type, rank, ptr, *layout):
    """A fake map: the address, shifted right by 4, in the low 60 bits of the word at byte
    16, a mark in the top 4 bits; the other bytes a pattern."""
    ctypes.memmove(map_address, bytes(range(128)), 128)
    _fake_replace(map_address, ptr)
    return 0


def _fake_replace(map_address, ptr):
    ctypes.memmove(map_address + 16, (ptr >> 4 | 0xA << 60).to_bytes(8, "little"), 8)
    return 0


def map_addresses(launch):
    """The address each (fake) TMA map of a launch points at; 0 for a map not encoded."""
    maps = launch[2][1]
    words = [int.from_bytes(maps[i + 16:i + 24], "little") for i in range(0, len(maps), 128)]
    return [(w & (1 << 60) - 1) << 4 if w >> 60 == 0xA else 0 for w in words]


_addresses = iter(range(1 << 32, 1 << 40, 1 << 24))


def view(shape, dtype="float16"):
    itemsize = 4 if dtype in ("float32", "int32") else 2
    return _interop.DeviceArray(None, "cupy", next(_addresses), tuple(shape),
                                _interop.contiguous_strides(shape), dtype, 0, itemsize)


def record(launch, fields=_params.FWD):
    return np.frombuffer(launch[2][0], dtype=fields.dtype)[0]


def test_dense_addresses_and_no_lse_unless_asked(device):
    q, k, v = view((2, 100, 4, 64)), view((2, 130, 2, 64)), view((2, 130, 2, 64))
    o = cufa.flash_attn_func(q, k, v, causal=True)
    (launch,) = device.launches
    r = record(launch)
    assert (r["q"], r["k"], r["v"]) == (q.ptr, k.ptr, v.ptr)
    assert r["o"] == int(o.split("@")[1], 16) and r["lse"] == 0
    assert r["tile_counter"] == _COUNTERS  # persistent kernel: the per-stream counter
    assert device.allocations == [((2, 100, 4, 64), "float16")]
    assert len(launch[2]) == 2             # the record and the TMA maps
    o, lse = cufa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    r = record(device.launches[-1])
    assert r["lse"] == int(lse.split("@")[1], 16) and device.allocations[-1] == (
        (2, 4, 100), "float32")
    assert len(_runtime.plans) == 1            # return_lse is no part of the plan


def test_repeated_signature_reuses_the_plan_with_new_addresses(device):
    shapes = ((1, 64, 2, 128), (1, 64, 2, 128), (1, 64, 2, 128))
    for _ in range(3):
        q, k, v = (view(s) for s in shapes)
        cufa.flash_attn_func(q, k, v)
        r = record(device.launches[-1])
        assert (r["q"], r["k"], r["v"]) == (q.ptr, k.ptr, v.ptr)
        # the layout's maps, encoded once, pointed at this call's arrays (no tail maps)
        assert map_addresses(device.launches[-1]) == [q.ptr, k.ptr, v.ptr, 0, 0]
    assert len(_runtime.plans) == 1 and _tma.template.cache_info().misses == 1
    cufa.flash_attn_func(q, k, v, softcap=5.0)  # new options: a new plan
    assert len(_runtime.plans) == 2


def test_tma_addresses_written_in_python_or_moved_by_the_driver(device, monkeypatch):
    q, k = view((1, 64, 2, 128)), view((1, 80, 2, 128))
    cufa.flash_attn_func(q, k, k)
    assert _tma._address_field() == (16, 4)   # learned from the (fake) driver's moves
    assert map_addresses(device.launches[-1]) == [q.ptr, k.ptr, k.ptr, 0, 0]
    moves = []

    def counting_replace(map_address, ptr):  # also bumps a byte: no field explains it
        moves.append(ptr)
        ctypes.memmove(map_address + 100, bytes([len(moves) % 256]), 1)
        return _fake_replace(map_address, ptr)
    monkeypatch.setattr(_tma, "_replace_fn", lambda: counting_replace)
    _clear_tma_caches()
    api.clear_plans()
    q = view((1, 64, 2, 128))
    cufa.flash_attn_func(q, k, k)
    assert _tma._address_field() is None
    assert map_addresses(device.launches[-1]) == [q.ptr, k.ptr, k.ptr, 0, 0]
    assert moves[-3:] == [q.ptr, k.ptr, k.ptr]   # the driver moved this call's maps


def test_a_new_shape_of_a_checked_kind_costs_no_driver_moves(device, monkeypatch):
    """A layout's maps are checked against the driver's own move once per kind (dtype and
    boxes); a new shape of that kind (a server's next token count) is encoded, its
    placeholders found where the field says, and no map moved by the driver."""
    moves = []

    def counting_replace(map_address, ptr):
        moves.append(ptr)
        return _fake_replace(map_address, ptr)
    monkeypatch.setattr(_tma, "_replace_fn", lambda: counting_replace)
    q = view((1, 64, 2, 128))
    cufa.flash_attn_func(q, q, q)
    learned = len(moves)          # the field learned (probe moves) and this kind checked
    assert learned > 3
    for n in (65, 300, 1000):     # new shapes, same dtype and boxes
        q = view((1, n, 2, 128))
        cufa.flash_attn_func(q, q, q)
        assert map_addresses(device.launches[-1]) == [q.ptr, q.ptr, q.ptr, 0, 0]
    assert len(moves) == learned
    q = view((1, 64, 2, 128), "bfloat16")  # a new kind: checked once
    cufa.flash_attn_func(q, q, q)
    assert len(moves) == learned + 3
    assert map_addresses(device.launches[-1]) == [q.ptr, q.ptr, q.ptr, 0, 0]


def test_out_is_written_and_returned(device):
    q = view((1, 33, 2, 64))
    out = view((1, 33, 2, 64))
    res = cufa.flash_attn_func(q, q, q, out=out)
    assert res is out and record(device.launches[-1])["o"] == out.ptr
    assert device.allocations == []


def test_packed_addresses_and_scratch(device):
    q, k = view((300, 4, 64)), view((300, 2, 64))
    cu = view((4,), "int32")
    used = view((3,), "int32")
    o, lse = cufa.flash_attn_varlen_func(q, k, k, cu, cu, 200, 200, seqused_k=used,
                                         return_lse=True)
    schedule, forward = device.launches
    r = record(forward)
    assert (r["q"], r["k"], r["v"]) == (q.ptr, k.ptr, k.ptr)
    assert (r["cu_seqlens_q"], r["cu_seqlens_k"], r["seqused_k"]) == (cu.ptr, cu.ptr, used.ptr)
    assert map_addresses(forward) == [q.ptr, k.ptr, k.ptr, k.ptr, k.ptr]  # k, v tails too
    scratch = r["tile_list"]
    assert scratch == _WORKSPACE  # the work list in the stream's buffer: no allocation
    assert device.allocations == [((300, 4, 64), "float16"), ((4, 300), "float32")]
    assert r["tile_count"] > scratch and r["tile_counter"] > r["tile_count"]
    # the schedule kernel's record: the batch, the forward's work list and tile counter
    # (which it zeroes), and the query rows up to which sequences are the decode kernel's
    # (none: not paged)
    (s_args,) = schedule[2]
    sr = np.frombuffer(s_args, dtype=_params.SCHEDULE.dtype)[0]
    assert (sr["cu_seqlens_q"], sr["tile_list"], sr["tile_count"], sr["tile_counter"]) == (
        cu.ptr, scratch, r["tile_count"], r["tile_counter"])
    assert sr["scratch"] == r["tile_count"] + 4
    assert (sr["batch"], sr["total_q"], sr["decode_rows"]) == (3, 300, 0)
    assert sr["block_m"] in (64, 128, 192) and sr["num_buckets"] == 300 // sr["block_m"] + 2


def test_paged_packed_batch_sends_short_sequences_to_the_decode_kernel(device):
    """flash_attn_varlen_func over a paged cache: after the forward, the decode kernel
    takes the sequences of 1 to 16 / group query rows (the schedule leaves them out of
    the forward's work list), writing the same out and lse."""
    total, h, hk, d, pages, page = 300, 8, 2, 128, 40, 16
    q, cache = view((total, h, d)), view((pages, page, hk, d))
    cu, used, table = view((5,), "int32"), view((4,), "int32"), view((4, 10), "int32")
    o, lse = cufa.flash_attn_varlen_func(q, cache, cache, cu, cu, 64, 64, seqused_k=used,
                                         block_table=table, causal=True, return_lse=True)
    schedule, forward, decode = device.launches
    assert record(schedule, _params.SCHEDULE)["decode_rows"] == 16 // (h // hk)
    r = record(decode, _params.DECODE)
    assert (r["q"], r["k"], r["v"], r["block_table"]) == (q.ptr, cache.ptr, cache.ptr, table.ptr)
    assert (r["cu_seqlens_q"], r["cu_seqlens_k"], r["seqused_k"]) == (cu.ptr, cu.ptr, used.ptr)
    assert r["o"] == record(forward)["o"] and r["lse"] == record(forward)["lse"] != 0
    assert (r["seqlen_q"], r["group"], r["total_q"], r["num_m_blocks"]) == (4, 4, total, 1)
    assert (r["q_batch_stride"], r["q_row_stride"], r["lse_batch_stride"],
            r["lse_head_stride"]) == (0, h * d, 0, total)
    assert (r["capacity"], r["max_pages"], r["page_shift"]) == (160, 10, 4)
    assert r["cache_seqlens"] == r["k_new"] == r["q_source"] == 0
    assert decode[1] == (r["num_m_blocks"] * r["num_splits"], hk, 4)  # grid
    # the schedule orders the decode-sized sequences (most keys first) into a list after
    # the work list and tile counter, which the decode kernel reads a sequence a grid z
    plan = next(p for p in _runtime.plans.values() if getattr(p, "decode", None) is not None)
    _, max_tiles, num_buckets, _ = plan.work_list
    s = record(schedule, _params.SCHEDULE)
    ints = _fwd_plan._work_list_ints(max_tiles, num_buckets)
    assert s["decode_order"] == r["decode_order"] == s["tile_list"] + 4 * (ints + 2)
    assert (s["cu_seqlens_k"], s["seqused_k"]) == (cu.ptr, used.ptr)
    assert (s["capacity"], s["key_shift"], s["decode_rows"]) == (160, 1, 4)
    assert 4 * (ints + 2 + 4) <= plan.decode.scratch_offset <= plan.scratch_bytes
    o2 = cufa.flash_attn_varlen_func(q, cache, cache, cu, cu, 64, 64, seqused_k=used,
                                     block_table=table, causal=True)
    assert record(device.launches[-1], _params.DECODE)["lse"] == 0  # no lse asked for


@pytest.mark.parametrize("page, family", [(1, "sm80"), (4, "sm80"), (8, "sm90"), (16, "sm90"),
                                          (256, "sm90")])
def test_paged_prefill_takes_the_hopper_kernels_from_pages_of_8(device, monkeypatch, page,
                                                                 family):
    """A paged packed batch on sm_90: the wgmma kernels, K and V read by TMA boxes of
    whole rows inside a page (the page, or the largest power of two dividing the key
    block: 80 -> 16), no tail maps; pages under 8 rows: the portable kernels."""
    made = []
    template = _tma.template

    def recording(dtype, views, tail_views=()):
        made.append((views, tail_views))
        return template(dtype, views, tail_views)
    recording.cache_clear = template.cache_clear  # (the fixture clears it after the test)
    monkeypatch.setattr(_tma, "template", recording)
    total, h, hk, d = 300, 8, 2, 128
    q, cache = view((total, h, d)), view((40, page, hk, d))
    cu, table = view((5,), "int32"), view((4, 10), "int32")
    cufa.flash_attn_varlen_func(q, cache, cache, cu, cu, 64, 64, block_table=table, causal=True)
    plan = next(p for p in _runtime.plans.values() if getattr(p, "decode", None) is not None)
    assert plan.variant.family == family
    forward = device.launches[1]
    assert record(forward)["kv_tail_maps"] == 0
    assert record(forward)["block_table"] == table.ptr
    if family == "sm80":
        assert plan.tma_template is None and not made
        return
    assert map_addresses(forward) == [q.ptr, cache.ptr, cache.ptr, 0, 0]
    (views, tails), = made
    box = min(page, plan.variant.block_n & -plan.variant.block_n)
    assert views[1] == views[2] == ((40, page, hk, d), cache.strides[:3], box) and tails == ()
    assert views[0] == ((1, total, h, d), (0, h * d, d), plan.variant.block_m)


def test_paged_boxes_never_cross_a_page():
    """A paged box: the page, or the largest power of two dividing the key block."""
    assert [_fwd_plan._paged_box_rows(p, n) for p, n in ((16, 80), (32, 80), (256, 80), (8, 128),
                                                   (256, 128), (64, 64), (256, 32))] == [
        16, 16, 16, 8, 128, 64, 32]


def test_sdpa_mask_address(device):
    q = view((2, 4, 50, 64))
    mask = view((50, 70), "float32")
    kv = view((2, 4, 70, 64))
    cufa.scaled_dot_product_attention(q, kv, kv, attn_mask=mask)
    assert record(device.launches[-1])["attn_mask"] == mask.ptr


def test_kvcache_addresses(device):
    q, cache, v_cache = view((4, 1, 8, 128)), view((4, 1024, 2, 128)), view((4, 1024, 2, 128))
    lens = view((4,), "int32")
    k_new, v_new = view((4, 1, 2, 128)), view((4, 1, 2, 128))
    o = cufa.flash_attn_with_kvcache(q, cache, v_cache, k_new, v_new, cache_seqlens=lens,
                                     num_splits=1)
    append, decode = device.launches
    r = record(decode, _params.DECODE)
    assert (r["q"], r["k"], r["v"], r["cache_seqlens"]) == (q.ptr, cache.ptr, v_cache.ptr,
                                                           lens.ptr)
    assert (r["k_new"], r["v_new"]) == (k_new.ptr, v_new.ptr)
    assert r["o"] == int(o.split("@")[1], 16) and r["lse"] == 0


def _decode_route(device, batch, seqlen, nheads_k, d=64, nheads=32, **kw):
    """The decode launch's (kind, grid, threads) of one call, and the launch."""
    q, cache = view((batch, 1, nheads, d)), view((batch, seqlen, nheads_k, d))
    done = len(device.launches)
    cufa.flash_attn_with_kvcache(q, cache, kw.pop("v_cache", cache), cache_seqlens=seqlen, **kw)
    plan = next(p for p in reversed(list(_runtime.plans.values()))
                if isinstance(p, _decode_plan._KvPlan))
    kind, _, grid, threads, smem = next(e for e in plan.launches if e[0].startswith("decode"))
    return (kind, grid, threads), device.launches[done], plan


@pytest.fixture
def h100(device, monkeypatch):
    monkeypatch.setattr(_heuristics, "_keeps_up", {})
    monkeypatch.setattr(_runtime, "peak_bytes_per_s", lambda device: 2 * 2619e6 * 5120 / 8)
    return device


def test_tma_decode_where_it_was_measured_faster(h100):
    """The TMA decode kernel (Hopper, d <= 64, contiguous caches): one unit a CTA where one
    CTA an SM streams a split, two where the units outnumber the SMs up to twice; its
    launch carries the K/V maps pointed at the call's cache; elsewhere the cp.async kernel."""
    route, launch, plan = _decode_route(h100, 1, 131072, 8)
    assert route == ("decode_tma", (16, 8, 1), 160)
    r = record(launch, _params.DECODE)
    assert map_addresses(launch)[:3] == [r["k"], r["k"], r["v"]] and len(launch[2]) == 2
    # one unit a CTA: the splits merge in the launch as decode_kernel's
    assert plan.merge_in_launch and r["split_counters"] == _SPLIT_COUNTERS
    route, _, plan = _decode_route(h100, 8, 16384, 32)
    assert route == ("decode_tma", (1, 32, 4), 160) and not plan.merge_in_launch  # 2 units
    assert _decode_route(h100, 1, 131072, 8, d=40)[0][0] == "decode_tma"  # padded to 64
    assert _decode_route(h100, 1, 32768, 32)[0][0] == "decode_tma"  # 4 splits: 8192 keys a CTA
    for shape, kw in (((64, 4096, 8), {}),           # 512 units: within +-2 %, cp.async
                      ((1, 32768, 8), {}),           # 16 splits: 2048 keys a CTA
                      ((7, 16384, 32), {}),          # 224 units, odd batch: no pairs
                      ((1, 32768, 8, 128), {}),      # d = 128: not yet
                      ((8, 16384, 32), {"num_splits": 2})):  # 512 CTAs
        assert _decode_route(h100, *shape, **kw)[0][0] == "decode", shape
    other = view((1, 131072, 8, 64))
    other.strides = (131072 * 8 * 64, 8 * 64, 64 * 2, 1)  # v strided unlike k
    assert _decode_route(h100, 1, 131072, 8, v_cache=other)[0][0] == "decode"


def test_tma_decode_only_on_the_h100_rule_and_the_hopper_family(h100, monkeypatch):
    monkeypatch.setattr(_runtime, "peak_bytes_per_s", lambda device: 2 * 3201e6 * 6144 / 8)
    monkeypatch.setattr(_heuristics, "_keeps_up", {})
    assert _decode_route(h100, 1, 131072, 8)[0][0] == "decode"  # an H200: not measured
    monkeypatch.setattr(_runtime, "peak_bytes_per_s", lambda device: 2 * 2619e6 * 5120 / 8)
    monkeypatch.setattr(_heuristics, "_keeps_up", {})
    api.clear_plans()
    monkeypatch.setitem(_compile._overrides, _compile.FAMILY_ENV, "sm80")
    assert _decode_route(h100, 1, 131072, 8)[0][0] == "decode"  # the portable family forced


@pytest.mark.parametrize("forced,route", [("0", ("decode", (16, 8, 1))),
                                          ("1", ("decode_tma", (1, 32, 64))),
                                          ("2", ("decode_tma", (1, 32, 32)))])
def test_cufa_decode_tma_forces_the_route(h100, monkeypatch, forced, route):
    """CUFA_DECODE_TMA: 0 never, 1 or 2 wherever the kernel can run (here 64 x 4k, 32 KV
    heads, which the rule leaves to cp.async), with that many units a CTA."""
    monkeypatch.setitem(_compile._overrides, _compile.DECODE_TMA_ENV, forced)
    if forced == "0":
        assert _decode_route(h100, 1, 32768, 8)[0][:2] == route
    else:
        assert _decode_route(h100, 64, 4096, 32)[0][:2] == route
    monkeypatch.setitem(_compile._overrides, _compile.DECODE_TMA_ENV, "3")
    api.clear_plans()
    monkeypatch.setitem(_compile._overrides, _compile.DECODE_TMA_ENV, "3")
    with pytest.raises(ValueError, match="CUFA_DECODE_TMA must be 0, 1 or 2"):
        _decode_route(h100, 1, 32768, 8)


def test_kvcache_split_partials_in_the_stream_workspace(device):
    q, cache = view((1, 1, 32, 128)), view((1, 32768, 8, 128))
    lens = view((1,), "int32")
    o = cufa.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lens, num_splits=4)
    (decode,) = device.launches  # the last split of each unit merges: no combine launch
    r = record(decode, _params.DECODE)
    assert r["o_partial"] == _WORKSPACE and r["lse_partial"] > _WORKSPACE
    assert r["num_splits"] == 4 and r["split_counters"] == _SPLIT_COUNTERS
    assert device.allocations == [((1, 1, 32, 128), "float16")]  # the output only
    cufa.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lens, num_splits=1)
    assert record(device.launches[-1], _params.DECODE)["split_counters"] == 0
    # a merge the decode CTA cannot cover in one pass (4 rows, a CTA a row at 16 splits of
    # d = 128) stays decode_combine's, eagerly too
    done = len(device.launches)
    cufa.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lens, num_splits=16)
    decode, combine = device.launches[done:]
    assert record(decode, _params.DECODE)["split_counters"] == 0
    assert record(decode, _params.DECODE)["combine_row_threads"] == 128
    # behind queued work too (the merge in the launch costs the GPU less than the combine)
    done = len(device.launches)
    cufa.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lens, num_splits=4)
    (decode,) = device.launches[done:]
    assert record(decode, _params.DECODE)["split_counters"] == _SPLIT_COUNTERS
    # under graph capture decode_combine merges: no counters of cufa's in the graph
    device.capturing, done = True, len(device.launches)
    cufa.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lens, num_splits=4)
    decode, combine = device.launches[done:]
    assert record(decode, _params.DECODE)["split_counters"] == 0
    assert record(combine, _params.DECODE)["num_splits"] == 4


def test_kvcache_append_without_query_rows_launches_the_append_alone(device):
    """No query rows: no decode launch to merge in, split or not (the append writes the
    new keys all the same)."""
    q, cache, new = view((1, 0, 8, 64)), view((1, 1024, 2, 64)), view((1, 1, 2, 64))
    lens = view((1,), "int32")
    cufa.flash_attn_with_kvcache(q, cache, view(cache.shape), new, new, cache_seqlens=lens,
                                 num_splits=4)
    (append,) = device.launches
    assert record(append, _params.DECODE)["k_new"] == new.ptr


def test_merge_addresses(device):
    oa, ob = view((1, 10, 2, 64)), view((1, 10, 2, 64))
    la, lb = view((1, 2, 10), "float32"), view((1, 2, 10), "float32")
    out, lse = cufa.merge_attention_states(oa, la, ob, lb)
    r = record(device.launches[-1], _params.MERGE)
    assert (r["out_a"], r["lse_a"], r["out_b"], r["lse_b"]) == (oa.ptr, la.ptr, ob.ptr, lb.ptr)
    assert r["out"] == int(out.split("@")[1], 16) and r["lse"] == int(lse.split("@")[1], 16)


def test_bad_input_still_named_before_any_launch(device):
    q = view((1, 10, 2, 64))
    with pytest.raises(ValueError, match="k has head dim 128"):
        cufa.flash_attn_func(q, view((1, 10, 2, 128)), view((1, 10, 2, 128)))
    with pytest.raises(TypeError, match="q must be a CUDA array"):
        cufa.flash_attn_func(None, q, q)
    assert device.launches == [] and _runtime.plans == {}


def test_portable_kernels_and_empty_batches(device, monkeypatch):
    monkeypatch.setattr(_runtime, "compute_capability", lambda device: "80")
    q = view((2, 40, 2, 64))
    cufa.flash_attn_func(q, q, q)
    r = record(device.launches[-1])
    assert r["q"] == q.ptr and r["tile_counter"] == 0   # not persistent: no counter
    assert len(device.launches[-1][2]) == 1             # no TMA maps
    empty = view((0, 40, 2, 64))
    o, lse = cufa.flash_attn_func(empty, empty, empty, return_lse=True)
    assert len(device.launches) == 1 and device.allocations[-2:] == [
        ((0, 40, 2, 64), "float16"), ((0, 2, 40), "float32")]


class _XlaBuffer:
    def __init__(self, shape, typestr):
        self.__cuda_array_interface__ = dict(shape=shape, typestr=typestr, strides=None,
                                             data=(next(_addresses), False), version=3)


def test_jax_callback_launches_on_xla_stream_without_lse_unless_asked(device, monkeypatch):
    jax = pytest.importorskip("jax")
    from cufa import _jax
    monkeypatch.setattr(_jax, "_device_of", lambda ptr: 0)
    q = jax.ShapeDtypeStruct((1, 40, 2, 64), "float16")
    for lse in (False, True):
        results = [q] + ([jax.ShapeDtypeStruct((1, 2, 40), "float32")] if lse else [])
        spec = _jax.Call("flash_attn_func", ("q", "k", "v"), ("float16",) * 3,
                         tuple(str(r.dtype) for r in results) + ("uint8",),
                         dict(softmax_scale=None, causal=True, window_size=(-1, -1),
                              softcap=0.0), (), tuple(_jax._layout(q) for _ in range(3)),
                         tuple(_jax._layout(r) for r in results) + (SCRATCH_LAYOUT,), True)
        bufs = [_XlaBuffer((1, 40, 2, 64), "<f2") for _ in range(3)]
        outs = [_XlaBuffer(tuple(r.shape), "<f4") for r in results] + [
            _XlaBuffer((SCRATCH_BYTES,), "|u1")]

        class Context:
            stream = 0x5EED
        _jax.on_device(spec, Context, outs, bufs)
        launch = device.launches[-1]
        r = record(launch)
        ptr = (lambda b: b.__cuda_array_interface__["data"][0])
        assert (r["q"], r["k"], r["v"], r["o"]) == tuple(map(ptr, bufs + outs[:1]))
        assert r["lse"] == (ptr(outs[1]) if lse else 0)
        assert launch[3] == 0x5EED and device.allocations == []


def test_missing_required_arrays_are_named(device):
    q = view((30, 2, 64))
    cu = view((2,), "int32")
    with pytest.raises(TypeError, match="cu_seqlens_k must be a CUDA array"):
        cufa.flash_attn_varlen_func(q, q, q, cu, None, 30, 30)
    with pytest.raises(TypeError, match="v_cache must be a CUDA array"):
        cufa.flash_attn_with_kvcache(view((1, 1, 2, 64)), view((1, 8, 2, 64)), None)
    with pytest.raises(TypeError, match="lse_b must be a CUDA array"):
        cufa.merge_attention_states(view((1, 4, 2, 64)), view((1, 2, 4), "float32"),
                                    view((1, 4, 2, 64)), None)
    assert device.launches == []


@pytest.fixture
def memsets(monkeypatch):
    """The memsets a jitted call's callback queues (their address, size and stream), with
    the buffers' device looked up as 0."""
    import cupy
    from cufa import _jax
    queued = []
    monkeypatch.setattr(_jax, "_device_of", lambda ptr: 0)
    monkeypatch.setattr(cupy.cuda.runtime, "memsetAsync",
                        lambda ptr, value, size, stream: queued.append((ptr, size, stream)))
    return queued


def test_jax_callback_takes_its_scratch_from_xla(device, memsets):
    """Under jax.jit the tile counter (and a packed batch's work list) live in an output
    XLA owns, zeroed in the stream, never in memory cufa allocates: XLA may replay the
    launches from a CUDA graph after the callback has returned."""
    jax = pytest.importorskip("jax")
    from cufa import _jax
    q = jax.ShapeDtypeStruct((1, 40, 2, 64), "float16")
    scratch = jax.ShapeDtypeStruct((8,), "uint8")
    spec = _jax.Call("flash_attn_func", ("q", "k", "v"), ("float16",) * 3,
                     ("float16", "uint8"), dict(softmax_scale=None, causal=False,
                                                window_size=(-1, -1), softcap=0.0), (),
                     tuple(_jax._layout(q) for _ in range(3)),
                     (_jax._layout(q), _jax._layout(scratch)), True)
    bufs = [_XlaBuffer((1, 40, 2, 64), "<f2") for _ in range(3)]
    outs = [_XlaBuffer((1, 40, 2, 64), "<f2"), _XlaBuffer((8,), "|u1")]

    class Context:
        stream = 0x5EED
    _jax.on_device(spec, Context, outs, bufs)
    counter = outs[1].__cuda_array_interface__["data"][0]
    assert record(device.launches[-1])["tile_counter"] == counter
    assert memsets == [(counter, 8, 0x5EED)] and device.allocations == []
    # traced for a device whose plan needed less scratch than this one's: refused
    small = jax.ShapeDtypeStruct((4,), "uint8")
    spec = spec.__class__(**{**spec.__dict__,
                             "out_layouts": (_jax._layout(q), _jax._layout(small))})
    with pytest.raises(RuntimeError, match="scratch buffer traced for this jitted call"):
        _jax.on_device(spec, Context, [outs[0], _XlaBuffer((4,), "|u1")], bufs)


def test_plans_beyond_the_limit_drop_the_oldest(device, monkeypatch):
    monkeypatch.setattr(_runtime, "MAX_PLANS", 3)
    shapes = [(1, n, 2, 64) for n in (10, 11, 12, 13)]
    for shape in shapes:
        cufa.flash_attn_func(view(shape), view(shape), view(shape))
    assert [key[2][1] for key in _runtime.plans] == shapes[1:]  # q's shape in each key


def test_jax_split_decode_keeps_its_partials_in_xla_scratch(device, memsets):
    """A split decode under jax.jit: the partials in XLA's scratch output, nothing
    allocated and nothing to zero."""
    jax = pytest.importorskip("jax")
    from cufa import _jax
    q = jax.ShapeDtypeStruct((2, 1, 8, 64), "float16")
    cache = jax.ShapeDtypeStruct((2, 32768, 2, 64), "float16")
    lens = jax.ShapeDtypeStruct((2,), "int32")
    lse = jax.ShapeDtypeStruct((2, 8, 1), "float32")
    plan = _decode_plan.plan_kvcache(_arrays.KvCache(*(view(x.shape, str(x.dtype))
                                                       for x in (q, cache, cache)),
                                                     cache_seqlens=view((2,), "int32")),
                                     None, None, window=(1 << 30, 1 << 30),
                                     scale=None, softcap=0.0, interleaved=True, num_splits=5,
                                     want_lse=True)
    assert plan.scratch_bytes == 4 * plan.workspace[0] > 0
    scratch = jax.ShapeDtypeStruct((plan.scratch_bytes,), "uint8")
    options = dict(cache_seqlen=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                   softcap=0.0, rotary_interleaved=True, num_splits=5)
    spec = _jax.Call("flash_attn_with_kvcache", ("q", "k_cache", "v_cache", "cache_seqlens"),
                     ("float16", "float16", "float16", "int32"), ("float16", "float32", "uint8"),
                     options, (), tuple(_jax._layout(x) for x in (q, cache, cache, lens)),
                     tuple(_jax._layout(x) for x in (q, lse, scratch)), True)
    bufs = [_XlaBuffer(x.shape, np.dtype(x.dtype).str) for x in (q, cache, cache, lens)]
    outs = [_XlaBuffer(x.shape, np.dtype(x.dtype).str) for x in (q, lse, scratch)]

    class Context:
        stream = 0x5EED
    for _ in range(2):
        _jax.on_device(spec, Context, outs, bufs)
    base = outs[2].__cuda_array_interface__["data"][0]
    r = record(device.launches[-1], _params.DECODE)
    assert r["o_partial"] == base and r["lse_partial"] == base + 4 * plan.workspace[2]
    # (2 units x 5 splits on a fake H100: the TMA kernel, its maps at XLA's cache buffers)
    assert [entry[0] for entry in plan.launches] == ["decode_tma", "combine"]
    cache_ptr = bufs[1].__cuda_array_interface__["data"][0]
    assert map_addresses(device.launches[-2])[:3] == [cache_ptr, cache_ptr, bufs[2].__cuda_array_interface__["data"][0]]
    assert r["num_splits"] == 5 and device.allocations == [] and memsets == []
    # (merged by decode_combine, launched: no counters of cufa's in an XLA replay)
    assert r["split_counters"] == 0 and len(device.launches) == 2  # (the second run repeats)


def test_the_documented_serving_step_validates_and_launches(device):
    """docs/api.md's serving example, call by call, on views of its shapes: the append
    of a prefill chunk into the pages, the chunk's attention over the pages, a decode step
    and the mixed step (a chunk and decodes in one packed call) all pass validation and
    launch what they should."""
    pages, page, chunk = 4096, 16, 512
    k_cache, v_cache = view((pages, page, 8, 128), "bfloat16"), view((pages, page, 8, 128),
                                                                      "bfloat16")
    table, lens = view((8, pages // 8), "int32"), view((8,), "int32")
    q, k, v = (view((8, chunk, h, 128), "bfloat16") for h in (32, 8, 8))
    q0 = view((8, 0, 32, 128), "bfloat16")  # q[:, :0]: append only
    cufa.flash_attn_with_kvcache(q0, k_cache, v_cache, k, v, cache_seqlens=lens,
                                 block_table=table)
    assert [record(launch, _params.DECODE)["seqlen_new"] for launch in device.launches] == [chunk]
    cu_q = view((9,), "int32")
    cufa.flash_attn_varlen_func(view((8 * chunk, 32, 128), "bfloat16"), k_cache, v_cache,
                                cu_q, cu_q, chunk, (pages // 8) * page, causal=True,
                                seqused_k=lens, block_table=table)
    q1, k1, v1 = (view((8, 1, h, 128), "bfloat16") for h in (32, 8, 8))
    count = len(device.launches)
    cufa.flash_attn_with_kvcache(q1, k_cache, v_cache, k1, v1, cache_seqlens=lens,
                                 block_table=table, causal=True)
    assert len(device.launches) > count
    # the mixed step: a 512-token chunk of sequence 0 and decodes of sequences 1..7
    cu_mixed = view((9,), "int32")
    count = len(device.launches)
    cufa.flash_attn_varlen_func(view((chunk + 7, 32, 128), "bfloat16"), k_cache, v_cache,
                                cu_mixed, cu_mixed, chunk, (pages // 8) * page, causal=True,
                                seqused_k=lens, block_table=table)
    schedule, forward, decode = device.launches[count:count + 3]
    assert record(decode, _params.DECODE)["seqlen_q"] == 16 // 4  # rows a decode sequence may have
    with pytest.raises(ValueError, match="capacity|cache"):  # the append without its pages
        cufa.flash_attn_with_kvcache(q0, k_cache, v_cache, k, v, cache_seqlens=lens)


# -- jax.jit: a callback's device calls recorded and repeated ------------------------------

class _Buffer:
    """An XLA buffer as the callback sees it: its __cuda_array_interface__."""

    def __init__(self, ptr, shape):
        self.ptr, self.shape = ptr, shape

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": "<f2", "data": (self.ptr, False),
                "version": 3, "strides": None}


class _Driver:
    """The driver module's launchKernel: each launch with its argument records' bytes,
    read through the pointer array as the driver would."""

    def __init__(self):
        self.launches = []

    def launchKernel(self, function, gx, gy, gz, bx, by, bz, smem, stream, args, extra):
        params = ctypes.c_void_p.from_address(args).value  # the first argument: the record
        self.launches.append((function, (gx, gy, gz), stream,
                              ctypes.string_at(params, _params.FWD.dtype.itemsize)))


# XLA's scratch buffer of a jitted call (the persistent kernel's tile counter or work list):
# a call traced without one that needs one is refused (_runtime.check_scratch)
SCRATCH_BYTES = 4096
SCRATCH_LAYOUT = ((SCRATCH_BYTES,), (1,), "uint8", 1)


def _dense_call():
    from cufa import _jax
    layout = ((2, 100, 4, 64), (25600, 256, 64, 1), "float16", 2)
    return _jax.Call("flash_attn_func", ("q", "k", "v"), ("float16",) * 3, ("float16", "uint8"),
                     dict(softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0),
                     (), (layout,) * 3, (layout, SCRATCH_LAYOUT), True)


def _scratch():
    return _Buffer(0xF000_0000, (SCRATCH_BYTES,))


def test_jax_callback_repeats_its_launches_for_the_same_buffers(device, monkeypatch):
    from cufa import _jax
    driver = _Driver()
    _patch_launchers(monkeypatch, "driver_launch", _real_driver_launch)
    monkeypatch.setattr(_runtime, "_driver", lambda: driver)
    monkeypatch.setattr(_jax, "_device_of", lambda ptr: 0)
    planned = []
    real_plan = _fwd_plan.plan_dense
    monkeypatch.setattr(_fwd_plan, "plan_dense", lambda *a: planned.append(1) or real_plan(*a))
    spec, ctx = _dense_call(), type("Ctx", (), {"stream": 0x77})
    bufs = [_Buffer(0x1000_0000 * (i + 1), (2, 100, 4, 64)) for i in range(3)]
    out = [_Buffer(0x9000_0000, (2, 100, 4, 64)), _scratch()]
    _jax.on_device(spec, ctx, out, bufs)
    first = driver.launches[:]
    assert len(first) == 1 and planned == [1] and first[0][2] == 0x77
    real_view = _jax._view
    for _ in range(2):  # repeated: the same launch, bytes and all, and no plan or views
        driver.launches.clear()
        monkeypatch.setattr(_jax, "_view", None)
        _jax.on_device(spec, ctx, out, bufs)
        assert driver.launches == first and planned == [1]
    monkeypatch.setattr(_jax, "_view", real_view)
    # a new output address: launched afresh, pointing at it
    driver.launches.clear()
    moved = [_Buffer(0xA000_0000, (2, 100, 4, 64)), _scratch()]
    _jax.on_device(spec, ctx, moved, bufs)
    def o_field(record):
        return int(np.frombuffer(record, _params.FWD.dtype)[0]["o"])
    assert o_field(driver.launches[0][3]) == 0xA000_0000
    assert o_field(first[0][3]) == 0x9000_0000
    # another stream: launched afresh on it
    driver.launches.clear()
    _jax.on_device(spec, type("Ctx", (), {"stream": 0x78}), out, bufs)
    assert driver.launches[0][2] == 0x78
    # clear_plans forgets the recordings with the plans
    assert len(_jax.replays) == 3
    api.clear_plans()
    assert not _jax.replays


def test_jax_callback_that_failed_or_took_stream_memory_is_not_repeated(device, monkeypatch):
    from cufa import _jax
    driver = _Driver()
    _patch_launchers(monkeypatch, "driver_launch", _real_driver_launch)
    monkeypatch.setattr(_runtime, "_driver", lambda: driver)
    monkeypatch.setattr(_jax, "_device_of", lambda ptr: 0)
    spec, ctx = _dense_call(), type("Ctx", (), {"stream": 0x77})
    bufs = [_Buffer(0x1000_0000 * (i + 1), (2, 100, 4, 64)) for i in range(3)]
    out = [_Buffer(0x9000_0000, (2, 100, 4, 64)), _scratch()]

    def fails(*a, **kw):
        raise ValueError("bad")
    monkeypatch.setitem(_jax._RUNNERS, "flash_attn_func", fails)
    with pytest.raises(ValueError):
        _jax.on_device(spec, ctx, out, bufs)
    assert _runtime.recording.calls is None
    assert not _jax.replays

    def takes_stream_memory(*a, **kw):  # as _runtime._stream_buffer does
        _runtime.recording.replayable = False
    monkeypatch.setitem(_jax._RUNNERS, "flash_attn_func", takes_stream_memory)
    _jax.on_device(spec, ctx, out, bufs)
    assert not _jax.replays


def test_jax_recordings_of_moving_buffers_are_bounded(device, monkeypatch):
    """A jitted function whose buffers move every run leaves a recording a run: the oldest
    go, and the plans stay."""
    from cufa import _jax
    _patch_launchers(monkeypatch, "driver_launch", _real_driver_launch)
    monkeypatch.setattr(_runtime, "_driver", lambda: _Driver())
    monkeypatch.setattr(_jax, "_device_of", lambda ptr: 0)
    monkeypatch.setattr(_jax, "_MAX_REPLAYS", 4)
    spec, ctx = _dense_call(), type("Ctx", (), {"stream": 0x77})
    bufs = [_Buffer(0x1000_0000 * (i + 1), (2, 100, 4, 64)) for i in range(3)]
    for i in range(10):
        _jax.on_device(spec, ctx, [_Buffer(0x9000_0000 + 0x100_0000 * i, (2, 100, 4, 64)),
                                   _scratch()], bufs)
    assert len(_jax.replays) == 4 and len(_runtime.plans) == 1
    assert [k[3][-2][0] for k in _jax.replays] == [0x9000_0000 + 0x100_0000 * i
                                                  for i in range(6, 10)]


_real_driver_launch = _runtime.driver_launch


def _strided(shape, strides, dtype="float16"):
    itemsize = 4 if dtype in ("float32", "int32") else 2
    return _interop.DeviceArray(None, "cupy", next(_addresses), tuple(shape), tuple(strides),
                                dtype, 0, itemsize)


def _last_plan():
    return next(reversed(_runtime.plans.values()))


def _same_plan(a, b):
    fields = dict(a.__dict__)
    other = dict(b.__dict__)
    ta, tb = fields.pop("tma_template"), other.pop("tma_template")
    assert fields == other
    assert (ta is None) == (tb is None)
    if ta is not None:
        assert (ta.record, ta.has_tails, ta.address_words) == (
            tb.record, tb.has_tails, tb.address_words)


def _model_driver(monkeypatch):
    """A fake driver that stores maps as _tma's layout model says (the H100's does): new
    shapes' maps are then written in Python, and moved plans' by _tma.moved_map."""
    def replace(map_address, ptr):
        ctypes.memmove(map_address, ptr.to_bytes(8, "little"), 8)
        return 0

    def encode(map_address, data_type, rank, ptr, dims, byte_strides, box, *rest):
        kind = bytes([data_type, box[1] & 0xFF]) + bytes(range(2, 128))
        ctypes.memmove(map_address, _tma._with_layout(kind, tuple(dims), tuple(byte_strides)),
                       128)
        return replace(map_address, ptr)
    monkeypatch.setattr(_tma, "_encode_fn", lambda: encode)
    monkeypatch.setattr(_tma, "_replace_fn", lambda: replace)
    _clear_tma_caches()


@pytest.mark.parametrize("heads_first", [False, True])
@pytest.mark.parametrize("driver", ["model", "other"])
def test_a_new_size_of_a_planned_layout_gets_the_plan_made_from_scratch(device, heads_first,
                                                                       driver, monkeypatch):
    """Moved plans (_fwd_plan._Mover) equal the plans made by validation and planning, at sizes
    that cross the tile classes (64-, 128- and 192-row tiles; head dims over 256 on the
    column halves' kernel, two CTAs a tile), for padded and packed
    batches, with and without out=, and a (B, H, N, d) storage whose head stride grows;
    with a driver whose maps _tma writes (moved maps written from a layout's pieces), and
    one whose maps it does not (moved through _tma's general path)."""
    import random
    if driver == "model":
        _model_driver(monkeypatch)
    rng = random.Random(5)
    moved_plans = []
    move = _fwd_plan._Mover._moved

    def counted(mover, *args):
        plan = move(mover, *args)
        moved_plans.append(plan is not None)
        if mover.tma:
            written.append(mover.writers is not None)
        return plan
    written = []

    monkeypatch.setattr(_fwd_plan._Mover, "_moved", counted)
    for case in range(60):
        d, h, hk = rng.choice((64, 128, 72, 320)), rng.choice((4, 8)), rng.choice((1, 2, 4))
        causal, dense, with_out = rng.random() < 0.5, rng.random() < 0.6, rng.random() < 0.3
        for n_q, n_k, batch in [(rng.randrange(1, 5000), rng.randrange(1, 5000),
                                 rng.randrange(1, 6)) for _ in range(3)]:
            if dense:
                def arr(n, heads):
                    if heads_first:  # (B, H, N, d) storage seen as (B, N, H, d)
                        return _strided((batch, n, heads, d), (heads * n * d, d, n * d, 1))
                    return view((batch, n, heads, d))
                q, k, v = arr(n_q, h), arr(n_k, hk), arr(n_k, hk)
                out = view(q.shape) if with_out else None

                def call():
                    return cufa.flash_attn_func(q, k, v, causal=causal, out=out)
            else:
                total_q, total_k = n_q * batch, n_k * batch
                q, k, v = view((total_q, h, d)), view((total_k, hk, d)), view((total_k, hk, d))
                cu_q, cu_k = view((batch + 1,), "int32"), view((batch + 1,), "int32")
                out = view(q.shape) if with_out else None

                def call():
                    return cufa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, n_q, n_k,
                                                       causal=causal, out=out)
            call()
            moved = _last_plan()
            _runtime.plans.clear()
            _fwd_plan.layouts.clear()
            call()  # made from scratch
            _same_plan(moved, _last_plan())
    assert written and all(written) == (driver == "model") and any(written) == all(written)
    # most calls moved a plan (the rest: another tile class or (B, H, N, d) storage,
    # whose head stride changes with N: another layout)
    assert sum(moved_plans) > (20 if heads_first else 60), (sum(moved_plans), len(moved_plans))


def test_moved_plans_still_refuse_bad_sizes(device):
    q, k = view((2, 300, 4, 64)), view((2, 300, 4, 64))
    cufa.flash_attn_func(q, k, k)
    with pytest.raises(ValueError, match="k has batch 3 but q has 2"):
        cufa.flash_attn_func(q, view((3, 300, 4, 64)), view((3, 300, 4, 64)))
    with pytest.raises(ValueError, match="v has shape"):
        cufa.flash_attn_func(q, k, view((2, 301, 4, 64)))
    with pytest.raises(ValueError, match="out must have q's shape"):
        cufa.flash_attn_func(q, k, k, out=view((2, 299, 4, 64)))
    empty = view((2, 0, 4, 64))
    assert cufa.flash_attn_func(empty, k, k).startswith("array@")  # planned: nothing to launch


def _planned_again_alike(first, second):
    """second's plan after first's (moved from it, or made): it equals the plan second
    makes from scratch; -> whether it takes the element-wise I/O variant."""
    first()
    second()
    plan = _last_plan()
    _runtime.plans.clear()
    _fwd_plan.layouts.clear()
    second()
    _same_plan(plan, _last_plan())
    return plan.variant.element_io


def test_moved_plans_follow_the_alignment_of_their_sizes(device, monkeypatch):
    """A row stride that is no multiple of 8 is chunk-aligned under one row only, a batch
    stride under one sequence only: a plan moved to sizes that change its arrays'
    alignment is made again, with the variant the alignment asks for (the element-wise
    I/O one, or back to the 16-byte one); a head dim of 59 moves as any layout does. (On
    sm_80 devices: on sm_90 the element-wise plans are the portable family's, which never
    move.)"""
    monkeypatch.setattr(_runtime, "compute_capability", lambda device: "80")
    moves = []
    move = _fwd_plan._Mover._moved
    monkeypatch.setattr(_fwd_plan._Mover, "_moved",
                        lambda mover, *args: moves.append(1) or move(mover, *args))
    kv, cu = view((300, 4, 64)), view((2,), "int32")

    def packed(rows):
        q = _strided((rows, 4, 64), (260, 64, 1))
        return lambda: cufa.flash_attn_varlen_func(q, kv, kv, cu, cu, rows, 300)
    assert _planned_again_alike(packed(1), packed(300))
    assert not _planned_again_alike(packed(300), packed(1))

    def padded(batch, rows, batch_stride, row_stride=256):
        q = _strided((batch, rows, 4, 64), (batch_stride, row_stride, 64, 1))
        k = view((batch, 300, 4, 64))
        return lambda: cufa.flash_attn_func(q, k, k)
    assert _planned_again_alike(padded(1, 1, 260, 260), padded(1, 300, 300 * 260, 260))
    odd_batch = 300 * 256 + 4
    assert _planned_again_alike(padded(1, 300, odd_batch), padded(3, 300, odd_batch))
    assert not _planned_again_alike(padded(3, 300, odd_batch), padded(1, 300, odd_batch))
    assert not moves  # (each of those was made again)

    def odd(batch, rows):
        q, k = view((batch, rows, 4, 59)), view((batch, 2 * rows, 2, 59))
        return lambda: cufa.flash_attn_func(q, k, k, causal=True)
    assert _planned_again_alike(odd(2, 300), odd(3, 100)) and moves


def test_head_groups_of_short_sequences_fit_the_resident_ctas(device):
    """Padded batches: a scheduling group holds at most the heads whose query blocks the
    resident CTAs cover at once (so each head's K/V is read from DRAM once), at least
    _MIN_GROUP_HEADS, and never more than half of L2 holds (_fwd_plan._sizes)."""
    def heads_per_group(n, d, causal=False):
        q = view((16384 // n, n, 2048 // d, d))
        cufa.flash_attn_func(q, q, q, causal=causal)
        plan = _last_plan()
        return int(np.frombuffer(plan.params, dtype=_params.FWD.dtype)[0]["heads_per_group"]), plan
    groups, plan = heads_per_group(512, 128)  # 128-row tiles, one CTA an SM: 4 blocks a head
    assert plan.variant.block_m == 128 and groups == 132 // 4
    groups, plan = heads_per_group(512, 64, causal=True)  # 64-row tiles, two CTAs an SM:
    # 8 blocks a head
    assert plan.variant.block_m == 64 and groups == 2 * 132 // 8
    assert heads_per_group(4096, 128)[0] == _heuristics.MIN_GROUP_HEADS  # 22 blocks a head
    assert heads_per_group(16384, 128)[0] == _heuristics.L2_BUDGET // (16384 * 128 * 4)  # L2 bound


def _padded_tile_order(bh_count, num_m_blocks, heads_per_group, tail_group_head):
    """block_info.cuh's get_tile for padded batches, in Python: (pair, query block) of
    each tile number, in launch order."""
    tail_tiles = tail_group_head * num_m_blocks
    order = []
    for block in range(bh_count * num_m_blocks):
        head0, group_heads, in_group = tail_group_head, bh_count - tail_group_head, block - tail_tiles
        if block < tail_tiles:
            group_tiles = heads_per_group * num_m_blocks
            head0, group_heads = block // group_tiles * heads_per_group, heads_per_group
            in_group = block % group_tiles
        order.append((head0 + in_group % group_heads, num_m_blocks - 1 - in_group // group_heads))
    return order


@pytest.mark.parametrize("heads,m_blocks,group", [(16, 64, 3), (32, 32, 6), (8, 128, 1),
                                                  (512, 4, 44), (7, 5, 7), (1, 1, 1), (5, 3, 2)])
@pytest.mark.parametrize("masked", [False, True])
def test_padded_tiles_each_once_in_groups_with_a_balanced_tail(heads, m_blocks, group, masked):
    """Every (pair, query block) once; each group's tiles heaviest first; the tail group
    starts at a group boundary and, under a mask on a persistent launch, holds at least
    TAIL_BALANCE tiles a CTA (or every head); without a mask it is the last partial group,
    as before the tail rule."""
    resident = 132
    tail = _heuristics.tail_group_head(heads, group, m_blocks, resident, masked=masked)
    order = _padded_tile_order(heads, m_blocks, group, tail)
    assert sorted(order) == [(bh, m) for bh in range(heads) for m in range(m_blocks)]
    assert tail % group == 0 and 0 <= tail <= heads
    if masked:
        assert (heads - tail) * m_blocks >= min(heads * m_blocks,
                                                _heuristics.TAIL_BALANCE * resident)
        assert tail == 0 or (heads - tail - group) * m_blocks < _heuristics.TAIL_BALANCE * resident
    else:
        assert tail == heads // group * group
    starts = list(range(0, tail, group)) + [tail]
    for lo, hi in zip(starts, starts[1:] + [heads]):
        tiles = [m for bh, m in order if lo <= bh < hi]
        assert tiles == sorted(tiles, reverse=True)  # heaviest (last query block) first
        assert order[lo * m_blocks:hi * m_blocks] == [(bh, m) for bh, m in order if lo <= bh < hi]
    assert _heuristics.tail_group_head(heads, group, m_blocks, None, masked=True) == \
        heads // group * group  # not persistent: as before


def test_causal_plan_sets_the_tail_group(device):
    """The plan writes tail_group_head beside heads_per_group: d = 256 causal 8k, 2 x 8
    heads on 128-row tiles: groups of 3 by L2, the tail from pair 9 (7 pairs, 448 tiles
    for 132 CTAs); without the mask the last partial group, from pair 15."""
    q = view((2, 8192, 8, 256))
    fields = []
    for causal in (True, False):
        cufa.flash_attn_func(q, q, q, causal=causal)
        r = np.frombuffer(_last_plan().params, dtype=_params.FWD.dtype)[0]
        fields.append((int(r["heads_per_group"]), int(r["tail_group_head"])))
    assert fields == [(3, 9), (3, 15)]


# -- learnable sink ------------------------------------------------------------------------

def test_sink_presence_and_dtype_are_the_plans_its_address_the_calls(device):
    """A sink's presence and dtype are part of the call signature (a plan each); its
    address is filled in per call, as every array's, and its dtype goes to the kernel
    (no conversion launch)."""
    q, k = view((2, 100, 4, 64)), view((2, 130, 2, 64))
    cufa.flash_attn_func(q, k, k, causal=True)
    r = record(device.launches[-1])
    assert (r["learnable_sink"], r["sink_dtype"]) == (0, 0)
    for dtype, code in (("float32", 0), ("bfloat16", 2), ("float16", 1), ("float32", 0)):
        sink = view((4,), dtype)
        cufa.flash_attn_func(q, k, k, causal=True, learnable_sink=sink)
        r = record(device.launches[-1])
        assert (r["learnable_sink"], r["sink_dtype"]) == (sink.ptr, code)
        assert len(device.launches[-1][2]) == 2  # the record and the TMA maps: nothing else
    assert len(_runtime.plans) == 4 and len(device.launches) == 5
    assert len(device.allocations) == 5  # outputs only: no sink converted on the host


def test_moved_plans_keep_the_sink_and_check_its_shape(device, monkeypatch):
    """A new size of a layout with a sink moves that layout's plan (the sink's dtype kept,
    its address the call's); a layout never takes a plan of another sink (none, another
    dtype or shape), whose checks then run."""
    planned = []
    real_plan = _fwd_plan.plan_dense
    monkeypatch.setattr(_fwd_plan, "plan_dense", lambda *a: planned.append(1) or real_plan(*a))
    sink = view((4,), "bfloat16")
    for n in (100, 300, 1000):
        q = view((2, n, 4, 64))
        cufa.flash_attn_func(q, q, q, learnable_sink=sink)
        r = record(device.launches[-1])
        assert (r["learnable_sink"], r["sink_dtype"], r["seqlen_q"]) == (sink.ptr, 2, n)
    assert len(planned) == 1  # then moved
    q = view((2, 77, 4, 64))
    cufa.flash_attn_func(q, q, q)  # no sink: a layout of its own
    assert record(device.launches[-1])["learnable_sink"] == 0 and len(planned) == 2
    for bad in (view((5,), "bfloat16"), view((3,), "bfloat16")):
        with pytest.raises(ValueError, match=r"learnable_sink must have shape \(4,\)"):
            cufa.flash_attn_func(view((2, 64, 4, 64)), q, q, learnable_sink=bad)
    cu, total = view((3,), "int32"), view((500, 4, 64))
    sink32 = view((4,), "float32")
    for rows in (500, 900):
        x = view((rows, 4, 64))
        cufa.flash_attn_varlen_func(x, x, x, cu, cu, rows, rows, learnable_sink=sink32)
        r = record(device.launches[-1])
        assert (r["learnable_sink"], r["sink_dtype"], r["seqlen_q"]) == (sink32.ptr, 0, rows)
    with pytest.raises(ValueError, match=r"learnable_sink must have shape \(4,\)"):
        cufa.flash_attn_varlen_func(total, total, total, cu, cu, 9, 9,
                                    learnable_sink=view((2,), "float32"))


def test_sink_reaches_every_launch_that_normalizes_a_row(device):
    """The forward's record, the decode kernel's of a paged packed batch (its short
    sequences), the KV-cache decode's (split or not: the merge in the launch or the
    combine reads the same record) and SDPA's."""
    total, h, hk, d, page = 300, 8, 2, 128, 16
    q, cache = view((total, h, d)), view((40, page, hk, d))
    cu, table = view((5,), "int32"), view((4, 10), "int32")
    sink = view((h,), "float16")
    cufa.flash_attn_varlen_func(q, cache, cache, cu, cu, 64, 64, block_table=table,
                                causal=True, learnable_sink=sink)
    schedule, forward, decode = device.launches
    assert record(forward)["learnable_sink"] == sink.ptr
    r = record(decode, _params.DECODE)
    assert (r["learnable_sink"], r["sink_dtype"]) == (sink.ptr, 1)
    qd, lens = view((1, 1, 32, 128)), view((1,), "int32")
    kv = view((1, 32768, 8, 128))
    sink = view((32,), "bfloat16")
    for splits in (1, 4, 16):  # unsplit; merged in the launch; by decode_combine
        done = len(device.launches)
        cufa.flash_attn_with_kvcache(qd, kv, kv, cache_seqlens=lens, num_splits=splits,
                                     learnable_sink=sink)
        for launch in device.launches[done:]:
            r = record(launch, _params.DECODE)
            assert (r["learnable_sink"], r["sink_dtype"], r["num_splits"]) == (sink.ptr, 2,
                                                                              splits)
    assert len(device.launches) - done == 2  # (16 splits: the combine launch too)
    query, key = view((2, 4, 50, 64)), view((2, 2, 70, 64))
    sink = view((4,), "float32")
    cufa.scaled_dot_product_attention(query, key, key, enable_gqa=True, learnable_sink=sink)
    assert record(device.launches[-1])["learnable_sink"] == sink.ptr


def test_jax_callback_traced_without_scratch_is_refused_where_the_launch_needs_some(
        device, monkeypatch):
    """A trace that planned no scratch (another device, or CUFA_KERNEL_FAMILY changed since)
    whose launch needs some is refused: cufa's own per-stream memory in its place would be
    outlived by a command buffer XLA records."""
    from cufa import _jax
    monkeypatch.setattr(_jax, "_device_of", lambda ptr: 0)
    layout = ((2, 100, 4, 64), (25600, 256, 64, 1), "float16", 2)
    spec = _jax.Call("flash_attn_func", ("q", "k", "v"), ("float16",) * 3, ("float16",),
                     dict(softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0),
                     (), (layout,) * 3, (layout,), False)
    bufs = [_Buffer(0x1000_0000 * (i + 1), (2, 100, 4, 64)) for i in range(3)]
    with pytest.raises(RuntimeError, match="has 0 bytes but the launch needs"):
        _jax.on_device(spec, type("Ctx", (), {"stream": 0x77}), [_Buffer(0x9000_0000, (
            2, 100, 4, 64))], bufs)
    assert device.launches == []


@pytest.mark.parametrize("framework, kept", [("cupy", True), ("torch", False)])
def test_memory_taken_under_capture_lives_as_the_graph_does(monkeypatch, framework, kept):
    """Under stream capture a call's counter or workspace is its own. PyTorch takes it from
    the graph's private pool; CuPy's pool knows no graphs and would hand it out again once
    the call dropped it, so cufa holds it."""
    import cupy
    owners = []
    monkeypatch.setattr(_interop, "allocate", lambda *a, **kw: owners.append(object()) or (
        owners[-1], 0x5000))
    monkeypatch.setattr(cupy.cuda.runtime, "memsetAsync", lambda *a: None)
    monkeypatch.setattr(_runtime, "_captured", [])
    owner, ptr = _runtime._stream_buffer({}, framework, 0, 0x99, 8, zeroed=True,
                                         capturing=True)
    assert ptr == 0x5000 and owner is owners[0]
    assert (_runtime._captured == [owner]) is kept


def test_workspace_is_per_thread_on_a_shared_stream(monkeypatch):
    """A call's kernels hand each other its workspace; two threads queueing calls on one
    stream at once would interleave them over one buffer, so each thread gets its own.
    The tile counter, which one kernel leaves zeroed, stays one a stream."""
    import threading
    import cupy
    freed, made = [], iter(range(0x10000, 0x100000, 0x1000))
    monkeypatch.setattr(cupy.cuda.runtime, "malloc", lambda n: next(made))
    monkeypatch.setattr(cupy.cuda.runtime, "free", freed.append)
    monkeypatch.setattr(cupy.cuda.runtime, "memsetAsync", lambda *a: None)
    monkeypatch.setattr(_runtime, "_workspaces", {})
    monkeypatch.setattr(_runtime, "_tile_counters", {})
    monkeypatch.setattr(_runtime, "stream_capturing", lambda stream: False)
    got = {}

    both_alive = threading.Barrier(2)  # (a thread's id is reused once it has ended)

    def call(name):
        got[name] = (_runtime.stream_workspace("cupy", 0, 0x77, 64, capturing=False)[1],
                     _runtime.stream_tile_counter("cupy", 0, 0x77)[1] if name else None)
        if name:
            both_alive.wait(timeout=10)

    threads = [threading.Thread(target=call, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    call("")
    workspaces = {got[n][0] for n in ("a", "b", "")}
    assert len(workspaces) == 3 and not freed
    assert got["a"][1] == got["b"][1]
    assert _runtime.stream_workspace("cupy", 0, 0x77, 64, capturing=False)[1] == got[""][0]


def test_kernel_handle_is_read_on_the_device_it_is_for(monkeypatch):
    """A CuPy RawKernel loads its module for whichever device is current when its `.kernel`
    is read: the handle of a launch on cuda:1 must be read with cuda:1 current, not the
    caller's cuda:0 (which the driver refused as an invalid handle on a two-GPU host)."""
    import cupy
    current = [0]

    class Device:
        def __init__(self, i):
            self.i = i

        def __enter__(self):
            self.was, current[0] = current[0], self.i

        def __exit__(self, *exc):
            current[0] = self.was

    class Function:
        def __init__(self):
            self.ptr = 0xC0DE00 + current[0]

    class RawKernel:
        max_dynamic_shared_size_bytes = preferred_shared_memory_carveout = 0

        @property
        def kernel(self):
            return Function()

    class Module:
        def get_function(self, name):
            return RawKernel()

    monkeypatch.setattr(cupy.cuda, "Device", Device)
    monkeypatch.setattr(_compile, "raw_module", lambda variant: Module())
    monkeypatch.setattr(_compile, "_kernels", {})
    variant = _compile.VARLEN_SCHEDULE
    assert _compile.function_pointer(variant, 1) == 0xC0DE01
    assert _compile.function_pointer(variant, 0) == 0xC0DE00
    assert current[0] == 0
    assert _compile.function_pointer(variant, 1) == 0xC0DE01  # (cached per device)
