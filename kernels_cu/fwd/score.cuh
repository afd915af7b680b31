#pragma once
// Score stages shared by the forward kernels, on the mma.sync accumulator layout
// (wgmma accumulators use the same layout per warp): element e of tile (mt, nt)
// is row 16 * mt + lane / 4 + 8 * (e / 2), column 8 * nt + 2 * (lane % 4) + e % 2.
#include "../common/sm80.cuh"
#include "params.cuh"
#include "mask.cuh"

namespace cufa {

// -- mask: keys outside the window or past seqlen_k get -inf. Bounds are found once per
//    row, relative to this lane's first key, so each score costs two compares; one where
//    the window's left side is unbounded (causal, or no window), whose only bound, the
//    row's end, is then found in 32 bits: ncu put the masked blocks at a fifth of the
//    instructions of short causal rows at d = 256, with 64-bit bounds. kBounds32: a
//    bounded window's in 32 bits too (row_keys_32; the fp8 forward's) --
template <int kMask, int kMTiles, int kNTiles, bool kBounds32 = false>
__device__ __forceinline__ void apply_mask(float (&s)[kMTiles][kNTiles][4], const FwdParams& p,
                                           const Tile& t, int row_base, int key0, int lane) {
  const int first_key = frag_col(key0, 0, 0, lane);
  if (kMask == MASK_NONE || p.window_left >= kUnboundedWindow) {
    // Not clamped to seqlen_k: rows before the diagonal enters (seqlen_q > seqlen_k) see
    // keys up to diagonal + right even when right > seqlen_k. The host caps it at
    // kUnboundedWindow, so seqlen_k - right cannot leave int32.
    const int right = p.window_right;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // min(row's diagonal + 1 + right, seqlen_k), without the sum passing 2^31
        const int diagonal_end = frag_row(row_base, mt, 2 * h, lane) + t.diag_offset + 1;
        const int end = (kMask == MASK_NONE ? t.seqlen_k
                                            : max(min(diagonal_end, t.seqlen_k - right) + right, 0)) -
                        first_key;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            if (nt * 8 + e >= end) s[mt][nt][2 * h + e] = -CUFA_INF;
      }
  } else {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = frag_row(row_base, mt, 2 * h, lane);
        const KeyRange keys = kBounds32 ? row_keys_32<kMask>(p, t, row) : row_keys<kMask>(p, t, row);
        const int begin = keys.begin - first_key, end = keys.end - first_key;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int key = nt * 8 + e;  // relative to first_key
            if (key < begin || key >= end) s[mt][nt][2 * h + e] = -CUFA_INF;
          }
      }
  }
}

__device__ __forceinline__ float attn_mask_value(const FwdParams& p, i64 offset) {
  switch (p.attn_mask_type) {
    case ATTN_MASK_BOOL: return reinterpret_cast<const unsigned char*>(p.attn_mask)[offset] ? 0.f : -CUFA_INF;
    case ATTN_MASK_FP16: return fp16_to_float(reinterpret_cast<const u16*>(p.attn_mask)[offset]);
    case ATTN_MASK_BF16: return bf16_to_float(reinterpret_cast<const u16*>(p.attn_mask)[offset]);
    case ATTN_MASK_FP32: return reinterpret_cast<const float*>(p.attn_mask)[offset];
    default: return 0.f;
  }
}

// What the score mods need of the tile, read once per CTA.
struct TileMods {
  float alibi_slope;  // 0 when there is no ALiBi
  i64 mask_offset;    // the (batch, head) corner of attn_mask
};

template <bool kScoreMods>
__device__ __forceinline__ TileMods tile_mods(const FwdParams& p, const Tile& t) {
  TileMods m;
  m.alibi_slope = (kScoreMods && p.alibi_slopes)
                      ? reinterpret_cast<const float*>(p.alibi_slopes)[t.b * p.alibi_batch_stride + t.h]
                      : 0.f;
  m.mask_offset = t.b * p.mask_batch_stride + t.h * p.mask_head_stride;
  return m;
}

// -- score mods: scale, softcap, ALiBi, explicit mask; leaves scores in log2 units --
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void apply_score_mods(float (&s)[kMTiles][kNTiles][4], const FwdParams& p,
                                                 const Tile& t, const TileMods& m, int row_base,
                                                 int key0, int lane) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = frag_row(row_base, mt, e, lane), key = frag_col(key0, nt, e, lane);
        float x = s[mt][nt][e] * p.scale;
        if (p.softcap > 0.f) x = p.softcap * fast_tanh(x * p.softcap_inv);
        if (m.alibi_slope != 0.f)  // (tile-uniform: most calls have no ALiBi)
          x -= m.alibi_slope * fabsf(static_cast<float>((i64)row + t.diag_offset - key));
        if (p.attn_mask_type != ATTN_MASK_NONE && row < t.seqlen_q && key < t.seqlen_k)
          x += attn_mask_value(p, m.mask_offset + row * p.mask_row_stride + key * p.mask_col_stride);
        s[mt][nt][e] = x * CUFA_LOG2E;
      }
}

}  // namespace cufa
