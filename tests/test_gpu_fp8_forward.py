"""GPU: the fp8 forward. transpose_v_e4m3 against cufa/_fp8.py's layout, byte for byte,
on strided V of odd lengths (vt poisoned first); flash_attn_func on e4m3 q, k, v per row
against the float64 attention of the dequantized inputs (out poisoned first)."""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cufa  # noqa: E402
from cufa import _compile, _fp8, _runtime, reference  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture
def hopper():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if _compile.family_for(_runtime.compute_capability(0)) != "sm90":
        pytest.skip("the fp8 forward is Hopper's")


@pytest.mark.parametrize("batch, seqlen, heads, d", [(2, 70, 3, 64), (1, 1, 1, 128),
                                                     (3, 300, 2, 256), (1, 128, 4, 128)])
def test_transpose_v_matches_the_layout(hopper, batch, seqlen, heads, d):
    rng = np.random.default_rng(seqlen)
    wide = torch.from_numpy(rng.integers(0, 256, (batch, seqlen, heads + 1, d + 16),
                                         dtype=np.uint8)).cuda()
    v = wide[:, :, 1:, 16:]  # (strided: another head and 16 bytes before each row)
    padded = _fp8.padded_keys(seqlen)
    vt = torch.full((batch, heads, d, padded), 0xAB, dtype=torch.uint8, device="cuda")
    _fp8.launch_transpose_v(v.data_ptr(), tuple(v.shape), tuple(v.stride()), vt.data_ptr(),
                            padded, 0, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    want = _fp8.transposed_v(v.cpu().numpy(), padded)
    np.testing.assert_array_equal(vt.cpu().numpy(), want)


# -- the fp8 forward (flash_attn_func with q, k, v in float8_e4m3fn) ---------------------------

E4M3 = getattr(torch, "float8_e4m3fn", None)
P_SCALE = 256.0  # the kernel's P * 2^8 before e4m3 (kE4m3ProbLog2)


def e4m3_tensor(rng, shape, outliers=0.0):
    """Unit-normal values (a fraction `outliers` of them magnitude 10, FlashAttention-3's
    test), in e4m3 on the GPU, and their float64 values."""
    x = rng.standard_normal(shape)
    if outliers:
        x = np.where(rng.random(shape) < outliers, 10.0 * np.sign(x), x)
    t = torch.from_numpy(x.astype(np.float32)).to("cuda", E4M3)
    return t, t.float().cpu().numpy().astype(np.float64)


def fp8_descale(rng, kind, batch, heads_k):
    if kind is None:
        return None
    shape = {"per_head": (batch, heads_k), "one": (1,), "scalar": ()}[kind]
    return torch.from_numpy(np.asarray(rng.uniform(0.5, 2.0, shape), dtype=np.float32)).cuda()


def dequantized(x, descale, group=1):
    """x (b, s, heads, d) float64 times its descale: one value, or (b, h_k) with `group`
    of x's heads a KV head (q's heads share their KV head's q_descale)."""
    if descale is None:
        return x
    scale = descale.cpu().numpy().astype(np.float64)
    if scale.ndim == 2:
        return x * np.repeat(scale, group, axis=1)[:, None, :, None]
    return x * scale.reshape(())


def fp8_lowp(q, k, v, causal, window, scale, bounds=True):
    """The naive algorithm as the fp8 forward rounds it: softmax against the row's max, P
    times 2^8 rounded to e4m3, P V in float64 over the float64 values, divided back by 2^8
    and by the row sum of the unrounded P. With bounds, each row's (b, sq, h) largest
    single term max_j,d P_j |V_jd| / l (what one rounding flip of P_j can move) and P's
    spread of V about the exact output, max_d sum_j P_j |V_jd - O_d| / l (what an error
    in every score moves); else None for both."""
    from cufa.reference import round_to_e4m3, visible_keys
    h, hk = q.shape[2], k.shape[2]
    kh = np.repeat(k, h // hk, axis=2).transpose(0, 2, 1, 3)
    vh = np.repeat(v, h // hk, axis=2).transpose(0, 2, 1, 3)
    s = (q.transpose(0, 2, 1, 3) @ kh.transpose(0, 1, 3, 2)) * scale
    seen = visible_keys(q.shape[1], k.shape[1], causal=causal, window_size=window)
    s = np.where(seen, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    l = np.where(l > 0, l, 1.0)
    o = (round_to_e4m3(p * P_SCALE) @ vh) / (P_SCALE * l)
    if not bounds:
        return o.transpose(0, 2, 1, 3), None, None
    exact = (p @ vh) / l
    term = (p * np.abs(vh).max(-1)[:, :, None, :]).max(-1) / l[..., 0]  # (b, h, sq)
    spread = np.empty_like(term)
    # (a (rows, keys, d) product at a time, over the keys the rows see, in float32: the
    # whole (b, h, sq, sk, d) one takes ~17 GB at 513 x 1000 x 256, and this bound was
    # most of the GPU suite's slowest tests' time)
    for bh in np.ndindex(p.shape[:2]):
        for r in range(0, p.shape[2], 32):
            rows = slice(r, r + 32)
            keys = np.flatnonzero(p[bh][rows].any(0))
            if keys.size == 0:
                spread[bh][rows] = 0.0
                continue
            span = slice(keys[0], keys[-1] + 1)
            dev = np.abs(vh[bh][None, span].astype(np.float32)
                         - exact[bh][rows, None].astype(np.float32))
            dev *= p[bh][rows, span, None].astype(np.float32)
            spread[bh][rows] = dev.sum(1).max(-1) / l[bh][rows, 0]
    return o.transpose(0, 2, 1, 3), term.transpose(0, 2, 1), spread.transpose(0, 2, 1)


def score_error_bound(q, k, scale):
    """(b, h, sq): the most a row's score can be off on Hopper's e4m3 products, which
    accumulate with about 13 bits kept at each k32 step (DeepSeek-V3's report on fp8
    GEMMs): (d / 32) * 2^-13 of the terms' absolute sum, times the scale."""
    h, hk, d = q.shape[2], k.shape[2], q.shape[3]
    terms = np.abs(q).transpose(0, 2, 1, 3) @ np.repeat(np.abs(k), h // hk, axis=2).transpose(
        0, 2, 3, 1)
    return (d / 32) * 2.0 ** -13 * scale * terms.max(-1)


@pytest.mark.parametrize("d", [64, 128, 256, 96])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("seqlens", [(300, 300), (1, 77), (513, 1000), (200, 130)])
def test_fp8_forward_per_row(hopper, d, mask, seqlens):
    """Every (batch, head, row) against the float64 attention of the dequantized inputs:
    its max error at most twice the fp8 algorithm's own (fp8_lowp), plus one rounding flip
    of its largest term and two roundings of the 16-bit output; over the whole tensor no
    systematic scale (the regression of the error on the reference under 0.3 %)."""
    if E4M3 is None:
        pytest.skip("this PyTorch has no float8_e4m3fn")
    rng = np.random.default_rng(d * 7919 + seqlens[1])
    (sq, sk), batch, h, hk = seqlens, 2, 8, 2
    causal, window = mask == "causal", (48, 16) if mask == "window" else (-1, -1)
    (q, q64), (k, k64), (v, v64) = (e4m3_tensor(rng, (batch, s, n, d))
                                    for s, n in ((sq, h), (sk, hk), (sk, hk)))
    kinds = ["per_head", "one", "scalar", None]
    qd, kd, vd = (fp8_descale(rng, kinds[(d // 32 + i) % 4], batch, hk) for i in range(3))
    out_dtype = torch.float16 if d == 96 else torch.bfloat16
    out = torch.full((batch, sq, h, d), float("nan"), dtype=out_dtype, device="cuda")
    got, lse = cufa.flash_attn_func(q, k, v, causal=causal, window_size=window, out=out,
                                    q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True)
    assert got is out
    torch.cuda.synchronize()
    qf, kf, vf = dequantized(q64, qd, h // hk), dequantized(k64, kd), dequantized(v64, vd)
    o = got.float().cpu().numpy().astype(np.float64)
    errs = assert_fp8_rows(o, lse.cpu().numpy().astype(np.float64), qf, kf, vf, causal,
                           window, 1.0 / math.sqrt(d), out_dtype)
    assert_no_scale_bug(*errs)


def assert_fp8_rows(o, lse, qf, kf, vf, causal, window, scale, out_dtype):
    """The per-row rule of one padded batch (o (b, sq, h, d), lse (b, h, sq), the float64
    dequantized inputs): a row's max error at most twice the fp8 algorithm's own
    (fp8_lowp), plus one rounding flip of its largest term, plus the score error of
    Hopper's e4m3 accumulation times P's spread, plus two roundings of the 16-bit output;
    lse within the score error. Returns (ref, o - ref) for assert_no_scale_bug."""
    ref, ref_lse = reference.attention(qf, kf, vf, causal=causal, window_size=window,
                                       softmax_scale=scale)
    lowp, term, spread = fp8_lowp(qf, kf, vf, causal, window, scale)
    score_err = score_error_bound(qf, kf, scale).transpose(0, 2, 1)  # (b, sq, h)
    assert np.isfinite(o).all()
    err = np.abs(o - ref).max(-1)
    err_lp = np.abs(lowp - ref).max(-1)
    rounding = 2.0 ** (-8 if out_dtype == torch.bfloat16 else -11)
    # (a score off by e moves its P by e relative: O by e times P's spread of V about O)
    bound = (2 * err_lp + 2.0 ** -4 * term + score_err * spread
             + 2 * rounding * np.abs(ref).max(-1) + 1e-6)
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert (err <= bound).all(), (f"row {worst}: error {err[worst]:.3g} over its bound "
                                  f"{bound[worst]:.3g} (fp8 algorithm {err_lp[worst]:.3g})")
    lse_ref = np.asarray(ref_lse)  # (b, h, sq)
    seen = np.isfinite(lse_ref)
    assert (np.isneginf(lse) == ~seen).all()
    lse_tol = 1e-4 + score_error_bound(qf, kf, scale)  # (no more than its worst score's)
    lse_err = np.where(seen, np.abs(lse - np.where(seen, lse_ref, 0.0)), 0.0)
    worst = np.unravel_index(np.argmax(lse_err / lse_tol), lse_err.shape)
    assert (lse_err <= lse_tol).all(), (f"lse row {worst}: error {lse_err[worst]:.3g} over "
                                        f"{lse_tol[worst]:.3g}")
    return ref, o - ref


def assert_no_scale_bug(ref, err):
    """No systematic scale over the rows: the regression of the error on the reference.
    Its noise from rounding alone shrinks with the rows' count (16 rows of one query token
    leave it near 1 %); a 1 % scale bug stands out from 2,400 on."""
    flat_ref, flat_err = np.ravel(ref), np.ravel(err)
    if (flat_ref ** 2).sum() > 0:
        beta = (flat_err * flat_ref).sum() / (flat_ref ** 2).sum()
        rows = flat_ref.size / ref.shape[-1]
        noise = np.sqrt((flat_err ** 2).sum() / (flat_ref ** 2).sum() / rows)
        assert abs(beta) < max(3e-3, 4 * noise), (
            f"systematic error: out = ref * (1 + {beta:.4f}) (noise {noise:.4f})")


def test_fp8_forward_rms_with_outliers(hopper):
    """FlashAttention-3's accuracy case: unit-normal q, k, v with 0.1 % outliers of
    magnitude 10, d = 128, 1k tokens. RMS error against the float64 attention of the
    dequantized inputs under 1e-2, and no more than twice that of the naive algorithm that
    rounds P the same way (fp8_lowp); both printed."""
    if E4M3 is None:
        pytest.skip("this PyTorch has no float8_e4m3fn")
    rng = np.random.default_rng(3)
    (q, q64), (k, k64), (v, v64) = (e4m3_tensor(rng, (2, 1024, 8, 128), outliers=1e-3)
                                    for _ in range(3))
    got = cufa.flash_attn_func(q, k, v, causal=True)
    o = got.float().cpu().numpy().astype(np.float64)
    scale = 1.0 / math.sqrt(128)
    ref, _ = reference.attention(q64, k64, v64, causal=True, softmax_scale=scale)
    lowp, _, _ = fp8_lowp(q64, k64, v64, True, (-1, -1), scale, bounds=False)
    rms, rms_lp = (np.sqrt(np.mean((x - ref) ** 2)) for x in (o, lowp))
    print(f"fp8 forward: RMS error {rms:.2e} (naive e4m3-P algorithm {rms_lp:.2e}), max "
          f"{np.abs(o - ref).max():.2e}")
    assert rms <= 1e-2 and rms <= 2 * rms_lp


@pytest.mark.parametrize("d", [128, 256])
def test_fp8_forward_scores_rising_block_after_block(hopper, d):
    """Scores that rise over the key blocks in the order the kernel visits them (last block
    first): every block raises the rows' max, so O is rescaled each time (the exact max's
    update skips it only where no row of a warp rose), and the probabilities, times 2^8 out
    of the exponentials, stay within e4m3. The per-row rule, lse included."""
    if E4M3 is None:
        pytest.skip("this PyTorch has no float8_e4m3fn")
    rng = np.random.default_rng(d + 1)
    batch, sq, sk, h = 1, 130, 1000, 2
    # k_j = (1 - j / sk) times q's direction: a key's score falls with its index, by ~2 a
    # 128-key block (scores in 0..~26), plus noise
    direction = rng.standard_normal((batch, 1, h, d))
    direction /= np.linalg.norm(direction, axis=-1, keepdims=True)
    q = direction * 2.0 * math.sqrt(d) * np.ones((batch, sq, h, 1)) + 0.3 * rng.standard_normal(
        (batch, sq, h, d))
    k = direction * (1.0 - np.arange(sk) / sk)[None, :, None, None] * 6.0 + 0.3 * \
        rng.standard_normal((batch, sk, h, d))
    v = rng.standard_normal((batch, sk, h, d))
    t = [torch.from_numpy(x.astype(np.float32)).to("cuda", E4M3) for x in (q, k, v)]
    qf, kf, vf = (x.float().cpu().numpy().astype(np.float64) for x in t)
    out = torch.full((batch, sq, h, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    got, lse = cufa.flash_attn_func(*t, out=out, return_lse=True)
    torch.cuda.synchronize()
    assert_no_scale_bug(*assert_fp8_rows(
        got.float().cpu().numpy().astype(np.float64), lse.cpu().numpy().astype(np.float64),
        qf, kf, vf, False, (-1, -1), 1.0 / math.sqrt(d), torch.bfloat16))


def test_fp8_forward_without_keys(hopper):
    """seqlen_k = 0: every row 0 and lse -inf (out poisoned first), nothing transposed."""
    if E4M3 is None:
        pytest.skip("this PyTorch has no float8_e4m3fn")
    rng = np.random.default_rng(5)
    q, _ = e4m3_tensor(rng, (2, 37, 4, 128))
    k = torch.empty(2, 0, 2, 128, dtype=E4M3, device="cuda")
    out = torch.full((2, 37, 4, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    got, lse = cufa.flash_attn_func(q, k, k, out=out, return_lse=True)
    torch.cuda.synchronize()
    assert (got == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_fp8_varlen_per_row(hopper, d, mask):
    """flash_attn_varlen_func on e4m3 q, k, v: sequences of 1, 77, 0, 300 and 513 query rows
    against 77, 1, 5, 300 and 1000 keys (odd, empty, shorter and longer than the queries),
    GQA 8/2, seqused_k below cu_seqlens_k for one sequence (its V rows past the used keys
    NaN bytes, which V^T must not carry into its last block), per-(sequence, KV head)
    descales; each sequence by the per-row rule (out poisoned first)."""
    if E4M3 is None:
        pytest.skip("this PyTorch has no float8_e4m3fn")
    rng = np.random.default_rng(d + len(mask))
    lens_q, lens_k, h, hk = [1, 77, 0, 300, 513], [77, 1, 5, 300, 1000], 8, 2
    used_k = list(lens_k)
    used_k[3] = 250
    causal, window = mask == "causal", (48, 16) if mask == "window" else (-1, -1)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]) for n in (lens_q, lens_k))
    (q, q64), (k, k64), (v, v64) = (e4m3_tensor(rng, (int(c[-1]), n, d))
                                    for c, n in ((cu_q, h), (cu_k, hk), (cu_k, hk)))
    batch = len(lens_q)
    v.view(torch.uint8)[int(cu_k[3]) + used_k[3]:int(cu_k[4])] = 0x7F  # (e4m3fn NaN)
    qd, kd, vd = (fp8_descale(rng, "per_head", batch, hk) for _ in range(3))
    out = torch.full((int(cu_q[-1]), h, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    got, lse = cufa.flash_attn_varlen_func(
        q, k, v, torch.tensor(cu_q, dtype=torch.int32, device="cuda"),
        torch.tensor(cu_k, dtype=torch.int32, device="cuda"), max(lens_q), max(lens_k),
        causal=causal, window_size=window, out=out, return_lse=True,
        seqused_k=torch.tensor(used_k, dtype=torch.int32, device="cuda"),
        q_descale=qd, k_descale=kd, v_descale=vd)
    torch.cuda.synchronize()
    assert_packed_rows(got, lse, (q64, k64, v64), (qd, kd, vd), cu_q, cu_k, used_k, causal,
                       window)


def assert_packed_rows(got, lse, values, descales, cu_q, cu_k, used_k, causal, window):
    """A packed batch's out and lse, each sequence by the per-row rule against the float64
    attention of its dequantized rows (values: packed q, k, v in float64; descales per
    (sequence, KV head))."""
    (q64, k64, v64), (qd, kd, vd) = values, descales
    h, hk, d = q64.shape[1], k64.shape[1], q64.shape[2]
    o_all = got.float().cpu().numpy().astype(np.float64)
    lse_all = lse.cpu().numpy().astype(np.float64)  # (h, total_q)
    refs, errs = [], []
    for b in range(len(cu_q) - 1):
        if cu_q[b + 1] == cu_q[b]:
            continue
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b] + used_k[b])
        one = lambda x, s: x[None, s]  # noqa: E731  (a batch of one)
        qf = dequantized(one(q64, rows), qd[b:b + 1], h // hk)
        kf, vf = dequantized(one(k64, keys), kd[b:b + 1]), dequantized(one(v64, keys), vd[b:b + 1])
        ref, err = assert_fp8_rows(o_all[None, rows], lse_all[None, :, rows], qf, kf, vf, causal,
                                   window, 1.0 / math.sqrt(d), torch.bfloat16)
        refs.append(ref.reshape(-1, d))  # (rows, d): assert_no_scale_bug counts rows
        errs.append(err.reshape(-1, d))
    assert_no_scale_bug(np.concatenate(refs), np.concatenate(errs))


@pytest.mark.parametrize("page_size", [1, 16, 256])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_fp8_paged_varlen_per_row(hopper, page_size, mask):
    """flash_attn_varlen_func on e4m3 q and a paged e4m3 cache (block_table): the batch of
    test_fp8_varlen_per_row with its keys scattered over pages in a random order, every
    slot no key was written to (and V past one sequence's used keys) NaN bytes, which
    neither the gathered rows nor V^T may carry into a row (out poisoned first). The
    sequence with seqused_k gets a cu_seqlens_k length past its pages' capacity, which a
    paged batch allows (seqused_k says how many keys): the ones after it must not move."""
    if E4M3 is None:
        pytest.skip("this PyTorch has no float8_e4m3fn")
    rng = np.random.default_rng(page_size + len(mask))
    lens_q, lens_k, h, hk, d = [1, 77, 0, 300, 513], [77, 1, 5, 300, 1000], 8, 2, 128
    used_k = list(lens_k)
    used_k[3] = 250
    causal = mask == "causal"
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]) for n in (lens_q, lens_k))
    (q, q64), (k, k64), (v, v64) = (e4m3_tensor(rng, (int(c[-1]), n, d))
                                    for c, n in ((cu_q, h), (cu_k, hk), (cu_k, hk)))
    batch = len(lens_q)
    v.view(torch.uint8)[int(cu_k[3]) + used_k[3]:int(cu_k[4])] = 0x7F  # (e4m3fn NaN)
    max_pages = max(-(-n // page_size) for n in lens_k)
    num_pages = batch * max_pages + 3
    table = rng.permutation(num_pages)[:batch * max_pages].reshape(batch, max_pages)
    caches = [torch.full((num_pages, page_size, hk, d), 0x7F, dtype=torch.uint8, device="cuda")
              for _ in range(2)]
    for b, n in enumerate(lens_k):
        j = np.arange(n)
        pages = torch.from_numpy(table[b, j // page_size]).cuda()
        slots = torch.from_numpy(j % page_size).cuda()
        for cache, packed in zip(caches, (k, v)):
            cache[pages, slots] = packed.view(torch.uint8)[int(cu_k[b]):int(cu_k[b + 1])]
    k_cache, v_cache = (c.view(E4M3) for c in caches)
    qd, kd, vd = (fp8_descale(rng, "per_head", batch, hk) for _ in range(3))
    out = torch.full((int(cu_q[-1]), h, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    lens_call = list(lens_k)
    lens_call[3] += 5 * max_pages * page_size  # (past any row of the gathered layout)
    # The gathered rows past each sequence's keys hold what their memory held: NaN bytes
    # here, a block of their size freed just before (PyTorch's allocator hands it on)
    rows = -(-batch * max_pages * page_size * hk * d // 256) * 256
    torch.full((2 * rows + 4 * (2 * batch + 1),), 0x7F, dtype=torch.uint8, device="cuda")
    cu_call = np.concatenate([[0], np.cumsum(lens_call)])
    got, lse = cufa.flash_attn_varlen_func(
        q, k_cache, v_cache, torch.tensor(cu_q, dtype=torch.int32, device="cuda"),
        torch.tensor(cu_call, dtype=torch.int32, device="cuda"), max(lens_q), max(lens_call),
        causal=causal, out=out, return_lse=True,
        block_table=torch.from_numpy(table.astype(np.int32)).cuda(),
        seqused_k=torch.tensor(used_k, dtype=torch.int32, device="cuda"),
        q_descale=qd, k_descale=kd, v_descale=vd)
    torch.cuda.synchronize()
    assert_packed_rows(got, lse, (q64, k64, v64), (qd, kd, vd), cu_q, cu_k, used_k, causal,
                       (-1, -1))


def test_transpose_v_packed_matches_the_layout(hopper):
    """The packed transpose: each sequence's region of vt, byte for byte, zeros past its
    used keys (seqused_k); the gaps between regions are never read and left as they were
    (poisoned here, not compared)."""
    rng = np.random.default_rng(11)
    lens, used = [70, 0, 129, 1, 300], [70, 0, 100, 1, 299]
    cu = np.concatenate([[0], np.cumsum(lens)])
    v = torch.from_numpy(rng.integers(0, 256, (int(cu[-1]), 3, 64), dtype=np.uint8)).cuda()
    keys = _fp8.vt_packed_keys(int(cu[-1]), len(lens))
    vt = torch.full((3, 64, keys), 0xAB, dtype=torch.uint8, device="cuda")
    cu_dev = torch.tensor(cu, dtype=torch.int32, device="cuda")
    used_dev = torch.tensor(used, dtype=torch.int32, device="cuda")
    _fp8.launch_transpose_v(v.data_ptr(), (len(lens),) + tuple(v.shape), (0,) + tuple(v.stride()),
                            vt.data_ptr(), keys, 0, torch.cuda.current_stream().cuda_stream,
                            cu_dev.data_ptr(), used_dev.data_ptr())
    torch.cuda.synchronize()
    want = _fp8.transposed_v_packed(v.cpu().numpy(), cu, used)
    got = vt.cpu().numpy()
    for b, n in enumerate(lens):
        if n:
            s = _fp8.vt_sequence_start(int(cu[b]), b)
            span = slice(s, s + _fp8.padded_keys(n))
            np.testing.assert_array_equal(got[:, :, span], want[:, :, span])


# -- the fp8 forward under torch.compile and JAX (jax.jit and eager) ---------------------------

def _fp8_case(d=128, seed=5):
    """A small GQA case of odd lengths: e4m3 q, k, v (and their float64 values), per-head
    descales, and the float64 dequantized inputs."""
    rng = np.random.default_rng(seed)
    batch, sq, sk, h, hk = 2, 150, 217, 4, 2
    (q, q64), (k, k64), (v, v64) = (e4m3_tensor(rng, (batch, s, n, d))
                                    for s, n in ((sq, h), (sk, hk), (sk, hk)))
    qd, kd, vd = (fp8_descale(rng, "per_head", batch, hk) for _ in range(3))
    return (q, k, v), (qd, kd, vd), (dequantized(q64, qd, h // hk), dequantized(k64, kd),
                                     dequantized(v64, vd))


def test_fp8_forward_under_torch_compile_per_row(hopper):
    """torch.compile(fullgraph) of an fp8 call: the same per-row rule as an eager call, out
    bfloat16 and lse."""
    if E4M3 is None:
        pytest.skip("this PyTorch has no float8_e4m3fn")
    (q, k, v), descales, (qf, kf, vf) = _fp8_case()
    f = torch.compile(lambda q, k, v, qd, kd, vd: cufa.flash_attn_func(
        q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True),
        fullgraph=True)
    o, lse = f(q, k, v, *descales)
    assert o.dtype == torch.bfloat16
    torch.cuda.synchronize()
    assert_no_scale_bug(*assert_fp8_rows(
        o.float().cpu().numpy().astype(np.float64), lse.cpu().numpy().astype(np.float64),
        qf, kf, vf, True, (-1, -1), 1.0 / math.sqrt(q.shape[-1]), torch.bfloat16))


def test_fp8_forward_from_jax_per_row(hopper):
    """jnp.float8_e4m3fn q, k, v under jax.jit and eagerly (one buffer callback each), dense
    and packed: the per-row rule against the dequantized inputs."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    if E4M3 is None or jax.default_backend() != "gpu":
        pytest.skip("needs torch's float8 and JAX on the GPU")
    (q, k, v), descales, (qf, kf, vf) = _fp8_case(d=64, seed=11)

    def to_jax(x):
        if x is None:
            return None
        if x.dtype == E4M3:  # (the bytes, read as e4m3: DLPack does not carry float8)
            return jnp.asarray(x.view(torch.uint8).cpu().numpy()).view(jnp.float8_e4m3fn)
        return jnp.asarray(x.cpu().numpy())
    jq, jk, jv, jqd, jkd, jvd = map(to_jax, (q, k, v, *descales))
    scale = 1.0 / math.sqrt(q.shape[-1])
    call = lambda q, k, v, qd, kd, vd: cufa.flash_attn_func(  # noqa: E731
        q, k, v, window_size=(40, 7), q_descale=qd, k_descale=kd, v_descale=vd,
        return_lse=True)
    for o, lse in (jax.jit(call)(jq, jk, jv, jqd, jkd, jvd), call(jq, jk, jv, jqd, jkd, jvd)):
        assert o.dtype == jnp.bfloat16
        assert_no_scale_bug(*assert_fp8_rows(
            np.asarray(o.astype(jnp.float32), np.float64), np.asarray(lse, np.float64),
            qf, kf, vf, False, (40, 7), scale, torch.bfloat16))
    # packed: the two sequences of the padded batch, stacked
    cu_q = jnp.asarray([0, q.shape[1], 2 * q.shape[1]], jnp.int32)
    cu_k = jnp.asarray([0, k.shape[1], 2 * k.shape[1]], jnp.int32)
    flat = [x.reshape((-1,) + x.shape[2:]) for x in (jq, jk, jv)]
    o, lse = jax.jit(lambda q, k, v, cq, ck, qd, kd, vd: cufa.flash_attn_varlen_func(
        q, k, v, cq, ck, 150, 217, window_size=(40, 7), q_descale=qd, k_descale=kd,
        v_descale=vd, return_lse=True))(*flat, cu_q, cu_k, jqd, jkd, jvd)
    o = np.asarray(o.astype(jnp.float32), np.float64).reshape(q.shape)
    lse = np.asarray(lse, np.float64).reshape(q.shape[2], 2, q.shape[1]).transpose(1, 0, 2)
    assert_no_scale_bug(*assert_fp8_rows(o, lse, qf, kf, vf, False, (40, 7), scale,
                                         torch.bfloat16))


def _paged(x, table, page_size):
    """x (batch, seqlen, heads, d) e4m3 as pages of a cache of table.max() + 3 pages,
    sequence b's key j in row j % page_size of page table[b, j // page_size], NaN bytes
    where no key was written."""
    cache = torch.full((int(table.max()) + 3, page_size) + x.shape[2:], 0x7F, dtype=torch.uint8,
                       device="cuda")
    j = np.arange(x.shape[1])
    for b in range(x.shape[0]):
        cache[torch.from_numpy(table[b, j // page_size]).cuda(),
              torch.from_numpy(j % page_size).cuda()] = x[b].view(torch.uint8)
    return cache.view(E4M3)


def test_fp8_paged_under_torch_compile_and_jax_per_row(hopper):
    """A paged e4m3 cache (pages of 16, in a random order) with e4m3 q under
    torch.compile(fullgraph) and jax.jit: the two sequences of _fp8_case, each by the
    per-row rule."""
    if E4M3 is None:
        pytest.skip("this PyTorch has no float8_e4m3fn")
    (q, k, v), descales, (qf, kf, vf) = _fp8_case(seed=7)
    per = -(-k.shape[1] // 16)
    table = np.random.default_rng(7).permutation(2 * per).reshape(2, per)
    k_cache, v_cache = _paged(k, table, 16), _paged(v, table, 16)
    table = torch.from_numpy(table.astype(np.int32)).cuda()
    batch, sq, h, d = q.shape
    cu_q = torch.tensor([0, sq, 2 * sq], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, k.shape[1], 2 * k.shape[1]], dtype=torch.int32, device="cuda")
    scale = 1.0 / math.sqrt(d)

    def check(o, lse):
        o = np.asarray(o, np.float64).reshape(q.shape)
        lse = np.asarray(lse, np.float64).reshape(h, batch, sq).transpose(1, 0, 2)
        assert_no_scale_bug(*assert_fp8_rows(o, lse, qf, kf, vf, True, (-1, -1), scale,
                                             torch.bfloat16))
    f = torch.compile(lambda q, kc, vc, t, qd, kd, vd: cufa.flash_attn_varlen_func(
        q, kc, vc, cu_q, cu_k, sq, k.shape[1], causal=True, block_table=t, q_descale=qd,
        k_descale=kd, v_descale=vd, return_lse=True), fullgraph=True)
    o, lse = f(q.reshape(-1, h, d), k_cache, v_cache, table, *descales)
    torch.cuda.synchronize()
    check(o.float().cpu().numpy(), lse.cpu().numpy())
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    if jax.default_backend() != "gpu":
        return

    def to_jax(x):
        if x.dtype == E4M3:  # (the bytes, read as e4m3: DLPack does not carry float8)
            return jnp.asarray(x.view(torch.uint8).cpu().numpy()).view(jnp.float8_e4m3fn)
        return jnp.asarray(x.cpu().numpy())
    args = map(to_jax, (q.reshape(-1, h, d), k_cache, v_cache, cu_q, cu_k, table, *descales))
    o, lse = jax.jit(lambda q, kc, vc, cq, ck, t, qd, kd, vd: cufa.flash_attn_varlen_func(
        q, kc, vc, cq, ck, sq, k.shape[1], causal=True, block_table=t, q_descale=qd,
        k_descale=kd, v_descale=vd, return_lse=True))(*args)
    check(np.asarray(o.astype(jnp.float32)), np.asarray(lse))


def test_fp8_forward_in_a_cuda_graph_per_row(hopper):
    """A captured fp8 call (V^T from the graph's pool, the tile counter its own) replayed
    on new values copied into its inputs: the per-row rule for the new values."""
    if E4M3 is None:
        pytest.skip("this PyTorch has no float8_e4m3fn")
    (q, k, v), descales, _ = _fp8_case(seed=3)
    call = lambda: cufa.flash_attn_func(q, k, v, causal=True, q_descale=descales[0],  # noqa: E731
                                        k_descale=descales[1], v_descale=descales[2],
                                        return_lse=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # (compiled and planned outside the capture)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = call()
    (q2, k2, v2), descales2, (qf, kf, vf) = _fp8_case(seed=4)
    for x, y in zip((q, k, v, *descales), (q2, k2, v2, *descales2)):
        x.copy_(y)
    o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_no_scale_bug(*assert_fp8_rows(
        o.float().cpu().numpy().astype(np.float64), lse.cpu().numpy().astype(np.float64),
        qf, kf, vf, True, (-1, -1), 1.0 / math.sqrt(q.shape[-1]), torch.bfloat16))
