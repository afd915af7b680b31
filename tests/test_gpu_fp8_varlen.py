"""GPU: flash_attn_varlen_func over an fp8 (float8_e4m3fn) paged cache with k_descale and
v_descale: prefill chunks (the forward's e4m3 K/V variant) and decode-sized sequences (the
e4m3 decode kernel) in one call, each sequence against the float64 reference of the
dequantized cache under the per-row pass rule. Slots past a sequence's keys and pages of
no sequence hold e4m3's largest value (448): read, they would move the rows far past the
rule (an e4m3 NaN code is a finite 480 to the kernels, so NaN cannot poison here)."""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import cufa  # noqa: E402
from cufa import reference  # noqa: E402
from _attention_check import cu_seqlens, i32, randn  # noqa: E402
from test_gpu_kvcache import check_packed_sequences  # noqa: E402

E4M3 = getattr(torch, "float8_e4m3fn", None)
if E4M3 is None:
    pytest.skip("this PyTorch has no float8_e4m3fn", allow_module_level=True)
NAN = float("nan")
POISON = 0x7E  # e4m3 448


def fp8_cache(rng, batch, capacity, heads_k, d, lens_k, table, num_pages, descale):
    """An e4m3 cache (batch, capacity, heads_k, d) of normal draws of 4 (448 past each
    sequence's keys), its descale ("per_head" (batch, heads_k), "one" (1,)), the float32
    dequantized cache, and its pages (unused pages 448)."""
    x = torch.from_numpy(rng.standard_normal((batch, capacity, heads_k, d), dtype=np.float32) * 4)
    codes = x.clamp(-448, 448).to(E4M3).view(torch.uint8)
    for b, n in enumerate(lens_k):
        codes[b, n:] = POISON
    shape = (batch, heads_k) if descale == "per_head" else (1,)
    scale = torch.from_numpy(rng.uniform(0.05, 0.5, shape).astype(np.float32))
    per_row = scale.view(batch, 1, heads_k, 1) if descale == "per_head" else scale
    dequantized = (codes.view(E4M3).float() * per_row).cuda()
    pages = reference.to_paged(codes.cuda(), table, num_pages, fill=POISON).view(E4M3)
    return pages, scale.cuda(), dequantized


CASES = {
    # heads, head dim, dtype, query rows and keys of each sequence (16 // group rows and
    # fewer: the decode kernel), options
    "GQA 8/2 d128 fp16 causal": ((8, 2), 128, "float16", [1, 2, 300, 5, 64, 0, 129],
                                 [90, 2, 700, 1000, 64, 5, 300], dict(causal=True)),
    "MQA 16/1 d64 bf16 window softcap": ((16, 1), 64, "bfloat16", [1, 3, 200, 64],
                                         [500, 2, 300, 64],
                                         dict(causal=True, window_size=(100, 0), softcap=20.0)),
    "MHA 4/4 d256 bf16": ((4, 4), 256, "bfloat16", [37, 1, 200], [300, 9, 1000], {}),
    "GQA 8/2 d96 fp16 causal": ((8, 2), 96, "float16", [40, 1, 77], [100, 33, 500],
                                dict(causal=True)),
    "GQA 4/1 d32 fp16": ((4, 1), 32, "float16", [3, 70], [7, 1000], {}),
}


@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("name", CASES)
def test_fp8_paged_varlen(rng, name, page_size):
    (h, hk), d, dtype, lens_q, lens_k, options = CASES[name]
    batch, capacity = len(lens_q), 1024
    table, num_pages = reference.paged_layout(batch, capacity, page_size, rng)
    descale = "per_head" if page_size != 64 else "one"
    (k_pages, k_scale, k_deq), (v_pages, v_scale, v_deq) = (
        fp8_cache(rng, batch, capacity, hk, d, lens_k, table, num_pages, descale)
        for _ in range(2))
    q = randn(rng, (1, sum(lens_q), h, d), dtype)[0]
    out = torch.full_like(q, NAN)
    res, lse = cufa.flash_attn_varlen_func(
        q, k_pages, v_pages, cu_seqlens(lens_q), cu_seqlens(lens_k), max(lens_q), max(lens_k),
        return_lse=True, out=out, block_table=i32(table), k_descale=k_scale,
        v_descale=v_scale, **options)
    assert res is out and lse.shape == (h, sum(lens_q))
    check_packed_sequences(out, lse, q, k_deq, v_deq, lens_q, lens_k,
                           f"fp8 {name}, pages of {page_size}, descale {descale}", **options)


def test_fp8_paged_varlen_under_torch_compile(rng):
    """The same call traced by torch.compile (the descales two more tensors of the op)."""
    h, hk, d, lens_q, lens_k = 8, 2, 128, [2, 150], [40, 600]
    table, num_pages = reference.paged_layout(2, 1024, 16, rng)
    (k_pages, k_scale, k_deq), (v_pages, v_scale, v_deq) = (
        fp8_cache(rng, 2, 1024, hk, d, lens_k, table, num_pages, "per_head") for _ in range(2))
    q = randn(rng, (1, sum(lens_q), h, d), "bfloat16")[0]
    cu_q, cu_k, t = cu_seqlens(lens_q), cu_seqlens(lens_k), i32(table)

    @torch.compile(fullgraph=True)
    def step(q, k, v, ks, vs):
        return cufa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 150, 600, causal=True,
                                           return_lse=True, block_table=t, k_descale=ks,
                                           v_descale=vs)
    out, lse = step(q, k_pages, v_pages, k_scale, v_scale)
    check_packed_sequences(out, lse, q, k_deq, v_deq, lens_q, lens_k, "fp8 torch.compile",
                           causal=True)


def test_fp8_paged_varlen_from_jax(rng):
    """JAX arrays (the torch cache's bytes, bitcast in JAX), eager and under jax.jit."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    h, hk, d, lens_q, lens_k = 8, 2, 64, [3, 90], [50, 700]
    table, num_pages = reference.paged_layout(2, 1024, 16, rng)
    (k_pages, k_scale, k_deq), (v_pages, v_scale, v_deq) = (
        fp8_cache(rng, 2, 1024, hk, d, lens_k, table, num_pages, "per_head") for _ in range(2))
    q = randn(rng, (1, sum(lens_q), h, d), "float16")[0]

    def to_jax(t):
        torch.cuda.synchronize()  # (JAX reads it on its own stream, which does not wait)
        if t.dtype == E4M3:
            return jax.lax.bitcast_convert_type(jax.dlpack.from_dlpack(t.view(torch.uint8)),
                                                jnp.float8_e4m3fn)
        return jax.dlpack.from_dlpack(t.contiguous())
    args = [to_jax(x) for x in (q, k_pages, v_pages, cu_seqlens(lens_q), cu_seqlens(lens_k),
                                i32(table), k_scale, v_scale)]

    def call(q, k, v, cu_q, cu_k, table, ks, vs):
        return cufa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 90, 700, causal=True,
                                           return_lse=True, block_table=table, k_descale=ks,
                                           v_descale=vs)
    for label, fn in (("JAX eager", call), ("jax.jit", jax.jit(call))):
        results = fn(*args)
        out, lse = (torch.from_dlpack(x).clone() for x in results)
        torch.cuda.synchronize()  # (the clones read JAX's buffers: keep them until done)
        del results
        check_packed_sequences(out, lse, q, k_deq, v_deq, lens_q, lens_k, f"fp8 {label}",
                               causal=True)
