// Forward attention on Hopper (sm_90a): persistent, warp-specialized. One CTA per SM
// (two on 64-row tiles, below) works through tiles of 128 (64, 192) query rows of one
// (batch, head), taking the next tile of the list from a global counter when it is ready
// for one (tiles differ in cost under a causal mask; a fixed stride left some SMs twice
// the work of others). A producer warp streams Q and the K/V blocks of its tiles into
// shared memory with TMA (a ring of stages, each announced on an mbarrier), running ahead
// across tile boundaries; consumer warpgroups of 64 rows each run both products on
// wgmma (S = Q K^T from shared memory, O += P V with P from registers) and write O (from
// d = 128 through their Q stage). Two consumers take turns issuing their products (named
// barriers), so one's softmax runs under the other's matrix work.
#include "../common/sm80.cuh"
#include "params.cuh"
#include "block_info.cuh"
#include "mask.cuh"
#include "../common/softmax.cuh"
#include "score.cuh"
#include "../common/sm90.cuh"
#include "../common/wgmma_ops.cuh"

namespace cufa {

// Three shapes: 128-row tiles, two consumers, one CTA per SM (d > 64); 192-row tiles,
// three consumers, one CTA per SM (d = 64, whose loop is short on matrix work per
// exponential: a third warpgroup keeps the matrix units fed, +3-12 % in NOTES.md step
// 33); or 64-row tiles, one consumer, two CTAs per SM (short sequences, whose tiles are
// mostly partial: half the rounding of query rows, and the SM's two CTAs hide each
// other's per-tile latency the way the turns do for two consumers).
template <int kBlockM> constexpr int kConsumers = kBlockM / 64;
template <int kBlockM> constexpr int kSm90Threads = 128 * (1 + kConsumers<kBlockM>);
template <int kBlockM> constexpr int kCtasPerSm = kBlockM == 64 ? 2 : 1;
template <int kBlockM> constexpr int kProducerRegs = kBlockM == 192 ? 32 : 56;
// 128 x 56 + 256 x 224 = 384 x 168, 128 x 32 + 384 x 160 = 512 x 128 and
// 128 x 56 + 128 x 200 = 256 x 128: the launch allotments (at 152 the three consumers
// spill; the producer fits in 32)
template <int kBlockM> constexpr int kConsumerRegs = kBlockM == 64 ? 200 : kBlockM == 192 ? 160 : 224;
// Two consumers take turns issuing; three (192-row tiles at d = 64) issue freely.
template <int kBlockM> constexpr bool kTurns = kConsumers<kBlockM> == 2;
constexpr int kTurnBarrier = 1;        // named barriers 1, 2: consumer 0's turn, consumer 1's

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

// -- the producer warp loads a tile into the panel layout with cp.async: rows past
//    `rows_valid`, columns past `head_dim` as zeros --
template <int kRows, int kHeadDim>
__device__ __forceinline__ void load_panels(u32 smem, const u16* gmem, i64 row_stride,
                                            int rows_valid, int head_dim) {
  copy_tile_async<kRows, kHeadDim, 32>(smem, gmem, row_stride, rows_valid, head_dim,
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

// lse of this thread's two rows (rows row_base + lane / 4 and + 8), one lane of each quad
__device__ __forceinline__ void write_lse(const float (&lse)[1][2], int seqlen_q, float* lse_ptr,
                                          int row_base, int lane) {
  if ((lane & 3) != 0) return;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = frag_row(row_base, 0, 2 * h, lane);
    if (row < seqlen_q) lse_ptr[row] = lse[0][h];
  }
}

// -- epilogue, head dims from 128: each warp's 16 rows through its own rows of the tile's
//    Q stage (read for the last time by now), then out in 16-byte chunks, whole rows per
//    store. Straight from registers each quad stores 16 bytes of a row at a time, half a
//    32-byte sector, with four times the store instructions: 7-13 % slower on short
//    sequences at d = 128. At d = 64 the direct stores measured 2-3 % faster (the Q stage
//    is then released at the last Q K^T, not after the epilogue) --
template <int kHeadDim>
constexpr bool kStagedOutput = kHeadDim >= 128;

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
template <int kBlockM, int kBlockN, bool kScoreMods>
constexpr bool kHalfFirstBlock = kBlockN == 128 && kBlockM <= 128 && !kScoreMods;

// row_base: the first of this warp's 16 rows in the sequence; row0: the tile's first
template <int kDtype, int kBlockM, int kHeadDim, int kDTiles>
__device__ __forceinline__ void write_output_staged(const float (&o)[1][kDTiles][4],
                                                    const float (&lse)[1][2], const FwdParams& p,
                                                    int seqlen_q, u16* o_ptr, float* lse_ptr,
                                                    u32 q_stage_smem, int row0, int row_base,
                                                    int lane) {
  const int warp_row0 = row_base - row0;  // in the tile, so in the Q stage
  // A 16 x 16 block a stmatrix: matrices 0 and 1 are the warp's rows 0-7 and 8-15 of
  // chunk 2j, 2 and 3 those of chunk 2j + 1 (a quarter of the stores of 4-byte pairs)
  static_assert(kDTiles % 2 == 0, "stmatrix stores 16-column pairs of chunks");
  const int lane_row = warp_row0 + (lane & 15), lane_chunk = lane >> 4;
#pragma unroll
  for (int j = 0; j < kDTiles / 2; ++j)
    stmatrix_x4(q_stage_smem + panel_offset<kBlockM>(lane_row, 2 * j + lane_chunk),
                pack2<kDtype>(o[0][2 * j][0], o[0][2 * j][1]),
                pack2<kDtype>(o[0][2 * j][2], o[0][2 * j][3]),
                pack2<kDtype>(o[0][2 * j + 1][0], o[0][2 * j + 1][1]),
                pack2<kDtype>(o[0][2 * j + 1][2], o[0][2 * j + 1][3]));
  __syncwarp();
  // (What a store does not change is worked out once: the warp's first row in memory and
  // in the stage, a multiple of 16 rows, so the swizzle sees only r.)
  constexpr int kChunks = kHeadDim / 8;
  u16* const o_rows = o_ptr + row_base * p.o_row_stride;
  const u32 stage_rows = q_stage_smem + warp_row0 * 128;
  const int rows_left = seqlen_q - row_base;
#pragma unroll 4
  for (int i = 0; i < 16 * kChunks / 32; ++i) {
    const int idx = i * 32 + lane;
    const int r = idx / kChunks, c = idx % kChunks;
    if (r < rows_left && c * 8 < p.head_dim)
      st_global_v4(o_rows + r * p.o_row_stride + c * 8,
                   ld_shared_v4(stage_rows + panel_offset<kBlockM>(r, c)));
  }
  if (p.lse) write_lse(lse, seqlen_q, lse_ptr, row_base, lane);  // lse asked for
}

template <int kDtype, int kDTiles>
__device__ __forceinline__ void write_output_direct(const float (&o)[1][kDTiles][4],
                                                    const float (&lse)[1][2], const FwdParams& p,
                                                    int seqlen_q, u16* o_ptr, float* lse_ptr,
                                                    int row_base, int lane) {
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
  }
  if (p.lse) write_lse(lse, seqlen_q, lse_ptr, row_base, lane);  // lse asked for
}

// -- shared memory: Q stages, the K/V ring, the mbarriers. The CTA's key blocks are
//    counted over all its tiles: block g sits in stage g % kStages, whose barriers are
//    then on their (g / kStages)-th phase; tile number n's Q likewise in Q stage
//    n % kQStages (two where they fit, so the next tile's Q loads during this one), and
//    the producer hands the consumers that tile in the slot tile() + 32 * s --
template <int kBlockM_, int kHeadDim_, int kBlockN_, int kQStages_, int kStages_>
struct Sm90Smem {
  static constexpr int kBlockM = kBlockM_, kHeadDim = kHeadDim_, kBlockN = kBlockN_;
  // K/V ring depth: two stages (three measured no faster: NOTES.md), or one where two do
  // not fit (d = 256's 128-key blocks: the loop then waits for each product, as cuDNN's)
  static constexpr int kQStages = kQStages_, kStages = kStages_;
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;
  // Offsets from q, the 1024-aligned base; stage s of K at k() + s * kKVBytes, stage s's
  // barrier at + 8 * s. (Addresses are computed, not stored: the producer warp has few
  // registers, and arrays indexed at run time would go to local memory.)
  static constexpr u32 kK = kQStages * kQBytes, kV = kK + kStages * kKVBytes;
  static constexpr u32 kQFull = kV + kStages * kKVBytes, kQEmpty = kQFull + 8 * kQStages;
  static constexpr u32 kKFull = kQEmpty + 8 * kQStages, kVFull = kKFull + 8 * kStages;
  static constexpr u32 kKEmpty = kVFull + 8 * kStages, kVEmpty = kKEmpty + 8 * kStages;
  static constexpr u32 kTile = (kVEmpty + 8 * kStages + 15) & ~15u;
  u32 q;

