"""GPU: the frameworks' compiled modes -- CUDA graphs (torch and CuPy capture, replayed
with new input values), torch.compile with dynamic shapes and mode="reduce-overhead", and
jax.jit (real kernels on XLA's stream, the KV-cache append under donation)."""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import cufa  # noqa: E402
from _attention_check import capture_cuda_graph, randn  # noqa: E402


def _close(a, b, tol=2e-3):
    a, b = a.float(), b.float()
    fin = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), fin)
    err = (a[fin] - b[fin]).abs().max().item() if fin.any() else 0.0
    assert err <= tol, err


def test_graph_replays_dense_and_sdpa_with_new_values():
    rng = np.random.default_rng(0)
    q, k, v = (randn(rng, (2, 200, 4, 64), "float16") for _ in range(3))
    graph, (out, lse, sd) = capture_cuda_graph(lambda: cufa.flash_attn_func(q, k, v, causal=True,
                                                                   return_lse=True)
                                     + (cufa.scaled_dot_product_attention(
                                         q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True),))
    for step in range(3):
        for x in (q, k, v):
            x.copy_(randn(rng, tuple(x.shape), "float16"))
        graph.replay()
        torch.cuda.synchronize()
        o_ref, lse_ref = cufa.flash_attn_func(q, k, v, causal=True, return_lse=True)
        _close(out, o_ref, 0)
        _close(lse, lse_ref, 0)
        _close(sd, cufa.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                     v.transpose(1, 2), is_causal=True), 0)


def test_graph_replays_varlen_with_new_cu_seqlens():
    rng = np.random.default_rng(1)
    total = 600
    q, k, v = (randn(rng, (1, total, 4, 64), "float16")[0] for _ in range(3))
    cu = torch.tensor([0, 100, 350, 600], dtype=torch.int32, device="cuda")
    graph, (out, lse) = capture_cuda_graph(lambda: cufa.flash_attn_varlen_func(
        q, k, v, cu, cu, total, total, causal=True, return_lse=True))
    for lens in ([600, 0, 0], [1, 598, 1], [200, 200, 200]):
        cu.copy_(torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        o_ref, lse_ref = cufa.flash_attn_varlen_func(q, k, v, cu, cu, total, total, causal=True,
                                                     return_lse=True)
        _close(out, o_ref, 0)
        _close(lse, lse_ref, 0)


def test_graph_replays_a_paged_serving_step_with_new_lengths_and_pages():
    """One paged flash_attn_varlen_func call of prefill chunks (the Hopper kernels' page
    boxes) and decodes (the decode kernel, most keys first), captured once and replayed
    with new query and key lengths, page tables and mixes of the two kinds: the same out
    and lse as the eager call, bit for bit."""
    rng = np.random.default_rng(3)
    b, pages, page, hk, h, d, width, total = 6, 200, 16, 2, 8, 128, 30, 400
    k_pages, v_pages = (randn(rng, (pages, page, hk, d), "float16") for _ in range(2))
    q = randn(rng, (1, total, h, d), "float16")[0]
    cu_q = torch.zeros(b + 1, dtype=torch.int32, device="cuda")
    cu_k = torch.zeros(b + 1, dtype=torch.int32, device="cuda")
    table = torch.zeros(b, width, dtype=torch.int32, device="cuda")

    def step():
        return cufa.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, total, width * page,
                                           causal=True, block_table=table, return_lse=True)
    graph, (out, lse) = capture_cuda_graph(step)
    for lens_q, lens_k in (([1, 1, 200, 1, 150, 2], [30, 470, 260, 9, 480, 100]),
                           ([300, 1, 1, 1, 1, 1], [310, 1, 480, 200, 64, 16]),
                           ([0, 4, 17, 1, 1, 0], [0, 400, 17, 0, 123, 5])):
        cu_q.copy_(torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32))
        cu_k.copy_(torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32))
        table.copy_(torch.randperm(pages, device="cuda")[:b * width].reshape(b, width).int())
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        o_ref, lse_ref = step()
        rows = sum(lens_q)
        assert torch.equal(out[:rows].view(torch.int16), o_ref[:rows].view(torch.int16))
        assert torch.equal(lse[:, :rows], lse_ref[:, :rows])


