"""CPU: a head dim of v's own (DeepSeek's prefill: q and k of 192, v and out of 128) in
flash_attn_func and flash_attn_varlen_func -- the variants (Hopper's kernel with kHeadDimV,
the sm80 family's with kHeadDimVWanted on any GPU), what the planner launches (head_dim_v,
out's shape, V's TMA map), and every call it does not take, refused with the argument
named."""
import numpy as np
import pytest

import cufa
from cufa import _compile, _runtime
from test_fp8_varlen_cpu import view
from test_launch_path_cpu import device, record  # noqa: F401  (the fixture)


def test_the_variant_pads_both_head_dims_to_a_kernel_pair():
    v = _compile.fwd_variant("bf16", 176, "window", True, "sm80", head_dim_v=100)
    assert (v.family, v.head_dim, v.head_dim_v) == ("sm80", 192, 128)
    assert v.key.endswith("_dv128") and v.name_expression.endswith(", false, false, 128>")
    assert v.smem_bytes == (v.block_m * 192 + v.block_n * (192 + 128)) * 2
    # Hopper's: the d = 192 tiles, V's stages 128 wide, kHeadDimV after the fp8 flag
    h = _compile.fwd_variant("bf16", 176, "window", True, "sm90", head_dim_v=100)
    plain = _compile.fwd_variant("bf16", 176, "window", True, "sm90")
    assert (h.family, h.head_dim, h.head_dim_v) == ("sm90", 192, 128)
    assert (h.block_m, h.block_n) == (plain.block_m, plain.block_n)
    assert h.name_expression == plain.name_expression[:-1] + ", false, 128>"
    assert h.smem_bytes == plain.smem_bytes - h.kv_stages * h.block_n * 64 * 2
    assert (h.q_stages, h.kv_stages) == (2, 2) and h.key == plain.key + "_dv128"
    # without score mods, 128-key blocks: two K/V stages beside one Q stage
    h = _compile.fwd_variant("fp16", 192, "none", False, "sm90", "mid", head_dim_v=128)
    assert (h.block_m, h.block_n, h.q_stages, h.kv_stages) == (128, 128, 1, 2)
    assert h.smem_bytes <= h.smem_limit
    assert _compile.fwd_variant("bf16", 192, "window", True, head_dim_v=192).head_dim_v == 0
    # a narrower v (any up to the pair's 128) takes the pair's kernel: its columns are bounded
    # by head_dim_v at run time
    assert _compile.fwd_variant("fp16", 192, "none", False, head_dim_v=64).head_dim_v == 128
    with pytest.raises(ValueError, match="no kernel for head dims 128"):
        _compile.fwd_variant("fp16", 128, "none", False, head_dim_v=64)
    with pytest.raises(ValueError, match="with e4m3 k, v"):
        _compile.fwd_variant("fp16", 192, "none", False, e4m3_kv=True, head_dim_v=128)
    keys = {x.key for x in _compile.all_variants()}
    assert {f"fwd_{family}_{dt}_hd192_{tiles}_{m}{mods}_dv128" for dt in ("fp16", "bf16")
            for family, tiles, mods in (("sm80", "bm64_bn64", ""), ("sm80", "bm64_bn64", "_mods"),
                                        ("sm90", "bm128_bn128", ""), ("sm90", "bm128_bn64", "_mods"))
            for m in ("none", "window")} <= keys


def test_dense_and_packed_calls_launch_it_with_out_in_v_s_head_dim(device):  # noqa: F811
    q, k, v = view((2, 100, 8, 192)), view((2, 300, 2, 192)), view((2, 300, 2, 128))
    out = cufa.flash_attn_func(q, k, v, causal=True)
    (launch,) = device.launches
    r = record(launch)
    assert (r["head_dim"], r["head_dim_v"], r["v_row_stride"]) == (192, 128, 256)
    # out: a new (2, 100, 8, 128) array, written with its own strides (not q's)
    assert device.allocations[0] == ((2, 100, 8, 128), "float16")
    assert (r["o_batch_stride"], r["o_row_stride"], r["o_head_stride"]) == (102400, 1024, 128)
    assert r["o"] == int(out.split("@")[1], 16)
    plan = next(p for p in _runtime.plans.values() if getattr(p, "variant", None) is not None)
    assert plan.variant.head_dim_v == 128 and plan.variant.family == "sm90"
    assert not plan.out_like_q  # (torch allocates it by shape, not like q)
    device.launches.clear()
    q, k, v = view((150, 8, 192)), view((400, 2, 192)), view((400, 2, 128))
    cu = view((4,), "int32")
    cufa.flash_attn_varlen_func(q, k, v, cu, cu, 64, 64)
    schedule, forward = device.launches
    r = record(forward)
    assert (r["head_dim_v"], r["o_row_stride"], r["o_head_stride"]) == (128, 1024, 128)
    assert device.allocations[-1] == ((150, 8, 128), "float16")
    device.launches.clear()  # a narrower v: the pair's kernel, its columns bounded at run time
    q, k, v = view((1, 10, 4, 192)), view((1, 20, 2, 192)), view((1, 20, 2, 64))
    cufa.flash_attn_func(q, k, v)
    r = record(device.launches[0])
    assert (r["head_dim_v"], r["o_head_stride"]) == (64, 64)


