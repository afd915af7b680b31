"""CPU: cufa under jax.jit, with the device launch replaced by the NumPy reference.

What runs here is everything JAX sees -- the buffer_callback each public function becomes
on traced arrays, its output shapes and dtypes, the aliasing of an appended cache, what
is static (shapes, options) and what is not (cu_seqlens, cache_seqlens values), and the
errors for jax.vmap, jax.grad and out= -- on JAX's CPU backend. The launch itself
(`_jax.on_device`) is swapped for a function that reads the same buffers with NumPy and
writes the reference's answer; the GPU tests run the real one. Without that stand-in, a
jitted call on the CPU backend gets the eager call's checks at trace time, then an error
naming the backend. Skipped without JAX.
"""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import cufa  # noqa: E402
from cufa import _jax, reference  # noqa: E402
from cufa._interop import DeviceArray  # noqa: E402

pytestmark = pytest.mark.skipif(not _jax.available(), reason="this JAX has no buffer_callback")


@pytest.fixture
def numpy_device(monkeypatch, jax_cpu_callbacks):
    """Replaces the device: JAX's CPU backend passes for its CUDA one, no scratch is
    planned, and each run's Call goes into the returned list."""
    runs = []

    def on_device(spec, ctx, outs, bufs):
        a = {n: np.asarray(b).astype(np.float64) if np.asarray(b).dtype.kind == "f"
             or "bfloat16" in str(np.asarray(b).dtype) else np.asarray(b)
             for n, b in zip(spec.names, bufs)}
        results = _REFERENCE[spec.entry](a, spec.options)
        for out, value in zip(outs, results):
            target = np.asarray(out)
            target[...] = np.asarray(value).astype(target.dtype)
        runs.append(spec)
    monkeypatch.setattr(_jax, "on_device", on_device)
    return runs


def _window(options):
    return dict(causal=options.get("causal", False), window_size=options.get("window_size", (-1, -1)),
                softcap=options.get("softcap", 0.0), softmax_scale=options.get("softmax_scale"))


def _dense(a, options):
    return reference.attention(a["q"], a["k"], a["v"], alibi_slopes=a.get("alibi_slopes"),
                               learnable_sink=a.get("learnable_sink"), **_window(options))


def _packed(a, options):
    cu_q, cu_k = a["cu_seqlens_q"], a["cu_seqlens_k"]
    nheads, d = a["q"].shape[1:]
    out = np.zeros_like(a["q"])
    lse = np.full((nheads, a["q"].shape[0]), -np.inf)
    for b in range(len(cu_q) - 1):
        qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if qe > qs:
            o, l_ = reference.attention(a["q"][None, qs:qe], a["k"][None, ks:ke],
                                        a["v"][None, ks:ke], **_window(options),
                                        learnable_sink=a.get("learnable_sink"))
            out[qs:qe], lse[:, qs:qe] = o[0], l_[0]
    return out, lse


def _sdpa(a, options):
    t = (lambda x: x.transpose(0, 2, 1, 3))
    o, lse = reference.attention(t(a["query"]), t(a["key"]), t(a["value"]),
                                 causal=options["is_causal"], diag_offset=0,
                                 learnable_sink=a.get("learnable_sink"))
    return t(o), lse


def _sdpa_backward(a, options):
    t = (lambda x: x.transpose(0, 2, 1, 3))
    mask = a.get("attn_mask")
    g = reference.attention_backward(t(a["query"]), t(a["key"]), t(a["value"]), t(a["dout"]),
                                     causal=options["is_causal"], diag_offset=0,
                                     softmax_scale=options.get("scale"), attn_mask=mask,
                                     learnable_sink=a.get("learnable_sink"))
    return ((t(g.dq), t(g.dk), t(g.dv)) + ((g.dsink,) if g.dsink is not None else ())
            + ((g.dmask,) if g.dmask is not None else ()))


def _kvcache(a, options):
    kc, vc = a["k_cache"].copy(), a["v_cache"].copy()
    lens = a["cache_seqlens"] if "cache_seqlens" in a else np.full(kc.shape[0],
                                                                    options["cache_seqlen"])
    new = a["k"].shape[1] if "k" in a else 0
    q = a["q"]
    out = np.zeros_like(q)
    lse = np.zeros((q.shape[0], q.shape[2], q.shape[1]))
    for b, n in enumerate(lens):
        if new:
            kc[b, n:n + new], vc[b, n:n + new] = a["k"][b], a["v"][b]
        out[b:b + 1], lse[b:b + 1] = reference.attention(
            q[b:b + 1], kc[b:b + 1, :n + new], vc[b:b + 1, :n + new], **_window(options),
            learnable_sink=a.get("learnable_sink"))
    return (out, lse) + ((kc, vc) if new else ())


def _merge(a, options):
    return reference_merge(a["out_a"], a["lse_a"], a["out_b"], a["lse_b"])


def reference_merge(oa, la, ob, lb):
    lse = np.logaddexp(la, lb)
    with np.errstate(invalid="ignore"):
        wa, wb = np.exp(la - lse), np.exp(lb - lse)
    wa, wb = np.nan_to_num(wa), np.nan_to_num(wb)
    move = (lambda w: np.moveaxis(w, -2, -1)[..., None] if oa.ndim == 4 else w.T[..., None])
    return move(wa) * oa + move(wb) * ob, lse


