"""GPU: a head dim of v's own (q and k of 192, v and out of 128: DeepSeek's prefill; q and k
of 576, v and out of 512: its latent attention in the absorbed form, on the wide kernel) in
flash_attn_func and flash_attn_varlen_func, against the float64 reference under the
per-row pass rule: masks, softcap, ALiBi, sinks, GQA, odd lengths, torch.compile."""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import cufa  # noqa: E402
from _attention_check import check_attention, cu_seqlens, make_sink, randn  # noqa: E402
from test_gpu_kvcache import check_packed_sequences  # noqa: E402

NAN = float("nan")


def skip_without_latent_tiles(d):
    """q and k over 512 take 64 x 32 tiles of 136 KB: not on sm_86/89 (99 KB a block)."""
    from cufa import _compile, _runtime
    need = _compile.fwd_variant("fp16", _compile.WIDE_QK_HEAD_DIM, "none", False,
                                head_dim_v=_compile.WIDE_V_HEAD_DIM).smem_bytes
    if d > 512 and _runtime.smem_per_block(torch.cuda.current_device()) < need:
        pytest.skip(f"q and k over 512 need {need} bytes of shared memory a block")
OPTIONS = {
    "full": {},
    "causal": dict(causal=True),
    "window": dict(causal=True, window_size=(77, 0)),
    "softcap": dict(causal=True, softcap=15.0),
}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", OPTIONS)
@pytest.mark.parametrize("d, d_v", [(192, 128), (176, 104), (576, 512), (520, 264)])
def test_dense(rng, dtype, name, d, d_v):
    skip_without_latent_tiles(d)
    batch, sq, sk, h, hk = 2, 129, 301, 8, 2
    if d > 512:  # (the latent form: one KV head for all query heads)
        sq, h, hk = 33, 16, 1
    q = randn(rng, (batch, sq, h, d), dtype)
    k = randn(rng, (batch, sk, hk, d), dtype)
    v = randn(rng, (batch, sk, hk, d_v), dtype)
    out = torch.full((batch, sq, h, d_v), NAN, dtype=q.dtype, device="cuda")
    res, lse = cufa.flash_attn_func(q, k, v, out=out, return_lse=True, **OPTIONS[name])
    assert res is out
    check_attention(out, lse, q, k, v, label=f"{dtype} {name} d={d}/{d_v}", **OPTIONS[name])


@pytest.mark.parametrize("dtype, sq, sk, h, hk, d, d_v", [
    ("bfloat16", 65, 65, 4, 4, 192, 128), ("float16", 70, 150, 8, 2, 576, 512)])
def test_alibi_and_sink(rng, dtype, sq, sk, h, hk, d, d_v):
    """Causal, with ALiBi and a learnable sink: DeepSeek's prefill pair and the latent one."""
    skip_without_latent_tiles(d)
    q, k = randn(rng, (2, sq, h, d), dtype), randn(rng, (2, sk, hk, d), dtype)
    v = randn(rng, (2, sk, hk, d_v), dtype)
    slopes = torch.from_numpy(rng.uniform(0.01, 0.3, h).astype(np.float32)).cuda()
    sink = make_sink(rng, h)
    out, lse = cufa.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes,
                                    learnable_sink=sink, return_lse=True)
    assert out.shape == (2, sq, h, d_v)
    check_attention(out, lse, q, k, v, label=f"alibi + sink d={d}/{d_v}", causal=True,
                    alibi_slopes=slopes, learnable_sink=sink)


@pytest.mark.parametrize("name", ["causal", "window"])
@pytest.mark.parametrize("d, d_v", [(192, 128), (576, 512)])
def test_varlen(rng, name, d, d_v):
    skip_without_latent_tiles(d)
    lens_q, lens_k = [1, 0, 200, 77, 512], [1, 9, 700, 77, 600]
    h, hk = (16, 4) if d <= 512 else (8, 1)
    q = randn(rng, (1, sum(lens_q), h, d), "float16")[0]
    k = randn(rng, (1, sum(lens_k), hk, d), "float16")[0]
    v = randn(rng, (1, sum(lens_k), hk, d_v), "float16")[0]
    out, lse = cufa.flash_attn_varlen_func(q, k, v, cu_seqlens(lens_q), cu_seqlens(lens_k),
                                           max(lens_q), max(lens_k), return_lse=True,
                                           **OPTIONS[name])
    assert out.shape == (sum(lens_q), h, d_v)
    starts = np.concatenate([[0], np.cumsum(lens_k)])
    k_rows = torch.zeros(len(lens_k), max(lens_k), hk, d, dtype=k.dtype, device="cuda")
    v_rows = torch.zeros(len(lens_k), max(lens_k), hk, d_v, dtype=v.dtype, device="cuda")
    for b, n in enumerate(lens_k):
        k_rows[b, :n], v_rows[b, :n] = k[starts[b]:starts[b] + n], v[starts[b]:starts[b] + n]
    check_packed_sequences(out, lse, q, k_rows, v_rows, lens_q, lens_k,
                           f"varlen {name} d={d}/{d_v}", **OPTIONS[name])


def test_latent_pair_one_row(rng):
    """q and k of 576 against v of 512: the smallest call."""
    skip_without_latent_tiles(576)
    q, k = (randn(rng, (1, 1, 2, 576), "bfloat16") for _ in range(2))
    v = randn(rng, (1, 1, 2, 512), "bfloat16")
    out, lse = cufa.flash_attn_func(q, k, v, return_lse=True)
    check_attention(out, lse, q, k, v, label="576/512 1 x 1")


def test_under_torch_compile(rng):
    q, k = randn(rng, (1, 100, 4, 192), "float16"), randn(rng, (1, 100, 4, 192), "float16")
    v = randn(rng, (1, 100, 4, 128), "float16")
    step = torch.compile(lambda q, k, v: cufa.flash_attn_func(q, k, v, causal=True,
                                                              return_lse=True),
                         fullgraph=True)
    out, lse = step(q, k, v)
    assert out.shape == (1, 100, 4, 128)
    check_attention(out, lse, q, k, v, label="torch.compile d=192/128", causal=True)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_strided_views_and_long_rows(rng, dtype):
    """v a column slice of a wider array and out= a slice too (their TMA views and O's
    stores take the strides), GQA 12/4, 1000 query rows over 1500 keys (several tiles a
    head, the K/V stages reused many times), causal."""
    q = randn(rng, (2, 1000, 12, 192), dtype)
    k = randn(rng, (2, 1500, 4, 192), dtype)
    v_wide = randn(rng, (2, 1500, 4, 256), dtype)
    v = v_wide[..., 64:192]
    out_wide = torch.full((2, 1000, 12, 160), NAN, dtype=q.dtype, device="cuda")
    out = out_wide[..., 16:144]
    res, lse = cufa.flash_attn_func(q, k, v, causal=True, out=out, return_lse=True)
    assert res.data_ptr() == out.data_ptr()
    assert torch.isnan(out_wide[..., :16]).all() and torch.isnan(out_wide[..., 144:]).all()
    check_attention(out, lse, q, k, v, label=f"{dtype} strided v and out", causal=True)