def test_graph_replays_kvcache_and_merge_with_new_lengths_and_pages():
    rng = np.random.default_rng(2)
    b, pages, page, hk, h, d = 3, 64, 16, 2, 8, 128
    k_pages, v_pages = (randn(rng, (pages, page, hk, d), "float16") for _ in range(2))
    q = randn(rng, (b, 1, h, d), "float16")
    lens = torch.tensor([5, 100, 250], dtype=torch.int32, device="cuda")
    table = torch.randperm(pages, device="cuda")[:b * 20].reshape(b, 20).int()

    def step():
        o, lse = cufa.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=lens,
                                              block_table=table, return_softmax_lse=True)
        return (o, lse) + cufa.merge_attention_states(o, lse, o, lse)
    graph, (out, lse, merged, merged_lse) = capture_cuda_graph(step)
    for _ in range(3):
        lens.copy_(torch.randint(0, 20 * page + 1, (b,), dtype=torch.int32))
        table.copy_(torch.randperm(pages, device="cuda")[:b * 20].reshape(b, 20).int())
        graph.replay()
        torch.cuda.synchronize()
        o_ref, lse_ref = cufa.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=lens,
                                                      block_table=table, return_softmax_lse=True)
        _close(out, o_ref, 0)
        _close(lse, lse_ref, 0)
        _close(merged, o_ref, 2e-3)
        _close(merged_lse, lse_ref + np.log(2), 1e-4)


def test_cupy_stream_capture_replays_with_new_values():
    cupy = pytest.importorskip("cupy")
    rng = np.random.default_rng(3)
    q = cupy.asarray(rng.standard_normal((1, 128, 2, 64)), dtype=cupy.float16)
    cufa.flash_attn_func(q, q, q)  # warm: plans, kernels, the memory pool
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        out = cufa.flash_attn_func(q, q, q, causal=True)
        graph = stream.end_capture()
    for _ in range(3):
        q[...] = cupy.asarray(rng.standard_normal(q.shape), dtype=cupy.float16)
        graph.launch(stream)
        stream.synchronize()
        ref = cufa.flash_attn_func(q, q, q, causal=True)
        assert float(cupy.abs(out.astype(cupy.float32) - ref.astype(cupy.float32)).max()) == 0


def test_torch_compile_dynamic_lengths_compile_once():
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()

    @torch.compile(fullgraph=True, dynamic=True)
    def block(x, w):
        q = (x @ w).view(x.shape[0], x.shape[1], 4, 64)
        return cufa.flash_attn_func(q, q, q, causal=True).flatten(2) + x
    rng = np.random.default_rng(4)
    w = randn(rng, (1, 1, 256, 256), "float16")[0, 0] / 16
    for n in (100, 257, 640):
        x = randn(rng, (2, n, 1, 256), "float16")[:, :, 0]
        y = block(x, w)
        q = (x @ w).view(2, n, 4, 64)
        _close(y, cufa.flash_attn_func(q, q, q, causal=True).flatten(2) + x, 2e-2)
    assert counters["stats"]["unique_graphs"] == 1


def test_torch_compile_reduce_overhead_runs_an_attention_block():
    import torch._dynamo
    torch._dynamo.reset()
    rng = np.random.default_rng(5)
    w = randn(rng, (1, 1, 128, 384), "float16")[0, 0] / 12

    @torch.compile(mode="reduce-overhead", fullgraph=True)
    def block(x):
        q, k, v = (x @ w).view(x.shape[0], x.shape[1], 3, 2, 64).unbind(2)
        return cufa.flash_attn_func(q, k, v, causal=True).flatten(2)
    x = randn(rng, (2, 96, 1, 128), "float16")[:, :, 0]
    for _ in range(4):  # warm-up, record, replays
        x.copy_(randn(rng, (2, 96, 1, 128), "float16")[:, :, 0])
        y = block(x).clone()
        q, k, v = (x @ w).view(2, 96, 3, 2, 64).unbind(2)
        _close(y, cufa.flash_attn_func(q, k, v, causal=True).flatten(2), 2e-2)


def test_jax_jit_runs_the_kernels_on_xla_stream():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from cufa import _jax
    if not _jax.available():
        pytest.skip("this JAX has no buffer_callback")
    rng = np.random.default_rng(6)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 300, 4, 64)), jnp.float16) for _ in range(3))

    @jax.jit
    def step(q, k, v):
        o, lse = cufa.flash_attn_func(q * 0.5, k, v, causal=True, return_lse=True)
        return o.astype(jnp.float32) * 2, lse
    o, lse = step(q, k, v)
    o_eager, lse_eager = cufa.flash_attn_func(q * 0.5, k, v, causal=True, return_lse=True)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_eager, np.float32) * 2)
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_eager))
    ref = jax.nn.dot_product_attention(q * 0.5, k, v, is_causal=True)
    np.testing.assert_allclose(np.asarray(o) / 2, np.asarray(ref, np.float32), atol=2e-2)


