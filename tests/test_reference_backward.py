"""CPU: reference.attention_backward, the float64 gradients the backward kernels will be
held to, against central finite differences of reference.attention itself (every mask
kind, softcap, ALiBi, sinks, GQA, a value head dim of its own, rows that see no key, an
additive mask's gradient summed over its broadcast dimensions), and against PyTorch's
autograd through its own SDPA in float64 where PyTorch is installed."""
import zlib

import numpy as np
import pytest

from cufa import reference

CASES = {
    "plain": {},
    "causal": dict(causal=True),
    "causal, more keys": dict(causal=True, sk=9),
    "causal, more queries (rows with no key)": dict(causal=True, sq=9, sk=5),
    "window": dict(window_size=(2, 1)),
    "softcap": dict(softcap=0.7),
    "alibi": dict(alibi=True, causal=True),
    "sink": dict(sink=True),
    "sink, no key for some rows": dict(sink=True, causal=True, sq=8, sk=4),
    "bool mask": dict(mask="bool"),
    "additive mask (1, h, 1, sk)": dict(mask="float", mask_shape=(1, 4, 1, 7)),
    "additive mask (sq, sk)": dict(mask="float", mask_shape=(6, 7), diag_offset=0),
    "everything": dict(causal=True, softcap=1.5, alibi=True, sink=True, mask="float",
                       mask_shape=(2, 1, 6, 7), window_size=(3, -1)),
    "MQA, value head dim 5": dict(heads_k=1, dv=5, causal=True),
}


def _inputs(case, rng):
    b, sq, sk, h = 2, case.get("sq", 6), case.get("sk", 7), 4
    hk, d, dv = case.get("heads_k", 2), 3, case.get("dv", 3)
    q, k = rng.standard_normal((b, sq, h, d)), rng.standard_normal((b, sk, hk, d))
    v, dout = rng.standard_normal((b, sk, hk, dv)), rng.standard_normal((b, sq, h, dv))
    kw = {n: case[n] for n in ("causal", "window_size", "softcap", "diag_offset") if n in case}
    if case.get("alibi"):
        kw["alibi_slopes"] = rng.uniform(0.1, 0.9, h)
    if case.get("sink"):
        kw["learnable_sink"] = rng.standard_normal(h)
    if case.get("mask") == "bool":
        kw["attn_mask"] = rng.random((b, h, sq, sk)) > 0.3
    elif case.get("mask") == "float":
        shape = case["mask_shape"]
        kw["attn_mask"] = rng.standard_normal(shape)
    return q, k, v, dout, kw


def _numerical(f, x, eps=1e-6):
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        old = x[i]
        x[i] = old + eps
        hi = f()
        x[i] = old - eps
        lo = f()
        x[i] = old
        g[i] = (hi - lo) / (2 * eps)
    return g


@pytest.mark.parametrize("name", list(CASES))
def test_gradients_match_finite_differences(name):
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    q, k, v, dout, kw = _inputs(CASES[name], rng)

    def loss():
        out, _ = reference.attention(q, k, v, **kw)
        return float((out * dout).sum())
    grads = reference.attention_backward(q, k, v, dout, **kw)
    for got, x, what in ((grads.dq, q, "dq"), (grads.dk, k, "dk"), (grads.dv, v, "dv")):
        want = _numerical(loss, x)
        np.testing.assert_allclose(got, want, atol=1e-7, rtol=1e-6, err_msg=f"{name}: {what}")
    if "learnable_sink" in kw:
        want = _numerical(loss, kw["learnable_sink"])
        np.testing.assert_allclose(grads.dsink, want, atol=1e-7, rtol=1e-6)
    else:
        assert grads.dsink is None
    if CASES[name].get("mask") == "float":
        assert grads.dmask.shape == kw["attn_mask"].shape
        np.testing.assert_allclose(grads.dmask, _numerical(loss, kw["attn_mask"]), atol=1e-7,
                                   rtol=1e-6)
    else:
        assert grads.dmask is None


def test_rows_that_see_no_key_give_no_gradient():
    rng = np.random.default_rng(3)
    q, k, v, dout, kw = _inputs(dict(causal=True, sq=8, sk=4), rng)
    grads = reference.attention_backward(q, k, v, dout, **kw)
    # bottom-right: queries 0..3 of 8 see no key of 4
    assert np.all(grads.dq[:, :4] == 0) and np.any(grads.dq[:, 4:] != 0)


@pytest.mark.parametrize("mask", [None, "bool", "float"])
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_match_torch_autograd(mask, causal):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    b, h, hk, sq, sk, d = 2, 4, 2, 6, 6, 8
    q, dout = rng.standard_normal((b, sq, h, d)), rng.standard_normal((b, sq, h, d))
    k, v = rng.standard_normal((b, sk, hk, d)), rng.standard_normal((b, sk, hk, d))
    m = None
    if mask == "bool":
        m = rng.random((b, 1, sq, sk)) > 0.3
        m[..., 0] = True   # every row sees a key (PyTorch's math gives NaN otherwise)
    elif mask == "float":
        m = rng.standard_normal((1, h, sq, sk))
    grads = reference.attention_backward(q, k, v, dout, causal=causal, attn_mask=m,
                                         diag_offset=0)
    t = {n: torch.tensor(x.transpose(0, 2, 1, 3), requires_grad=True)
         for n, x in (("q", q), ("k", k), ("v", v))}
    leaf = None if m is None else torch.tensor(m, requires_grad=mask == "float")
    tm = leaf
    if causal and tm is not None:   # (SDPA takes one of the two)
        keep = torch.ones(sq, sk, dtype=torch.bool).tril()
        tm = tm.masked_fill(~keep, False) if mask == "bool" else tm + torch.where(
            keep, 0.0, float("-inf"))
    out = torch.nn.functional.scaled_dot_product_attention(
        t["q"], t["k"], t["v"], attn_mask=tm, is_causal=causal and tm is None,
        enable_gqa=True)
    (out * torch.tensor(dout.transpose(0, 2, 1, 3))).sum().backward()
    for n, got in (("q", grads.dq), ("k", grads.dk), ("v", grads.dv)):
        np.testing.assert_allclose(got, t[n].grad.numpy().transpose(0, 2, 1, 3), atol=1e-10,
                                   rtol=1e-9, err_msg=f"d{n}")
    if mask == "float":
        np.testing.assert_allclose(grads.dmask, leaf.grad.numpy(), atol=1e-10, rtol=1e-9)