  // dynamic shared memory is 16-byte aligned; the swizzle needs 1024
  __device__ explicit Sm90Smem(u32 base) : q((base + 1023) & ~1023u) {}
  __device__ u32 k() const { return q + kK; }
  __device__ u32 v() const { return q + kV; }
  __device__ u32 q_full() const { return q + kQFull; }
  __device__ u32 q_empty() const { return q + kQEmpty; }
  __device__ u32 k_full() const { return q + kKFull; }
  __device__ u32 v_full() const { return q + kVFull; }
  __device__ u32 k_empty() const { return q + kKEmpty; }
  __device__ u32 v_empty() const { return q + kVEmpty; }
  __device__ u32 tile() const { return q + kTile; }
  __device__ static u32 stage(int g) { return static_cast<u32>(g % kStages); }
  __device__ static u32 parity(int g) { return static_cast<u32>((g / kStages) & 1); }
  __device__ static u32 q_stage(int n) { return static_cast<u32>(n % kQStages); }
  __device__ static u32 q_parity(int n) { return static_cast<u32>((n / kQStages) & 1); }
};

// -- one tile's work: the tile, its rows, and its key blocks n_block_max - n_blocks ..
//    n_block_max - 1, visited last first --
struct Sm90Work {
  Tile t;
  int row0, row_end, n_block_max, n_blocks;
  int last_block_keys;  // keys of the last (highest) block some row of the tile sees
};

template <int kBlockM, int kMask, int kBlockN>
__device__ __forceinline__ Sm90Work sm90_work(const FwdParams& p, const Tile& t) {
  Sm90Work w;
  w.t = t;
  w.row0 = t.m_block * kBlockM;
  w.row_end = min(w.row0 + kBlockM, t.seqlen_q);
  const KeyRange keys = key_range<kMask>(p, t, w.row0, w.row_end);
  w.n_block_max = (keys.end + kBlockN - 1) / kBlockN;  // rows with no key: no blocks
  w.n_blocks = max(w.n_block_max - keys.begin / kBlockN, 0);
  w.last_block_keys = keys.end - (w.n_block_max - 1) * kBlockN;
  return w;
}

// -- descriptor offset (16-byte units) of k-step ks in a K-major tile of `rows` rows --
__device__ __forceinline__ u32 kstep_offset(int ks, int rows) {
  return static_cast<u32>(((ks / 4) * rows * 128 + (ks % 4) * 32) >> 4);
}

// -- S = Q K^T of one K stage, issued and committed: the block's first 8 * kTiles keys
//    (all of them, or the lower half: kHalfFirstBlock) --
template <int kDtype, int kHeadDim, int kBlockM, int kBlockN, int kTiles>
__device__ __forceinline__ void issue_qk_keys(float (&acc)[1][kTiles][4], u64 q_stage_desc,
                                              u64 k_stage_desc) {
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks)
    wgmma_ss<kDtype>(acc, desc_add(q_stage_desc, kstep_offset(ks, kBlockM)),
                     desc_add(k_stage_desc, kstep_offset(ks, kBlockN)), ks > 0);
  wgmma_commit();
}