def test_jax_jit_kvcache_append_with_donation():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from cufa import _jax
    if not _jax.available():
        pytest.skip("this JAX has no buffer_callback")
    rng = np.random.default_rng(7)
    b, cap, hk, h, d = 2, 64, 2, 8, 64
    f16 = (lambda shape: jnp.asarray(rng.standard_normal(shape), jnp.float16))
    kc, vc = f16((b, cap, hk, d)), f16((b, cap, hk, d))
    kc_host, vc_host = np.asarray(kc), np.asarray(vc)

    @jax.jit
    def decode(q, kc, vc, k, v, lens):
        return cufa.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, causal=True)
    decode_donating = jax.jit(decode, donate_argnums=(1, 2))
    q, k, v = f16((b, 1, h, d)), f16((b, 1, hk, d)), f16((b, 1, hk, d))
    lens = jnp.asarray([10, 40], jnp.int32)
    o, kc2, vc2 = decode_donating(q, kc, vc, k, v, lens)
    expect_k = kc_host.copy()
    for i, n in enumerate([10, 40]):
        expect_k[i, n] = np.asarray(k)[i, 0]
    np.testing.assert_array_equal(np.asarray(kc2), expect_k)
    o_ref = cufa.flash_attn_with_kvcache(q, kc2, vc2, cache_seqlens=lens + 1, causal=True)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_ref))
    assert vc_host.shape == np.asarray(vc2).shape


def test_jax_jit_runs_a_paged_serving_step():
    """A paged packed batch under jax.jit: the work list, the decode order and the split
    partials live in XLA's scratch; prefill chunks (page boxes) and decodes (the decode
    kernel) give the eager call's bits, for new lengths and tables every call."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from cufa import _jax
    if not _jax.available():
        pytest.skip("this JAX has no buffer_callback")
    rng = np.random.default_rng(9)
    b, pages, page, hk, h, d, width, total = 5, 160, 16, 2, 8, 128, 30, 300

    def f16(shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float16)

    kc, vc = f16((pages, page, hk, d)), f16((pages, page, hk, d))

    @jax.jit
    def step(q, cu_q, cu_k, table):
        return cufa.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, total, width * page,
                                           causal=True, block_table=table, return_lse=True)

    for lens_q, lens_k in (([1, 200, 1, 2, 96], [470, 260, 9, 100, 400]),
                           ([1, 1, 1, 1, 296], [480, 3, 0, 77, 296])):
        q = f16((total, h, d))
        cu_q = jnp.asarray(np.concatenate([[0], np.cumsum(lens_q)]), jnp.int32)
        cu_k = jnp.asarray(np.concatenate([[0], np.cumsum(lens_k)]), jnp.int32)
        table = jnp.asarray(rng.permutation(pages)[:b * width].reshape(b, width), jnp.int32)
        o, lse = step(q, cu_q, cu_k, table)
        o_ref, lse_ref = cufa.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, total, width * page,
                                                     causal=True, block_table=table,
                                                     return_lse=True)
        np.testing.assert_array_equal(np.asarray(o), np.asarray(o_ref))
        np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_ref))


def test_jax_jit_replays_with_new_values_every_call():
    """The callbacks are command_buffer_compatible: XLA may record the launches once and
    replay them from a CUDA graph without calling back into Python. Every call here gets
    new inputs and new lengths (packed batch, split-KV decode over a paged cache); each
    result must match the eager call on the same values."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from cufa import _jax
    if not _jax.available():
        pytest.skip("this JAX has no buffer_callback")
    rng = np.random.default_rng(8)
    total, h, hk, d, page, pages = 640, 8, 2, 64, 16, 48

    def f16(shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float16)

    @jax.jit
    def step(q, k, v, cu, qd, kc, vc, lens, table):
        o = cufa.flash_attn_varlen_func(q, k, v, cu, cu, total, total, causal=True)
        od, lse = cufa.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens,
                                               block_table=table, num_splits=3,
                                               return_softmax_lse=True)
        return o * 2, od, lse

    for lens_q, lens_k in (([640, 0, 0], [1, 300, 0]), ([1, 638, 1], [250, 17, 96]),
                           ([200, 200, 240], [0, 0, 1]), ([333, 7, 300], [256, 255, 129])):
        q, k, v = f16((total, h, d)), f16((total, hk, d)), f16((total, hk, d))
        cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens_q)]), jnp.int32)
        qd, kc, vc = f16((3, 1, h, d)), f16((pages, page, hk, d)), f16((pages, page, hk, d))
        lens = jnp.asarray(lens_k, jnp.int32)
        table = jnp.asarray(rng.permutation(pages)[:48].reshape(3, 16), jnp.int32)
        o, od, lse = (np.asarray(x) for x in step(q, k, v, cu, qd, kc, vc, lens, table))
        o_ref = cufa.flash_attn_varlen_func(q, k, v, cu, cu, total, total, causal=True)
        od_ref, lse_ref = cufa.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens,
                                                       block_table=table, num_splits=3,
                                                       return_softmax_lse=True)
        np.testing.assert_array_equal(o, np.asarray(o_ref * 2))
        np.testing.assert_array_equal(od, np.asarray(od_ref))
        np.testing.assert_array_equal(lse, np.asarray(lse_ref))
        ref = jax.nn.dot_product_attention(q[None, :lens_q[0]], k[None, :lens_q[0]],
                                           v[None, :lens_q[0]], is_causal=True)[0]
        np.testing.assert_allclose(o[:lens_q[0]] / 2, np.asarray(ref, np.float32), atol=2e-2)
