"""GPU: flash_attn_with_kvcache with an fp8 (float8_e4m3fn) KV cache and k_descale /
v_descale (FlashAttention-3's names). Each output against the float64 reference of the
dequantized cache (reference.kvcache_attention with the descales) under the per-row pass
rule; each append byte for byte against torch's own quantization of k / k_descale after
the clamp to +-448, every other cache byte unchanged."""
import math

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import cufa  # noqa: E402
from cufa import reference  # noqa: E402
from _attention_check import (  # noqa: E402
    append_slots, assert_pass_rule, i32, kvcache_references, make_sink, randn)

E4M3 = getattr(torch, "float8_e4m3fn", None)
if E4M3 is None:
    pytest.skip("this PyTorch has no float8_e4m3fn", allow_module_level=True)
NAN = float("nan")


def fp8_cache(rng, shape, scale=4.0):
    """An e4m3 cache of random values (normal draws of `scale`: most of e4m3's exponents)."""
    x = torch.from_numpy(rng.standard_normal(shape, dtype=np.float32) * scale)
    return x.clamp(-448, 448).to("cuda", E4M3)


def descales(rng, kind, batch, heads_k):
    """k or v descale: "per_head" (batch, nheads_k), "one" (1,), "scalar" 0-d, None."""
    if kind is None:
        return None
    shape = {"per_head": (batch, heads_k), "one": (1,), "scalar": ()}[kind]
    return torch.from_numpy(np.asarray(rng.uniform(0.05, 0.5, shape), dtype=np.float32)).cuda()