def _dense_backward(a, options):
    g = reference.attention_backward(a["q"], a["k"], a["v"], a["dout"],
                                     alibi_slopes=a.get("alibi_slopes"),
                                     learnable_sink=a.get("learnable_sink"), **_window(options))
    return (g.dq, g.dk, g.dv) + ((g.dsink,) if g.dsink is not None else ())


def _packed_backward(a, options):
    cu_q, cu_k = a["cu_seqlens_q"], a["cu_seqlens_k"]
    dq, dk, dv = (np.zeros_like(a[n]) for n in "qkv")
    for b in range(len(cu_q) - 1):
        qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if qe > qs and ke > ks:
            g = reference.attention_backward(a["q"][None, qs:qe], a["k"][None, ks:ke],
                                             a["v"][None, ks:ke], a["dout"][None, qs:qe],
                                             **_window(options))
            dq[qs:qe], dk[ks:ke], dv[ks:ke] = g.dq[0], g.dk[0], g.dv[0]
    return dq, dk, dv


_REFERENCE = {"flash_attn_func": _dense, "flash_attn_varlen_func": _packed,
              "scaled_dot_product_attention": _sdpa, "flash_attn_with_kvcache": _kvcache,
              "merge_attention_states": _merge, "flash_attn_backward": _dense_backward,
              "flash_attn_varlen_backward": _packed_backward, "sdpa_backward": _sdpa_backward}


def randn(rng, shape, dtype=jnp.float16):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32), dtype=dtype)


def close(x, y, tol=2e-2):
    np.testing.assert_allclose(np.asarray(x, dtype=np.float64), y, atol=tol, rtol=tol)


def test_flash_attn_func_in_a_jitted_function_with_other_ops(numpy_device, rng):
    q, k, v = randn(rng, (2, 7, 4, 32)), randn(rng, (2, 9, 2, 32)), randn(rng, (2, 9, 2, 32))
    traces = []

    @jax.jit
    def step(q, k, v):
        traces.append(1)
        o, lse = cufa.flash_attn_func(q * 2, k, v, causal=True, return_lse=True)
        return o.astype(jnp.float32) + 1, lse
    o, lse = step(q, k, v)
    o_ref, lse_ref = reference.attention(2 * np.asarray(q, np.float64), np.asarray(k, np.float64),
                                         np.asarray(v, np.float64), causal=True)
    assert o.shape == (2, 7, 4, 32) and lse.shape == (2, 4, 7) and lse.dtype == jnp.float32
    close(o, o_ref + 1)
    close(lse, lse_ref, 1e-3)
    jax.block_until_ready(step(q + 1, k, v))
    assert len(traces) == 1 and len(numpy_device) == 2  # one trace, two runs
    step(q[:, :5], k, v)
    assert len(traces) == 2  # a new shape traces again


def test_options_are_static_in_the_callback(numpy_device, rng):
    q = randn(rng, (1, 5, 2, 16))
    jax.jit(lambda q: cufa.flash_attn_func(q, q, q, window_size=(2, 1), softcap=5.0))(q)
    spec = numpy_device[-1]
    assert spec.entry == "flash_attn_func" and spec.names == ("q", "k", "v")
    assert spec.options["window_size"] == (2, 1) and spec.options["softcap"] == 5.0


def test_host_integer_windows_and_attn_probs_under_jit(numpy_device, rng):
    q = randn(rng, (1, 5, 2, 16))
    o, lse, s = jax.jit(lambda q: cufa.flash_attn_func(
        q, q, q, window_size=(np.int64(2), np.array(1)), return_attn_probs=True))(q)
    window = numpy_device[-1].options["window_size"]
    assert window == (2, 1) and {type(w) for w in window} == {int}  # ints in the static options
    assert s.shape == (0,) and s.dtype == q.dtype and lse.shape == (1, 2, 5)
    o_ref, lse_ref = reference.attention(*(np.asarray(q, np.float64),) * 3, window_size=(2, 1))
    close(o, o_ref)
    close(lse, lse_ref, 1e-3)
    qp, cu = randn(rng, (9, 2, 16)), jnp.array([0, 4, 9], jnp.int32)
    o, lse, s = jax.jit(lambda q, cu: cufa.flash_attn_varlen_func(
        q, q, q, cu, cu, np.int32(5), np.int32(5), return_attn_probs=True))(qp, cu)
    assert o.shape == (9, 2, 16) and lse.shape == (2, 9) and s.shape == (0,)


