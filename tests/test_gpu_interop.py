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
    # the same shapes 8 bytes off alignment: refused, not served from the plan
    flat = torch.empty(q.numel() + 4, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="16-byte aligned"):
        cufa.flash_attn_func(flat[4:].view(shape), k, v, causal=True)


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