def build(rng, *, dtype="float16", batch=3, seqlen_q=1, heads=(8, 2), d=128, capacity=300,
          page_size=None, new=0, lens=None, descale="per_head", rotary=False, sink=None,
          batch_idx=False, leftpad=None, **call_kw):
    """One call's keyword arguments and the append's slots (cache rows or pages, positions).
    batch_idx: sequences on cache rows in a random order (two spare rows); leftpad: the
    cache_leftpad list."""
    h, hk = heads
    kw = dict(q=randn(rng, (batch, seqlen_q, h, d), dtype), **call_kw)
    rows = batch + 2 if batch_idx else batch
    k_cache, v_cache = (fp8_cache(rng, (rows, capacity, hk, d)) for _ in range(2))
    idx = rng.permutation(rows)[:batch] if batch_idx else np.arange(batch)
    if batch_idx:
        kw["cache_batch_idx"] = i32(idx)
    if leftpad is not None:
        kw["cache_leftpad"] = i32(leftpad)
    room = capacity - max(new, seqlen_q)
    if lens is None:
        lens = [int(x) for x in rng.integers(0, room + 1, batch)]
    kw["cache_seqlens"] = i32(lens)
    kw["k_descale"], kw["v_descale"] = (descales(rng, descale, batch, hk) for _ in range(2))
    if new:
        kw["k"], kw["v"] = (randn(rng, (batch, new, hk, d), dtype, scale=0.5) for _ in range(2))
    if rotary:
        angles = rng.uniform(-math.pi, math.pi, (capacity, d // 2))
        kw["rotary_cos"], kw["rotary_sin"] = (torch.from_numpy(f(angles)).to("cuda", kw["q"].dtype)
                                              for f in (np.cos, np.sin))
    if sink:
        kw["learnable_sink"] = make_sink(rng, h, sink)
    positions = np.asarray(lens)[:, None] + np.arange(new)[None, :]
    if page_size:
        table, num_pages = reference.paged_layout(batch, capacity, page_size, rng)
        k_cache, v_cache = (reference.to_paged(c.view(torch.uint8), table, num_pages, fill=0).view(E4M3)
                            for c in (k_cache, v_cache))  # (as bytes: no fp8 indexing needed)
        kw["block_table"] = i32(table)
    kw["k_cache"], kw["v_cache"] = k_cache, v_cache
    return kw, append_slots(positions, idx, table if page_size else None, page_size)


def expected_bytes(x, descale, batch, heads_k):
    """torch's quantization of new keys x (batch, new, heads_k, d) by a descale: the bytes
    an fp8 append must write."""
    scale = descale.reshape(-1, heads_k) if descale.dim() == 2 else descale.reshape(1, 1)
    scale = torch.broadcast_to(scale, (batch, heads_k))[:, None, :, None]
    return (x.float() / scale).clamp(-448, 448).to(E4M3).view(torch.uint8)


def call_and_check(kw, slots, label, fp8_q=None, use_out=True):
    """The call on kw (into out=, NaN first, where use_out; else out must come in q's
    dtype), checked against the references and torch's quantization of the appended keys.
    fp8_q: (q in e4m3, q_descale) to call with in kw["q"]'s place; kw["q"] is then their
    dequantization, what the kernel attends with, for the references."""
    before = {n: kw[n].clone() for n in ("k_cache", "v_cache")}
    call_kw = kw if fp8_q is None else {**kw, "q": fp8_q[0], "q_descale": fp8_q[1]}
    if fp8_q is not None:  # (the same call with the dequantized q, on copies of the caches)
        same = cufa.flash_attn_with_kvcache(**{**kw, **{n: x.clone() for n, x in before.items()}},
                                            return_softmax_lse=True)
    if use_out:
        out = torch.full_like(kw["q"], NAN)
        res, lse = cufa.flash_attn_with_kvcache(**call_kw, out=out, return_softmax_lse=True)
        assert res is out
    else:
        out, lse = cufa.flash_attn_with_kvcache(**call_kw, return_softmax_lse=True)
        assert out.dtype == kw["q"].dtype and out.shape == kw["q"].shape
    if fp8_q is not None:  # an fp8 q is its dequantization's call, bit for bit
        assert torch.equal(out, same[0]) and torch.equal(lse, same[1]), label
    ref, lowp, _, _ = kvcache_references(**{**kw, **before})
    assert_pass_rule(out, lse, ref, lowp, kw["q"].dtype, label)
    batch, hk = kw["q"].shape[0], kw["k_cache"].shape[2]
    for n, new, scale in (("k_cache", "k", "k_descale"), ("v_cache", "v", "v_descale")):
        got, old = kw[n].view(torch.uint8), before[n].view(torch.uint8)
        written = torch.zeros(got.shape[:2], dtype=torch.bool, device="cuda")
        if new in kw:
            written[torch.as_tensor(slots[0]).cuda().long(), torch.as_tensor(slots[1]).cuda().long()] = True
        assert torch.equal(got[~written], old[~written]), f"{label}: {n} changed outside the new slots"
        if new not in kw:
            continue
        descale = kw[scale] if kw[scale] is not None else torch.ones((), device="cuda")
        want = expected_bytes(kw[new], descale, batch, hk).reshape(-1, hk, got.shape[-1])
        rows, positions = (torch.as_tensor(np.asarray(x)).cuda().long() for x in slots)
        have = got[rows, positions]  # (batch x new, heads_k, d), in the new keys' order
        assert torch.equal(have, want), (
            f"{label}: {n}'s new slots differ from torch's e4m3 quantization in "
            f"{int((have != want).sum())} of {have.numel()} bytes")
    return out, lse


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [32, 48, 64, 80, 96, 128, 160, 192, 224, 256])
def test_fp8_cache_decode_per_head_descales(dtype, d):
    rng = np.random.default_rng(d)
    kw, slots = build(rng, dtype=dtype, d=d, batch=3, seqlen_q=2, causal=True)
    call_and_check(kw, slots, f"{dtype} d={d}")


@pytest.mark.parametrize("page_size", [None, 16, 256])
@pytest.mark.parametrize("descale", ["per_head", "one", "scalar", None])
def test_fp8_cache_layouts_and_descale_shapes(page_size, descale):
    rng = np.random.default_rng(7)
    kw, slots = build(rng, page_size=page_size, descale=descale, capacity=512, batch=2,
                      heads=(16, 4))
    call_and_check(kw, slots, f"pages {page_size} descale {descale}")


def head_major(cache):
    """The same values stored head-major ((rows, heads_k, positions, d), a head's keys one
    run), passed as the (rows, positions, heads_k, d) view (what docs/api.md recommends at
    d = 64: the strided copies then read whole lines)."""
    x = cache.view(torch.uint8)
    return x.transpose(1, 2).contiguous().transpose(1, 2).view(E4M3)


@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("d, new", [(64, 0), (64, 3), (128, 2)])
def test_fp8_cache_head_major(page_size, d, new):
    rng = np.random.default_rng(d + new)
    kw, slots = build(rng, d=d, batch=3, heads=(16, 4), capacity=400, page_size=page_size,
                      new=new, lens=[397 - new, 0, 141])
    for n in ("k_cache", "v_cache"):
        kw[n] = head_major(kw[n])
        assert kw[n].stride(1) == d
    call_and_check(kw, slots, f"head-major pages {page_size} d={d} new {new}")


def decode_launch_of_last_call():
    """(CUfunction, grid) of the decode launch of the one with_kvcache plan held (the plans
    are cleared before the call)."""
    from cufa import _runtime
    plan, = [p for p in _runtime.plans.values() if hasattr(p, "launches")]
    launch, = [e for e in plan.launches if e[0] == "decode"]
    return launch[1], launch[2]


def e4m3_decode_function(dtype, head_pairs):
    """The CUfunction of the e4m3 decode kernel at d = 64, of head pairs or not."""
    from cufa import _compile
    kernel = _compile.decode_kernel({"float16": "fp16", "bfloat16": "bf16"}[dtype], 64,
                                    fp8_cache=True, head_pairs=head_pairs)
    return _compile.function_pointer(kernel, 0)


# Two adjacent KV heads a CTA (d = 64, head stride 64): each tile row scores against its
# own head's half of the pair's keys and takes its own head's descales; per-head descales
# drawn apart, so a row that took its neighbour's keys, values or scales fails the rule.
PAIRS = [  # (heads, seqlen_q, extra keyword arguments)
    ((8, 2), 1, {}),                                     # group 4: rows 0-3 and 8-11
    ((32, 4), 1, {"num_splits": 3}),                     # group 8: a half's 8 rows, split
    ((4, 4), 2, {"causal": True, "num_splits": 0}),      # group 1, two tokens, causal
    ((16, 8), 4, {"causal": True, "window_size": (40, 0)}),  # 8 rows a head, window
    ((12, 6), 1, {"sink": "float32", "alibi": True}),    # sink and ALiBi by head
]


@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", range(len(PAIRS)))
def test_fp8_cache_head_pairs(case, dtype, page_size):
    heads, seqlen_q, extra = PAIRS[case]
    extra = dict(extra)
    rng = np.random.default_rng(100 + case)
    if extra.pop("alibi", False):
        extra["alibi_slopes"] = torch.from_numpy(rng.uniform(0.01, 0.2, (2, heads[0])).astype(
            np.float32)).cuda()
    kw, slots = build(rng, dtype=dtype, d=64, batch=2, heads=heads, seqlen_q=seqlen_q,
                      capacity=704, lens=[689, 213], new=1, page_size=page_size, **extra)
    cufa.api.clear_plans()
    call_and_check(kw, slots, f"pairs {heads} q {seqlen_q} {extra} {dtype} pages {page_size}")
    function, grid = decode_launch_of_last_call()
    assert function == e4m3_decode_function(dtype, True) and grid[1] == heads[1] // 2


# The pair kernel on the rest of the call's options: each its own case at d = 64 with the
# heads side by side (what 132 SMs plan for each, the device stubbed, in the comment).
PAIRS_MORE = {  # name: (q's dtype, build's keyword arguments)
    # unsplit (the sink and ALiBi in the kernel's own epilogue), softcap
    "unsplit sink alibi softcap": ("bfloat16", dict(
        heads=(12, 6), capacity=704, lens=[689, 213], new=1, sink="float32", alibi=True,
        softcap=20.0, num_splits=1)),
    # one sequence, one pair: 64 splits, then the combine kernel
    "one long sequence": ("float16", dict(heads=(8, 2), batch=1, capacity=24576,
                                          lens=[24570], new=1)),
    # rows of 3 sequences on a cache of 5 in a random order, leftpads, a window: unsplit
    "batch_idx leftpad window": ("float16", dict(
        heads=(8, 4), batch=3, capacity=320, lens=[300, 200, 64], leftpad=[5, 0, 17],
        batch_idx=True, new=2, seqlen_q=2, window_size=(48, 0))),
    "pages 16 leftpad window": ("float16", dict(
        heads=(8, 4), batch=3, capacity=320, lens=[300, 200, 64], leftpad=[5, 0, 17],
        page_size=16, new=2, seqlen_q=2, window_size=(48, 0))),
    # q rotated at each sequence's end (no append), causal: unsplit
    "rotary q causal": ("float16", dict(heads=(8, 2), seqlen_q=2, capacity=400,
                                        lens=[390, 50], rotary=True, causal=True)),
    # one descale for the whole cache (shape (1,) and 0-d) or none
    "descale one": ("float16", dict(heads=(8, 2), capacity=704, lens=[689, 213], new=1,
                                    descale="one")),
    "descale scalar": ("float16", dict(heads=(8, 2), capacity=704, lens=[689, 213], new=1,
                                       descale="scalar")),
    "no descale": ("float16", dict(heads=(8, 2), capacity=704, lens=[689, 213], new=1,
                                   descale=None)),
    # pages of 256 and 64: 2 splits, the combine kernel
    "pages 256": ("float16", dict(heads=(8, 2), capacity=768, lens=[700, 213], new=1,
                                  page_size=256)),
    "pages 64": ("bfloat16", dict(heads=(8, 2), capacity=768, lens=[700, 213], new=1,
                                  page_size=64)),
}


@pytest.mark.parametrize("name", list(PAIRS_MORE))
def test_fp8_cache_head_pairs_with_every_option(name):
    dtype, options = PAIRS_MORE[name]
    options = dict(options)
    rng = np.random.default_rng(sum(map(ord, name)))
    batch = options.pop("batch", 2)
    if options.pop("alibi", False):
        options["alibi_slopes"] = torch.from_numpy(rng.uniform(0.01, 0.2, (
            batch, options["heads"][0])).astype(np.float32)).cuda()
    kw, slots = build(rng, dtype=dtype, d=64, batch=batch, **options)
    cufa.api.clear_plans()
    call_and_check(kw, slots, f"pairs {name} {dtype}")
    function, grid = decode_launch_of_last_call()
    assert function == e4m3_decode_function(dtype, True) and grid[1] == options["heads"][1] // 2


def test_fp8_cache_pairs_only_where_heads_sit_side_by_side():
    """An odd KV head count, a head-major cache and 16 rows a head take the kernel of one
    head a CTA at d = 64 (and pass)."""
    rng = np.random.default_rng(31)
    for heads, seqlen_q, major in (((6, 3), 1, False), ((8, 2), 1, True), ((16, 2), 2, False)):
        kw, slots = build(rng, d=64, batch=2, heads=heads, seqlen_q=seqlen_q, capacity=400,
                          lens=[400 - seqlen_q, 77])
        if major:
            kw["k_cache"], kw["v_cache"] = head_major(kw["k_cache"]), head_major(kw["v_cache"])
        cufa.api.clear_plans()
        call_and_check(kw, slots, f"one head a CTA: {heads} q {seqlen_q} head-major {major}")
        function, grid = decode_launch_of_last_call()
        assert function == e4m3_decode_function("float16", False) and grid[1] == heads[1]


@pytest.mark.parametrize("splits", [1, 4, 0])
@pytest.mark.parametrize("heads", [(8, 8), (32, 8), (8, 1)])
def test_fp8_cache_splits_and_gqa(splits, heads):
    rng = np.random.default_rng(11)
    kw, slots = build(rng, heads=heads, capacity=2048, lens=[2048, 1500], batch=2,
                      num_splits=splits)
    call_and_check(kw, slots, f"splits {splits} heads {heads}")


@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fp8_cache_append_quantizes_new_keys(page_size, dtype):
    rng = np.random.default_rng(3)
    kw, slots = build(rng, dtype=dtype, new=5, seqlen_q=5, causal=True, page_size=page_size,
                      capacity=320)
    call_and_check(kw, slots, f"append {dtype} pages {page_size}")


def test_fp8_cache_rotary_q_sink_and_window():
    rng = np.random.default_rng(5)
    kw, slots = build(rng, seqlen_q=3, rotary=True, sink="float32", window_size=(64, 0))
    call_and_check(kw, slots, "rotary q + sink + window")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fp8_cache_rotary_append_quantizes_the_rounded_rotation(dtype):
    """A rotated new key is rotated in float32, rounded to q's dtype and then quantized by
    its descale (docs/api.md): the bytes torch writes for the same steps, but where the
    kernel's fused multiply-adds round the rotation differently (then within one e4m3
    step, and rarely)."""
    rng = np.random.default_rng(17)
    kw, slots = build(rng, dtype=dtype, new=4, seqlen_q=1, rotary=True)
    cufa.flash_attn_with_kvcache(**kw)
    batch, new, hk, d = kw["k"].shape
    pos = (kw["cache_seqlens"].long()[:, None] + torch.arange(new, device="cuda"))  # (b, new)
    cos, sin = (kw[n].float()[pos][:, :, None, :] for n in ("rotary_cos", "rotary_sin"))
    x0, x1 = kw["k"].float()[..., 0::2], kw["k"].float()[..., 1::2]  # (interleaved pairs)
    rotated = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)
    want = expected_bytes(rotated.to(kw["q"].dtype), kw["k_descale"], batch, hk)
    rows, positions = (torch.as_tensor(np.asarray(x)).cuda().long() for x in slots)
    have = kw["k_cache"].view(torch.uint8)[rows, positions].reshape(want.shape)
    differ = have != want
    assert differ.float().mean() < 0.005, f"{int(differ.sum())} of {differ.numel()} bytes differ"
    steps = (have.view(E4M3).float() - want.view(E4M3).float()).abs()
    unit = torch.exp2(torch.floor(torch.log2(want.view(E4M3).float().abs().clamp_min(2.0 ** -6))) - 3)
    assert (steps <= unit).all(), "a new key off by more than one e4m3 step"


