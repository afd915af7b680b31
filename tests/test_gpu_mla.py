"""MLA decode through flash_attn_with_kvcache(qv=...) on Hopper (FlashAttention-3's form:
q and k_cache the 64 rotary dims, qv and v_cache the 512 latent ones, v_cache also the
values), against the float64 reference under the per-row pass rule. MLA's scores are
plain attention's with q' = [qv, q] and k' = [c_kv, k_pe], its values c_kv, so the
forward's references check it. Contiguous caches and pages of 16 and 64, 1 to 4 query
tokens, 16 and 128 heads on one latent head (one and two CTAs of rows) and two KV heads,
lengths that are not multiples of the 32-key block, empty sequences, causal, splits
chosen and given, appends, out= and lse, CUDA graph replays with new lengths,
torch.compile and jax.jit; outputs poisoned first."""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cufa  # noqa: E402
from cufa import _compile, _runtime, reference  # noqa: E402
from _attention_check import (  # noqa: E402
    capture_cuda_graph, check_appended_cache, check_attention, check_kvcache, i32, randn)

pytestmark = pytest.mark.gpu

ROPE, LATENT = _compile.MLA_ROPE_DIM, _compile.MLA_LATENT_DIM
NAN = float("nan")


def hopper_family():
    return _compile.family_for(_runtime.compute_capability(torch.cuda.current_device())) == "sm90"


@pytest.fixture
def hopper():
    if not hopper_family():
        pytest.skip("MLA decode runs on Hopper's kernel family (wgmma) alone")


def test_mla_refused_elsewhere():
    """Off Hopper's kernel family (another GPU, or CUFA_KERNEL_FAMILY=sm80): a clear error."""
    if hopper_family():
        pytest.skip("Hopper's kernel family runs it")
    kw, _, _ = build(np.random.default_rng(1), lens=[5])
    with pytest.raises(NotImplementedError, match=r"qv \(MLA decode\) runs on Hopper"):
        cufa.flash_attn_with_kvcache(**kw)


