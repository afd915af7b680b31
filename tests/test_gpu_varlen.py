"""GPU: packed variable-length batches — every sequence checked against the reference
run on it alone (pass rule in _attention_check.py)."""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import cufa  # noqa: E402
from cufa import reference  # noqa: E402
from _attention_check import DTYPES, check_attention, randn  # noqa: E402

LENGTHS = [0, 1, 2, 7, 64, 65, 127, 128, 129, 200, 300, 513]


def _cu(lens):
    return torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")


def _check_each_sequence(out, lse, q, k, v, lens_q, lens_k, used=None, alibi=None, label="", **kw):
    cq, ck = np.concatenate([[0], np.cumsum(lens_q)]), np.concatenate([[0], np.cumsum(lens_k)])
    for b in range(len(lens_q)):
        s, e = cq[b], cq[b + 1]
        ks, ke = ck[b], ck[b] + (used[b] if used is not None else lens_k[b])
        if e == s:
            continue
        kw_b = dict(kw)
        if alibi is not None:
            kw_b["alibi_slopes"] = alibi if alibi.ndim == 1 else alibi[b]
        check_attention(out[s:e][None], lse[:, s:e][None], q[s:e][None], k[ks:ke][None],
                        v[ks:ke][None], label=f"{label} seq {b} ({e - s} x {ke - ks})", **kw_b)


@pytest.mark.parametrize("seed", range(24))
def test_random_packed_batches(seed):
    rng = np.random.default_rng(500 + seed)
    batch = int(rng.integers(1, 12))
    lens_q = [int(x) for x in rng.choice(LENGTHS, batch)]
    lens_k = lens_q if rng.random() < 0.5 else [int(x) for x in rng.choice(LENGTHS, batch)]
    dtype = str(rng.choice(list(DTYPES)))
    d = int(rng.choice([32, 64, 96, 128, 256]))
    h, hk = (int(x) for x in rng.choice([(4, 4), (4, 2), (6, 1)]))
    kw = {}
    if rng.random() < 0.5:
        kw["causal"] = True
    if rng.random() < 0.3:  # both sides, -1 on either, right sides past every key
        kw["window_size"] = [(int(rng.integers(0, 100)), int(rng.integers(-1, 20))),
                             (-1, int(rng.integers(0, 20))), (-1, int(rng.integers(0, 600))),
                             (int(rng.integers(0, 100)), -1)][int(rng.integers(4))]
    if rng.random() < 0.3:
        kw["softcap"] = 10.0
    alibi = None
    if rng.random() < 0.3:
        shape = (h,) if rng.random() < 0.5 else (batch, h)
        alibi = torch.from_numpy(rng.uniform(0, 1, shape).astype(np.float32)).cuda()
    q = randn(rng, (1, sum(lens_q), h, d), dtype)[0]
    k, v = (randn(rng, (1, sum(lens_k), hk, d), dtype)[0] for _ in range(2))
    out = torch.full_like(q, float("nan"))
    res, lse = cufa.flash_attn_varlen_func(
        q, k, v, _cu(lens_q), _cu(lens_k), max(lens_q) + 5, max(lens_k), out=out,
        return_lse=True, alibi_slopes=alibi, check_cu_seqlens=True, **kw)
    assert res is out and lse.shape == (h, sum(lens_q))
    _check_each_sequence(out, lse, q, k, v, lens_q, lens_k, alibi=alibi,
                         label=f"{dtype} d={d} h={h}/{hk} {sorted(kw)}", **kw)


def _check_mask_kind(rng, d, mods, lens_q, lens_k, dense_shapes, window, dtypes):
    """A packed batch (lens_q, lens_k) and padded ones of 2 x (n_q, n_k), 4 heads over 2
    KV heads, under one mask kind: "none", "causal" or "window+softcap+alibi"."""
    h, hk = 4, 2
    kw = {"causal": mods == "causal"}
    alibi = None
    if mods.startswith("window"):
        kw.update(window_size=window, softcap=8.0)
        alibi = torch.from_numpy(rng.uniform(0, 1, (h,)).astype(np.float32)).cuda()
    packed_dtype, dense_dtype = dtypes
    q = randn(rng, (1, sum(lens_q), h, d), packed_dtype)[0]
    k, v = (randn(rng, (1, sum(lens_k), hk, d), packed_dtype)[0] for _ in range(2))
    out = torch.full_like(q, float("nan"))
    _, lse = cufa.flash_attn_varlen_func(q, k, v, _cu(lens_q), _cu(lens_k), max(lens_q),
                                         max(lens_k), out=out, return_lse=True,
                                         alibi_slopes=alibi, **kw)
    _check_each_sequence(out, lse, q, k, v, lens_q, lens_k, alibi=alibi, label=f"d={d} {mods}",
                         **kw)
    for n_q, n_k in dense_shapes:
        dense_q = randn(rng, (2, n_q, h, d), dense_dtype)
        dense_k, dense_v = (randn(rng, (2, n_k, hk, d), dense_dtype) for _ in range(2))
        dense_out, dense_lse = cufa.flash_attn_func(dense_q, dense_k, dense_v, return_lse=True,
                                                    alibi_slopes=alibi, **kw)
        check_attention(dense_out, dense_lse, dense_q, dense_k, dense_v, alibi_slopes=alibi,
                        label=f"dense {n_q}x{n_k} d={d} {mods}", **kw)


