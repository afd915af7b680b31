"""GPU: the backward pass (dq, dk, dv, dsink) against reference.attention_backward in
float64, held to the pass rule per row (tests/_backward_check.py). Every gradient array is
poisoned before the call."""
import zlib

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import cufa  # noqa: E402
from _attention_check import cu_seqlens, f64, randn  # noqa: E402
from _backward_check import check_grads, poisoned_like  # noqa: E402

DTYPES = (torch.float16, torch.bfloat16)
# the same bits every run: the default's dq kernel (no atomics), not the fused dq's atomic
# sums (bench/device_run.sh's fdq family runs this file with CUFA_BWD_FUSED_DQ=1)
# the same bits every run, and the same as other kernels' where they make the same products
# in the same order: deterministic=True (the dq kernel, never dq fused, whose float32 sums'
# order varies; bench/device_run.sh's fdq family runs this file with CUFA_BWD_FUSED_DQ=1)
EXACT = dict(deterministic=True)


def run_dense(rng, dtype, b, sq, sk, h, hk, d, label, layout="bshd", **kw):
    q = randn(rng, (b, sq, h, d), dtype, layout=layout)
    k, v = (randn(rng, (b, sk, hk, d), dtype, layout=layout) for _ in range(2))
    dout = randn(rng, (b, sq, h, d), dtype)
    out, lse = cufa.flash_attn_func(q, k, v, return_lse=True, **kw)
    grads = [poisoned_like(x) for x in (q, k, v)]
    got = cufa.flash_attn_backward(dout, q, k, v, out, lse, **kw, dq=grads[0], dk=grads[1],
                                   dv=grads[2])
    assert all(g is w for g, w in zip(got[:3], grads))
    kw.pop("deterministic", None)
    check_grads(got, q, k, v, dout, label, out=out, **kw)
    return q, k, v, dout, out, lse, got


