// The backward's dq and dk, dv kernels on Hopper's tensor cores (wgmma, sm_90a): bwd_sm80.cu's
// kernels, their CTAs (a warpgroup every 64 rows of the products' M: one, or two on 128 query
// rows or keys that share what they stream) and schedules (the other side's blocks streamed
// into two buffers, or a producer warpgroup's ring; by TMA where the host gives maps
// (kTma), else cp.async), with the products issued by each warpgroup as a whole from
// 128-byte-swizzled panels:
//   dq:    S = Q K^T, dP = dout V^T (K-major B), dq += dS K (dS from registers, K MN-major)
//   dk,dv: S^T = K Q^T, dP^T = V dout^T (K-major B), dv += P^T dout, dk += dS^T Q (P^T, dS^T
//          from registers, dout and Q MN-major)
// The accumulators are laid out per warp as mma.sync's, so the scores' element-wise steps
// (mods, mask, exponentials, dS) are bwd_sm80.cu's.
#include "../common/softmax.cuh"
#include "../common/sm90.cuh"
#include "../common/wgmma_ops.cuh"
#include "common.cuh"

namespace cufa {

// -- a diagnostic build (CUFA_TRACE=1, cufa/_compile.py's debug_options): each dk/dv
//    CTA's start, the arrival of its first step (K, V and the first Q and dout), the end
//    of its loop and of its stores (a consumer's first thread), the producer's end (its
//    last sums sent and read) and its SM, on the global timer (ns), for
//    bench/profile/bwd_timeline.py. Without the flag the stamps compile to nothing --
//    (With a producer, also its thread 0 once its copies of the first step (lse and D,
//    the TMA of Q and dout; the consumers copy K and V) are issued and once its own
//    copies have landed.)
enum BwdTraceField : int {
  kBwdStart = 0, kBwdFirstStep, kBwdLoopEnd, kBwdStored, kBwdProducerEnd, kBwdIssued,
  kBwdLanded, kBwdSm
};
#ifdef CUFA_TRACE
constexpr int kBwdTraceCtas = 8192, kBwdTraceFields = 8;
extern "C" {
__device__ u64 cufa_bwd_trace[kBwdTraceCtas][kBwdTraceFields];
}
#endif
__device__ __forceinline__ void bwd_trace(bool stamps, BwdTraceField field) {
#ifdef CUFA_TRACE
  if (!stamps || blockIdx.x >= kBwdTraceCtas) return;
  u64 ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  cufa_bwd_trace[blockIdx.x][field] = ns;
  if (field == kBwdStart) {
    u32 sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    cufa_bwd_trace[blockIdx.x][kBwdSm] = sm;
  }
#endif
}

// A tile of kRows rows in 64-column panels (128-byte swizzle), the layout the descriptors
// below describe; rows past rows_valid and columns past head_dim become zeros. kThreads:
// the CTA's, which share the copy.
template <int kRows, int kHeadDim, int kThreads = kBwdThreads>
__device__ __forceinline__ void load_panels(u32 smem, const u16* gmem, i64 row_stride,
                                            int rows_valid, int head_dim) {
  copy_tile_async<kRows, kHeadDim, kThreads>(
      smem, gmem, row_stride, rows_valid, head_dim,
      [](int r, int c) { return panel_offset<kRows>(r, c); });
}

// The same by `thread` of kThreads (a consumer's index), for threads with registers to
// spare: where they cover whole rows a pass each keeps one chunk column, in an unrolled
// loop of independent copies.
template <int kRows, int kHeadDim, int kThreads>
__device__ __forceinline__ void load_panels_from(u32 smem, const u16* gmem, i64 row_stride,
                                                 int rows_valid, int head_dim, int thread) {
  constexpr int kChunks = kHeadDim / 8;
  if constexpr (kThreads % kChunks == 0 && kRows % (kThreads / kChunks) == 0) {
    constexpr int kRowStep = kThreads / kChunks;
    const int c = thread % kChunks, r0 = thread / kChunks;
    const bool column = c * 8 < head_dim;
#pragma unroll
    for (int i = 0; i < kRows / kRowStep; ++i) {
      const int r = r0 + i * kRowStep;
      const bool valid = column && r < rows_valid;
      cp_async_16(smem + panel_offset<kRows>(r, c), valid ? gmem + r * row_stride + c * 8 : gmem,
                  valid ? 16 : 0);
    }
  } else {
    copy_rows_async<kRows, kHeadDim, kThreads>(
        smem, [=](int r) { return gmem + r * row_stride; }, gmem, rows_valid, head_dim,
        [](int r, int c) { return panel_offset<kRows>(r, c); }, thread);
  }
}

// -- acc = A B^T over the head dim: A 64 rows (the warpgroup's M) of a K-major tile of
//    kRowsA rows (its panels' height), B one of kRowsB rows (N); one committed group --
template <int kDtype, int kHeadDim, int kRowsB, int kNTiles, int kRowsA = 64>
__device__ __forceinline__ void issue_scores(float (&acc)[1][kNTiles][4], u64 a_desc, u64 b_desc) {
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks)
    wgmma_ss<kDtype>(acc, desc_add(a_desc, kstep_offset(ks, kRowsA)),
                     desc_add(b_desc, kstep_offset(ks, kRowsB)), ks > 0);
  wgmma_commit();
}

// -- the same with A held in registers (the warp's fragments, every k-step:
//    load_a_frags) --
template <int kDtype, int kHeadDim, int kRowsB, int kNTiles>
__device__ __forceinline__ void issue_scores_held(float (&acc)[1][kNTiles][4],
                                                  const u32 (&a)[kHeadDim / 16][4], u64 b_desc) {
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks)
    wgmma_rs_k<kDtype>(acc, a[ks], desc_add(b_desc, kstep_offset(ks, kRowsB)), ks > 0);
  wgmma_commit();
}

// a warp's A fragments of a K-major tile of kRows rows in 64-column panels: its 16 rows
// from row0, every 16-column k-step
template <int kRows, int kHeadDim>
__device__ __forceinline__ void load_a_frags(u32 (&a)[kHeadDim / 16][4], u32 tile, int row0,
                                             int lane) {
  const int r = row0 + (lane & 15);
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks)
    ldmatrix_x4(a[ks], tile + panel_offset<kRows>(r, 2 * ks + (lane >> 4)));
}

// -- acc += A B: A from registers (kSteps fragments of 16 columns), B an MN-major tile
//    whose rows are those columns; one committed group --
template <int kDtype, int kSteps, int kDTiles>
__device__ __forceinline__ void issue_accumulate(float (&acc)[1][kDTiles][4],
                                                 const u32 (&a)[kSteps][4], u64 b_desc) {
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) wgmma_rs<kDtype>(acc, a[kk], desc_add(b_desc, mn_kstep_offset(kk)), 1);
  wgmma_commit();
}

// The producer warpgroup's register budget, and the consumers', where two consumer warpgroups
// share the CTA's registers with the producer's warpgroup: setmaxnreg moves them within
// the launch's allotment (384 threads x 168 = 64512), no more (an .inc past it waits for
// registers that never come)
constexpr int kBwdProducerRegs = 24, kBwdConsumerRegs = 240;
static_assert(128 * kBwdProducerRegs + 256 * kBwdConsumerRegs <= 384 * (65536 / 384 / 8 * 8),
              "within the launch's registers");

// -- the producer's ring (kProducer): kStages buffers that a producer warpgroup fills, a
//    step each, and the consumer warps drain, on mbarriers after the buffers: full (a lane
//    of each producer warp, once its copies have landed), then empty (a lane of each
//    consumer warp, once done reading). The consumer warpgroups then never wait for each
//    other at a CTA-wide barrier a step (await_then_prefetch) and never issue a copy --
template <int kStages>
struct Ring {
  static constexpr int kProducerThreads = 128;
  u32 bars;  // (2 * 8 * kStages bytes: BwdVariant.smem_with's ring)
  __device__ __forceinline__ u32 full(int stage) const { return bars + 8 * stage; }
  __device__ __forceinline__ u32 empty(int stage) const { return bars + 8 * (kStages + stage); }
  __device__ __forceinline__ void init(int consumer_threads) const {
    if (threadIdx.x == 0) {
      for (int s = 0; s < kStages; ++s) {
        mbar_init(full(s), kProducerThreads / 32);
        mbar_init(empty(s), consumer_threads / 32);
      }
      fence_barrier_init();
    }
  }
  // kTma without a producer: the full barriers alone, one arrival each (thread 0's, after
  // the bytes it expects), before the CTA's first barrier
  __device__ __forceinline__ void init_full() const {
    if (threadIdx.x == 0) {
      for (int s = 0; s < kStages; ++s) mbar_init(full(s), 1);
      fence_barrier_init();
    }
  }
  // the producer: steps 0 .. steps - 1, each copy(i, stage) (exactly one cp.async group:
  // the waits below count groups); a step's copies landed, finish(i, stage) on what this
  // thread copied, all fenced for wgmma's async proxy (the copies came through the generic
  // one), then announced. kPublishNow (the tiles by TMA: the group holds a few rows of lse
  // and D): each step as soon as its group lands. Else (the tiles by cp.async) a step
  // later, so that two steps' copies are in flight; but then a step is announced only
  // once the buffer of the next one is free, which with two buffers puts the producer's
  // wake-up on the consumers' path every step. kFreed: freed(j) once every consumer warp
  // has released step j (each step, the last ones after the loop), then settle() once
  // the step being produced is announced (what freed started may take a while)
  template <bool kPublishNow, bool kFreed, class Copy, class Finish, class Freed, class Settle>
  __device__ __forceinline__ void produce(int steps, Copy copy, Finish finish, Freed freed,
                                          Settle settle) const {
    const int lane = threadIdx.x % 32;
    const auto publish = [&](int j, bool last) {
      if (last) cp_async_wait<0>();
      else cp_async_wait<1>();
      finish(j, j % kStages);
      fence_proxy_async();
      __syncwarp();
      if (lane == 0) mbar_arrive(full(j % kStages));
    };
    for (int i = 0; i < steps; ++i) {
      const int stage = i % kStages;
      if (i >= kStages) mbar_wait(empty(stage), ((i / kStages) & 1) ^ 1);
      copy(i, stage);
      if (kFreed && i >= kStages) freed(i - kStages);
      if (kPublishNow) publish(i, true);
      else if (i > 0) publish(i - 1, false);
      if (kFreed && i >= kStages) settle();
    }
    if (!kPublishNow && steps) publish(steps - 1, true);
    if constexpr (kFreed) {
      for (int j = max(0, steps - kStages); j < steps; ++j) {
        mbar_wait(empty(j % kStages), (j / kStages) & 1);
        freed(j);
        settle();
      }
    }
  }
  // the CTA's roles: the barriers set up; then the producer warpgroup fills the ring
  // (`produce`) and gets false, the consumers (kConsumerThreads of them, with the registers
  // the producer's warpgroup gives up where they are two warpgroups) true
  template <int kConsumerThreads, bool kPublishNow, bool kFreed = false, class Copy,
            class Finish, class Freed, class Settle>
  __device__ __forceinline__ bool consumer_after_roles(int steps, Copy copy, Finish finish,
                                                       Freed freed, Settle settle) const {
    init(kConsumerThreads);
    __syncthreads();
    if (threadIdx.x < kProducerThreads) {
      if constexpr (kConsumerThreads > 128) setmaxnreg_dec<kBwdProducerRegs>();
      produce<kPublishNow, kFreed>(steps, copy, finish, freed, settle);
      return false;
    }
    if constexpr (kConsumerThreads > 128) setmaxnreg_inc<kBwdConsumerRegs>();
    return true;
  }
  // a consumer warp: the buffer of its next step, then that buffer done with
  __device__ __forceinline__ void await_full(int stage, u32 phase) const {
    mbar_wait(full(stage), phase);
  }
  __device__ __forceinline__ void release(int& stage, u32& phase, int lane) const {
    __syncwarp();  // (every lane's products and reads of the buffer are done)
    if (lane == 0) mbar_arrive(empty(stage));
    if (++stage == kStages) stage = 0, phase ^= 1;
  }
};

