"""CPU: head dims above 256, up to 512 (Gemma 4's global layers), in flash_attn_func,
flash_attn_varlen_func and flash_attn_with_kvcache -- the variants (the forward kernels,
Hopper's and the sm80 family's, on Q and K padded to 512, the decode kernel on 512; V's and
O's columns in two halves, two CTAs a tile), what the planners launch, and every call that
does not take them, refused with the argument named."""
import pytest

import cufa
from cufa import _compile, _heuristics, _params, _runtime
from test_fp8_varlen_cpu import view
from test_launch_path_cpu import device, record  # noqa: F401  (the fixture)


def test_the_variant_pads_to_512_and_splits_v_in_halves():
    for d in (257, 320, 512):
        v = _compile.fwd_variant("bf16", d, "window", True, "sm80")
        assert (v.family, v.head_dim, v.head_dim_v, v.ctas_per_tile) == ("sm80", 512, 256, 2)
        assert (v.block_m, v.block_n) == _compile.WIDE_TILES == (64, 32)
        assert v.smem_bytes == (64 * 512 + 32 * (512 + 256)) * 2
        portable = _compile.fwd_variant("bf16", d, "window", True, "sm80",
                                        wide_tiles=_compile.WIDE_TILES_PORTABLE)
        assert portable.smem_bytes == (64 * 512 + 16 * (512 + 256)) * 2 <= 99 * 1024
        # Hopper's: 128-row tiles, one Q, K and V stage (V's half) filling the SM
        h = _compile.fwd_variant("bf16", d, "window", True, "sm90")
        assert (h.family, h.head_dim, h.head_dim_v, h.ctas_per_tile) == ("sm90", 512, 256, 2)
        assert (h.block_m, h.block_n, h.q_stages, h.kv_stages) == (128, 64, 1, 1)
        assert h.smem_limit >= h.smem_bytes > (128 * 512 + 64 * (512 + 256)) * 2
        assert h.name_expression.endswith(", 1, 1, false, false, 256>")
    assert _compile.fwd_variant("fp16", 256, "none", False).ctas_per_tile == 1
    with pytest.raises(ValueError, match="head dim 300 .over 256. takes 16-bit k and v"):
        _compile.fwd_variant("fp16", 300, "none", False, e4m3_kv=True)
    keys = {x.key for x in _compile.all_variants()}
    assert {f"fwd_sm80_{dt}_hd512_bm64_bn{n}_{m}{mods}_dv256" for dt in ("fp16", "bf16")
            for m in ("none", "window") for mods in ("", "_mods") for n in (16, 32)} <= keys
    assert {f"fwd_sm90_{dt}_hd512_bm128_bn64_{m}{mods}_dv256" for dt in ("fp16", "bf16")
            for m in ("none", "window") for mods in ("", "_mods")} <= keys


def on_sm80(monkeypatch):
    """The planners on an sm_80 GPU (the device fixture's is Hopper)."""
    monkeypatch.setattr(_runtime, "compute_capability", lambda device: "80")