@pytest.mark.parametrize("d", [32, 64, 128, 192])
@pytest.mark.parametrize("mods", ["none", "causal", "window+softcap+alibi"])
def test_last_rows_with_many_key_blocks(d, mods):
    """A sequence's last 64 rows or fewer against several key blocks: on Hopper one
    consumer warpgroup runs them alone, without turns (sm80: ordinary tiles)."""
    _check_mask_kind(np.random.default_rng(600 + d), d, mods,
                     lens_q=[64, 129, 192, 300, 449, 40, 1, 257],
                     lens_k=[700, 129, 192, 300, 449, 900, 260, 1000],
                     dense_shapes=[(192, 333)],  # rows 128..191 a solo tile too
                     window=(150, 30), dtypes=("bfloat16", "float16"))


# key counts around half and whole multiples of every sm90 key-block width (32, 64, 80,
# 128, 192): the highest key block seen in part, by every row or only by some
KEY_BLOCK_EDGE_LENGTHS = [1, 31, 32, 33, 40, 63, 64, 65, 95, 96, 97, 127, 160, 161, 191, 192,
                          193, 255, 257, 288, 289, 320, 383, 385]


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mods", ["none", "causal", "window+softcap+alibi"])
def test_partly_seen_last_key_blocks(d, mods):
    """Sequences whose highest key block is seen up to about half, or just past it, by
    every row (the sequence's last keys) or by some (a causal diagonal)."""
    lens_k = list(KEY_BLOCK_EDGE_LENGTHS)
    _check_mask_kind(np.random.default_rng(700 + d), d, mods,
                     lens_q=[n if i % 3 else max(1, n - 37) for i, n in enumerate(lens_k)],
                     lens_k=lens_k,
                     dense_shapes=[(97, 97), (160, 161), (33, 289), (289, 289)],
                     window=(90, 20), dtypes=("float16", "bfloat16"))


def test_seqused_k_and_sequences_without_keys():
    rng = np.random.default_rng(7)
    lens_q, lens_k = [5, 40, 0, 130, 9], [60, 0, 3, 200, 9]
    used = [17, 0, 3, 150, 0]
    q = randn(rng, (1, sum(lens_q), 4, 64), "bfloat16")[0]
    k, v = (randn(rng, (1, sum(lens_k), 2, 64), "bfloat16")[0] for _ in range(2))
    used_t = torch.tensor(used, dtype=torch.int32, device="cuda")
    out, lse = cufa.flash_attn_varlen_func(q, k, v, _cu(lens_q), _cu(lens_k), 130, 200,
                                           causal=True, seqused_k=used_t, return_lse=True)
    assert (out[45 + 130:] == 0).all() and torch.isneginf(lse[:, 45 + 130:]).all()  # used 0
    _check_each_sequence(out, lse, q, k, v, lens_q, lens_k, used=used, causal=True)


def test_matches_padded_dense_call():
    """The same sequences, padded to one length, through flash_attn_func."""
    rng = np.random.default_rng(8)
    lens = [100, 37, 128, 1]
    dense = randn(rng, (4, 128, 4, 64), "float16")
    packed = torch.cat([dense[b, :n] for b, n in enumerate(lens)])
    out, lse = cufa.flash_attn_varlen_func(packed, packed, packed, _cu(lens), _cu(lens), 128,
                                           128, causal=True, return_lse=True)
    _check_each_sequence(out, lse, packed, packed, packed, lens, lens, causal=True)
    for b, n in enumerate(lens):
        ref = cufa.flash_attn_func(dense[b:b + 1, :n], dense[b:b + 1, :n], dense[b:b + 1, :n],
                                   causal=True)
        torch.testing.assert_close(out[sum(lens[:b]):sum(lens[:b]) + n], ref[0], rtol=0, atol=0)


def test_many_short_sequences():
    rng = np.random.default_rng(9)
    lens = [int(x) for x in rng.integers(0, 9, 5000)]
    q = randn(rng, (1, sum(lens), 2, 64), "float16")[0]
    out, lse = cufa.flash_attn_varlen_func(q, q, q, _cu(lens), _cu(lens), 8, 8, causal=True,
                                           return_lse=True)
    pick = [b for b in range(len(lens)) if lens[b]][:: 97]
    cq = np.concatenate([[0], np.cumsum(lens)])
    for b in pick:
        s, e = cq[b], cq[b + 1]
        check_attention(out[s:e][None], lse[:, s:e][None], q[s:e][None], q[s:e][None],
                        q[s:e][None], causal=True)


