// Forward attention on Hopper's warpgroup MMA (sm_90a). Two warpgroups of 4 warps own
// 64 query rows each (a CTA owns 128 rows of one (batch, head)); both matrix products
// are wgmma: S = Q K^T with Q and K read from shared memory through descriptors, and
// O += P V with P straight from the S registers. K/V blocks stream through a two-stage
// cp.async ring: block j+1 loads while block j computes.
#include "common.cuh"
#include "params.cuh"
#include "block_info.cuh"
#include "mask.cuh"
#include "softmax.cuh"
#include "score.cuh"
#include "sm90.cuh"
#include "wgmma_ops.cuh"

namespace cufa {

constexpr int kSm90Threads = 256;
constexpr int kSm90BlockM = 128;

// -- load a tile into the panel layout: rows past `rows_valid`, columns past `head_dim` as zeros --
template <int kRows, int kHeadDim>
__device__ __forceinline__ void load_panels(u32 smem, const u16* gmem, i64 row_stride,
                                            int rows_valid, int head_dim) {
  copy_tile_async<kRows, kHeadDim, kSm90Threads>(smem, gmem, row_stride, rows_valid, head_dim,
                                                 [](int r, int c) { return panel_offset<kRows>(r, c); });
}

// -- P from the S accumulators into wgmma A fragments, 16 keys per fragment --
template <int kDtype, int kNTiles>
__device__ __forceinline__ void pack_p(u32 (&a)[kNTiles / 2][4], const float (&s)[1][kNTiles][4]) {
#pragma unroll
  for (int kk = 0; kk < kNTiles / 2; ++kk) {
    a[kk][0] = pack2<kDtype>(s[0][2 * kk][0], s[0][2 * kk][1]);
    a[kk][1] = pack2<kDtype>(s[0][2 * kk][2], s[0][2 * kk][3]);
    a[kk][2] = pack2<kDtype>(s[0][2 * kk + 1][0], s[0][2 * kk + 1][1]);
    a[kk][3] = pack2<kDtype>(s[0][2 * kk + 1][2], s[0][2 * kk + 1][3]);
  }
}

// -- epilogue: straight from registers; each quad writes 16 contiguous bytes of a row --
template <int kDtype, int kDTiles>
__device__ __forceinline__ void write_output_direct(const float (&o)[1][kDTiles][4],
                                                    const float (&lse)[1][2], const FwdParams& p,
                                                    int seqlen_q, u16* o_ptr, float* lse_ptr,
                                                    int row_base,
                                                    int lane) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = frag_row(row_base, 0, 2 * h, lane);
    if (row >= seqlen_q) continue;
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
      const int col = frag_col(0, dt, 0, lane);
      if (col < p.head_dim)
        *reinterpret_cast<u32*>(o_ptr + row * p.o_row_stride + col) =
            pack2<kDtype>(o[0][dt][2 * h], o[0][dt][2 * h + 1]);
    }
    if ((lane & 3) == 0) lse_ptr[row] = lse[0][h];
  }
}

