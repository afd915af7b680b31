"""GPU: the frameworks' compiled modes -- CUDA graphs (torch and CuPy capture, replayed
with new input values), torch.compile (dense with dynamic shapes and mode="reduce-overhead",
varlen, KV cache with and without an append, merge) and jax.jit (real kernels on XLA's
stream; the KV-cache append with and without donation, and eagerly). Every output is
checked against the float64 reference (pass rule in _attention_check.py) and every cache
byte after an append against the reference's cache; where a compiled call should give the
eager call's bits, that is checked as well."""
import math

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import cufa  # noqa: E402
from cufa import reference  # noqa: E402
from _attention_check import (  # noqa: E402
    assert_pass_rule, capture_cuda_graph, check_appended_cache, check_attention,
    kvcache_references, randn)

NAN = float("nan")


def _close(a, b, tol=2e-3):
    a, b = a.float(), b.float()
    fin = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), fin)
    err = (a[fin] - b[fin]).abs().max().item() if fin.any() else 0.0
    assert err <= tol, err


def _starts(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)


def _cu(lens):
    return torch.tensor(_starts(lens), dtype=torch.int32, device="cuda")


def _check_sequences(out, lse, q, keys, values, lens_q, label, **kw):
    """A packed call's out (total, h, d) and lse (h, total) or None: sequence b's rows
    (lens_q[b] of them) against the reference over keys[b] and values[b], (1, n, hk, d)
    each; sequences without rows are skipped."""
    starts = _starts(lens_q)
    for b, (kb, vb) in enumerate(zip(keys, values)):
        s, e = starts[b], starts[b + 1]
        if e > s:
            check_attention(out[s:e][None], None if lse is None else lse[:, s:e][None],
                            q[s:e][None], kb, vb, label=f"{label}: seq {b} ({e - s} x "
                            f"{kb.shape[1]})", **kw)


def _packed_keys(k, v, lens_k, used=None):
    """Sequence b's keys and values of packed k, v (total_k, hk, d): the first used[b] (or
    lens_k[b]) of its rows."""
    starts = _starts(lens_k)
    n = lens_k if used is None else used
    return ([x[None, starts[b]:starts[b] + n[b]] for b in range(len(lens_k))] for x in (k, v))


def _paged_keys(k_pages, v_pages, table, lens_k):
    """Sequence b's first lens_k[b] keys and values of a paged cache (torch)."""
    table = np.asarray(table)
    return ([reference.from_paged(p, table)[b:b + 1, :n] for b, n in enumerate(lens_k)]
            for p in (k_pages, v_pages))


