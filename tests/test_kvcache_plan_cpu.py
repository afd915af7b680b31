"""CPU: what flash_attn_with_kvcache plans from shapes alone -- split count, kernels and
their grids, the params record, the workspace layout -- with the compile and the device
queries stubbed out, so no GPU is needed."""
import numpy as np
import pytest

import cufa
from cufa import _compile, _decode_plan, _heuristics, _params, _runtime
from cufa._interop import DeviceArray

H100_SMS = 132
H100_PEAK_BYTES_PER_S = 2 * 2619e6 * 5120 / 8   # H100 SXM: 3.35 TB/s
H200_PEAK_BYTES_PER_S = 2 * 3201e6 * 6144 / 8   # H200: 4.9 TB/s


def arr(shape, dtype="float16", strides=None, ptr=0x7f0000000000):
    if strides is None:
        strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    itemsize = {"float16": 2, "bfloat16": 2, "float32": 4, "int32": 4}[dtype]
    return DeviceArray(None, "cupy", ptr, tuple(shape), tuple(strides), dtype, 0, itemsize)


@pytest.fixture
def planner(monkeypatch):
    """Plans without a GPU: kernels get fake handles, the device has 132 SMs."""
    monkeypatch.setattr(_compile, "function_pointer", lambda kernel, device: hash(kernel.key))
    monkeypatch.setattr(_runtime, "sm_count", lambda device: H100_SMS)
    monkeypatch.setattr(_runtime, "smem_per_sm", lambda device: _compile.SM90_SMEM_PER_SM)
    monkeypatch.setattr(_runtime, "compute_capability", lambda device: "90")
    monkeypatch.setattr(_heuristics, "tma_device", lambda device, forced=None: False)
    monkeypatch.setattr(_heuristics, "_keeps_up", {})
    monkeypatch.setattr(_runtime, "peak_bytes_per_s", lambda device: H100_PEAK_BYTES_PER_S)
    _runtime.plans.clear()
    captured = []
    monkeypatch.setattr(_decode_plan, "_run", lambda plan, *a: captured.append(plan) or plan)

    def plan(*args, **kw):
        cufa.flash_attn_with_kvcache(*args, **kw)
        return captured[-1]
    yield plan
    _runtime.plans.clear()


def record(plan):
    return np.frombuffer(plan.params, dtype=_params.DECODE.dtype)[0]


