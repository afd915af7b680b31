"""GPU: framework interop — returned types, zero copy, the caller's stream, JAX, torch.compile."""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import cufa  # noqa: E402
from _attention_check import check_attention, randn  # noqa: E402


def _busy(stream, n=4096, reps=20):
    """Queue enough work on `stream` that anything racing it reads stale data."""
    with torch.cuda.stream(stream):
        x = torch.randn(n, n, device="cuda")
        for _ in range(reps):
            x = x @ x
            x = x / x.norm()
    return x


def test_torch_side_stream_needs_no_user_sync():
    rng = np.random.default_rng(0)
    base = randn(rng, (2, 300, 4, 64), "float16")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    _busy(side)
    with torch.cuda.stream(side):
        q = base * 2.0            # produced on the busy stream, after the matmuls
        k, v = q + 1.0, q - 1.0
        out = cufa.flash_attn_func(q, k, v, causal=True)
        consumed = out.float() * 3.0  # consumed on the same stream
    torch.cuda.synchronize()
    check_attention(consumed / 3.0, None, (base * 2).half(), (base * 2 + 1).half(),
                    (base * 2 - 1).half(), causal=True)


def test_cupy_current_stream_is_used():
    cupy = pytest.importorskip("cupy")
    rng = np.random.default_rng(1)
    base = randn(rng, (1, 257, 2, 128), "float16")
    with cupy.cuda.Stream(non_blocking=True) as s:
        x = cupy.random.standard_normal((4096, 4096), dtype=cupy.float32)
        for _ in range(20):
            x = x @ x
            x /= cupy.linalg.norm(x)
        q = cupy.from_dlpack(base) * 2          # after the busy work, on s
        out = cufa.flash_attn_func(q, q, q)
        doubled = out * 2
    s.synchronize()
    assert isinstance(out, cupy.ndarray)
    q_t = base * 2
    check_attention(torch.from_dlpack(doubled).float() / 2, None, q_t, q_t, q_t)


def test_torch_outputs_and_out_share_memory():
    rng = np.random.default_rng(2)
    q = randn(rng, (2, 64, 4, 64), "float16")
    out = torch.empty_like(q)
    res, lse = cufa.flash_attn_func(q, q, q, out=out, return_lse=True)
    assert res is out and res.data_ptr() == out.data_ptr()
    assert type(lse) is torch.Tensor and lse.device == q.device


def test_repeated_signature_takes_new_addresses_and_layouts():
    """A call's plan is cached by its signature: a repeat with other arrays of the same
    shapes must read and write those, and any change of layout must be planned anew."""
    rng = np.random.default_rng(4)
    shape = (2, 77, 4, 64)
    for _ in range(2):  # same signature, fresh arrays each time
        q, k, v = (randn(rng, shape, "float16") for _ in range(3))
        out, lse = cufa.flash_attn_func(q, k, v, causal=True, return_lse=True)
        check_attention(out, lse, q, k, v, causal=True)
    # q strided (row stride 2 * h * d), out contiguous; then out strided, q contiguous
    q = randn(rng, (2, 77, 8, 64), "float16")[:, :, :4]
    out = cufa.flash_attn_func(q, k, v, causal=True)
    assert out.is_contiguous()
    check_attention(out, None, q, k, v, causal=True)
    wide = torch.full((2, 77, 4, 72), float("nan"), device="cuda", dtype=torch.float16)
    q = q.contiguous()
    res = cufa.flash_attn_func(q, k, v, causal=True, out=wide[..., :64])
    check_attention(res, None, q, k, v, causal=True)
    assert wide[..., 64:].isnan().all()  # the padding columns untouched
    # the same shapes 8 bytes off alignment: planned anew (the element-wise I/O kernel),
    # not served from the aligned plan
    flat = torch.empty(q.numel() + 4, device="cuda", dtype=torch.float16)
    shifted = flat[4:].view(shape)
    shifted.copy_(q)
    out, lse = cufa.flash_attn_func(shifted, k, v, causal=True, return_lse=True)
    check_attention(out, lse, shifted, k, v, causal=True)