def _append_slots(lens, new, table=None, page_size=None):
    """The cache slots an append of `new` keys at positions lens[b].. writes, as an index
    of the cache's first two axes: (row, position), or (page, row in page) with a table."""
    lens = np.asarray(lens)
    pos = lens[:, None] + np.arange(new)[None, :]
    if table is None:
        rows = np.broadcast_to(np.arange(len(lens))[:, None], pos.shape)
        return rows.ravel(), pos.ravel()
    table = np.asarray(table)
    return (table[np.arange(len(lens))[:, None], pos // page_size].ravel(),
            (pos % page_size).ravel())


# -- CUDA graphs ---------------------------------------------------------------------------

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
        for x in (out, lse, sd):
            x.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        check_attention(out, lse, q, k, v, causal=True, label=f"replay {step}")
        check_attention(sd.transpose(1, 2), None, q, k, v, causal=True, diag_offset=0,
                        label=f"replay {step} sdpa")
        o_eager, lse_eager = cufa.flash_attn_func(q, k, v, causal=True, return_lse=True)
        _close(out, o_eager, 0)
        _close(lse, lse_eager, 0)
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
        cu.copy_(_cu(lens))
        for x in (q, k, v):
            x.copy_(randn(rng, (1,) + tuple(x.shape), "float16")[0])
        out.fill_(NAN)
        lse.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        _check_sequences(out, lse, q, *_packed_keys(k, v, lens), lens, f"lens {lens}",
                         causal=True)
        o_eager, lse_eager = cufa.flash_attn_varlen_func(q, k, v, cu, cu, total, total,
                                                         causal=True, return_lse=True)
        _close(out, o_eager, 0)
        _close(lse, lse_eager, 0)


def test_graph_replays_a_paged_serving_step_with_new_lengths_and_pages():
    """One paged flash_attn_varlen_func call of prefill chunks (the Hopper kernels' page
    boxes) and decodes (the decode kernel, most keys first), captured once and replayed
    with new query and key lengths, page tables and mixes of the two kinds: each sequence
    against the reference, and the same out and lse as the eager call, bit for bit."""
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
        cu_q.copy_(_cu(lens_q))
        cu_k.copy_(_cu(lens_k))
        table.copy_(torch.randperm(pages, device="cuda")[:b * width].reshape(b, width).int())
        q.copy_(randn(rng, (1, total, h, d), "float16")[0])
        out.fill_(NAN)
        lse.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        _check_sequences(out, lse, q, *_paged_keys(k_pages, v_pages, table.cpu(), lens_k),
                         lens_q, f"lens {lens_q} x {lens_k}", causal=True)
        o_eager, lse_eager = step()
        rows = sum(lens_q)
        assert torch.equal(out[:rows].view(torch.int16), o_eager[:rows].view(torch.int16))
        assert torch.equal(lse[:, :rows], lse_eager[:, :rows])


def test_graph_replays_kvcache_and_merge_with_new_lengths_and_pages():
    """A decode step and a merge of two different states in one graph: the keys of each
    sequence split at page 10 (the first 160 keys and the rest, each attended by its own
    call on its half of the block table), merged; replayed with new lengths, pages and
    queries, the merge must be the attention over all the keys (a state merged with
    itself would hide swapped weights)."""
    rng = np.random.default_rng(2)
    b, pages, page, hk, h, d = 3, 64, 16, 2, 8, 128
    k_pages, v_pages = (randn(rng, (pages, page, hk, d), "float16") for _ in range(2))
    q = randn(rng, (b, 1, h, d), "float16")
    lens, lens_a, lens_b = (torch.zeros(b, dtype=torch.int32, device="cuda") for _ in range(3))
    table = torch.randperm(pages, device="cuda")[:b * 20].reshape(b, 20).int()
    table_a, table_b = table[:, :10].contiguous(), table[:, 10:].contiguous()
    split = 10 * page

    def step():
        o, lse = cufa.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=lens,
                                              block_table=table, return_softmax_lse=True)
        o_a, lse_a = cufa.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=lens_a,
                                                  block_table=table_a, return_softmax_lse=True)
        o_b, lse_b = cufa.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=lens_b,
                                                  block_table=table_b, return_softmax_lse=True)
        return (o, lse) + cufa.merge_attention_states(o_a, lse_a, o_b, lse_b)
    graph, (out, lse, merged, merged_lse) = capture_cuda_graph(step)
    for i in range(3):
        n = torch.randint(0, 20 * page + 1, (b,), dtype=torch.int32)
        n[i] = 0  # a sequence without keys: out 0, lse -inf, merged the same
        n[(i + 1) % b] = int(rng.integers(1, split + 1))  # one with keys in the first part only
        lens.copy_(n)
        lens_a.copy_(n.clamp(max=split))
        lens_b.copy_(n - n.clamp(max=split))
        table.copy_(torch.randperm(pages, device="cuda")[:b * 20].reshape(b, 20).int())
        table_a.copy_(table[:, :10])
        table_b.copy_(table[:, 10:])
        q.copy_(randn(rng, (b, 1, h, d), "float16"))
        for x in (out, lse, merged, merged_lse):
            x.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        label = f"lens {lens.tolist()}"
        ref, lowp, _, _ = kvcache_references(q, k_pages, v_pages, cache_seqlens=lens,
                                             block_table=table)
        assert_pass_rule(out, lse, ref, lowp, q.dtype, label)
        # two parts, each rounded to fp16, then merged and rounded again
        assert_pass_rule(merged, merged_lse, ref, lowp, q.dtype, f"{label} merged", roundings=3)
        o_eager, lse_eager = cufa.flash_attn_with_kvcache(q, k_pages, v_pages,
                                                          cache_seqlens=lens, block_table=table,
                                                          return_softmax_lse=True)
        _close(out, o_eager, 0)
        _close(lse, lse_eager, 0)


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
        with stream:  # (a non-blocking stream does not wait for the legacy default one)
            q[...] = cupy.asarray(rng.standard_normal(q.shape), dtype=cupy.float16)
            out.fill(NAN)
            graph.launch(stream)
        stream.synchronize()
        q_t = torch.from_dlpack(q)
        check_attention(torch.from_dlpack(out), None, q_t, q_t, q_t, causal=True)
        ref = cufa.flash_attn_func(q, q, q, causal=True)
        assert float(cupy.abs(out.astype(cupy.float32) - ref.astype(cupy.float32)).max()) == 0