// -- kTma: a step's two streamed tiles (dq: a K and a V block; dk/dv: a Q and a dout
//    block) by TMA, through the maps' k and v slots (and their tails), which the host
//    points at that pair. One thread expects both tiles' bytes on the step's full barrier
//    (the producer warps' arrivals complete it) and issues the 64-column boxes, rows `row`..
//    of a sequence with `rows_left` rows from there. Past a padded batch's sequence the
//    map's end gives zeros; a packed batch's partial last block reads through the tail
//    views, or where it cannot (no tail maps, or the sequence starts within a block of the
//    tensor's first row) this returns false and the caller copies the block itself --
template <int kRows, int kHeadDim>
__device__ __forceinline__ bool tma_step_pair(const FwdParams& p, const TensorMaps& maps, u32 dst_x,
                                              u32 dst_y, u32 full, int row, int rows_left,
                                              int head, int batch, bool packed) {
  const TensorMap *x = &maps.k, *y = &maps.v;
  int last = packed ? 0 : batch;
  if (packed && rows_left < kRows) {
    const int shift = kRows - rows_left;  // rows of the box past the sequence
    if (!p.kv_tail_maps || row < shift) return false;
    x = &maps.k_tail;
    y = &maps.v_tail;
    last = row - shift;
    row = shift;
  }
  if (threadIdx.x == 0) {
    mbar_expect_bytes(full, 2 * kRows * kHeadDim * 2);
    tma_load_panels<kRows, kHeadDim>(dst_x, *x, full, row, head, last);
    tma_load_panels<kRows, kHeadDim>(dst_y, *y, full, row, head, last);
  }
  return true;
}

// the consumers' own copies landed (dk/dv: K and V; dq: Q and dout), all of them past
// (named barrier 6: 1-5 are taken)
enum : int { kCopiesInBarrier = 6 };  // (an enum: unused where no kernel has a producer)

// dq: kBlockM query rows of a head (64 a warpgroup: its M), every key block they see; the
// warpgroups share each streamed K/V block. kProducer: a warpgroup of its own streams the
// K/V blocks through a Ring of kStages buffers
template <int kDtype, int kHeadDim, int kMask, bool kScoreMods, int kBlockM, int kBlockN,
          int kStages, bool kProducer = false, bool kTma = false>
__global__ void __launch_bounds__(2 * kBlockM + (kProducer ? 128 : 0), 1)
    bwd_dq_sm90_kernel(const FwdParams p, const BwdParams g, const __grid_constant__ TensorMaps maps) {
  constexpr int kThreads = 2 * kBlockM;  // the consumers'
  constexpr int kProducerThreads = kProducer ? Ring<kStages>::kProducerThreads : 0;
  constexpr int kCopiers = kProducer ? kProducerThreads : kThreads;  // who issues the copies
  constexpr int kNTiles = kBlockN / 8;
  constexpr int kDTiles = kHeadDim / 8;
  constexpr int kQBytes = kBlockM * kHeadDim * 2;
  constexpr int kTileBytes = kBlockN * kHeadDim * 2;  // one K or V block
  static_assert(kBlockM == 64 || kBlockM == 128, "one or two warpgroups, 16 rows a warp");
  static_assert(kHeadDim % 64 == 0 && kBlockN % 16 == 0 && kTileBytes % 1024 == 0,
                "whole 64-column panels");
  static_assert(kProducer ? kStages >= 2 : kStages == 2,
                "two K/V buffers (await_then_prefetch), or a ring of two or more");
  static_assert(kProducer || !kTma || kStages == 2, "two buffers without a producer");
  extern __shared__ unsigned char smem_raw[];
  const u32 sq = (smem_u32(smem_raw) + 1023) & ~1023u;  // (panels at 1024-byte boundaries)
  const u32 sdo = sq + kQBytes, skv = sdo + kQBytes;    // stage s: K at s * 2 tiles, V after
  [[maybe_unused]] const Ring<kStages> ring{skv + kStages * 2 * kTileBytes};  // (kProducer, kTma)

  Tile t;
  if (!get_tile(p, static_cast<int>(blockIdx.x), t)) return;
  const int row0 = t.m_block * kBlockM;
  const int row_end = min(row0 + kBlockM, t.seqlen_q);
  // a consumer's thread (the producer's threads: 0, so that their unused rows stay small)
  const unsigned tid =
      kProducer && threadIdx.x < kProducerThreads ? 0u : threadIdx.x - kProducerThreads;
  const int lane = threadIdx.x % 32;
  const int warp_row0 = (tid / 32) * 16;
  // this warpgroup's rows (a row past the sequence gets P = 0, and no dq written)
  const int wg = kThreads > 128 ? tid / 128 : 0;
  const int wg_row0 = row0 + wg * 64;
  const int wg_row_end = min(wg_row0 + 64, t.seqlen_q);
  const TilePointers ptr = tile_pointers(p, t);
  const i64 q_row = t.q_start + row0;
  const u16* dout = reinterpret_cast<const u16*>(g.dout) + t.b * g.dout_batch_stride +
                    t.h * g.dout_head_stride + q_row * g.dout_row_stride;
  u16* dq = reinterpret_cast<u16*>(g.dq) + t.b * g.dq_batch_stride + t.h * g.dq_head_stride +
            q_row * g.dq_row_stride;
  const TileMods mods = tile_mods<kScoreMods>(p, t);

  // this lane's rows' lse (log2 units) and D
  const float* lse = reinterpret_cast<const float*>(p.lse) + row_stats_offset(p, t);
  const float* dsum_of = reinterpret_cast<const float*>(g.softmax_d) + row_stats_offset(p, t);
  float lse_log2[2], dsum[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = frag_row(row0 + warp_row0, 0, 2 * h, lane);
    lse_log2[h] = lse_log2_of(lse, row, t.seqlen_q);
    dsum[h] = row < t.seqlen_q ? dsum_of[row] : 0.f;
  }

  float acc_dq[1][kDTiles][4];
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dq[0][dt][e] = 0.f;

  const KeyRange keys = key_range<kMask>(p, t, row0, row_end);
  const int n_block_min = keys.begin / kBlockN;
  const int n_block_max = (keys.end + kBlockN - 1) / kBlockN;
  const u32 wg_rows = wg * 64 * 128;  // its 64 rows in each panel
  const u64 q_desc = smem_desc(sq + wg_rows, 16, 1024), do_desc = smem_desc(sdo + wg_rows, 16, 1024);
  const auto load_kv = [&](int step, int stage) {  // (step: key block n_block_min + step)
    const int key0 = (n_block_min + step) * kBlockN;
    const u32 sk = skv + stage * 2 * kTileBytes;
    load_panels<kBlockN, kHeadDim, kCopiers>(sk, ptr.k + key0 * p.k_row_stride, p.k_row_stride,
                                             t.seqlen_k - key0, p.head_dim);
    load_panels<kBlockN, kHeadDim, kCopiers>(sk + kTileBytes, ptr.v + key0 * p.v_row_stride,
                                             p.v_row_stride, t.seqlen_k - key0, p.head_dim);
    cp_async_commit();
  };
  const auto load_q_dout = [&] {  // (in the first block's copy group)
    load_panels<kBlockM, kHeadDim, kCopiers>(sq, ptr.q + row0 * p.q_row_stride, p.q_row_stride,
                                             t.seqlen_q - row0, p.head_dim);
    load_panels<kBlockM, kHeadDim, kCopiers>(sdo, dout, g.dout_row_stride, t.seqlen_q - row0,
                                             p.head_dim);
  };
  // kTma: step i's K and V by TMA (false: the caller copies them)
  const auto tma_kv = [&](int i, int stage) {
    const int key0 = (n_block_min + i) * kBlockN;
    const u32 sk = skv + stage * 2 * kTileBytes;
    const bool packed = p.cu_seqlens_k != 0;
    return tma_step_pair<kBlockN, kHeadDim>(p, maps, sk, sk + kTileBytes, ring.full(stage),
                                            static_cast<int>(packed ? t.k_start : 0) + key0,
                                            t.seqlen_k - key0, t.h_k, t.b, packed);
  };
  // the consumers' own copies of step i (no producer): with kTma announced on the
  // buffer's full barrier too, which the bytes complete (cp.async's land by the wait)
  const auto stream_kv = [&](int i, int stage) {
    if constexpr (kTma) {
      if (tma_kv(i, stage)) cp_async_commit();  // (the group: Q and dout at step 0)
      else load_kv(i, stage);
      if (threadIdx.x == 0) mbar_arrive(ring.full(stage));
    } else {
      load_kv(i, stage);
    }
  };
  if constexpr (kProducer) {
    const auto copy = [&](int i, int stage) {  // (Q and dout: the consumers', below)
      if constexpr (kTma) {
        if (tma_kv(i, stage)) {
          cp_async_commit();  // (the step's group, empty)
          return;
        }
      }
      load_kv(i, stage);
    };
    if (!ring.template consumer_after_roles<kThreads, kTma>(n_block_max - n_block_min, copy,
                                                      [](int, int) {}, [](int) {}, [] {}))
      return;
    // Q and dout by the consumers, as the dk/dv kernel's K and V (the producer's 24
    // registers issued them one dependent step at a time: 128 KB a CTA at d = 256)
    if (n_block_min < n_block_max) {
      load_panels_from<kBlockM, kHeadDim, kThreads>(sq, ptr.q + row0 * p.q_row_stride,
                                                    p.q_row_stride, t.seqlen_q - row0,
                                                    p.head_dim, static_cast<int>(tid));
      load_panels_from<kBlockM, kHeadDim, kThreads>(sdo, dout, g.dout_row_stride,
                                                    t.seqlen_q - row0, p.head_dim,
                                                    static_cast<int>(tid));
      cp_async_commit();
      cp_async_wait<0>();
      fence_proxy_async();
      named_barrier_sync(kCopiesInBarrier, kThreads);
    }
  } else if (n_block_min < n_block_max) {
    if constexpr (kTma) {
      ring.init_full();
      __syncthreads();
    }
    load_q_dout();
    stream_kv(0, 0);
  }
  int stage = 0;
  u32 phase = 0;  // (the ring's pass over the buffers, mod 2)
  for (int nb = n_block_min; nb < n_block_max; ++nb) {
    const int key0 = nb * kBlockN;
    if constexpr (kProducer) {
      ring.await_full(stage, phase);
    } else {
      if constexpr (kTma) ring.await_full(stage, phase);
      await_then_prefetch(nb - n_block_min, n_block_max - n_block_min, stage, stream_kv,
                          [] { fence_proxy_async(); });
    }
    const u32 sk = skv + stage * 2 * kTileBytes, sv = sk + kTileBytes;

    // S = Q K^T and dP = dout V^T, two groups in flight
    float s[1][kNTiles][4], dp[1][kNTiles][4];
    wgmma_fence();
    issue_scores<kDtype, kHeadDim, kBlockN, kNTiles, kBlockM>(s, q_desc, smem_desc(sk, 16, 1024));
    issue_scores<kDtype, kHeadDim, kBlockN, kNTiles, kBlockM>(dp, do_desc, smem_desc(sv, 16, 1024));
    wgmma_wait<1>();
    fence_registers(s);

    // scores in log2 units (their derivatives kept where score mods change them), masked
    float grad[1][kScoreMods ? kNTiles : 1][4];
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if constexpr (kScoreMods)
          s[0][nt][e] = modded_score(s[0][nt][e], p, t, mods, frag_row(row0 + warp_row0, 0, e, lane),
                                     frag_col(key0, nt, e, lane), grad[0][nt][e]);
        else
          s[0][nt][e] *= p.scale_log2;
      }
    if (block_needs_mask<kMask>(p, t, wg_row0, wg_row_end, key0, key0 + kBlockN))
      apply_mask<kMask>(s, p, t, row0 + warp_row0, key0, lane);
    // dS = P (dP - D) times d(score)/d(raw score), in place of S
    wgmma_wait<0>();
    fence_registers(dp);
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float prob = fast_exp2(s[0][nt][e] - lse_log2[e >> 1]);
        const float ds = prob * (dp[0][nt][e] - dsum[e >> 1]);
        if (kScoreMods && g.dmask)
          add_mask_grad(g, t, frag_row(row0 + warp_row0, 0, e, lane), frag_col(key0, nt, e, lane),
                        ds);
        const float d_raw = kScoreMods ? grad[0][kScoreMods ? nt : 0][e] : p.scale;
        s[0][nt][e] = ds * d_raw;
      }
    // dq += dS K: K as the MN-major B (16 keys a k-step)
    u32 ds_frag[kNTiles / 2][4];
    pack_p<kDtype>(ds_frag, s);
    wgmma_fence();
    issue_accumulate<kDtype>(acc_dq, ds_frag, smem_desc(sk, kBlockN * 128, 1024));
    wgmma_wait<0>();
    fence_registers(ds_frag);
    fence_registers(acc_dq);
    if constexpr (kProducer) ring.release(stage, phase, lane);
    else if ((stage ^= 1) == 0) phase ^= 1;
  }
  store_rows<kDtype>(acc_dq, dq, g.dq_row_stride, warp_row0, t.seqlen_q - row0, p.head_dim, lane);
}

