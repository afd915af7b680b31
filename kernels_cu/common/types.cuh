#pragma once
// Scalar types, conversions and the fast math every kernel uses.
// No CUDA headers: NVRTC compiles these sources with an empty include path, so
// half types live in plain 16-bit integers and conversions go through PTX.

namespace cufa {

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

enum Dtype { FP16 = 0, BF16 = 1 };

#define CUFA_INF __int_as_float(0x7f800000)
#define CUFA_LOG2E 1.4426950408889634f
#define CUFA_LN2 0.6931471805599453f

// Two floats -> one register holding two 16-bit values, `lo` in the low half.
template <int DT>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r;
  if (DT == FP16) {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
}

__device__ __forceinline__ float fp16_to_float(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

__device__ __forceinline__ float bf16_to_float(u16 h) {
  return __uint_as_float(static_cast<u32>(h) << 16);
}

// -- e4m3 (float8_e4m3fn: 1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no inf) --
typedef unsigned char u8;
constexpr float kE4m3Max = 448.f;

// Four e4m3 bytes -> four 16-bit values of dtype DT in two registers: bytes 0 and 2 in
// `even` (byte 0 in its low half), bytes 1 and 3 in `odd`; the e4m3 mma fragments
// (common/e4m3_mma.cuh) are laid out for this pairing. Each value is exactly the e4m3
// value over e4m3_to_half_scale<DT, kCvt>() (the kernels fold the factor into their
// descales). kCvt, fp16, from sm_89 on: the hardware's e4m3x2 -> f16x2 conversion of each
// byte pair, the value itself: two byte permutes and two conversions where the shifts and
// masks below issue seven instructions (the fp8 decode kernel, whose loop is issue-bound;
// in the forward's e4m3 variant ptxas spilled at d = 128 with them). Otherwise shifts and
// masks: fp16: the byte's exponent and mantissa bits moved into place (an e4m3 subnormal
// is an fp16 one, at 2^-17 and up, and an fp16 product of it stays far above float32's
// subnormals); bf16: the same bits under bf16's exponent sit at 2^-120 times the value
// (where products would fall below float32's normals), so one bf16x2 fma by 2^112 lifts
// them to the fp16 scale, exactly: bf16 arithmetic keeps subnormals. (The shifts read
// e4m3fn's NaN code as 480, a finite value; the conversion gives NaN.)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define CUFA_E4M3_CVT 1
#else
#define CUFA_E4M3_CVT 0
#endif
template <int DT, bool kCvt>
__device__ constexpr bool e4m3_by_cvt() {
  return kCvt && DT == FP16 && CUFA_E4M3_CVT;
}
template <int DT, bool kCvt = false>
__device__ constexpr float e4m3_to_half_scale() {
  return e4m3_by_cvt<DT, kCvt>() ? 1.f : 0x1p8f;
}
// (sm_89 on) the e4m3 bytes in the low half of x -> an fp16 pair, exactly
__device__ __forceinline__ u32 e4m3x2_to_half2(u32 x) {
  u32 r = 0;
#if CUFA_E4M3_CVT
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(static_cast<unsigned short>(x)));
#endif
  return r;
}
// (sm_89 on) x's four e4m3 bytes -> the fp16 pairs of bytes 0, 1 (low) and 2, 3 (high):
// the conversion reads each half of x where it is, with no byte permute (the key side of
// gemm_qk_e4m3, whose Q columns are ordered to match)
__device__ __forceinline__ void e4m3x4_to_half2_halves(u32 x, u32& low, u32& high) {
  low = high = 0;
#if CUFA_E4M3_CVT
  asm("{.reg .b16 l, h; mov.b32 {l, h}, %2; cvt.rn.f16x2.e4m3x2 %0, l; cvt.rn.f16x2.e4m3x2 %1, h;}"
      : "=r"(low), "=r"(high) : "r"(x));
#endif
}
template <int DT, bool kCvt = false>
__device__ __forceinline__ void e4m3x4_to_pairs(u32 x, u32& even, u32& odd) {
  if constexpr (e4m3_by_cvt<DT, kCvt>()) {
    even = e4m3x2_to_half2(__byte_perm(x, 0, 0x20));
    odd = e4m3x2_to_half2(__byte_perm(x, 0, 0x31));
  } else if constexpr (DT == FP16) {
    even = ((x << 8) & 0x80008000u) | ((x << 7) & 0x3f803f80u);
    odd = (x & 0x80008000u) | ((x >> 1) & 0x3f803f80u);
  } else {
    const u32 lift = 0x77807780u, minus_zero = 0x80008000u;  // bf16 2^112, -0 (keeps -0)
    const u32 e = ((x << 8) & 0x80008000u) | ((x << 4) & 0x07f007f0u);
    const u32 o = (x & 0x80008000u) | ((x >> 4) & 0x07f007f0u);
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(even) : "r"(e), "r"(lift), "r"(minus_zero));
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(odd) : "r"(o), "r"(lift), "r"(minus_zero));
  }
}

