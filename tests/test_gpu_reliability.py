"""GPU: large problems (64-bit offsets, grid limits), extreme values, and concurrency."""
import threading

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import cufa  # noqa: E402
from cufa import _compile  # noqa: E402
from _attention_check import assert_pass_rule, check_attention, randn  # noqa: E402


def _rows_references(q, k, v, rows, causal):
    """The given query rows of (1, n, h, d) tensors, keys on the GPU: (float64 reference,
    low-precision reference with Q K^T and P V in the inputs' dtype), each (rows, h, d)."""
    sq, sk, d = q.shape[1], k.shape[1], q.shape[-1]
    rep = q.shape[2] // k.shape[2]
    low = [x[0].repeat_interleave(rep, dim=1) for x in (k, v)]          # (sk, h, d)
    high = [x.double() for x in low]
    ref, lowp = [], []
    for i in rows:
        for (keys, values), found in ((high, ref), (low, lowp)):
            s = torch.einsum("hd,khd->hk", q[0, i].to(keys.dtype), keys).double() / d ** 0.5
            if causal:
                s[:, i + sk - sq + 1:] = float("-inf")
            p = torch.softmax(s, dim=-1).to(values.dtype)
            found.append(torch.einsum("hk,khd->hd", p, values).double())
    return (torch.stack(x).cpu().numpy() for x in (ref, lowp))


def _check_rows(out, q, k, v, rows, causal):
    """The pass rule on each sampled row alone: the rows' outputs differ in scale (a row
    that sees a few keys against one that sees 100k), so one bound over all of them
    would let a small row's output be anything near zero."""
    ref, lowp = _rows_references(q, k, v, rows, causal)
    for j, i in enumerate(rows):
        assert_pass_rule(out[0, i], None, (ref[j], None), (lowp[j], None), q.dtype,
                         f"row {i}")