def test_varlen_lengths_are_values_not_shapes(numpy_device, rng):
    q, k = randn(rng, (20, 2, 32)), randn(rng, (24, 2, 32))
    traces = []

    @jax.jit
    def step(q, k, cu_q, cu_k):
        traces.append(1)
        return cufa.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 20, 24, causal=True,
                                           return_lse=True)
    for lens_q, lens_k in (([5, 15], [10, 14]), ([20, 0], [12, 12]), ([1, 19], [24, 0])):
        cu_q = jnp.asarray(np.concatenate([[0], np.cumsum(lens_q)]), jnp.int32)
        cu_k = jnp.asarray(np.concatenate([[0], np.cumsum(lens_k)]), jnp.int32)
        o, lse = step(q, k, cu_q, cu_k)
        o_ref, lse_ref = _packed(dict(q=np.asarray(q, np.float64), k=np.asarray(k, np.float64),
                                      v=np.asarray(k, np.float64), cu_seqlens_q=np.asarray(cu_q),
                                      cu_seqlens_k=np.asarray(cu_k)), dict(causal=True))
        close(o, o_ref)
        assert lse.shape == (2, 20)
    assert len(traces) == 1


def test_kvcache_append_returns_the_caches_and_aliases_them(numpy_device, rng):
    b, cap, hk, d = 2, 16, 2, 32
    q, kc, vc = randn(rng, (b, 1, 4, d)), randn(rng, (b, cap, hk, d)), randn(rng, (b, cap, hk, d))
    k_new, v_new = randn(rng, (b, 2, hk, d)), randn(rng, (b, 2, hk, d))
    lens = jnp.asarray([3, 9], jnp.int32)

    def step(q, kc, vc, k_new, v_new, lens):
        return cufa.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lens,
                                            causal=True)
    text = str(jax.make_jaxpr(step)(q, kc, vc, k_new, v_new, lens))
    assert "input_output_aliases=((1, 2), (2, 3))" in text
    kc_np, vc_np = np.asarray(kc, np.float64), np.asarray(vc, np.float64)
    o, kc2, vc2 = jax.jit(step, donate_argnums=(1, 2))(q, kc, vc, k_new, v_new, lens)
    assert o.shape == q.shape and kc2.shape == kc_np.shape
    expect = _kvcache(dict(q=np.asarray(q, np.float64), k_cache=kc_np, v_cache=vc_np,
                           k=np.asarray(k_new, np.float64), v=np.asarray(v_new, np.float64),
                           cache_seqlens=np.asarray(lens)), dict(causal=True))
    close(o, expect[0])
    close(kc2, expect[2], 1e-3)
    close(vc2, expect[3], 1e-3)


def test_kvcache_without_append_returns_out_and_lse(numpy_device, rng):
    q, kc = randn(rng, (2, 1, 4, 32)), randn(rng, (2, 16, 2, 32))
    o, lse = jax.jit(lambda q, kc, n: cufa.flash_attn_with_kvcache(
        q, kc, kc, cache_seqlens=n, return_softmax_lse=True))(q, kc, jnp.asarray([4, 16], jnp.int32))
    assert o.shape == q.shape and lse.shape == (2, 4, 1)
    assert numpy_device[-1].names == ("q", "k_cache", "v_cache", "cache_seqlens")


def test_merge_and_sdpa_under_jit(numpy_device, rng):
    oa, ob = randn(rng, (1, 3, 2, 8), jnp.float32), randn(rng, (1, 3, 2, 8), jnp.float32)
    la = jnp.asarray(rng.standard_normal((1, 2, 3)), jnp.float32)
    lb = jnp.full((1, 2, 3), -jnp.inf, jnp.float32)
    o, lse = jax.jit(cufa.merge_attention_states)(oa, la, ob, lb)
    close(o, np.asarray(oa), 1e-5)
    close(lse, np.asarray(la), 1e-5)
    q = randn(rng, (1, 2, 5, 16))
    o = jax.jit(lambda q: cufa.scaled_dot_product_attention(q, q, q, is_causal=True))(q)
    assert o.shape == q.shape and o.dtype == q.dtype


def test_learnable_sink_is_an_array_argument_of_every_entry_point(numpy_device, rng):
    """The sink goes to the callback as one more buffer (its values not static: a new sink
    does not trace again), in float32 or the 16-bit dtypes."""
    traces = []
    q, k = randn(rng, (2, 7, 4, 32)), randn(rng, (2, 9, 2, 32))

    @jax.jit
    def dense(q, k, sink):
        traces.append(1)
        return cufa.flash_attn_func(q, k, k, causal=True, learnable_sink=sink, return_lse=True)
    for dtype in (jnp.float32, jnp.bfloat16, jnp.bfloat16):
        sink = randn(rng, (4,), dtype)
        o, lse = dense(q, k, sink)
        o_ref, lse_ref = reference.attention(*(np.asarray(x, np.float64) for x in (q, k, k)),
                                             causal=True,
                                             learnable_sink=np.asarray(sink, np.float64))
        close(o, o_ref)
        close(lse, lse_ref, 1e-3)
        assert "learnable_sink" in numpy_device[-1].names
    assert len(traces) == 2  # float32, then bfloat16 once
    sink = randn(rng, (4,), jnp.float32)
    sink64 = np.asarray(sink, np.float64)
    cu = jnp.asarray([0, 3, 7], jnp.int32)
    o, lse = jax.jit(lambda q, k, cu, s: cufa.flash_attn_varlen_func(
        q, k, k, cu, cu, 4, 4, learnable_sink=s, return_lse=True))(q[0], k[0, :7], cu, sink)
    for b, (s0, s1) in enumerate(((0, 3), (3, 7))):
        o_ref, lse_ref = reference.attention(*(np.asarray(x[None, s0:s1], np.float64)
                                               for x in (q[0], k[0], k[0])),
                                             learnable_sink=sink64)
        close(o[s0:s1], o_ref[0])
        close(lse[:, s0:s1], lse_ref[0], 1e-3)
    qd = randn(rng, (2, 1, 4, 32))
    o = jax.jit(lambda q, c, s: cufa.flash_attn_with_kvcache(
        q, c, c, cache_seqlens=5, learnable_sink=s))(qd, k, sink)
    close(o, reference.kvcache_attention(*(np.asarray(x, np.float64) for x in (qd, k, k)),
                                         cache_seqlens=5, learnable_sink=sink64)[0])
    qs = randn(rng, (1, 4, 5, 16))
    o = jax.jit(lambda q, s: cufa.scaled_dot_product_attention(
        q, q, q, is_causal=True, learnable_sink=s))(qs, sink)
    q64 = np.asarray(qs, np.float64)
    close(o, reference.sdpa(q64, q64, q64, is_causal=True, learnable_sink=sink64))


