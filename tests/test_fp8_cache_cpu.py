"""CPU: fp8 (float8_e4m3fn) KV caches in flash_attn_with_kvcache -- what the planner takes
(the e4m3 decode variant in the 16-bit shape's shared memory, never the TMA kernel, the
quantizing append), every bad argument's error before any launch, the e4m3
arithmetic the kernels do in bits (a mirror of common/types.cuh's, checked against
ml_dtypes), and an fp8 q with q_descale: its errors and its dequantization to 16 bits."""
import struct

import numpy as np
import pytest

import cufa
from cufa import _compile
from cufa._interop import DeviceArray
from test_kvcache_plan_cpu import planner, record  # noqa: F401  (the fixture)

SIZES = {"float16": 2, "bfloat16": 2, "float32": 4, "int32": 4, "float8_e4m3fn": 1,
         "float8_e5m2": 1, "uint8": 1}


def arr(shape, dtype="float16", strides=None, ptr=0x7f0000000000, device=0):
    if strides is None:
        strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    return DeviceArray(None, "torch", ptr, tuple(shape), tuple(strides), dtype, device,
                       SIZES[dtype])


def call(q=None, cache=None, v_cache=None, **kw):
    q = q if q is not None else arr((2, 1, 8, 128))
    cache = cache if cache is not None else arr((2, 256, 2, 128), "float8_e4m3fn")
    kw.setdefault("cache_seqlens", arr((2,), "int32"))
    if v_cache is None:  # (another array: the append would write k and v into one)
        v_cache = arr(cache.shape, cache.dtype, cache.strides, ptr=cache.ptr + (1 << 32))
    return q, cache, v_cache, kw


def test_fp8_cache_takes_the_e4m3_decode_variant(planner):  # noqa: F811
    q, kc, vc, kw = call(k_descale=arr((2, 2), "float32"), v_descale=arr((1,), "float32"))
    plan = planner(q, kc, vc, **kw)
    decode = [e for e in plan.launches if e[0] == "decode"]  # (fake handles: hash of the key)
    assert len(decode) == 1 and decode[0][1] == hash(_compile.decode_kernel("fp16", 128,
                                                                           fp8_cache=True).key)
    rec = record(plan)
    assert (rec["k_descale_batch_stride"], rec["k_descale_head_stride"]) == (2, 1)
    assert (rec["v_descale_batch_stride"], rec["v_descale_head_stride"]) == (0, 0)
    assert plan.maps is None  # never the TMA kernel, which reads 16-bit caches


