#pragma once
// The Hopper forward's consumer warpgroups: per key block S = Q K^T and O += P V on
// wgmma, the online softmax between, software-pipelined; then the epilogue.
#include "sm90_smem.cuh"
#include "sm90_epilogue.cuh"
#include "sm90_trace.cuh"
#include "score.cuh"
#include "../common/e4m3_mma.cuh"
#include "../common/softmax.cuh"
#include "../common/wgmma_ops.cuh"

namespace cufa {

// Two consumers take turns issuing; three (192-row tiles at d = 64) issue freely.
template <int kBlockM> constexpr bool kTurns = kConsumers<kBlockM> == 2;
constexpr int kTurnBarrier = 1;        // named barriers 1, 2: consumer 0's turn, consumer 1's
constexpr int kKReadBarrier = 3;       // consumer 1 has read a tile's last K stage (kStageOInK)
constexpr int kWarpgroupBarrier = 4;   // 4, 5: one consumer's warps (kStageOInK)

// -- turns: consumer c issues its products between take_turn (a sync on barrier 1 + c)
//    and pass_turn (an arrive on the other's), so the two never issue at once and each
//    one's softmax overlaps the other's products. Consumer 1 passes once before its
//    first turn, so consumer 0 goes first, and then after every turn, its last of a tile
//    included: consumer 0 starts the next tile while 1 writes its output. Consumer 0
//    takes one turn more at the end to balance the barrier --
__device__ __forceinline__ void take_turn(int consumer) {
  named_barrier_sync(kTurnBarrier + consumer, 256);
}
__device__ __forceinline__ void pass_turn(int consumer) {
  named_barrier_arrive(kTurnBarrier + 1 - consumer, 256);
}

// -- lazy max (OnlineSoftmax::update_lazy) from d = 128: O's rescale is then skipped by
//    most blocks, and it is 64 (d = 128) to 128 (d = 256) multiplies a thread a block --
template <int kHeadDim>
constexpr bool kLazyRescale = kHeadDim >= 128;

// -- a row's block max and sum as two chains up to d = 128 (+1-4 % there); at d = 256 they
//    measured up to 4 % slower on short causal rows --
template <int kHeadDim>
constexpr int kSoftmaxChains = kHeadDim <= 128 ? 2 : 1;

// -- the first block a tile takes is its last: where no row of the tile sees its upper
//    half (every other tile of a causal sequence on 64-row tiles and 128-key blocks, or
//    a sequence ending there), only the lower half's Q K^T and exponentials are
//    computed. At d = 64 the exponentials bound the loop, and on short causal rows such
//    blocks are a fifth of all (N = 512: 4 of 20). (Not on 192-row tiles: ptxas spills.) --
template <int kBlockM, int kBlockN, bool kScoreMods, bool kE4m3 = false>
constexpr bool kHalfFirstBlock = kBlockN == 128 && kBlockM <= 128 && !kScoreMods && !kE4m3;

// -- where one Q stage is all that fits beside two K/V stages (d = 256 on 128 x 80), O is
//    staged through the tile's last K stage, not through Q: Q is then released at its
//    last Q K^T and the next tile's Q loads under this tile's last P V and epilogue.
//    Staged through Q, consumer 0 waited ~3,000 cycles a tile for it, 11 % of a 1k
//    launch (bench/results/tile_timeline_h200.md). A consumer's 64 rows go out in two
//    passes of 128 columns (16 KB of the stage each). The K stage is released after the
//    epilogue; consumer 0 writes only once consumer 1's last Q K^T has read it --
// (Two consumers, neither ever solo: consumer 0 waits for consumer 1's signal every tile.)
template <class Smem>
constexpr bool kStageOInK = kStagedOutput<Smem::kHeadDim> && !Smem::kE4m3 && !Smem::kOwnHeadDimV &&
                            Smem::kQStages == 1 && Smem::kStages > 1 &&
                            kConsumers<Smem::kBlockM> == 2;
constexpr int kStageOInKBytes = 64 * 128 * 2;  // a consumer's rows, 128 columns

// -- S = Q K^T of one K stage, issued and committed: the first 8 * kTiles keys from
//    k_stage_desc (all of the block's, or half: kHalfFirstBlock) --
template <int kDtype, int kHeadDim, int kBlockM, int kBlockN, int kTiles>
__device__ __forceinline__ void issue_qk_keys(float (&acc)[1][kTiles][4], u64 q_stage_desc,
                                              u64 k_stage_desc) {
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks)
    wgmma_ss<kDtype>(acc, desc_add(q_stage_desc, kstep_offset(ks, kBlockM)),
                     desc_add(k_stage_desc, kstep_offset(ks, kBlockN)), ks > 0);
  wgmma_commit();
}