// -- kFusedDq: the step's share of dq, dS K (the step's kBlockM queries x the CTA's
//    kBlockN keys), added to g.dq_accum's float32 sums off the consumers' path. Each
//    warpgroup stores its dS^T fragments as dS (stmatrix .trans: rows of queries) into a
//    K-major tile of both warpgroups' keys (a 64-key panel each), two tiles alternating by
//    step. At d = 128, once both are in, each takes 64 of the head dim's columns over all
//    of the keys; at d = 64 each takes the whole head dim over its own keys (no wait for
//    the other's dS) as dq^T = K^T dS^T (DqKtFrags), and warpgroup 0 adds warpgroup 1's
//    sums to its own (stage_dq_pair). The sums go to shared memory as the accumulators
//    hold them, a slab of 64 x 64 a warpgroup (float4 j of thread t at (j * 128 + t) * 16
//    bytes: no bank conflicts, no shuffle; the accumulator's rows are dq's rows, or at
//    d = 64 its columns), and once the step's buffer is released the producer adds the
//    step's 16 KB (d = 64) or 32 KB to the step's block of dq_accum, which keeps that
//    order, by one bulk reduction; bwd_dq_blocks_kernel puts the sums back in rows --
enum : int { kDqSlabBytes = 64 * 64 * 4 };  // (an enum: unused where dq is not fused)

// the warp's dS^T fragments (its 16 keys x kBlockM queries) as dS, before they are the A
// operand of an in-flight product (its registers must not be read until it completes)
template <int kBlockM, int kQTiles>
__device__ __forceinline__ void stage_ds(const u32 (&ds_frag)[kQTiles / 2][4], u32 sds,
                                         int warp_row0, int lane) {
  const int matrix = lane / 8, row = lane % 8;
#pragma unroll
  for (int kk = 0; kk < kQTiles / 2; ++kk) {  // (fragment kk: queries 16 kk ..)
    const int query = 16 * kk + (matrix / 2) * 8 + row, key = warp_row0 + (matrix % 2) * 8;
    stmatrix_x4_trans(sds + panel_offset<kBlockM>(query, key / 8), ds_frag[kk][0],
                      ds_frag[kk][1], ds_frag[kk][2], ds_frag[kk][3]);
  }
}


// a named barrier of one warpgroup (ids 2 and 3: constants, so ptxas counts two)
__device__ __forceinline__ void warpgroup_barrier(int wg) {
  if (wg) named_barrier_sync(3, 128);
  else named_barrier_sync(2, 128);
}

// At d = 64 a warpgroup's dq share is over its own 64 keys, as dq^T = K^T dS^T: K^T's A
// fragments held for the block (load_kt_frags), dS^T's B the dS tile as stage_ds leaves
// it, so the product reads only B from shared memory (as dS K it read both: a quarter of
// a step's shared-memory reads once K and V were held); the slab then holds dq^T, which
// bwd_dq_blocks_kernel turns back. (d = 128 takes all the keys for 64 columns: unused)
template <int kHeadDim>
using DqKtFrags = u32[kHeadDim == 64 ? 4 : 1][4];

// this warp's K^T fragments (DqKtFrags): A's rows are the head dim's 16 w .. 16 w + 15 (w:
// the warp in its warpgroup; the consumers' threads start at a multiple of 128), its
// k-steps its warpgroup's 64 keys, from K's tile of kRows keys (one 64-column panel)
template <int kRows>
__device__ __forceinline__ void load_kt_frags(DqKtFrags<64>& a, u32 sk, int wg, int lane) {
  const int matrix = lane / 8, dim_chunk = 2 * ((threadIdx.x / 32) % 4) + matrix % 2;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
    ldmatrix_x4_trans(a[kk], sk + panel_offset<kRows>(wg * 64 + 16 * kk + (matrix / 2) * 8 +
                                                      lane % 8, dim_chunk));
}

// this warpgroup's dq product, once the dS it reads is in (its own panel, or both). d = 64:
// dq^T, A K^T from registers, B its keys' panel of dS (K-major: rows of queries); d = 128:
// dq, A both panels of dS, B all the keys' rows of its 64-column panel of K. One committed
// group
template <int kDtype, int kHeadDim, int kBlockM, int kBlockN>
__device__ __forceinline__ void issue_dq_share(float (&acc)[1][8][4], u32 sds, u32 sk,
                                               const DqKtFrags<kHeadDim>& kt, int wg) {
  static_assert(kBlockM == 64 && kBlockN == 128, "two warpgroups of 64 keys, 64-query steps");
  static_assert(kHeadDim == 64 || kHeadDim == 128, "64 of dq's columns a warpgroup");
  fence_proxy_async();  // (stage_ds' stores, before the product reads them)
  if constexpr (kHeadDim == 64) {
    warpgroup_barrier(wg);  // its keys in place
    const u64 b_desc = smem_desc(sds + wg * kBlockM * 128, 16, 1024);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
      wgmma_rs_k<kDtype>(acc, kt[ks], desc_add(b_desc, kstep_offset(ks, kBlockM)), ks > 0);
  } else {
    named_barrier_sync(1, 2 * kBlockN);  // both warpgroups' keys in place
    const u64 a_desc = smem_desc(sds, 16, 1024);
    const u64 b_desc = smem_desc(sk + wg * kBlockN * 128, kBlockN * 128, 1024);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kBlockN / 16; ++ks)
      wgmma_ss_mn<kDtype>(acc, desc_add(a_desc, kstep_offset(ks, kBlockM)),
                          desc_add(b_desc, mn_kstep_offset(ks)), ks > 0);
  }
  wgmma_commit();
}

// a step's dq share (issue_dq_share), once dv's product is done: P^T's registers are then
// free for the sums; issued behind dk's product, the last wait is for both
template <int kDtype, int kHeadDim, int kBlockM, int kBlockN, int kPTiles, int kDvTiles>
__device__ __forceinline__ void dq_share_after_dv(float (&acc_dq)[1][8][4],
                                                  u32 (&p_frag)[kPTiles][4],
                                                  float (&acc_dv)[1][kDvTiles][4], u32 sds_step,
                                                  u32 sk, const DqKtFrags<kHeadDim>& kt,
                                                  int wg) {
  wgmma_wait<1>();
  fence_registers(p_frag);
  fence_registers(acc_dv);
  issue_dq_share<kDtype, kHeadDim, kBlockM, kBlockN>(acc_dq, sds_step, sk, kt, wg);
  wgmma_wait<0>();
  fence_registers(acc_dq);
}

// The first row of a tile's sequence in dq_accum's blocks (a packed batch's sequences at
// (q_start + 64 b) rounded down to 64 rows: at most its rows + 64 a sequence)
__device__ __forceinline__ i64 dq_accum_seq_row(const FwdParams& p, const Tile& t) {
  return p.cu_seqlens_q ? (t.q_start + 64 * t.b) / 64 * 64 : 0;
}

// a thread's sums into a slab at `at` (its own float4s: at + j * 128 * 16)
__device__ __forceinline__ void store_slab(const float (&acc)[1][8][4], u32 at) {
#pragma unroll
  for (int j = 0; j < 8; ++j)
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(at + j * 128 * 16),
                 "f"(acc[0][j][0]), "f"(acc[0][j][1]), "f"(acc[0][j][2]), "f"(acc[0][j][3])
                 : "memory");
}

// the sums (complete) into this warpgroup's slab once the producer has sent step - 1's
// (the warp's release of the step announces them)
__device__ __forceinline__ void stage_dq_share(const float (&acc)[1][8][4], u32 slab,
                                               u32 dq_empty, int step) {
  if (step > 0) mbar_wait(dq_empty, (step - 1) & 1);
  store_slab(acc, slab + (threadIdx.x % 128) * 16);
  fence_proxy_async();  // (for the bulk reduction's reads)
}

// d = 64, where both warpgroups' sums are of the same 64 x 64 block: warpgroup 1 leaves
// its sums in one of two slabs of its own (by step) and warpgroup 0 adds them to its own
// before staging them, so the step sends one slab: half the L2 reductions a step, for half
// of d = 128's products (without a mask 1.07-1.13x the two kernels' time where two slabs
// made it 1.15-1.20x). The hand-over goes on mbarriers (DqPair), one way a step: warpgroup
// 0 waits for warpgroup 1's sums, which waits only for its slab of two steps before to be
// read, so that the two may drift apart by a step or two (a named barrier a step held
// them in lockstep: their exponentials at the same time, the tensor cores idle).
struct DqPair {
  u32 bars;  // full[2] (warpgroup 1's four warps), then free[2] (warpgroup 0's four)
  __device__ __forceinline__ u32 full(int step) const { return bars + 8 * (step & 1); }
  __device__ __forceinline__ u32 freed(int step) const { return bars + 16 + 8 * (step & 1); }
  __device__ __forceinline__ void init() const {
    for (int s = 0; s < 2; ++s) mbar_init(full(s), 4), mbar_init(freed(s), 4);
  }
};
__device__ __forceinline__ void stage_dq_pair(float (&acc)[1][8][4], u32 sdq, u32 dq_empty,
                                              const DqPair& pair, int step, int wg) {
  const int lane = threadIdx.x % 32;
  const u32 thread_at = (threadIdx.x % 128) * 16;
  const u32 other = sdq + (1 + (step & 1)) * kDqSlabBytes + thread_at;  // (step's slab of 1)
  if (wg == 1) {
    if (step >= 2) mbar_wait(pair.freed(step), ((step >> 1) - 1) & 1);
    store_slab(acc, other);
    __syncwarp();
    if (lane == 0) mbar_arrive(pair.full(step));
    return;
  }
  mbar_wait(pair.full(step), (step >> 1) & 1);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float x, y, z, w;
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(x), "=f"(y), "=f"(z), "=f"(w) : "r"(other + j * 128 * 16) : "memory");
    acc[0][j][0] += x;
    acc[0][j][1] += y;
    acc[0][j][2] += z;
    acc[0][j][3] += w;
  }
  __syncwarp();
  if (lane == 0) mbar_arrive(pair.freed(step));
  if (step > 0) mbar_wait(dq_empty, (step - 1) & 1);
  store_slab(acc, sdq + thread_at);
  fence_proxy_async();  // (for the bulk reduction's reads)
}

// The producer's thread that sends the sums: its second warp's first (the first warp's
// issues the TMA copies, its last ones copy lse and D and wait for them: each chain of
// waits on its own warp, so that the consumers' next slab is not held behind a load)
constexpr unsigned kDqSender = 32;