# -- torch.compile -------------------------------------------------------------------------

def test_torch_compile_dynamic_lengths_compile_once():
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()

    @torch.compile(fullgraph=True, dynamic=True)
    def block(x, w):
        q = (x @ w).view(x.shape[0], x.shape[1], 4, 64)
        o = cufa.flash_attn_func(q, q, q, causal=True)
        return q, o, o.flatten(2) + x
    rng = np.random.default_rng(4)
    w = randn(rng, (1, 1, 256, 256), "float16")[0, 0] / 16
    for n in (100, 257, 640):
        x = randn(rng, (2, n, 1, 256), "float16")[:, :, 0]
        q, o, y = block(x, w)
        check_attention(o, None, q, q, q, causal=True, label=f"n={n}")
        torch.testing.assert_close(y, o.flatten(2) + x)  # the residual, fused by inductor
    assert counters["stats"]["unique_graphs"] == 1


def test_torch_compile_reduce_overhead_runs_an_attention_block():
    import torch._dynamo
    torch._dynamo.reset()
    rng = np.random.default_rng(5)
    w = randn(rng, (1, 1, 128, 384), "float16")[0, 0] / 12

    @torch.compile(mode="reduce-overhead", fullgraph=True)
    def block(x):
        q, k, v = (x @ w).view(x.shape[0], x.shape[1], 3, 2, 64).unbind(2)
        return q, k, v, cufa.flash_attn_func(q, k, v, causal=True)
    x = randn(rng, (2, 96, 1, 128), "float16")[:, :, 0]
    for step in range(4):  # warm-up, record, replays
        x.copy_(randn(rng, (2, 96, 1, 128), "float16")[:, :, 0])
        q, k, v, o = (t.clone() for t in block(x))  # (the graph's outputs are reused)
        check_attention(o, None, q, k, v, causal=True, label=f"call {step}")


def test_torch_compile_varlen_op():
    """flash_attn_varlen_func inside torch.compile: packed with seqused_k and softcap, and
    paged through a block table; new lengths every call."""
    import torch._dynamo
    torch._dynamo.reset()
    rng = np.random.default_rng(10)
    h, hk, d, total_q, total_k = 4, 2, 64, 300, 420

    @torch.compile(fullgraph=True)
    def packed(q, k, v, cu_q, cu_k, used):
        return cufa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 200, 300, causal=True,
                                           softcap=15.0, seqused_k=used, return_lse=True)
    for lens_q, lens_k, used in (([100, 0, 200], [120, 0, 300], [120, 0, 257]),
                                 ([1, 150, 149], [300, 97, 23], [1, 60, 23])):
        q = randn(rng, (1, total_q, h, d), "bfloat16")[0]
        k, v = (randn(rng, (1, total_k, hk, d), "bfloat16")[0] for _ in range(2))
        used_t = torch.tensor(used, dtype=torch.int32, device="cuda")
        out, lse = packed(q, k, v, _cu(lens_q), _cu(lens_k), used_t)
        _check_sequences(out, lse, q, *_packed_keys(k, v, lens_k, used), lens_q,
                         f"packed {lens_q} x {used}", causal=True, softcap=15.0)

    pages, page, width = 48, 16, 14

    @torch.compile(fullgraph=True)
    def paged(q, k_pages, v_pages, cu_q, cu_k, table):
        return cufa.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 200, width * page,
                                           causal=True, block_table=table, return_lse=True)
    for lens_q, lens_k in (([1, 200, 99], [160, 200, 99]), ([3, 1, 17], [3, 150, 77])):
        q = randn(rng, (1, total_q, h, d), "float16")[0]
        k_pages, v_pages = (randn(rng, (pages, page, hk, d), "float16") for _ in range(2))
        table = rng.permutation(pages)[:3 * width].reshape(3, width).astype(np.int32)
        out, lse = paged(q, k_pages, v_pages, _cu(lens_q), _cu(lens_k),
                         torch.from_numpy(table).cuda())
        _check_sequences(out, lse, q, *_paged_keys(k_pages, v_pages, table, lens_k), lens_q,
                         f"paged {lens_q} x {lens_k}", causal=True)