// -- the fp8 forward's S = Q K^T: e4m3 Q and K, 32 bytes (k32) a step, 4 steps a panel --
template <int kHeadDim, int kBlockM, int kBlockN>
__device__ __forceinline__ void issue_qk_keys_e4m3(float (&acc)[1][kBlockN / 8][4],
                                                   u64 q_stage_desc, u64 k_stage_desc) {
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 32; ++ks)
    wgmma_ss_e4m3(acc, desc_add(q_stage_desc, kstep_offset(ks, kBlockM)),
                  desc_add(k_stage_desc, kstep_offset(ks, kBlockN)), ks > 0);
  wgmma_commit();
}

// -- P as the e4m3 A operand of O += P V^T: k-step kk (32 keys) takes score tiles
//    4kk..4kk+3, a lane's k-indices 4t..4t+3 and 16+4t..16+4t+3 (t = lane % 4) holding keys
//    2t, 2t+1, 8+2t, 9+2t of two tiles each (V^T's keys are in that order: cufa/_fp8.py's
//    vt_key_of). The probabilities come out of the exponentials times 2^kE4m3ProbLog2
//    (OnlineSoftmax's kProbLog2, with the exact max: no lazy slack), so P <= 256 stays
//    under e4m3's 448 and small P keep normal exponents (down to 2^-14 instead of 2^-6),
//    at no multiply a probability --
constexpr int kE4m3ProbLog2 = 8;
__device__ __forceinline__ u32 e4m3x4(float a, float b, float c, float d) {
  unsigned short lo, hi;  // (cvt's first operand goes to the upper byte)
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(b), "f"(a));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(d), "f"(c));
  return static_cast<u32>(lo) | (static_cast<u32>(hi) << 16);
}
template <int kNTiles>
__device__ __forceinline__ void pack_p_e4m3(u32 (&a)[kNTiles / 4][4], const float (&s)[1][kNTiles][4]) {
#pragma unroll
  for (int kk = 0; kk < kNTiles / 4; ++kk) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float(&lo)[4] = s[0][4 * kk + 2 * half];
      const float(&hi)[4] = s[0][4 * kk + 2 * half + 1];
      a[kk][2 * half] = e4m3x4(lo[0], lo[1], hi[0], hi[1]);      // row r
      a[kk][2 * half + 1] = e4m3x4(lo[2], lo[3], hi[2], hi[3]);  // row r + 8
    }
  }
}

// -- scores of the block at key0 -> probabilities, in place, over its first 8 * kTiles
//    keys: score mods, the mask where the block needs it, the online softmax's update and
//    the factor O must be rescaled by. Returns whether O needs rescaling (under a lazy max
//    most blocks do not) --
template <int kMask, bool kScoreMods, bool kLazy, bool kBounds32, int kTiles, class Softmax>
__device__ __forceinline__ bool scores_to_probs_keys(float (&acc)[1][kTiles][4], const FwdParams& p,
                                                     const Tile& t, const TileMods& mods,
                                                     const Sm90Work& w, int row_base, int key0,
                                                     int lane, float scale_log2, Softmax& softmax,
                                                     float (&correction)[1][2]) {
  if (kScoreMods)
    apply_score_mods(acc, p, t, mods, row_base, key0, lane);
  if (block_needs_mask<kMask>(p, t, w.row0, w.row_end, key0, key0 + 8 * kTiles))
    apply_mask<kMask, 1, kTiles, kBounds32>(acc, p, t, row_base, key0, lane);
  bool rescale = true;
  if constexpr (kLazy)
    rescale = softmax.update_lazy(acc, scale_log2, correction);
  else
    softmax.update(acc, scale_log2, correction);
  fence_registers(acc);
  return rescale;
}

