"""GPU: flash-attn-style calls through cufa.compat.flash_attn against the float64 reference
(pass rule in _attention_check.py): the packed forms, padded batches packed with its
bert_padding, windows given as 0-d CPU tensors (as flash-attn's tests give them),
return_attn_probs, inputs that require grad, flash-attn's pages of 512 rows, a paged
cache past its block_table, a paged decode step captured in a CUDA graph, and the
RotaryEmbedding module on GPU tensors against float64 angles."""
import math

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import cufa.compat.flash_attn as flash_attn  # noqa: E402
from cufa import reference  # noqa: E402
from cufa.compat.flash_attn.bert_padding import pad_input, unpad_input  # noqa: E402
from cufa.compat.flash_attn.flash_attn_interface import _flash_attn_varlen_forward  # noqa: E402
from cufa.compat.flash_attn.layers.rotary import RotaryEmbedding, apply_rotary_emb  # noqa: E402
from _backward_check import check_grads  # noqa: E402
from _attention_check import (  # noqa: E402
    DTYPES, capture_cuda_graph, check_appended_cache, check_attention, check_kvcache, f64)

HEAD_DIMS = [40, 59, 64, 111, 128]  # 59 and 111: not multiples of 8, as flash-attn tests


def tensor(rng, shape, dtype="float16", scale=1.0):
    x = rng.standard_normal(shape, dtype=np.float32) * scale
    return torch.from_numpy(x).to("cuda", DTYPES[dtype])


def i32(values):
    return torch.tensor(np.asarray(values), dtype=torch.int32, device="cuda")


def window_of(local, seqlen_k):
    """flash-attn's tests' window: (-1, -1), or a CPU tensor of two random sizes, whose
    entries are 0-d CPU tensors; and the same as Python ints for the reference."""
    if not local:
        return (-1, -1), (-1, -1)
    window = torch.randint(0, seqlen_k, (2,))
    return window, tuple(int(w) for w in window)


def check_empty_s_dmask(s, like):
    assert s.shape == (0,) and s.dtype == like.dtype and s.device == like.device


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("causal,local", [(False, False), (True, False), (False, True)])
def test_qkvpacked_and_kvpacked(rng, d, causal, local):
    torch.manual_seed(d)
    seqlen, seqlen_k = 97, 203
    qkv = tensor(rng, (2, seqlen, 3, 6, d))
    window, ints = window_of(local, seqlen)
    out, lse, s = flash_attn.flash_attn_qkvpacked_func(qkv, causal=causal, window_size=window,
                                                       return_attn_probs=True)
    check_attention(out, lse, *qkv.unbind(2), label=f"qkvpacked d={d}", causal=causal,
                    window_size=ints)
    check_empty_s_dmask(s, qkv)

    q, kv = tensor(rng, (2, seqlen, 6, d), scale=5.0), tensor(rng, (2, seqlen_k, 2, 2, d))
    alibi = torch.rand(2, 6, device="cuda", dtype=torch.float32) * 0.3
    window, ints = window_of(local, seqlen_k)
    out = flash_attn.flash_attn_kvpacked_func(q, kv, causal=causal, window_size=window,
                                              softcap=50.0, alibi_slopes=alibi)
    check_attention(out, None, q, *kv.unbind(2), label=f"kvpacked d={d}", causal=causal,
                    window_size=ints, softcap=50.0, alibi_slopes=alibi)


def _padded_batch(rng, batch, seqlen):
    """Prefix masks of random lengths (one full, one of a single token), as flash-attn's
    tests make them: (mask (batch, seqlen) bool on the GPU, the lengths)."""
    lens = rng.integers(max(1, seqlen - 20), seqlen + 1, batch)
    lens[0], lens[-1] = seqlen, 1
    mask = torch.arange(seqlen, device="cuda")[None, :] < torch.from_numpy(lens).cuda()[:, None]
    return mask, lens