// x's four e4m3 bytes -> the 16-bit pairs of bytes 0, 1 (lo) and 2, 3 (hi), each value
// the e4m3 value over e4m3_to_half_scale<DT, true>(): fp16 by the hardware's conversion (2
// instructions for the 4 values); bf16 as e4m3x4_to_pairs' bits, with each pair's bytes
// first moved to its halves' upper bytes (5 a pair, where the pairs and their permutes
// take 13 for both)
template <int DT>
__device__ __forceinline__ void e4m3x4_to_halves(u32 x, u32& lo, u32& hi) {
  static_assert(DT != FP16 || CUFA_E4M3_CVT, "fp16 halves by the conversion: sm_89 on");
  if constexpr (DT == FP16) {
    e4m3x4_to_half2_halves(x, lo, hi);
  } else {
    const auto widen = [](u32 w) {  // (bytes at bits 15..8 and 31..24)
      const u32 lift = 0x77807780u, minus_zero = 0x80008000u;  // as e4m3x4_to_pairs'
      const u32 bits = ((w & 0x7f007f00u) >> 4) | (w & 0x80008000u);
      u32 r;
      asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(bits), "r"(lift), "r"(minus_zero));
      return r;
    };
    lo = widen(__byte_perm(x, 0, 0x1404));
    hi = widen(__byte_perm(x, 0, 0x3424));
  }
}

// e4m3x4_to_pairs of __byte_perm(x, y, perm) (perm: a constant); by conversion, that byte
// permute and the conversion's own are composed into one a pair
template <int DT, bool kCvt = false>
__device__ __forceinline__ void e4m3x4_to_pairs(u32 x, u32 y, u32 perm, u32& even, u32& odd) {
  if constexpr (e4m3_by_cvt<DT, kCvt>()) {
    even = e4m3x2_to_half2(__byte_perm(x, y, (perm & 0xfu) | ((perm >> 4) & 0xf0u)));
    odd = e4m3x2_to_half2(__byte_perm(x, y, ((perm >> 4) & 0xfu) | ((perm >> 8) & 0xf0u)));
  } else {
    e4m3x4_to_pairs<DT>(__byte_perm(x, y, perm), even, odd);
  }
}

// A float to e4m3, rounded to nearest even and saturated to +-448 (a NaN stays NaN).
__device__ __forceinline__ u8 float_to_e4m3(float x) {
  const u32 sign = (__float_as_uint(x) >> 24) & 0x80u;
  const float a = fabsf(x);
  if (!(a == a)) return static_cast<u8>(sign | 0x7fu);
  u32 code = 0x7eu;  // from 448 up: 448
  if (a < 0x1p-6f) {  // subnormal: steps of 2^-9 (the 8th is 2^-6, code 8)
    code = static_cast<u32>(__float2int_rn(a * 0x1p9f));
  } else if (a < kE4m3Max) {
    const int e = static_cast<int>(__float_as_uint(a) >> 23) - 127;      // -6 .. 8
    const float step = __uint_as_float(static_cast<u32>(127 + 3 - e) << 23);  // 2^(3 - e)
    const int m = __float2int_rn(a * step) - 8;                          // 0 .. 8
    code = min(static_cast<u32>(((e + 7) << 3) + m), 0x7eu);  // (m = 8 carries up)
  }
  return static_cast<u8>(sign | code);
}

// exp2 on the special-function unit; exp2(-inf) = 0, which masking relies on.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// tanh as 1 - 2 / (e^{2x} + 1) on the special-function unit: absolute error ~1e-7 (near 0
// the difference loses relative precision, not absolute, which is what a softcap's score
// keeps); +-1 for large |x|, NaN kept. libdevice's tanhf is ~20 instructions with a full
// division, a few times the cost of the rest of a score's work.
__device__ __forceinline__ float fast_tanh(float x) {
  return 1.f - 2.f * fast_rcp(fast_exp2(x * 2.8853900817779268f) + 1.f);  // 2 log2(e)
}

// Offset of a params field, computed at compile time (the layout checks): set the field
// to a value whose lowest byte is non-zero, bit_cast the struct to bytes, find that
// byte. Params structs hold addresses as integers so that they can be bit_cast.
template <typename T>
struct StructBytes {
  unsigned char b[sizeof(T)];
};
template <typename T, typename M>
__device__ constexpr int field_offset(M T::*field, M marker) {
  T t{};
  t.*field = marker;
  const StructBytes<T> bytes = __builtin_bit_cast(StructBytes<T>, t);
  for (int i = 0; i < (int)sizeof(T); ++i)
    if (bytes.b[i]) return i;
  return -1;
}

}  // namespace cufa