// -- a K or V stage is released by one thread a consumer warpgroup (as FA3's and cuDNN's
//    consumers do; an arrival from all 128 measured slower on short causal rows, docs/decisions.md
//    step 42): the warpgroup's wgmma has read it once any of its threads has waited for it --
__device__ __forceinline__ void release_stage(u32 bar) {
  if (threadIdx.x % 128 == 0) mbar_arrive(bar);
}

// -- a consumer with no rows in a tile still owes its arrivals on the tile's K/V
//    stages: on each once it is full (so it never runs a phase ahead of the other) --
template <class Smem>
__device__ __forceinline__ void release_blocks(const Smem& sm, int n_blocks, int& block_count) {
  for (int g = block_count; g < block_count + n_blocks; ++g) {
    const u32 stage = Smem::stage(g), parity = Smem::parity(g);
    mbar_wait(sm.k_full() + 8 * stage, parity);
    release_stage(sm.k_empty() + 8 * stage);
    mbar_wait(sm.v_full() + 8 * stage, parity);
    release_stage(sm.v_empty() + 8 * stage);
  }
  block_count += n_blocks;
}

// -- a tile's end: O / l and lse written (from d = 128 staged through the tile's Q stage,
//    which is then released, or through its last K stage, k_last: kStageOInK) --
template <int kDtype, class Smem, int kDTiles, class Softmax>
__device__ __forceinline__ void finish_tile(float (&acc_o)[1][kDTiles][4], Softmax& softmax,
                                            float scale_log2, const FwdParams& p, const Tile& t,
                                            const Smem& sm, u32 q_stage, int k_last, int consumer,
                                            int row0, int row_base, int lane, int v_col0) {
  float lse[1][2];
  softmax.finalize(acc_o, lse, scale_log2, load_sink(p.learnable_sink, p.sink_dtype, t.h));
  const TilePointers ptr = tile_pointers(p, t);
  if constexpr (kStageOInK<Smem>) {
    // (k_last < 0: a tile without key blocks, whose Q stage is still held: staged there)
    const bool in_k = k_last >= 0;
    if (in_k && consumer == 0) named_barrier_sync(kKReadBarrier, 256);
    const u32 area = (in_k ? sm.k() + k_last * Smem::kKVBytes : sm.q + q_stage * Smem::kQBytes) +
                     consumer * kStageOInKBytes;
    write_output_staged<kDtype, 64, 128, Smem::kHeadDim>(acc_o, lse, p, t.seqlen_q, p.head_dim,
                                                         ptr.o, ptr.lse, area,
                                                         row_base - row0 - 64 * consumer, row_base,
                                                         lane);
    // The stage's next K or Q comes by TMA (the async proxy) over what this warpgroup
    // just wrote and read through the generic one.
    fence_proxy_async();
    if (in_k) {
      named_barrier_sync(kWarpgroupBarrier + consumer, 128);
      release_stage(sm.k_empty() + 8 * k_last);
    } else {
      mbar_arrive(sm.q_empty() + 8 * q_stage);
    }
  } else if constexpr (kStagedOutput<Smem::kHeadDimV> && !Smem::kE4m3) {  // (an e4m3 Q stage is half O's tile)
    if constexpr (Smem::kColumnHalves) {  // this CTA's half of O; the first half's writes lse
      store_rows_staged<kDtype, Smem::kBlockM, Smem::kHeadDimV, Smem::kHeadDimV>(
          acc_o, ptr.o + v_col0, p.o_row_stride, t.seqlen_q, head_dim_v<Smem>(p) - v_col0,
          sm.q + q_stage * Smem::kQBytes, row_base - row0, row_base, lane);
      if (p.lse && v_col0 == 0) write_lse(lse, t.seqlen_q, ptr.lse, row_base, lane);
    } else {
      write_output_staged<kDtype, Smem::kBlockM, Smem::kHeadDimV, Smem::kHeadDimV>(
          acc_o, lse, p, t.seqlen_q, head_dim_v<Smem>(p), ptr.o, ptr.lse,
          sm.q + q_stage * Smem::kQBytes, row_base - row0, row_base, lane);
    }
    // The stage's next Q comes by TMA (the async proxy) over what this warp just wrote
    // and read through the generic one.
    fence_proxy_async();
    mbar_arrive(sm.q_empty() + 8 * q_stage);
  } else {
    write_output_direct<kDtype>(acc_o, lse, p, t.seqlen_q, head_dim_v<Smem>(p), ptr.o, ptr.lse,
                                row_base, lane);
  }
}