def check_sequences(out_unpad, lse, q, k, v, lens_q, lens_k, label, **kw):
    """Each sequence of a packed call's out (total, h, d) and lse (h, total) against the
    reference over its rows of the padded q, k, v."""
    start = 0
    for b, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        rows = slice(start, start + nq)
        check_attention(out_unpad[rows][None], None if lse is None else lse[:, rows][None],
                        q[b:b + 1, :nq], k[b:b + 1, :nk], v[b:b + 1, :nk],
                        label=f"{label}: sequence {b}", **kw)
        start += nq


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("causal,local", [(False, False), (True, False), (True, True)])
def test_varlen_packed_forms_of_padded_batches(rng, d, causal, local):
    torch.manual_seed(d)
    batch, seqlen, seqlen_k = 4, 113, 211
    qkv = tensor(rng, (batch, seqlen, 3, 6, d))
    mask, lens = _padded_batch(rng, batch, seqlen)
    qkv_unpad, indices, cu, max_seqlen, used = unpad_input(qkv, mask)
    assert used.tolist() == lens.tolist() and max_seqlen == seqlen
    window, ints = window_of(local, seqlen)
    out_unpad, lse, s = flash_attn.flash_attn_varlen_qkvpacked_func(
        qkv_unpad, cu, max_seqlen, causal=causal, window_size=window, return_attn_probs=True)
    check_empty_s_dmask(s, qkv)
    check_sequences(out_unpad, lse, *qkv.unbind(2), lens, lens, f"varlen qkvpacked d={d}",
                    causal=causal, window_size=ints)
    padded = pad_input(out_unpad, indices, batch, seqlen)
    assert (padded[~mask] == 0).all() and torch.equal(padded[mask], out_unpad)

    q, kv = tensor(rng, (batch, seqlen, 6, d)), tensor(rng, (batch, seqlen_k, 2, 3, d))
    mask_k, lens_k = _padded_batch(rng, batch, seqlen_k)
    q_unpad, _, cu_q, max_q, _ = unpad_input(q, mask)
    kv_unpad, _, cu_k, max_k, _ = unpad_input(kv, mask_k)
    window, ints = window_of(local, seqlen_k)
    out_unpad = flash_attn.flash_attn_varlen_kvpacked_func(
        q_unpad, kv_unpad, cu_q, cu_k, max_q, max_k, causal=causal, window_size=window)
    check_sequences(out_unpad, None, q, *kv.unbind(2), lens, lens_k, f"varlen kvpacked d={d}",
                    causal=causal, window_size=ints)


def test_inputs_that_require_grad_get_the_forward_and_the_backward(rng):
    """Autograd through the compat functions, a non-leaf q included (flash-attn's softcap
    tests scale q before the call)."""
    q = tensor(rng, (2, 128, 4, 64)).requires_grad_()
    k, v = (tensor(rng, (2, 150, 2, 64)).requires_grad_() for _ in range(2))
    scaled = q * 3
    out, lse, _ = flash_attn.flash_attn_func(scaled, k, v, causal=True, return_attn_probs=True)
    assert out.requires_grad
    check_attention(out, lse.detach(), scaled, k, v, label="requires grad", causal=True)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (scaled, k, v), dout)
    check_grads(got, scaled, k, v, dout, "compat dense", out=out, causal=True)
    cu = i32([0, 100, 256])
    qv, kv, vv = (x[:, :128].reshape(256, x.shape[2], 64) for x in (scaled, k, v))
    out = flash_attn.flash_attn_varlen_func(qv, kv, vv, cu, cu, 156, 156)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (qv, kv, vv), dout)
    for i, r in enumerate((slice(0, 100), slice(100, 256))):
        check_grads([g[r][None] for g in got], *(x[r][None] for x in (qv, kv, vv, dout)),
                    f"compat varlen sequence {i}", out=out[r][None])


@pytest.mark.parametrize("append", [False, True])
def test_paged_cache_past_its_block_table_raises(rng, append):
    # flash-attn's test_flash_attn_kvcache_paged_block_table_bounds
    cache = [tensor(rng, (4, 256, 1, 64)) for _ in range(2)]
    table = torch.zeros(1, 1, dtype=torch.int32, device="cuda")
    q = tensor(rng, (1, 1, 1, 64))
    new = [tensor(rng, (1, 1, 1, 64)) for _ in range(2)] if append else [None, None]
    over = i32([256 if append else 257])
    with pytest.raises(RuntimeError, match="block_table"):
        flash_attn.flash_attn_with_kvcache(q, *cache, *new, cache_seqlens=over,
                                           block_table=table)
    at_capacity = i32([256])
    out = flash_attn.flash_attn_with_kvcache(q, *cache, cache_seqlens=at_capacity,
                                             block_table=table)
    check_attention(out, None, q, cache[0][:1], cache[1][:1], label="at capacity")