// -- scores of the block at key0 -> probabilities, in place, over its first 8 * kTiles
//    keys: score mods, the mask where the block needs it, the online softmax's update and
//    the factor O must be rescaled by. Returns whether O needs rescaling (under a lazy max
//    most blocks do not) --
template <int kMask, bool kScoreMods, int kHeadDim, int kTiles, class Softmax>
__device__ __forceinline__ bool scores_to_probs_keys(float (&acc)[1][kTiles][4], const FwdParams& p,
                                                     const Tile& t, const TileMods& mods,
                                                     const Sm90Work& w, int row_base, int key0,
                                                     int lane, float scale_log2, Softmax& softmax,
                                                     float (&correction)[1][2]) {
  if (kScoreMods)
    apply_score_mods(acc, p, t, mods, row_base, key0, lane);
  if (block_needs_mask<kMask>(p, t, w.row0, w.row_end, key0, key0 + 8 * kTiles))
    apply_mask<kMask>(acc, p, t, row_base, key0, lane);
  bool rescale = true;
  if constexpr (kLazyRescale<kHeadDim>)
    rescale = softmax.update_lazy(acc, scale_log2, correction);
  else
    softmax.update(acc, scale_log2, correction);
  fence_registers(acc);
  return rescale;
}

// -- the producer looks each tile up once and hands it to the consumers through shared
//    memory (32 bytes a Q stage; b = -1: the end of the list): a packed batch's tile
//    takes two dependent global loads (list entry, then cu_seqlens), which the
//    consumers would otherwise wait for at every tile start. Sequence starts fit in 32
//    bits: they are clamped to the tensors' row counts, which are ints --
__device__ __forceinline__ void store_tile(u32 addr, const Tile& t, bool more) {
  asm volatile(
      "st.shared.v4.s32 [%0], {%1, %2, %3, %4};\n"
      "st.shared.v4.s32 [%0 + 16], {%5, %6, %7, %8};\n"
      ::"r"(addr), "r"(more ? t.b : -1), "r"(t.h), "r"(t.h_k), "r"(t.m_block), "r"(t.seqlen_q),
      "r"(t.seqlen_k), "r"(static_cast<int>(t.q_start)), "r"(static_cast<int>(t.k_start))
      : "memory");
}
__device__ __forceinline__ bool load_tile(u32 addr, const FwdParams& p, Tile& t) {
  int q_start, k_start;
  asm volatile(
      "ld.shared.v4.s32 {%0, %1, %2, %3}, [%8];\n"
      "ld.shared.v4.s32 {%4, %5, %6, %7}, [%8 + 16];\n"
      : "=r"(t.b), "=r"(t.h), "=r"(t.h_k), "=r"(t.m_block), "=r"(t.seqlen_q), "=r"(t.seqlen_k),
        "=r"(q_start), "=r"(k_start)
      : "r"(addr) : "memory");
  t.q_start = q_start;
  t.k_start = k_start;
  set_diag_offset(p, t);
  return t.b >= 0;
}

// -- a K and V stage the producer warp filled with cp.async (a sequence's last key
//    block): once its copies have landed, fenced for the async proxy that wgmma reads
//    through (they came through the generic one), lane 0 marks both full --
template <class Smem>
__device__ __forceinline__ void mark_copied_stage_full(const Smem& sm, u32 stage) {
  cp_async_wait_all();
  fence_proxy_async();
  __syncwarp();
  if (threadIdx.x == 0) {
    mbar_arrive(sm.k_full() + 8 * stage);
    mbar_arrive(sm.v_full() + 8 * stage);
  }
}