@pytest.mark.parametrize("append", [False, True], ids=["decode", "append rotary"])
def test_torch_compile_kvcache_op(append):
    """flash_attn_with_kvcache inside torch.compile on a paged cache: a decode (the op that
    mutates nothing: both caches bit for bit unchanged) and an append of 3 rotated keys
    (written into the caches in place: every cache byte against the reference)."""
    import torch._dynamo
    torch._dynamo.reset()
    rng = np.random.default_rng(11 + append)
    b, h, hk, d, cap, page, new = 3, 8, 2, 128, 96, 16, 3 if append else 0
    table, pages = reference.paged_layout(b, cap, page, rng)
    k_pages, v_pages = (reference.to_paged(randn(rng, (b, cap, hk, d), "float16"), table, pages,
                                           fill=NAN) for _ in range(2))
    q = randn(rng, (b, 3, h, d), "float16")
    k, v = ((randn(rng, (b, new, hk, d), "float16") for _ in range(2)) if append
            else (None, None))
    cos = sin = None
    if append:
        angles = torch.from_numpy(rng.uniform(-math.pi, math.pi, (cap, d // 2))).cuda()
        cos, sin = angles.cos().float(), angles.sin().float()
    lens = np.array([0, 40, cap - new])
    before = {"k_cache": k_pages.clone(), "v_cache": v_pages.clone()}

    @torch.compile(fullgraph=True)
    def step(q, k_cache, v_cache, k, v, cos, sin, lens, table):
        return cufa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin,
                                            cache_seqlens=lens, block_table=table, causal=True,
                                            rotary_interleaved=False, return_softmax_lse=True)
    table_t = torch.from_numpy(table).cuda()
    out, lse = step(q, k_pages, v_pages, k, v, cos, sin,
                    torch.tensor(lens, dtype=torch.int32, device="cuda"), table_t)
    ref, lowp, k_after, v_after = kvcache_references(
        q, before["k_cache"], before["v_cache"], k, v, rotary_cos=cos, rotary_sin=sin,
        cache_seqlens=lens, block_table=table, causal=True, rotary_interleaved=False)
    label = "append" if append else "decode"
    assert_pass_rule(out, lse, ref, lowp, q.dtype, label)
    slots = _append_slots(lens, new, table, page)
    check_appended_cache(k_pages, before["k_cache"], k_after, slots, f"{label}: k_cache",
                         rotated=append)
    check_appended_cache(v_pages, before["v_cache"], v_after, slots, f"{label}: v_cache")


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_torch_compile_merge_op(packed):
    """merge_attention_states inside torch.compile: two halves of the keys, merged, are the
    attention over all of them."""
    import torch._dynamo
    torch._dynamo.reset()
    rng = np.random.default_rng(13 + packed)
    b = 1 if packed else 2
    q = randn(rng, (b, 37, 4, 96), "bfloat16")
    k, v = (randn(rng, (b, 150, 2, 96), "bfloat16") for _ in range(2))
    # causal over all 150 keys: every row sees keys [0, 61), and of [61, 150) what a causal
    # call on those alone shows it (bottom-right alignment)
    parts = (list(cufa.flash_attn_func(q, k[:, :61], v[:, :61], return_lse=True))
             + list(cufa.flash_attn_func(q, k[:, 61:], v[:, 61:], causal=True, return_lse=True)))
    if packed:
        parts = [x[0] for x in parts]
    merge = torch.compile(lambda *p: cufa.merge_attention_states(*p), fullgraph=True)
    out, lse = merge(*parts)
    if packed:
        out, lse = out[None], lse[None]
    check_attention(out, lse, q, k, v, causal=True, label="merged")


# -- jax.jit -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def jax():
    jax = pytest.importorskip("jax")
    from cufa import _jax
    if not _jax.available():
        pytest.skip("this JAX has no buffer_callback")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX sees no GPU")
    return jax


def _t(x):
    """A JAX array as a torch tensor (the same memory), once it is computed."""
    return torch.from_dlpack(x.block_until_ready())


def _jnp(rng, shape, dtype="float16"):
    import jax.numpy as jnp
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32), getattr(jnp, dtype))