@pytest.mark.parametrize("batch, keys, heads_k, d, expected", [
    (1, 32768, 8, 128, 16),     # 8 units on 132 SMs: one CTA an SM, 8 x 16 = 128
    (1, 131072, 8, 128, 16),
    (8, 16384, 8, 128, 2),      # 64 units: 128 CTAs
    (12, 16384, 8, 128, 4),     # 96 units: 73 % of the SMs at one an SM -> the slots' fill
    (30, 16384, 4, 128, 1),     # 120 units: 91 % of the SMs, unsplit
    (64, 4096, 8, 128, 1),      # 512 units: one wave of the four-CTA shape, unsplit
    (64, 4096, 8, 256, 3),      # 512 units, d = 256 (no four-CTA shape): 3 splits, 3.9 waves
    (8, 16384, 32, 64, 1),      # 256 units: one wave of the 396 slots unsplit
    (128, 2048, 8, 128, 1),     # 1024 CTAs: over two waves already
    (256, 1024, 32, 64, 1),
    (1, 32768, 32, 64, 4),      # 32 units: 128 CTAs
    (1, 512, 8, 128, 2),        # few keys: at least 256 a split
])
def test_split_count_fills_the_sms(planner, batch, keys, heads_k, d, expected):
    q = arr((batch, 1, 32, d))
    cache = arr((batch, keys, heads_k, d))
    plan = planner(q, cache, cache, cache_seqlens=arr((batch,), "int32"))
    rec = record(plan)
    assert rec["num_splits"] == expected
    kinds = [entry[0] for entry in plan.launches]
    assert kinds == (["decode", "combine"] if expected > 1 else ["decode"])
    if expected > 1:  # a CTA a query row, or (few splits) a warp a row
        per_cta = _heuristics.combine_kernel("fp16", d, expected).rows
        assert plan.launches[1][2] == (-(-batch * 32 // per_cta), 1, 1)
    assert plan.scratch_bytes == 4 * plan.workspace[0]
    grid = plan.launches[0][2]
    assert grid == (rec["num_m_blocks"] * expected, heads_k, batch)
    slots = H100_SMS * _compile.decode_kernel("fp16", d).ctas_per_sm
    one_wave = batch * heads_k * expected <= slots
    assert expected & (expected - 1) == 0 or not one_wave  # one wave: a power of two
    # an sm_86 / sm_89 GPU (100 KB an SM) holds one CTA an SM: fewer splits (10 -> 8)
    assert _heuristics.choose_num_splits(8, keys, 84, _compile.decode_kernel("fp16", d).ctas_per_sm_on(
        100 * 1024)) == min(8, 1 << (max(1, keys // 256).bit_length() - 1)) or expected == 1


@pytest.mark.parametrize("units, ctas_per_sm, expected", [
    (16, 2, 16),   # d = 512's two CTAs a unit, 8 KV heads, Hopper's shape: 15 fill 91 % (was 8)
    (24, 3, 16),   # 15 fill 91 % of 396 slots, 16 still one wave (was 8)
    (8, 3, 32),    # 45 fill 91 %; 64 would make two waves
    (100, 3, 11),  # over one wave: the fewest splits whose waves fill 90 % (2.8 of 3)
])
def test_one_wave_of_splits_takes_the_largest_power_of_two_that_fits(units, ctas_per_sm,
                                                                    expected):
    """Where the splits' CTAs make one wave (no one-CTA-an-SM rule: an H200's bandwidth),
    the largest power of two of splits that still fits the slots."""
    got = _heuristics.choose_num_splits(units, 131072, H100_SMS, ctas_per_sm, one_per_sm=False)
    assert got == expected


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("batch, heads_k, seqlen_q, wider", [
    (64, 8, 1, True),     # 512 units: split 3 ways on 396 slots, one wave on 528
    (64, 8, 4, True),     # 4 tokens x 4 heads a KV head: still one 16-row block
    (60, 8, 1, True),     # 480: fills 91 % of the 528
    (48, 8, 1, False),    # 384: one wave of the default shape already
    (32, 32, 1, True),    # 1024: over two waves of the 396 slots, under two of the 528
    (26, 32, 1, True),    # 832
    (24, 32, 1, False),   # 768: two waves of the default shape
    (34, 32, 1, False),   # 1088: over two waves of the 528 too
    (64, 32, 1, False),   # 2048: several waves either way
    (1, 8, 1, False),     # batch 1: split either way
])
def test_the_four_cta_shape_where_it_runs_unsplit(planner, d, batch, heads_k, seqlen_q, wider):
    q = arr((batch, seqlen_q, 32, d))
    cache = arr((batch, 4096, heads_k, d))
    plan = planner(q, cache, cache, cache_seqlens=arr((batch,), "int32"))
    decode = [entry for entry in plan.launches if entry[0] == "decode"][0]
    more = _compile.decode_kernel_with_more_ctas("fp16", d)
    assert more.ctas_per_sm == 4 and _compile.decode_kernel("fp16", d).ctas_per_sm == 3
    assert decode[3] == more.threads if wider else decode[3] == 128
    assert (decode[4] == more.smem_bytes) == wider
    if wider:
        assert record(plan)["num_splits"] == 1
        assert [entry[0] for entry in plan.launches] == ["decode"]
    # an explicit split count keeps the default shape
    plan = planner(q, cache, cache, cache_seqlens=arr((batch,), "int32"), num_splits=2)
    assert [e for e in plan.launches if e[0] == "decode"][0][4] != more.smem_bytes


def test_num_splits_argument_is_obeyed_up_to_its_most(planner):
    q, cache = arr((2, 1, 8, 64)), arr((2, 4096, 8, 64))
    assert record(planner(q, cache, cache, num_splits=1))["num_splits"] == 1
    assert record(planner(q, cache, cache, num_splits=7))["num_splits"] == 7
    most = _compile.MAX_SPLITS
    assert record(planner(q, cache, cache, num_splits=most))["num_splits"] == most
    for n in (most + 1, 1000, np.int64(2 ** 40)):  # (once capped, silently)
        with pytest.raises(ValueError, match=f"num_splits must be an int from 0 to {most}"):
            planner(q, cache, cache, num_splits=n)


def test_gqa_rows_and_query_blocks(planner):
    # 4 tokens x group 4 = 16 rows: one block; 37 tokens x 4 = 148 rows: 10 blocks
    for seqlen_q, blocks in ((1, 1), (4, 1), (37, 10)):
        rec = record(planner(arr((3, seqlen_q, 32, 128)), arr((3, 256, 8, 128)),
                             arr((3, 256, 8, 128)), num_splits=1))
        assert (rec["group"], rec["num_m_blocks"]) == (4, blocks)
    rec = record(planner(arr((3, 1, 8, 128)), arr((3, 256, 8, 128)), arr((3, 256, 8, 128))))
    assert (rec["group"], rec["num_m_blocks"]) == (1, 1)


def test_paged_cache_params(planner):
    pages = arr((50, 16, 2, 64))
    table = arr((3, 7), "int32")
    rec = record(planner(arr((3, 1, 4, 64)), pages, pages, block_table=table,
                         cache_seqlens=arr((3,), "int32")))
    assert rec["page_shift"] == 4 and rec["max_pages"] == 7 and rec["capacity"] == 7 * 16
    assert rec["cache_rows"] == 50 and rec["block_table_batch_stride"] == 7
    assert (rec["k_batch_stride"], rec["k_row_stride"], rec["k_head_stride"]) == (
        16 * 2 * 64, 2 * 64, 64)


@pytest.mark.parametrize("heads_k, contiguous, paged", [(8, 16, 32), (32, 4, 8)])
def test_paged_caches_split_to_fill_the_slots_not_one_cta_an_sm(planner, heads_k, contiguous,
                                                               paged):
    # 1 x 128k keys: a contiguous cache one CTA an SM (8 x 16 or 32 x 4 = 128 CTAs), pages
    # (a lookup a row) the slots' fill, as before (measured 1.3-1.5x slower otherwise)
    q, lens = arr((1, 1, 32, 64)), arr((1,), "int32")
    cache = arr((1, 131072, heads_k, 64))
    assert record(planner(q, cache, cache, cache_seqlens=lens))["num_splits"] == contiguous
    pages, table = arr((8192, 16, heads_k, 64)), arr((1, 8192), "int32")
    assert record(planner(q, pages, pages, block_table=table,
                          cache_seqlens=lens))["num_splits"] == paged


@pytest.mark.parametrize("heads_k, one_per_sm", [(8, 16), (32, 4)])
def test_pages_of_256_read_whole_take_the_contiguous_rule(planner, heads_k, one_per_sm):
    # 1 x 128k keys: tiles inside one page read as contiguous ones, so pages of 256 get one
    # CTA an SM as a contiguous cache does; not with a leftpad or a left window (tiles
    # off a page's row 0), nor pages of 16 (slower so on an H100)
    q, lens = arr((1, 1, 32, 64)), arr((1,), "int32")

    def splits(page, **kw):
        pages, table = arr((131072 // page, page, heads_k, 64)), arr((1, 131072 // page), "int32")
        return record(planner(q, pages, pages, block_table=table, cache_seqlens=lens,
                              **kw))["num_splits"]

    assert splits(256) == one_per_sm
    slot_fill = splits(16)
    assert slot_fill != one_per_sm
    assert splits(256, cache_leftpad=arr((1,), "int32")) == slot_fill
    assert splits(256, window_size=(4096, 0)) == slot_fill
    assert splits(256, window_size=(-1, 0)) == one_per_sm  # a right bound keeps row 0


@pytest.mark.parametrize("heads_k, one_per_sm, slot_fill", [(8, 16, 32), (32, 4, 8)])
def test_one_cta_an_sm_only_where_it_keeps_up_with_the_memory(planner, monkeypatch, heads_k,
                                                              one_per_sm, slot_fill):
    """A contiguous batch-1 cache takes one CTA an SM on an H100's bandwidth an SM, the
    slot-fill split on an H200's (one CTA an SM read 20-35 % slower there); a device
    whose memory clock the driver does not give keeps the H100's rule."""
    q, cache = arr((1, 1, 32, 128)), arr((1, 131072, heads_k, 128))
    lens = arr((1,), "int32")

    def splits(peak):
        monkeypatch.setattr(_heuristics, "_keeps_up", {})
        monkeypatch.setattr(_runtime, "peak_bytes_per_s", lambda device: peak)
        _runtime.plans.clear()
        return record(planner(q, cache, cache, cache_seqlens=lens))["num_splits"]
    assert splits(H100_PEAK_BYTES_PER_S) == one_per_sm
    assert splits(H200_PEAK_BYTES_PER_S) == slot_fill
    assert splits(None) == one_per_sm


def test_split_ctas_one_an_sm_take_the_default_kernel(planner):
    """1 x 32k, 8 KV heads, d = 64: 16 splits, a CTA an SM, on the default shape (its
    four stages a warp), contiguous or on pages of 256 read whole."""
    lens, default = arr((1,), "int32"), _compile.decode_kernel("fp16", 64)
    q, cache = arr((1, 1, 32, 64)), arr((1, 32768, 8, 64))
    pages, table = arr((128, 256, 8, 64)), arr((1, 128), "int32")
    for k, kw in ((cache, {}), (pages, {"block_table": table})):
        plan = planner(q, k, k, cache_seqlens=lens, **kw)
        _, _, grid, threads, smem = [e for e in plan.launches if e[0] == "decode"][0]
        assert (record(plan)["num_splits"], grid, threads, smem) == (
            16, (16, 8, 1), default.threads, default.smem_bytes)


def test_units_that_fit_the_cta_slots_run_unsplit_paged_or_not(planner):
    # 8 x 16k, 32 KV heads, d = 64: 256 units over 132 SMs x 3 slots. Paged caches split
    # them 3 ways before (1.9 waves), 5 % slower than unsplit on an H100
    q, lens = arr((8, 1, 32, 64)), arr((8,), "int32")
    cache = arr((8, 16384, 32, 64))
    assert record(planner(q, cache, cache, cache_seqlens=lens))["num_splits"] == 1
    pages, table = arr((8192, 16, 32, 64)), arr((8, 1024), "int32")
    assert record(planner(q, pages, pages, block_table=table,
                          cache_seqlens=lens))["num_splits"] == 1


def test_append_and_rotary_plan_the_append_kernel_and_a_rotated_q(planner):
    b, sq, h, hk, d = 2, 3, 8, 2, 128
    q, cache = arr((b, sq, h, d)), arr((b, 300, hk, d))
    new = arr((b, 2, hk, d))
    cos = arr((300, 32))
    plan = planner(q, cache, arr(cache.shape, ptr=0x7f4000000000), new, new, rotary_cos=cos,
                   rotary_sin=cos,
                   cache_seqlens=arr((b,), "int32"), causal=True, num_splits=3)
    assert [e[0] for e in plan.launches] == ["append", "decode", "combine"]
    rows = b * 2 * hk + b * sq * h
    assert plan.launches[0][2] == (-(-rows // 4), 1, 1)
    rec = record(plan)
    assert rec["rotary_dim"] == 64 and rec["rotary_q_per_token"] == 1
    assert (rec["lse_batch_stride"], rec["lse_head_stride"]) == (h * sq, sq)  # (b, h, sq)
    assert rec["cu_seqlens_q"] == 0  # not a packed batch
    assert rec["seqlen_new"] == 2 and plan.rotary
    # q is read from the rotated copy: contiguous strides, while q_source keeps the caller's
    assert (rec["q_batch_stride"], rec["q_row_stride"], rec["q_head_stride"]) == (
        sq * h * d, h * d, d)
    total, o_part, lse_part, q_rot = plan.workspace
    assert min(o_part, lse_part, q_rot) >= 0
    for offset in (o_part, lse_part, q_rot):  # 256-byte aligned parts
        assert offset % 64 == 0
    assert o_part + 3 * b * sq * h * d <= lse_part and lse_part + 3 * b * sq * h <= q_rot
    assert q_rot + b * sq * h * d // 2 <= total


def test_no_rotary_no_split_needs_no_workspace(planner):
    plan = planner(arr((128, 1, 32, 128)), arr((128, 4096, 8, 128)), arr((128, 4096, 8, 128)))
    assert plan.workspace[0] == 0 and not plan.rotary


def test_decode_kernel_shared_memory_fits_the_stated_ctas():
    for v in _compile.decode_variants():
        if v.kind == "decode":
            assert v.ctas_per_sm * (v.smem_bytes + 1024 + 640) <= _compile.SM90_SMEM_PER_SM, v.key
            # what sm_86 / sm_89 grant a CTA, unless the variant is Hopper's alone
            assert v.smem_bytes <= 99 * 1024 or v.archs == ("sm_90",), v.key
            assert v.ctas_per_sm_on(100 * 1024) >= 1
    assert [_compile.decode_kernel("fp16", d).ctas_per_sm for d in (64, 128, 256)] == [3, 3, 3]
    assert _compile.decode_kernel("fp16", 256).threads == 64


def test_variant_keys_are_readable_and_unique():
    keys = [v.key for v in _compile.decode_variants()]
    assert len(set(keys)) == len(keys)
    assert "decode_bf16_hd128_s2" in keys and "decode_fp16_hd64_s3" in keys
    assert "decode_fp16_hd128_s3_w2" in keys
    assert "decode_append_bf16" in keys and "merge_fp32" in keys
    assert _compile.DecodeVariant("bf16", 64).name_expression == \
        "cufa::decode_kernel<1, 64, 4, 4>"


def test_decode_pointer_order_is_the_records():
    # _decode_plan._run packs the pointers positionally, in this order
    assert _params.DECODE.pointer_fields == (
        "q", "k", "v", "o", "lse", "o_partial", "lse_partial",
        "cache_seqlens", "cache_batch_idx", "cache_leftpad", "block_table", "alibi_slopes",
        "k_new", "v_new", "q_source", "rotary_cos", "rotary_sin", "cu_seqlens_q", "cu_seqlens_k",
        "seqused_k", "split_counters", "decode_order", "learnable_sink", "k_descale",
        "v_descale", "qv")


@pytest.mark.parametrize("d, splits, rows", [
    (64, 2, 4), (64, 16, 4), (64, 17, 1), (128, 8, 4), (128, 9, 1), (256, 4, 4), (256, 5, 1),
    (96, 8, 4), (96, 9, 1),   # 12 lanes a split: two splits a warp at once
    (32, 32, 4), (16, 32, 4), (16, 33, 1), (8, 64, 1),  # and a lane a split's lse
])
def test_combine_takes_a_warp_a_row_while_one_round_of_reads_covers_the_splits(d, splits, rows):
    # a lane reads 8 columns; a warp's lanes hold 32 // (d / 8) splits at once, 4 reads
    # each, and a lane holds one split's lse
    kernel = _heuristics.combine_kernel("bf16", d, splits)
    assert kernel.rows == rows
    assert kernel.key == f"decode_combine_r{rows}_bf16"
    assert kernel.name_expression == f"cufa::decode_combine<1, {rows}>"


@pytest.mark.parametrize("d, splits, may_slice, sliced", [
    (512, 128, True, True),    # 2 groups x 4 = 8 splits a round: 16 rounds whole, 4 sliced
    (512, 17, True, True),     # three rounds whole
    (512, 16, True, False),    # two rounds: whole
    (256, 33, True, True),     # 4 groups x 4 = 16 a round
    (256, 32, True, False),
    (128, 128, True, False),   # a slice would be the whole row
    (512, 128, False, False),  # the decode launch merges too: the whole row's order
])
def test_combine_slices_wide_rows_over_many_splits(d, splits, may_slice, sliced):
    kernel = _heuristics.combine_kernel("bf16", d, splits, may_slice=may_slice)
    assert kernel.rows == 1 and kernel.slice_cols == (_compile.COMBINE_SLICE_COLS if sliced else 0)
    assert kernel.slices(d) == (-(-d // 128) if sliced else 1)
    assert kernel in set(_compile.all_variants())
    if sliced:
        assert kernel.key == "decode_combine_r1_bf16_c128"
        assert kernel.name_expression == "cufa::decode_combine<1, 1, false, 128>"


def test_split_decode_without_a_merge_in_launch_slices_its_combine(planner):
    """d = 512 over one KV head of 32 query heads (rows a unit past one decode CTA's reach:
    no merge in the decode launch), one sequence of 64k keys: many splits, a sliced
    combine, 4 CTAs a row; MQA with one query head a KV head merges in the launch and
    keeps whole rows."""
    lens = arr((1,), "int32")
    plan = planner(arr((1, 1, 32, 512)), arr((1, 65536, 1, 512)), arr((1, 65536, 1, 512)),
                   cache_seqlens=lens)
    assert not plan.merge_in_launch and [e[0] for e in plan.launches] == ["decode", "combine"]
    splits = record(plan)["num_splits"]
    combine = _heuristics.combine_kernel("fp16", 512, splits, may_slice=True)
    assert combine.slice_cols and plan.launches[1][2] == (32, 4, 1)
    plan = planner(arr((1, 1, 1, 512)), arr((1, 65536, 1, 512)), arr((1, 65536, 1, 512)),
                   cache_seqlens=lens)
    if plan.merge_in_launch:
        assert plan.launches[1][2][1] == 1


@pytest.mark.parametrize("case, pairs", [
    (dict(), True),                                        # 32/8, one token: 4 rows a head
    (dict(peak=H100_PEAK_BYTES_PER_S), False),              # one CTA an SM keeps up there
    (dict(tokens=4), False),                               # 16 rows a head: over half a tile
    (dict(heads_k=7, heads=28), False),                    # an odd count of KV heads
    (dict(d=128), False),
    (dict(head_major=True), False),                        # heads not side by side
    (dict(tma="1"), False),                                # the TMA kernel forced
    (dict(tma="0"), True),
    (dict(dtype="bfloat16", heads=8, heads_k=8), True),    # MHA: one row a head
    (dict(paged=16), True),
    (dict(batch=1, keys=32768), False),                    # split: 8 rows a pair, two passes
    (dict(batch=1, keys=32768, heads=32, heads_k=32), True),  # split: 2 rows a pair, one pass
])
def test_16bit_cache_takes_head_pairs_where_one_cta_does_not_keep_up(
        planner, monkeypatch, case, pairs):
    """A 16-bit cache at d = 64 runs two adjacent KV heads a CTA (_heuristics.head_pairs)
    where one decode CTA an SM does not keep up with the memory (an H200): d = 128's
    kernel with the pairs flag, half the grid's y, the split rule over half the units;
    but not where a split call's merge would leave the decode launch."""
    d, tokens = case.get("d", 64), case.get("tokens", 1)
    heads, heads_k = case.get("heads", 32), case.get("heads_k", 8)
    batch, keys = case.get("batch", 64), case.get("keys", 4096)
    dtype, page = case.get("dtype", "float16"), case.get("paged")
    monkeypatch.setattr(_runtime, "peak_bytes_per_s",
                        lambda device: case.get("peak", H200_PEAK_BYTES_PER_S))
    if "tma" in case:
        monkeypatch.setenv(_compile.DECODE_TMA_ENV, case["tma"])
    cufa.api.clear_plans()
    try:
        if case.get("head_major"):
            shape, strides = (batch, keys, heads_k, d), (keys * heads_k * d, d, keys * d, 1)
            kc = vc = arr(shape, dtype, strides)
        elif page:
            kc = vc = arr((batch * keys // page, page, heads_k, d), dtype)
        else:
            kc = vc = arr((batch, keys, heads_k, d), dtype)
        kw = dict(cache_seqlens=arr((batch,), "int32"))
        if page:
            kw["block_table"] = arr((batch, keys // page), "int32")
        plan = planner(arr((batch, tokens, heads, d), dtype), kc, vc, **kw)
    finally:
        monkeypatch.delenv(_compile.DECODE_TMA_ENV, raising=False)
        cufa.api.clear_plans()
    (kind, pointer, grid, threads, smem), = [e for e in plan.launches if e[0] == "decode"]
    kernel = {hash(v.key): v for v in _compile.decode_variants()
              if isinstance(v, _compile.DecodeVariant)}[pointer]
    assert kernel.head_pairs == pairs
    assert grid[1] == (heads_k // 2 if pairs else heads_k)
    if pairs:
        assert kernel.head_dim == 128 and not kernel.fp8_cache and threads == kernel.threads
    assert _heuristics.pairs_keep_the_merge(kernel, d, int(record(plan)["num_splits"]),
                                            tokens * heads // heads_k) or not pairs