template <int kDtype, int kHeadDim, int kMask, bool kScoreMods, int kBlockN>
__global__ void __launch_bounds__(kSm90Threads, 1) fwd_sm90_kernel(const FwdParams p) {
  constexpr int kBlockM = kSm90BlockM;
  constexpr int kNTiles = kBlockN / 8;
  constexpr int kDTiles = kHeadDim / 8;
  constexpr int kQBytes = kBlockM * kHeadDim * 2;
  constexpr int kKVBytes = kBlockN * kHeadDim * 2;
  static_assert(kHeadDim % 64 == 0 && kBlockN % 16 == 0, "whole 128-byte panels, 16-key steps");

  // Dynamic shared memory is only 16-byte aligned; the swizzle needs 1024.
  extern __shared__ unsigned char smem_raw[];
  const u32 smem = (smem_u32(smem_raw) + 1023) & ~1023u;
  // Q, then the two K/V stages: stage s of K at sk + s * kKVBytes, of V at sv + s * kKVBytes
  // (arithmetic, not arrays: a run-time index into an array would put it in local memory).
  const u32 sq = smem;
  const u32 sk = sq + kQBytes;
  const u32 sv = sk + 2 * kKVBytes;

  // -- which tile --
  Tile t;
  if (!get_tile(p, t)) return;
  const int row0 = t.m_block * kBlockM;
  const int row_end = min(row0 + kBlockM, t.seqlen_q);
  const int lane = threadIdx.x % 32;
  const int warpgroup = threadIdx.x / 128;
  const int row_base = row0 + warpgroup * 64 + ((threadIdx.x / 32) % 4) * 16;  // this warp's rows

  const TilePointers ptr = tile_pointers(p, t);
  const u16* q_ptr = ptr.q + row0 * p.q_row_stride;

  const TileMods mods = tile_mods<kScoreMods>(p, t);
  const float scale_log2 = kScoreMods ? 1.f : p.scale_log2;  // score mods leave log2 units

  float acc_o[1][kDTiles][4];
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_o[0][dt][e] = 0.f;
  OnlineSoftmax<1> softmax;
  softmax.init();

  const KeyRange keys = key_range<kMask>(p, t, row0, row_end);
  const int n_block_min = keys.begin / kBlockN;
  const int n_block_max = (keys.end + kBlockN - 1) / kBlockN;  // rows with no key skip the loop

  if (n_block_min < n_block_max) {
    // K-major Q and K: 8-row groups 1024 bytes apart; 16 columns (32 bytes) per k-step
    // inside a panel. MN-major V: 64-column panels kBlockN * 128 bytes apart, 8-key
    // groups 1024 bytes apart; 16 keys (2048 bytes) per k-step.
    const u64 q_desc = smem_desc(sq + warpgroup * 64 * 128, 16, 1024);
    const u64 k_desc = smem_desc(sk, 16, 1024);
    const u64 v_desc = smem_desc(sv, kBlockN * 128, 1024);
    auto kstep = [](int ks, int rows) {  // descriptor offset (16-byte units) of k-step ks
      return static_cast<u64>(((ks / 4) * rows * 128 + (ks % 4) * 32) >> 4);
    };
    constexpr u64 kStageStep = kKVBytes >> 4;
    // Block `it` of the loop is key block n_block_max - 1 - it, in stage it % 2.
    const int n_blocks = n_block_max - n_block_min;
    auto load_k = [&](int it) {
      const int key0 = (n_block_max - 1 - it) * kBlockN;
      load_panels<kBlockN, kHeadDim>(sk + (it & 1) * kKVBytes, ptr.k + key0 * p.k_row_stride,
                                     p.k_row_stride, t.seqlen_k - key0, p.head_dim);
      cp_async_commit();
    };
    auto load_v = [&](int it) {
      const int key0 = (n_block_max - 1 - it) * kBlockN;
      load_panels<kBlockN, kHeadDim>(sv + (it & 1) * kKVBytes, ptr.v + key0 * p.v_row_stride,
                                     p.v_row_stride, t.seqlen_k - key0, p.head_dim);
      cp_async_commit();
    };
    auto issue_pv = [&](const u32 (&pa)[kNTiles / 2][4], int it) {
#pragma unroll
      for (int kk = 0; kk < kNTiles / 2; ++kk)
        wgmma_rs<kDtype>(acc_o, pa[kk], v_desc + (it & 1) * kStageStep + (kk * 16 * 128 >> 4), 1);
      wgmma_commit();
    };

    // Software pipeline: iteration `it` issues S_it = Q K_it^T and O += P_{it-1} V_{it-1}
    // together, and computes the exponentials of S_it while the P V product runs. Copies
    // run one iteration ahead: the top of iteration `it` fetches K_{it+1} and V_it, into
    // stages whose last readers (S_{it-1}, P_{it-2} V_{it-2}) finished before the barrier.
    load_panels<kBlockM, kHeadDim>(sq, q_ptr, p.q_row_stride, t.seqlen_q - row0, p.head_dim);
    load_k(0);
    u32 p_prev[kNTiles / 2][4];
    for (int it = 0; it < n_blocks; ++it) {
      const int key0 = (n_block_max - 1 - it) * kBlockN;
      cp_async_wait<0>();
      fence_proxy_async();
      __syncthreads();  // K_it and V_{it-1} visible to all; every warp is past S_{it-1}, P V_{it-2}
      if (it + 1 < n_blocks) load_k(it + 1);
      load_v(it);

      // -- issue qk, and the previous block's P V --
      float acc_s[1][kNTiles][4];
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks)
        wgmma_ss<kDtype>(acc_s, q_desc + kstep(ks, kBlockM),
                         k_desc + (it & 1) * kStageStep + kstep(ks, kBlockN), ks > 0);
      wgmma_commit();
      if (it > 0) issue_pv(p_prev, it - 1);
      if (it > 0) wgmma_wait<1>(); else wgmma_wait<0>();
      fence_registers(acc_s);

      // -- score mods and mask, then softmax while P V runs --
      if (kScoreMods)
        apply_score_mods(acc_s, p, t, mods, row_base, key0, lane);
      if (block_needs_mask<kMask>(p, t, row0, row_end, key0, key0 + kBlockN))
        apply_mask<kMask>(acc_s, p, t, row_base, key0, lane);
      float correction[1][2];
      softmax.update(acc_s, scale_log2, correction);
      fence_registers(acc_s);

      // -- P V done: rescale O, keep P for the next iteration's product --
      // (P is packed only now: the registers of the previous P feed the product until
      // it completes, and ptxas does not see that they are still in use.)
      wgmma_wait<0>();
      fence_registers(acc_o);
      fence_registers(p_prev);
      softmax.rescale_output(acc_o, correction);
      pack_p<kDtype>(p_prev, acc_s);
    }
    // -- the last block's P V --
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    wgmma_fence();
    issue_pv(p_prev, n_blocks - 1);
    wgmma_wait<0>();
    fence_registers(acc_o);
  }

  float lse[1][2];
  softmax.finalize(acc_o, lse, scale_log2);
  write_output_direct<kDtype>(acc_o, lse, p, t.seqlen_q, ptr.o, ptr.lse, row_base, lane);
}

}  // namespace cufa