@pytest.mark.parametrize("page_size", [None, 16])
def test_fp8_cache_batch_idx_leftpad_and_window(page_size):
    """Descales follow the sequence (not its cache row); leftpad and a window over an fp8
    cache, contiguous (cache_batch_idx) and paged."""
    rng = np.random.default_rng(23)
    kw, slots = build(rng, batch=3, capacity=320, lens=[300, 200, 64], leftpad=[5, 0, 17],
                      batch_idx=page_size is None, page_size=page_size, new=2, seqlen_q=2,
                      window_size=(48, 0))
    call_and_check(kw, slots, f"batch_idx/leftpad/window pages {page_size}")


def test_fp8_cache_empty_rows_and_one_key():
    """Sequences with no keys (lse -inf, out 0) and with one key."""
    rng = np.random.default_rng(9)
    kw, slots = build(rng, lens=[0, 1, 33], batch=3)
    call_and_check(kw, slots, "lens 0, 1, 33")


def test_fp8_cache_large_values_stay_finite():
    """Cache values at e4m3's extremes (+-448 and the subnormals) with large descales: the
    16-bit conversion keeps them exact (the bf16 path's 2^-120 factor included)."""
    rng = np.random.default_rng(13)
    for dtype in ("float16", "bfloat16"):
        kw, slots = build(rng, dtype=dtype, batch=2, capacity=128, lens=[128, 77])
        codes = torch.tensor([0x7e, 0xfe, 0x01, 0x81, 0x08, 0x00], dtype=torch.uint8, device="cuda")
        pick = torch.randint(0, len(codes), kw["k_cache"].shape, device="cuda")
        kw["k_cache"] = codes[pick].view(E4M3)
        kw["k_descale"] = torch.full((2, 2), 1e-3, device="cuda")
        kw["v_descale"] = torch.full((2, 2), 3.0, device="cuda")
        call_and_check(kw, slots, f"{dtype} extremes")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fp8_cache_subnormal_codes_are_values(dtype):
    """Caches of e4m3 subnormals alone (and zeros), scaled up to unit size by their
    descales: a conversion that flushed them (bf16 arithmetic on its 2^-120 values) would
    leave scores of 0 and outputs of 0, far outside the pass rule."""
    rng = np.random.default_rng(17)
    kw, slots = build(rng, dtype=dtype, batch=2, capacity=128, lens=[128, 45])
    codes = torch.tensor([0x00, 0x01, 0x02, 0x03, 0x05, 0x07, 0x81, 0x84, 0x86, 0x87],
                         dtype=torch.uint8, device="cuda")
    for name in ("k_cache", "v_cache"):
        pick = torch.randint(0, len(codes), kw[name].shape, device="cuda")
        kw[name] = codes[pick].view(E4M3)
    kw["k_descale"] = torch.full((2, 2), 2.0 ** 7, device="cuda")  # keys up to 1.75
    kw["v_descale"] = torch.full((2, 2), 2.0 ** 9, device="cuda")  # values up to 7
    call_and_check(kw, slots, f"{dtype} subnormals")


