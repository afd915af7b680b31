"""GPU: flash_attn_func and scaled_dot_product_attention against the float64 reference
(pass rule in _attention_check.py). Runs on a CUDA device with PyTorch installed."""
import math

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import cufa  # noqa: E402
from _attention_check import (  # noqa: E402
    assert_pass_rule, check_attention, f64, lowp_attention, randn)


def _poisoned_like(q):
    return torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", list(range(8, 257, 8)))
def test_every_head_dim(rng, dtype, d):
    q = randn(rng, (2, 65, 4, d), dtype)
    k, v = (randn(rng, (2, 67, 2, d), dtype) for _ in range(2))
    out = _poisoned_like(q)
    res, lse = cufa.flash_attn_func(q, k, v, out=out, return_lse=True)
    assert res is out
    check_attention(out, lse, q, k, v, label=f"d={d}")


def _random_case(rng):
    dtype = str(rng.choice(["float16", "bfloat16"]))
    d = int(rng.choice([8, 40, 64, 72, 96, 128, 160, 200, 256]))
    sq, sk = (int(x) for x in rng.choice(
        [(1, 1), (1, 77), (77, 1), (7, 7), (65, 129), (129, 65), (113, 203), (256, 256),
         (200, 31), (31, 200), (128, 129)]))
    h, hk = (int(x) for x in rng.choice([(4, 4), (4, 2), (6, 1), (8, 2)]))
    b = int(rng.integers(1, 4))
    kw = {}
    if rng.random() < 0.5:
        kw["causal"] = True
    w = rng.integers(0, 4)
    if w == 1:
        kw["window_size"] = (int(rng.integers(0, 64)), -1)
    elif w == 2:
        kw["window_size"] = (-1, int(rng.integers(0, 16)))
    elif w == 3:
        kw["window_size"] = (int(rng.integers(0, 40)), int(rng.integers(0, 40)))
    if rng.random() < 0.4:
        kw["softcap"] = float(rng.choice([2.0, 5.0, 30.0]))
    if rng.random() < 0.3:
        shape = (h,) if rng.random() < 0.5 else (b, h)
        kw["alibi_slopes"] = torch.from_numpy(rng.uniform(0, 1, shape).astype(np.float32)).cuda()
    if rng.random() < 0.3:
        kw["softmax_scale"] = float(rng.uniform(0.02, 0.5))
    layout = str(rng.choice(["bshd", "bhsd", "padded"]))
    return dtype, d, (b, sq, sk, h, hk), kw, layout


@pytest.mark.parametrize("seed", range(80))
def test_random_shapes_and_masks(seed):
    rng = np.random.default_rng(1000 + seed)
    dtype, d, (b, sq, sk, h, hk), kw, layout = _random_case(rng)
    q = randn(rng, (b, sq, h, d), dtype, layout=layout)
    k, v = (randn(rng, (b, sk, hk, d), dtype, layout=layout) for _ in range(2))
    out, lse = cufa.flash_attn_func(q, k, v, return_lse=True, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == torch.float32
    label = f"{dtype} d={d} b={b} sq={sq} sk={sk} h={h}/{hk} {layout} {sorted(kw)}"
    check_attention(out, lse, q, k, v, label=label, **kw)


# A tile's first (highest) key block with no row seeing its upper half is computed on its
# lower half only (kHalfFirstBlock): every other 64-row tile of a causal sequence on
# 128-key blocks, and sequences whose last block holds 1-64 keys; next to them, lengths
# whose last block is just over half full.
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq,sk,kw", [
    (512, 512, {"causal": True}), (576, 576, {"causal": True}), (320, 320, {"causal": True}),
    (200, 329, {"causal": True}), (300, 129, {}), (300, 192, {}), (77, 576, {}), (300, 193, {}),
    (512, 512, {"window_size": (100, 0)}), (256, 640, {"window_size": (-1, 20)})])
