#pragma once
// mma.sync building blocks shared by the sm_80 forward and the decode kernels: the
// swizzled shared-memory tile, ldmatrix addressing, and the two products of a warp's
// 16-row tiles (S = Q K^T, O += P V).
#include "sm80.cuh"

namespace cufa {

// A shared-memory tile of 16-bit elements, kHeadDim per row, addressed in 16-byte
// chunks. A chunk's place in its row is XOR-swizzled by the row so that the 8 rows
// one ldmatrix phase reads land in 8 different bank groups.
template <int kHeadDim>
struct Swizzle {
  static constexpr int kChunks = kHeadDim / 8;
  // XOR span in chunks: 8 when a row holds a multiple of 8 chunks (128 bytes),
  // else 4, with the row's bits 1-2 so that rows r and r+1 sit 64 bytes apart.
  static constexpr int kSpan = (kChunks % 8 == 0) ? 8 : 4;
  static_assert(kChunks % 4 == 0, "head dim must be padded to a multiple of 32");
  __device__ __forceinline__ static int swz(int row) {
    return kSpan == 8 ? (row & 7) : ((row >> 1) & 3);
  }
  __device__ __forceinline__ static int offset(int row, int chunk) {  // bytes
    return (row * kChunks + (chunk ^ swz(row))) * 16;
  }
};

// One lane's ldmatrix addresses into a swizzled tile: the lane reads row
// `row_block + lane_row` (row_block a multiple of 8) at chunk `2 * pair + lane_chunk`.
// The XOR only touches the chunk's low bits, so kSpan / 2 per-lane bases cover
// every (row_block, pair) with compile-time offsets, rather than one register per address.
template <int kHeadDim>
struct LdmatrixAddr {
  using S = Swizzle<kHeadDim>;
  static constexpr int kBases = S::kSpan / 2;
  u32 base[kBases];

  __device__ __forceinline__ LdmatrixAddr(u32 tile, int lane_row, int lane_chunk) {
#pragma unroll
    for (int j = 0; j < kBases; ++j)
      base[j] = tile + (lane_row * S::kChunks + ((2 * j + lane_chunk) ^ S::swz(lane_row))) * 16;
  }
  __device__ __forceinline__ u32 at(int row_block, int pair) const {
    return base[pair % kBases] + row_block * S::kChunks * 16 + (pair / kBases) * S::kSpan * 16;
  }
};

// -- S = Q K^T for one warp's rows --
template <int kDtype, int kHeadDim, int kMTiles, int kNTiles>
__device__ __forceinline__ void gemm_qk(float (&s)[kMTiles][kNTiles][4], const LdmatrixAddr<kHeadDim>& q,
                                        const LdmatrixAddr<kHeadDim>& k) {
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks) {
    u32 a[kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) ldmatrix_x4(a[mt], q.at(mt * 16, ks));
#pragma unroll
    for (int np = 0; np < kNTiles / 2; ++np) {
      u32 b[4];
      ldmatrix_x4(b, k.at(np * 16, ks));
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        mma_16816<kDtype>(s[mt][2 * np], a[mt], b[0], b[1]);
        mma_16816<kDtype>(s[mt][2 * np + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// -- P's A fragments (each row tile's) of the 16-key step ks, from the S accumulators --
template <int kDtype, int kMTiles, int kNTiles>
__device__ __forceinline__ void p_fragments(u32 (&a)[kMTiles][4],
                                            const float (&p)[kMTiles][kNTiles][4], int ks) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    a[mt][0] = pack2<kDtype>(p[mt][2 * ks][0], p[mt][2 * ks][1]);
    a[mt][1] = pack2<kDtype>(p[mt][2 * ks][2], p[mt][2 * ks][3]);
    a[mt][2] = pack2<kDtype>(p[mt][2 * ks + 1][0], p[mt][2 * ks + 1][1]);
    a[mt][3] = pack2<kDtype>(p[mt][2 * ks + 1][2], p[mt][2 * ks + 1][3]);
  }
}

// -- O += P V: P goes from the S accumulators straight into A fragments --
template <int kDtype, int kHeadDim, int kMTiles, int kNTiles, int kDTiles>
__device__ __forceinline__ void gemm_pv(float (&o)[kMTiles][kDTiles][4],
                                        const float (&p)[kMTiles][kNTiles][4],
                                        const LdmatrixAddr<kHeadDim>& v) {
#pragma unroll
  for (int ks = 0; ks < kNTiles / 2; ++ks) {
    u32 a[kMTiles][4];
    p_fragments<kDtype>(a, p, ks);
#pragma unroll
    for (int dp = 0; dp < kDTiles / 2; ++dp) {
      u32 b[4];
      ldmatrix_x4_trans(b, v.at(ks * 16, dp));
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        mma_16816<kDtype>(o[mt][2 * dp], a[mt], b[0], b[1]);
        mma_16816<kDtype>(o[mt][2 * dp + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

}  // namespace cufa