def test_fp8_variants_take_the_16_bit_shape_with_padded_rows():
    for dt in _compile.DTYPES:
        for hd in _compile.DECODE_HEAD_DIMS:
            fp8, plain = (_compile.decode_kernel(dt, hd, fp8_cache=f) for f in (True, False))
            warps, stages = fp8.shape
            assert fp8.shape == plain.shape
            padded_row = ((hd // 16) | 1) * 16  # E4m3Tile: an odd number of 16-byte chunks
            assert fp8.smem_bytes == 16 * hd * 2 + warps * stages * 2 * 16 * padded_row
            assert fp8.smem_bytes < plain.smem_bytes
            ctas = _compile.DECODE_FP8_MIN_CTAS.get(hd, 0)
            assert fp8.min_ctas == ctas
            assert fp8.key == (f"decode_{dt}_hd{hd}_s{stages}_e4m3" + (f"_c{ctas}" if ctas else ""))
            assert fp8.name_expression.endswith(f"false, true, {ctas}>" if ctas else "false, true>")
    assert {v.key for v in _compile.all_variants()} >= {
        _compile.decode_kernel(dt, hd, fp8_cache=True).key
        for dt in _compile.DTYPES for hd in _compile.DECODE_HEAD_DIMS}


def test_fp8_cache_never_takes_the_four_cta_shape(planner, monkeypatch):  # noqa: F811
    """The DECODE_MORE_CTAS shape has no e4m3 variant: the default shape, even where the
    16-bit cache would take the wider one (64 x 4k with 8 KV heads, d = 128)."""
    q, cache = arr((64, 1, 32, 128)), arr((64, 4096, 8, 128))
    wide = planner(q, cache, cache, cache_seqlens=arr((64,), "int32"))
    fp8 = arr((64, 4096, 8, 128), "float8_e4m3fn")
    narrow = planner(q, fp8, fp8, cache_seqlens=arr((64,), "int32"))
    assert wide.launches[0][1] == hash(_compile.decode_kernel_with_more_ctas("fp16", 128).key)
    assert narrow.launches[0][1] == hash(_compile.decode_kernel("fp16", 128, fp8_cache=True).key)


PAIRED = hash(_compile.decode_kernel("fp16", 64, fp8_cache=True, head_pairs=True).key)
ONE_HEAD = hash(_compile.decode_kernel("fp16", 64, fp8_cache=True).key)


@pytest.mark.parametrize("q_shape, cache_shape, strides, dtype, want", [
    # (q, cache, cache strides or None, cache dtype, (kernel, grid's y) or None: no launch)
    ((64, 1, 32, 64), (64, 4096, 8, 64), None, "float8_e4m3fn", (PAIRED, 4)),
    ((2, 1, 64, 64), (2, 4096, 8, 64), None, "float8_e4m3fn", (PAIRED, 4)),   # 8 rows a head
    ((2, 2, 4, 64), (2, 4096, 4, 64), None, "float8_e4m3fn", (PAIRED, 2)),    # 2 tokens
    ((2, 1, 128, 64), (2, 4096, 8, 64), None, "float8_e4m3fn", (ONE_HEAD, 8)),  # 16 rows
    ((2, 1, 21, 64), (2, 4096, 7, 64), None, "float8_e4m3fn", (ONE_HEAD, 7)),   # odd count
    ((2, 1, 32, 64), (2, 4096, 8, 64), (8 * 4096 * 64, 64, 4096 * 64, 1), "float8_e4m3fn",
     (ONE_HEAD, 8)),                                                         # head-major
    ((1, 1, 32, 64), (1, 131072, 8, 64), None, "float8_e4m3fn", (PAIRED, 4)),   # split
    ((256, 1, 32, 64), (256, 1024, 8, 64), None, "float8_e4m3fn", (PAIRED, 4)),    # 1.9
    ((192, 1, 32, 64), (192, 1024, 8, 64), None, "float8_e4m3fn", (PAIRED, 4)),    # 1.5
    ((384, 1, 32, 64), (384, 1024, 8, 64), None, "float8_e4m3fn", (PAIRED, 4)),    # 2.9
    ((2, 1, 32, 128), (2, 4096, 8, 128), None, "float8_e4m3fn", None),      # d = 128
    ((2, 1, 32, 64), (2, 4096, 8, 64), None, "float16", None),              # 16-bit cache
])
def test_fp8_cache_pairs_adjacent_heads_at_d64(planner, q_shape, cache_shape, strides,  # noqa: F811
                                               dtype, want):
    """Two KV heads a CTA (the kernel of head pairs, half the grid's y) where an e4m3 cache
    at d = 64 holds them side by side and a head's query rows fit 8, at any count of pairs
    (the comments: waves of 528 CTAs, 132 SMs x 4); one head a CTA elsewhere; never for
    other head dims or 16-bit caches."""
    cache = arr(cache_shape, dtype, strides)
    plan = planner(arr(q_shape), cache, cache, cache_seqlens=arr((q_shape[0],), "int32"))
    decode, = [e for e in plan.launches if e[0] == "decode"]
    if want is None:
        assert decode[1] not in (PAIRED, ONE_HEAD) and decode[2][1] == cache_shape[2]
    else:
        assert (decode[1], decode[2][1]) == want
        assert record(plan)["nheads_k"] == cache_shape[2]  # (the kernel finds its pair's heads)


@pytest.mark.parametrize("batch, keys, heads_k, d, want_splits", [
    (128, 2048, 8, 128, 1),    # 1024 CTAs, 1.9 waves of 528 (a 16-bit cache's rule: 3 splits)
    (96, 2048, 8, 128, 1),     # 768, 1.5 waves (the rule would split 2 ways)
    (66, 2048, 8, 128, 1),     # 528, one wave
    (8, 16384, 8, 128, 2),     # 64: under the SMs, split to fill them, one CTA an SM
    (1, 131072, 8, 128, 16),
])
def test_e4m3_decode_counts_its_launch_bounds_and_splits_under_a_wave_only(
        planner, batch, keys, heads_k, d, want_splits):  # noqa: F811
    """The e4m3 decode kernels run 4 CTAs an SM (their launch bounds; shared memory would
    hold 5), and from one wave of those up they run unsplit (_heuristics.FILL_WAVES_E4M3)."""
    for dt in _compile.DTYPES:
        for hd in (64, 128):
            assert _compile.decode_kernel(dt, hd, fp8_cache=True).ctas_per_sm_on(
                _compile.SM90_SMEM_PER_SM) == 4
    cache = arr((batch, keys, heads_k, d), "float8_e4m3fn")
    plan = planner(arr((batch, 1, 4 * heads_k, d)), cache, cache,
                   cache_seqlens=arr((batch,), "int32"))
    assert record(plan)["num_splits"] == want_splits


@pytest.mark.parametrize("batch, keys, d, want_splits", [
    (1, 131072, 128, 32),   # 8 units: 256 CTAs, two an SM (four would be 64 splits)
    (8, 16384, 128, 4),     # 64 units
    (16, 8192, 128, 2),
    (1, 131072, 64, 64),    # head pairs: 4 units
    (8, 16384, 64, 8),
])
def test_e4m3_decode_splits_for_two_ctas_an_sm(planner, monkeypatch, batch, keys, d,
                                               want_splits):  # noqa: F811
    """Under one wave, where one CTA an SM does not keep up with the memory (an H200's
    4.8 TB/s), an e4m3 decode's keys are split for two CTAs an SM
    (_heuristics.E4M3_SPLIT_CTAS_PER_SM), not its four; a 16-bit cache's by the wave rule
    for its kernel's CTAs an SM (at d = 64 the kernel of head pairs there, over half the
    units)."""
    from cufa import _heuristics, _runtime
    monkeypatch.setattr(_runtime, "peak_bytes_per_s", lambda device: 4.8e12)
    monkeypatch.setattr(_heuristics, "_keeps_up", {})
    fp8, fp16 = (arr((batch, keys, 8, d), dt) for dt in ("float8_e4m3fn", "float16"))
    seqlens = arr((batch,), "int32")
    assert record(planner(arr((batch, 1, 32, d)), fp8, fp8,
                          cache_seqlens=seqlens))["num_splits"] == want_splits
    pairs = False
    if d == _compile.PAIRED_HEAD_DIM:  # (pairs where they keep the in-launch merge)
        pair = _compile.decode_kernel("fp16", d, head_pairs=True)
        pair_splits = _heuristics.choose_num_splits(
            batch * 4, keys, 132, pair.ctas_per_sm_on(_compile.SM90_SMEM_PER_SM), one_per_sm=False)
        pairs = _heuristics.pairs_keep_the_merge(pair, d, pair_splits, 4)
    sixteen = _compile.decode_kernel("fp16", d, head_pairs=pairs)
    units = batch * (4 if pairs else 8)
    plan = planner(arr((batch, 1, 32, d)), fp16, fp16, cache_seqlens=seqlens)
    assert hash(sixteen.key) in [e[1] for e in plan.launches]
    assert record(plan)["num_splits"] == _heuristics.choose_num_splits(
        units, keys, 132, sixteen.ctas_per_sm_on(_compile.SM90_SMEM_PER_SM), one_per_sm=False)


def test_e4m3_split_rule_never_passes_one_wave():
    """Without fill_waves no count of units is split past one wave of the slots (the fill
    loop would pick 7-11 splits for 89-112 units, 1.4-2 waves), and a power of two is
    taken only where it fills 90 % of them."""
    from cufa import _heuristics
    for slots_per_sm in (2, 4):
        slots = 132 * slots_per_sm
        for units in range(1, 2 * slots + 2):
            for keys in (512, 16384, 131072):
                splits = _heuristics.choose_num_splits(units, keys, 132, slots_per_sm,
                                                       one_per_sm=False, fill_waves=False)
                assert splits == 1 or units * splits <= slots, (units, keys, splits)
                assert splits <= max(1, keys // _heuristics.MIN_KEYS_PER_SPLIT)
    assert _heuristics.choose_num_splits(67, 16384, 132, 2, one_per_sm=False,
                                         fill_waves=False) == 3  # 2 would fill half
    assert _heuristics.choose_num_splits(8, 131072, 132, 2, one_per_sm=False,
                                         fill_waves=False) == 32  # 33 fit; 32 fill 97 %


def test_head_pairs_kernel_is_d128s_tile():
    """The paired kernel is d = 128's kernel (its shared memory, shape and launch bounds)
    with the pairs flag, over an e4m3 cache or a 16-bit one (and d = 128's four-CTA shape
    for 16-bit pairs); only d = 64 has one, of 16-byte rows."""
    variants = {v.key for v in _compile.all_variants()}
    for dt in _compile.DTYPES:
        for fp8 in (True, False):
            paired = _compile.decode_kernel(dt, 64, fp8_cache=fp8, head_pairs=True)
            wide = _compile.decode_kernel(dt, 128, fp8_cache=fp8)
            assert (paired.head_dim, paired.shape, paired.smem_bytes, paired.min_ctas,
                    paired.fp8_cache) == (wide.head_dim, wide.shape, wide.smem_bytes,
                                          wide.min_ctas, fp8)
            assert paired.key in variants
            # every flag spelled out before the pairs flag (kElementIO, kFp8, kMinCtasWanted)
            flags = paired.name_expression.split(", ")[4:]
            assert flags == ["false", str(fp8).lower(), str(wide.min_ctas), "true>"]
        more = _compile.decode_kernel_with_more_ctas(dt, 64, head_pairs=True)
        assert more.head_pairs and more.shape == _compile.decode_kernel_with_more_ctas(
            dt, 128).shape and more.key in variants
    for bad in (dict(head_dim=128, fp8_cache=True), dict(head_dim=64, element_io=True)):
        with pytest.raises(ValueError, match="head pairs"):
            _compile.decode_kernel("fp16", head_pairs=True, **bad)


def test_fp8_append_quantizes_in_the_append_kernel(planner):  # noqa: F811
    q, kc, vc, kw = call(q=arr((2, 3, 8, 128), "bfloat16"), k=arr((2, 3, 2, 128), "bfloat16"),
                         v=arr((2, 3, 2, 128), "bfloat16"))
    plan = planner(q, kc, vc, **kw)
    kinds = [(e[0], e[1]) for e in plan.launches]
    assert kinds[0] == ("append", hash(_compile.AppendVariant("bf16", True).key))
    assert _compile.AppendVariant("bf16", True).name_expression == "cufa::decode_append<1, true>"


@pytest.mark.parametrize("kw, error, words", [
    (dict(v_cache=arr((2, 256, 2, 128))), TypeError, ["v_cache", "float16", "float8_e4m3fn"]),
    (dict(cache=arr((2, 256, 2, 128), "float8_e5m2")), TypeError, ["k_cache", "float8_e5m2"]),
    (dict(q=arr((2, 1, 8, 128), "float8_e4m3fn")), NotImplementedError, ["q", "float8_e4m3fn"]),
    (dict(cache=arr((2, 256, 2, 128)), k_descale=arr((2, 2), "float32")), TypeError,
     ["k_descale", "float8_e4m3fn"]),
    (dict(k_descale=arr((2, 2), "float16")), TypeError, ["k_descale", "float32"]),
    (dict(v_descale=arr((2, 8), "float32")), ValueError, ["v_descale", "(2, 2)"]),
    (dict(k_descale=arr((2,), "float32")), ValueError, ["k_descale", "(batch, nheads_k)"]),
    (dict(k_descale=arr((2, 2), "float32", device=1)), ValueError, ["k_descale", "cuda:1"]),
    (dict(q=arr((2, 1, 8, 72)), cache=arr((2, 256, 2, 72), "float8_e4m3fn")),
     NotImplementedError, ["multiples of 16"]),
    (dict(cache=arr((2, 256, 2, 128), "float8_e4m3fn", strides=(256 * 2 * 136, 2 * 136, 136, 1))),
     NotImplementedError, ["multiples of 16"]),
    (dict(k=arr((2, 1, 2, 128), "float8_e4m3fn"), v=arr((2, 1, 2, 128), "float8_e4m3fn")),
     TypeError, ["k has dtype float8_e4m3fn", "float16"]),
    (dict(cache=DeviceArray(None, "dlpack", 0x7f0000000000, (2, 256, 2, 128),
                            (65536, 256, 128, 1), "float8_e4m3fn", 0, 1)),
     NotImplementedError, ["PyTorch", "CuPy", "JAX"]),
])
def test_fp8_cache_bad_arguments(kw, error, words, planner):  # noqa: F811
    q, kc, vc, rest = call(**{n: kw.pop(n) for n in ("q", "cache", "v_cache") if n in kw})
    with pytest.raises(error) as info:
        planner(q, kc, vc, **rest, **kw)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


# -- the kernels' e4m3 arithmetic, in Python (common/types.cuh) -----------------------------

def _bits(f):
    return struct.unpack("<I", struct.pack("<f", np.float32(f)))[0]


def _float(u):
    return struct.unpack("<f", struct.pack("<I", u))[0]


def float_to_e4m3(x):
    """types.cuh's float_to_e4m3, step for step in float32."""
    x = np.float32(x)
    sign = (_bits(x) >> 24) & 0x80
    a = np.float32(abs(x))
    if a != a:
        return sign | 0x7F
    code = 0x7E
    if a < 2.0 ** -6:
        code = int(np.rint(np.float32(a * np.float32(512))))
    elif a < 448:
        e = (_bits(a) >> 23) - 127
        m = int(np.rint(np.float32(a * np.float32(_float((127 + 3 - e) << 23))))) - 8
        code = min(((e + 7) << 3) + m, 0x7E)
    return sign | code


def e4m3x4_to_pairs(x, bf16):
    """types.cuh's e4m3x4_to_pairs: four e4m3 bytes (a 32-bit word) to the 16-bit patterns
    of bytes 0, 2 (`even`) and 1, 3 (`odd`), low half first; bf16's before its fma by
    2^112 (done here in float64: exact, as the kernel's bf16 fma is on these values)."""
    if not bf16:
        even = ((x << 8) & 0x80008000) | ((x << 7) & 0x3F803F80)
        odd = (x & 0x80008000) | ((x >> 1) & 0x3F803F80)
    else:
        even = ((x << 8) & 0x80008000) | ((x << 4) & 0x07F007F0)
        odd = (x & 0x80008000) | ((x >> 4) & 0x07F007F0)
    return [h & 0xFFFF for w in (even, odd) for h in (w, w >> 16)]  # bytes 0, 2, 1, 3


def test_float_to_e4m3_matches_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    e4m3 = ml_dtypes.float8_e4m3fn
    values = np.arange(256, dtype=np.uint8).view(e4m3).astype(np.float32)
    values = np.sort(values[np.isfinite(values)])
    rng = np.random.default_rng(0)
    xs = np.concatenate([values, (values[1:] + values[:-1]) / 2,  # every value and midpoint
                         *(rng.standard_normal(20000).astype(np.float32) * s
                           for s in (1e-3, 1, 100)), [448, 460, 464, 1e6, -1e6]]).astype(np.float32)
    want = np.clip(xs, -448, 448).astype(e4m3).view(np.uint8)
    got = np.array([float_to_e4m3(x) for x in xs], dtype=np.uint8)
    assert np.array_equal(got, want), xs[got != want][:5]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp16", "bf16"])
def test_e4m3_to_pairs_is_exact_up_to_the_scale(bf16):
    """Every e4m3 code in each of a word's four byte places lands, in its pair's half,
    as the e4m3 value over 2^8 (bf16: over 2^120 before the kernel's fma by 2^112)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint32)  # no NaN
    want = codes.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    half = ml_dtypes.bfloat16 if bf16 else np.float16
    lift = 2.0 ** 112 if bf16 else 1.0
    rng = np.random.default_rng(1)
    for place in range(4):  # the code in byte `place`, random codes in the other three
        others = rng.integers(0, 256, (len(codes), 4)).astype(np.uint32)
        others[:, place] = codes
        words = others[:, 0] | others[:, 1] << 8 | others[:, 2] << 16 | others[:, 3] << 24
        halves = np.array([e4m3x4_to_pairs(int(w), bf16) for w in words], dtype=np.uint16)
        got = halves[:, (0, 2, 1, 3)[place]].view(half).astype(np.float64) * lift
        assert np.array_equal(got * 2.0 ** 8, want), place
        # the fp16 / lifted bf16 values are normal: products with q stay far from float32's
        # subnormals
        assert (np.abs(got[got != 0]) >= 2.0 ** -17).all()


# -- an fp8 q (q_descale), dequantized by the caller's framework before the decode ---------

def _fp8_q_call(**changes):
    """A decode call's arguments as CPU torch tensors: an e4m3 q of 8 heads over 2 KV heads
    and an e4m3 cache (its checks run before any array reaches the planner)."""
    torch = pytest.importorskip("torch")
    e4m3 = torch.float8_e4m3fn
    kw = dict(q=torch.randn(2, 1, 8, 64).to(e4m3), k_cache=torch.zeros(2, 32, 2, 64, dtype=e4m3),
              v_cache=torch.zeros(2, 32, 2, 64, dtype=e4m3), q_descale=torch.ones(2, 2),
              cache_seqlens=3)
    kw.update(changes)
    return {n: x for n, x in kw.items() if x is not None}


FP8_Q_CASES = [
    # (id, changes (a callable of torch, for the tensors), error, words)
    ("q_descale with a 16-bit q", lambda t: dict(q=t.randn(2, 1, 8, 64, dtype=t.bfloat16)),
     TypeError, ["q_descale", "bfloat16"]),
    ("16-bit cache", lambda t: dict(k_cache=t.zeros(2, 32, 2, 64, dtype=t.float16),
                                    v_cache=t.zeros(2, 32, 2, 64, dtype=t.float16)),
     TypeError, ["k_cache", "float16", "fp8 cache"]),
    ("16-bit v_cache", lambda t: dict(v_cache=t.zeros(2, 32, 2, 64, dtype=t.bfloat16)),
     TypeError, ["v_cache", "bfloat16"]),
    ("q_descale float16", lambda t: dict(q_descale=t.ones(2, 2, dtype=t.float16)), TypeError,
     ["q_descale", "float32"]),
    ("q_descale per query head", lambda t: dict(q_descale=t.ones(2, 8)), ValueError,
     ["q_descale", "(2, 2)"]),
    ("q_descale 1-D of batch", lambda t: dict(q_descale=t.ones(2)), ValueError,
     ["q_descale", "(batch, nheads_k)"]),
    ("q_descale on another device", lambda t: dict(q_descale=t.ones(2, 2, device="meta")),
     ValueError, ["q_descale", "meta", "cpu"]),
    ("q_descale a NumPy array", lambda t: dict(q_descale=np.ones((2, 2), np.float32)),
     TypeError, ["q_descale", "PyTorch"]),
    ("q_descale a float", lambda t: dict(q_descale=0.5), TypeError, ["q_descale", "float32"]),
    ("qv", lambda t: dict(qv=t.zeros(2, 1, 8, 512, dtype=t.bfloat16)), NotImplementedError,
     ["qv", "MLA", "float8_e4m3fn"]),
    ("e5m2 q", lambda t: dict(q=t.randn(2, 1, 8, 64).to(t.float8_e5m2), q_descale=None),
     TypeError, ["q", "float8_e5m2", "float8_e4m3fn"]),
    ("new k in float16", lambda t: dict(k=t.zeros(2, 1, 2, 64, dtype=t.float16),
                                        v=t.zeros(2, 1, 2, 64, dtype=t.float16)),
     TypeError, ["k has dtype float16", "bfloat16"]),
    ("new k against out='s float16", lambda t: dict(
        k=t.zeros(2, 1, 2, 64, dtype=t.bfloat16), v=t.zeros(2, 1, 2, 64, dtype=t.bfloat16),
        out=t.zeros(2, 1, 8, 64, dtype=t.float16)), TypeError,
     ["k has dtype bfloat16", "float16"]),
    ("out float32", lambda t: dict(out=t.zeros(2, 1, 8, 64)), ValueError,
     ["out", "float16 or bfloat16"]),
    ("heads not a multiple", lambda t: dict(k_cache=t.zeros(2, 32, 3, 64, dtype=t.float8_e4m3fn),
                                            v_cache=t.zeros(2, 32, 3, 64, dtype=t.float8_e4m3fn)),
     ValueError, ["nheads_k", "(2, 32, 3, 64)"]),
]


@pytest.mark.parametrize("case", FP8_Q_CASES, ids=[c[0] for c in FP8_Q_CASES])
def test_fp8_q_bad_arguments(case, monkeypatch):
    """Each refused before the planner sees the call, the cache unchanged."""
    torch = pytest.importorskip("torch")
    _, changes, error, words = case
    monkeypatch.setattr(cufa.api, "with_kvcache", lambda *a, **k: pytest.fail("planned"))
    kw = _fp8_q_call(**changes(torch))
    before = kw["k_cache"].clone()
    with pytest.raises(error) as info:
        cufa.flash_attn_with_kvcache(**kw)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    assert torch.equal(kw["k_cache"].view(torch.uint8), before.view(torch.uint8))


def test_fp8_q_of_other_arrays_is_not_implemented():
    """An e4m3 q neither PyTorch's nor JAX's (CuPy's, a view here) is refused: no
    framework op dequantizes it."""
    q = arr((2, 1, 8, 128), "float8_e4m3fn")
    cache = arr((2, 256, 2, 128), "float8_e4m3fn")
    for extra in ({}, dict(q_descale=arr((2, 2), "float32"))):
        with pytest.raises(NotImplementedError, match="q in float8_e4m3fn.*float16 or bfloat16 "
                                                      r"\(q times q_descale\)"):
            cufa.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=arr((2,), "int32"),
                                         **extra)


def _short_descales(rng, shape):
    """float32 descales of 16 significant bits at most: times an e4m3 value (4 bits) the
    product is exact in float32, so the helper's one rounding, to 16 bits, is the float64
    product's."""
    return np.asarray(np.ldexp(rng.integers(2 ** 15, 2 ** 16, shape),
                               rng.integers(-24, -12, shape)), dtype=np.float32)


@pytest.mark.parametrize("kind", ["per_kv_head", "one", "scalar", None])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fp8_q_dequantizes_per_kv_head_group(kind, dtype):
    """q_fp8 * q_descale[b, h // (nheads / nheads_k)], rounded to dtype: the float64
    product rounded once (CPU torch tensors, every e4m3 code among q's values)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(31)
    batch, seqlen, heads, heads_k, d = 3, 2, 12, 3, 48
    codes = rng.integers(0, 256, (batch, seqlen, heads, d), dtype=np.uint8)
    codes[codes & 0x7F == 0x7F] = 0x38  # (no NaN codes: 1.0 instead)
    codes.reshape(-1)[:256 - 2] = [c for c in range(256) if c & 0x7F != 0x7F]
    q = torch.from_numpy(codes).view(torch.float8_e4m3fn)
    shape = {"per_kv_head": (batch, heads_k), "one": (1,), "scalar": (), None: None}[kind]
    descale = None if shape is None else torch.from_numpy(_short_descales(rng, shape))
    got = cufa.api._fp8_query_as_16_bit(q, descale, heads // heads_k, dtype)
    scale = np.ones((batch, heads_k)) if descale is None else np.broadcast_to(
        descale.double().numpy(), (batch, heads_k))
    per_head = np.repeat(scale, heads // heads_k, axis=1)[:, None, :, None]  # (b, 1, h, 1)
    want = torch.from_numpy(q.double().numpy() * per_head).to(getattr(torch, dtype))
    assert got.dtype == want.dtype and got.shape == q.shape
    assert torch.equal(got, want), int((got != want).sum())


def test_fp8_q_reaches_the_planner_as_its_16_bit_dequantization(monkeypatch):
    """The eager call hands the planner the dequantized q (bfloat16, or out='s float16) in
    q's place and everything else as given."""
    torch = pytest.importorskip("torch")
    seen = []
    monkeypatch.setattr(cufa.api, "with_kvcache", lambda arrays, **kw: seen.append(arrays))
    kw = _fp8_q_call(q_descale=torch.tensor([0.5]))
    for out in (None, torch.empty(2, 1, 8, 64, dtype=torch.float16)):
        cufa.flash_attn_with_kvcache(**kw, out=out)
        q = seen[-1][0]
        want = (kw["q"].float() * 0.5).to(torch.bfloat16 if out is None else out.dtype)
        assert torch.equal(q, want) and seen[-1][1] is kw["k_cache"] and seen[-1][-1] is out