DENSE = {
    "plain d64": dict(b=2, sq=128, sk=128, h=4, hk=4, d=64),
    "causal, more keys, GQA, d128": dict(b=1, sq=113, sk=300, h=4, hk=2, d=128, causal=True),
    "causal, more queries (rows without keys), MQA, d72": dict(b=2, sq=300, sk=113, h=4, hk=1,
                                                               d=72, causal=True),
    "one row, one key, d32": dict(b=1, sq=1, sk=1, h=2, hk=2, d=32),
    "window, d256 (dk and dv apart)": dict(b=1, sq=257, sk=257, h=2, hk=2, d=256,
                                           window_size=(32, 16)),
    "softcap, alibi, d160": dict(b=2, sq=65, sk=130, h=4, hk=2, d=160, softcap=20.0,
                                 alibi=True),
    "sink, causal, d128": dict(b=1, sq=77, sk=77, h=4, hk=4, d=128, causal=True, sink=True),
    "causal d192, strided": dict(b=1, sq=200, sk=200, h=2, hk=2, d=192, causal=True,
                                 layout="bhsd"),
    "long causal, q k v from one fused projection, d64": dict(b=1, sq=1100, sk=1100, h=2, hk=2,
                                                              d=64, causal=True, layout="qkv"),
    "window and softcap, d96": dict(b=1, sq=190, sk=170, h=2, hk=1, d=96, window_size=(8, -1),
                                    softcap=5.0),
    # (Hopper: dq on 32-key blocks with score mods above d = 128, dk and dv apart)
    "causal, softcap, GQA, d256": dict(b=1, sq=150, sk=200, h=4, hk=2, d=256, causal=True,
                                       softcap=10.0),
    "window, alibi, MQA, d184": dict(b=2, sq=130, sk=97, h=2, hk=1, d=184, window_size=(20, 5),
                                     alibi=True),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", list(DENSE))
def test_dense_backward(name, dtype):
    case = dict(DENSE[name])
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    kw = {}
    if case.pop("alibi", False):
        kw["alibi_slopes"] = torch.tensor(rng.uniform(0.05, 0.5, case["h"]), dtype=torch.float32,
                                          device="cuda")
    if case.pop("sink", False):
        kw["learnable_sink"] = torch.tensor(2 * rng.standard_normal(case["h"]),
                                            dtype=torch.float32, device="cuda")
    for n in ("causal", "window_size", "softcap"):
        if n in case:
            kw[n] = case.pop(n)
    run_dense(rng, dtype, label=f"{name} {dtype}", **case, **kw)


@pytest.mark.parametrize("seqlen", [1, 7, 65, 1000, 2049])
def test_odd_lengths(seqlen):
    """Lengths off every tile size, causal with more keys than queries (bottom-right), GQA."""
    rng = np.random.default_rng(seqlen)
    run_dense(rng, torch.bfloat16, 1, seqlen, seqlen + 3, 4, 2, 64, f"N={seqlen}", causal=True)


def test_gradients_are_the_same_bits_every_run():
    """deterministic=True: the same bits every run, where dq would otherwise be fused
    (Hopper, d = 128), through flash_attn_backward and through autograd."""
    rng = np.random.default_rng(5)
    q, k, v, dout, out, lse, got = run_dense(rng, torch.bfloat16, 2, 200, 200, 8, 2, 128,
                                             "determinism", causal=True, **EXACT)
    again = cufa.flash_attn_backward(dout, q, k, v, out, lse, causal=True, **EXACT)
    assert all(torch.equal(a, b) for a, b in zip(got[:3], again))
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    runs = []
    for _ in range(2):
        for x in leaves:
            x.grad = None
        cufa.flash_attn_func(*leaves, causal=True, **EXACT).backward(dout)
        runs.append([x.grad.clone() for x in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert all(torch.equal(a, b) for a, b in zip(runs[0], got[:3]))


def test_a_kept_plan_at_new_addresses(monkeypatch):
    """A backward that passes no gradient arrays of its own keeps its plan: the next call
    of its signature, on fresh arrays at other addresses, launches that plan. Both calls'
    gradients against the reference: a padded batch with a learnable sink (the plan
    allocates and zeroes dsink) and a packed one (the plan builds its work lists)."""
    from cufa import _bwd_plan
    rng = np.random.default_rng(37)
    cufa.api.clear_plans()
    planned, plan = [], _bwd_plan._plan
    monkeypatch.setattr(_bwd_plan, "_plan", lambda *a, **kw: planned.append(1) or plan(*a, **kw))
    held = []  # (the first call's arrays stay alive: the second's come at other addresses)
    for call in range(2):
        q = randn(rng, (2, 77, 4, 128), torch.bfloat16)
        k, v = (randn(rng, (2, 77, 2, 128), torch.bfloat16) for _ in range(2))
        dout = randn(rng, (2, 77, 4, 128), torch.bfloat16)
        sink = torch.tensor(2 * rng.standard_normal(4), dtype=torch.float32, device="cuda")
        out, lse = cufa.flash_attn_func(q, k, v, causal=True, return_lse=True,
                                        learnable_sink=sink)
        got = cufa.flash_attn_backward(dout, q, k, v, out, lse, causal=True,
                                       learnable_sink=sink)
        check_grads(got, q, k, v, dout, f"kept plan, call {call}", out=out, causal=True,
                    learnable_sink=sink)
        held.append((q, k, v, dout, out, lse, sink, got))
        lens = [0, 70, 1, 150]
        q, k, v, dout, cu, out, lse = causal_packed(rng, lens, 4, 64)
        grads = cufa.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu, cu, 150, 150,
                                                causal=True)
        check_packed_grads(grads, q, k, v, dout, out, lens, f"kept packed plan, call {call}")
        held.append((q, k, v, dout, cu, out, lse, grads))
    assert len(planned) == 2  # (the first call of each signature)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("used", [False, True])
def test_varlen_backward(causal, used):
    rng = np.random.default_rng(7 + causal + 2 * used)
    dtype, h, hk, d = torch.float16, 4, 2, 64
    lens_q, lens_k = [0, 37, 128, 1, 200, 3], [5, 37, 0, 64, 300, 70]
    used_k = [5, 20, 0, 64, 150, 0] if used else lens_k
    q = randn(rng, (1, sum(lens_q), h, d), dtype)[0]
    k, v = (randn(rng, (1, sum(lens_k), hk, d), dtype)[0] for _ in range(2))
    dout = randn(rng, (1, sum(lens_q), h, d), dtype)[0]
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    extra = dict(seqused_k=torch.tensor(used_k, dtype=torch.int32, device="cuda")) if used else {}
    out, lse = cufa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                           causal=causal, return_lse=True, **extra)
    grads = [poisoned_like(x) for x in (q, k, v)]
    dq, dk, dv = cufa.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k,
                                                 max(lens_q), max(lens_k), causal=causal,
                                                 dq=grads[0], dk=grads[1], dv=grads[2], **extra)
    qs, ks = np.cumsum([0] + lens_q), np.cumsum([0] + lens_k)
    for i in range(len(lens_q)):
        rows, keys = slice(qs[i], qs[i + 1]), slice(ks[i], ks[i + 1])
        seen = slice(ks[i], ks[i] + used_k[i])
        label = f"varlen causal={causal} used={used} sequence {i}"
        if lens_q[i] == 0:  # no query: no gradient for any key
            assert not dk[keys].any() and not dv[keys].any(), label
            continue
        sub = [x[None] for x in (q[rows], k[seen], v[seen], dout[rows])]
        got = (dq[rows][None], dk[seen][None], dv[seen][None])
        check_grads(got, *sub, label, out=out[rows][None], causal=causal)
        unseen = slice(ks[i] + used_k[i], ks[i + 1])  # keys past seqused_k: zero gradients
        assert not dk[unseen].any() and not dv[unseen].any(), label
        assert torch.isfinite(dk[keys]).all() and torch.isfinite(dv[keys]).all(), label


def test_varlen_autograd_with_sink_window_and_gqa():
    """What gpt-oss trains through: packed sequences, GQA, a learnable sink, causal with a
    sliding window; the sink's gradient summed over the sequences."""
    rng = np.random.default_rng(19)
    dtype, h, hk, d, lens = torch.bfloat16, 4, 2, 32, [45, 36, 1, 130]
    q = randn(rng, (1, sum(lens), h, d), dtype)[0].requires_grad_()
    k, v = (randn(rng, (1, sum(lens), hk, d), dtype)[0].requires_grad_() for _ in range(2))
    sink = torch.tensor(rng.standard_normal(h), dtype=torch.float32, device="cuda",
                        requires_grad=True)
    dout = randn(rng, (1, sum(lens), h, d), dtype)[0]
    cu, kw = cu_seqlens(lens), dict(causal=True, window_size=(23, 0))
    out = cufa.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), **kw,
                                      learnable_sink=sink)
    out.backward(dout)
    offs, dsink = np.cumsum([0] + lens), 0.0
    for i in range(len(lens)):
        r = slice(offs[i], offs[i + 1])
        ref = check_grads((q.grad[r][None], k.grad[r][None], v.grad[r][None]),
                          *(x[r][None] for x in (q, k, v, dout)), f"sequence {i}",
                          out=out[r][None], learnable_sink=sink, **kw)
        dsink = dsink + ref.dsink
    np.testing.assert_allclose(f64(sink.grad), dsink, rtol=2e-2,
                               atol=1e-3 * np.abs(dsink).max())