def test_cupy_zero_copy_in_and_out():
    cupy = pytest.importorskip("cupy")
    rng = np.random.default_rng(3)
    q = cupy.asarray(rng.standard_normal((1, 100, 2, 64)).astype(np.float16))
    out = cupy.empty_like(q)
    res = cufa.flash_attn_func(q, q, q, out=out)
    assert res is out and res.data.ptr == out.data.ptr
    check_attention(torch.from_dlpack(res), None, *(torch.from_dlpack(q),) * 3)


def test_out_of_another_framework_is_refused():
    cupy = pytest.importorskip("cupy")
    q = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(TypeError, match="out is a cupy array but q is a torch array"):
        cufa.flash_attn_func(q, q, q, out=cupy.empty((1, 16, 2, 64), cupy.float16))


class _DLPackOnly:
    """An array type of no framework cufa knows: the DLPack protocol alone, around a CuPy
    array."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kw):
        return self.array.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def test_any_dlpack_object_is_read_in_place(rng):
    """Objects with only __dlpack__ / __dlpack_device__ are read through CuPy without a
    copy and get CuPy arrays back: the dense call, and a merge of two halves of the keys."""
    cupy = pytest.importorskip("cupy")
    from cufa import _interop
    q = randn(rng, (2, 77, 4, 64), "float16")
    k, v = (randn(rng, (2, 90, 2, 64), "float16") for _ in range(2))
    wrap = (lambda t: _DLPackOnly(cupy.from_dlpack(t)))
    assert _interop.as_device_array(wrap(q), "q").ptr == q.data_ptr()
    out, lse = cufa.flash_attn_func(wrap(q), wrap(k), wrap(v), causal=True, return_lse=True)
    assert isinstance(out, cupy.ndarray) and isinstance(lse, cupy.ndarray)
    check_attention(torch.from_dlpack(out), torch.from_dlpack(lse), q, k, v, causal=True)
    halves = [cufa.flash_attn_func(wrap(q), wrap(k[:, keys]), wrap(v[:, keys]), return_lse=True)
              for keys in (slice(0, 40), slice(40, 90))]
    merged, merged_lse = cufa.merge_attention_states(
        *(_DLPackOnly(x) for half in halves for x in half))
    assert isinstance(merged, cupy.ndarray) and isinstance(merged_lse, cupy.ndarray)
    check_attention(torch.from_dlpack(merged), torch.from_dlpack(merged_lse), q, k, v,
                    label="merged halves")


def test_bfloat16_cupy_arrays(rng):
    """bfloat16 CuPy arrays (ml_dtypes' dtype; here on torch tensors' memory, handed over
    as int16): the dense call with out= and lse, one with cufa allocating the output, and
    SDPA with a bfloat16 additive mask; the output is a bfloat16 CuPy array."""
    cupy = pytest.importorskip("cupy")
    ml_dtypes = pytest.importorskip("ml_dtypes")

    def as_cupy(t):
        return cupy.from_dlpack(t.view(torch.int16)).view(ml_dtypes.bfloat16)

    def as_torch(a):
        return torch.from_dlpack(a.view(cupy.int16)).view(torch.bfloat16)

    q = randn(rng, (2, 77, 4, 64), "bfloat16")
    k, v = (randn(rng, (2, 90, 2, 64), "bfloat16") for _ in range(2))
    out = torch.full_like(q, float("nan"))
    torch.cuda.synchronize()
    res, lse = cufa.flash_attn_func(as_cupy(q), as_cupy(k), as_cupy(v), causal=True,
                                    return_lse=True, out=as_cupy(out))
    allocated = cufa.flash_attn_func(as_cupy(q), as_cupy(k), as_cupy(v), window_size=(20, 3))
    qh, kh = q.transpose(1, 2), k.repeat_interleave(2, dim=2).transpose(1, 2)
    vh = v.repeat_interleave(2, dim=2).transpose(1, 2)
    mask = torch.from_numpy(rng.standard_normal((77, 90)) * 3).to("cuda", torch.bfloat16)
    sdpa = cufa.scaled_dot_product_attention(as_cupy(qh), as_cupy(kh), as_cupy(vh),
                                             attn_mask=as_cupy(mask))
    cupy.cuda.get_current_stream().synchronize()
    assert res.data.ptr == out.data_ptr()
    for a in (res, allocated, sdpa):
        assert isinstance(a, cupy.ndarray) and a.dtype.name == "bfloat16"
    check_attention(out, torch.from_dlpack(lse), q, k, v, label="out=", causal=True)
    check_attention(as_torch(allocated), None, q, k, v, label="window", window_size=(20, 3))
    check_attention(as_torch(sdpa).transpose(1, 2), None, q, kh.transpose(1, 2),
                    vh.transpose(1, 2), label="sdpa", attn_mask=mask, diag_offset=0)


@pytest.fixture(scope="module")
def jax():
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX sees no GPU")
    return jax


def test_jax_eager_values_types_and_zero_copy_inputs(jax):
    import cupy
    import jax.numpy as jnp
    rng = np.random.default_rng(4)
    host = [rng.standard_normal((2, 77, 4, 64)).astype(np.float32) for _ in range(3)]
    q, k, v = (jnp.asarray(x, dtype=jnp.bfloat16) for x in host)
    out, lse = cufa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert isinstance(out, jax.Array) and isinstance(lse, jax.Array)
    assert out.dtype == jnp.bfloat16 and lse.shape == (2, 4, 77)
    # inputs are read in place: CuPy's view of a JAX array has the same address
    assert cupy.from_dlpack(q).data.ptr == q.unsafe_buffer_pointer()
    to_t = (lambda a: torch.from_dlpack(a))
    check_attention(to_t(out), to_t(lse), to_t(q), to_t(k), to_t(v), causal=True)


def test_jax_out_is_refused_clearly_eager_and_under_jit(jax):
    import jax.numpy as jnp
    q = jnp.zeros((1, 8, 1, 64), jnp.float16) + 1
    with pytest.raises(TypeError, match="JAX arrays are immutable"):
        cufa.flash_attn_func(q, q, q, out=q)
    with pytest.raises(TypeError, match="out= is not supported for JAX arrays"):
        jax.jit(lambda x: cufa.flash_attn_func(x, x, x, out=x))(q)


def test_torch_compile_fullgraph_runs():
    rng = np.random.default_rng(5)
    q = randn(rng, (2, 128, 4, 64), "float16")
    k, v = (randn(rng, (2, 128, 2, 64), "float16") for _ in range(2))
    slopes = torch.rand(4, device="cuda")

    def block(q, k, v):
        out = cufa.flash_attn_func(q * 0.5, k, v, causal=True, alibi_slopes=slopes)
        return out, torch.nn.functional.gelu(out.float()).sum(dim=-1)

    compiled = torch.compile(block, fullgraph=True)
    (out_c, post_c), (out_e, post_e) = compiled(q, k, v), block(q, k, v)
    check_attention(out_c, None, q * 0.5, k, v, causal=True, alibi_slopes=slopes)
    torch.testing.assert_close(out_c, out_e, rtol=0, atol=0)   # the same kernel, bit for bit
    torch.testing.assert_close(post_c, post_e)                 # inductor fuses gelu + sum its own way

    sdpa = torch.compile(lambda a, b, c: cufa.scaled_dot_product_attention(a, b, c, is_causal=True),
                         fullgraph=True)
    qh = q.transpose(1, 2)
    out_s = sdpa(qh, qh, qh)
    check_attention(out_s.transpose(1, 2), None, q, q, q, causal=True, diag_offset=0)
    torch.testing.assert_close(out_s, cufa.scaled_dot_product_attention(qh, qh, qh, is_causal=True),
                               rtol=0, atol=0)
