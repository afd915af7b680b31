#pragma once
// Rotary embedding (rotate-half or interleaved pairs) of one row, cos/sin from tables
// of fp16, bf16 or fp32.
#include "params.cuh"

namespace cufa {

// -- rotary embedding of one row (d elements) from src to dst, at cache position pos --
template <int kDtype>
__device__ __forceinline__ float load_half(const u16* x, int i) {
  return kDtype == FP16 ? fp16_to_float(x[i]) : bf16_to_float(x[i]);
}
template <int kDtype>
__device__ __forceinline__ u16 to_half(float x) {
  return static_cast<u16>(pack2<kDtype>(x, 0.f) & 0xffffu);
}

__device__ __forceinline__ float rotary_value(const DecodeParams& p, u64 table, i64 i) {
  if (p.rotary_dtype == 2) return reinterpret_cast<const float*>(table)[i];
  const u16 h = reinterpret_cast<const u16*>(table)[i];
  return p.rotary_dtype == FP16 ? fp16_to_float(h) : bf16_to_float(h);
}

// -- rotary embedding of the row src (d elements) at cache position pos: each rotated value
//    goes to store_rotated(i, x), each feature past rotary_dim (all without rotary) to
//    store_kept(i) --
template <int kDtype, class StoreRotated, class StoreKept>
__device__ __forceinline__ void rotate_row_into(const DecodeParams& p, const u16* src, int pos,
                                                int lane, StoreRotated store_rotated,
                                                StoreKept store_kept) {
  const int half = p.rotary_dim / 2;
  const i64 at = (i64)min(max(pos, 0), p.seqlen_ro - 1) * half;
  for (int i = lane; i < half; i += 32) {
    const int a = p.rotary_interleaved ? 2 * i : i, b = p.rotary_interleaved ? 2 * i + 1 : i + half;
    const float c = rotary_value(p, p.rotary_cos, at + i), s = rotary_value(p, p.rotary_sin, at + i);
    const float x0 = load_half<kDtype>(src, a), x1 = load_half<kDtype>(src, b);
    store_rotated(a, x0 * c - x1 * s);
    store_rotated(b, x0 * s + x1 * c);
  }
  for (int i = p.rotary_dim + lane; i < p.head_dim; i += 32) store_kept(i);
}

// -- into a row of kDtype: rotated values rounded, the rest copied --
template <int kDtype>
__device__ __forceinline__ void rotate_row(const DecodeParams& p, const u16* src, u16* dst, int pos,
                                           int lane) {
  rotate_row_into<kDtype>(p, src, pos, lane, [&](int i, float x) { dst[i] = to_half<kDtype>(x); },
                          [&](int i) { dst[i] = src[i]; });
}

// -- into an e4m3 cache row: each value rounded to kDtype as rotate_row stores it, then
//    divided by the row's descale and rounded to e4m3, saturated to +-448 (float_to_e4m3:
//    a NaN stays NaN, as torch's clamp and cast keep it) --
template <int kDtype>
__device__ __forceinline__ u8 to_e4m3(float x, float descale) {
  const float half = kDtype == FP16 ? fp16_to_float(to_half<kDtype>(x)) : bf16_to_float(to_half<kDtype>(x));
  return float_to_e4m3(half / descale);
}

template <int kDtype>
__device__ __forceinline__ void rotate_row_e4m3(const DecodeParams& p, const u16* src, u8* dst,
                                                int pos, float descale, int lane) {
  rotate_row_into<kDtype>(
      p, src, pos, lane, [&](int i, float x) { dst[i] = to_e4m3<kDtype>(x, descale); },
      [&](int i) { dst[i] = to_e4m3<kDtype>(load_half<kDtype>(src, i), descale); });
}

}  // namespace cufa