@pytest.mark.parametrize("packed", [False, True])
def test_hopper_maps_give_v_its_own_columns(device, monkeypatch, packed):  # noqa: F811
    """On Hopper the pair runs the wgmma kernel: V's TMA view (and a packed batch's V tail)
    has v's 128 columns, q's and k's 192; CUFA_KERNEL_FAMILY=sm80 keeps mma.sync's."""
    from cufa import _fwd_plan
    made = []
    real = _fwd_plan.tma_views
    monkeypatch.setattr(_fwd_plan, "tma_views",
                        lambda *args: made.append(real(*args)) or made[-1])
    if packed:
        q, k, v = view((150, 8, 192)), view((400, 2, 192)), view((400, 2, 128))
        cufa.flash_attn_varlen_func(q, k, v, view((4,), "int32"), view((4,), "int32"), 64, 64)
    else:
        q, k, v = view((2, 100, 8, 192)), view((2, 300, 2, 192)), view((2, 300, 2, 128))
        cufa.flash_attn_func(q, k, v, causal=True)
    (views, tails), = made
    assert [shape[-1] for shape, _, _ in views] == [192, 192, 128]
    assert [shape[-1] for shape, _, _ in tails] == ([192, 128] if packed else [])
    plan = next(p for p in _runtime.plans.values() if getattr(p, "variant", None) is not None)
    assert (plan.variant.family, plan.variant.head_dim_v) == ("sm90", 128)
    monkeypatch.setenv(_compile.FAMILY_ENV, "sm80")
    cufa.api.clear_plans()
    q, k, v = view((2, 10, 8, 192)), view((2, 30, 2, 192)), view((2, 30, 2, 128))
    cufa.flash_attn_func(q, k, v)
    plan = next(p for p in _runtime.plans.values() if getattr(p, "variant", None) is not None)
    assert (plan.variant.family, plan.variant.head_dim_v) == ("sm80", 128)


@pytest.mark.parametrize("case, error, words", [
    ("unsupported pair", ValueError, ["v has head dim 64 but q has 128", "(192, 128)"]),
    ("v wider than q", ValueError, ["v has head dim 256 but q has 192"]),
    ("v heads", ValueError, ["v has shape", "same length and heads"]),
    ("out in q's head dim", ValueError, ["shape of q with v's head dim", "(2, 10, 4, 128)"]),
    ("unaligned", NotImplementedError, ["16-byte aligned"]),
    ("kvcache", ValueError, ["v_cache has shape", "head dim here"]),
    ("paged varlen", ValueError, ["v has shape", "head dim here"]),
])
def test_calls_it_does_not_take(device, case, error, words):  # noqa: F811
    q, k, v = view((2, 10, 4, 192)), view((2, 20, 2, 192)), view((2, 20, 2, 128))
    call = (lambda: cufa.flash_attn_func(q, k, v))
    if case == "unsupported pair":
        q, k, v = view((2, 10, 4, 128)), view((2, 20, 2, 128)), view((2, 20, 2, 64))
    elif case == "v wider than q":
        v = view((2, 20, 2, 256))
    elif case == "v heads":
        v = view((2, 20, 1, 128))
    elif case == "out in q's head dim":
        call = (lambda: cufa.flash_attn_func(q, k, v, out=view((2, 10, 4, 192))))
    elif case == "unaligned":
        v = view((2, 20, 2, 100))
        v = type(v)(None, "cupy", v.ptr + 2, v.shape, v.strides, "float16", 0, 2)
    elif case == "kvcache":
        call = (lambda: cufa.flash_attn_with_kvcache(view((2, 1, 4, 192)), k, v,
                                                     cache_seqlens=view((2,), "int32")))
    elif case == "paged varlen":
        cu = view((3,), "int32")
        call = (lambda: cufa.flash_attn_varlen_func(
            view((10, 4, 192)), view((8, 16, 2, 192)), view((8, 16, 2, 128)), cu, cu, 5, 5,
            block_table=view((2, 4), "int32")))
    with pytest.raises(error) as info:
        call()
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    assert not device.launches


def test_under_jax_jit_out_takes_v_s_head_dim(monkeypatch, jax_cpu_callbacks):
    """The traced call's outputs: out (…, 128) from v's head dim (the CPU stand-in of the
    launch computes the reference, as in test_jax_jit_cpu)."""
    import jax
    import jax.numpy as jnp
    from cufa import reference
    _jax = jax_cpu_callbacks

    def on_device(spec, ctx, outs, bufs):
        a = {n: np.asarray(b).astype(np.float64) for n, b in zip(spec.names, bufs)}
        o, lse = reference.attention(a["q"], a["k"], a["v"], causal=True)
        np.asarray(outs[0])[...] = o.astype(np.asarray(outs[0]).dtype)
        np.asarray(outs[1])[...] = lse
    monkeypatch.setattr(_jax, "on_device", on_device)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(s).astype(np.float32), jnp.float16)
               for s in ((1, 5, 2, 192), (1, 7, 2, 192), (1, 7, 2, 128)))
    o, lse = jax.jit(lambda q, k, v: cufa.flash_attn_func(q, k, v, causal=True,
                                                          return_lse=True))(q, k, v)
    assert o.shape == (1, 5, 2, 128) and lse.shape == (1, 2, 5)
    want, _ = reference.attention(*(np.asarray(x, np.float64) for x in (q, k, v)), causal=True)
    np.testing.assert_allclose(np.asarray(o, np.float64), want, atol=2e-2, rtol=2e-2)