@pytest.mark.parametrize("family", ["sm90", "sm80"])
@pytest.mark.parametrize("d", [320, 512])
def test_dense_calls_launch_two_ctas_a_tile(device, monkeypatch, d, family):  # noqa: F811
    if family == "sm80":
        on_sm80(monkeypatch)
    q, k, v = view((2, 100, 8, d)), view((2, 300, 2, d)), view((2, 300, 2, d))
    out = cufa.flash_attn_func(q, k, v, causal=True)
    (launch,) = device.launches
    r = record(launch)
    assert (r["head_dim"], r["head_dim_v"], r["v_row_stride"]) == (d, d, 2 * d)
    # batch x heads x query tiles, twice (Hopper's: no more than its CTAs on the SMs)
    rows = 64 if family == "sm80" else 128
    assert launch[1] == 2 * 2 * 8 * -(-100 // rows)
    assert device.allocations[0] == ((2, 100, 8, d), "float16")
    assert r["o"] == int(out.split("@")[1], 16)
    plan = next(p for p in _runtime.plans.values() if getattr(p, "variant", None) is not None)
    assert (plan.variant.family, plan.variant.head_dim, plan.variant.head_dim_v) == (
        family, 512, 256)
    assert (plan.tma_template is not None) == (family == "sm90")


@pytest.mark.parametrize("family", ["sm90", "sm80"])
def test_packed_and_paged_calls_launch_two_ctas_a_tile(device, monkeypatch, family):  # noqa: F811
    if family == "sm80":
        on_sm80(monkeypatch)
    rows = 64 if family == "sm80" else 128
    q, k, v = view((150, 8, 384)), view((400, 2, 384)), view((400, 2, 384))
    cu = view((4,), "int32")
    cufa.flash_attn_varlen_func(q, k, v, cu, cu, 64, 64)
    schedule, forward = device.launches
    assert forward[1] == 2 * 8 * (150 // rows + 3)
    assert record(forward)["head_dim_v"] == 384
    device.launches.clear()
    cache, table = view((40, 16, 2, 384)), view((3, 10), "int32")
    cufa.flash_attn_varlen_func(q, cache, cache, cu, cu, 64, 160, block_table=table)
    # the forward takes the longer sequences, the decode kernel (two CTAs a unit) the short
    schedule, forward, decode, *combine = device.launches
    r = record(forward)
    assert forward[1] == 2 * 8 * (150 // rows + 3) and r["page_shift"] == 4
    rd = record(decode, _params.DECODE)
    assert (rd["head_dim"], rd["seqlen_q"], rd["split_counters"]) == (384, 4, 0)
    assert tuple(decode[1]) == (2 * int(rd["num_m_blocks"]) * int(rd["num_splits"]), 2, 3)
    assert len(combine) == (int(rd["num_splits"]) > 1)


@pytest.mark.parametrize("spec, smem, keys", [
    (None, 227 * 1024, 32), (None, 112 * 1024, 32), (None, 112 * 1024 - 1, 16),
    (None, 99 * 1024, 16), ("64x16", 227 * 1024, 16), ("64x32", 112 * 1024, 32),
    ("64x64", 227 * 1024, 64)])
def test_wide_tiles_from_the_environment_or_the_gpu(device, monkeypatch, spec, smem, keys):  # noqa: F811
    """The sm80 family's planner: 32-key blocks where a block's shared memory holds them,
    else 16; CUFA_WIDE_TILES's where it asks."""
    on_sm80(monkeypatch)
    monkeypatch.setitem(_compile._overrides, _compile.WIDE_TILES_ENV, spec)
    monkeypatch.setattr(_runtime, "smem_per_block", lambda device: smem)
    q, k, v = view((1, 70, 4, 320)), view((1, 90, 4, 320)), view((1, 90, 4, 320))
    cufa.flash_attn_func(q, k, v)
    plan = next(p for p in _runtime.plans.values() if getattr(p, "variant", None) is not None
                and p.variant.head_dim == 512)
    assert (plan.variant.block_m, plan.variant.block_n) == (64, keys)
    assert plan.variant.smem_bytes == (64 * 512 + keys * (512 + 256)) * 2


@pytest.mark.parametrize("spec", ["64x128", "128x16", "64"])
def test_wide_tiles_that_do_not_exist_are_refused(monkeypatch, spec):
    monkeypatch.setitem(_compile._overrides, _compile.WIDE_TILES_ENV, spec)
    with pytest.raises(ValueError, match="CUFA_WIDE_TILES takes '64xN' with N in"):
        _compile.wide_tiles()


def test_wide_tiles_over_the_gpus_shared_memory_are_refused(device, monkeypatch):  # noqa: F811
    on_sm80(monkeypatch)
    monkeypatch.setitem(_compile._overrides, _compile.WIDE_TILES_ENV, "64x64")
    monkeypatch.setattr(_runtime, "smem_per_block", lambda device: 99 * 1024)
    q, k, v = view((1, 70, 4, 320)), view((1, 90, 4, 320)), view((1, 90, 4, 320))
    with pytest.raises(ValueError, match="CUFA_WIDE_TILES=64x64: the tiles take 163840 bytes"):
        cufa.flash_attn_func(q, k, v)
    assert not device.launches


def test_the_decode_variant_halves_v_and_fits_every_gpu():
    for d in (264, 512):
        v = _compile.decode_kernel("bf16", d)
        assert (v.head_dim, v.shape, v.threads, v.ctas_per_unit) == (512, (1, 2), 32, 2)
        assert v.smem_bytes == 16 * 512 * 2 + 2 * 16 * (512 + 256) * 2 <= 99 * 1024
        assert v.archs == ("sm_80", "sm_90")
        # Hopper's: two warps of two stages, over sm_86/89's 99 KB, compiled for sm_90 alone
        h = _compile.decode_kernel("bf16", d, family="sm90")
        assert (h.head_dim, h.shape, h.threads, h.ctas_per_unit) == (512, (2, 2), 64, 2)
        assert h.smem_bytes == 16 * 512 * 2 + 2 * 2 * 16 * (512 + 256) * 2 > 99 * 1024
        assert h.archs == ("sm_90",)
    assert _compile.decode_kernel("bf16", 128, family="sm90") == _compile.decode_kernel("bf16", 128)
    assert _compile.decode_kernel("fp16", 256).ctas_per_unit == 1
    keys = {x.key for x in _compile.all_variants()}
    assert {f"decode_{dt}_hd512_s2{w}" for dt in ("fp16", "bf16") for w in ("", "_w2")} <= keys


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_calls_launch_two_ctas_a_unit(device, paged):  # noqa: F811
    """One token of 8 query heads over 2 KV heads, 4 new keys appended: the append, then the
    decode kernel's grid x doubled (two halves of V a unit) with its splits, merged by
    decode_combine (never in the launch), lse from the merge."""
    d, batch = 320, 2
    q, k_new, v_new = view((batch, 1, 8, d)), view((batch, 4, 2, d)), view((batch, 4, 2, d))
    lens = view((batch,), "int32")
    if paged:
        cache, table = view((64, 16, 2, d)), view((batch, 32), "int32")
        kw = dict(block_table=table)
    else:
        cache, kw = view((batch, 512, 2, d)), {}
    v_cache = view(cache.shape)
    out, lse = cufa.flash_attn_with_kvcache(q, cache, v_cache, k_new, v_new, cache_seqlens=lens,
                                            causal=True, return_softmax_lse=True, **kw)
    append, decode, *combine = device.launches
    r = record(decode, _params.DECODE)
    splits = int(r["num_splits"])
    assert (r["head_dim"], r["num_m_blocks"], r["split_counters"]) == (d, 1, 0)
    assert tuple(decode[1]) == (2 * splits, 2, batch)
    assert splits > 1 and len(combine) == 1  # (4 units, 8 CTAs: split to fill 132 SMs)
    assert record(combine[0], _params.DECODE)["lse"] == int(lse.split("@")[1], 16)
    assert record(append, _params.DECODE)["k_new"] == k_new.ptr


@pytest.mark.parametrize("case, error, words", [
    ("over 512", ValueError, ["q has head dim 520", "1 to 512"]),
    ("fp8 kvcache", ValueError, ["head dim 320", "1 to 256 here",
                                 "up to 512 with 16-bit k and v in flash_attn_func, "
                                 "flash_attn_varlen_func and flash_attn_with_kvcache"]),
    ("unaligned kvcache", NotImplementedError, ["head dim 320 (over 256) needs",
                                                "16-byte aligned"]),
    ("sdpa", ValueError, ["query has head dim 320", "1 to 256"]),
    ("odd head dim", NotImplementedError, ["head dim 300 (over 256) needs a head dim that is "
                                           "a multiple of 8"]),
    ("unaligned", NotImplementedError, ["head dim 320 (over 256) needs", "16-byte aligned"]),
    ("backward", NotImplementedError, ["the backward takes head dims up to 256; got 320"]),
])
def test_calls_it_does_not_take(device, case, error, words):  # noqa: F811
    q, k, v = view((2, 10, 4, 320)), view((2, 20, 2, 320)), view((2, 20, 2, 320))
    call = (lambda: cufa.flash_attn_func(q, k, v))
    if case == "over 512":
        q, k, v = view((2, 10, 4, 520)), view((2, 20, 2, 520)), view((2, 20, 2, 520))
    elif case == "fp8 kvcache":
        k, v = view((2, 20, 2, 320), "float8_e4m3fn"), view((2, 20, 2, 320), "float8_e4m3fn")
        call = (lambda: cufa.flash_attn_with_kvcache(q, k, v))
    elif case == "unaligned kvcache":
        k = k.__class__(None, "cupy", k.ptr + 2, k.shape, k.strides, k.dtype, 0, 2)
        call = (lambda: cufa.flash_attn_with_kvcache(q, k, v))
    elif case == "sdpa":
        q, k, v = view((2, 4, 10, 320)), view((2, 4, 20, 320)), view((2, 4, 20, 320))
        call = (lambda: cufa.scaled_dot_product_attention(q, k, v))
    elif case == "odd head dim":
        q, k, v = view((2, 10, 4, 300)), view((2, 20, 2, 300)), view((2, 20, 2, 300))
    elif case == "unaligned":
        k = k.__class__(None, "cupy", k.ptr + 2, k.shape, k.strides, k.dtype, 0, 2)
    elif case == "backward":
        out, lse = view((2, 10, 4, 320)), view((2, 4, 10), "float32")
        call = (lambda: cufa.flash_attn_backward(out, q, k, v, out, lse))
    with pytest.raises(error) as e:
        call()
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert not device.launches


def test_latent_pair_variant_pads_q_and_k_to_640_and_halves_v():
    """q and k over 512 (DeepSeek's 576 in the absorbed form) against v's 257-512: q and k
    padded to 640, v's and out's columns in two halves of 256, 64 x 32 tiles (136 KB)."""
    for d, dv in ((576, 512), (520, 264), (640, 512)):
        v = _compile.fwd_variant("bf16", d, "window", True, "sm90", head_dim_v=dv)
        assert (v.family, v.head_dim, v.head_dim_v, v.ctas_per_tile) == ("sm80", 640, 256, 2)
        assert (v.block_m, v.block_n) == _compile.WIDE_TILES
        assert v.smem_bytes == (64 * 640 + 32 * (640 + 256)) * 2 == 139264
    keys = {x.key for x in _compile.all_variants()}
    assert {f"fwd_sm80_{dt}_hd640_bm64_bn32_{m}{mods}_dv256" for dt in ("fp16", "bf16")
            for m in ("none", "window") for mods in ("", "_mods")} <= keys
    with pytest.raises(ValueError, match="head dim 576 .over 512. takes 16-bit k and a v of"):
        _compile.fwd_variant("bf16", 576, "none", False)


@pytest.mark.parametrize("packed", [False, True])
def test_latent_pair_calls_launch_two_ctas_a_tile(device, packed):  # noqa: F811
    if packed:
        q, k, v = view((150, 16, 576)), view((150, 1, 576)), view((150, 1, 512))
        cu = view((3,), "int32")
        out = cufa.flash_attn_varlen_func(q, k, v, cu, cu, 100, 100, causal=True)
        schedule, launch = device.launches
        assert launch[1] == 2 * 16 * (150 // 64 + 2)
        assert device.allocations[0] == ((150, 16, 512), "float16")
    else:
        q, k, v = view((2, 100, 16, 576)), view((2, 300, 1, 576)), view((2, 300, 1, 512))
        out = cufa.flash_attn_func(q, k, v, causal=True)
        (launch,) = device.launches
        assert launch[1] == 2 * 2 * 16 * -(-100 // 64)
        assert device.allocations[0] == ((2, 100, 16, 512), "float16")
    r = record(launch)
    assert (r["head_dim"], r["head_dim_v"], r["v_row_stride"]) == (576, 512, 512)
    assert r["o"] == int(out.split("@")[1], 16)
    assert r["scale"] == pytest.approx(576 ** -0.5)
    plan = next(p for p in _runtime.plans.values() if getattr(p, "variant", None) is not None
                and p.variant.head_dim == 640)
    assert (plan.variant.head_dim_v, plan.variant.block_n) == (256, 32)


@pytest.mark.parametrize("shapes, smem, words", [
    (((2, 10, 4, 576), (2, 20, 2, 576), (2, 20, 2, 128)), None,
     ["v has head dim 128 but q has 576", "(640, 512)", "(576 and 512)"]),
    (((2, 10, 4, 704), (2, 20, 2, 704), (2, 20, 2, 512)), None,
     ["q has head dim 704", "1 to 640"]),
    (((2, 10, 4, 576), (2, 20, 2, 576), (2, 20, 2, 576)), None,
     ["q has head dim 576", "1 to 512"]),
    (((2, 10, 4, 320), (2, 20, 2, 320), (2, 20, 2, 256)), None,
     ["v has shape (2, 20, 2, 256) but k has (2, 20, 2, 320)", "equal key and value shapes",
      "but for q and k over 512"]),
    (((2, 10, 4, 576), (2, 20, 2, 576), (2, 20, 2, 512)), 99 * 1024,
     ["head dims 576 (q, k) and 512 (v): the smallest tiles take 110592 bytes",
      "this GPU's 101376 a block"]),
])
def test_latent_pair_calls_it_does_not_take(device, monkeypatch, shapes, smem, words):  # noqa: F811
    if smem:
        monkeypatch.setattr(_runtime, "smem_per_block", lambda device: smem)
    q, k, v = (view(s) for s in shapes)
    with pytest.raises(ValueError) as e:
        cufa.flash_attn_func(q, k, v)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert not device.launches


def test_hopper_groups_count_tiles_of_two_ctas(device):  # noqa: F811
    """The persistent kernel's scheduling groups (heads_per_group, tail_group_head) count
    the tiles a wave covers: 132 CTAs an H200 hold 66 tiles of column halves."""
    q, k, v = view((2, 4096, 8, 512)), view((2, 4096, 8, 512)), view((2, 4096, 8, 512))
    cufa.flash_attn_func(q, k, v, causal=True)
    r = record(device.launches[0])
    groups = _heuristics.heads_per_group(16, 4096, 512, 32, 66)
    assert r["heads_per_group"] == groups
    assert r["tail_group_head"] == _heuristics.tail_group_head(16, groups, 32, 66, masked=True)
    assert device.launches[0][1] == 132  # (every CTA on the SMs; 2 x 8 x 32 tiles, twice)


def test_maps_the_copy_engine_refuses_take_the_wide_tiles_rule(device, monkeypatch):  # noqa: F811
    """Where TMA cannot describe the arrays (a batch stride over its 2^40 bytes) the call
    runs the mma.sync kernel on the tiles _wide_variant picks (CUFA_WIDE_TILES honoured)."""
    from test_head_dims_cpu import strided
    monkeypatch.setitem(_compile._overrides, _compile.WIDE_TILES_ENV, "64x16")
    q = strided((2, 100, 8, 320), (1 << 40, 8 * 320, 320, 1))
    k, v = view((2, 300, 2, 320)), view((2, 300, 2, 320))
    cufa.flash_attn_func(q, k, v)
    plan = next(p for p in _runtime.plans.values() if getattr(p, "variant", None) is not None)
    assert (plan.variant.family, plan.variant.block_n, plan.tma_template) == ("sm80", 16, None)


@pytest.mark.parametrize("family, d, d_v, paged, aligned, hopper", [
    ("sm90", 512, 512, False, True, True),    # one head dim over 256
    ("sm90", 320, 320, True, True, True),     # ... paged too
    ("sm90", 192, 128, False, True, True),    # DeepSeek's pair on contiguous K/V
    ("sm90", 192, 128, True, True, False),    # ... not paged
    ("sm90", 192, 128, False, False, False),  # ... nor unaligned
    ("sm90", 576, 512, False, True, False),   # the latent pair: mma.sync's
    ("sm80", 512, 512, False, True, False),   # other GPUs, CUFA_KERNEL_FAMILY=sm80
    ("sm80", 192, 128, False, True, False),
])
def test_which_wide_calls_hopper_takes(family, d, d_v, paged, aligned, hopper):
    from cufa import _fwd_plan
    assert _fwd_plan._hopper_takes(family, d, d_v, {} if paged else None, aligned) == hopper