// the sender, once every consumer warp has released a step (and so staged its sums): the
// step's slabs (d = 64: warpgroup 0's, which holds both) added to its block of dq_accum ...
template <int kHeadDim>
__device__ __forceinline__ void send_dq_share(float* block, u32 sdq) {
  if (threadIdx.x != kDqSender) return;
  bulk_add_f32(block, sdq, kHeadDim == 64 ? kDqSlabBytes : 2 * kDqSlabBytes);
  bulk_commit();
}
// ... and free again once read (after the step it produces is announced: the reads wait
// for L2, where every key block's CTA adds to the same rows)
__device__ __forceinline__ void free_dq_slabs(u32 dq_empty) {
  if (threadIdx.x != kDqSender) return;
  bulk_wait_read<0>();
  mbar_arrive(dq_empty);
}

// dq's rows from the fused kernel's blocks of sums (float32, in slabs' order; a
// 64-row block of a sequence at a row of dq_accum that is a multiple of 64: the sequences
// of a packed batch start at (q_start + 64 b) rounded down). A CTA a block of a head: the
// block read in order (float4s), turned into rows in shared memory, written a row's 16
// bytes a thread (a thread a row's 8 columns, rows of every head interleaved, read half
// of each sector and took 1.7x the time of cuDNN's conversion on an H200)
template <int kDtype, int kHeadDim>
__global__ void __launch_bounds__(256) bwd_dq_blocks_kernel(const FwdParams p, const BwdParams g) {
  // the rows a chunk of columns at a time (64 x 128 floats at most: static shared memory
  // stops at 48 KB)
  constexpr int kChunkCols = kHeadDim % 128 == 0 ? 128 : 64;
  constexpr int kStride = kChunkCols + 8;  // (floats: a float2 of 8 rows in 2 wavefronts)
  __shared__ __align__(16) float rows[64 * kStride];
  const int h = static_cast<int>(blockIdx.x % p.nheads);
  const int block = static_cast<int>(blockIdx.x / p.nheads);
  // the block's sequence, its first row in it and dq, the sequence's rows (bounds clamped
  // to the tensor as get_tile clamps them)
  int b, q0, row0 = 0, seq_rows = p.seqlen_q;
  if (p.cu_seqlens_q) {
    const int* cu = reinterpret_cast<const int*>(p.cu_seqlens_q);
    const auto start = [&](int s) { return min(max(cu[s], 0), p.seqlen_q); };
    const auto first_block = [&](int s) { return (start(s) + 64 * s) / 64; };
    int lo = 0, hi = p.batch - 1;  // the last sequence whose blocks start at or before
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (first_block(mid) <= block) lo = mid;
      else hi = mid - 1;
    }
    b = lo;
    q0 = 64 * (block - first_block(lo));
    row0 = start(lo);
    seq_rows = min(max(cu[lo + 1], row0), p.seqlen_q) - row0;
  } else {
    const int q_blocks = (p.seqlen_q + 63) / 64;
    b = block / q_blocks;
    q0 = 64 * (block % q_blocks);
  }
  if (q0 < 0 || q0 >= seq_rows) return;  // (between two sequences' blocks)
  const float4* sums = reinterpret_cast<const float4*>(
      reinterpret_cast<const float*>(g.dq_accum) + h * g.dq_accum_head_stride +
      static_cast<i64>(block) * 64 * g.dq_accum_row_stride);
  const int valid = min(64, seq_rows - q0);
  // (a packed batch's rows are cu[b] + row: batch strides 0)
  u16* dq = reinterpret_cast<u16*>(g.dq) + b * g.dq_batch_stride + h * g.dq_head_stride +
            static_cast<i64>(row0 + q0) * g.dq_row_stride;
  constexpr int kChunks = kChunkCols / 8;
#pragma unroll 1
  for (int col0 = 0; col0 < kHeadDim; col0 += kChunkCols) {
    if (col0 > 0) __syncthreads();  // (the previous chunk's rows read)
    // float4 f of a slab: its accumulator's tile j = f / 128 of thread t = f % 128, rows r
    // and r + 8, columns c and c + 1 (at d = 64 of dq^T)
#pragma unroll
    for (int k = 0; k < kChunkCols / 16; ++k) {
      const int f = col0 / 64 * 1024 + k * 256 + threadIdx.x;
      const float4 x = sums[f];
      const int t = f % 128, slab_f = f % 1024;
      const int r = (t / 32) * 16 + (t % 32) / 4;
      const int c = (f / 1024) * 64 - col0 + (slab_f / 128) * 8 + (t % 4) * 2;
      if constexpr (kHeadDim == 64) {  // (dq^T: r a column of dq, c a row; DqKtFrags)
        rows[c * kStride + r] = x.x;
        rows[(c + 1) * kStride + r] = x.y;
        rows[c * kStride + r + 8] = x.z;
        rows[(c + 1) * kStride + r + 8] = x.w;
      } else {
        *reinterpret_cast<float2*>(rows + r * kStride + c) = make_float2(x.x, x.y);
        *reinterpret_cast<float2*>(rows + (r + 8) * kStride + c) = make_float2(x.z, x.w);
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 64 * kChunks; i += 256) {
      const int r = i / kChunks, c0 = (i % kChunks) * 8;
      if (r >= valid || col0 + c0 >= p.head_dim) continue;
      const float4 lo = *reinterpret_cast<const float4*>(rows + r * kStride + c0);
      const float4 hi = *reinterpret_cast<const float4*>(rows + r * kStride + c0 + 4);
      *reinterpret_cast<uint4*>(dq + r * g.dq_row_stride + col0 + c0) =
          make_uint4(pack2<kDtype>(lo.x, lo.y), pack2<kDtype>(lo.z, lo.w),
                     pack2<kDtype>(hi.x, hi.y), pack2<kDtype>(hi.z, hi.w));
    }
  }
}

// -- kSplitCols (head dims over 128): both consumer warpgroups take the same 64 keys and
//    split the step by product instead of by keys. Warpgroup 0 computes S^T = K Q^T and P^T,
//    warpgroup 1 dP^T = V dout^T and dS^T (from warpgroup 0's P^T, fp32, through shared
//    memory); then each adds its share of the head dim's columns to dv += P^T dout and
//    dk += dS^T Q (warpgroup 0 the first ceil(panels / 2) 64-column panels, from P^T and
//    dS^T in registers). One warpgroup with both gradients would hold 2 x 128 accumulators
//    a thread at d = 256; so each holds at most 128, S is computed once a step (dk and dv
//    launched apart computed it twice) and two warpgroups share the SM, where the launches
//    apart had one --
template <int kHeadDim>
struct SplitCols {
  static constexpr int kCols0 = (kHeadDim / 64 + 1) / 2 * 64;
  template <int kRole>
  __device__ static constexpr int cols() { return kRole == 0 ? kCols0 : kHeadDim - kCols0; }
  template <int kRole>
  __device__ static constexpr int col0() { return kRole == 0 ? 0 : kCols0; }
};
// The exchange, each array in its accumulator's order (thread t's float4 or 16-bit
// fragment j at (j * 128 + t) * 16: no bank conflicts, no shuffles): P^T in fp32 (dS is
// computed from P unrounded, as the other kernels do), then dS^T's fragments. Named
// barriers 4 (P^T in) and 5 (dS^T in): one warpgroup arrives, the other waits. A buffer of
// each is enough: warpgroup 1 has read P^T before it announces dS^T, which warpgroup 0
// waits for before it writes the next P^T, and the same the other way round
enum : int { kSplitPBytes = 64 * 64 * 4, kSplitDsBytes = 64 * 64 * 2, kBarP = 4, kBarDs = 5 };

// warpgroup 1's dS^T = P^T (dP^T - D) scale in place of dP^T, from warpgroup 0's P^T
// (read once: it also becomes P^T's 16-bit fragments for dv)
template <int kDtype>
__device__ __forceinline__ void ds_t_from_p_t(float (&dpt)[1][8][4], u32 (&p_frag)[4][4], u32 at,
                                              const float* s_d, float scale, int lane) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float pr[4];
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(pr[0]), "=f"(pr[1]), "=f"(pr[2]), "=f"(pr[3])
                 : "r"(at + j * 128 * 16) : "memory");
#pragma unroll
    for (int e = 0; e < 4; ++e)
      dpt[0][j][e] = pr[e] * (dpt[0][j][e] - s_d[frag_col(0, j, e, lane)]) * scale;
    p_frag[j / 2][2 * (j % 2)] = pack2<kDtype>(pr[0], pr[1]);  // (pack_p's order)
    p_frag[j / 2][2 * (j % 2) + 1] = pack2<kDtype>(pr[2], pr[3]);
  }
}

__device__ __forceinline__ void put_fragments(const u32 (&f)[4][4], u32 at) {
#pragma unroll
  for (int j = 0; j < 4; ++j)
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(at + j * 128 * 16),
                 "r"(f[j][0]), "r"(f[j][1]), "r"(f[j][2]), "r"(f[j][3])
                 : "memory");
}
__device__ __forceinline__ void get_fragments(u32 (&f)[4][4], u32 at) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint4 v = ld_shared_v4(at + j * 128 * 16);
    f[j][0] = v.x, f[j][1] = v.y, f[j][2] = v.z, f[j][3] = v.w;
  }
}

// kFusedDq in a split block: dq += dS K by both warpgroups, each over its panels of the
// head dim's columns (its dk and dv columns), a 64-column panel at a time (32 accumulators
// a thread, where the split block has no registers for more), from a 64 x 64 tile of dS
// that warpgroup 1 stores (stage_ds) in place of the dS^T fragments' copy and warpgroup 0
// reads its fragments back from (ldmatrix .trans undoes stmatrix .trans). The sums go to
// dq_accum's block from registers by vector reductions, in the slabs' order that
// bwd_dq_blocks_kernel reads (no shared memory is left at d = 256 for a slab to send).
__device__ __forceinline__ void add_dq_share(const float (&acc)[1][8][4], float* slab,
                                             unsigned thread) {
#pragma unroll
  for (int j = 0; j < 8; ++j)
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(
                     slab + (j * 128 + thread) * 4),
                 "f"(acc[0][j][0]), "f"(acc[0][j][1]), "f"(acc[0][j][2]), "f"(acc[0][j][3])
                 : "memory");
}
template <int kQTiles>
__device__ __forceinline__ void load_ds_t(u32 (&ds_frag)[kQTiles / 2][4], u32 sds, int warp_row0,
                                          int lane) {
  const int matrix = lane / 8, row = lane % 8;
#pragma unroll
  for (int kk = 0; kk < kQTiles / 2; ++kk) {  // (stage_ds' addresses)
    const int query = 16 * kk + (matrix / 2) * 8 + row, key = warp_row0 + (matrix % 2) * 8;
    ldmatrix_x4_trans(ds_frag[kk], sds + panel_offset<64>(query, key / 8));
  }
}
template <int kDtype, int kPanels>
__device__ __forceinline__ void dq_panels(float* block, int panel0, u32 sds, u32 sk,
                                          unsigned thread) {
#pragma unroll 1
  for (int c = panel0; c < panel0 + kPanels; ++c) {
    float acc[1][8][4];
    const u64 a_desc = smem_desc(sds, 16, 1024);
    const u64 b_desc = smem_desc(sk + c * 64 * 128, 64 * 128, 1024);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
      wgmma_ss_mn<kDtype>(acc, desc_add(a_desc, kstep_offset(ks, 64)),
                          desc_add(b_desc, mn_kstep_offset(ks)), ks > 0);
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(acc);
    add_dq_share(acc, block + c * (kDqSlabBytes / 4), thread);
  }
}