// -- a key block of a paged cache (block_table): boxes of whole rows inside one page by
//    TMA, each from its page (the maps view K and V as (columns, page rows, heads, pages)
//    in boxes of the page's rows, or of the largest power of two up to 128 dividing
//    kBlockN where that is fewer: api._paged_box_rows; so no box crosses a page). The
//    lanes look the boxes' pages up before the stage is free, so the lookup's latency
//    hides under that wait. The sequence's last block is copied with cp.async instead,
//    with zeros past the end: the rest of its last page is whatever the cache holds there
//    (a stray NaN would turn P = 0 into NaN). --
template <class Smem>
__device__ __forceinline__ void produce_paged_block(const FwdParams& p, const TensorMaps& maps,
                                                    const Smem& sm, const Tile& t, int key0,
                                                    int block_count) {
  constexpr int kHeadDim = Smem::kHeadDim, kBlockN = Smem::kBlockN;
  constexpr int kBlockNShift =
      kBlockN % 128 == 0 ? 7 : kBlockN % 64 == 0 ? 6 : kBlockN % 32 == 0 ? 5 : 4;
  const bool elected = threadIdx.x == 0;
  const int lane = threadIdx.x % 32;
  const u32 stage = Smem::stage(block_count), parity = Smem::parity(block_count);
  const u32 k_dst = sm.k() + stage * Smem::kKVBytes, v_dst = sm.v() + stage * Smem::kKVBytes;
  const bool reused = block_count >= Smem::kStages;
  if (key0 + kBlockN > t.seqlen_k) {
    if (reused) {
      mbar_wait(sm.k_empty() + 8 * stage, parity ^ 1);
      mbar_wait(sm.v_empty() + 8 * stage, parity ^ 1);
    }
    const TilePointers ptr = tile_pointers(p, t);
    const auto panels = [](int r, int c) { return panel_offset<kBlockN>(r, c); };
    copy_rows_async<kBlockN, kHeadDim, 32>(
        k_dst, [&](int r) { return paged_row(p, t, ptr.k, p.k_batch_stride, p.k_row_stride, key0 + r); },
        ptr.k, t.seqlen_k - key0, p.head_dim, panels, lane);
    copy_rows_async<kBlockN, kHeadDim, 32>(
        v_dst, [&](int r) { return paged_row(p, t, ptr.v, p.v_batch_stride, p.v_row_stride, key0 + r); },
        ptr.v, t.seqlen_k - key0, p.head_dim, panels, lane);
    mark_copied_stage_full(sm, stage);
    return;
  }
  const int box_shift = min(p.page_shift, kBlockNShift);
  const int boxes = kBlockN >> box_shift;  // at most 16: pages of 8 rows and more take this path
  int page = 0, page_row = 0;
  if (lane < boxes) {
    const int key = key0 + (lane << box_shift);
    const int* pages = reinterpret_cast<const int*>(p.block_table) + t.b * p.block_table_batch_stride;
    page = min(max(pages[key >> p.page_shift], 0), p.num_pages - 1);
    page_row = key & ((1 << p.page_shift) - 1);
  }
  // A box a lane, each lane issuing its own copies: one lane issuing them all, the
  // pages passed to it by shuffles, read pages of 16 at 60-65 % of a contiguous cache's
  // speed on an H100, against 85-92 % so (bench/NOTES.md)
  const auto load = [&](u32 dst, const TensorMap& map, u32 bar) {
    if (elected) mbar_arrive_expect_bytes(bar, Smem::kKVBytes);
    __syncwarp();  // the bytes expected before any box's land
    if (lane < boxes) {
#pragma unroll
      for (int panel = 0; panel < kHeadDim / 64; ++panel)
        tma_load_4d(dst + panel * kBlockN * 128 + (lane << box_shift) * 128, map, bar, panel * 64,
                    page_row, t.h_k, page);
    }
  };
  if (reused) mbar_wait(sm.k_empty() + 8 * stage, parity ^ 1);
  load(k_dst, maps.k, sm.k_full() + 8 * stage);
  if (reused) mbar_wait(sm.v_empty() + 8 * stage, parity ^ 1);
  load(v_dst, maps.v, sm.v_full() + 8 * stage);
  __syncwarp();
}

