"""GPU: a head dim of v's own (q and k of 192, v and out of 128: DeepSeek's prefill) in
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
OPTIONS = {
    "full": {},
    "causal": dict(causal=True),
    "window": dict(causal=True, window_size=(77, 0)),
    "softcap": dict(causal=True, softcap=15.0),
}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", OPTIONS)
@pytest.mark.parametrize("d, d_v", [(192, 128), (176, 104)])
def test_dense(rng, dtype, name, d, d_v):
    batch, sq, sk, h, hk = 2, 129, 301, 8, 2
    q = randn(rng, (batch, sq, h, d), dtype)
    k = randn(rng, (batch, sk, hk, d), dtype)
    v = randn(rng, (batch, sk, hk, d_v), dtype)
    out = torch.full((batch, sq, h, d_v), NAN, dtype=q.dtype, device="cuda")
    res, lse = cufa.flash_attn_func(q, k, v, out=out, return_lse=True, **OPTIONS[name])
    assert res is out
    check_attention(out, lse, q, k, v, label=f"{dtype} {name} d={d}/{d_v}", **OPTIONS[name])


def test_dense_alibi_and_sink(rng):
    q, k = randn(rng, (2, 65, 4, 192), "bfloat16"), randn(rng, (2, 65, 4, 192), "bfloat16")
    v = randn(rng, (2, 65, 4, 128), "bfloat16")
    slopes = torch.from_numpy(rng.uniform(0.01, 0.3, 4).astype(np.float32)).cuda()
    sink = make_sink(rng, 4)
    out, lse = cufa.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes,
                                    learnable_sink=sink, return_lse=True)
    assert out.shape == (2, 65, 4, 128)
    check_attention(out, lse, q, k, v, label="alibi + sink d=192/128", causal=True,
                    alibi_slopes=slopes, learnable_sink=sink)


@pytest.mark.parametrize("name", ["causal", "window"])
def test_varlen(rng, name):
    lens_q, lens_k = [1, 0, 200, 77, 512], [1, 9, 700, 77, 600]
    h, hk = 16, 4
    q = randn(rng, (1, sum(lens_q), h, 192), "float16")[0]
    k = randn(rng, (1, sum(lens_k), hk, 192), "float16")[0]
    v = randn(rng, (1, sum(lens_k), hk, 128), "float16")[0]
    out, lse = cufa.flash_attn_varlen_func(q, k, v, cu_seqlens(lens_q), cu_seqlens(lens_k),
                                           max(lens_q), max(lens_k), return_lse=True,
                                           **OPTIONS[name])
    assert out.shape == (sum(lens_q), h, 128)
    starts = np.concatenate([[0], np.cumsum(lens_k)])
    k_rows = torch.zeros(len(lens_k), max(lens_k), hk, 192, dtype=k.dtype, device="cuda")
    v_rows = torch.zeros(len(lens_k), max(lens_k), hk, 128, dtype=v.dtype, device="cuda")
    for b, n in enumerate(lens_k):
        k_rows[b, :n], v_rows[b, :n] = k[starts[b]:starts[b] + n], v[starts[b]:starts[b] + n]
    check_packed_sequences(out, lse, q, k_rows, v_rows, lens_q, lens_k, f"varlen {name}",
                           **OPTIONS[name])


def test_under_torch_compile(rng):
    q, k = randn(rng, (1, 100, 4, 192), "float16"), randn(rng, (1, 100, 4, 192), "float16")
    v = randn(rng, (1, 100, 4, 128), "float16")
    step = torch.compile(lambda q, k, v: cufa.flash_attn_func(q, k, v, causal=True,
                                                              return_lse=True),
                         fullgraph=True)
    out, lse = step(q, k, v)
    assert out.shape == (1, 100, 4, 128)
    check_attention(out, lse, q, k, v, label="torch.compile d=192/128", causal=True)
