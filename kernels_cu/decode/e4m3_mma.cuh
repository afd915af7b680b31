#pragma once
// An e4m3 cache's tiles go from their cp.async stages straight into mma fragments: each
// ldmatrix reads a lane's four bytes of keys (or values), e4m3x4_to_pairs makes them one
// B fragment, and no 16-bit copy of the tile is written (a tile crosses shared memory
// twice, as a 16-bit one does, where a converted copy took it there four times). The
// bytes a lane gets are not the dims or keys the 16-bit fragment layout would give it;
// the orders below make both sides of each product agree:
// - S = Q K^T sums over the dims in any order, so Q's columns are reordered once to the
//   order the key fragments hold them (order_q_for_e4m3_keys);
// - O += P V: V read transposed gives a lane two keys of two dims; a byte permute makes
//   one fragment of each dim, so an output tile holds every other dim and the epilogue
//   writes the columns back in order (stage_warp_outputs' kE4m3Columns).
#include "cache.cuh"

namespace cufa {

// Q's columns, each 16-column block reordered in place: e4m3x4_to_pairs gives a lane the
// dims (4t, 4t+2) and (4t+1, 4t+3) of a 16-dim step as the mma's k = (2t, 2t+1) and
// (2t+8, 2t+9), so new column 2t, 2t+1 = old 4t, 4t+2 and new 2t+8, 2t+9 = old 4t+1,
// 4t+3: new word t = the low halves of old words 2t, 2t+1, new word 4 + t their high
// halves. The caller syncs the CTA before and after.
template <int kHeadDim, int kThreads>
__device__ __forceinline__ void order_q_for_e4m3_keys(u32 sq, int thread) {
  using S = Swizzle<kHeadDim>;
  constexpr int kBlocks = kHeadDim / 16;
  for (int idx = thread; idx < kDecodeRows * kBlocks; idx += kThreads) {
    const int r = idx / kBlocks, blk = idx % kBlocks;
    const u32 first = sq + S::offset(r, 2 * blk), second = sq + S::offset(r, 2 * blk + 1);
    const uint4 a = ld_shared_16(first), b = ld_shared_16(second);
    st_shared_16(first, make_uint4(__byte_perm(a.x, a.y, 0x5410), __byte_perm(a.z, a.w, 0x5410),
                                   __byte_perm(b.x, b.y, 0x5410), __byte_perm(b.z, b.w, 0x5410)));
    st_shared_16(second, make_uint4(__byte_perm(a.x, a.y, 0x7632), __byte_perm(a.z, a.w, 0x7632),
                                    __byte_perm(b.x, b.y, 0x7632), __byte_perm(b.z, b.w, 0x7632)));
  }
}

// -- S = Q K^T of a 16-key e4m3 tile (an E4m3Tile), Q in order_q_for_e4m3_keys's order.
//    One ldmatrix reads two 16-dim steps of keys 0-7 and 8-15: a lane's four bytes of
//    key g (+ 8) at dims 4t..4t+3 of each step --
template <int kDtype, int kHeadDim>
__device__ __forceinline__ void gemm_qk_e4m3(float (&s)[1][2][4], const LdmatrixAddr<kHeadDim>& q,
                                             u32 k_tile, int lane) {
  const u32 k_lane = k_tile + E4m3Tile<kHeadDim>::offset((lane & 7) + ((lane >> 4) << 3),
                                                         (lane >> 3) & 1);
#pragma unroll
  for (int kp = 0; kp < kHeadDim / 32; ++kp) {
    u32 b[4];  // step 2kp keys 0-7, step 2kp + 1 keys 0-7, then keys 8-15 of each
    ldmatrix_x4(b, k_lane + kp * 32);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      u32 a[4], even0, odd0, even1, odd1;
      ldmatrix_x4(a, q.at(0, 2 * kp + h));
      e4m3x4_to_pairs<kDtype>(b[h], even0, odd0);
      e4m3x4_to_pairs<kDtype>(b[2 + h], even1, odd1);
      mma_16816<kDtype>(s[0][0], a, even0, odd0);
      mma_16816<kDtype>(s[0][1], a, even1, odd1);
    }
  }
}

// -- O += P V of a 16-key e4m3 tile. ldmatrix.trans of 16-bit elements reads V's bytes
//    in pairs: a lane gets dims 2g, 2g + 1 of keys 2t, 2t + 1 (keys 0-7) and of keys
//    2t + 8, 2t + 9 (keys 8-15); a byte permute makes the fragment of dim 2g and that of
//    dim 2g + 1. Output tile 2c holds the even dims of the 16-dim chunk c, tile 2c + 1
//    the odd ones --
template <int kDtype, int kHeadDim, int kDTiles>
__device__ __forceinline__ void gemm_pv_e4m3(float (&o)[1][kDTiles][4], const float (&p)[1][2][4],
                                             u32 v_tile, int lane) {
  u32 a[4];
  a[0] = pack2<kDtype>(p[0][0][0], p[0][0][1]);
  a[1] = pack2<kDtype>(p[0][0][2], p[0][0][3]);
  a[2] = pack2<kDtype>(p[0][1][0], p[0][1][1]);
  a[3] = pack2<kDtype>(p[0][1][2], p[0][1][3]);
  const u32 v_lane = v_tile + E4m3Tile<kHeadDim>::offset((lane & 7) + (((lane >> 3) & 1) << 3),
                                                         lane >> 4);
#pragma unroll
  for (int cp = 0; cp < kHeadDim / 32; ++cp) {
    u32 b[4];  // chunk 2cp keys 0-7, keys 8-15, then chunk 2cp + 1's
    ldmatrix_x4_trans(b, v_lane + cp * 32);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = 2 * cp + h;
      u32 even, odd;
      e4m3x4_to_pairs<kDtype>(__byte_perm(b[2 * h], b[2 * h + 1], 0x6240), even, odd);
      mma_16816<kDtype>(o[0][2 * c], a, even, odd);
      e4m3x4_to_pairs<kDtype>(__byte_perm(b[2 * h], b[2 * h + 1], 0x7351), even, odd);
      mma_16816<kDtype>(o[0][2 * c + 1], a, even, odd);
    }
  }
}

}  // namespace cufa