def test_torch_autograd_through_flash_attn_func():
    rng = np.random.default_rng(11)
    dtype, b, s, h, hk, d = torch.bfloat16, 2, 150, 4, 2, 128
    q = randn(rng, (b, s, h, d), dtype).requires_grad_()
    k, v = (randn(rng, (b, s, hk, d), dtype).requires_grad_() for _ in range(2))
    sink = torch.tensor(rng.standard_normal(h), dtype=torch.float32, device="cuda",
                        requires_grad=True)
    dout = randn(rng, (b, s, h, d), dtype)
    out = cufa.flash_attn_func(q, k, v, causal=True, learnable_sink=sink)
    assert out.requires_grad
    out.backward(dout)
    check_grads((q.grad, k.grad, v.grad, sink.grad), q, k, v, dout, "autograd", out=out,
                causal=True, learnable_sink=sink)


@pytest.mark.parametrize("d,layout", [(59, "bshd"), (64, "odd"), (200, "shifted")])
def test_torch_autograd_with_unaligned_rows(d, layout):
    """Head dims or strides off the 16-byte chunks: the backward runs on zero-padded copies
    (the forward read them in place)."""
    rng = np.random.default_rng(d)
    dtype, b, s, h = torch.float16, 2, 77, 4
    q, k, v = (randn(rng, (b, s, h, d), dtype, layout=layout).requires_grad_() for _ in range(3))
    dout = randn(rng, (b, s, h, d), dtype)
    out = cufa.flash_attn_func(q, k, v, causal=True)
    out.backward(dout)
    check_grads((q.grad, k.grad, v.grad), q, k, v, dout, f"unaligned d={d} {layout}", out=out,
                causal=True)


def test_torch_autograd_through_varlen_and_compile():
    rng = np.random.default_rng(13)
    dtype, h, d = torch.float16, 4, 64
    lens = [40, 1, 90]
    q, k, v = (randn(rng, (1, sum(lens), h, d), dtype)[0].requires_grad_() for _ in range(3))
    cu = cu_seqlens(lens)
    dout = randn(rng, (1, sum(lens), h, d), dtype)[0]

    def f(q, k, v):
        return cufa.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    for fn, label in ((f, "eager"), (torch.compile(f, fullgraph=True), "compiled")):
        for x in (q, k, v):
            x.grad = None
        out = fn(q, k, v)
        out.backward(dout)
        offs = np.cumsum([0] + lens)
        for i in range(len(lens)):
            r = slice(offs[i], offs[i + 1])
            check_grads((q.grad[r][None], k.grad[r][None], v.grad[r][None]),
                        *(x[r][None] for x in (q, k, v, dout)), f"{label} sequence {i}",
                        out=out[r][None], causal=True)


def test_cupy_arrays():
    cupy = pytest.importorskip("cupy")
    rng = np.random.default_rng(17)
    q, k, v, dout = (randn(rng, (1, 70, 2, 64), torch.float16) for _ in range(4))
    out, lse = cufa.flash_attn_func(q, k, v, return_lse=True)
    as_cp = [cupy.from_dlpack(x) for x in (dout, q, k, v, out, lse)]
    dq, dk, dv = cufa.flash_attn_backward(*as_cp)
    assert isinstance(dq, cupy.ndarray)
    got = [torch.from_dlpack(x) for x in (dq, dk, dv)]
    check_grads(got, q, k, v, dout, "cupy", out=out)


@pytest.mark.parametrize("jit", [False, True])
def test_jax_grad(jit):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    rng = np.random.default_rng(19 + jit)
    b, s, h, hk, d = 2, 90, 4, 2, 64
    q, k, v, dout = (rng.standard_normal(shape).astype(np.float16) for shape in (
        (b, s, h, d), (b, s, hk, d), (b, s, hk, d), (b, s, h, d)))
    sink = rng.standard_normal(h).astype(np.float32)

    def loss(q, k, v, sink):
        out = cufa.flash_attn_func(q, k, v, causal=True, learnable_sink=sink)
        return (out.astype(jnp.float32) * dout.astype(np.float32)).sum()
    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    got = (jax.jit(grad) if jit else grad)(*(jnp.asarray(x) for x in (q, k, v, sink)))
    got = [torch.from_numpy(np.asarray(g)) for g in got]
    t = [torch.from_numpy(x).cuda() for x in (q, k, v, dout)]
    out = cufa.flash_attn_func(*t[:3], causal=True, learnable_sink=torch.from_numpy(sink).cuda())
    check_grads(got, *t, f"jax.grad jit={jit}", out=out, causal=True,
                learnable_sink=torch.from_numpy(sink))


@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_sdpa_autograd(mask):
    """scaled_dot_product_attention's backward: top-left causal, GQA, a broadcast mask
    (which gets no gradient), against the float64 reference."""
    rng = np.random.default_rng(23)
    dtype, b, h, hk, L, S, d = torch.bfloat16, 2, 4, 2, 70, 90, 64
    q = randn(rng, (b, L, h, d), dtype).transpose(1, 2).detach().requires_grad_()
    k, v = (randn(rng, (b, S, hk, d), dtype).transpose(1, 2).detach().requires_grad_()
            for _ in range(2))
    m = None
    if mask == "bool":
        m = torch.from_numpy(rng.random((b, 1, L, S)) > 0.3).cuda()
    elif mask == "float":
        m = torch.from_numpy(rng.standard_normal((h, 1, S))).float().cuda()
    dout = randn(rng, (b, L, h, d), dtype).transpose(1, 2)
    out = cufa.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=True,
                                            enable_gqa=True)
    out.backward(dout)
    t = (lambda x: x.transpose(1, 2))  # (the reference's layout: (batch, seqlen, heads, d))
    kw = dict(causal=True, diag_offset=0)
    if m is not None:
        kw["attn_mask"] = m.cpu().numpy() if mask == "bool" else f64(m)
    check_grads((t(q.grad), t(k.grad), t(v.grad)), *(t(x) for x in (q, k, v, dout)),
                f"sdpa mask={mask}", out=t(out), **kw)