def test_fp8_cache_bf16_q_beyond_fp16_range():
    """bf16 q heads far outside fp16's range or resolution (unit draws times 2^20, 2^16,
    2^-12, 2^-30, 2^-40, zeros, and a unit head with one entry of 2^18): an e4m3 cache's
    products run in fp16 on q times a power of two a row, which must neither overflow
    nor flush the row."""
    rng = np.random.default_rng(41)
    kw, slots = build(rng, dtype="bfloat16", batch=2, heads=(8, 2), capacity=160, lens=[160, 93])
    scales = torch.tensor([2.0 ** 20, 2.0 ** -30, 1.0, 2.0 ** -12, 2.0 ** 16, 0.0, 2.0 ** -40,
                           1.0], device="cuda")
    q = kw["q"].float() * scales[None, None, :, None]
    q[:, :, 2, 0] = 2.0 ** 18
    kw["q"] = q.to(torch.bfloat16)
    call_and_check(kw, slots, "bf16 q beyond fp16")


def quantized_q(q, heads_k):
    """q (batch, seqlen_q, nheads, d) in e4m3 with a per-(batch, KV head) q_descale, each
    group's largest magnitude over 448 (e4m3's range used): (q in e4m3, q_descale)."""
    batch, seqlen, heads, d = q.shape
    grouped = q.float().reshape(batch, seqlen, heads_k, heads // heads_k, d)
    scale = grouped.abs().amax(dim=(1, 3, 4)) / 448  # (batch, heads_k)
    q8 = (grouped / scale[:, None, :, None, None]).clamp(-448, 448).to(E4M3)
    return q8.reshape(q.shape), scale


@pytest.mark.parametrize("page_size, causal, out_dtype, rotary", [
    (None, True, None, False), (16, False, None, False), (16, True, None, True),
    (None, False, "float16", False)],
    ids=["contiguous-causal", "paged", "paged-causal-rotary", "contiguous-out16"])
def test_fp8_q_with_an_fp8_cache(page_size, causal, out_dtype, rotary):
    """q in e4m3 with a per-(batch, KV head) q_descale (FlashAttention-3's fp8 decode),
    GQA, one append step of 3 tokens: out in bfloat16, or in out='s float16 (then the
    new k, v and the rotary tables are float16 too). With rotary, the rotation of the
    dequantized q, and no append (a rotated new key's bytes may differ from torch's by a
    rounding: test_fp8_cache_rotary_append_quantizes_the_rounded_rotation)."""
    rng = np.random.default_rng(37)
    dtype = out_dtype or "bfloat16"  # the dequantized q's dtype
    heads = (16, 4)
    kw, slots = build(rng, dtype=dtype, batch=3, seqlen_q=3, new=0 if rotary else 3,
                      heads=heads, capacity=320, page_size=page_size, causal=causal,
                      rotary=rotary)
    q8, q_scale = quantized_q(randn(rng, kw["q"].shape, torch.float32, scale=2.0), heads[1])
    # the references attend with the dequantized q rounded to the 16-bit dtype, which is
    # what the kernel sees (not the float32 q it was quantized from)
    per_head = q_scale.repeat_interleave(heads[0] // heads[1], dim=1)[:, None, :, None]
    kw["q"] = (q8.float() * per_head).to(getattr(torch, dtype))
    assert kw["q"].abs().amax() > 1  # (random values over e4m3's range, not zeros)
    call_and_check(kw, slots, f"fp8 q pages {page_size} causal {causal} out {out_dtype}",
                   fp8_q=(q8, q_scale), use_out=out_dtype is not None)


def test_fp8_cache_from_cupy():
    """CuPy arrays of ml_dtypes' float8_e4m3fn (views of the torch cache's bytes): out, a
    CuPy array, against the float64 reference of the dequantized cache (pass rule)."""
    cupy = pytest.importorskip("cupy")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(19)
    kw, _ = build(rng, dtype="float16", batch=2, capacity=256)
    as_cupy = {n: cupy.from_dlpack(kw[n]) for n in ("q", "cache_seqlens", "k_descale", "v_descale")}
    for n in ("k_cache", "v_cache"):
        as_cupy[n] = cupy.from_dlpack(kw[n].view(torch.uint8)).view(ml_dtypes.float8_e4m3fn)
    got, lse = cufa.flash_attn_with_kvcache(**{**kw, **as_cupy}, return_softmax_lse=True)
    assert isinstance(got, cupy.ndarray)
    ref, lowp, _, _ = kvcache_references(**kw)
    assert_pass_rule(torch.from_dlpack(got), torch.from_dlpack(lse), ref, lowp, kw["q"].dtype,
                     "CuPy fp8 cache")


def test_fp8_cache_from_jax():
    """jnp.float8_e4m3fn caches (the torch cache's bytes, bitcast in JAX), eager and under
    jax.jit, with an append: out and lse against the float64 reference (pass rule), the
    returned caches' bytes against torch's quantization of the new keys at their slots and
    the old bytes everywhere else."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    rng = np.random.default_rng(29)
    kw, slots = build(rng, dtype="bfloat16", batch=2, capacity=256, new=3, seqlen_q=3,
                      lens=[200, 17], causal=True)
    ref, lowp, _, _ = kvcache_references(**kw)
    batch, hk = kw["q"].shape[0], kw["k_cache"].shape[2]

    def to_jax(t):
        # (JAX may read the tensor on its own stream, which does not wait for torch's: one
        # run of the whole suite saw new bytes that were not torch's, not seen again alone)
        torch.cuda.synchronize()
        if t.dtype == E4M3:
            # (the bitcast is a copy queued on JAX's stream; the torch clone it reads is
            # freed as soon as this returns, and torch may hand its memory to the next
            # clone before the copy has run: a whole-suite run saw another cache's bytes)
            return jax.lax.bitcast_convert_type(jax.dlpack.from_dlpack(t.view(torch.uint8)),
                                                jnp.float8_e4m3fn).block_until_ready()
        return jax.dlpack.from_dlpack(t)

    def to_torch(x):  # (a copy: the test writes into the caches)
        if x.dtype == jnp.float8_e4m3fn:
            x = jax.lax.bitcast_convert_type(x, jnp.uint8)
        # (JAX computes on its own stream and torch's clone does not wait for it: with six
        # test processes on the GPU, jax.jit's appended rows read back as other bytes)
        copy = torch.from_dlpack(x.block_until_ready()).clone()
        # (and the clone is queued, not run: the bitcast's buffer is JAX's again once x
        # goes, and the next cache's bitcast wrote over it before the clone had read it, one
        # row of k's new bytes wrong in a whole-suite run)
        torch.cuda.synchronize()
        return copy

    def jax_arrays(skip=()):  # (fresh copies: an append may update its cache in place)
        return {n: to_jax(x.clone()) for n, x in kw.items() if torch.is_tensor(x) and n not in skip}

    options = {n: x for n, x in kw.items() if not torch.is_tensor(x)}
    call = (lambda a: cufa.flash_attn_with_kvcache(**a, **options, return_softmax_lse=True))
    for label, fn in (("JAX eager", call), ("jax.jit", jax.jit(call))):
        out, lse, k_cache, v_cache = (to_torch(x) for x in fn(jax_arrays()))
        assert_pass_rule(out, lse, ref, lowp, kw["q"].dtype, f"{label} fp8 cache")
        for cache, old, new, scale in ((k_cache, kw["k_cache"], "k", "k_descale"),
                                       (v_cache, kw["v_cache"], "v", "v_descale")):
            rows, positions = (torch.as_tensor(np.asarray(x)).cuda().long() for x in slots)
            want = expected_bytes(kw[new], kw[scale], batch, hk).reshape(-1, hk, cache.shape[-1])
            assert torch.equal(cache[rows, positions], want), f"{label}: {new}'s new bytes"
            cache[rows, positions] = old.view(torch.uint8)[rows, positions]
            assert torch.equal(cache, old.view(torch.uint8)), f"{label}: other {new} bytes"
    # and without an append, eagerly: out alone
    ref, lowp, _, _ = kvcache_references(**{n: x for n, x in kw.items() if n not in ("k", "v")})
    out, lse = (to_torch(x) for x in call(jax_arrays(skip=("k", "v"))))
    assert_pass_rule(out, lse, ref, lowp, kw["q"].dtype, "JAX eager fp8 cache, no append")
