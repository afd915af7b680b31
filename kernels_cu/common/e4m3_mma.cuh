#pragma once
// e4m3 K and V tiles go from shared memory straight into mma.sync fragments of the 16-bit
// dtype: each ldmatrix reads a lane's four bytes of keys (or values), e4m3x4_to_pairs
// makes them one B fragment, and no 16-bit copy of a tile is written (a tile crosses
// shared memory twice, as a 16-bit one does, where a converted copy took it there four
// times). The decode kernel (one 16-row tile, 16-key steps) and the forward's e4m3 K/V
// variant (kMTiles row tiles, kNTiles / 2 16-key steps) share them. The bytes a lane gets
// are not the dims or keys the 16-bit fragment layout would give it; the orders below
// make both sides of each product agree:
// - S = Q K^T sums over the dims in any order, so Q's columns are reordered once to the
//   order the key fragments hold them (order_q_for_e4m3_keys);
// - O += P V: V read transposed gives a lane two keys of two dims; a byte permute makes
//   one fragment of each dim, so an output tile holds every other dim and the epilogues
//   write the columns back in order (e4m3_output_dims).
#include "element_io.cuh"
#include "mma_tiles.cuh"

namespace cufa {

// -- rows of an e4m3 tile in shared memory: kHeadDim bytes, each row padded to an odd
//    number of 16-byte chunks, so that the 8 rows an ldmatrix phase reads at one chunk
//    land in 8 different bank groups at every head dim --
template <int kHeadDim>
struct E4m3Tile {
  static constexpr int kRowChunks = (kHeadDim / 16) | 1;
  static constexpr int kRowBytes = kRowChunks * 16;
  __device__ __forceinline__ static u32 offset(int row, int chunk) {
    return static_cast<u32>((row * kRowChunks + chunk) * 16);
  }
};

// -- an e4m3 cache's scale of sequence b's KV head h_k (k_descale / v_descale: float32,
//    0 for none) --
__device__ __forceinline__ float cache_descale(u64 descale, i64 batch_stride, i64 head_stride,
                                               int b, int h_k) {
  return descale ? reinterpret_cast<const float*>(descale)[b * batch_stride + h_k * head_stride]
                 : 1.f;
}

// Q's kRows rows, each 16-column block reordered in place: e4m3x4_to_pairs gives a lane the
// dims (4t, 4t+2) and (4t+1, 4t+3) of a 16-dim step as the mma's k = (2t, 2t+1) and
// (2t+8, 2t+9), so new column 2t, 2t+1 = old 4t, 4t+2 and new 2t+8, 2t+9 = old 4t+1,
// 4t+3: new word t = the low halves of old words 2t, 2t+1, new word 4 + t their high
// halves. kHalves: the keys by e4m3x4_to_half2_halves, which gives dims (4t, 4t+1) and
// (4t+2, 4t+3): new word t = old word 2t, new word 4 + t = old word 2t + 1. The caller
// syncs the CTA before and after.
template <int kRows, int kHeadDim, int kThreads, bool kHalves = false>
__device__ __forceinline__ void order_q_for_e4m3_keys(u32 sq, int thread) {
  using S = Swizzle<kHeadDim>;
  constexpr int kBlocks = kHeadDim / 16;
  for (int idx = thread; idx < kRows * kBlocks; idx += kThreads) {
    const int r = idx / kBlocks, blk = idx % kBlocks;
    const u32 first = sq + S::offset(r, 2 * blk), second = sq + S::offset(r, 2 * blk + 1);
    const uint4 a = ld_shared_16(first), b = ld_shared_16(second);
    if constexpr (kHalves) {
      st_shared_16(first, make_uint4(a.x, a.z, b.x, b.z));
      st_shared_16(second, make_uint4(a.y, a.w, b.y, b.w));
      continue;
    }
    st_shared_16(first, make_uint4(__byte_perm(a.x, a.y, 0x5410), __byte_perm(a.z, a.w, 0x5410),
                                   __byte_perm(b.x, b.y, 0x5410), __byte_perm(b.z, b.w, 0x5410)));
    st_shared_16(second, make_uint4(__byte_perm(a.x, a.y, 0x7632), __byte_perm(a.z, a.w, 0x7632),
                                    __byte_perm(b.x, b.y, 0x7632), __byte_perm(b.z, b.w, 0x7632)));
  }
}

// The decode kernel's e4m3 products run in fp16 whatever q's dtype: fp16 has a conversion
// from e4m3 in hardware (e4m3x4_to_pairs), bf16 none. So a bf16 Q is turned into fp16
// once a CTA, each row r times a power of two 2^e_r that puts its largest |q| in
// [2^14, 2^15): no value overflows, and every one from 2^-28 of the largest up is an fp16
// value exactly (bf16 keeps 8 significant bits, fp16 11); smaller ones round into fp16's
// subnormals, far below the dot product's rounding. row_unit[r] = 2^-e_r takes it back out
// of the scores. fp16 Q stays as it is (unit 1). Then the columns are reordered as
// order_q_for_e4m3_keys does for gemm_qk_e4m3<FP16, ..., kCvt = true>'s keys. The caller syncs the CTA before (Q has landed) and after.
template <int kDtype, int kRows, int kHeadDim, int kThreads>
__device__ __forceinline__ void q_to_fp16_for_e4m3_keys(u32 sq, float* row_unit, int thread) {
  using S = Swizzle<kHeadDim>;
  constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks a row
  if constexpr (kDtype == BF16) {
    // each row's largest |q|: kThreads / kRows lanes a row (a power of two, in one warp)
    constexpr int kLanes = kThreads / kRows;
    static_assert(kLanes * kRows == kThreads && 32 % kLanes == 0, "whole rows a warp");
    const int r = thread / kLanes;
    u32 largest = 0;  // (|q|'s bits: as unsigned ints they order as the values do)
    for (int c = thread % kLanes; c < kChunks; c += kLanes) {
      const uint4 x = ld_shared_16(sq + S::offset(r, c));
      const u32 w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) largest = max(largest, max(w[i] & 0x7fffu, (w[i] >> 16) & 0x7fffu));
    }
#pragma unroll
    for (int o = kLanes / 2; o > 0; o /= 2) largest = max(largest, __shfl_xor_sync(0xffffffffu, largest, o));
    // 2^e with e = 14 - the largest's exponent, within float's normal exponents (a row of
    // zeros gets 2^126; inf or NaN, 2^-114, which keeps them what they are)
    const int e = min(max(14 - (static_cast<int>(largest >> 7) - 127), -126), 126);
    if (thread % kLanes == 0) row_unit[r] = __uint_as_float(static_cast<u32>(127 - e) << 23);
    const float scale = __uint_as_float(static_cast<u32>(127 + e) << 23);
    for (int c = thread % kLanes; c < kChunks; c += kLanes) {
      const u32 at = sq + S::offset(r, c);
      const uint4 x = ld_shared_16(at);
      const u32 w[4] = {x.x, x.y, x.z, x.w};
      u32 h[4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
        h[i] = pack2<FP16>(bf16_to_float(static_cast<u16>(w[i])) * scale,
                           bf16_to_float(static_cast<u16>(w[i] >> 16)) * scale);
      st_shared_16(at, make_uint4(h[0], h[1], h[2], h[3]));
    }
    __syncthreads();
  } else {
    if (thread < kRows) row_unit[thread] = 1.f;
  }
  order_q_for_e4m3_keys<kRows, kHeadDim, kThreads, e4m3_by_cvt<FP16, true>()>(sq, thread);
}

// -- S = Q K^T of kNTiles * 8 e4m3 keys (an E4m3Tile at k_tile), Q in
//    order_q_for_e4m3_keys's order (kHalves where the keys are widened by conversion). One ldmatrix reads two 16-dim steps of 16 keys: a
//    lane's four bytes of key g (+ 8) at dims 4t..4t+3 of each step --
template <int kDtype, int kHeadDim, int kMTiles, int kNTiles, bool kCvt = false>
__device__ __forceinline__ void gemm_qk_e4m3(float (&s)[kMTiles][kNTiles][4],
                                             const LdmatrixAddr<kHeadDim>& q, u32 k_tile,
                                             int lane) {
  using T = E4m3Tile<kHeadDim>;
  const u32 k_lane = k_tile + T::offset((lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
#pragma unroll
  for (int kp = 0; kp < kHeadDim / 32; ++kp) {
    u32 b[kNTiles / 2][4];  // step 2kp keys 0-7, step 2kp + 1 keys 0-7, then keys 8-15 of each
#pragma unroll
    for (int np = 0; np < kNTiles / 2; ++np) ldmatrix_x4(b[np], k_lane + np * 16 * T::kRowBytes + kp * 32);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      u32 a[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) ldmatrix_x4(a[mt], q.at(mt * 16, 2 * kp + h));
#pragma unroll
      for (int np = 0; np < kNTiles / 2; ++np) {
        u32 even0, odd0, even1, odd1;
        if constexpr (e4m3_by_cvt<kDtype, kCvt>()) {  // (Q: order_q_for_e4m3_keys<..., true>)
          e4m3x4_to_half2_halves(b[np][h], even0, odd0);
          e4m3x4_to_half2_halves(b[np][2 + h], even1, odd1);
        } else {
          e4m3x4_to_pairs<kDtype, kCvt>(b[np][h], even0, odd0);
          e4m3x4_to_pairs<kDtype, kCvt>(b[np][2 + h], even1, odd1);
        }
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          mma_16816<kDtype>(s[mt][2 * np], a[mt], even0, odd0);
          mma_16816<kDtype>(s[mt][2 * np + 1], a[mt], even1, odd1);
        }
      }
    }
  }
}

// -- O += P V of kNTiles * 8 e4m3 keys (an E4m3Tile at v_tile). ldmatrix.trans of 16-bit
//    elements reads V's bytes in pairs: a lane gets dims 2g, 2g + 1 of keys 2t, 2t + 1
//    (keys 0-7 of a 16-key step) and of keys 2t + 8, 2t + 9; a byte permute makes the
//    fragment of dim 2g and that of dim 2g + 1. Output tile 2c holds the even dims of the
//    16-dim chunk c, tile 2c + 1 the odd ones --
template <int kDtype, int kHeadDim, int kMTiles, int kNTiles, int kDTiles, bool kCvt = false>
__device__ __forceinline__ void gemm_pv_e4m3(float (&o)[kMTiles][kDTiles][4],
                                             const float (&p)[kMTiles][kNTiles][4], u32 v_tile,
                                             int lane) {
  using T = E4m3Tile<kHeadDim>;
  const u32 v_lane = v_tile + T::offset((lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4);
#pragma unroll
  for (int ks = 0; ks < kNTiles / 2; ++ks) {
    u32 a[kMTiles][4];
    p_fragments<kDtype>(a, p, ks);
#pragma unroll
    for (int cp = 0; cp < kHeadDim / 32; ++cp) {
      u32 b[4];  // chunk 2cp keys 0-7, keys 8-15, then chunk 2cp + 1's
      ldmatrix_x4_trans(b, v_lane + ks * 16 * T::kRowBytes + cp * 32);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int c = 2 * cp + h;
        u32 even, odd;
        e4m3x4_to_pairs<kDtype, kCvt>(b[2 * h], b[2 * h + 1], 0x6240, even, odd);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) mma_16816<kDtype>(o[mt][2 * c], a[mt], even, odd);
        e4m3x4_to_pairs<kDtype, kCvt>(b[2 * h], b[2 * h + 1], 0x7351, even, odd);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) mma_16816<kDtype>(o[mt][2 * c + 1], a[mt], even, odd);
      }
    }
  }
}

// -- the four output dims a lane holds of row half `h` (0: row g, 1: row g + 8) of the
//    16-dim chunk c after gemm_pv_e4m3: dims 16c + 4t .. 16c + 4t + 3, in order --
template <int kMTiles, int kDTiles>
__device__ __forceinline__ float4 e4m3_output_dims(const float (&o)[kMTiles][kDTiles][4], int mt,
                                                   int c, int h) {
  return make_float4(o[mt][2 * c][2 * h], o[mt][2 * c + 1][2 * h], o[mt][2 * c][2 * h + 1],
                     o[mt][2 * c + 1][2 * h + 1]);
}

}  // namespace cufa