def test_jax_jit_runs_the_kernels_on_xla_stream(jax):
    import jax.numpy as jnp
    rng = np.random.default_rng(6)
    q, k, v = (_jnp(rng, (2, 300, 4, 64)) for _ in range(3))

    @jax.jit
    def step(q, k, v):
        o, lse = cufa.flash_attn_func(q * 0.5, k, v, causal=True, return_lse=True)
        return o.astype(jnp.float32) * 2, lse
    o, lse = step(q, k, v)
    check_attention(_t(o) / 2, _t(lse), _t(q * 0.5), _t(k), _t(v), causal=True)
    o_eager, lse_eager = cufa.flash_attn_func(q * 0.5, k, v, causal=True, return_lse=True)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_eager, np.float32) * 2)
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_eager))


@pytest.mark.parametrize("mode", ["eager", "jit", "jit donating"])
@pytest.mark.parametrize("cache", ["contiguous", "paged rotary"])
def test_jax_kvcache_append_returns_the_caches(jax, mode, cache):
    """An append with JAX arrays returns (out, lse, k_cache, v_cache): eagerly and under
    jax.jit XLA copies each cache into a new array and the inputs stay as they were; with
    the caches donated the append writes into their memory. out and lse against the
    reference; every byte of both returned caches against the reference's caches."""
    import jax.numpy as jnp
    rng = np.random.default_rng(7)
    b, cap, hk, h, d, seqlen_q, new = 3, 64, 2, 8, 64, 2, 2
    lens = np.array([10, 0, cap - new])
    q = _jnp(rng, (b, seqlen_q, h, d))
    k, v = (_jnp(rng, (b, new, hk, d)) for _ in range(2))
    extra = {"cache_seqlens": jnp.asarray(lens, jnp.int32)}
    table = page = None
    if cache == "contiguous":
        k_cache, v_cache = (_jnp(rng, (b, cap, hk, d)) for _ in range(2))
    else:
        page = 16
        table, pages = reference.paged_layout(b, cap, page, rng)
        k_cache, v_cache = (_jnp(rng, (pages, page, hk, d)) for _ in range(2))
        angles = rng.uniform(-math.pi, math.pi, (cap, d // 2))
        extra.update(block_table=jnp.asarray(table), rotary_cos=jnp.asarray(np.cos(angles),
                     jnp.float32), rotary_sin=jnp.asarray(np.sin(angles), jnp.float32))
    # host copies (a DLPack view would be an external reference that blocks the donation)
    before = {"k_cache": np.array(k_cache), "v_cache": np.array(v_cache)}
    addresses = [c.unsafe_buffer_pointer() for c in (k_cache, v_cache)]

    def call(q, k_cache, v_cache, k, v, extra):
        return cufa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **extra, causal=True,
                                            return_softmax_lse=True)
    fn = {"eager": call, "jit": jax.jit(call),
          "jit donating": jax.jit(call, donate_argnums=(1, 2))}[mode]
    out, lse, k_after, v_after = fn(q, k_cache, v_cache, k, v, extra)

    q_t = _t(q)
    ref, lowp, k_ref, v_ref = kvcache_references(q_t, before["k_cache"], before["v_cache"],
                                                 _t(k), _t(v), causal=True,
                                                 **{n: _t(x) for n, x in extra.items()})
    assert_pass_rule(_t(out), _t(lse), ref, lowp, q_t.dtype, f"{mode} {cache}")
    slots = _append_slots(lens, new, table, page)
    for name, after, expected in (("k_cache", k_after, k_ref), ("v_cache", v_after, v_ref)):
        check_appended_cache(after, before[name], expected, slots, f"{mode} {cache}: {name}",
                             rotated=name == "k_cache" and table is not None)
    moved = [c.unsafe_buffer_pointer() != a for c, a in zip((k_after, v_after), addresses)]
    if mode == "jit donating":
        assert not any(moved), "the donated caches were copied"
    else:
        assert all(moved), "the returned caches share the inputs' memory"
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            check_appended_cache(c, before[name], before[name].astype(np.float64),
                                 _append_slots(lens, 0), f"{mode} {cache}: input {name}")


def test_jax_jit_sdpa(jax):
    """scaled_dot_product_attention under jax.jit: a float16 call with an additive mask of
    (1, h, L, S) and a scale, a bfloat16 one causal (top-left, L != S) with a bool mask."""
    import jax.numpy as jnp
    rng = np.random.default_rng(15)
    tr = (lambda x: x.transpose(1, 2))
    for dtype, is_causal in (("float16", False), ("bfloat16", True)):
        q = _jnp(rng, (2, 4, 33, 64), dtype)
        k, v = (_jnp(rng, (2, 4, 47, 64), dtype) for _ in range(2))
        if is_causal:
            mask, scale = rng.random((33, 47)) > 0.25, None
        else:
            mask, scale = (rng.standard_normal((1, 4, 33, 47)) * 3).astype(np.float16), 0.2
        step = jax.jit(lambda q, k, v, m: cufa.scaled_dot_product_attention(
            q, k, v, attn_mask=m, is_causal=is_causal, scale=scale))
        out = step(q, k, v, jnp.asarray(mask))
        mask_t = torch.from_numpy(mask if is_causal else mask.astype(np.float32))
        check_attention(tr(_t(out)), None, tr(_t(q)), tr(_t(k)), tr(_t(v)), attn_mask=mask_t,
                        causal=is_causal, softmax_scale=scale, diag_offset=0,
                        label=f"{dtype} causal={is_causal}")


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_jax_jit_merge(jax, packed):
    """merge_attention_states under jax.jit: two halves of the keys (attended eagerly),
    merged, are the attention over all of them."""
    rng = np.random.default_rng(16 + packed)
    b = 1 if packed else 2
    q = _jnp(rng, (b, 37, 4, 96))
    k, v = (_jnp(rng, (b, 150, 2, 96)) for _ in range(2))
    parts = (list(cufa.flash_attn_func(q, k[:, :61], v[:, :61], softcap=10.0, return_lse=True))
             + list(cufa.flash_attn_func(q, k[:, 61:], v[:, 61:], softcap=10.0,
                                         return_lse=True)))
    if packed:
        parts = [x[0] for x in parts]
    out, lse = jax.jit(cufa.merge_attention_states)(*parts)
    out, lse = _t(out), _t(lse)
    if packed:
        out, lse = out[None], lse[None]
    check_attention(out, lse, _t(q), _t(k), _t(v), softcap=10.0, label="merged")


def test_jax_jit_runs_a_paged_serving_step(jax):
    """A paged packed batch under jax.jit: the work list, the decode order and the split
    partials live in XLA's scratch; prefill chunks (page boxes) and decodes (the decode
    kernel) against the reference, and the eager call's bits, for new lengths and tables
    every call."""
    import jax.numpy as jnp
    rng = np.random.default_rng(9)
    b, pages, page, hk, h, d, width, total = 5, 160, 16, 2, 8, 128, 30, 300
    kc, vc = _jnp(rng, (pages, page, hk, d)), _jnp(rng, (pages, page, hk, d))

    @jax.jit
    def step(q, cu_q, cu_k, table):
        return cufa.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, total, width * page,
                                           causal=True, block_table=table, return_lse=True)

    for lens_q, lens_k in (([1, 200, 1, 2, 96], [470, 260, 9, 100, 400]),
                           ([1, 1, 1, 1, 296], [480, 3, 0, 77, 296])):
        q = _jnp(rng, (total, h, d))
        cu_q = jnp.asarray(_starts(lens_q), jnp.int32)
        cu_k = jnp.asarray(_starts(lens_k), jnp.int32)
        table = rng.permutation(pages)[:b * width].reshape(b, width).astype(np.int32)
        o, lse = step(q, cu_q, cu_k, jnp.asarray(table))
        _check_sequences(_t(o), _t(lse), _t(q), *_paged_keys(_t(kc), _t(vc), table, lens_k),
                         lens_q, f"lens {lens_q} x {lens_k}", causal=True)
        o_eager, lse_eager = cufa.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, total,
                                                         width * page, causal=True,
                                                         block_table=jnp.asarray(table),
                                                         return_lse=True)
        np.testing.assert_array_equal(np.asarray(o), np.asarray(o_eager))
        np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_eager))