def test_q_with_more_than_2_31_elements():
    gen = torch.Generator(device="cuda").manual_seed(0)
    n = 2**31 // (16 * 64) + 97                       # q: (1, n, 16, 64) > 2^31 elements
    q, k, v = (torch.randn((1, rows, 16, 64), device="cuda", dtype=torch.float16, generator=gen)
               for rows in (n, 256, 256))
    assert q.numel() > 2**31
    out = cufa.flash_attn_func(q, k, v)
    rows = [0, 1, n // 2, n - 2, n - 1]
    _check_rows(out, q, k, v, rows, causal=False)
    del q, out
    torch.cuda.empty_cache()


def test_seqlen_128k_head_dim_128():
    rng = np.random.default_rng(1)
    n = 128 * 1024
    q, k, v = (randn(rng, (1, n, 2, 128), "bfloat16") for _ in range(3))
    out = cufa.flash_attn_func(q, k, v, causal=True)
    _check_rows(out, q, k, v, [0, 5, 4097, n // 3, n - 1], causal=True)


def test_65536_sequences_in_one_packed_batch():
    rng = np.random.default_rng(2)
    lens = [int(x) for x in rng.integers(0, 6, 65536)]
    q = randn(rng, (1, sum(lens), 2, 64), "float16")[0]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
    out, lse = cufa.flash_attn_varlen_func(q, q, q, cu, cu, 5, 5, causal=True, return_lse=True)
    c = np.concatenate([[0], np.cumsum(lens)])
    for b in list(range(0, 65536, 4099)) + [65535]:
        s, e = c[b], c[b + 1]
        if e > s:
            check_attention(out[s:e][None], lse[:, s:e][None], q[s:e][None], q[s:e][None],
                            q[s:e][None], causal=True)


def test_many_heads_times_batch():
    rng = np.random.default_rng(3)
    q = randn(rng, (4096, 3, 32, 32), "float16")       # 131072 (batch, head) pairs
    out = cufa.flash_attn_func(q, q, q)
    check_attention(out[-2:], None, q[-2:], q[-2:], q[-2:])


@pytest.mark.parametrize("kw", [dict(softcap=1e-3), dict(softcap=1e4),
                                dict(alibi=1e3), dict(alibi=1e-6)],
                         ids=["softcap-tiny", "softcap-huge", "alibi-huge", "alibi-tiny"])
def test_extreme_softcap_and_alibi(kw):
    rng = np.random.default_rng(4)
    q, k, v = (randn(rng, (2, 70, 4, 64), "float16", scale=3.0) for _ in range(3))
    args = dict(causal=True)
    if "softcap" in kw:
        args["softcap"] = kw["softcap"]
    else:
        args["alibi_slopes"] = torch.full((4,), kw["alibi"], device="cuda")
    out, lse = cufa.flash_attn_func(q, k, v, return_lse=True, **args)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    check_attention(out, lse, q, k, v, **args)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("ramp", ["first-keys-large", "last-keys-large"])
def test_row_max_rising_block_after_block(d, dtype, causal, ramp):
    """Keys scaled 1..14x along the sequence, so a row's scores span ~±100 and, when the
    large keys come last in the kernel's order (it visits a tile's key blocks last first),
    its running max rises block after block, past the lazy max's slack of 2^8 every few
    blocks: raises and O rescales after the first block run, not only the first's."""
    rng = np.random.default_rng(7)
    n = 1000
    q, k, v = (randn(rng, (2, n, 2, d), dtype) for _ in range(3))
    ramp_up = torch.linspace(1.0, 14.0, n, device="cuda")
    factor = ramp_up.flip(0) if ramp == "first-keys-large" else ramp_up
    k = (k.float() * factor[None, :, None, None]).to(k.dtype)
    out = torch.full_like(q, float("nan"))
    _, lse = cufa.flash_attn_func(q, k, v, causal=causal, return_lse=True, out=out)
    check_attention(out, lse, q, k, v, causal=causal)


def test_inf_inputs_propagate_without_hang():
    rng = np.random.default_rng(5)
    q, k, v = (randn(rng, (1, 50, 2, 64), "float16") for _ in range(3))
    k[0, 10, 0, 0] = float("inf")
    out = cufa.flash_attn_func(q, k, v, causal=True)
    torch.cuda.synchronize()
    assert not torch.isfinite(out[0, 10:, 0]).all()          # rows that see the inf key
    assert torch.isfinite(out[0, :10, 0]).all() and torch.isfinite(out[0, :, 1]).all()


def _in_two_threads(work):
    """Run work(0) and work(1) at the same time; re-raise what either raised."""
    results, errors = [None, None], []
    start = threading.Barrier(2)

    def run(i):
        try:
            start.wait()
            results[i] = work(i)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def test_two_threads_two_streams():
    rng = np.random.default_rng(6)
    inputs = [[randn(rng, (2, 300, 4, 64), "bfloat16") for _ in range(3)] for _ in range(2)]

    def work(i):
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for _ in range(20):
                out = cufa.flash_attn_func(*inputs[i], causal=bool(i))
        stream.synchronize()
        return out

    results = _in_two_threads(work)
    for i in range(2):
        check_attention(results[i], None, *inputs[i], causal=bool(i))


def test_first_use_compiles_once_from_two_threads(monkeypatch):
    import cupy
    compiles = []
    real = cupy.RawModule

    def counting(*args, **kwargs):
        compiles.append(kwargs.get("name_expressions"))
        return real(*args, **kwargs)

    monkeypatch.setattr(cupy, "RawModule", counting)
    monkeypatch.setattr(_compile, "_kernels", {})
    rng = np.random.default_rng(7)
    q = randn(rng, (1, 33, 2, 40), "bfloat16")
    outs = _in_two_threads(lambda i: cufa.flash_attn_func(q, q, q, window_size=(5, 3), softcap=7.0))
    assert len(compiles) == 1, compiles
    check_attention(outs[0], None, q, q, q, window_size=(5, 3), softcap=7.0)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