def test_vmap_grad_and_out_raise_clear_errors(numpy_device, rng):
    q = randn(rng, (3, 1, 5, 2, 16))
    with pytest.raises(NotImplementedError, match="fold the mapped axis into the batch"):
        jax.vmap(lambda q: cufa.flash_attn_func(q, q, q))(q)
    x = randn(rng, (1, 5, 2, 16), jnp.float32).astype(jnp.float16)
    with pytest.raises(NotImplementedError, match="no backward pass yet"):
        lse = jnp.zeros((1, 2, 5), jnp.float32)  # (merge has no backward)
        jax.grad(lambda q: cufa.merge_attention_states(q, lse, q, lse)[0].astype(
            jnp.float32).sum())(x)
    with pytest.raises(TypeError, match="immutable"):
        jax.jit(lambda q: cufa.flash_attn_func(q, q, q, out=q))(x)
    cu = jnp.asarray([0, 5], jnp.int32)
    with pytest.raises(ValueError, match="check_cu_seqlens"):
        jax.jit(lambda q, cu: cufa.flash_attn_varlen_func(q, q, q, cu, cu, 5, 5,
                                                          check_cu_seqlens=True))(x[0], cu)


def test_eager_kvcache_append_on_jax_arrays_returns_the_caches_too(numpy_device, rng):
    q, kc = randn(rng, (1, 1, 2, 16)), randn(rng, (1, 8, 1, 16))
    new = randn(rng, (1, 1, 1, 16))
    o, lse, kc2, vc2 = cufa.flash_attn_with_kvcache(q, kc, kc, new, new, cache_seqlens=3,
                                                    return_softmax_lse=True)
    assert lse.shape == (1, 2, 1) and kc2.shape == kc.shape
    close(kc2[0, 3], np.asarray(new[0, 0], np.float64), 1e-3)
    close(kc2[0, :3], np.asarray(kc[0, :3], np.float64), 0)
    assert numpy_device[-1].options["cache_seqlen"] == 3


# -- without a CUDA backend: the eager checks at trace time, then the backend's error -------

def _view(x):
    """A device view of x's shape and dtype, row-major, as the eager call would see it."""
    shape, strides, dtype, itemsize = _jax._layout(x)
    return DeviceArray(None, "cupy", 1 << 20, shape, strides, dtype, 0, itemsize)


def _raised(fn, *args):
    with pytest.raises(Exception) as info:
        fn(*args)
    return info.type, str(info.value)