// -- one turn: the products `issue` queues, between the other consumer's turns (solo: a
//    consumer with the tile to itself issues without them) --
template <typename Issue>
__device__ __forceinline__ void in_turn(bool solo, int consumer, const Issue& issue) {
  if (!solo) take_turn(consumer);
  wgmma_fence();
  issue();
  if (!solo) pass_turn(consumer);
}

// -- the lower and upper half of a block's S accumulators (its first and last 4 * kTiles
//    keys) --
template <int kTiles>
__device__ __forceinline__ float (&lower_keys(float (&acc)[1][kTiles][4]))[1][kTiles / 2][4] {
  return *reinterpret_cast<float(*)[1][kTiles / 2][4]>(&acc);
}
template <int kTiles>
__device__ __forceinline__ float (&upper_keys(float (&acc)[1][kTiles][4]))[1][kTiles / 2][4] {
  return *reinterpret_cast<float(*)[1][kTiles / 2][4]>(&acc[0][kTiles / 2][0]);
}

// -- the fp8 forward's descales of a tile's (sequence, KV head): float32 (batch,
//    nheads_k) arrays through their strides, 1 where absent (cache_descale) --
__device__ __forceinline__ float fp8_qk_descale(const FwdParams& p, const Tile& t) {
  return cache_descale(p.q_descale, p.q_descale_batch_stride, p.q_descale_head_stride, t.b, t.h_k) *
         cache_descale(p.k_descale, p.k_descale_batch_stride, p.k_descale_head_stride, t.b, t.h_k);
}
__device__ __forceinline__ float fp8_v_descale(const FwdParams& p, const Tile& t) {
  return cache_descale(p.v_descale, p.v_descale_batch_stride, p.v_descale_head_stride, t.b, t.h_k);
}
template <int kDTiles>
__device__ __forceinline__ void scale_output(float (&o)[1][kDTiles][4], float factor) {
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[0][dt][e] *= factor;
}

