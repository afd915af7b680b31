#pragma once
// A warp's 16-key tile: S = Q K^T, score mods (scale, softcap, ALiBi), the window and
// the sequence's end as a mask, and O += P V; the keys a CTA's rows see.
#include "cache.cuh"

namespace cufa {

// Keys [begin, end) that some row of the CTA sees (bottom-right window, i64 because an
// unbounded side holds 2^30).
struct KeySpan {
  int begin, end;
};

__device__ __forceinline__ KeySpan visible_span(const DecodeParams& p, int seqlen_k, int seqlen_q,
                                                int t_lo, int t_hi) {
  const i64 diag = seqlen_k - seqlen_q;
  const i64 lo = t_lo + diag - p.window_left, hi = t_hi + diag + p.window_right + 1;
  KeySpan k;
  k.begin = (int)max((i64)0, min(lo, (i64)seqlen_k));
  k.end = (int)max((i64)k.begin, min(hi, (i64)seqlen_k));
  return k;
}

// What one lane needs of its two accumulator rows (lane / 4 and lane / 4 + 8).
struct LaneRows {
  i64 lo[2], hi[2];  // visible keys [lo, hi] of each row
  float slope[2];    // ALiBi slope of each row's head (0 without ALiBi)
  int t[2];
};

template <int kHeads = 1>
__device__ __forceinline__ LaneRows lane_rows(const DecodeParams& p, const CacheSeq& s, int m_block,
                                              int h_k, int lane) {
  LaneRows lr;
  const i64 diag = s.seqlen_k - s.seqlen_q;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const DecodeRow row = decode_row<kHeads>(p, s, m_block, h_k, (lane >> 2) + 8 * i);
    lr.t[i] = row.t;
    lr.lo[i] = row.t + diag - p.window_left;
    lr.hi[i] = min(row.t + diag + p.window_right, (i64)s.seqlen_k - 1);
    lr.slope[i] = (p.alibi_slopes && row.valid)
                      ? reinterpret_cast<const float*>(p.alibi_slopes)[s.b * p.alibi_batch_stride + row.h]
                      : 0.f;
  }
  return lr;
}

// -- score mods: scale, softcap, ALiBi; leaves scores in log2 units --
__device__ __forceinline__ void decode_score_mods(float (&sc)[1][2][4], const DecodeParams& p,
                                                  const CacheSeq& s, const LaneRows& lr, int key0,
                                                  int lane) {
  const int diag = s.seqlen_k - s.seqlen_q;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = frag_col(key0, nt, e, lane), i = e >> 1;
      float x = sc[0][nt][e] * p.scale;
      if (p.softcap > 0.f) x = p.softcap * fast_tanh(x * p.softcap_inv);
      x -= lr.slope[i] * fabsf(static_cast<float>(lr.t[i] + diag - key));
      sc[0][nt][e] = x * CUFA_LOG2E;
    }
}

// -- mask: keys outside a row's window or past the sequence get -inf --
__device__ __forceinline__ void decode_mask(float (&sc)[1][2][4], const LaneRows& lr, int key0,
                                            int lane) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = frag_col(key0, nt, e, lane), i = e >> 1;
      if (key < lr.lo[i] || key > lr.hi[i]) sc[0][nt][e] = -CUFA_INF;
    }
}

// -- accumulator fragments set to one value --
template <int A, int B, int C>
__device__ __forceinline__ void fill(float (&x)[A][B][C], float value) {
#pragma unroll
  for (int i = 0; i < A; ++i)
#pragma unroll
    for (int j = 0; j < B; ++j)
#pragma unroll
      for (int k = 0; k < C; ++k) x[i][j][k] = value;
}

// -- softcap or ALiBi: then the scores leave score mods in log2 units --
__device__ __forceinline__ bool score_mods_on(const DecodeParams& p) {
  return p.softcap > 0.f || p.alibi_slopes;
}

// -- what a warp needs to score a 16-key tile: its lanes' rows, and the keys every row of
//    the CTA sees (tiles inside them need no mask; `rows` a head, kHeads heads) --
struct TileScoring {
  LaneRows lr;
  int all_lo, all_hi;  // (visible_span's ints)
};

template <int kHeads = 1>
__device__ __forceinline__ TileScoring tile_scoring(const DecodeParams& p, const CacheSeq& s,
                                                    int m_block, int h_k, int rows, int lane) {
  TileScoring sc;
  sc.lr = lane_rows<kHeads>(p, s, m_block, h_k, lane);
  constexpr int kRows = rows_per_head<kHeads>();
  const int t_first = (m_block * kRows) / p.group;
  const int t_last = (m_block * kRows + rows - 1) / p.group;
  sc.all_lo = visible_span(p, s.seqlen_k, s.seqlen_q, t_last, t_last).begin;
  sc.all_hi = visible_span(p, s.seqlen_k, s.seqlen_q, t_first, t_first).end;
  return sc;
}

// -- S += Q K^T of the 16-key tile at k_tile (keys key0..): a 16-bit tile, or an e4m3
//    one (kE4m3: E4m3Tile rows; Q in fp16, q_to_fp16_for_e4m3_keys's) whose scores are
//    then times k_scale_lo in row lane / 4, k_scale_hi in row lane / 4 + 8 (the descale
//    and Q's row units); then score mods and mask --
template <int kDtype, int kHeadDim, bool kE4m3 = false>
__device__ __forceinline__ void score_tile(float (&tile_s)[1][2][4], const LdmatrixAddr<kHeadDim>& q_frag,
                                           u32 k_tile, const DecodeParams& p, const CacheSeq& s,
                                           const TileScoring& sc, bool score_mods, int key0,
                                           int lane, float k_scale_lo = 1.f,
                                           float k_scale_hi = 1.f) {
  if constexpr (kE4m3) {
    gemm_qk_e4m3<FP16, kHeadDim, 1, 2, true>(tile_s, q_frag, k_tile, lane);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) tile_s[0][nt][e] *= e < 2 ? k_scale_lo : k_scale_hi;
  } else {
    const LdmatrixAddr<kHeadDim> k_frag(k_tile, (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
    gemm_qk<kDtype>(tile_s, q_frag, k_frag);
  }
  if (score_mods) decode_score_mods(tile_s, p, s, sc.lr, key0, lane);
  if (key0 < sc.all_lo || key0 + kTileKeys > sc.all_hi) decode_mask(tile_s, sc.lr, key0, lane);
}

// -- O += P V of the 16-key tile at v_tile (kE4m3: E4m3Tile rows, in fp16 products, whose
//    output tiles hold gemm_pv_e4m3's dims) --
template <int kDtype, int kHeadDim, bool kE4m3 = false, int kDTiles>
__device__ __forceinline__ void accumulate_tile(float (&acc_o)[1][kDTiles][4],
                                                const float (&tile_p)[1][2][4], u32 v_tile,
                                                int lane) {
  if constexpr (kE4m3) {
    gemm_pv_e4m3<FP16, kHeadDim, 1, 2, kDTiles, true>(acc_o, tile_p, v_tile, lane);
  } else {
    const LdmatrixAddr<kHeadDim> v_frag(v_tile, (lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4);
    gemm_pv<kDtype>(acc_o, tile_p, v_frag);
  }
}

}  // namespace cufa
