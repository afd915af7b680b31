// Forward attention on Hopper (sm_90a), warp-specialized. A CTA owns 128 query rows of
// one (batch, head) and has three warpgroups: a producer that streams K/V blocks into a
// shared-memory ring (two or more stages) with cp.async, and two consumers of 64 rows each that
// run both products on wgmma (S = Q K^T from shared memory, O += P V with P from
// registers). Copies announce themselves on mbarriers, so the producer never waits for
// a copy, only for a stage to be released. The consumers take turns issuing their
// products (named barriers), so one's softmax runs under the other's matrix work.
#include "common.cuh"
#include "params.cuh"
#include "block_info.cuh"
#include "mask.cuh"
#include "softmax.cuh"
#include "score.cuh"
#include "sm90.cuh"
#include "wgmma_ops.cuh"

namespace cufa {

constexpr int kSm90Threads = 384;      // producer warpgroup, then two consumer warpgroups
constexpr int kSm90BlockM = 128;
#ifndef CUFA_PINGPONG
#define CUFA_PINGPONG 1  // consumers take turns issuing their products (0: experiments only)
#endif
constexpr int kProducerRegs = 24;      // 128 x 24 + 256 x 240 fits the 64K registers of an SM
constexpr int kConsumerRegs = 240;
constexpr int kTurnBarrier = 1;        // named barriers 1, 2: consumer 0's turn, consumer 1's
constexpr int kProducerBarrier = 3;    // the producer warpgroup alone

// -- turns: consumer c issues its products between take_turn (a sync on barrier 1 + c)
//    and pass_turn (an arrive on the other's), so the two never issue at once and each
//    one's softmax overlaps the other's products --
__device__ __forceinline__ void take_turn(int consumer) {
  if (CUFA_PINGPONG) named_barrier_sync(kTurnBarrier + consumer, 256);
}
__device__ __forceinline__ void pass_turn(int consumer) {
  if (CUFA_PINGPONG) named_barrier_arrive(kTurnBarrier + 1 - consumer, 256);
}

// -- the producer warpgroup loads a tile into the panel layout with cp.async: rows past
//    `rows_valid`, columns past `head_dim` as zeros --
template <int kRows, int kHeadDim>
__device__ __forceinline__ void load_panels(u32 smem, const u16* gmem, i64 row_stride,
                                            int rows_valid, int head_dim) {
  copy_tile_async<kRows, kHeadDim, 128>(smem, gmem, row_stride, rows_valid, head_dim,
                                        [](int r, int c) { return panel_offset<kRows>(r, c); });
}

// -- one thread loads a tile with TMA, one 64-column panel per copy: rows `row`.. of
//    head `head` (columns, rows, heads, batch map); past the tensor's ends come zeros --
template <int kRows, int kHeadDim>
__device__ __forceinline__ void tma_load_panels(u32 smem, const TensorMap& map, u32 bar, int row,
                                                int head, int batch) {
#pragma unroll
  for (int panel = 0; panel < kHeadDim / 64; ++panel)
    tma_load_4d(smem + panel * kRows * 128, map, bar, panel * 64, row, head, batch);
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

template <int kDtype, int kHeadDim, int kMask, bool kScoreMods, int kBlockN, int kStages>
__global__ void __launch_bounds__(kSm90Threads, 1)
    fwd_sm90_kernel(const __grid_constant__ FwdParams p, const __grid_constant__ TensorMaps maps) {
  constexpr int kBlockM = kSm90BlockM;
  constexpr int kNTiles = kBlockN / 8;
  constexpr int kDTiles = kHeadDim / 8;
  constexpr int kQBytes = kBlockM * kHeadDim * 2;
  constexpr int kKVBytes = kBlockN * kHeadDim * 2;
  static_assert(kHeadDim % 64 == 0 && kBlockN % 16 == 0, "whole 128-byte panels, 16-key steps");

  // Dynamic shared memory is only 16-byte aligned; the swizzle needs 1024.
  // Q, the K stages, the V stages (stage s at + s * kKVBytes: arithmetic, not arrays, since
  // a run-time index into an array would put it in local memory), then the mbarriers.
  extern __shared__ unsigned char smem_raw[];
  const u32 sq = (smem_u32(smem_raw) + 1023) & ~1023u;
  const u32 sk = sq + kQBytes;
  const u32 sv = sk + kStages * kKVBytes;
  const u32 q_full = sv + kStages * kKVBytes;  // 8 bytes each
  const u32 k_full = q_full + 8, v_full = k_full + 8 * kStages;
  const u32 k_empty = v_full + 8 * kStages, v_empty = k_empty + 8 * kStages;

  // -- which tile --
  Tile t;
  if (!get_tile(p, t)) return;
  const int row0 = t.m_block * kBlockM;
  const int row_end = min(row0 + kBlockM, t.seqlen_q);
  const TilePointers ptr = tile_pointers(p, t);
  const KeyRange keys = key_range<kMask>(p, t, row0, row_end);
  const int n_block_min = keys.begin / kBlockN;
  const int n_block_max = (keys.end + kBlockN - 1) / kBlockN;  // rows with no key skip the loop
  const int n_blocks = max(n_block_max - n_block_min, 0);
  // Block `it` of the loop is key block n_block_max - 1 - it, in stage it % kStages, whose
  // barriers are on their (it / kStages)-th phase.
  auto stage_of = [](int it) { return static_cast<u32>(it % kStages); };
  auto parity_of = [](int it) { return static_cast<u32>((it / kStages) & 1); };

  if (threadIdx.x == 0) {
    mbar_init(q_full, 1);  // the producer's one arrival, plus the bytes its copies bring
    for (int s = 0; s < kStages; ++s) {
      mbar_init(k_full + 8 * s, 1);
      mbar_init(v_full + 8 * s, 1);
      mbar_init(k_empty + 8 * s, 256);  // every consumer thread is done reading
      mbar_init(v_empty + 8 * s, 256);
    }
  }
  __syncthreads();

  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    // -- producer: Q once, then K and V of every block, each as soon as its stage is free.
    //    One thread issues TMA copies, which announce their bytes on the stage's barrier.
    //    A packed batch's last key block is the exception: the rows past the sequence
    //    belong to the next one, and a stray inf there would turn P = 0 into NaN, so the
    //    whole warpgroup copies it with cp.async, which fills those rows with zeros. --
    setmaxnreg_dec<kProducerRegs>();
    if (n_blocks == 0) return;
    const bool elected = threadIdx.x == 0;
    const bool packed = p.cu_seqlens_k != 0;
    const int batch_coord = packed ? 0 : t.b;
    if (elected) {
      mbar_arrive_expect_bytes(q_full, kQBytes);
      tma_load_panels<kBlockM, kHeadDim>(sq, maps.q, q_full, static_cast<int>(t.q_start) + row0,
                                         t.h, batch_coord);
    }
    for (int it = 0; it < n_blocks; ++it) {
      const int key0 = (n_block_max - 1 - it) * kBlockN;
      const u32 stage = stage_of(it);
      if (packed && key0 + kBlockN > t.seqlen_k) {
        if (it >= kStages) {
          mbar_wait(k_empty + 8 * stage, parity_of(it) ^ 1);
          mbar_wait(v_empty + 8 * stage, parity_of(it) ^ 1);
        }
        load_panels<kBlockN, kHeadDim>(sk + stage * kKVBytes, ptr.k + key0 * p.k_row_stride,
                                       p.k_row_stride, t.seqlen_k - key0, p.head_dim);
        load_panels<kBlockN, kHeadDim>(sv + stage * kKVBytes, ptr.v + key0 * p.v_row_stride,
                                       p.v_row_stride, t.seqlen_k - key0, p.head_dim);
        cp_async_wait_all();
        fence_proxy_async();  // generic-proxy writes, read by wgmma through the async proxy
        named_barrier_sync(kProducerBarrier, 128);
        if (elected) {
          mbar_arrive(k_full + 8 * stage);
          mbar_arrive(v_full + 8 * stage);
        }
        continue;
      }
      if (!elected) continue;
      const int row = static_cast<int>(t.k_start) + key0;
      if (it >= kStages) mbar_wait(k_empty + 8 * stage, parity_of(it) ^ 1);
      mbar_arrive_expect_bytes(k_full + 8 * stage, kKVBytes);
      tma_load_panels<kBlockN, kHeadDim>(sk + stage * kKVBytes, maps.k, k_full + 8 * stage, row,
                                         t.h_k, batch_coord);
      if (it >= kStages) mbar_wait(v_empty + 8 * stage, parity_of(it) ^ 1);
      mbar_arrive_expect_bytes(v_full + 8 * stage, kKVBytes);
      tma_load_panels<kBlockN, kHeadDim>(sv + stage * kKVBytes, maps.v, v_full + 8 * stage, row,
                                         t.h_k, batch_coord);
    }
    return;
  }

  // -- consumers --
  setmaxnreg_inc<kConsumerRegs>();
  const int consumer = warpgroup - 1;
  const int lane = threadIdx.x % 32;
  const int row_base = row0 + consumer * 64 + ((threadIdx.x / 32) % 4) * 16;  // this warp's rows
  const TileMods mods = tile_mods<kScoreMods>(p, t);
  const float scale_log2 = kScoreMods ? 1.f : p.scale_log2;  // score mods leave log2 units

  float acc_o[1][kDTiles][4];
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_o[0][dt][e] = 0.f;
  OnlineSoftmax<1> softmax;
  softmax.init();

  if (n_blocks > 0) {
    // K-major Q and K: 8-row groups 1024 bytes apart; 16 columns (32 bytes) per k-step
    // inside a panel. MN-major V: 64-column panels kBlockN * 128 bytes apart, 8-key
    // groups 1024 bytes apart; 16 keys (2048 bytes) per k-step.
    const u64 q_desc = smem_desc(sq + consumer * 64 * 128, 16, 1024);
    const u64 k_desc = smem_desc(sk, 16, 1024);
    const u64 v_desc = smem_desc(sv, kBlockN * 128, 1024);
    auto kstep = [](int ks, int rows) {  // descriptor offset (16-byte units) of k-step ks
      return static_cast<u64>(((ks / 4) * rows * 128 + (ks % 4) * 32) >> 4);
    };
    constexpr u64 kStageStep = kKVBytes >> 4;
    auto issue_pv = [&](const u32 (&pa)[kNTiles / 2][4], u32 stage) {
#pragma unroll
      for (int kk = 0; kk < kNTiles / 2; ++kk)
        wgmma_rs<kDtype>(acc_o, pa[kk], v_desc + stage * kStageStep + (kk * 16 * 128 >> 4), 1);
      wgmma_commit();
    };
    if (consumer == 1) pass_turn(consumer);  // consumer 0 goes first

    // Scores of block `it` -> probabilities (in place), and the factor O must be rescaled
    // by; then, once the previous P V is complete, O rescaled and P packed as the A
    // operand of this block's product.
    u32 p_prev[kNTiles / 2][4];
    auto scores_to_probs = [&](float (&acc_s)[1][kNTiles][4], int it, float (&correction)[1][2]) {
      const int key0 = (n_block_max - 1 - it) * kBlockN;
      if (kScoreMods)
        apply_score_mods(acc_s, p, t, mods, row_base, key0, lane);
      if (block_needs_mask<kMask>(p, t, row0, row_end, key0, key0 + kBlockN))
        apply_mask<kMask>(acc_s, p, t, row_base, key0, lane);
      softmax.update(acc_s, scale_log2, correction);
      fence_registers(acc_s);
    };
    auto rescale_and_pack = [&](const float (&acc_s)[1][kNTiles][4], const float (&correction)[1][2]) {
      softmax.rescale_output(acc_o, correction);
      pack_p<kDtype>(p_prev, acc_s);
    };
    auto issue_qk = [&](float (&acc_s)[1][kNTiles][4], u32 stage) {
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks)
        wgmma_ss<kDtype>(acc_s, q_desc + kstep(ks, kBlockM),
                         k_desc + stage * kStageStep + kstep(ks, kBlockN), ks > 0);
      wgmma_commit();
    };

    // Block 0: S only. Peeled, so that every product in the loop is issued
    // unconditionally: a branch around an in-flight wgmma makes ptxas serialize them all.
    mbar_wait(q_full, 0);
    mbar_wait(k_full, 0);
    {
      take_turn(consumer);
      float acc_s[1][kNTiles][4];
      wgmma_fence();
      issue_qk(acc_s, 0);
      pass_turn(consumer);
      wgmma_wait<0>();
      fence_registers(acc_s);
      mbar_arrive(k_empty);
      float correction[1][2];
      scores_to_probs(acc_s, 0, correction);
      rescale_and_pack(acc_s, correction);
    }
    // Software pipeline: iteration `it` issues S_it = Q K_it^T and O += P_{it-1} V_{it-1}
    // together, and computes the exponentials of S_it while the P V product runs.
    for (int it = 1; it < n_blocks; ++it) {
      const u32 stage = stage_of(it), prev_stage = stage_of(it - 1);
      mbar_wait(k_full + 8 * stage, parity_of(it));
      mbar_wait(v_full + 8 * prev_stage, parity_of(it - 1));

      take_turn(consumer);
      float acc_s[1][kNTiles][4];
      wgmma_fence();
      issue_qk(acc_s, stage);
      issue_pv(p_prev, prev_stage);
      pass_turn(consumer);
      wgmma_wait<1>();
      fence_registers(acc_s);
      mbar_arrive(k_empty + 8 * stage);
      // (P is packed only after the P V wait: the registers of the previous P feed the
      // product until it completes, and ptxas does not see that they are still in use.)
      float correction[1][2];
      scores_to_probs(acc_s, it, correction);
      wgmma_wait<0>();
      fence_registers(acc_o);
      fence_registers(p_prev);
      mbar_arrive(v_empty + 8 * prev_stage);
      rescale_and_pack(acc_s, correction);
    }
    // -- the last block's P V --
    const u32 last = stage_of(n_blocks - 1);
    mbar_wait(v_full + 8 * last, parity_of(n_blocks - 1));
    take_turn(consumer);
    wgmma_fence();
    issue_pv(p_prev, last);
    if (consumer == 0) pass_turn(consumer);  // consumer 1 has one turn left
    wgmma_wait<0>();
    fence_registers(acc_o);
  }

  float lse[1][2];
  softmax.finalize(acc_o, lse, scale_log2);
  write_output_direct<kDtype>(acc_o, lse, p, t.seqlen_q, ptr.o, ptr.lse, row_base, lane);
}

}  // namespace cufa
