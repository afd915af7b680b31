"""CPU: fp8 (float8_e4m3fn) KV caches in flash_attn_with_kvcache -- what the planner takes
(the e4m3 decode variant in the 16-bit shape's shared memory, never the TMA kernel, the
quantizing append), every bad argument's error before any launch, and the e4m3
arithmetic the kernels do in bits (a mirror of common/types.cuh's, checked against
ml_dtypes)."""
import struct

import numpy as np
import pytest

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
    return q, cache, (v_cache if v_cache is not None else cache), kw


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