// -- the producer's K and V copies of key block `it` of a tile, the CTA's block number
//    `block_count` --
template <class Smem>
__device__ __forceinline__ void produce_block(const FwdParams& p, const TensorMaps& maps,
                                              const Smem& sm, const Sm90Work& w, int it,
                                              int block_count) {
  constexpr int kHeadDim = Smem::kHeadDim, kBlockN = Smem::kBlockN;
  const bool elected = threadIdx.x == 0;
  const bool packed = p.cu_seqlens_k != 0;
  const Tile& t = w.t;
  const int key0 = (w.n_block_max - 1 - it) * kBlockN;
  if (p.block_table) {
    produce_paged_block(p, maps, sm, t, key0, block_count);
    return;
  }
  const u32 stage = Smem::stage(block_count), parity = Smem::parity(block_count);
  const u32 k_dst = sm.k() + stage * Smem::kKVBytes, v_dst = sm.v() + stage * Smem::kKVBytes;
  if (block_count >= Smem::kStages) mbar_wait(sm.k_empty() + 8 * stage, parity ^ 1);
  // (map, row coordinate, last coordinate) of this block's K and V boxes
  const TensorMap *k_map = &maps.k, *v_map = &maps.v;
  int row = static_cast<int>(t.k_start) + key0, last = packed ? 0 : t.b;
  if (packed && key0 + kBlockN > t.seqlen_k) {
    const int shift = key0 + kBlockN - t.seqlen_k;  // rows of the box past the sequence
    if (p.kv_tail_maps && row >= shift) {
      k_map = &maps.k_tail;
      v_map = &maps.v_tail;
      last = row - shift;
      row = shift;
    } else {
      if (block_count >= Smem::kStages) mbar_wait(sm.v_empty() + 8 * stage, parity ^ 1);
      const TilePointers ptr = tile_pointers(p, t);
      load_panels<kBlockN, kHeadDim>(k_dst, ptr.k + key0 * p.k_row_stride, p.k_row_stride,
                                     t.seqlen_k - key0, p.head_dim);
      load_panels<kBlockN, kHeadDim>(v_dst, ptr.v + key0 * p.v_row_stride, p.v_row_stride,
                                     t.seqlen_k - key0, p.head_dim);
      mark_copied_stage_full(sm, stage);
      return;
    }
  }
  if (elected) {
    mbar_arrive_expect_bytes(sm.k_full() + 8 * stage, Smem::kKVBytes);
    tma_load_panels<kBlockN, kHeadDim>(k_dst, *k_map, sm.k_full() + 8 * stage, row, t.h_k, last);
  }
  if (block_count >= Smem::kStages) mbar_wait(sm.v_empty() + 8 * stage, parity ^ 1);
  if (elected) {
    mbar_arrive_expect_bytes(sm.v_full() + 8 * stage, Smem::kKVBytes);
    tma_load_panels<kBlockN, kHeadDim>(v_dst, *v_map, sm.v_full() + 8 * stage, row, t.h_k, last);
  }
  __syncwarp();
}

// -- the last CTA out of the tile loop zeroes the tile counter (and its count of CTAs
//    out, counter[1]) for the next launch on the stream, so the host needs no memset:
//    every CTA has then taken its last tile, so no atomicAdd on counter[0] is to come --
__device__ __forceinline__ void leave_tile_loop(u32* counter) {
  __threadfence();  // our last counter[0] atomic before our count below
  if (atomicAdd(counter + 1, 1u) == gridDim.x - 1) {
    __threadfence();  // every other CTA's counter[0] atomics before the reset
    atomicExch(counter, 0u);
    atomicExch(counter + 1, 0u);
  }
}

// -- producer: one warp; lane 0 issues TMA copies, whose bytes complete the stage's
//    barrier. A packed batch's last key block must not bring in the next sequence's rows
//    (a stray inf there would turn P = 0 into NaN): it comes through the tail maps, whose
//    window ends with the sequence. Where the window would start before row 0 (the
//    first sequence) or the maps are missing, the warp copies it with cp.async, which
//    fills those rows with zeros. All lanes wait for every stage, so none runs a phase
//    ahead of the barriers. Every tile, with keys or not, and the end of the list pass
//    through a Q stage, which carries the tile to the consumers. --
template <int kMask, class Smem>
__device__ __forceinline__ void produce(const FwdParams& p, const TensorMaps& maps, const Smem& sm) {
  constexpr int kQStages = Smem::kQStages;
  const bool elected = threadIdx.x == 0;
  const bool packed = p.cu_seqlens_k != 0;
  u32* counter = reinterpret_cast<u32*>(p.tile_counter);
  int block_count = 0, tile_count = 0;
  for (u32 index = blockIdx.x;; ++tile_count) {  // < 2^31 + gridDim.x: the host keeps tiles in int32
    Tile t{};  // stored whole even past the end of the list
    const bool more = index <= 0x7fffffffu && get_tile(p, static_cast<int>(index), t);
    const Sm90Work w = sm90_work<Smem::kBlockM, kMask, Smem::kBlockN>(p, t);
    const u32 q_stage = Smem::q_stage(tile_count);
    if (tile_count >= kQStages) mbar_wait(sm.q_empty() + 8 * q_stage, Smem::q_parity(tile_count) ^ 1);
    if (elected) {
      store_tile(sm.tile() + 32 * q_stage, t, more);
      if (more && w.n_blocks > 0) {
        mbar_arrive_expect_bytes(sm.q_full() + 8 * q_stage, Smem::kQBytes);
        tma_load_panels<Smem::kBlockM, Smem::kHeadDim>(sm.q + q_stage * Smem::kQBytes, maps.q,
                                               sm.q_full() + 8 * q_stage,
                                               static_cast<int>(t.q_start) + w.row0, t.h,
                                               packed ? 0 : t.b);
      } else {
        mbar_arrive(sm.q_full() + 8 * q_stage);  // the tile alone
      }
    }
    if (!more) {
      if (elected) leave_tile_loop(counter);
      break;
    }
    u32 next = 0;
    if (elected) next = atomicAdd(counter, 1u);  // in flight while the K/V copies go out
    for (int it = 0; it < w.n_blocks; ++it, ++block_count)
      produce_block(p, maps, sm, w, it, block_count);
    index = gridDim.x + __shfl_sync(0xffffffffu, next, 0);
  }
}