f16, f32, i32, fp8 = jnp.float16, jnp.float32, jnp.int32, jnp.float8_e4m3fn
TRACE_CASES = [
    # (id, the call, its arrays: the eager call on views of them must fail the same way)
    ("q float32", lambda q, k, v: cufa.flash_attn_func(q, k, v),
     [((2, 7, 4, 32), f32), ((2, 9, 2, 32), f32), ((2, 9, 2, 32), f32)]),
    ("q rank 3", lambda q, k, v: cufa.flash_attn_func(q, k, v, causal=True),
     [((7, 4, 32), f16), ((2, 9, 2, 32), f16), ((2, 9, 2, 32), f16)]),
    ("head dim 40 against 32", lambda q, k, v: cufa.flash_attn_func(q, k, v),
     [((2, 7, 4, 40), f16), ((2, 9, 2, 32), f16), ((2, 9, 2, 32), f16)]),
    ("window", lambda q, k, v: cufa.flash_attn_func(q, k, v, window_size=(-2, 0)),
     [((2, 7, 4, 32), f16), ((2, 9, 2, 32), f16), ((2, 9, 2, 32), f16)]),
    ("varlen cu float32", lambda q, k, cu: cufa.flash_attn_varlen_func(
        q, k, k, cu, cu, 7, 9), [((7, 4, 32), f16), ((9, 2, 32), f16), ((3,), f32)]),
    ("sdpa heads", lambda q, k, v: cufa.scaled_dot_product_attention(q, k, v),
     [((1, 4, 5, 16), f16), ((1, 2, 5, 16), f16), ((1, 2, 5, 16), f16)]),
    ("kvcache splits", lambda q, c, n: cufa.flash_attn_with_kvcache(
        q, c, c, cache_seqlens=n, num_splits=-1),
     [((2, 1, 4, 32), f16), ((2, 16, 2, 32), f16), ((2,), i32)]),
    ("kvcache lengths", lambda q, c, n: cufa.flash_attn_with_kvcache(q, c, c, cache_seqlens=n),
     [((2, 1, 4, 32), f16), ((2, 16, 2, 32), f16), ((3,), i32)]),
    ("merge lse", lambda oa, la, ob, lb: cufa.merge_attention_states(oa, la, ob, lb),
     [((1, 3, 2, 8), f32), ((1, 2, 3), f16), ((1, 3, 2, 8), f32), ((1, 2, 3), f32)]),
    ("sink shape", lambda q, k, s: cufa.flash_attn_func(q, k, k, learnable_sink=s),
     [((2, 7, 4, 32), f16), ((2, 9, 2, 32), f16), ((2,), f32)]),
    ("fp8 descale shape", lambda q, c, d: cufa.flash_attn_with_kvcache(q, c, c, k_descale=d),
     [((2, 1, 4, 32), f16), ((2, 16, 2, 32), fp8), ((3,), f32)]),
    ("descale of a 16-bit cache", lambda q, c, d: cufa.flash_attn_with_kvcache(
        q, c, c, k_descale=d), [((2, 1, 4, 32), f16), ((2, 16, 2, 32), f16), ((2, 2), f32)]),
    ("fp8 k_cache, 16-bit v_cache", lambda q, kc, vc: cufa.flash_attn_with_kvcache(q, kc, vc),
     [((2, 1, 4, 32), f16), ((2, 16, 2, 32), fp8), ((2, 16, 2, 32), f16)]),
    ("sink int32", lambda q, c, s: cufa.flash_attn_with_kvcache(q, c, c, learnable_sink=s),
     [((2, 1, 4, 32), f16), ((2, 16, 2, 32), f16), ((4,), i32)]),
    ("varlen sink 2-D", lambda q, cu, s: cufa.flash_attn_varlen_func(
        q, q, q, cu, cu, 7, 7, learnable_sink=s), [((7, 4, 32), f16), ((3,), i32), ((1, 4), f32)]),
    ("sdpa sink shape", lambda q, s: cufa.scaled_dot_product_attention(q, q, q, learnable_sink=s),
     [((1, 4, 5, 16), f16), ((5,), f16)]),
]


@pytest.mark.parametrize("case", TRACE_CASES, ids=[c[0] for c in TRACE_CASES])
def test_jit_without_cuda_checks_as_eager_at_trace_time(case, rng):
    """A bad call fails while jax.jit traces it, with the error the eager call gives for the
    same shapes, dtypes and options (not later, inside XLA)."""
    assert jax.default_backend() != "gpu"
    _, call, specs = case
    arrays = [randn(rng, shape, dtype) if dtype != i32 else jnp.zeros(shape, i32)
              for shape, dtype in specs]
    traced = _raised(jax.jit(call), *arrays)
    assert traced == _raised(call, *(_view(x) for x in arrays))
    assert traced[0] in (TypeError, ValueError)
    with pytest.raises(traced[0]):
        jax.make_jaxpr(call)(*arrays)  # while tracing: before anything runs


@pytest.mark.parametrize("call, specs", [
    (lambda q, k, v: cufa.flash_attn_func(q, k, v, causal=True),
     [((2, 7, 4, 32), f16), ((2, 9, 2, 32), f16), ((2, 9, 2, 32), f16)]),
    (lambda oa, la, ob, lb: cufa.merge_attention_states(oa, la, ob, lb),
     [((1, 3, 2, 8), f32), ((1, 2, 3), f32), ((1, 3, 2, 8), f32), ((1, 2, 3), f32)]),
])
def test_jit_without_cuda_names_the_backend(call, specs, rng):
    arrays = [randn(rng, shape, dtype) for shape, dtype in specs]
    with pytest.raises(RuntimeError, match="under jax.jit needs JAX's CUDA backend, and this "
                                           "JAX runs on 'cpu'"):
        jax.make_jaxpr(call)(*arrays)


def test_eager_jax_arrays_on_the_cpu_are_named(rng):
    """Eagerly, a CPU JAX array is refused as any host array is, on the route an append
    takes through a callback too."""
    q, kc, new = randn(rng, (1, 1, 2, 16)), randn(rng, (1, 8, 1, 16)), randn(rng, (1, 1, 1, 16))
    for call in (lambda: cufa.flash_attn_with_kvcache(q, kc, kc, new, new, cache_seqlens=3),
                 lambda: cufa.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=3),
                 lambda: cufa.flash_attn_func(q, q, q)):
        with pytest.raises(TypeError, match=r"cufa needs CUDA device arrays; got a CPU \(JAX\) "
                                            "array for q"):
            call()


