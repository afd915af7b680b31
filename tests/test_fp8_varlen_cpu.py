"""CPU: flash_attn_varlen_func over an fp8 (float8_e4m3fn) paged cache -- the launches the
planner makes (the schedule, the forward's e4m3 K/V variant on the mma.sync kernels with
the cache's strides in 16-bit units and the descales' addresses and strides, the e4m3
decode kernel for the short sequences) and every bad argument's error before any launch."""
import itertools

import numpy as np
import pytest

import cufa
from cufa import _interop, _params, _runtime
from test_launch_path_cpu import device, record  # noqa: F401  (the fixture)

_addresses = itertools.count(0x7E00_0000_0000, 1 << 24)
_SIZES = {"float16": 2, "bfloat16": 2, "float32": 4, "int32": 4, "float8_e4m3fn": 1,
          "float8_e5m2": 1}


def view(shape, dtype="float16"):
    return _interop.DeviceArray(None, "cupy", next(_addresses), tuple(shape),
                                _interop.contiguous_strides(shape), dtype, 0, _SIZES[dtype])


def batch(h=8, hk=2, d=128, page=16, cache_dtype="float8_e4m3fn"):
    """q of 300 rows over 4 sequences, a paged cache of 40 pages, cu_seqlens, a table."""
    return (view((300, h, d)), view((40, page, hk, d), cache_dtype), view((5,), "int32"),
            view((4, 10), "int32"))


def test_fp8_paged_batch_takes_the_e4m3_forward_and_decode_kernels(device):  # noqa: F811
    q, cache, cu, table = batch()
    k_scale, v_scale = view((4, 2), "float32"), view((), "float32")
    cufa.flash_attn_varlen_func(q, cache, cache, cu, cu, 64, 64, block_table=table, causal=True,
                                k_descale=k_scale, v_descale=v_scale)
    plan = next(p for p in _runtime.plans.values() if getattr(p, "decode", None) is not None)
    assert plan.variant.e4m3_kv and plan.variant.family == "sm80" and plan.tma_template is None
    assert plan.variant.key.endswith("_e4m3kv")
    _, forward, decode = device.launches[:3]
    r = record(forward)
    assert (r["k"], r["v"], r["block_table"]) == (cache.ptr, cache.ptr, table.ptr)
    # e4m3 rows move as 16-bit units: (40, 16, 2, 128) bytes -> page, row, head strides / 2
    assert (r["k_batch_stride"], r["k_row_stride"], r["k_head_stride"]) == (2048, 128, 64)
    assert (r["v_batch_stride"], r["v_row_stride"], r["v_head_stride"]) == (2048, 128, 64)
    assert (r["k_descale"], r["v_descale"]) == (k_scale.ptr, v_scale.ptr)
    assert (r["k_descale_batch_stride"], r["k_descale_head_stride"]) == (2, 1)
    assert (r["v_descale_batch_stride"], r["v_descale_head_stride"]) == (0, 0)
    assert r["head_dim"] == 128
    # the decode kernel's share: its e4m3 variant, byte strides, the same descales
    assert plan.decode.launches[0][0] == "decode"
    d = record(decode, _params.DECODE)
    assert (d["k_batch_stride"], d["k_row_stride"], d["k_head_stride"]) == (4096, 256, 128)
    assert (d["k_descale"], d["v_descale"]) == (k_scale.ptr, v_scale.ptr)
    assert (d["k_descale_batch_stride"], d["k_descale_head_stride"]) == (2, 1)


def test_the_same_batch_in_16_bits_keeps_its_kernels(device):  # noqa: F811
    q, cache, cu, table = batch(cache_dtype="float16")
    cufa.flash_attn_varlen_func(q, cache, cache, cu, cu, 64, 64, block_table=table, causal=True)
    plan = next(p for p in _runtime.plans.values() if getattr(p, "decode", None) is not None)
    assert not plan.variant.e4m3_kv
    r = record(device.launches[1])
    assert (r["k_batch_stride"], r["k_descale"], r["k_descale_batch_stride"]) == (4096, 0, 0)


