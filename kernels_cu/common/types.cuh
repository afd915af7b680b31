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