def test_fp8_cache_is_one_callback_eager_and_under_jit(monkeypatch, rng, jax_cpu_callbacks):
    """A jnp.float8_e4m3fn cache runs as one buffer callback, traced and eager alike (not
    through DLPack). Its buffers cross as uint8 (XLA hands a GPU callback no float8
    buffer: "Unimplemented primitive type F8E4M3FN" on the H200) and are read as float8
    by the spec's layouts; the descales are arguments, out is q's dtype and an append
    returns the caches in float8."""
    specs = []
    crossed = []  # (argument dtypes, output dtypes) as the callback gets them

    def on_device(spec, ctx, outs, bufs):
        specs.append(spec)
        crossed.append(tuple(str(np.asarray(b).dtype) for b in (*bufs, *outs)))
    monkeypatch.setattr(_jax, "on_device", on_device)
    q, new = randn(rng, (2, 1, 4, 32), jnp.bfloat16), randn(rng, (2, 1, 2, 32), jnp.bfloat16)
    kc, vc = randn(rng, (2, 16, 2, 32), fp8), randn(rng, (2, 16, 2, 32), fp8)
    scale, lens = jnp.full((2, 2), 0.5, f32), jnp.asarray([3, 5], i32)
    o, lse, kc2, vc2 = jax.jit(lambda q, kc, vc, new, scale, lens: cufa.flash_attn_with_kvcache(
        q, kc, vc, new, new, cache_seqlens=lens, k_descale=scale, v_descale=scale,
        return_softmax_lse=True))(q, kc, vc, new, scale, lens)
    assert (o.dtype, o.shape, lse.dtype) == (jnp.bfloat16, q.shape, f32)
    assert (kc2.dtype, kc2.shape, vc2.dtype) == (fp8, kc.shape, fp8)
    o = cufa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, k_descale=scale)
    assert (o.dtype, o.shape) == (jnp.bfloat16, q.shape)
    traced, eager = specs
    for spec in specs:
        at = {n: i for i, n in enumerate(spec.names)}
        assert spec.dtypes[at["k_cache"]] == spec.dtypes[at["v_cache"]] == "float8_e4m3fn"
        assert spec.layouts[at["k_cache"]][2:] == ("float8_e4m3fn", 1)
        assert spec.dtypes[at["k_descale"]] == "float32" and spec.out_dtypes[0] == "bfloat16"
    assert traced.aliases == (("k_cache", 2), ("v_cache", 3)) and traced.out_dtypes[2:] == (
        "float8_e4m3fn", "float8_e4m3fn")
    assert "v_descale" not in eager.names and eager.aliases == ()
    assert not any("float8" in dtype for dtypes in crossed for dtype in dtypes)
    assert crossed[0][traced.names.index("k_cache")] == "uint8"


def test_fp8_q_is_dequantized_by_jnp_eager_and_under_jit(monkeypatch, rng, jax_cpu_callbacks):
    """A jnp.float8_e4m3fn q with a per-KV-head q_descale: jnp ops turn it into bfloat16
    before the one buffer callback, traced and eager alike, which then gets that q (its
    values q * q_descale[b, h // 2]) and returns out in bfloat16; q_descale is no argument
    of the callback."""
    seen = []

    def on_device(spec, ctx, outs, bufs):
        seen.append((spec, np.asarray(bufs[spec.names.index("q")]).astype(np.float64)))
    monkeypatch.setattr(_jax, "on_device", on_device)
    q = randn(rng, (2, 1, 4, 32), fp8)
    kc = randn(rng, (2, 16, 2, 32), fp8)
    new = randn(rng, (2, 1, 2, 32), jnp.bfloat16)
    q_scale, lens = jnp.asarray([[0.5, 2.0], [0.25, 4.0]], f32), jnp.asarray([3, 5], i32)
    call = (lambda q, kc, new, qs, lens: cufa.flash_attn_with_kvcache(
        q, kc, kc, new, new, cache_seqlens=lens, q_descale=qs))
    for fn in (jax.jit(call), call):
        o, kc2, _ = fn(q, kc, new, q_scale, lens)
        assert (o.dtype, o.shape, kc2.dtype) == (jnp.bfloat16, q.shape, fp8)
    want = np.asarray(q, np.float64) * np.repeat(np.asarray(q_scale), 2, axis=1)[:, None, :, None]
    want = np.asarray(jnp.asarray(want, jnp.bfloat16), np.float64)
    for spec, got in seen:
        assert "q_descale" not in spec.names and spec.dtypes[spec.names.index("q")] == "bfloat16"
        assert np.array_equal(got, want)


def test_eager_callback_calls_of_one_shape_share_a_trace(numpy_device, rng):
    """Eager calls that run as a callback (an append) trace and compile once a shape and
    options, not once a call: the same Call (token) runs again; a new shape traces anew."""
    q, kc, new = randn(rng, (1, 1, 2, 16)), randn(rng, (1, 8, 1, 16)), randn(rng, (1, 1, 1, 16))
    for n in (2, 3):  # (lengths in an array are values: the same trace)
        out, kc2, vc2 = cufa.flash_attn_with_kvcache(q, kc, kc, new, new,
                                                     cache_seqlens=jnp.asarray([n], i32))
        close(kc2[0, n], np.asarray(new, np.float64)[0, 0], 1e-3)
    cufa.flash_attn_with_kvcache(q, kc, kc, new, new, cache_seqlens=2, causal=True)
    cufa.flash_attn_with_kvcache(randn(rng, (2, 1, 2, 16)), randn(rng, (2, 8, 1, 16)),
                                 randn(rng, (2, 8, 1, 16)), randn(rng, (2, 1, 1, 16)),
                                 randn(rng, (2, 1, 1, 16)), cache_seqlens=2)
    tokens = [spec.token for spec in numpy_device]
    assert tokens[0] == tokens[1] and len(set(tokens)) == 3, tokens