@pytest.mark.parametrize("reads", ["out and lse", "lse alone"])
def test_gradient_through_lse(reads):
    """A loss that reads lse as well (a hand-made merge of partial attentions does), or lse
    alone (out's gradient then never comes: the eager route hands the backward zeros): its
    gradient against torch autograd of the naive attention in float64 (lse's derivative by a
    score is P, so it enters as D - dlse). Rows within 1 % of their largest gradient, bf16."""
    rng = np.random.default_rng(29)
    dtype, b, s, h, d = torch.bfloat16, 1, 64, 2, 64
    q, k, v = (randn(rng, (b, s, h, d), dtype).requires_grad_() for _ in range(3))
    dout = randn(rng, (b, s, h, d), dtype)
    wl = torch.from_numpy(rng.standard_normal((b, h, s))).float().cuda()
    out_weight = 1.0 if reads == "out and lse" else 0.0
    out, lse = cufa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    loss = (lse * wl).sum()
    if out_weight:
        loss = loss + (out.float() * dout.float()).sum()
    loss.backward()
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    sc = torch.einsum("bihd,bjhd->bhij", q64, k64) / d ** 0.5
    sc = sc.masked_fill(torch.ones(s, s, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    lse64 = torch.logsumexp(sc, -1)
    o64 = torch.einsum("bhij,bjhd->bihd", torch.softmax(sc, -1), v64)
    ((o64 * dout.double()).sum() * out_weight + (lse64 * wl.double()).sum()).backward()
    for name, got, want in (("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad),
                            ("dv", v.grad, v64.grad)):
        err = (got.double() - want).abs().amax(-1)
        bound = 1e-2 * want.abs().amax(-1) + 1e-3
        assert (err <= bound).all(), (name, float((err / bound).max()))


@pytest.mark.parametrize("shape", [(2, 4, 50, 70), (4, 1, 70)], ids=["full", "broadcast"])
def test_sdpa_additive_mask_gradient(shape):
    """An additive mask that requires grad: its gradient (dS summed over the dimensions it
    broadcasts along) against torch autograd of the naive attention in float64; rows of
    the mask's gradient within 1 % of their largest value, bf16 inputs."""
    rng = np.random.default_rng(31)
    dtype, b, h, L, S, d = torch.bfloat16, 2, 4, 50, 70, 64
    q = randn(rng, (b, L, h, d), dtype).transpose(1, 2).detach().requires_grad_()
    k, v = (randn(rng, (b, S, h, d), dtype).transpose(1, 2).detach() for _ in range(2))
    mask = torch.from_numpy(rng.standard_normal(shape)).float().cuda().requires_grad_()
    dout = randn(rng, (b, L, h, d), dtype).transpose(1, 2)
    cufa.scaled_dot_product_attention(q, k, v, attn_mask=mask).backward(dout)
    m64 = mask.detach().double().requires_grad_()
    sc = (q.detach().double() @ k.double().transpose(-1, -2)) / d ** 0.5 + m64
    (torch.softmax(sc, -1) @ v.double()).backward(dout.double())
    got, want = mask.grad.double(), m64.grad
    assert got.shape == mask.shape
    err = (got - want).abs().amax(-1)
    bound = 1e-2 * want.abs().amax(-1) + 1e-4
    assert (err <= bound).all(), float((err / bound).max())


def check_packed_grads(grads, q, k, v, dout, out, lens, label):
    """Each non-empty sequence of a packed causal batch's (dq, dk, dv) against the
    reference."""
    offs = np.cumsum([0] + lens)
    for i in range(len(lens)):
        if lens[i]:
            r = slice(offs[i], offs[i + 1])
            check_grads(tuple(g[r][None] for g in grads), *(x[r][None] for x in (q, k, v, dout)),
                        f"{label} {i}", out=out[r][None], causal=True)


def causal_packed(rng, lens, h, d, dtype=torch.bfloat16):
    """A packed batch of sequences `lens`: q, k, v and dout (fresh normal values), its
    cu_seqlens, and the causal forward's out and lse."""
    q, k, v, dout = (randn(rng, (1, sum(lens), h, d), dtype)[0] for _ in range(4))
    cu = cu_seqlens(lens)
    out, lse = cufa.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                           return_lse=True)
    return q, k, v, dout, cu, out, lse


@pytest.fixture
def fused_dq(monkeypatch):
    """CUFA_BWD_FUSED_DQ=1 for the test (dq added atomically by the dk/dv kernel), then
    the environment as it was (the fdq family of bench/device_run.sh sets it for all)."""
    import os
    from cufa import _compile
    before = os.environ.get(_compile.BWD_FUSED_ENV)
    monkeypatch.setenv(_compile.BWD_FUSED_ENV, "1")
    cufa.api.clear_plans()
    yield
    if before is None:
        monkeypatch.delenv(_compile.BWD_FUSED_ENV)
    else:
        monkeypatch.setenv(_compile.BWD_FUSED_ENV, before)
    cufa.api.clear_plans()


FUSED = {
    "d64": dict(b=2, sq=129, sk=129, h=4, hk=4, d=64),
    "d64 causal GQA softcap": dict(b=1, sq=200, sk=250, h=4, hk=2, d=64, causal=True,
                                   softcap=10.0),
    "d128 causal, more queries": dict(b=2, sq=150, sk=100, h=4, hk=2, d=128, causal=True),
    "d120 window (padded to 128)": dict(b=1, sq=97, sk=97, h=2, hk=1, d=120,
                                        window_size=(16, 0)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", list(FUSED))
def test_dq_fused(fused_dq, name, dtype):
    from cufa import _compile
    case = dict(FUSED[name])
    kw = {n: case.pop(n) for n in ("causal", "window_size", "softcap") if n in case}
    window = "window" if "causal" in kw or "window_size" in kw else "none"
    assert _compile.bwd_fused_variants("fp16", case["d"], window, "softcap" in kw) is not None
    run_dense(np.random.default_rng(zlib.crc32(name.encode())), dtype,
              label=f"fused {name} {dtype}", **case, **kw)


# (on Hopper, d = 128 takes the wgmma kernel, d = 256 the kernel split by columns)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_dq_fused_varlen(fused_dq, d):
    rng = np.random.default_rng(37 + d)
    lens = [0, 70, 1, 150]
    q, k, v, dout, cu, out, lse = causal_packed(rng, lens, 4, d)
    dq, dk, dv = cufa.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu, cu, 150, 150,
                                                 causal=True)
    check_packed_grads((dq, dk, dv), q, k, v, dout, out, lens, f"fused varlen d={d}")


PERSISTENT = {  # (d = 64 on Hopper; CUFA_BWD_PERSISTENT=1 takes it past the default's rule)
    "no mask, GQA": dict(b=2, sq=300, sk=300, h=4, hk=2, d=64),
    "causal, more keys, d56": dict(b=1, sq=200, sk=333, h=4, hk=4, d=56, causal=True),
    "window, past 512 rows": dict(b=1, sq=1500, sk=1500, h=2, hk=1, d=64,
                                   window_size=(100, 20)),
}


@pytest.mark.parametrize("name", list(PERSISTENT))
def test_persistent_dkdv_kernel(monkeypatch, name):
    """The persistent d = 64 dk/dv kernel (a CTA an SM taking key blocks from a counter;
    the default only under a window up to 512 query rows) wherever it applies, with
    CUFA_BWD_PERSISTENT=1: without a mask (where it holds K's fragments as well as K^T's),
    causal, and a sliding window past 512 rows; the reference's gradients."""
    from cufa import _compile
    wgmma_or_skip("the persistent kernel")
    case = dict(PERSISTENT[name])
    kw = {n: case.pop(n) for n in ("causal", "window_size") if n in case}
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    try:
        monkeypatch.setenv(_compile.BWD_PERSISTENT_ENV, "1")
        cufa.api.clear_plans()
        if not kw:
            assert any(v.persistent for v in _route(torch.bfloat16, 64, case["sq"]))
        run_dense(rng, torch.bfloat16, label=f"persistent {name}", **case, **kw)
    finally:
        monkeypatch.undo()
        cufa.api.clear_plans()


def _route(dtype, d, seqlen_q, deterministic=False):
    """The backward's launches for a call of this dtype, head dim and query rows (no mask)."""
    from cufa import _bwd_plan, _checks, _interop
    q = _interop.as_device_array(torch.ones(1, 1, 1, d, dtype=dtype, device="cuda"), "q")
    return _bwd_plan.variants_of(q, d, (_checks.UNBOUNDED,) * 2, 0.0, None, seqlen_q=seqlen_q,
                                 deterministic=deterministic)


SPLIT_FUSED = {  # (Hopper above d = 128: dq added from the split kernel's registers)
    "d256, GQA, odd lengths": dict(b=2, sq=300, sk=517, h=4, hk=2, d=256),
    "d192 causal, more queries (rows without keys)": dict(b=1, sq=300, sk=100, h=4, hk=1,
                                                         d=192, causal=True),
    "d176 window, more keys": dict(b=1, sq=100, sk=300, h=2, hk=2, d=176,
                                   window_size=(10, 0)),
    "d256 causal, long": dict(b=1, sq=1100, sk=1100, h=2, hk=2, d=256, causal=True),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", list(SPLIT_FUSED))
def test_dq_fused_split_columns(fused_dq, name, dtype):
    """dq fused into the kernel that splits dk and dv by columns: each warpgroup's share of
    each step's dq, from a tile of dS, added to the float32 sums from registers."""
    wgmma_or_skip("dq fused into the split kernel")
    case = dict(SPLIT_FUSED[name])
    kw = {n: case.pop(n) for n in ("causal", "window_size") if n in case}
    route = _route(dtype, case["d"], case["sq"])
    assert route[1].split_cols and route[1].fused_dq, route
    run_dense(np.random.default_rng(zlib.crc32(name.encode())), dtype,
              label=f"fused split {name} {dtype}", **case, **kw)


def wgmma_or_skip(what):
    """Skip where the wgmma kernels do not run: off Hopper, or where the mma.sync ones are
    asked for (the sm80 family of bench/device_run.sh sets CUFA_KERNEL_FAMILY=sm80)."""
    from cufa import _compile, _runtime
    if str(_runtime.compute_capability(torch.cuda.current_device())) != "90":
        pytest.skip(f"{what}: the Hopper kernels'")
    if (_compile._overrides.get(_compile.FAMILY_ENV) == "sm80"
            or _compile._overrides.get(_compile.BWD_SM90_ENV) == "0"):
        pytest.skip(f"{what}: CUFA_KERNEL_FAMILY=sm80 or CUFA_BWD_SM90=0 runs mma.sync")


@pytest.mark.parametrize("d", [64, 128])
def test_dq_fused_by_cp_async(fused_dq, monkeypatch, d):
    """The fused wgmma kernel's cp.async twin (what arrays the copy engine cannot describe
    take; here CUFA_BWD_SM90_TMA=0), whose producer announces each step a step late: a
    dense causal call and a packed batch with an empty and a one-token sequence, against
    the reference."""
    import os
    from cufa import _compile
    wgmma_or_skip("the fused wgmma kernel")
    launched, real = [], _compile.function_pointer

    def spy(variant, device):
        launched.append(variant)
        return real(variant, device)
    before = os.environ.get(_compile.BWD_SM90_TMA_ENV)
    monkeypatch.setenv(_compile.BWD_SM90_TMA_ENV, "0")
    monkeypatch.setattr(_compile, "function_pointer", spy)
    cufa.api.clear_plans()
    try:
        rng = np.random.default_rng(41 + d)
        run_dense(rng, torch.bfloat16, 2, 300, 300, 4, 2, d, f"fused by cp.async d={d}",
                  causal=True)
        lens = [0, 70, 1, 150]
        q, k, v, dout, cu, out, lse = causal_packed(rng, lens, 4, d)
        grads = cufa.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu, cu, 150, 150,
                                                causal=True)
    finally:
        if before is None:
            monkeypatch.delenv(_compile.BWD_SM90_TMA_ENV)
        else:
            monkeypatch.setenv(_compile.BWD_SM90_TMA_ENV, before)
        cufa.api.clear_plans()
    check_packed_grads(grads, q, k, v, dout, out, lens, f"fused varlen by cp.async d={d}")
    fused = [x for x in launched if getattr(x, "fused_dq", False)]
    assert len(fused) == 2 and all(x.family == "sm90" and not x.tma for x in fused)


PRODUCER = {  # (the producer: two consumer warpgroups, d = 128 and above)
    "d128": dict(b=2, sq=1100, sk=1100, h=4, hk=2, d=128),
    "d128 causal, more queries (dq blocks without keys)": dict(b=2, sq=300, sk=100, h=4, hk=1,
                                                               d=128, causal=True),
    "d120 window, more keys (dk/dv blocks without queries)": dict(b=1, sq=100, sk=300, h=2,
                                                                  hk=2, d=120,
                                                                  window_size=(10, 0)),
    "d112 window": dict(b=1, sq=517, sk=517, h=2, hk=2, d=112, window_size=(100, 7)),
    "d128, one key block": dict(b=3, sq=5, sk=70, h=2, hk=2, d=128),
    # (above d = 128: dq's two warpgroups on 32-key blocks; dk and dv split by columns
    # with the producer, launched apart without)
    "d256 causal, GQA": dict(b=1, sq=300, sk=300, h=4, hk=2, d=256, causal=True),
    "d176 window, more queries": dict(b=1, sq=400, sk=333, h=2, hk=2, d=176,
                                      window_size=(50, 3)),
}


@pytest.mark.parametrize("name", list(PRODUCER))
def test_producer_warpgroup(monkeypatch, name):
    """Hopper's wgmma dq and dk/dv kernels with a producer warpgroup and a ring of
    mbarriers (the default at d = 128): the reference's gradients, and the same bits as
    the kernels without it (CUFA_BWD_SM90_PRODUCER=0; the same products in the same
    order)."""
    from cufa import _compile
    wgmma_or_skip("the producer warpgroup")
    case = dict(PRODUCER[name])
    kw = {n: case.pop(n) for n in ("causal", "window_size") if n in case} | EXACT
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    try:
        monkeypatch.delenv(_compile.BWD_SM90_PRODUCER_ENV, raising=False)
        cufa.api.clear_plans()
        q, k, v, dout, out, lse, got = run_dense(rng, torch.bfloat16, label=f"producer {name}",
                                                 **case, **kw)
        monkeypatch.setenv(_compile.BWD_SM90_PRODUCER_ENV, "0")
        cufa.api.clear_plans()
        without = cufa.flash_attn_backward(dout, q, k, v, out, lse, **kw)
    finally:
        monkeypatch.undo()
        cufa.api.clear_plans()
    assert all(torch.equal(a, b) for a, b in zip(got[:3], without[:3]))


def test_producer_warpgroup_varlen(monkeypatch):
    """A packed batch with an empty and a one-token sequence through the producer's kernels:
    each sequence's gradients against the reference, the same bits as without it."""
    from cufa import _compile
    lens = [0, 150, 1, 333]
    q, k, v, dout, cu, out, lse = causal_packed(np.random.default_rng(71), lens, 4, 128)
    try:
        grads = {}
        for env in (None, "0"):
            if env:
                monkeypatch.setenv(_compile.BWD_SM90_PRODUCER_ENV, env)
            else:
                monkeypatch.delenv(_compile.BWD_SM90_PRODUCER_ENV, raising=False)
            cufa.api.clear_plans()
            grads[env] = cufa.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu, cu, 333,
                                                         333, causal=True, **EXACT)
    finally:
        monkeypatch.undo()
        cufa.api.clear_plans()
    assert all(torch.equal(a, b) for a, b in zip(grads[None][:3], grads["0"][:3]))
    dq, dk, dv = grads[None][:3]
    check_packed_grads((dq, dk, dv), q, k, v, dout, out, lens, "producer varlen")


SPLIT = {  # (Hopper above d = 128: dk and dv from one launch, the columns split)
    "d256, GQA, odd lengths": dict(b=2, sq=300, sk=517, h=4, hk=2, d=256),
    "d192 causal, more queries (rows without keys), MQA": dict(b=1, sq=300, sk=100, h=4, hk=1,
                                                              d=192, causal=True),
    "d176 window, more keys (key blocks without queries)": dict(b=1, sq=100, sk=300, h=2,
                                                                hk=2, d=176,
                                                                window_size=(10, 0)),
    "d256, one key block": dict(b=3, sq=5, sk=70, h=2, hk=2, d=256),
    "d184 causal, strided": dict(b=1, sq=200, sk=260, h=2, hk=2, d=184, causal=True,
                                 layout="bhsd"),
    "d256 window, long": dict(b=1, sq=1500, sk=1500, h=2, hk=2, d=256, window_size=(300, 40)),
}


def _with_split_and_apart(monkeypatch, call):
    """call() with dk and dv split by columns (the default above d = 128 on Hopper), then
    launched apart (CUFA_BWD_SPLIT_COLS=0)."""
    from cufa import _compile
    results = []
    try:
        for env in (None, "0"):
            if env:
                monkeypatch.setenv(_compile.BWD_SPLIT_COLS_ENV, env)
            else:
                monkeypatch.delenv(_compile.BWD_SPLIT_COLS_ENV, raising=False)
            cufa.api.clear_plans()
            results.append(call())
    finally:
        monkeypatch.undo()
        cufa.api.clear_plans()
    return results


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", list(SPLIT))
def test_split_columns(monkeypatch, name, dtype):
    """dk and dv of a 64-key block from two warpgroups, one computing S and P, the other dP
    and dS, each a share of the columns: the reference's gradients, and the same bits as
    dk and dv launched apart (the same products of the same operands)."""
    wgmma_or_skip("dk and dv split by columns")
    case = dict(SPLIT[name])
    kw = {n: case.pop(n) for n in ("causal", "window_size") if n in case} | EXACT
    assert _route(dtype, case["d"], case["sq"], deterministic=True)[2].split_cols
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    first = []

    def call():
        if not first:
            first.append(run_dense(rng, dtype, label=f"split {name}", **case, **kw))
            return first[0][-1]
        q, k, v, dout, out, lse, _ = first[0]
        return cufa.flash_attn_backward(dout, q, k, v, out, lse, **kw)

    split, apart = _with_split_and_apart(monkeypatch, call)
    assert all(torch.equal(a, b) for a, b in zip(split[:3], apart[:3]))


def test_split_columns_varlen(monkeypatch):
    """A packed batch with an empty and a one-token sequence at d = 256, split by columns:
    each sequence's gradients against the reference, the same bits as dk and dv apart."""
    wgmma_or_skip("dk and dv split by columns")
    lens = [0, 150, 1, 333]
    q, k, v, dout, cu, out, lse = causal_packed(np.random.default_rng(73), lens, 2, 256)
    split, apart = _with_split_and_apart(monkeypatch, lambda: cufa.flash_attn_varlen_backward(
        dout, q, k, v, out, lse, cu, cu, 333, 333, causal=True, **EXACT))
    assert all(torch.equal(a, b) for a, b in zip(split[:3], apart[:3]))
    check_packed_grads(split[:3], q, k, v, dout, out, lens, "split varlen")


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_tma_streams_varlen(monkeypatch, causal, d):
    """The wgmma kernels' TMA copies (Hopper's default; at d = 128 from a producer
    warpgroup, at 64 from a consumer thread, or a producer for the windowed dk/dv) over a
    packed batch whose blocks take every path: a first sequence shorter than a block at
    the tensor's first row (copied by cp.async), partial last blocks read through the tail
    maps, keys past seqused_k and rows past the last sequences holding NaN (never read:
    zeros come in their place; those rows' gradients are zeros). Both kernels got their maps and the tails (not a quiet
    fall back to cp.async); each sequence's gradients against the reference, the same
    bits as the cp.async copies (CUFA_BWD_SM90_TMA=0)."""
    from cufa import _bwd_plan, _compile, _params, _tma
    wgmma_or_skip("the TMA copies")
    rng = np.random.default_rng(83 + causal + d)
    dtype, h, hk = torch.bfloat16, 4, 2
    lens_q, lens_k = [40, 0, 150, 1, 333], [40, 64, 150, 70, 333]
    used_k = [40, 0, 100, 70, 300]
    spare = 70  # rows past the last sequence in q, out and dout, and in k and v
    q, dout = (randn(rng, (1, sum(lens_q) + spare, h, d), dtype)[0] for _ in range(2))
    k, v = (randn(rng, (1, sum(lens_k) + spare, hk, d), dtype)[0] for _ in range(2))
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    ks = np.cumsum([0] + lens_k)
    for i in range(len(lens_k)):  # keys past seqused_k: NaN, which no query may read
        k[ks[i] + used_k[i]:ks[i + 1]] = float("nan")
        v[ks[i] + used_k[i]:ks[i + 1]] = float("nan")
    used = torch.tensor(used_k, dtype=torch.int32, device="cuda")
    kw = dict(causal=causal, seqused_k=used, **EXACT)
    out, lse = cufa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                           return_lse=True, **kw)
    total = sum(lens_q)
    q[total:], dout[total:], out[total:] = (float("nan"),) * 3
    k[ks[-1]:], v[ks[-1]:] = (float("nan"),) * 2
    grads, launched = {}, []
    real_launch = _bwd_plan.driver_launch

    def spy(function, blocks, threads, smem, stream, args):
        launched.append(args)
        return real_launch(function, blocks, threads, smem, stream, args)
    try:
        for env in (None, "0"):
            if env:
                monkeypatch.setenv(_compile.BWD_SM90_TMA_ENV, env)
            else:
                monkeypatch.delenv(_compile.BWD_SM90_TMA_ENV, raising=False)
                monkeypatch.setattr(_bwd_plan, "driver_launch", spy)
            cufa.api.clear_plans()
            poisoned = [poisoned_like(x) for x in (q, k, v)]
            grads[env] = cufa.flash_attn_varlen_backward(
                dout, q, k, v, out, lse, cu_q, cu_k, max(lens_q), max(lens_k), dq=poisoned[0],
                dk=poisoned[1], dv=poisoned[2], **kw)[:3]
            monkeypatch.setattr(_bwd_plan, "driver_launch", real_launch)
    finally:
        monkeypatch.undo()
        cufa.api.clear_plans()
    streamed = [args for args in launched if len(args) == 3]  # (dq's and dk/dv's)
    assert len(streamed) == 2 and all(bytes(a[2]) != bytes(_tma.NO_MAPS) for a in streamed)
    fwd = np.frombuffer(bytes(streamed[0][0]), dtype=_params.FWD.dtype)[0]
    assert fwd["kv_tail_maps"] == 1
    dq, dk, dv = grads[None]
    assert all(torch.equal(a[:total], b[:total]) for a, b in zip(grads[None], grads["0"]))
    for got in grads.values():  # (poisoned: the rows past the last sequences are written)
        assert not got[0][total:].any() and not got[1][ks[-1]:].any()
        assert not got[2][ks[-1]:].any()
    assert torch.isfinite(dq[:total]).all() and torch.isfinite(dk).all()
    assert torch.isfinite(dv).all()
    qs = np.cumsum([0] + lens_q)
    for i in range(len(lens_q)):
        rows, seen = slice(qs[i], qs[i + 1]), slice(ks[i], ks[i] + used_k[i])
        label = f"TMA d={d} causal={causal} sequence {i}"
        unseen = slice(ks[i] + used_k[i], ks[i + 1])
        assert not dk[unseen].any() and not dv[unseen].any(), label
        if lens_q[i] == 0 or used_k[i] == 0:
            assert not dk[seen].any() and not dv[seen].any(), label
            continue
        got = (dq[rows][None], dk[seen][None], dv[seen][None])
        check_grads(got, *(x[None] for x in (q[rows], k[seen], v[seen], dout[rows])), label,
                    out=out[rows][None], causal=causal)


def test_the_wgmma_kernels_are_hoppers_default(monkeypatch):
    """On Hopper the dq and dk/dv launches are the wgmma kernels unless CUFA_BWD_SM90=0 or
    CUFA_KERNEL_FAMILY=sm80 (the sm80 family of bench/device_run.sh runs this file that
    way); elsewhere the mma.sync ones."""
    from cufa import _bwd_plan, _compile, _interop, _runtime
    from cufa._checks import UNBOUNDED
    q = _interop.as_device_array(torch.empty(1, 8, 2, 128, device="cuda",
                                             dtype=torch.float16), "q")
    hopper = str(_runtime.compute_capability(q.device)) == "90"

    monkeypatch.setitem(_compile._overrides, _compile.BWD_FUSED_ENV, None)  # (family fdq)

    def families(**overrides):
        for name, value in overrides.items():
            monkeypatch.setitem(_compile._overrides, name, value)
        variants = _bwd_plan.variants_of(q, 128, (UNBOUNDED, UNBOUNDED), 0.0, None, seqlen_q=8)
        return [v.family for v in variants[1:]]
    sm90 = ["sm90" if hopper else "sm80"] * 2
    assert families(**{_compile.FAMILY_ENV: None, _compile.BWD_SM90_ENV: None}) == sm90
    assert families(**{_compile.BWD_SM90_ENV: "0"}) == ["sm80"] * 2
    assert families(**{_compile.BWD_SM90_ENV: "1"}) == sm90
    assert families(**{_compile.FAMILY_ENV: "sm80"}) == ["sm80"] * 2


def test_activation_checkpointing_and_autocast():
    """torch.utils.checkpoint reruns the forward in the backward: the gradients are the
    reference's, and the same bits as without checkpointing; under autocast a float32
    projection's output reaches cufa in bf16."""
    from torch.utils.checkpoint import checkpoint
    rng = np.random.default_rng(23)
    b, s, h, d = 2, 130, 4, 64
    x = randn(rng, (b, s, h, d), torch.float32).requires_grad_()
    w = torch.from_numpy(rng.standard_normal((d, 3 * d), dtype=np.float32) / 8).cuda()
    dout = randn(rng, (b, s, h, d), torch.bfloat16)

    def block(x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            q, k, v = (x @ w).chunk(3, dim=-1)
            return cufa.flash_attn_func(q, k, v, causal=True, **EXACT)

    grads = []
    for checkpointed in (False, True):
        x.grad = None
        out = checkpoint(block, x, use_reentrant=False) if checkpointed else block(x)
        assert out.dtype == torch.bfloat16
        out.backward(dout)
        grads.append(x.grad.clone())
    assert torch.equal(grads[0], grads[1])
    # the attention's own gradients against the reference, from the same q, k, v
    with torch.autocast("cuda", dtype=torch.bfloat16):
        q, k, v = (t.detach().requires_grad_() for t in (x @ w).chunk(3, dim=-1))
    out = cufa.flash_attn_func(q, k, v, causal=True)
    out.backward(dout)
    check_grads((q.grad, k.grad, v.grad), q, k, v, dout, "autocast", out=out, causal=True)