// -- a consumer warpgroup: 64 rows of every tile --
template <int kDtype, int kMask, bool kScoreMods, bool kHoldPVWait, class Smem>
__device__ __forceinline__ void consume(const FwdParams& p, const Smem& sm, int consumer) {
  constexpr int kBlockM = Smem::kBlockM, kHeadDim = Smem::kHeadDim, kBlockN = Smem::kBlockN;
  constexpr int kNTiles = kBlockN / 8;
  constexpr int kDTiles = Smem::kHeadDimV / 8;  // O's column tiles
  // fp8 (kE4m3): e4m3 products, P * 2^kE4m3ProbLog2 in e4m3 registers (a k32 step holds
  // 32 keys, so half the 16-bit P's registers); the max exact (update_lazy without slack:
  // O rescaled only where a row's max rose), O written from registers
  constexpr bool kE4m3 = Smem::kE4m3;
  constexpr bool kLazy = kLazyRescale<kHeadDim> || kE4m3;
  constexpr bool kStagedO = kStagedOutput<Smem::kHeadDimV> && !kE4m3;
  constexpr bool kOInK = kStageOInK<Smem>;
  static_assert(!kOInK || (kHeadDim == 256 && Smem::kKVBytes >= 2 * kStageOInKBytes),
                "both consumers' rows, 128 columns, in a K stage; no solo tiles (d = 256)");
  constexpr bool kQFreeAtLastQK = !kStagedO || kOInK;  // else after the epilogue
  constexpr bool kHalfFirst = kHalfFirstBlock<kBlockM, kBlockN, kScoreMods, kE4m3>;
  constexpr int kPSteps = kE4m3 ? kNTiles / 4 : kNTiles / 2;
  const int lane = threadIdx.x % 32;
  const float scale_log2 = kScoreMods ? 1.f : p.scale_log2;  // score mods leave log2 units
  // K-major Q and K: 8-row groups 1024 bytes apart; 16 columns (32 bytes) per k-step
  // inside a panel. MN-major V: 64-column panels kBlockN * 128 bytes apart, 8-key
  // groups 1024 bytes apart; 16 keys (2048 bytes) per k-step. (fp8: V^T K-major as K,
  // 32 keys a k-step.)
  const u64 q_desc = smem_desc(sm.q + consumer * 64 * 128, 16, 1024);
  const u64 k_desc = smem_desc(sm.k(), 16, 1024);
  const u64 v_desc = kE4m3 ? smem_desc(sm.v(), 16, 1024) : smem_desc(sm.v(), kBlockN * 128, 1024);
  constexpr u32 kStageStep = Smem::kKVBytes >> 4, kVStageStep = Smem::kVBytes >> 4;

  int block_count = 0;
  bool took_turns = false;
  for (int tile_count = 0;; ++tile_count) {
    const u32 q_stage = Smem::q_stage(tile_count);
    const u64 wait_start = trace_clock();
    mbar_wait(sm.q_full() + 8 * q_stage, Smem::q_parity(tile_count));
    Tile t;
    if (!load_tile(sm.tile() + 32 * q_stage, p, t)) break;
    const int v_col0 = split_half<Smem>(t);  // (column halves: this CTA's half of V and O)
    Sm90Work w = sm90_work<kBlockM, kMask, kBlockN>(p, t);
    // The key-block count drives the stage indices and so every wgmma descriptor. Read
    // from shared memory, ptxas cannot tell it is the same across the warp; broadcast
    // from lane 0, it is, and the descriptors stay in uniform registers (no R2UR moves
    // and vector adds before each wgmma).
    w.n_blocks = __shfl_sync(0xffffffffu, w.n_blocks, 0);
    // A tile whose rows all fall to consumer 0 (a sequence's last 64 or fewer): consumer
    // 1 only releases its stages, and consumer 0 issues without taking turns. (Not at
    // head dim 256: with the extra branch ptxas spills there; kStageOInK relies on it.)
    const bool solo = !kTurns<kBlockM> || (kHeadDim < 256 && w.row0 + 64 >= w.row_end);
    // A consumer whose 64 rows lie past the tile's end only releases the stages.
    const bool idle = kTurns<kBlockM> ? solo && consumer == 1 : w.row0 + 64 * consumer >= w.row_end;
    if (idle) {
      mbar_arrive(sm.q_empty() + 8 * q_stage);
      release_blocks(sm, w.n_blocks, block_count);
      continue;
    }
    if (consumer == 0) {
      trace_tile(tile_count, kTraceWait, wait_start);
      trace_tile(tile_count, kTraceQReady, trace_clock());
      trace_tile(tile_count, kTraceNsReady, trace_ns());
      trace_tile(tile_count, kTraceHeadBlock, (static_cast<u64>(t.h) << 32) | t.m_block);
      trace_tile(tile_count, kTraceBatchBlocks, (static_cast<u64>(t.b) << 32) | w.n_blocks);
    }
    const int row_base = w.row0 + consumer * 64 + ((threadIdx.x / 32) % 4) * 16;  // this warp's rows
    // (fp8: the scores are q_descale * k_descale times the e4m3 product)
    const float tile_scale_log2 = kE4m3 ? scale_log2 * fp8_qk_descale(p, t) : scale_log2;
    float acc_o[1][kDTiles][4];
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[0][dt][e] = 0.f;
    OnlineSoftmax<1, kSoftmaxChains<kHeadDim>, kE4m3 ? kE4m3ProbLog2 : 0> softmax;
    softmax.init();

    if (w.n_blocks > 0) {
      const TileMods mods = tile_mods<kScoreMods>(p, t);
      const int n_blocks = w.n_blocks;
      const u64 q_stage_desc = desc_add(q_desc, q_stage * (Smem::kQBytes >> 4));
      auto issue_qk = [&](float (&acc_s)[1][kNTiles][4], u32 stage) {
        if constexpr (kE4m3)
          issue_qk_keys_e4m3<kHeadDim, kBlockM, kBlockN>(acc_s, q_stage_desc,
                                                         desc_add(k_desc, stage * kStageStep));
        else
          issue_qk_keys<kDtype, kHeadDim, kBlockM, kBlockN>(acc_s, q_stage_desc,
                                                            desc_add(k_desc, stage * kStageStep));
      };
      // Block 0's S: the lower half's keys always, the upper half's only where a row sees
      // them. (Choosing between the whole block's product and the lower half's, each on
      // its branch, left ptxas short of registers for the wgmma pipeline at d = 128 on
      // 128 rows and d = 64 on 64: it serialized every product of those kernels, 15-20 %
      // on short rows; ptxas says C7511, which test_compile fails on.)
      auto issue_first_qk = [&](float (&acc_s)[1][kNTiles][4], u32 stage, bool half) {
        if constexpr (kHalfFirst) {
          const u64 k_stage_desc = desc_add(k_desc, stage * kStageStep);
          issue_qk_keys<kDtype, kHeadDim, kBlockM, kBlockN>(lower_keys(acc_s), q_stage_desc,
                                                            k_stage_desc);
          if (!half)  // (64 rows of a K-major panel lie 64 * 128 bytes on)
            issue_qk_keys<kDtype, kHeadDim, kBlockM, kBlockN>(
                upper_keys(acc_s), q_stage_desc, desc_add(k_stage_desc, (kBlockN / 2) * 128 >> 4));
        } else {
          issue_qk(acc_s, stage);
        }
      };
      u32 p_prev[kPSteps][4];
      auto issue_pv = [&](u32 stage) {
        const u64 v_stage_desc = desc_add(v_desc, stage * kVStageStep);
#pragma unroll
        for (int kk = 0; kk < kPSteps; ++kk) {
          if constexpr (kE4m3)
            wgmma_rs_e4m3(acc_o, p_prev[kk], desc_add(v_stage_desc, kstep_offset(kk, kHeadDim)), 1);
          else
            wgmma_rs<kDtype>(acc_o, p_prev[kk], desc_add(v_stage_desc, mn_kstep_offset(kk)), 1);
        }
        wgmma_commit();
      };
      auto pack = [&](const float (&acc_s)[1][kNTiles][4]) {
        if constexpr (kE4m3)
          pack_p_e4m3(p_prev, acc_s);
        else
          pack_p<kDtype>(p_prev, acc_s);
      };
      // Scores of block `it` -> probabilities (in place), and the factor O must be
      // rescaled by; then, once the previous P V is complete, O rescaled and P packed as
      // the A operand of this block's product.
      auto scores_to_probs = [&](float (&acc_s)[1][kNTiles][4], int it, float (&correction)[1][2]) {
        return scores_to_probs_keys<kMask, kScoreMods, kLazy, kE4m3>(
            acc_s, p, t, mods, w, row_base, (w.n_block_max - 1 - it) * kBlockN, lane,
            tile_scale_log2, softmax, correction);
      };
      auto rescale_and_pack = [&](const float (&acc_s)[1][kNTiles][4], const float (&correction)[1][2],
                                  bool rescale) {
        if (rescale) softmax.rescale_output(acc_o, correction);
        pack(acc_s);
      };
      // Block 0's probabilities where no row sees its upper half: the lower half's, and
      // P = 0 for the upper half's keys.
      auto half_block_scores_to_probs = [&](float (&acc_s)[1][kNTiles][4],
                                            float (&correction)[1][2]) {
        if constexpr (kHalfFirst) {
          scores_to_probs_keys<kMask, kScoreMods, kLazy, kE4m3>(
              lower_keys(acc_s), p, t, mods, w, row_base, (w.n_block_max - 1) * kBlockN, lane,
              tile_scale_log2, softmax, correction);
#pragma unroll
          for (int nt = kNTiles / 2; nt < kNTiles; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_s[0][nt][e] = 0.f;
        }
      };
      if (!solo && !took_turns) {
        if (consumer == 1) pass_turn(consumer);  // consumer 0 goes first
        took_turns = true;
      }

      if constexpr (Smem::kStages == 1) {
        // One K and one V buffer (d = 256 on 128-key blocks, as cuDNN's kernel): each
        // product is waited for where it is issued, so no scores are in flight beside P
        // and O (64 + 32 + 128 registers a thread would not fit); the other consumer's
        // products fill the matrix units meanwhile, and the producer loads K_{j+1} under
        // this block's softmax and P V.
        for (int it = 0; it < n_blocks; ++it) {
          const int g = block_count + it;
          float acc_s[1][kNTiles][4];
          mbar_wait(sm.k_full(), Smem::parity(g));
          in_turn(solo, consumer, [&] { issue_qk(acc_s, 0); });
          wgmma_wait<0>();
          fence_registers(acc_s);
          release_stage(sm.k_empty());
          if (!kStagedO && it == n_blocks - 1) mbar_arrive(sm.q_empty() + 8 * q_stage);
          float correction[1][2];
          const bool rescale = scores_to_probs(acc_s, it, correction);
          if (it > 0 && rescale) softmax.rescale_output(acc_o, correction);
          pack(acc_s);
          if (consumer == 0 && it == 0) trace_tile(tile_count, kTraceFirstP, trace_clock());
          mbar_wait(sm.v_full(), Smem::parity(g));
          in_turn(solo, consumer, [&] { issue_pv(0); });
          wgmma_wait<0>();
          fence_registers(acc_o);
          release_stage(sm.v_empty());
        }
      } else {
        // Block 0: S only, and where no row of the tile sees the block's upper half
        // (kHalfFirstBlock), only its lower half's S and exponentials. A scope, not a
        // lambda: as a lambda of its own or as a first step of `step` below, ptxas
        // serializes every wgmma of the kHalfFirstBlock kernels (d = 128, 128 rows: 40
        // warpgroup arrives instead of 4).
        {
          const u32 stage = Smem::stage(block_count);
          // (broadcast from lane 0, so that ptxas sees a uniform branch)
          const bool half = kHalfFirst &&
                            __shfl_sync(0xffffffffu, 2 * w.last_block_keys <= kBlockN, 0);
          float acc_s[1][kNTiles][4];
          mbar_wait(sm.k_full() + 8 * stage, Smem::parity(block_count));
          in_turn(solo, consumer, [&] { issue_first_qk(acc_s, stage, half); });
          wgmma_wait<0>();
          fence_registers(acc_s);
          if (!kOInK || n_blocks > 1) release_stage(sm.k_empty() + 8 * stage);
          if (kQFreeAtLastQK && n_blocks == 1) {
            mbar_arrive(sm.q_empty() + 8 * q_stage);  // Q's last reader is done
            if (kOInK && consumer == 1) named_barrier_arrive(kKReadBarrier, 256);
          }
          float correction[1][2];
          if (half)
            half_block_scores_to_probs(acc_s, correction);
          else
            scores_to_probs(acc_s, 0, correction);
          // O is still zero: rescaling it would be 0 * correction, which the compiler must
          // keep (inf and NaN), ~100 instructions a tile at d = 128
          pack(acc_s);
          if (consumer == 0) trace_tile(tile_count, kTraceFirstP, trace_clock());
        }
        // Then step `it` issues S_it = Q K_it^T and O += P_{it-1} V_{it-1} together and
        // computes the exponentials of S_it while the P V product runs; the last step
        // (it = n_blocks, `last`, a constant where the step is inlined) has only the P V.
        // It is peeled, as block 0 is, so that every product in the loop is issued
        // unconditionally (a branch around an in-flight wgmma makes ptxas serialize them
        // all). (Not a generic lambda with `last` a template flag: NVRTC compiles no
        // generic lambda in device code.)
        auto step = [&](bool last, int it) {
          const int g = block_count + it;
          const u32 stage = Smem::stage(g), prev_stage = Smem::stage(g - 1);
          float acc_s[1][kNTiles][4];
          if (!last) mbar_wait(sm.k_full() + 8 * stage, Smem::parity(g));
          mbar_wait(sm.v_full() + 8 * prev_stage, Smem::parity(g - 1));
          if (!solo) take_turn(consumer);
          wgmma_fence();
          if (!last) issue_qk(acc_s, stage);
          issue_pv(prev_stage);
          if (!solo) pass_turn(consumer);
          float correction[1][2];
          bool rescale = false;
          if (!last) {
            wgmma_wait<1>();
            fence_registers(acc_s);
            if (!kOInK || it < n_blocks - 1) release_stage(sm.k_empty() + 8 * stage);
            if (kQFreeAtLastQK && it == n_blocks - 1) {
              mbar_arrive(sm.q_empty() + 8 * q_stage);  // Q's last reader is done
              if (kOInK && consumer == 1) named_barrier_arrive(kKReadBarrier, 256);
            }
            rescale = scores_to_probs(acc_s, it, correction);
            if constexpr (kHoldPVWait)  // the exponentials under this warpgroup's own P V
              hold_wait_below(softmax.row_sum[0][0], softmax.row_sum[0][1], sm.tile());
          }
          wgmma_wait<0>();
          fence_registers(acc_o);
          // (P is packed only after the P V wait: the registers of the previous P feed the
          // product until it completes, and ptxas does not see that they are still in use.)
          if (!last) fence_registers(p_prev);
          release_stage(sm.v_empty() + 8 * prev_stage);
          if (!last) rescale_and_pack(acc_s, correction, rescale);
        };
        for (int it = 1; it < n_blocks; ++it) step(false, it);
        step(true, n_blocks);
      }
      block_count += n_blocks;
    } else if (!kStagedO) {
      mbar_arrive(sm.q_empty() + 8 * q_stage);  // rows without keys: only the tile was read
    }

    if (consumer == 0) trace_tile(tile_count, kTraceLoopEnd, trace_clock());
    if constexpr (kE4m3)  // (V's descale is O's)
      scale_output(acc_o, fp8_v_descale(p, t));
    const int k_last = w.n_blocks > 0 ? static_cast<int>(Smem::stage(block_count - 1)) : -1;
    finish_tile<kDtype>(acc_o, softmax, tile_scale_log2, p, t, sm, q_stage, k_last, consumer,
                        w.row0, row_base, lane, v_col0);
    trace_tile(tile_count, consumer == 0 ? kTraceEnd0 : kTraceEnd1, trace_clock());
    if (consumer == 0) trace_tile(tile_count, kTraceNsEnd0, trace_ns());
  }
  if (consumer == 0 && took_turns) take_turn(consumer);  // consumer 1's pass after its last turn
}

}  // namespace cufa