def _paged(rng, batch, capacity, page_size, heads_k, d):
    """Random caches of `capacity` keys a sequence in pages of page_size rows: (k_pages,
    v_pages, block_table on the GPU, block_table as NumPy)."""
    table, num_pages = reference.paged_layout(batch, capacity, page_size, rng)
    pages = [tensor(rng, (num_pages, page_size, heads_k, d)) for _ in range(2)]
    return pages[0], pages[1], i32(table), table


@pytest.mark.parametrize("rotary", [None, "interleaved", "half"])
def test_kvcache_with_flash_attns_pages_of_512(rng, rotary):
    batch, capacity, d = 3, 1536, 64
    k_pages, v_pages, table, table_np = _paged(rng, batch, capacity, 512, 2, d)
    q, k, v = tensor(rng, (batch, 2, 6, d)), tensor(rng, (batch, 2, 2, d)), tensor(
        rng, (batch, 2, 2, d))
    lens = i32([0, 700, capacity - 2])
    kw = dict(cache_seqlens=lens, block_table=table, causal=True)
    if rotary:
        angle = torch.rand(capacity, d // 4, device="cuda") * 2 * math.pi
        kw.update(rotary_cos=angle.cos().half(), rotary_sin=angle.sin().half(),
                  rotary_interleaved=rotary == "interleaved")
    before = k_pages.clone(), v_pages.clone()
    out, lse = flash_attn.flash_attn_with_kvcache(q, k_pages, v_pages, k, v,
                                                  return_softmax_lse=True, **kw)
    kw["block_table"] = table_np
    k_after, _ = check_kvcache(out, lse, q, *before, k, v, label=f"pages of 512 {rotary}", **kw)
    # the appended keys against the reference's (rotated in float64), the rest untouched
    positions = lens.cpu().numpy()[:, None] + np.arange(2)[None, :]
    slots = (table_np[np.arange(batch)[:, None], positions // 512].ravel(),
             (positions % 512).ravel())
    check_appended_cache(k_pages, before[0], k_after, slots, f"pages of 512 {rotary}",
                         rotated=bool(rotary))
    if rotary:  # compat's apply_rotary_emb (flash-attn's own test's oracle) agrees with it
        rotated = f64(apply_rotary_emb(k, kw["rotary_cos"], kw["rotary_sin"],
                                       seqlen_offsets=lens, interleaved=rotary == "interleaved"))
        expected = k_after[slots].reshape(rotated.shape)
        assert np.abs(rotated - expected).max() <= 2 ** -9 * np.abs(expected).max(), rotary


def test_varlen_with_flash_attns_pages_of_512(rng):
    batch, capacity, d = 3, 1024, 128
    k_pages, v_pages, table, table_np = _paged(rng, batch, capacity, 512, 2, d)
    lens_q, lens_k = [5, 1, 77], [1024, 300, 513]
    q = tensor(rng, (sum(lens_q), 8, d))
    cu_q = i32(np.concatenate([[0], np.cumsum(lens_q)]))
    cu_k = i32(np.concatenate([[0], np.cumsum(lens_k)]))
    out = flash_attn.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max(lens_q),
                                            max(lens_k), causal=True, block_table=table)
    keys, values = (reference.from_paged(p, table_np) for p in (k_pages, v_pages))
    start = 0
    for b, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        check_attention(out[start:start + nq][None], None, q[start:start + nq][None],
                        keys[b:b + 1, :nk], values[b:b + 1, :nk], label=f"sequence {b}",
                        causal=True)
        start += nq


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_varlen_paged_num_splits(rng, dtype):
    # flash-attn's test_flash_attn_varlen_paged_kv_num_splits
    k_pages, v_pages, table, table_np = _paged(rng, 2, 1024, 256, 2, 64)
    q = tensor(rng, (2, 4, 64), dtype)
    k_pages, v_pages = k_pages.to(q.dtype), v_pages.to(q.dtype)
    used = i32([512, 1024])
    kw = dict(cu_seqlens_q=i32([0, 1, 2]), cu_seqlens_k=i32([0, 512, 1536]), max_seqlen_q=1,
              max_seqlen_k=1024, dropout_p=0.0, softmax_scale=64 ** -0.5, causal=False,
              window_size_left=-1, window_size_right=0, block_table=table, seqused_k=used)
    out, lse, s, _ = _flash_attn_varlen_forward(q, k_pages, v_pages, **kw)
    again = _flash_attn_varlen_forward(q, k_pages, v_pages, **kw, num_splits=0)[0]
    assert torch.equal(out, again)
    keys, values = (reference.from_paged(p, table_np) for p in (k_pages, v_pages))
    for b, n in enumerate((512, 1024)):
        check_attention(out[b][None, None], lse[:, b][None, :, None], q[b][None, None],
                        keys[b:b + 1, :n], values[b:b + 1, :n], label=f"sequence {b}",
                        window_size=(-1, 0))
    with pytest.raises(RuntimeError, match="num_splits > 1 is not supported"):
        _flash_attn_varlen_forward(q, k_pages, v_pages, **kw, num_splits=2)


def test_paged_decode_step_captured_in_a_cuda_graph(rng):
    """The block_table check reads max(cache_seqlens), which a capture forbids: compat
    skips it there, and the replays with new lengths are still right."""
    batch, capacity, d = 4, 1024, 128
    k_pages, v_pages, table, table_np = _paged(rng, batch, capacity, 512, 2, d)
    q = tensor(rng, (batch, 1, 8, d))
    lens = i32([1, 300, 513, 1024])
    graph, (out, lse) = capture_cuda_graph(lambda: flash_attn.flash_attn_with_kvcache(
        q, k_pages, v_pages, cache_seqlens=lens, block_table=table, return_softmax_lse=True))
    for new_lens in ([1024, 1, 77, 600], [5, 6, 7, 8]):
        lens.copy_(i32(new_lens))
        q.copy_(tensor(rng, q.shape))
        graph.replay()
        torch.cuda.synchronize()
        check_kvcache(out, lse, q, k_pages, v_pages, cache_seqlens=lens, block_table=table_np,
                      label=f"replay {new_lens}")


def test_raw_fwd_writes_into_out_and_returns_four_values(rng):
    gpu = flash_attn.flash_attn_interface.flash_attn_gpu
    q, k = tensor(rng, (2, 61, 4, 64)), tensor(rng, (2, 70, 4, 64))
    out_ = torch.full_like(q, float("nan"))
    out, lse, s, rng_state = gpu.fwd(q, k, k, out_, None, 0.0, 0.125, True, torch.tensor(9),
                                     torch.tensor(0), 0.0, False, None)
    assert out is out_ and rng_state.shape == (2,)
    check_empty_s_dmask(s, q)
    check_attention(out, lse, q, k, k, label="raw fwd", softmax_scale=0.125, causal=True,
                    window_size=(9, 0))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_rotary_embedding_on_gpu_tensors(rng, dtype):
    """RotaryEmbedding on a GPU GQA-packed qkv with per-sequence offsets (a decode step's
    cache lengths): its tables built on the device in qkv's dtype, q and k rotated in place
    within two roundings of the float64 rotation (each element against its row's largest),
    v untouched."""
    batch, seqlen, hq, hk, d, dim, base = 3, 5, 4, 2, 64, 32, 10000.0
    module = RotaryEmbedding(dim, base=base)
    qkv = tensor(rng, (batch, seqlen, hq + 2 * hk, d), dtype)
    before = f64(qkv)
    offsets = torch.tensor([0, 700, 4090], device="cuda")
    assert module(qkv, seqlen_offset=offsets, max_seqlen=4096, num_heads_q=hq) is qkv
    assert module._cos_cached.device.type == "cuda" and module._cos_cached.dtype == qkv.dtype
    half = dim // 2
    angle = (offsets.cpu().numpy()[:, None] + np.arange(seqlen))[..., None] * \
        base ** (-np.arange(0, dim, 2) / dim)  # (batch, seqlen, half)
    turn = (np.cos(angle) + 1j * np.sin(angle))[:, :, None, :]
    z = (before[..., :half] + 1j * before[..., half:dim]) * turn
    want = before.copy()
    want[:, :, :hq + hk, :half] = z.real[:, :, :hq + hk]
    want[:, :, :hq + hk, half:dim] = z.imag[:, :, :hq + hk]
    got = f64(qkv)
    eps = 2.0 ** (-8 if dtype == "bfloat16" else -11)
    # (the tables round cos and sin to the dtype once, the rotation rounds once more)
    bound = 3 * eps * np.abs(want).max(-1, keepdims=True)
    assert (np.abs(got - want) <= bound).all(), np.abs(got - want).max()
    assert np.array_equal(got[:, :, hq + hk:], before[:, :, hq + hk:])