def test_first_block_upper_half_skipped(rng, d, sq, sk, kw):
    q = randn(rng, (2, sq, 4, d), "float16")
    k, v = (randn(rng, (2, sk, 2, d), "float16") for _ in range(2))
    out = _poisoned_like(q)
    _, lse = cufa.flash_attn_func(q, k, v, out=out, return_lse=True, **kw)
    check_attention(out, lse, q, k, v, label=f"d={d} sq={sq} sk={sk} {kw}", **kw)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_packed_qkv_views(rng, dtype):
    """q, k, v sliced out of one (b, s, 3, h, d) buffer: strided, no copy."""
    qkv = randn(rng, (2, 3 * 150, 4, 64), dtype).view(2, 150, 3, 4, 64)
    q, k, v = qkv.unbind(dim=2)
    out, lse = cufa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    check_attention(out, lse, q, k, v, causal=True)


@pytest.mark.parametrize("causal", [False, True])
def test_large_scores_do_not_overflow(rng, causal):
    q = randn(rng, (1, 100, 2, 64), "float16", scale=50.0)
    k = randn(rng, (1, 100, 2, 64), "float16", scale=50.0)
    v = randn(rng, (1, 100, 2, 64), "float16")
    out, lse = cufa.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert torch.isfinite(lse).all() and lse.abs().max() > 1e3   # scores really were large
    check_attention(out, lse, q, k, v, causal=causal)


def test_rows_without_keys_are_zero():
    rng = np.random.default_rng(5)
    # bottom-right causal with more queries than keys: the first 40 rows see nothing
    q = randn(rng, (2, 50, 2, 64), "bfloat16")
    k, v = (randn(rng, (2, 10, 2, 64), "bfloat16") for _ in range(2))
    out, lse = cufa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert (out[:, :40] == 0).all() and torch.isneginf(lse[:, :, :40]).all()
    check_attention(out, lse, q, k, v, causal=True)