// -- a K or V stage is released by one thread a consumer warpgroup (as FA3's and cuDNN's
//    consumers do; an arrival from all 128 measured slower on short causal rows, NOTES.md
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

// -- a consumer warpgroup: 64 rows of every tile --
template <int kDtype, int kMask, bool kScoreMods, bool kHoldPVWait, class Smem>
__device__ __forceinline__ void consume(const FwdParams& p, const Smem& sm, int consumer) {
  constexpr int kBlockM = Smem::kBlockM, kHeadDim = Smem::kHeadDim, kBlockN = Smem::kBlockN;
  constexpr int kNTiles = kBlockN / 8;
  constexpr int kDTiles = kHeadDim / 8;
  const int lane = threadIdx.x % 32;
  const float scale_log2 = kScoreMods ? 1.f : p.scale_log2;  // score mods leave log2 units
  // K-major Q and K: 8-row groups 1024 bytes apart; 16 columns (32 bytes) per k-step
  // inside a panel. MN-major V: 64-column panels kBlockN * 128 bytes apart, 8-key
  // groups 1024 bytes apart; 16 keys (2048 bytes) per k-step.
  const u64 q_desc = smem_desc(sm.q + consumer * 64 * 128, 16, 1024);
  const u64 k_desc = smem_desc(sm.k(), 16, 1024);
  const u64 v_desc = smem_desc(sm.v(), kBlockN * 128, 1024);
  constexpr u32 kStageStep = Smem::kKVBytes >> 4;

  int block_count = 0;
  bool took_turns = false;
  for (int tile_count = 0;; ++tile_count) {
    const u32 q_stage = Smem::q_stage(tile_count);
    mbar_wait(sm.q_full() + 8 * q_stage, Smem::q_parity(tile_count));
    Tile t;
    if (!load_tile(sm.tile() + 32 * q_stage, p, t)) break;
    Sm90Work w = sm90_work<kBlockM, kMask, kBlockN>(p, t);
    // The key-block count drives the stage indices and so every wgmma descriptor. Read
    // from shared memory, ptxas cannot tell it is the same across the warp; broadcast
    // from lane 0, it is, and the descriptors stay in uniform registers (no R2UR moves
    // and vector adds before each wgmma).
    w.n_blocks = __shfl_sync(0xffffffffu, w.n_blocks, 0);
    // A tile whose rows all fall to consumer 0 (a sequence's last 64 or fewer): consumer
    // 1 only releases its stages, and consumer 0 issues without taking turns. (Not at
    // head dim 256: with the extra branch ptxas spills there.)
    const bool solo = !kTurns<kBlockM> || (kHeadDim < 256 && w.row0 + 64 >= w.row_end);
    // A consumer whose 64 rows lie past the tile's end only releases the stages.
    const bool idle = kTurns<kBlockM> ? solo && consumer == 1 : w.row0 + 64 * consumer >= w.row_end;
    if (idle) {
      mbar_arrive(sm.q_empty() + 8 * q_stage);
      release_blocks(sm, w.n_blocks, block_count);
      continue;
    }
    const int row_base = w.row0 + consumer * 64 + ((threadIdx.x / 32) % 4) * 16;  // this warp's rows
    float acc_o[1][kDTiles][4];
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[0][dt][e] = 0.f;
    OnlineSoftmax<1, kSoftmaxChains<kHeadDim>> softmax;
    softmax.init();

    if (w.n_blocks > 0) {
      const TileMods mods = tile_mods<kScoreMods>(p, t);
      const int n_blocks = w.n_blocks;
      const u64 q_stage_desc = desc_add(q_desc, q_stage * (Smem::kQBytes >> 4));
      auto issue_qk = [&](float (&acc_s)[1][kNTiles][4], u32 stage) {
        issue_qk_keys<kDtype, kHeadDim, kBlockM, kBlockN>(acc_s, q_stage_desc,
                                                          desc_add(k_desc, stage * kStageStep));
      };
      u32 p_prev[kNTiles / 2][4];
      auto issue_pv = [&](u32 stage) {
        const u64 v_stage_desc = desc_add(v_desc, stage * kStageStep);
#pragma unroll
        for (int kk = 0; kk < kNTiles / 2; ++kk)
          wgmma_rs<kDtype>(acc_o, p_prev[kk], desc_add(v_stage_desc, kk * 16 * 128 >> 4), 1);
        wgmma_commit();
      };
      // Scores of block `it` -> probabilities (in place), and the factor O must be
      // rescaled by; then, once the previous P V is complete, O rescaled and P packed as
      // the A operand of this block's product.
      auto scores_to_probs = [&](float (&acc_s)[1][kNTiles][4], int it, float (&correction)[1][2]) {
        return scores_to_probs_keys<kMask, kScoreMods, kHeadDim>(
            acc_s, p, t, mods, w, row_base, (w.n_block_max - 1 - it) * kBlockN, lane, scale_log2,
            softmax, correction);
      };
      auto rescale_and_pack = [&](const float (&acc_s)[1][kNTiles][4], const float (&correction)[1][2],
                                  bool rescale) {
        if (rescale) softmax.rescale_output(acc_o, correction);
        pack_p<kDtype>(p_prev, acc_s);
      };
      if (!solo && !took_turns) {
        if (consumer == 1) pass_turn(consumer);  // consumer 0 goes first
        took_turns = true;
      }
      auto turn_begin = [&] { if (!solo) take_turn(consumer); };
      auto turn_end = [&] { if (!solo) pass_turn(consumer); };

      if constexpr (Smem::kStages == 1) {
        // One K and one V buffer (d = 256 on 128-key blocks, as cuDNN's kernel): each
        // product is waited for where it is issued, so no scores are in flight beside P
        // and O (64 + 32 + 128 registers a thread would not fit); the other consumer's
        // products fill the matrix units meanwhile, and the producer loads K_{j+1} under
        // this block's softmax and P V.
        for (int it = 0; it < n_blocks; ++it) {
          const int g = block_count + it;
          mbar_wait(sm.k_full(), Smem::parity(g));
          turn_begin();
          float acc_s[1][kNTiles][4];
          wgmma_fence();
          issue_qk(acc_s, 0);
          turn_end();
          wgmma_wait<0>();
          fence_registers(acc_s);
          release_stage(sm.k_empty());
          if (!kStagedOutput<kHeadDim> && it == n_blocks - 1) mbar_arrive(sm.q_empty() + 8 * q_stage);
          float correction[1][2];
          const bool rescale = scores_to_probs(acc_s, it, correction);
          if (it > 0 && rescale) softmax.rescale_output(acc_o, correction);
          pack_p<kDtype>(p_prev, acc_s);
          mbar_wait(sm.v_full(), Smem::parity(g));
          turn_begin();
          wgmma_fence();
          issue_pv(0);
          turn_end();
          wgmma_wait<0>();
          fence_registers(acc_o);
          release_stage(sm.v_empty());
        }
        block_count += n_blocks;
      } else {
        // Block 0: S only. Peeled, so that every product in the loop is issued
        // unconditionally: a branch around an in-flight wgmma makes ptxas serialize them all.
        {
          const u32 stage = Smem::stage(block_count);
          // (broadcast from lane 0, so that ptxas sees a uniform branch around the wgmma)
          const bool half = kHalfFirstBlock<kBlockM, kBlockN, kScoreMods> &&
                            __shfl_sync(0xffffffffu, 2 * w.last_block_keys <= kBlockN, 0);
          float acc_s[1][kNTiles][4];
          float(&lower)[1][kNTiles / 2][4] = *reinterpret_cast<float(*)[1][kNTiles / 2][4]>(&acc_s);
          mbar_wait(sm.k_full() + 8 * stage, Smem::parity(block_count));
          turn_begin();
          wgmma_fence();
          if constexpr (kHalfFirstBlock<kBlockM, kBlockN, kScoreMods>) {
            if (half)
              issue_qk_keys<kDtype, kHeadDim, kBlockM, kBlockN>(
                  lower, q_stage_desc, desc_add(k_desc, stage * kStageStep));
            else
              issue_qk(acc_s, stage);
          } else {
            issue_qk(acc_s, stage);
          }
          turn_end();
          wgmma_wait<0>();
          fence_registers(acc_s);
          release_stage(sm.k_empty() + 8 * stage);
          if (!kStagedOutput<kHeadDim> && n_blocks == 1)
            mbar_arrive(sm.q_empty() + 8 * q_stage);  // Q's last reader is done
          float correction[1][2];
          if constexpr (kHalfFirstBlock<kBlockM, kBlockN, kScoreMods>) {
            if (half) {
              scores_to_probs_keys<kMask, kScoreMods, kHeadDim>(
                  lower, p, t, mods, w, row_base, (w.n_block_max - 1) * kBlockN, lane, scale_log2,
                  softmax, correction);
#pragma unroll
              for (int nt = kNTiles / 2; nt < kNTiles; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_s[0][nt][e] = 0.f;  // P of the keys no row sees
            } else {
              scores_to_probs(acc_s, 0, correction);
            }
          } else {
            scores_to_probs(acc_s, 0, correction);
          }
          // O is still zero: rescaling it would be 0 * correction, which the compiler must
          // keep (inf and NaN), ~100 instructions a tile at d = 128
          pack_p<kDtype>(p_prev, acc_s);
        }
        // Software pipeline: iteration `it` issues S_it = Q K_it^T and O += P_{it-1} V_{it-1}
        // together, and computes the exponentials of S_it while the P V product runs.
        for (int it = 1; it < n_blocks; ++it) {
          const int g = block_count + it;
          const u32 stage = Smem::stage(g), prev_stage = Smem::stage(g - 1);
          mbar_wait(sm.k_full() + 8 * stage, Smem::parity(g));
          mbar_wait(sm.v_full() + 8 * prev_stage, Smem::parity(g - 1));
          turn_begin();
          float acc_s[1][kNTiles][4];
          wgmma_fence();
          issue_qk(acc_s, stage);
          issue_pv(prev_stage);
          turn_end();
          wgmma_wait<1>();
          fence_registers(acc_s);
          release_stage(sm.k_empty() + 8 * stage);
          if (!kStagedOutput<kHeadDim> && it == n_blocks - 1) mbar_arrive(sm.q_empty() + 8 * q_stage);
          // (P is packed only after the P V wait: the registers of the previous P feed the
          // product until it completes, and ptxas does not see that they are still in use.)
          float correction[1][2];
          const bool rescale = scores_to_probs(acc_s, it, correction);
          if constexpr (kHoldPVWait)  // the exponentials under this warpgroup's own P V
            hold_wait_below(softmax.row_sum[0][0], softmax.row_sum[0][1], sm.tile());
          wgmma_wait<0>();
          fence_registers(acc_o);
          fence_registers(p_prev);
          release_stage(sm.v_empty() + 8 * prev_stage);
          rescale_and_pack(acc_s, correction, rescale);
        }
        // -- the last block's P V --
        const int last = block_count + n_blocks - 1;
        mbar_wait(sm.v_full() + 8 * Smem::stage(last), Smem::parity(last));
        turn_begin();
        wgmma_fence();
        issue_pv(Smem::stage(last));
        turn_end();
        wgmma_wait<0>();
        fence_registers(acc_o);
        release_stage(sm.v_empty() + 8 * Smem::stage(last));
        block_count += n_blocks;
      }
    } else if (!kStagedOutput<kHeadDim>) {
      mbar_arrive(sm.q_empty() + 8 * q_stage);  // rows without keys: only the tile was read
    }

    float lse[1][2];
    softmax.finalize(acc_o, lse, scale_log2);
    const TilePointers ptr = tile_pointers(p, t);
    if constexpr (kStagedOutput<kHeadDim>) {
      write_output_staged<kDtype, kBlockM, kHeadDim>(acc_o, lse, p, t.seqlen_q, ptr.o, ptr.lse,
                                            sm.q + q_stage * Smem::kQBytes, w.row0, row_base,
                                            lane);
      // The stage's next Q comes by TMA (the async proxy) over what this warp just wrote
      // and read through the generic one.
      fence_proxy_async();
      mbar_arrive(sm.q_empty() + 8 * q_stage);
    } else {
      write_output_direct<kDtype>(acc_o, lse, p, t.seqlen_q, ptr.o, ptr.lse, row_base, lane);
    }
  }
  if (consumer == 0 && took_turns) take_turn(consumer);  // consumer 1's pass after its last turn
}

// kHoldPVWait: the P V wait held below the softmax (hold_wait_below; the host picks it,
// _compile.SM90_HOLD_PV_WAIT)
template <int kDtype, int kHeadDim, int kMask, bool kScoreMods, int kBlockM, int kBlockN,
          int kQStages, int kKVStages, bool kHoldPVWait>
__global__ void __launch_bounds__(kSm90Threads<kBlockM>, kCtasPerSm<kBlockM>)
    fwd_sm90_kernel(const __grid_constant__ FwdParams p, const __grid_constant__ TensorMaps maps) {
  static_assert(kHeadDim % 64 == 0 && kBlockN % 16 == 0, "whole 128-byte panels, 16-key steps");
  static_assert(kBlockM == 64 || kBlockM == 128 || kBlockM == 192, "one to three consumer warpgroups");
  constexpr int kConsumerThreads = 128 * kConsumers<kBlockM>;
  // setmaxnreg moves registers between warpgroups; it cannot hand out more than the
  // launch allotted (65536 an SM, shared by its CTAs)
  static_assert(128 * kProducerRegs<kBlockM> + kConsumerThreads * kConsumerRegs<kBlockM> <=
                    65536 / kCtasPerSm<kBlockM>, "register split over the SM's file");
  extern __shared__ unsigned char smem_raw[];
  const Sm90Smem<kBlockM, kHeadDim, kBlockN, kQStages, kKVStages> sm(smem_u32(smem_raw));
  if (threadIdx.x == 0) {
    for (int s = 0; s < kQStages; ++s) {
      mbar_init(sm.q_full() + 8 * s, 1);  // the producer's one arrival, plus the bytes its copies bring
      mbar_init(sm.q_empty() + 8 * s, kConsumerThreads);  // every consumer thread is done reading
    }
    for (int s = 0; s < kKVStages; ++s) {
      mbar_init(sm.k_full() + 8 * s, 1);
      mbar_init(sm.v_full() + 8 * s, 1);
      mbar_init(sm.k_empty() + 8 * s, kConsumers<kBlockM>);  // one thread a warpgroup
      mbar_init(sm.v_empty() + 8 * s, kConsumers<kBlockM>);
    }
  }
  __syncthreads();
  if (threadIdx.x < 128) {
    setmaxnreg_dec<kProducerRegs<kBlockM>>();
    if (threadIdx.x < 32) produce<kMask>(p, maps, sm);
    return;
  }
  setmaxnreg_inc<kConsumerRegs<kBlockM>>();
  // Broadcast for the same reason: the consumer index picks this warpgroup's Q rows.
  const int consumer = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128) - 1, 0);
  consume<kDtype, kMask, kScoreMods, kHoldPVWait>(p, sm, kConsumers<kBlockM> == 1 ? 0 : consumer);
}

}  // namespace cufa