def build(rng, *, dtype="bfloat16", lens, sq=1, heads=16, heads_k=1, page=None, new=0,
          capacity=None):
    """The logical caches (batch, capacity, heads_k, dim) as they are after the call, and
    the call's arguments: q, qv, the caches (paged copies where page is set, pages of no
    sequence NaN), lengths, and `new` tokens' k and v to append."""
    batch = len(lens)
    capacity = capacity or -(-(max(lens) + new + 1) // 64) * 64
    k_pe, c_kv = (randn(rng, (batch, capacity, heads_k, d), dtype) for d in (ROPE, LATENT))
    kw = dict(q=randn(rng, (batch, sq, heads, ROPE), dtype),
              qv=randn(rng, (batch, sq, heads, LATENT), dtype), cache_seqlens=i32(lens))
    if page:
        table, num_pages = reference.paged_layout(batch, capacity, page, rng)
        kw["k_cache"], kw["v_cache"] = (reference.to_paged(c, table, num_pages, fill=NAN)
                                        for c in (k_pe, c_kv))
        kw["block_table"] = i32(table)
    else:
        kw["k_cache"], kw["v_cache"] = k_pe.clone(), c_kv.clone()
    if new:
        kw["k"] = randn(rng, (batch, new, heads_k, ROPE), dtype)
        kw["v"] = randn(rng, (batch, new, heads_k, LATENT), dtype)
        for b, n in enumerate(lens):
            k_pe[b, n:n + new] = kw["k"][b]
            c_kv[b, n:n + new] = kw["v"][b]
    return kw, k_pe, c_kv


def check_mla(out, lse, kw, k_pe, c_kv, lens, label, causal=False, softmax_scale=None):
    """Each sequence's rows against the forward's references over its keys."""
    scale = softmax_scale or 1 / math.sqrt(ROPE + LATENT)
    new = kw["k"].shape[1] if "k" in kw else 0
    for b, n in enumerate(lens):
        q_cat = torch.cat([kw["qv"][b:b + 1], kw["q"][b:b + 1]], dim=-1)
        k_cat = torch.cat([c_kv[b:b + 1, :n + new], k_pe[b:b + 1, :n + new]], dim=-1)
        check_attention(out[b:b + 1], lse[b:b + 1], q_cat, k_cat, c_kv[b:b + 1, :n + new],
                        label=f"{label}: seq {b} ({n + new} keys)", softmax_scale=scale,
                        causal=causal)


CASES = {
    "one token, 16 heads": dict(lens=[77, 1, 300]),
    "128 heads (two CTAs of rows)": dict(lens=[513, 64], heads=128),
    "speculative 4, causal, pages of 64": dict(lens=[130, 5, 1000], sq=4, page=64,
                                               causal=True),
    "2 tokens, pages of 16, 5 splits, an empty sequence": dict(lens=[1500, 0, 33], sq=2,
                                                                heads=32, page=16, causal=True,
                                                                num_splits=5),
    "two KV heads, 3 splits": dict(lens=[700, 95], heads_k=2, num_splits=3),
    "one sequence, 128 heads, split to fill the SMs": dict(lens=[4000], heads=128),
    "append 3, causal 3 tokens, pages of 64": dict(lens=[61, 0, 200], sq=3, page=64, new=3,
                                                   causal=True),
    "a given scale, one split": dict(lens=[90, 31], num_splits=1, softmax_scale=0.07),
    "128 heads, 2 tokens (rows over two CTAs), causal": dict(lens=[700, 3], sq=2, heads=128,
                                                              causal=True),
}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", list(CASES))
def test_mla_decode(hopper, name, dtype):
    case = dict(CASES[name])
    rng = np.random.default_rng(sum(map(ord, name)))
    call = {n: case.pop(n) for n in ("causal", "num_splits", "softmax_scale") if n in case}
    kw, k_pe, c_kv = build(rng, dtype=dtype, **case)
    lens = case["lens"]
    b, sq, h, _ = kw["q"].shape
    out = torch.full((b, sq, h, LATENT), NAN, dtype=kw["q"].dtype, device="cuda")
    got, lse = cufa.flash_attn_with_kvcache(**kw, **call, out=out, return_softmax_lse=True)
    assert got.data_ptr() == out.data_ptr()
    check_mla(out, lse, kw, k_pe, c_kv, lens, name, call.get("causal", False),
              call.get("softmax_scale"))
    if "k" in kw:  # the appended rows are in the caches
        page = case.get("page")
        for cache_name, logical in (("k_cache", k_pe), ("v_cache", c_kv)):
            cache = kw[cache_name]
            for s, n in enumerate(lens):
                for pos in range(n, n + kw["k"].shape[1]):
                    row = (cache[int(kw["block_table"][s, pos // page]), pos % page] if page
                           else cache[s, pos])
                    assert torch.equal(row, logical[s, pos]), f"{cache_name} seq {s} pos {pos}"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mla_scores_that_keep_rising(hopper, dtype):
    """Keys whose rotary rows grow along the sequence, so that rows' maxima rise again and
    again, by more than the kernel's lazy slack (2^8) and by less: every block both
    raises some rows' max (O rescaled) and leaves others (O kept, P up to 2^8, which fp16
    must hold too), unsplit and split."""
    rng = np.random.default_rng(11)
    kw, k_pe, c_kv = build(rng, dtype=dtype, lens=[800, 37], heads=128)
    ramp = 1 + torch.arange(k_pe.shape[1], device="cuda", dtype=torch.float32) / 48
    k_pe.copy_((k_pe.float() * ramp[None, :, None, None]).to(k_pe.dtype))
    kw["k_cache"] = k_pe.clone()
    for splits in (1, 3):
        out, lse = cufa.flash_attn_with_kvcache(**kw, num_splits=splits, softmax_scale=0.2,
                                                return_softmax_lse=True)
        check_mla(out, lse, kw, k_pe, c_kv, [800, 37], f"rising scores, {splits} splits",
                  softmax_scale=0.2)


def test_mla_every_split_count(hopper):
    """The same call unsplit and split 2, 7 and 64 ways, each against the references."""
    rng = np.random.default_rng(5)
    kw, k_pe, c_kv = build(rng, lens=[2000, 3], heads=128)
    for splits in (1, 2, 7, 64):
        out, lse = cufa.flash_attn_with_kvcache(**kw, num_splits=splits,
                                                return_softmax_lse=True)
        check_mla(out, lse, kw, k_pe, c_kv, [2000, 3], f"{splits} splits")


def test_mla_replayed_from_a_cuda_graph(hopper):
    """One step (128 heads, pages of 64, split by the planner) captured once; each replay
    with new lengths, q and qv copied into the captured tensors."""
    rng = np.random.default_rng(11)
    capacity = 1024
    kw, k_pe, c_kv = build(rng, lens=[5, 700], heads=128, page=64, capacity=capacity)
    out = torch.full((2, 1, 128, LATENT), NAN, dtype=torch.bfloat16, device="cuda")
    graph, (_, lse) = capture_cuda_graph(
        lambda: cufa.flash_attn_with_kvcache(**kw, out=out, return_softmax_lse=True))
    for replay in range(3):
        lens = [int(x) for x in rng.integers(0, capacity, 2)]
        lens[replay % 2] = capacity if replay == 1 else 0
        kw["cache_seqlens"].copy_(i32(lens))
        for n in ("q", "qv"):
            kw[n].copy_(torch.randn_like(kw[n]))
        out.fill_(NAN)
        lse.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        check_mla(out, lse, kw, k_pe, c_kv, lens, f"replay {replay} lens {lens}")


def test_mla_under_torch_compile(hopper):
    rng = np.random.default_rng(12)
    kw, k_pe, c_kv = build(rng, lens=[300, 41], heads=128, page=64, new=1)
    step = torch.compile(lambda a: cufa.flash_attn_with_kvcache(**a, causal=True,
                                                                return_softmax_lse=True),
                         fullgraph=True)
    out, lse = step(kw)
    assert out.shape == (2, 1, 128, LATENT)
    check_mla(out, lse, kw, k_pe, c_kv, [300, 41], "torch.compile", causal=True)


def test_mla_under_jax_jit(hopper):
    jax = pytest.importorskip("jax")
    from cufa import _jax
    if not _jax.available() or not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("this JAX has no buffer_callback, or sees no GPU")
    jnp = jax.numpy
    rng = np.random.default_rng(13)
    kw, k_pe, c_kv = build(rng, lens=[300, 41], heads=16)
    as_jax = {n: (jnp.asarray(x.cpu().numpy()) if x.dtype == torch.int32 else
                  jnp.asarray(x.float().cpu().numpy()).astype(jnp.bfloat16))
              for n, x in kw.items()}
    out, lse = jax.jit(lambda a: cufa.flash_attn_with_kvcache(**a, return_softmax_lse=True))(
        as_jax)
    out_t = torch.from_numpy(np.asarray(out.astype(jnp.float32))).cuda().to(torch.bfloat16)
    lse_t = torch.from_numpy(np.asarray(lse)).cuda()
    check_mla(out_t, lse_t, kw, k_pe, c_kv, [300, 41], "jax.jit")


@pytest.mark.parametrize("sq", [1, 2], ids=["one token (Q by TMA)", "two tokens"])
@pytest.mark.parametrize("page", [None, 64], ids=["contiguous", "pages of 64"])
def test_mla_rotary_append(hopper, page, sq):
    """q and the new k_pe rotated (rotary_cos / rotary_sin over the 64 rotary dims, at the
    sequences' positions), the new k_pe and c_kv appended: the reference's rotated
    attention (kvcache_references, which learns qv) and its caches after the append. With
    one token the kernel reads the rotated copy of q through its map."""
    rng = np.random.default_rng(14)
    lens = [70, 0, 129]
    kw, _, _ = build(rng, lens=lens, sq=sq, heads=16, page=page, new=2)
    angles = rng.uniform(0, 6.3, (512, 32))
    cos, sin = (torch.from_numpy(f(angles)).float().cuda() for f in (np.cos, np.sin))
    before = {n: kw[n].clone() for n in ("k_cache", "v_cache")}
    out, lse = cufa.flash_attn_with_kvcache(**kw, rotary_cos=cos, rotary_sin=sin, causal=True,
                                            return_softmax_lse=True)
    k_after, v_after = check_kvcache(out, lse, **{**kw, **before}, rotary_cos=cos,
                                     rotary_sin=sin, causal=True, label=f"rotary {page}")
    positions = np.asarray(lens)[:, None] + np.arange(2)
    if page:
        table = kw["block_table"].cpu().numpy()
        slots = (table[np.arange(3)[:, None], positions // page], positions % page)
    else:
        slots = (np.arange(3)[:, None].repeat(2, 1), positions)
    slots = tuple(s.ravel() for s in slots)
    check_appended_cache(kw["k_cache"], before["k_cache"], k_after, slots, "k_pe",
                         rotated=True)
    check_appended_cache(kw["v_cache"], before["v_cache"], v_after, slots, "c_kv")


OPTIONS = {  # flash_attn_with_kvcache's other arguments, with qv
    "a window (100, 0)": dict(window_size=(100, 0)),
    "leftpads": dict(cache_leftpad=[3, 0, 50]),
    "one int length": dict(cache_seqlens=150),
    "cache rows picked": dict(cache_batch_idx=[2, 0, 1]),
    "rotary on halves": dict(rotary_interleaved=False),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_mla_with_the_other_arguments(hopper, name):
    """Each against kvcache_references (the reference's gather: leftpads, picked rows, an
    int length, rotary), 2 causal tokens over 16 heads."""
    rng = np.random.default_rng(sum(map(ord, name)))
    kw, _, _ = build(rng, lens=[150, 37, 90], sq=2, heads=16)
    opt = dict(OPTIONS[name])
    for n in ("cache_leftpad", "cache_batch_idx"):
        if n in opt:
            kw[n] = i32(opt.pop(n))
    if "cache_seqlens" in opt:
        kw["cache_seqlens"] = opt.pop("cache_seqlens")
    if "rotary_interleaved" in opt:
        angles = rng.uniform(0, 6.3, (256, 32))
        opt["rotary_cos"], opt["rotary_sin"] = (torch.from_numpy(f(angles)).float().cuda()
                                                for f in (np.cos, np.sin))
    before = {n: kw[n].clone() for n in ("k_cache", "v_cache")}
    out, lse = cufa.flash_attn_with_kvcache(**kw, **opt, causal=True, return_softmax_lse=True)
    check_kvcache(out, lse, **{**kw, **before}, **opt, causal=True, label=name)


# -- an fp8 (e4m3) latent cache: k_pe and c_kv in float8_e4m3fn, k_descale and v_descale --

E4M3 = getattr(torch, "float8_e4m3fn", None)
# Powers of two as descales: each dequantized value (e4m3 x descale) is then a 16-bit
# value, so the 16-bit references above take the dequantized caches exactly. k's and v's
# are drawn apart, per (sequence, KV head), so that a descale applied to the wrong part,
# head or sequence, or not at all, fails.
def e4m3_descales(rng, kind, batch, heads_k):
    if kind == "none":
        return None, None
    if kind == "subnormals to unit size":  # (keys up to 1.75, values up to 7)
        return (torch.tensor([2.0 ** 7], device="cuda"), torch.tensor([2.0 ** 9], device="cuda"))
    shape = (batch, heads_k) if kind == "per sequence and head" else (1,)
    return tuple(torch.from_numpy(2.0 ** rng.integers(-3, 2, shape)).float().cuda()
                 for _ in range(2))


def build_e4m3(rng, *, dtype="bfloat16", lens, sq=1, heads=16, heads_k=1, page=None, new=0,
               descale, batch_idx=False, codes=None):
    """The call's arguments over e4m3 caches of random values; the dequantized logical
    caches (batch, capacity, heads_k, d) of each sequence as they are after the call (q's
    dtype, exact); and the bytes each cache must hold after it, in its layout (the new
    rows as torch quantizes k / k_descale after the clamp to +-448, every other byte as
    it was). batch_idx: the sequences on cache rows in a random order, two rows spare;
    pages of no sequence hold 448 (0x7e), so that a read of one shows. codes: the caches'
    bytes drawn from these e4m3 codes instead."""
    batch = len(lens)
    capacity = -(-(max(lens) + new + 1) // 64) * 64
    rows = batch + 2 if batch_idx else batch
    idx = rng.permutation(rows)[:batch] if batch_idx else np.arange(batch)
    kd, vd = e4m3_descales(rng, descale, batch, heads_k)
    if codes is None:
        caches = [torch.from_numpy(rng.standard_normal((rows, capacity, heads_k, d),
                                                       dtype=np.float32) * 4)
                  .clamp(-448, 448).to("cuda", E4M3) for d in (ROPE, LATENT)]
    else:
        caches = [torch.from_numpy(rng.choice(np.array(codes, np.uint8), (rows, capacity, heads_k, d)))
                  .cuda().view(E4M3) for d in (ROPE, LATENT)]
    kw = dict(q=randn(rng, (batch, sq, heads, ROPE), dtype),
              qv=randn(rng, (batch, sq, heads, LATENT), dtype), cache_seqlens=i32(lens),
              k_descale=kd, v_descale=vd)
    if batch_idx:
        kw["cache_batch_idx"] = i32(idx)
    if new:
        kw["k"] = randn(rng, (batch, new, heads_k, ROPE), dtype)
        kw["v"] = randn(rng, (batch, new, heads_k, LATENT), dtype)
    table = num_pages = None
    if page:
        table, num_pages = reference.paged_layout(batch, capacity, page, rng)
        kw["block_table"] = i32(table)

    def layout(cache):  # (as bytes: no fp8 indexing needed)
        return (reference.to_paged(cache.view(torch.uint8), table, num_pages, fill=0x7e)
                .view(E4M3) if page else cache.clone())
    kw["k_cache"], kw["v_cache"] = (layout(c) for c in caches)
    logical, expected = [], []
    for cache, scale, name in zip(caches, (kd, vd), ("k", "v")):
        scale = (torch.ones((batch, heads_k), device="cuda") if scale is None
                 else torch.broadcast_to(scale.reshape(-1, scale.shape[-1] if scale.dim() == 2
                                                       else 1), (batch, heads_k)))
        for b, n in enumerate(lens):  # (as bytes: fp8 tensors take few index operations)
            if new:
                cache.view(torch.uint8)[idx[b], n:n + new] = (
                    kw[name][b].float() / scale[b][None, :, None]).clamp(-448, 448).to(
                    E4M3).view(torch.uint8)
        seqs = cache.view(torch.uint8)[torch.as_tensor(idx).long().cuda()].view(E4M3)
        logical.append((seqs.float() * scale[:, None, :, None]).to(kw["q"].dtype))
        expected.append(layout(cache).view(torch.uint8))
    return kw, logical[0], logical[1], expected


E4M3_CASES = {
    "128 heads, descales a sequence, pages of 64": dict(lens=[513, 64, 1000], heads=128,
                                                        page=64,
                                                        descale="per sequence and head"),
    "two KV heads, descales a head, rows picked": dict(lens=[300, 90, 7], heads=32, heads_k=2,
                                                       descale="per sequence and head",
                                                       batch_idx=True),
    "16 heads, 2 tokens, one descale, causal": dict(lens=[300, 1, 77], sq=2,
                                                    descale="one", causal=True),
    "no descales, 4 splits, an empty sequence": dict(lens=[0, 700, 33], descale="none",
                                                     num_splits=4),
    "append 2, causal, pages of 64": dict(lens=[61, 0, 200], sq=2, page=64, new=2,
                                          descale="per sequence and head", causal=True),
    "append 1, rows picked, 128 heads": dict(lens=[5, 130, 64], heads=128, new=1,
                                             descale="one", batch_idx=True),
    # every code but NaN's: the widening's bits of each normal value and its sign (values
    # up to 448 make the softmax nearly one-hot, so small codes are the next case's)
    "every code, 128 heads, pages of 64": dict(lens=[700, 64], heads=128, page=64,
                                               descale="per sequence and head",
                                               codes=[c for c in range(256) if c & 0x7f != 0x7f]),
    # subnormals alone, scaled to unit size: flushed, they would leave scores and outputs 0
    "subnormals and zeros, 16 heads": dict(lens=[300, 45], descale="subnormals to unit size",
                                           codes=[0x00, 0x80] + [s | c for s in (0, 0x80)
                                                                 for c in range(1, 8)]),
}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", list(E4M3_CASES))
def test_mla_over_an_e4m3_cache(hopper, name, dtype):
    """Each against the references of the dequantized caches; with an append, the new
    rows' bytes are torch's quantization of k / k_descale (and of v / v_descale) after the
    clamp, and every other byte of the caches is unchanged."""
    if E4M3 is None:
        pytest.skip("this PyTorch has no float8_e4m3fn")
    case = dict(E4M3_CASES[name])
    call = {n: case.pop(n) for n in ("causal", "num_splits") if n in case}
    rng = np.random.default_rng(sum(map(ord, name)))
    kw, k_pe, c_kv, expected = build_e4m3(rng, dtype=dtype, **case)
    b, sq, h, _ = kw["q"].shape
    out = torch.full((b, sq, h, LATENT), NAN, dtype=kw["q"].dtype, device="cuda")
    got, lse = cufa.flash_attn_with_kvcache(**kw, **call, out=out, return_softmax_lse=True)
    assert got.data_ptr() == out.data_ptr()
    check_mla(out, lse, kw, k_pe, c_kv, case["lens"], f"{name} {dtype}",
              call.get("causal", False))
    for cache_name, want in zip(("k_cache", "v_cache"), expected):
        have = kw[cache_name].view(torch.uint8)
        assert torch.equal(have, want), (
            f"{cache_name}: {int((have != want).sum())} of {have.numel()} bytes differ from "
            "the cache with torch's quantization of the new rows")