def test_empty_and_degenerate_lengths():
    rng = np.random.default_rng(6)
    q = randn(rng, (2, 9, 2, 32), "float16")
    k0 = randn(rng, (2, 0, 2, 32), "float16")
    out, lse = cufa.flash_attn_func(q, k0, k0, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()
    q0 = randn(rng, (2, 0, 2, 32), "float16")
    out, lse = cufa.flash_attn_func(q0, q, q, return_lse=True)
    assert out.shape == (2, 0, 2, 32) and lse.shape == (2, 2, 0)
    b0 = randn(rng, (0, 9, 2, 32), "float16")
    assert cufa.flash_attn_func(b0, b0, b0).shape == (0, 9, 2, 32)


def test_nan_propagates_without_hang():
    rng = np.random.default_rng(7)
    q = randn(rng, (1, 70, 2, 64), "float16")
    k, v = (randn(rng, (1, 70, 2, 64), "float16") for _ in range(2))
    q[0, 5, 1, 3] = float("nan")
    k[0, 30, 0, 0] = float("nan")
    out = cufa.flash_attn_func(q, k, v, causal=True)
    torch.cuda.synchronize()
    assert torch.isnan(out[0, 5, 1]).all()                  # the NaN query's row
    assert torch.isnan(out[0, 30:, 0]).all()                # rows that see the NaN key
    assert not torch.isnan(out[0, :30, 0]).any()            # rows that don't
    assert not torch.isnan(out[0, :5, 1]).any()


# -- scaled_dot_product_attention ------------------------------------------------------------

def _sdpa_inputs(rng, dtype, b, h, hk, L, S, d):
    q = randn(rng, (b, L, h, d), dtype, layout="bhsd").transpose(1, 2)     # (b, h, L, d) contiguous
    k, v = (randn(rng, (b, S, hk, d), dtype).transpose(1, 2) for _ in range(2))  # strided views
    return q, k, v


def _check_sdpa(out, q, k, v, attn_mask=None, is_causal=False, scale=None):
    tr = (lambda x: x.transpose(1, 2))
    mask = attn_mask
    if mask is not None:   # the reference takes (b, h, L, S)-broadcastable masks as they are
        mask = mask if mask.dtype == torch.bool else mask.float()
    check_attention(tr(out), None, tr(q), tr(k), tr(v), attn_mask=mask, causal=is_causal,
                    softmax_scale=scale, diag_offset=0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("mask_shape", [None, (33, 47), (2, 1, 33, 47), (1, 4, 1, 47), (47,),
                                        (2, 4, 33, 47)])
@pytest.mark.parametrize("mask_dtype", ["bool", "float32", "float16", "bfloat16"])
def test_sdpa_masks(rng, dtype, mask_shape, mask_dtype):
    """Boolean and additive masks of every float dtype (the inputs' own, the other 16-bit
    one, float32), with -inf entries, broadcast from every rank."""
    q, k, v = _sdpa_inputs(rng, dtype, 2, 4, 4, 33, 47, 64)
    mask = None
    if mask_shape is not None:
        if mask_dtype == "bool":
            mask = torch.from_numpy(rng.random(mask_shape) > 0.25).cuda()
        else:
            values = rng.standard_normal(mask_shape) * 3
            values[rng.random(mask_shape) < 0.1] = -np.inf
            mask = torch.from_numpy(values).to("cuda", getattr(torch, mask_dtype))
    out = cufa.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert out.shape == q.shape and out.is_contiguous()
    _check_sdpa(out, q, k, v, attn_mask=mask)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sdpa_additive_mask_views(rng, dtype):
    """Additive masks of the inputs' dtype read through their strides: expanded (zero
    strides on batch and heads) and a transposed (S, L) buffer (column stride L)."""
    q, k, v = _sdpa_inputs(rng, dtype, 2, 4, 4, 33, 47, 64)
    tdt = getattr(torch, dtype)
    expanded = torch.from_numpy(rng.standard_normal((33, 47)) * 3).to("cuda", tdt).expand(
        2, 4, 33, 47)
    transposed = torch.from_numpy(rng.standard_normal((47, 33)) * 3).to("cuda", tdt).T
    for mask in (expanded, transposed):
        out = cufa.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
        _check_sdpa(out, q, k, v, attn_mask=mask, is_causal=True)


@pytest.mark.parametrize("L,S", [(33, 47), (47, 33), (1, 64), (128, 128)])
@pytest.mark.parametrize("enable_gqa", [False, True])
def test_sdpa_causal_top_left(rng, L, S, enable_gqa):
    hk = 2 if enable_gqa else 4
    q, k, v = _sdpa_inputs(rng, "float16", 2, 4, hk, L, S, 128)
    out = cufa.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa,
                                            scale=0.1)
    _check_sdpa(out, q, k, v, is_causal=True, scale=0.1)


def test_sdpa_matches_torch(rng):
    """Against PyTorch's own SDPA in float64 (its math), by the pass rule."""
    q, k, v = _sdpa_inputs(rng, "bfloat16", 2, 8, 8, 200, 300, 128)
    mask = torch.from_numpy(rng.random((200, 300)) > 0.1).cuda()
    ours = cufa.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    theirs = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                              attn_mask=mask)
    tr = (lambda x: x.transpose(1, 2))
    lowp = lowp_attention(tr(q), tr(k), tr(v), attn_mask=mask.cpu().numpy(), diag_offset=0)
    assert_pass_rule(tr(ours), None, (f64(tr(theirs)), None), lowp, q.dtype, "sdpa vs torch")


def test_sdpa_fully_masked_row_is_zero(rng):
    q, k, v = _sdpa_inputs(rng, "float16", 1, 2, 2, 20, 30, 64)
    mask = torch.ones(20, 30, dtype=torch.bool, device="cuda")
    mask[7] = False
    out = cufa.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
    assert (out[:, :, 7] == 0).all()
    _check_sdpa(out, q, k, v, attn_mask=mask, is_causal=True)


# -- validation on the GPU: errors leave the CUDA context healthy ---------------------------------