def test_jax_jit_replays_with_new_values_every_call(jax):
    """The callbacks are command_buffer_compatible: XLA may record the launches once and
    replay them from a CUDA graph without calling back into Python. Every call here gets
    new inputs and new lengths (packed batch, split-KV decode over a paged cache); each
    result against the reference, and the eager call's bits on the same values."""
    import jax.numpy as jnp
    rng = np.random.default_rng(8)
    total, h, hk, d, page, pages = 640, 8, 2, 64, 16, 48

    @jax.jit
    def step(q, k, v, cu, qd, kc, vc, lens, table):
        o = cufa.flash_attn_varlen_func(q, k, v, cu, cu, total, total, causal=True)
        od, lse = cufa.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens,
                                               block_table=table, num_splits=3,
                                               return_softmax_lse=True)
        return o * 2, od, lse

    for lens_q, lens_k in (([640, 0, 0], [1, 211, 0]), ([1, 638, 1], [250, 17, 96]),
                           ([200, 200, 240], [0, 0, 1]), ([333, 7, 300], [256, 255, 129])):
        q, k, v = _jnp(rng, (total, h, d)), _jnp(rng, (total, hk, d)), _jnp(rng, (total, hk, d))
        cu = jnp.asarray(_starts(lens_q), jnp.int32)
        qd, kc, vc = (_jnp(rng, (3, 1, h, d)), _jnp(rng, (pages, page, hk, d)),
                      _jnp(rng, (pages, page, hk, d)))
        lens = jnp.asarray(lens_k, jnp.int32)
        table = jnp.asarray(rng.permutation(pages)[:48].reshape(3, 16), jnp.int32)
        o, od, lse = step(q, k, v, cu, qd, kc, vc, lens, table)
        label = f"lens {lens_q}, decode {lens_k}"
        _check_sequences(_t(o) / 2, None, _t(q), *_packed_keys(_t(k), _t(v), lens_q), lens_q,
                         label, causal=True)
        ref, lowp, _, _ = kvcache_references(_t(qd), _t(kc), _t(vc), cache_seqlens=_t(lens),
                                             block_table=_t(table))
        assert_pass_rule(_t(od), _t(lse), ref, lowp, torch.float16, f"{label}: decode")
        o_eager = cufa.flash_attn_varlen_func(q, k, v, cu, cu, total, total, causal=True)
        od_eager, lse_eager = cufa.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens,
                                                           block_table=table, num_splits=3,
                                                           return_softmax_lse=True)
        np.testing.assert_array_equal(np.asarray(o), np.asarray(o_eager * 2))
        np.testing.assert_array_equal(np.asarray(od), np.asarray(od_eager))
        np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_eager))