@pytest.mark.parametrize("jit", [False, True])
def test_grad_through_flash_attn_func(numpy_device, rng, jit):
    """jax.grad (eager and jitted) runs the forward with lse, then the backward callback on
    dout, q, k, v, out and lse; the cotangents of q, k, v and the sink come back in their
    dtypes, ALiBi's and the options' not at all."""
    q, k, v = randn(rng, (2, 7, 4, 16)), randn(rng, (2, 9, 2, 16)), randn(rng, (2, 9, 2, 16))
    dout = rng.standard_normal((2, 7, 4, 16))
    sink = jnp.asarray(rng.standard_normal(4), jnp.float32)
    slopes = jnp.asarray(rng.uniform(0.1, 0.5, 4), jnp.float32)

    def loss(q, k, v, sink):
        out = cufa.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes,
                                   learnable_sink=sink)
        return (out.astype(jnp.float32) * dout).sum()
    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    got = (jax.jit(grad) if jit else grad)(q, k, v, sink)
    want = reference.attention_backward(*(np.asarray(x, np.float64) for x in (q, k, v)), dout,
                                        causal=True, alibi_slopes=np.asarray(slopes),
                                        learnable_sink=np.asarray(sink))
    for g, w, x in zip(got, (want.dq, want.dk, want.dv, want.dsink), (q, k, v, sink)):
        assert g.dtype == x.dtype and g.shape == x.shape
        close(g, w, tol=3e-2)
    entries = [spec.entry for spec in numpy_device]
    assert entries[-2:] == ["flash_attn_func", "flash_attn_backward"]
    spec = numpy_device[-1]
    assert spec.names == ("dout", "q", "k", "v", "out", "lse", "dlse", "alibi_slopes",
                          "learnable_sink")
    assert spec.scratch and spec.out_dtypes[:4] == ("float16", "float16", "float16", "float32")


def test_grad_through_flash_attn_varlen_func(numpy_device, rng):
    lens = [3, 0, 6]
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    q, k, v = (randn(rng, (9, 2, 16)) for _ in range(3))
    dout = rng.standard_normal((9, 2, 16))

    def loss(q, k, v):
        out = cufa.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, causal=True)
        return (out.astype(jnp.float32) * dout).sum()
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for (s, e) in ((0, 3), (3, 9)):
        want = reference.attention_backward(*(np.asarray(x[None, s:e], np.float64)
                                              for x in (q, k, v)), dout[None, s:e], causal=True)
        for g, w in zip(got, (want.dq, want.dk, want.dv)):
            close(g[s:e], w[0], tol=3e-2)
    assert numpy_device[-1].entry == "flash_attn_varlen_backward"
    assert numpy_device[-1].names[:9] == ("dout", "q", "k", "v", "out", "lse", "dlse",
                                          "cu_seqlens_q", "cu_seqlens_k")


def test_grad_through_lse_and_refusals(numpy_device, rng):
    """lse's cotangent reaches the backward (as dlse); a head dim the kernels cannot take
    is refused while tracing, not inside XLA."""
    q = randn(rng, (1, 6, 2, 16))
    jax.grad(lambda q: cufa.flash_attn_func(q, q, q, return_lse=True)[1].sum())(q)
    spec = numpy_device[-1]
    assert spec.entry == "flash_attn_backward" and "dlse" in spec.names
    odd = randn(rng, (1, 6, 2, 12))
    with pytest.raises(NotImplementedError, match="multiple of 8"):
        jax.grad(lambda q: cufa.flash_attn_func(q, q, q).astype(jnp.float32).sum())(odd)


def test_grad_through_sdpa(numpy_device, rng):
    q, k, v = randn(rng, (2, 4, 7, 16)), randn(rng, (2, 2, 9, 16)), randn(rng, (2, 2, 9, 16))
    dout = rng.standard_normal((2, 4, 7, 16))

    def loss(q, k, v):
        out = cufa.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return (out.astype(jnp.float32) * dout).sum()
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    t = (lambda x: np.asarray(x, np.float64).transpose(0, 2, 1, 3))
    want = reference.attention_backward(t(q), t(k), t(v), t(dout), causal=True, diag_offset=0)
    for g, w in zip(got, (want.dq, want.dk, want.dv)):
        close(t(g), w, tol=3e-2)
    assert numpy_device[-1].entry == "sdpa_backward"
    assert numpy_device[-1].names[:6] == ("dout", "query", "key", "value", "out", "lse")