@pytest.mark.parametrize("case, error, words", [
    ("no block_table", NotImplementedError, ["float8_e4m3fn", "block_table"]),
    ("16-bit v", TypeError, ["k has dtype float8_e4m3fn but v has float16"]),
    ("descale of a 16-bit cache", TypeError, ["k_descale applies to float8_e4m3fn", "k has dtype float16"]),
    ("fp8 q, 16-bit cache", TypeError, ["k has dtype float16", "all in float8_e4m3fn"]),
    ("e5m2", TypeError, ["float8_e5m2", "e4m3"]),
    ("descale shape", ValueError, ["k_descale must be float32 (batch, nheads_k) = (4, 2)"]),
    ("descale dtype", TypeError, ["v_descale must be float32"]),
    ("head dim 40", NotImplementedError, ["multiples of 16"]),
    ("q unaligned", NotImplementedError, ["q and out must be 16-byte aligned"]),
])
def test_fp8_paged_batch_bad_arguments(device, case, error, words):  # noqa: F811
    q, cache, cu, table = batch()
    k = v = cache
    kw = dict(block_table=table)
    if case == "no block_table":
        k = v = view((300, 2, 128), "float8_e4m3fn")
        kw = {}
    elif case == "16-bit v":
        v = view(cache.shape)
    elif case == "descale of a 16-bit cache":
        k = v = view(cache.shape)
        kw["k_descale"] = view((4, 2), "float32")
    elif case == "fp8 q, 16-bit cache":
        q, k, v = view(q.shape, "float8_e4m3fn"), view(cache.shape), view(cache.shape)
    elif case == "e5m2":
        k = v = view(cache.shape, "float8_e5m2")
    elif case == "descale shape":
        kw["k_descale"] = view((2, 4), "float32")
    elif case == "descale dtype":
        kw["v_descale"] = view((4, 2), "float16")
    elif case == "q unaligned":
        q = _interop.DeviceArray(None, "cupy", q.ptr, q.shape, (8 * 129, 129, 1), "float16", 0, 2)
    elif case == "head dim 40":
        q, k = view((300, 8, 40)), view((40, 16, 2, 40), "float8_e4m3fn")
        v = k
    with pytest.raises(error) as info:
        cufa.flash_attn_varlen_func(q, k, v, cu, cu, 64, 64, **kw)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    assert not device.launches


def test_jax_arrays_of_an_fp8_cache_run_as_one_callback(monkeypatch, jax_cpu_callbacks):
    """JAX arrays of an fp8 paged cache go through XLA's buffers eagerly too (as under
    jax.jit), crossing as uint8 and read as float8 by the spec's layouts, the descales
    among the arguments."""
    import jax.numpy as jnp
    _jax = jax_cpu_callbacks
    calls = []

    def on_device(spec, ctx, outs, bufs):
        calls.append((spec, tuple(str(np.asarray(b).dtype) for b in bufs)))
    monkeypatch.setattr(_jax, "on_device", on_device)
    q = jnp.zeros((8, 2, 32), jnp.bfloat16)
    cache = jnp.zeros((4, 16, 1, 32), jnp.float8_e4m3fn)
    cu, table = jnp.asarray(np.array([0, 8], np.int32)), jnp.zeros((1, 4), jnp.int32)
    scale = jnp.ones((1, 1), jnp.float32)
    out = cufa.flash_attn_varlen_func(q, cache, cache, cu, cu, 8, 8, block_table=table,
                                      causal=True, k_descale=scale, v_descale=scale)
    assert (out.dtype, out.shape) == (jnp.bfloat16, q.shape)
    (spec, dtypes), = calls
    at = {n: i for i, n in enumerate(spec.names)}
    assert spec.entry == "flash_attn_varlen_func" and "k_descale" in at and "v_descale" in at
    assert spec.layouts[at["k"]][2:] == ("float8_e4m3fn", 1) and dtypes[at["k"]] == "uint8"
    with pytest.raises(ValueError, match="check_cu_seqlens=True reads device values"):
        cufa.flash_attn_varlen_func(q, cache, cache, cu, cu, 8, 8, block_table=table,
                                    check_cu_seqlens=True)
