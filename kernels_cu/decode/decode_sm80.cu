// Attention of a few new query rows against a KV cache: decode, speculative decode, and
// appends of new keys. Reading the cache is the whole cost, so the kernel is built to
// keep HBM busy rather than the matrix units:
// - the query rows that share a KV head (GQA group x new tokens) form the 16 rows of one
//   mma tile, so each cache byte is read once per KV head, not once per query head;
// - each warp (4, or 2 above d = 128) streams its own 16-key tiles through a ring of
//   cp.async stages (no CTA-wide barrier in the loop); the warps' softmax states merge at
//   the end;
// - split-KV: the keys of one (sequence, KV head) are cut into num_splits chunks, each a
//   CTA, when there are too few (sequence, KV head) pairs to fill the GPU; the chunks'
//   normalized outputs merge by their lse, in decode_combine or, for an eager call whose
//   merge one pass of the CTA covers, in the chunk that finishes last (merge_if_last: a
//   launch less, of host and of GPU time; docs/decisions.md).
// decode_append runs first when the call appends keys or applies rotary embedding.
#include "cache.cuh"
#include "score.cuh"
#include "epilogue.cuh"
#include "split_merge.cuh"

namespace cufa {

// Warps and cp.async stages per head dim: enough bytes in flight to keep HBM busy (three
// CTAs share an H100 SM), within the 99 KB of shared memory that every GPU from sm_80 on
// grants a CTA. A warp's 16-key stage of K and V is 16 KB at d = 256, hence two warps
// above d = 128. kStagesWanted and kWarpsWanted (0: these) give d = 64 and 128 a shape
// with four CTAs an SM (d = 64: three stages; d = 128: two warps of three stages), that
// the planner takes where it runs the work in one wave unsplit (measured slower than the
// default at d = 64 once there are several waves). Mirrored by decode_shape and
// DECODE_MORE_CTAS in cufa/_compile.py. kFp8: an e4m3 cache, whose stages (E4m3Tile:
// rows of kHeadDim bytes and a 16-byte pad) hold a little over half the bytes, read
// straight into mma fragments (common/e4m3_mma.cuh). Above d = 256 a unit's V and O
// columns are cut in two halves, a CTA each (kColumnHalves: each computes the scores over
// all of Q and K, as the forward's wide kernel does, so that a warp's output fits its
// registers); a stage holds K's row and V's half: one warp of two 24 KB stages (Hopper's
// planner asks for two warps, DECODE_HALVES_SM90).
template <int kHeadDim, int kStagesWanted = 0, int kWarpsWanted = 0, bool kFp8 = false,
          int kMinCtasWanted = 0>
struct DecodeShape {
  static constexpr bool kColumnHalves = kHeadDim > 256;
  static constexpr int kHeadDimV = kColumnHalves ? kHeadDim / 2 : kHeadDim;  // V's and O's
  static constexpr int kWarps =
      kWarpsWanted ? kWarpsWanted : kHeadDim <= 128 ? 4 : kColumnHalves ? 1 : 2;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kStages =
      kStagesWanted ? kStagesWanted : kHeadDim <= 64 ? 4 : 2;
  // 16-key tiles a warp's softmax step folds in: two where two stages can be computing
  // while two are in flight, so the max, sum and output rescale run once per 32 keys
  static constexpr int kStepTiles = kStages >= 4 ? 2 : 1;
  // Ring tiles a warp issues before Q has landed; the rest of the ring goes out after. Q
  // waits in the memory queues behind every copy issued with it: with 6 tiles a warp
  // ahead (4 x 8 stages at 1 x 32k) Q landed after 3.6 us, with 2 after 2.0.
  static constexpr int kTilesBeforeQ = kStages - kStepTiles < 2 ? kStages - kStepTiles : 2;
  static constexpr int kTileBytes = kTileKeys * kHeadDim * 2;         // a 16-bit tile
  static constexpr int kStageTileBytes = kFp8 ? kTileKeys * E4m3Tile<kHeadDim>::kRowBytes : kTileBytes;
  static constexpr int kVTileBytes = kColumnHalves ? kTileKeys * kHeadDimV * 2 : kStageTileBytes;
  static constexpr int kWarpBytes = kStages * (kStageTileBytes + kVTileBytes);
  static constexpr int kQBytes = kDecodeRows * kHeadDim * 2;
  static constexpr int kOStride = kHeadDimV + 4;  // floats a row: rows 4 banks apart
  static_assert(kDecodeRows * kOStride * 4 <= kWarpBytes,
                "a warp's float outputs reuse its cache stages");
  static constexpr int kBytes = kQBytes + kWarps * kWarpBytes;
  // launch bounds (0: none): the e4m3 kernels ask for one CTA an SM, so that ptxas takes
  // the registers they need (unbounded, it held them to 128 and spilled at d = 128 on
  // sm_80), or on sm_90 for kMinCtasWanted (DECODE_FP8_MIN_CTAS), which they fit
  // without spilling
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static constexpr int kMinCtas = kMinCtasWanted ? kMinCtasWanted : kFp8 ? 1 : 0;
#else
  static constexpr int kMinCtas = kFp8 ? 1 : 0;
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(kBytes <= 227 * 1024, "shared memory a CTA of sm_90");
#else
  static_assert(kBytes <= 99 * 1024, "shared memory of sm_86/89");
#endif
};

// grid: (num_m_blocks * num_splits, nheads_k / kHeads, batch). kElementIO: the element-wise
// I/O variant (common/element_io.cuh), for any head dim and any strides: a warp's tile
// loads block it until they land, where cp.async keeps kStages tiles in flight. kFp8: the
// cache holds e4m3 (q and out stay kDtype): its tiles go from the stages into mma
// fragments as fp16 values, Q turned into fp16 once (common/e4m3_mma.cuh), the descales
// folded into the scores and the output.
// kHeadPairs (head_dim = kHeadDim / 2 = 64, two adjacent KV heads a CTA: head stride
// head_dim, a head's query rows at most 8): an e4m3 head's 64-byte slice of a cache row is
// half a 128-byte line, and a CTA a head read such rows at 49-66 % of copy bandwidth where
// d = 128 read 85 % (H200); a 16-bit head's 128 bytes read 1-3 % slower than two heads'
// (_heuristics.head_pairs). So a CTA takes the row of two heads as one kHeadDim-wide tile
// row, its tile rows 0-7 head A's query rows with their Q in columns 0-63 and zeros in
// 64-127, rows 8-15 head B's in 64-127: Q K^T scores each row against its own head's keys
// alone, P V gives each row its own head's output in its half (the other half unused),
// and the softmax is row by row as ever. The loop is d = 128's; the descales go by row.
template <int kDtype, int kHeadDim, int kStages, int kWarpCount, bool kElementIO = false,
          bool kFp8 = false, int kMinCtasWanted = 0, bool kHeadPairs = false>
__global__ void __launch_bounds__(
    DecodeShape<kHeadDim, kStages, kWarpCount, kFp8, kMinCtasWanted>::kThreads,
    DecodeShape<kHeadDim, kStages, kWarpCount, kFp8, kMinCtasWanted>::kMinCtas)
    decode_kernel(const DecodeParams p) {
  static_assert(!(kElementIO && kFp8), "an e4m3 cache takes the 16-byte path");
  using Shape = DecodeShape<kHeadDim, kStages, kWarpCount, kFp8, kMinCtasWanted>;
  using Elem = typename CacheElem<kFp8>::type;
  constexpr int kWarps = Shape::kWarps;
  constexpr int kHeadDimV = Shape::kHeadDimV;
  constexpr int kDTiles = kHeadDimV / 8;
  static_assert(!Shape::kColumnHalves || !(kElementIO || kFp8),
                "above d = 256: 16-bit caches of 16-byte aligned rows");
  static_assert(!kHeadPairs || kHeadDim == 128, "head pairs: two heads of d = 64");
  constexpr int kHeads = kHeadPairs ? 2 : 1;
  constexpr int kRowsPerHead = rows_per_head<kHeads>();
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ float s_warp_max[kWarps][kDecodeRows], s_warp_sum[kWarps][kDecodeRows];

  // -- which rows, keys and split (and with kColumnHalves, which half of V's columns: the
  //    low bit, so that a unit's two CTAs run side by side and K's second read hits L2) --
  const unsigned unit_x = Shape::kColumnHalves ? blockIdx.x >> 1 : blockIdx.x;
  const int col0 = Shape::kColumnHalves ? (blockIdx.x & 1) * kHeadDimV : 0;
  const int m_block = unit_x % p.num_m_blocks, split = unit_x / p.num_m_blocks;
  const int h_k = blockIdx.y;  // (a pair's index with kHeadPairs: heads 2 h_k, 2 h_k + 1)
  const int b = p.decode_order ? reinterpret_cast<const int*>(p.decode_order)[blockIdx.z] : blockIdx.z;
  if (b < 0) return;
  const CacheSeq s = cache_seq(p, b);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  // (rows: a head's)
  const int rows = min(kRowsPerHead, s.seqlen_q * p.group - m_block * kRowsPerHead);
  // (a packed batch: past this sequence's rows, or a sequence the forward kernel takes)
  if (rows <= 0 || s.seqlen_q > p.seqlen_q) return;
  const KeySpan span = visible_span(p, s.seqlen_k, s.seqlen_q, (m_block * kRowsPerHead) / p.group,
                                    (m_block * kRowsPerHead + rows - 1) / p.group);
  const int num_tiles = (span.end - span.begin + kTileKeys - 1) / kTileKeys;
  const int split_tiles = (num_tiles + p.num_splits - 1) / p.num_splits;
  const int tile_begin = min(split * split_tiles, num_tiles);
  const int tile_end = min(tile_begin + split_tiles, num_tiles);
  // this warp's tiles: tile_begin + warp, + kWarps, ...
  const int my_tiles = max(0, (tile_end - tile_begin - warp + kWarps - 1) / kWarps);

  // -- Q: the CTA's 16 rows, zeros past the last --
  const u32 sq = smem_u32(smem);
  load_q_rows<kHeadDim, Shape::kThreads, kElementIO, kHeads>(sq, p, s, m_block, h_k, rows,
                                                             threadIdx.x);
  cp_async_commit();

  // -- prologue: the first kStages - kStep tiles of this warp, a commit group each --
  constexpr int kStep = Shape::kStepTiles;
  // Page ids a step ahead: pages of 16 and 256 read 1-2 % faster at d = 128 on an H100;
  // at d = 64 (two tiles a step, more CTAs an SM) they read within +-2 %, as often
  // slower, so it keeps the lookup at the copy (docs/decisions.md).
  constexpr bool kPagesAhead = kStep == 1;
  const u32 stages = sq + Shape::kQBytes + warp * Shape::kWarpBytes;
  const int h_k0 = h_k * kHeads;  // the tile's first KV head
  const Elem* k_head = reinterpret_cast<const Elem*>(p.k) + h_k0 * p.k_head_stride;
  const Elem* v_head = reinterpret_cast<const Elem*>(p.v) + h_k0 * p.v_head_stride + col0;
  const int pair_cols = p.head_dim * kHeads;  // (cache_cols: unused with one head)
  const auto tile_key0 = [&](int i) { return span.begin + (tile_begin + warp + i * kWarps) * kTileKeys; };
  const auto stage_k = [&](int i) {
    return stages + (i % kStages) * (Shape::kStageTileBytes + Shape::kVTileBytes);
  };
  const auto ahead_pages = [&](int i) {
    return kPagesAhead && i < my_tiles ? tile_row_page(p, s, tile_key0(i), lane) : 0;
  };
  // (an e4m3 cache's whole tiles of a contiguous cache: ContiguousTiles; the rest, and the
  // 16-bit caches, whose kernels are not issue-bound and would hold more registers (d = 128:
  // 128 -> 150): load_kv_tile)
  constexpr bool kStrided = kFp8 && 32 % (kHeadDim / 16) == 0;
  using Strided = ContiguousTiles<kStrided ? kHeadDim : 32, kWarps, Elem, kHeads>;
  Strided strided(p, s, k_head, v_head, tile_key0(0), pair_cols, lane);
  const auto load_tile = [&](int i, int pages) {  // (i: each in turn)
    if (kStrided && !p.block_table && tile_key0(i) + kTileKeys <= s.seqlen_k)
      strided.load_next(stage_k(i), stage_k(i) + Shape::kStageTileBytes, p);
    else
      load_kv_tile<kHeadDim, kPagesAhead, kElementIO, Elem, kHeadDimV, kHeads>(
          stage_k(i), stage_k(i) + Shape::kStageTileBytes, p, s, k_head, v_head, tile_key0(i),
          pages, lane, pair_cols, col0);
  };
  const auto prologue_tile = [&](int i) {
    if (i < my_tiles) load_tile(i, ahead_pages(i));
    cp_async_commit();
  };
#pragma unroll
  for (int i = 0; i < Shape::kTilesBeforeQ; ++i) prologue_tile(i);
  // the page ids of the first step's copies (then each step loads the next step's)
  int next_pages[kStep];
#pragma unroll
  for (int u = 0; u < kStep; ++u) next_pages[u] = ahead_pages(kStages - kStep + u);
  cp_async_wait<Shape::kTilesBeforeQ>();  // Q (the oldest group) has landed
  __syncthreads();
  __shared__ float s_q_unit[kFp8 ? kDecodeRows : 1];  // (kFp8: Q's rows in fp16 are q over these)
  if constexpr (kFp8) {
    q_to_fp16_for_e4m3_keys<kDtype, kDecodeRows, kHeadDim, Shape::kThreads>(sq, s_q_unit, threadIdx.x);
    __syncthreads();
  }
#pragma unroll
  for (int i = Shape::kTilesBeforeQ; i < kStages - kStep; ++i) prologue_tile(i);

  const TileScoring scoring = tile_scoring<kHeads>(p, s, m_block, h_k, rows, lane);
  const bool score_mods = score_mods_on(p);
  const float scale_log2 = score_mods ? 1.f : p.scale_log2;  // score mods leave log2 units
  const LdmatrixAddr<kHeadDim> q_frag(sq, lane & 15, lane >> 4);

  // an e4m3 cache: the products run in fp16 (q_to_fp16_for_e4m3_keys), on keys and values
  // that are the cache's over e4m3_to_half_scale<FP16, true>(); each of this lane's two rows
  // (lane / 4, + 8: with kHeadPairs, one of each head) takes its scale back out of its
  // scores
  float k_scale[2] = {1.f, 1.f};
  if constexpr (kFp8) {
    const auto descale = [&](int head) {
      return cache_descale(p.k_descale, p.k_descale_batch_stride, p.k_descale_head_stride, s.b,
                           head) * e4m3_to_half_scale<FP16, true>();
    };
    const float descale_lo = descale(h_k0);
    k_scale[0] = descale_lo * s_q_unit[lane / 4];
    k_scale[1] = (kHeadPairs ? descale(h_k0 + 1) : descale_lo) * s_q_unit[lane / 4 + 8];
  }
  float acc_o[1][kDTiles][4];
  fill(acc_o, 0.f);
  OnlineSoftmax<1> softmax;
  softmax.init();

  for (int i = 0; i < my_tiles; i += kStep) {
    // -- fetch the kStep tiles after the ones in flight, into the stages the last step
    //    used, then wait for tiles i .. i + kStep - 1 --
#pragma unroll
    for (int u = 0; u < kStep; ++u) {
      const int ahead = i + kStages - kStep + u;
      if (ahead < my_tiles) load_tile(ahead, next_pages[u]);
      cp_async_commit();
      next_pages[u] = ahead_pages(ahead + kStep);
    }
    cp_async_wait<kStages - kStep>();
    __syncwarp();

    // -- compute qk of each tile (a tile past the warp's last scores -inf), score mods, mask --
    float acc_s[1][2 * kStep][4];
#pragma unroll
    for (int u = 0; u < kStep; ++u) {
      float(&tile_s)[1][2][4] = *reinterpret_cast<float(*)[1][2][4]>(&acc_s[0][2 * u]);
      const bool present = u == 0 || i + u < my_tiles;
      fill(tile_s, present ? 0.f : -CUFA_INF);
      if (present)
        score_tile<kDtype, kHeadDim, kFp8>(tile_s, q_frag, stage_k(i + u), p, s, scoring,
                                           score_mods, tile_key0(i + u), lane, k_scale[0],
                                           k_scale[1]);
    }

    // -- update m_i and l_i once for the step, rescale acc, then acc += P V per tile --
    // (an e4m3 cache: a lazy max, O rescaled only where a row of the warp was raised: its
    // loop is issue-bound, and the rescale is kHeadDim / 2 multiplies a lane a step)
    float correction[1][2];
    if constexpr (kFp8) {
      if (softmax.update_lazy(acc_s, scale_log2, correction)) softmax.rescale_output(acc_o, correction);
    } else {
      softmax.update(acc_s, scale_log2, correction);
      softmax.rescale_output(acc_o, correction);
    }
#pragma unroll
    for (int u = 0; u < kStep; ++u) {
      if (u > 0 && i + u >= my_tiles) continue;
      const float(&tile_p)[1][2][4] = *reinterpret_cast<const float(*)[1][2][4]>(&acc_s[0][2 * u]);
      accumulate_tile<kDtype, kHeadDimV, kFp8>(acc_o, tile_p, stage_k(i + u) + Shape::kStageTileBytes,
                                               lane);
    }
    __syncwarp();  // every lane is done with these stages before they are refilled
  }

  if constexpr (kFp8) {  // (a lane's outputs e = 0, 1 are row lane / 4's, 2, 3 row + 8's)
    const auto descale = [&](int head) {
      return cache_descale(p.v_descale, p.v_descale_batch_stride, p.v_descale_head_stride, s.b,
                           head) * e4m3_to_half_scale<FP16, true>();
    };
    const float v_scale_lo = descale(h_k0);
    const float v_scale[2] = {v_scale_lo, kHeadPairs ? descale(h_k0 + 1) : v_scale_lo};
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[0][dt][e] *= v_scale[e >> 1];
  }
  cp_async_wait<0>();  // (the outputs are staged over the cache stages)
  float* s_out = reinterpret_cast<float*>(smem + Shape::kQBytes);
  stage_warp_outputs<kWarps, Shape::kOStride, kFp8>(softmax, acc_o, true, s_warp_max, s_warp_sum, s_out,
                                              scale_log2);
  write_decode_output<kDtype, kHeadDimV, Shape, kElementIO, kHeads>(
      p, s, m_block, h_k, split, s_out, s_warp_max, s_warp_sum, scale_log2, col0);
  // (halves: decode_combine merges the splits; the host leaves split_counters 0)
  if constexpr (!Shape::kColumnHalves) {
    static_assert(merge_scratch_bytes(Shape::kThreads) <= kWarps * Shape::kWarpBytes,
                  "the merge's weights and partial sums fit the cache stages");
    if (p.num_splits > 1 && p.split_counters)
      merge_if_last<kDtype, Shape::kThreads, kElementIO, kHeads>(p, s, m_block, h_k, rows, s_out);
  }
}

}  // namespace cufa