def test_grad_of_an_additive_sdpa_mask(numpy_device, rng):
    """A float mask gets its cotangent (the backward's callback writes it, always: JAX does
    not say whether it is wanted); a boolean one none."""
    q = randn(rng, (2, 2, 5, 16))
    mask = jnp.asarray(rng.standard_normal((2, 1, 5)), jnp.float32)
    dout = rng.standard_normal((2, 2, 5, 16))

    def loss(q, mask):
        out = cufa.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        return (out.astype(jnp.float32) * dout).sum()
    dq, dmask = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, mask)
    t = (lambda x: np.asarray(x, np.float64).transpose(0, 2, 1, 3))
    want = reference.attention_backward(t(q), t(q), t(q), t(dout), diag_offset=0,
                                        attn_mask=np.asarray(mask, np.float64))
    assert dmask.shape == mask.shape and dmask.dtype == mask.dtype
    close(dmask, want.dmask, tol=3e-2)
    assert numpy_device[-1].out_dtypes[-2] == "float32"  # (the mask's, before the scratch)


def test_fp8_forward_is_one_callback_eager_and_under_jit(monkeypatch, rng, jax_cpu_callbacks):
    """q, k, v in jnp.float8_e4m3fn run the fp8 forward as one buffer callback (eagerly
    too: DLPack importers do not all take float8), dense and packed: q, k, v cross as uint8
    and are read as float8 by the spec's layouts, the descales are arguments, out is
    bfloat16 and lse has the 16-bit forward's shape."""
    specs, crossed = [], []

    def on_device(spec, ctx, outs, bufs):
        specs.append(spec)
        crossed.append(tuple(str(np.asarray(b).dtype) for b in (*bufs, *outs)))
    monkeypatch.setattr(_jax, "on_device", on_device)
    q, k = randn(rng, (2, 7, 4, 32), fp8), randn(rng, (2, 9, 2, 32), fp8)
    scale = jnp.full((2, 2), 0.5, f32)
    o, lse = jax.jit(lambda q, k, s: cufa.flash_attn_func(
        q, k, k, causal=True, q_descale=s, k_descale=s, return_lse=True))(q, k, scale)
    assert (o.dtype, o.shape, lse.dtype, lse.shape) == (jnp.bfloat16, q.shape, f32, (2, 4, 7))
    assert cufa.flash_attn_func(q, k, k).dtype == jnp.bfloat16  # eager, no descales
    cu = jnp.asarray([0, 3, 7], i32)
    o, lse = cufa.flash_attn_varlen_func(q[0], k[0, :7], k[0, :7], cu, cu, 4, 4,
                                         v_descale=scale, q_descale=scale, return_lse=True)
    assert (o.dtype, o.shape, lse.shape) == (jnp.bfloat16, (7, 4, 32), (4, 7))
    traced, eager, packed = specs
    assert (traced.entry, eager.entry, packed.entry) == (
        "flash_attn_fp8", "flash_attn_fp8", "flash_attn_varlen_fp8")
    assert traced.names == ("q", "k", "v", "q_descale", "k_descale")
    assert sorted(eager.names) == ["k", "q", "v"]  # (the eager jit's dict of arrays)
    assert traced.options == dict(softmax_scale=None, causal=True, window_size=(-1, -1))
    for spec in specs:
        assert spec.layouts[spec.names.index("q")][2:] == ("float8_e4m3fn", 1)
        assert spec.out_dtypes[:2] == ("bfloat16", "float32")
    assert sorted(packed.names) == ["cu_seqlens_k", "cu_seqlens_q", "k", "q", "q_descale",
                                    "v", "v_descale"]
    assert not any("float8" in dtype for dtypes in crossed for dtype in dtypes)


@pytest.mark.parametrize("call, error, match", [
    (lambda q, k: cufa.flash_attn_func(q[..., :24], k[..., :24], k[..., :24]), ValueError,
     "multiples of 16"),
    (lambda q, k: cufa.flash_attn_func(q, k, k, k_descale=jnp.ones((3,), f32)), ValueError,
     "k_descale"),
    (lambda q, k: cufa.flash_attn_func(q, k, k, softcap=5.0), NotImplementedError, "softcap"),
    (lambda q, k: cufa.flash_attn_func(q, k.astype(jnp.bfloat16), k), TypeError,
     "k has dtype bfloat16"),
])
def test_fp8_forward_under_jit_refuses_bad_calls_while_tracing(call, error, match, rng,
                                                               jax_cpu_callbacks):
    q, k = randn(rng, (2, 7, 4, 32), fp8), randn(rng, (2, 9, 2, 32), fp8)
    with pytest.raises(error, match=match):
        jax.make_jaxpr(call)(q, k)


def test_fp8_forward_under_grad_and_vmap_says_what_to_do(rng, jax_cpu_callbacks):
    q, k = randn(rng, (2, 7, 4, 32), fp8), randn(rng, (2, 9, 2, 32), fp8)
    scale = jnp.full((2, 2), 0.5, f32)
    with pytest.raises(NotImplementedError, match="has no backward pass"):
        jax.make_jaxpr(jax.grad(
            lambda s: cufa.flash_attn_func(q, k, k, q_descale=s).astype(f32).sum()))(scale)
    with pytest.raises(NotImplementedError, match="no batching rule"):
        jax.make_jaxpr(jax.vmap(lambda q: cufa.flash_attn_func(q, k, k)))(jnp.stack([q, q]))