// a split block's consumer warpgroup (kRole 0 or 1): its loop over the steps, then its
// columns of dv and dk
template <int kStages>
struct SplitBlock {
  Tile t;
  Ring<kStages> ring;
  u32 sk, sv, sstages, sx;  // K, V, the ring's first stage, the exchange
  const unsigned char* stages;  // (the first stage, as a generic address: lse and D)
  int key0, rows_out, h_k, group, m_block_min, m_blocks;
  i64 k_row;
  unsigned tid;  // (the consumers': 0-255)
  i64 dq_row0;   // kFusedDq: the sequence's first row of dq_accum's blocks
};
template <int kDtype, int kHeadDim, int kMask, int kRole, bool kFusedDq, int kStages>
__device__ __forceinline__ void dkdv_split_consumer(const FwdParams& p, const BwdParams& g,
                                                    const SplitBlock<kStages>& c) {
  constexpr int kBlockM = 64, kBlockN = 64, kQTiles = kBlockM / 8;
  constexpr int kTileBytes = kBlockM * kHeadDim * 2;
  constexpr int kStageBytes = (2 * kTileBytes + 8 * kBlockM + 1023) / 1024 * 1024;
  constexpr int kCols = SplitCols<kHeadDim>::template cols<kRole>();
  constexpr int kCol0 = SplitCols<kHeadDim>::template col0<kRole>();
  constexpr u32 kColsAt = kCol0 / 64 * kBlockM * 128;  // (its first panel in a stage's tile)
  const Tile& t = c.t;
  const int lane = threadIdx.x % 32;
  const int warp_row0 = (c.tid % 128 / 32) * 16;  // the warp's 16 keys
  const int first_key = frag_row(c.key0 + warp_row0, 0, 0, lane);
  const u32 thread_at = c.tid % 128 * 16, sp = c.sx, sdst = c.sx + kSplitPBytes;
  const int steps = c.group * c.m_blocks;
  float acc_dk[1][kCols / 8][4], acc_dv[1][kCols / 8][4];
#pragma unroll
  for (int dt = 0; dt < kCols / 8; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dk[0][dt][e] = acc_dv[0][dt][e] = 0.f;
  int stage = 0;
  u32 phase = 0;
  for (int i = 0; i < steps; ++i) {
    c.ring.await_full(stage, phase);
    bwd_trace(i == 0 && c.tid == 0, kBwdFirstStep);
    const u32 sq = c.sstages + stage * kStageBytes, sdo = sq + kTileBytes;
    const float* s_lse =
        reinterpret_cast<const float*>(c.stages + stage * kStageBytes + 2 * kTileBytes);
    const u64 q_cols = smem_desc(sq + kColsAt, kBlockM * 128, 1024);
    const u64 do_cols = smem_desc(sdo + kColsAt, kBlockM * 128, 1024);
    // S^T = K Q^T (warpgroup 0) or dP^T = V dout^T (1)
    float x[1][kQTiles][4];
    u32 p_frag[kQTiles / 2][4], ds_frag[kQTiles / 2][4];
    wgmma_fence();
    if constexpr (kRole == 0)
      issue_scores<kDtype, kHeadDim, kBlockM, kQTiles, kBlockN>(x, smem_desc(c.sk, 16, 1024),
                                                                smem_desc(sq, 16, 1024));
    else
      issue_scores<kDtype, kHeadDim, kBlockM, kQTiles, kBlockN>(x, smem_desc(c.sv, 16, 1024),
                                                                smem_desc(sdo, 16, 1024));
    wgmma_wait<0>();
    fence_registers(x);
    if constexpr (kRole == 0) {
      Tile th = t;
      th.h = c.h_k * c.group + i / c.m_blocks;
      const int q0 = (c.m_block_min + i % c.m_blocks) * kBlockM;
      const bool masked = block_needs_mask<kMask>(p, th, q0, min(q0 + kBlockM, t.seqlen_q),
                                                  c.key0, c.key0 + kBlockN);
      float grad[1][1][4];
      probs_t<kMask, false, true>(x, grad, masked, p, th, TileMods{}, q0, first_key, s_lse,
                                  lane);
      store_slab(x, sp + thread_at);
      named_barrier_arrive(kBarP, 256);
      pack_p<kDtype>(p_frag, x);
      wgmma_fence();
      issue_accumulate<kDtype>(acc_dv, p_frag, do_cols);
      named_barrier_sync(kBarDs, 256);
      if constexpr (kFusedDq) load_ds_t<kQTiles>(ds_frag, sdst, warp_row0, lane);
      else get_fragments(ds_frag, sdst + thread_at);
    } else {
      named_barrier_sync(kBarP, 256);
      ds_t_from_p_t<kDtype>(x, p_frag, sp + thread_at, s_lse + kBlockM, p.scale, lane);
      pack_p<kDtype>(ds_frag, x);
      if constexpr (kFusedDq) {
        stage_ds<kBlockM, kQTiles>(ds_frag, sdst, warp_row0, lane);
        fence_proxy_async();  // (for both warpgroups' dq products)
      } else {
        put_fragments(ds_frag, sdst + thread_at);
      }
      named_barrier_arrive(kBarDs, 256);
      wgmma_fence();
      issue_accumulate<kDtype>(acc_dv, p_frag, do_cols);
    }
    wgmma_fence();
    issue_accumulate<kDtype>(acc_dk, ds_frag, q_cols);
    if constexpr (kFusedDq) {
      const int head = c.h_k * c.group + i / c.m_blocks;
      const int q0 = (c.m_block_min + i % c.m_blocks) * kBlockM;
      float* block = reinterpret_cast<float*>(g.dq_accum) + t.b * g.dq_accum_batch_stride +
                     head * g.dq_accum_head_stride + (c.dq_row0 + q0) * g.dq_accum_row_stride;
      dq_panels<kDtype, kCols / 64>(block, kCol0 / 64, sdst, c.sk, c.tid % 128);
    }
    wgmma_wait<0>();
    fence_registers(p_frag);
    fence_registers(ds_frag);
    fence_registers(acc_dv);
    fence_registers(acc_dk);
    c.ring.release(stage, phase, lane);
  }
  bwd_trace(c.tid == 0, kBwdLoopEnd);
  // dv, then dk, through the tile that only this warpgroup's products read (K for
  // warpgroup 0, V for 1), once its four warps are past the loop
  const int rows = c.rows_out - c.key0, cols = p.head_dim - kCol0;
  const u32 staging = kRole == 0 ? c.sk : c.sv;
  u16* dk = reinterpret_cast<u16*>(g.dk) + t.b * g.dk_batch_stride + c.h_k * g.dk_head_stride +
            c.k_row * g.dk_row_stride + kCol0;
  u16* dv = reinterpret_cast<u16*>(g.dv) + t.b * g.dv_batch_stride + c.h_k * g.dv_head_stride +
            c.k_row * g.dv_row_stride + kCol0;
  warpgroup_barrier(kRole);
  store_rows_staged<kDtype, kBlockN, kCols, kCols>(acc_dv, dv, i64{g.dv_row_stride}, rows, cols,
                                                   staging, warp_row0, warp_row0, lane);
  __syncwarp();  // (the warp's dv rows read back)
  store_rows_staged<kDtype, kBlockN, kCols, kCols>(acc_dk, dk, i64{g.dk_row_stride}, rows, cols,
                                                   staging, warp_row0, warp_row0, lane);
  bwd_trace(c.tid == 0, kBwdStored);
}

// dk, dv: kBlockN keys of a KV head (64 a warpgroup: its M), the query blocks of every head
// of its group; the warpgroups share each step's Q and dout. kProducer: a warpgroup of
// its own copies each step's Q, dout, lse and D (a row a thread) into a ring of kStages
// buffers, announced on mbarriers (full: a lane of each producer warp, once its copies
// have landed; empty: a lane of each consumer warp, once done reading), so the consumer
// warpgroups never wait for each other at a CTA-wide barrier a step
// (await_then_prefetch) and never issue a copy. kFusedDq: dq too (issue_dq_share), at
// head dims 64 and 128 on two warpgroups with a producer, whose thread 0 also sends each
// released step's sums (send_dq_share, free_dq_slabs).
template <int kDtype, int kHeadDim, int kMask, bool kScoreMods, int kBlockM, int kGrads,
          int kStages, int kBlockN, bool kFusedDq = false, bool kProducer = false,
          bool kTma = false, bool kSplitCols = false>
__global__ void __launch_bounds__((kSplitCols ? 256 : 2 * kBlockN) + (kProducer ? 128 : 0), 1)
    bwd_dkdv_sm90_kernel(const FwdParams p, const BwdParams g,
                         const __grid_constant__ TensorMaps maps) {
  constexpr int kThreads = kSplitCols ? 256 : 2 * kBlockN;  // the consumers'
  // dq's sums sent from slabs by the producer (kFusedDq but where the columns are split:
  // there the consumers add them from registers, dq_panels)
  constexpr bool kSlabDq = kFusedDq && !kSplitCols;
  using StepRing = Ring<kStages>;
  constexpr int kProducerThreads = kProducer ? StepRing::kProducerThreads : 0;
  // the threads that issue the copies: the consumers, or the producer's whole warpgroup
  constexpr int kCopiers = kProducer ? kProducerThreads : kThreads;
  constexpr int kQTiles = kBlockM / 8;
  constexpr int kDTiles = kHeadDim / 8;
  constexpr bool kDk = kGrads != KV_DV, kDv = kGrads != KV_DK;
  constexpr int kTileBytes = kBlockM * kHeadDim * 2;
  // a stage: Q and dout, then lse (log2 units) and D; stages 1024-byte aligned (panels)
  constexpr int kStageBytes = (2 * kTileBytes + 8 * kBlockM + 1023) / 1024 * 1024;
  constexpr int kKVBytes = kBlockN * kHeadDim * 2;
  static_assert(kBlockN == 64 || kBlockN == 128, "one or two warpgroups, 16 keys a warp");
  static_assert(kHeadDim % 64 == 0 && kBlockM % 64 == 0, "whole 64-column panels, n64 steps");
  static_assert(kProducer ? kStages >= 2 : kStages == 2,
                "two Q/dout buffers (await_then_prefetch), or a ring of two or more");
  static_assert(kProducer || !kTma || kStages == 2, "two buffers without a producer");
  static_assert(!kFusedDq || ((kHeadDim == 64 || kHeadDim == 128 || kSplitCols) &&
                              kGrads == KV_BOTH && !kScoreMods && kProducer && kBlockM == 64),
                "dq fused at head dims 64 and 128 (or split by columns), dk and dv together, "
                "no score mods, a producer, 64-query steps");
  static_assert(!kSplitCols || (kHeadDim > 128 && kBlockN == 64 && kBlockM == 64 &&
                                kGrads == KV_BOTH && !kScoreMods && kProducer),
                "columns split above d = 128: 64 keys, 64-query steps, both gradients, no "
                "score mods, a producer");
  extern __shared__ unsigned char smem_raw[];
  // (the swizzle's phase is the address's: panels start at 1024-byte boundaries)
  const u32 base = (smem_u32(smem_raw) + 1023) & ~1023u;
  unsigned char* smem = smem_raw + (base - smem_u32(smem_raw));
  const u32 sk = base, sv = base + kKVBytes, sstages = base + 2 * kKVBytes;
  // kFusedDq: two tiles of dS (kBlockM x kBlockN, 16-bit), then each warpgroup's slab
  constexpr int kDsBytes = kBlockM * kBlockN * 2;
  [[maybe_unused]] const u32 sds = sstages + kStages * kStageBytes;
  [[maybe_unused]] const u32 sdq = sds + 2 * kDsBytes;
  unsigned char* stages = smem + 2 * kKVBytes;
  // (kProducer, kTma) its mbarriers, after the slabs where dq is fused, then theirs (the
  // producer's reductions have read them)
  // (d = 64: warpgroup 0's slab, then two of warpgroup 1's: stage_dq_pair)
  constexpr int kSlabs = kHeadDim == 64 ? 3 : 2;
  // (kSplitCols: the exchange's P^T and dS^T at sds)
  [[maybe_unused]] const StepRing ring{kSlabDq      ? sdq + kSlabs * kDqSlabBytes
                                       : kSplitCols ? sds + kSplitPBytes + kSplitDsBytes
                                                    : sds};
  [[maybe_unused]] const u32 dq_empty = ring.bars + 16 * kStages;
  [[maybe_unused]] const DqPair dq_pair{dq_empty + 8};  // (kFusedDq at d = 64)

  KeyBlock kb;
  if (!key_block<kMask, kBlockM, kBlockN>(p, g, kb)) return;
  Tile& t = kb.t;
  bwd_trace(threadIdx.x == 0, kBwdStart);
  const int h_k = kb.h_k, key0 = kb.key0, rows_out = kb.rows_out;
  const int group = p.nheads / p.nheads_k;
  // a consumer's thread (the producer's threads: 0, so that their unused row and key
  // offsets below stay small)
  const unsigned tid =
      kProducer && threadIdx.x < kProducerThreads ? 0u : threadIdx.x - kProducerThreads;
  const int lane = threadIdx.x % 32;
  const int warp_row0 = (tid / 32) * 16;
  const int wg = kThreads > 128 ? tid / 128 : 0;
  const int wg_key0 = key0 + wg * 64;  // this warpgroup's first key
  const TilePointers kv = tile_pointers(p, t);
  const i64 k_row = t.k_start + key0;

  float acc_dk[1][kDk ? kDTiles : 8][4], acc_dv[1][kDv ? kDTiles : 8][4];
#pragma unroll
  for (int dt = 0; dt < (kDk ? kDTiles : 8); ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dk[0][dt][e] = 0.f;
#pragma unroll
  for (int dt = 0; dt < (kDv ? kDTiles : 8); ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dv[0][dt][e] = 0.f;

  const int m_block_min = kb.m_block_min, m_blocks = kb.m_blocks;
  const int steps = group * m_blocks;

  // K and V as A (K-major, this warpgroup's 64 rows); a stage's Q and dout as B, K-major for S^T and dP^T,
  // MN-major (16 rows a k-step, 64-column panels kBlockM * 128 bytes apart) for dk, dv
  const u32 wg_rows = wg * 64 * 128;  // its 64 rows in each panel
  const u64 k_desc = smem_desc(sk + wg_rows, 16, 1024), v_desc = smem_desc(sv + wg_rows, 16, 1024);
  const auto head_of = [&](int i) { return h_k * group + i / m_blocks; };
  const auto q0_of = [&](int i) { return (m_block_min + i % m_blocks) * kBlockM; };
  // this thread's row of step i's lse and D (kBlockM floats on), a row a thread: they come
  // by cp.async as they are stored, in the step's copy group, and lse is put in log2 units
  // (lse_log2_of) by the same thread once it has landed (to_log2): a load and a store there
  // held the step's copies back by a round trip (ncu, d = 64 without a producer: 13 % of
  // the stall samples at that load's use). A producer's last kBlockM threads copy them
  // (away from the TMA's thread and kDqSender: their waits are the loads')
  constexpr int kStatsThread0 = kProducer ? kProducerThreads - kBlockM : 0;
  static_assert(kStatsThread0 >= 0 && (!kFusedDq || kStatsThread0 > int{kDqSender}),
                "the stats' rows on threads of their own");
  const int stats_r = static_cast<int>(threadIdx.x) - kStatsThread0;
  const bool stats_thread = stats_r >= 0 && stats_r < kBlockM;
  struct StatsRow {
    float* s;
    i64 at;
    bool valid;
  };
  const auto stats_row = [&](int i, int stage) {
    Tile th = t;
    th.h = head_of(i);
    const int q0 = q0_of(i);
    return StatsRow{
        reinterpret_cast<float*>(stages + stage * kStageBytes + 2 * kTileBytes) + stats_r,
        row_stats_offset(p, th) + q0 + stats_r, q0 + stats_r < t.seqlen_q};
  };
  const auto copy_stats = [&](int i, int stage) {
    if (stats_thread) {
      const StatsRow row = stats_row(i, stage);
      cp_async_4(smem_u32(row.s), reinterpret_cast<const float*>(p.lse) + row.at,
                 row.valid ? 4 : 0);
      cp_async_4(smem_u32(row.s + kBlockM), reinterpret_cast<const float*>(g.softmax_d) + row.at,
                 row.valid ? 4 : 0);
    }
  };
  const auto to_log2 = [&](int i, int stage) {
    bwd_trace(kProducer && threadIdx.x == 0 && i == 0, kBwdLanded);
    if (stats_thread) {
      const StatsRow row = stats_row(i, stage);
      *row.s = lse_log2_of(row.s, 0, row.valid);  // (a row past the sequence: +inf)
    }
  };
  // step i's Q and dout into a buffer and (stats) its lse and D, one copy group (the
  // caller commits it where copies is false), by the copiers (the consumers, or the
  // producer warpgroup). Without TMA or a producer lse and D come by plain loads (their
  // cp.async spilled at d = 64 under a window, 128-query blocks)
  const auto load_step = [&](int i, int stage, bool copies = true, bool stats = true) {
    if (stats && (kTma || kProducer)) copy_stats(i, stage);
    if (stats && !(kTma || kProducer)) {
      Tile th = t;
      th.h = head_of(i);
      const int q0 = q0_of(i);
      const i64 at = row_stats_offset(p, th) + q0;
      float* s_lse = reinterpret_cast<float*>(stages + stage * kStageBytes + 2 * kTileBytes);
      for (int r = threadIdx.x; r < kBlockM; r += kCopiers) {
        s_lse[r] = lse_log2_of(reinterpret_cast<const float*>(p.lse) + at, r, t.seqlen_q - q0);
        s_lse[kBlockM + r] =
            q0 + r < t.seqlen_q ? reinterpret_cast<const float*>(g.softmax_d)[at + r] : 0.f;
      }
    }
    if (copies) {
      Tile th = t;
      th.h = head_of(i);
      const int q0 = q0_of(i);
      const TilePointers ptr = tile_pointers(p, th);
      const u16* dout = reinterpret_cast<const u16*>(g.dout) + th.b * g.dout_batch_stride +
                        th.h * g.dout_head_stride + (th.q_start + q0) * g.dout_row_stride;
      const u32 sq = sstages + stage * kStageBytes;
      load_panels<kBlockM, kHeadDim, kCopiers>(sq, ptr.q + q0 * p.q_row_stride, p.q_row_stride,
                                               t.seqlen_q - q0, p.head_dim);
      load_panels<kBlockM, kHeadDim, kCopiers>(sq + kTileBytes, dout, g.dout_row_stride,
                                               t.seqlen_q - q0, p.head_dim);
      cp_async_commit();
    }
  };
  // K and V without a producer (in the first step's copy group)
  const auto load_kv = [&] {
    load_panels<kBlockN, kHeadDim, kCopiers>(sk, kv.k + key0 * p.k_row_stride, p.k_row_stride,
                                             t.seqlen_k - key0, p.head_dim);
    if (kDk)
      load_panels<kBlockN, kHeadDim, kCopiers>(sv, kv.v + key0 * p.v_row_stride,
                                               p.v_row_stride, t.seqlen_k - key0, p.head_dim);
  };
  // kTma: step i's Q and dout by TMA (false: the caller copies them)
  const auto tma_q_dout = [&](int i, int stage) {
    const int q0 = q0_of(i);
    const u32 sq = sstages + stage * kStageBytes;
    const bool packed = p.cu_seqlens_q != 0;
    return tma_step_pair<kBlockM, kHeadDim>(p, maps, sq, sq + kTileBytes, ring.full(stage),
                                            static_cast<int>(packed ? t.q_start : 0) + q0,
                                            t.seqlen_q - q0, head_of(i), t.b, packed);
  };
  // the consumers' own copies of step i (no producer); with kTma announced on the
  // buffer's full barrier too, which the bytes complete (cp.async's land by the wait)
  const auto stream_step = [&](int i, int stage) {
    if constexpr (kTma) {
      const bool copied = tma_q_dout(i, stage);
      load_step(i, stage, !copied, true);
      if (copied) cp_async_commit();  // (the group: K and V at step 0)
      if (threadIdx.x == 0) mbar_arrive(ring.full(stage));
    } else {
      load_step(i, stage);
    }
  };
  if constexpr (kProducer) {
    const auto copy = [&](int i, int stage) {  // (K and V: the consumers', below)
      copy_stats(i, stage);
      if constexpr (kTma) {
        if (tma_q_dout(i, stage)) {
          cp_async_commit();  // (the step's group: lse and D)
          bwd_trace(threadIdx.x == 0 && i == 0, kBwdIssued);
          return;
        }
      }
      load_step(i, stage, true, false);  // (Q and dout; commits the group)
      bwd_trace(threadIdx.x == 0 && i == 0, kBwdIssued);
    };
    // kFusedDq: a released step's sums, sent
    const i64 seq_row = dq_accum_seq_row(p, t);
    const auto send_sums = [&](int i) {
      if constexpr (kSlabDq)
        send_dq_share<kHeadDim>(reinterpret_cast<float*>(g.dq_accum) +
                                    t.b * g.dq_accum_batch_stride +
                                    head_of(i) * g.dq_accum_head_stride +
                                    (seq_row + q0_of(i)) * g.dq_accum_row_stride,
                                sdq);
    };
    const auto sums_read = [&] {
      if constexpr (kSlabDq) free_dq_slabs(dq_empty);
    };
    if constexpr (kSlabDq) {
      if (threadIdx.x == 0) {  // (fenced by the ring's init)
        mbar_init(dq_empty, 1);
        if constexpr (kHeadDim == 64) dq_pair.init();
      }
    }
    if (!ring.template consumer_after_roles<kThreads, kTma, kSlabDq>(steps, copy, to_log2,
                                                                      send_sums, sums_read)) {
      bwd_trace(threadIdx.x == 0, kBwdProducerEnd);
      return;
    }
  } else if (steps) {
    if constexpr (kTma) {
      ring.init_full();
      __syncthreads();
    }
    load_kv();
    stream_step(0, 0);
  }
  // (kKVHeld) K and V as this warp's A fragments for S^T and dP^T, loaded once: at d = 64
  // their shared-memory reads were a quarter of a step's products' (the step's Q and dout,
  // dS and K, dq's slabs and the copies read and write it besides)
  constexpr bool kKVHeld = kSlabDq && kHeadDim == 64;
  u32 k_frag[kKVHeld ? kHeadDim / 16 : 1][4], v_frag[kKVHeld ? kHeadDim / 16 : 1][4];
  [[maybe_unused]] DqKtFrags<kHeadDim> kt_frag;  // (kSlabDq at d = 64)
  if constexpr (kProducer) {
    // K and V by the consumers, before their first step: the producer's 24 registers had
    // it issue the copies one dependent step at a time, 2.6 us of a d = 128 CTA's 3.4 us
    // prologue on an H200 (bench/results/bwd_kv_by_consumers_h200.md); the consumers have
    // registers to spare until their loop. Landed, fenced for wgmma, then all of them met
    if (steps) {
      load_panels_from<kBlockN, kHeadDim, kThreads>(sk, kv.k + key0 * p.k_row_stride,
                                                    p.k_row_stride, t.seqlen_k - key0,
                                                    p.head_dim, static_cast<int>(tid));
      if (kDk)
        load_panels_from<kBlockN, kHeadDim, kThreads>(sv, kv.v + key0 * p.v_row_stride,
                                                      p.v_row_stride, t.seqlen_k - key0,
                                                      p.head_dim, static_cast<int>(tid));
      cp_async_commit();
      cp_async_wait<0>();
      fence_proxy_async();
      named_barrier_sync(kCopiesInBarrier, kThreads);
      if constexpr (kKVHeld) {
        load_a_frags<kBlockN, kHeadDim>(k_frag, sk, warp_row0, lane);
        load_a_frags<kBlockN, kHeadDim>(v_frag, sv, warp_row0, lane);
        load_kt_frags<kBlockN>(kt_frag, sk, wg, lane);
      }
    }
  }
  if constexpr (kSplitCols) {
    const i64 dq_row0 = dq_accum_seq_row(p, t);
    const SplitBlock<kStages> c{t,     ring,     sk,       sv,          sstages, sds,
                                stages, key0, rows_out, h_k, group, m_block_min,
                                m_blocks, k_row, tid, dq_row0};
    if (wg == 0) dkdv_split_consumer<kDtype, kHeadDim, kMask, 0, kFusedDq>(p, g, c);
    else dkdv_split_consumer<kDtype, kHeadDim, kMask, 1, kFusedDq>(p, g, c);
    return;
  }
  const int first_key = frag_row(key0 + warp_row0, 0, 0, lane);  // this lane's keys: + 0, + 8

  int stage = 0;
  u32 phase = 0;  // (the ring's pass over the buffers, mod 2)
  for (int i = 0; i < steps; ++i) {
    if constexpr (kProducer) {
      ring.await_full(stage, phase);
    } else {
      if constexpr (kTma) ring.await_full(stage, phase);
      await_then_prefetch(i, steps, stage, stream_step, [&] {
        if constexpr (kTma) to_log2(i, stage);  // (the plain loads' are in log2 units)
        fence_proxy_async();
      });
    }
    bwd_trace(i == 0 && tid == 0, kBwdFirstStep);
    Tile th = t;
    th.h = head_of(i);
    const int q0 = q0_of(i);
    const TileMods mods = tile_mods<kScoreMods>(p, th);
    const u32 sq = sstages + stage * kStageBytes, sdo = sq + kTileBytes;
    const float* s_lse = reinterpret_cast<const float*>(stages + stage * kStageBytes +
                                                        2 * kTileBytes);
    const float* s_d = s_lse + kBlockM;
    const u64 q_desc = smem_desc(sq, 16, 1024), do_desc = smem_desc(sdo, 16, 1024);
    const u64 q_mn_desc = smem_desc(sq, kBlockM * 128, 1024);
    const u64 do_mn_desc = smem_desc(sdo, kBlockM * 128, 1024);

    // S^T = K Q^T and (for dk) dP^T = V dout^T, two groups in flight
    float st[1][kQTiles][4], dpt[1][kDk ? kQTiles : 2][4];
    wgmma_fence();
    if constexpr (kKVHeld) {
      issue_scores_held<kDtype, kHeadDim, kBlockM, kQTiles>(st, k_frag, q_desc);
      issue_scores_held<kDtype, kHeadDim, kBlockM, kQTiles>(dpt, v_frag, do_desc);
    } else {
      issue_scores<kDtype, kHeadDim, kBlockM, kQTiles, kBlockN>(st, k_desc, q_desc);
      if constexpr (kDk)
        issue_scores<kDtype, kHeadDim, kBlockM, kQTiles, kBlockN>(dpt, v_desc, do_desc);
    }
    wgmma_wait<kDk ? 1 : 0>();
    fence_registers(st);

    const bool masked = block_needs_mask<kMask>(p, th, q0, min(q0 + kBlockM, t.seqlen_q),
                                                wg_key0, wg_key0 + 64);
    float grad[1][kScoreMods ? kQTiles : 1][4];
    probs_t<kMask, kScoreMods, true>(st, grad, masked, p, th, mods, q0, first_key, s_lse,
                                     lane);
    u32 p_frag[kQTiles / 2][4], ds_frag[kQTiles / 2][4];
    if constexpr (kDv) {
      pack_p<kDtype>(p_frag, st);
      wgmma_fence();
      issue_accumulate<kDtype>(acc_dv, p_frag, do_mn_desc);
    }
    if constexpr (kDk) {
      // dS^T = P^T (dP^T - D) d(score)/d(raw score), once dP^T is in (dv's group may still run)
      if constexpr (kDv) wgmma_wait<1>(); else wgmma_wait<0>();
      fence_registers(dpt);
#pragma unroll
      for (int nt = 0; nt < kQTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = frag_col(0, nt, e, lane);
          const float d_raw = kScoreMods ? grad[0][kScoreMods ? nt : 0][e] : p.scale;
          dpt[0][nt][e] = st[0][nt][e] * (dpt[0][nt][e] - s_d[col]) * d_raw;
        }
      pack_p<kDtype>(ds_frag, dpt);
      const u32 sds_step = sds + (i & 1) * kDsBytes;  // (kFusedDq)
      if constexpr (kSlabDq) stage_ds<kBlockM, kQTiles>(ds_frag, sds_step, warp_row0, lane);
      wgmma_fence();
      issue_accumulate<kDtype>(acc_dk, ds_frag, q_mn_desc);
      if constexpr (kSlabDq) {
        float acc_dq[1][8][4];
        dq_share_after_dv<kDtype, kHeadDim, kBlockM, kBlockN>(acc_dq, p_frag, acc_dv, sds_step,
                                                              sk, kt_frag, wg);
        if constexpr (kHeadDim == 64)
          stage_dq_pair(acc_dq, sdq, dq_empty, dq_pair, i, wg);
        else
          stage_dq_share(acc_dq, sdq + wg * kDqSlabBytes, dq_empty, i);
      }
    }
    // (the fragments feed the products until they complete: held past the wait)
    wgmma_wait<0>();
    if constexpr (kDv) {
      fence_registers(p_frag);
      fence_registers(acc_dv);
    }
    if constexpr (kDk) {
      fence_registers(ds_frag);
      fence_registers(acc_dk);
    }
    if constexpr (kProducer) ring.release(stage, phase, lane);
    else if ((stage ^= 1) == 0) phase ^= 1;
  }
  bwd_trace(tid == 0, kBwdLoopEnd);
  // dv, then dk, through each warp's rows of V's tile where the registers allow it (with a
  // producer, and at d = 64; elsewhere ptxas spilled 8-212 bytes): only this warpgroup's
  // products read its rows there, and they are done once all four of its warps are past
  // the loop. (From registers, half a sector a quad store: the epilogue took 6 us of a
  // d = 128 CTA's 45 on an H200, 13 % of the launch at 1k tokens a sequence.)
  constexpr bool kStagedGrads = kProducer || kHeadDim == 64;
  const int rows = rows_out - key0;
  u16* dk = reinterpret_cast<u16*>(g.dk) + t.b * g.dk_batch_stride + h_k * g.dk_head_stride +
            k_row * g.dk_row_stride;
  u16* dv = reinterpret_cast<u16*>(g.dv) + t.b * g.dv_batch_stride + h_k * g.dv_head_stride +
            k_row * g.dv_row_stride;
  if constexpr (kStagedGrads) {
    // (i64{..}, int{..}: the stride and head dim read here, as in the code the A/B timed)
    warpgroup_barrier(wg);
    if constexpr (kDv)
      store_rows_staged<kDtype, kBlockN, kHeadDim, kHeadDim>(
          acc_dv, dv, i64{g.dv_row_stride}, rows, int{p.head_dim}, sv, warp_row0, warp_row0,
          lane);
    if constexpr (kDk) {
      if constexpr (kDv) __syncwarp();  // (the warp's dv rows read back)
      store_rows_staged<kDtype, kBlockN, kHeadDim, kHeadDim>(
          acc_dk, dk, i64{g.dk_row_stride}, rows, int{p.head_dim}, sv, warp_row0, warp_row0,
          lane);
    }
  } else {
    if constexpr (kDk)
      store_rows<kDtype>(acc_dk, dk, g.dk_row_stride, warp_row0, rows, p.head_dim, lane);
    if constexpr (kDv)
      store_rows<kDtype>(acc_dv, dv, g.dv_row_stride, warp_row0, rows, p.head_dim, lane);
  }
  bwd_trace(tid == 0, kBwdStored);
}

// -- the persistent fused kernel (d = 64): bwd_dkdv_sm90_kernel's fused case (two
//    warpgroups of 64 keys, 64-query steps, a producer warpgroup, TMA), but a CTA an SM
//    that takes key blocks one after another: its first is blockIdx.x, the next ones
//    come from g.tile_counter (zeroed by the preprocess), so that they go as the SMs free
//    up, heaviest first, as the launch's own CTAs did. K and V have two buffers: the next
//    block's are copied in its first step's group, under this block's last steps, and a
//    buffer is free again once the consumers' stores have read it back (kv_empty). The
//    steps keep one count across blocks, so the Q/dout ring, the dS tiles and dq's slabs
//    run on without a break. Key blocks that no query sees (no steps) are written as zeros
//    by the consumers alone and take no K/V buffer. (A CTA a block spent 3-4 us of a 20-45
//    us CTA at 1k tokens on its prologue, and left a gap to the next CTA: 11-13 % each at
//    d = 64 causal.) --
enum : int { kTileReaders = 8 + 3 };  // (the consumer warps, the producer's other warps)
struct TileRing {  // a key block's number, handed from the producer's thread 0 to the others
  u32 bars;  // full[2] (thread 0's arrival), empty[2] (kTileReaders), then the numbers (int[2])
  __device__ __forceinline__ u32 full(int n) const { return bars + 8 * (n & 1); }
  __device__ __forceinline__ u32 empty(int n) const { return bars + 16 + 8 * (n & 1); }
  __device__ __forceinline__ u32 slot(int n) const { return bars + 32 + 4 * (n & 1); }
  __device__ __forceinline__ void init() const {
    for (int s = 0; s < 2; ++s) mbar_init(full(s), 1), mbar_init(empty(s), kTileReaders);
  }
  // thread 0: block n's number, once the slot's block n - 2 has been read by every reader
  __device__ __forceinline__ void put(int n, int tile) const {
    if (n >= 2) mbar_wait(empty(n), ((n >> 1) - 1) & 1);
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(slot(n)), "r"(tile) : "memory");
    mbar_arrive(full(n));
  }
  // a reader warp: block n's number
  __device__ __forceinline__ int get(int n, int lane) const {
    mbar_wait(full(n), (n >> 1) & 1);
    int tile;
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(tile) : "r"(slot(n)) : "memory");
    __syncwarp();
    if (lane == 0) mbar_arrive(empty(n));
    return tile;
  }
};

template <int kDtype, int kMask, int kStages>
__global__ void __launch_bounds__(384, 1)
    bwd_dkdv_persistent_sm90_kernel(const FwdParams p, const BwdParams g,
                                    const __grid_constant__ TensorMaps maps) {
  constexpr int kHeadDim = 64, kBlockM = 64, kBlockN = 128, kThreads = 256;
  constexpr int kQTiles = kBlockM / 8, kDTiles = kHeadDim / 8;
  constexpr int kTileBytes = kBlockM * kHeadDim * 2;
  constexpr int kStageBytes = (2 * kTileBytes + 8 * kBlockM + 1023) / 1024 * 1024;
  constexpr int kKVBytes = kBlockN * kHeadDim * 2;
  constexpr int kDsBytes = kBlockM * kBlockN * 2;
  constexpr int kProducerThreads = Ring<kStages>::kProducerThreads;
  constexpr int kStatsThread0 = kProducerThreads - kBlockM;  // (lse and D: the last warps)
  // (the producer walks the key blocks too: with 24 registers it spilled 500 bytes, with
  // 56 140; the consumers fit in 216)
  constexpr int kProducerRegs = 72, kConsumerRegs = 216;
  static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= 384 * 168, "the launch's registers");
  extern __shared__ unsigned char smem_raw[];
  const u32 base = (smem_u32(smem_raw) + 1023) & ~1023u;
  unsigned char* smem = smem_raw + (base - smem_u32(smem_raw));
  // K and V (two buffers), the steps' ring, two dS tiles, the slabs (stage_dq_pair's
  // three), then the mbarriers: the ring's, dq_empty, DqPair's, kv_empty[2], TileRing's;
  // then the sender's record of each stage's block of sums (u64[kStages])
  const u32 sstages = base + 4 * kKVBytes;
  unsigned char* stages = smem + 4 * kKVBytes;
  const u32 sds = sstages + kStages * kStageBytes, sdq = sds + 2 * kDsBytes;
  const Ring<kStages> ring{sdq + 3 * kDqSlabBytes};
  const u32 dq_empty = ring.bars + 16 * kStages;
  const DqPair dq_pair{dq_empty + 8};
  const u32 kv_empty = dq_empty + 40;
  const TileRing tiles{kv_empty + 16};
  u64* sent_to = reinterpret_cast<u64*>(smem + (tiles.bars + 40 - base));
  if (threadIdx.x == 0) {
    ring.init(kThreads);
    mbar_init(dq_empty, 1);
    dq_pair.init();
    mbar_init(kv_empty, 8);
    mbar_init(kv_empty + 8, 8);
    tiles.init();
    fence_barrier_init();
  }
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int group = p.nheads / p.nheads_k;
  int* counter = reinterpret_cast<int*>(g.tile_counter);

  if (threadIdx.x < kProducerThreads) {
    setmaxnreg_dec<kProducerRegs>();
    const int stats_r = static_cast<int>(threadIdx.x) - kStatsThread0;
    int tile = static_cast<int>(blockIdx.x);
    int step = 0, kv_blocks = 0;  // (steps and blocks with steps so far)
    for (int n = 0;; ++n) {
      if (warp == 0) {
        if (lane == 0) tiles.put(n, tile);
        tile = __shfl_sync(0xffffffffu, tile, 0);
      } else {
        tile = tiles.get(n, lane);
      }
      KeyBlock kb;
      if (!key_block<kMask, kBlockM, kBlockN>(p, g, kb, tile)) break;
      int upcoming = 0;  // (thread 0: the next block, its atomic's wait at the next put)
      if (threadIdx.x == 0) upcoming = static_cast<int>(gridDim.x) + atomicAdd(counter, 1);
      const Tile& t = kb.t;
      const int steps = group * kb.m_blocks;
      if (steps) {
        const int buffer = kv_blocks & 1;
        if (kv_blocks >= 2) mbar_wait(kv_empty + 8 * buffer, ((kv_blocks >> 1) - 1) & 1);
        ++kv_blocks;
        const u32 sk = base + buffer * 2 * kKVBytes;
        const TilePointers kv = tile_pointers(p, t);
        const auto head_of = [&](int i) { return kb.h_k * group + i / kb.m_blocks; };
        const auto q0_of = [&](int i) { return (kb.m_block_min + i % kb.m_blocks) * kBlockM; };
        const i64 seq_row = dq_accum_seq_row(p, t);
        for (int i = 0; i < steps; ++i, ++step) {
          const int stage = step % kStages;
          if (step >= kStages) {
            mbar_wait(ring.empty(stage), ((step / kStages) & 1) ^ 1);
            // (the sender: the sums of the step that last used this stage)
            send_dq_share<kHeadDim>(reinterpret_cast<float*>(sent_to[stage]), sdq);
          }
          Tile th = t;
          th.h = head_of(i);
          const int q0 = q0_of(i);
          if (threadIdx.x == kDqSender)
            sent_to[stage] = reinterpret_cast<u64>(
                reinterpret_cast<float*>(g.dq_accum) + t.b * g.dq_accum_batch_stride +
                th.h * g.dq_accum_head_stride + (seq_row + q0) * g.dq_accum_row_stride);
          if (i == 0) {
            load_panels<kBlockN, kHeadDim, kProducerThreads>(
                sk, kv.k + kb.key0 * p.k_row_stride, p.k_row_stride, t.seqlen_k - kb.key0,
                p.head_dim);
            load_panels<kBlockN, kHeadDim, kProducerThreads>(
                sk + kKVBytes, kv.v + kb.key0 * p.v_row_stride, p.v_row_stride,
                t.seqlen_k - kb.key0, p.head_dim);
          }
          // lse and D (a row a thread of the last warps), then Q and dout by TMA or copies
          float* s_stats =
              reinterpret_cast<float*>(stages + stage * kStageBytes + 2 * kTileBytes);
          const i64 stats_at = row_stats_offset(p, th) + q0 + stats_r;
          const bool stats_valid = q0 + stats_r < t.seqlen_q;
          if (stats_r >= 0) {
            cp_async_4(smem_u32(s_stats + stats_r),
                       reinterpret_cast<const float*>(p.lse) + stats_at, stats_valid ? 4 : 0);
            cp_async_4(smem_u32(s_stats + kBlockM + stats_r),
                       reinterpret_cast<const float*>(g.softmax_d) + stats_at,
                       stats_valid ? 4 : 0);
          }
          const u32 sq = sstages + stage * kStageBytes;
          const bool packed = p.cu_seqlens_q != 0;
          if (!tma_step_pair<kBlockM, kHeadDim>(p, maps, sq, sq + kTileBytes, ring.full(stage),
                                                static_cast<int>(packed ? t.q_start : 0) + q0,
                                                t.seqlen_q - q0, th.h, t.b, packed)) {
            const TilePointers ptr = tile_pointers(p, th);
            const u16* dout = reinterpret_cast<const u16*>(g.dout) + th.b * g.dout_batch_stride +
                              th.h * g.dout_head_stride + (th.q_start + q0) * g.dout_row_stride;
            load_panels<kBlockM, kHeadDim, kProducerThreads>(
                sq, ptr.q + q0 * p.q_row_stride, p.q_row_stride, t.seqlen_q - q0, p.head_dim);
            load_panels<kBlockM, kHeadDim, kProducerThreads>(
                sq + kTileBytes, dout, g.dout_row_stride, t.seqlen_q - q0, p.head_dim);
          }
          cp_async_commit();
          // the step announced once its copies have landed (lse into log2 units first)
          cp_async_wait<0>();
          if (stats_r >= 0) s_stats[stats_r] = lse_log2_of(s_stats + stats_r, 0, stats_valid);
          fence_proxy_async();
          __syncwarp();
          if (lane == 0) mbar_arrive(ring.full(stage));
          if (step >= kStages) free_dq_slabs(dq_empty);
        }
      }
      if (threadIdx.x == 0) tile = upcoming;
    }
    // the last steps' sums, once released
    for (int j = max(0, step - kStages); j < step; ++j) {
      mbar_wait(ring.empty(j % kStages), (j / kStages) & 1);
      send_dq_share<kHeadDim>(reinterpret_cast<float*>(sent_to[j % kStages]), sdq);
      free_dq_slabs(dq_empty);
    }
    return;
  }

  setmaxnreg_inc<kConsumerRegs>();
  const unsigned tid = threadIdx.x - kProducerThreads;
  const int warp_row0 = (tid / 32) * 16, wg = tid / 128;
  int stage = 0, step = 0, kv_blocks = 0;
  u32 phase = 0;
  for (int n = 0;; ++n) {
    KeyBlock kb;
    if (!key_block<kMask, kBlockM, kBlockN>(p, g, kb, tiles.get(n, lane))) break;
    const Tile& t = kb.t;
    const int steps = group * kb.m_blocks;
    const int buffer = kv_blocks & 1;
    const u32 sk = base + buffer * 2 * kKVBytes, sv = sk + kKVBytes;
    const int wg_key0 = kb.key0 + wg * 64;
    const int first_key = frag_row(kb.key0 + warp_row0, 0, 0, lane);
    float acc_dk[1][kDTiles][4], acc_dv[1][kDTiles][4];
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_dk[0][dt][e] = acc_dv[0][dt][e] = 0.f;
    // K^T (DqKtFrags) and K as A fragments, as bwd_dkdv_sm90_kernel's; V stays in shared
    // memory, and under a window K too: at the consumers' 216 registers K, V and K^T
    // spilled 128 bytes, and K and K^T under a window 48
    constexpr bool kKHeld = kMask != MASK_WINDOW;
    u32 k_frag[kKHeld ? kHeadDim / 16 : 1][4];
    DqKtFrags<kHeadDim> kt_frag;
    const u64 k_desc = smem_desc(sk + wg * 64 * 128, 16, 1024);
    const u64 v_desc = smem_desc(sv + wg * 64 * 128, 16, 1024);
    for (int i = 0; i < steps; ++i, ++step) {
      ring.await_full(stage, phase);
      if (i == 0) {  // (the block's K and V came with its first step)
        if constexpr (kKHeld) load_a_frags<kBlockN, kHeadDim>(k_frag, sk, warp_row0, lane);
        load_kt_frags<kBlockN>(kt_frag, sk, wg, lane);
      }
      Tile th = t;
      th.h = kb.h_k * group + i / kb.m_blocks;
      const int q0 = (kb.m_block_min + i % kb.m_blocks) * kBlockM;
      const u32 sq = sstages + stage * kStageBytes, sdo = sq + kTileBytes;
      const float* s_lse = reinterpret_cast<const float*>(stages + stage * kStageBytes +
                                                          2 * kTileBytes);
      const float* s_d = s_lse + kBlockM;
      float st[1][kQTiles][4], dpt[1][kQTiles][4];
      wgmma_fence();
      if constexpr (kKHeld)
        issue_scores_held<kDtype, kHeadDim, kBlockM, kQTiles>(st, k_frag, smem_desc(sq, 16, 1024));
      else
        issue_scores<kDtype, kHeadDim, kBlockM, kQTiles, kBlockN>(st, k_desc,
                                                                  smem_desc(sq, 16, 1024));
      issue_scores<kDtype, kHeadDim, kBlockM, kQTiles, kBlockN>(dpt, v_desc,
                                                                smem_desc(sdo, 16, 1024));
      wgmma_wait<1>();
      fence_registers(st);
      const bool masked = block_needs_mask<kMask>(p, th, q0, min(q0 + kBlockM, t.seqlen_q),
                                                  wg_key0, wg_key0 + 64);
      float grad[1][1][4];
      probs_t<kMask, false, true>(st, grad, masked, p, th, TileMods{}, q0, first_key, s_lse,
                                  lane);
      u32 p_frag[kQTiles / 2][4], ds_frag[kQTiles / 2][4];
      pack_p<kDtype>(p_frag, st);
      wgmma_fence();
      issue_accumulate<kDtype>(acc_dv, p_frag, smem_desc(sdo, kBlockM * 128, 1024));
      wgmma_wait<1>();
      fence_registers(dpt);
#pragma unroll
      for (int nt = 0; nt < kQTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float dsum = s_d[frag_col(0, nt, e, lane)];
          dpt[0][nt][e] = st[0][nt][e] * (dpt[0][nt][e] - dsum) * p.scale;
        }
      pack_p<kDtype>(ds_frag, dpt);
      const u32 sds_step = sds + (step & 1) * kDsBytes;
      stage_ds<kBlockM, kQTiles>(ds_frag, sds_step, warp_row0, lane);
      wgmma_fence();
      issue_accumulate<kDtype>(acc_dk, ds_frag, smem_desc(sq, kBlockM * 128, 1024));
      float acc_dq[1][8][4];
      dq_share_after_dv<kDtype, kHeadDim, kBlockM, kBlockN>(acc_dq, p_frag, acc_dv, sds_step,
                                                            sk, kt_frag, wg);
      fence_registers(ds_frag);
      fence_registers(acc_dk);
      stage_dq_pair(acc_dq, sdq, dq_empty, dq_pair, step, wg);
      ring.release(stage, phase, lane);
    }
    const int rows = kb.rows_out - kb.key0;
    const i64 k_row = t.k_start + kb.key0;
    u16* dk = reinterpret_cast<u16*>(g.dk) + t.b * g.dk_batch_stride + kb.h_k * g.dk_head_stride +
              k_row * g.dk_row_stride;
    u16* dv = reinterpret_cast<u16*>(g.dv) + t.b * g.dv_batch_stride + kb.h_k * g.dv_head_stride +
              k_row * g.dv_row_stride;
    if (steps) {  // (through this warp's rows of V's buffer, then that buffer freed)
      ++kv_blocks;
      warpgroup_barrier(wg);
      store_rows_staged<kDtype, kBlockN, kHeadDim, kHeadDim>(
          acc_dv, dv, i64{g.dv_row_stride}, rows, int{p.head_dim}, sv, warp_row0, warp_row0,
          lane);
      __syncwarp();
      store_rows_staged<kDtype, kBlockN, kHeadDim, kHeadDim>(
          acc_dk, dk, i64{g.dk_row_stride}, rows, int{p.head_dim}, sv, warp_row0, warp_row0,
          lane);
      __syncwarp();
      if (lane == 0) mbar_arrive(kv_empty + 8 * buffer);
    } else {  // (zeros, from registers: no buffer)
      store_rows<kDtype>(acc_dk, dk, g.dk_row_stride, warp_row0, rows, p.head_dim, lane);
      store_rows<kDtype>(acc_dv, dv, g.dv_row_stride, warp_row0, rows, p.head_dim, lane);
    }
  }
}

}  // namespace cufa