def test_unpad_pad_roundtrip_and_attention():
    rng = np.random.default_rng(10)
    batch, seqlen = 3, 50
    hidden = randn(rng, (batch, seqlen, 2, 32), "float16")
    mask = torch.zeros(batch, seqlen, dtype=torch.bool, device="cuda")
    for b, n in enumerate([50, 0, 17]):
        mask[b, :n] = True
    mask[2, 30] = True                                   # not only prefixes
    packed, indices, cu, max_len = cufa.unpad_input(hidden, mask)
    assert packed.shape == (68, 2, 32) and cu.tolist() == [0, 50, 50, 68] and max_len == 50
    assert torch.equal(cufa.pad_input(packed, indices, batch, seqlen),
                       hidden * mask[..., None, None])


def test_bad_cu_seqlens_are_refused():
    q = torch.randn(10, 2, 64, device="cuda", dtype=torch.float16)
    good = torch.tensor([0, 4, 10], dtype=torch.int32, device="cuda")
    cases = [
        (good.long(), TypeError, "cu_seqlens_q must be int32"),
        (good[None], ValueError, "cu_seqlens_q must be 1-D"),
        (torch.tensor([0, 4, 9], dtype=torch.int32, device="cuda"), ValueError, "ends at 9"),
        (torch.tensor([0, 6, 4, 10], dtype=torch.int32, device="cuda"), ValueError,
         "non-decreasing"),
        (torch.tensor([1, 4, 10], dtype=torch.int32, device="cuda"), ValueError, "start at 0"),
    ]
    for cu, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            cufa.flash_attn_varlen_func(q, q, q, cu, cu, 10, 10, check_cu_seqlens=True)
    with pytest.raises(ValueError, match="seqused_k"):
        cufa.flash_attn_varlen_func(q, q, q, good, good, 6, 6, check_cu_seqlens=True,
                                    seqused_k=torch.tensor([5, 1], dtype=torch.int32,
                                                           device="cuda"))
    # without the check, malformed values stay inside the tensors (no crash, no hang)
    bad = torch.tensor([0, 60, -5], dtype=torch.int32, device="cuda")
    cufa.flash_attn_varlen_func(q, q, q, bad, bad, 10, 10)
    torch.cuda.synchronize()
    out = cufa.flash_attn_varlen_func(q, q, q, good, good, 6, 6)
    check_attention(out[:4][None], None, q[:4][None], q[:4][None], q[:4][None])


@pytest.mark.parametrize("family", ["default", "sm80"])
@pytest.mark.parametrize("paged", [False, True], ids=["packed", "pages of 16"])
def test_right_window_wider_than_the_keys_packed(rng, monkeypatch, family, paged):
    """The fuzz's window bug (nine of its ten cases packed): sequences with more query
    rows than keys and a window (-1, right) whose right side passes the keys, with
    seqused_k (NaN past the used keys) and paged keys; each sequence against the
    reference on its used keys."""
    lens_q, lens_k, used = [257, 191, 40, 129, 3], [2, 7, 300, 1, 16], [2, 5, 40, 1, 0]
    h, hk, d, window = 4, 2, 64, (-1, 41)
    q = randn(rng, (1, sum(lens_q), h, d), "float16")[0]
    ck = np.concatenate([[0], np.cumsum(lens_k)])
    extra = dict(seqused_k=torch.tensor(used, dtype=torch.int32, device="cuda"))
    if paged:
        page = 16
        capacity = page * -(-max(lens_k) // page)
        k_seq, v_seq = (randn(rng, (len(lens_k), capacity, hk, d), "float16") for _ in range(2))
        for x in (k_seq, v_seq):
            for i, n in enumerate(used):
                x[i, n:] = float("nan")
        table, num_pages = reference.paged_layout(len(lens_k), capacity, page, rng)
        k, v = (reference.to_paged(x, table, num_pages, fill=float("nan"))
                for x in (k_seq, v_seq))
        extra["block_table"] = torch.tensor(table, dtype=torch.int32, device="cuda")
        keys = [(k_seq[i, :n], v_seq[i, :n]) for i, n in enumerate(used)]
    else:
        k, v = (randn(rng, (1, sum(lens_k), hk, d), "float16")[0] for _ in range(2))
        for x in (k, v):
            for i, n in enumerate(used):
                x[ck[i] + n:ck[i + 1]] = float("nan")
        keys = [(k[ck[i]:ck[i] + n], v[ck[i]:ck[i] + n]) for i, n in enumerate(used)]
    if family == "sm80":
        monkeypatch.setenv("CUFA_KERNEL_FAMILY", "sm80")
    cufa.api.clear_plans()
    try:
        out = torch.full_like(q, float("nan"))
        _, lse = cufa.flash_attn_varlen_func(q, k, v, _cu(lens_q), _cu(lens_k), max(lens_q),
                                             max(lens_k), window_size=window, out=out,
                                             return_lse=True, **extra)
    finally:
        monkeypatch.undo()
        cufa.api.clear_plans()
    cq = np.concatenate([[0], np.cumsum(lens_q)])
    for i, (kb, vb) in enumerate(keys):
        rows = slice(cq[i], cq[i + 1])
        check_attention(out[rows][None], lse[:, rows][None], q[rows][None], kb[None], vb[None],
                        window_size=window, label=f"{family} paged={paged} sequence {i}")