def test_bad_inputs_leave_context_healthy(rng):
    q = randn(rng, (1, 16, 2, 64), "float16")
    bad = [
        ((q.float(), q, q), {}, TypeError),
        ((q.cpu(), q, q), {}, TypeError),
        ((q, q, q[..., :32]), {}, ValueError),
        ((q, q, q), {"window_size": (-3, 0)}, ValueError),
        ((torch.randn(1, 16, 2, 128, device="cuda", dtype=torch.float16)[..., ::2], q, q), {},
         ValueError),
    ]
    for args, kw, exc in bad:
        with pytest.raises(exc):
            cufa.flash_attn_func(*args, **kw)
    out = cufa.flash_attn_func(q, q, q)
    torch.cuda.synchronize()
    check_attention(out, None, q, q, q)


def test_cupy_inputs_return_cupy(rng):
    cupy = pytest.importorskip("cupy")
    q = randn(rng, (2, 50, 4, 64), "float16")
    cq = cupy.from_dlpack(q)
    out = cufa.flash_attn_func(cq, cq, cq, causal=True)
    assert isinstance(out, cupy.ndarray)
    check_attention(torch.from_dlpack(out), None, q, q, q, causal=True)


def test_scale_default_is_inverse_sqrt_d(rng):
    q = randn(rng, (1, 30, 2, 72), "float16")
    a = cufa.flash_attn_func(q, q, q)
    b = cufa.flash_attn_func(q, q, q, softmax_scale=1 / math.sqrt(72))
    check_attention(a, None, q, q, q, softmax_scale=1 / math.sqrt(72))
    assert torch.equal(a, b)


def test_back_to_back_calls_share_the_self_resetting_tile_counter(rng):
    """The persistent kernel's tile counter is kept per stream and reset by the kernel
    itself: calls queued without a sync in between, with different tile counts, on two
    streams at once, each compute every tile (a counter left non-zero would skip tiles of
    the next call, leaving its poison)."""
    shapes = [(1, 1, 2, 64), (3, 300, 4, 64), (2, 129, 8, 128), (1, 1000, 2, 64),
              (2, 65, 4, 256), (4, 17, 2, 64)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    calls = []
    for rep in range(3):
        for i, (b, s, h, d) in enumerate(shapes):
            q, k, v = (randn(rng, (b, s, h, d), "float16") for _ in range(3))
            out = _poisoned_like(q)
            stream = streams[(i + rep) % 2]
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                cufa.flash_attn_func(q, k, v, causal=bool(i % 2), out=out)
            calls.append((out, q, k, v, bool(i % 2)))
    torch.cuda.synchronize()
    for out, q, k, v, causal in calls:
        check_attention(out, None, q, k, v, label=f"{tuple(q.shape)} causal={causal}",
                        causal=causal)


@pytest.mark.parametrize("family", ["default", "sm80"])
@pytest.mark.parametrize("sq,sk,window,d", [
    (257, 2, (-1, 18), 24), (191, 7, (-1, 37), 176), (300, 40, (-1, 41), 64),
    (129, 1, (-1, 200), 128), (257, 2, (3, 18), 64)])
def test_right_window_wider_than_the_keys(rng, monkeypatch, family, sq, sk, window, d):
    """seqlen_q > seqlen_k and a right side longer than seqlen_k: the rows before the
    diagonal enters still see keys up to diagonal + right (bottom-right alignment), and
    the earlier rows none; the one-compare mask path once cut right to seqlen_k."""
    if family == "sm80":
        monkeypatch.setenv("CUFA_KERNEL_FAMILY", "sm80")
    cufa.api.clear_plans()   # plans read the family override when they are made
    try:
        q = randn(rng, (2, sq, 4, d), "float16")
        k, v = (randn(rng, (2, sk, 2, d), "float16") for _ in range(2))
        out = _poisoned_like(q)
        _, lse = cufa.flash_attn_func(q, k, v, out=out, window_size=window, return_lse=True)
    finally:
        monkeypatch.undo()
        cufa.api.clear_plans()
    check_attention(out, lse, q, k, v, label=f"sq={sq} sk={sk} window={window}",
                    window_size=window)
