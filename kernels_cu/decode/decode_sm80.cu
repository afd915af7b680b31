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
//   launch less, of host and of GPU time; bench/NOTES.md).
// decode_append runs first when the call appends keys or applies rotary embedding.
#include "../common/types.cuh"
#include "params.cuh"
#include "../common/softmax.cuh"
#include "../common/mma_tiles.cuh"

namespace cufa {

constexpr int kDecodeRows = 16;  // query rows per CTA: one mma tile
constexpr int kTileKeys = 16;    // keys a warp takes per step

// Warps and cp.async stages per head dim: enough bytes in flight to keep HBM busy (three
// CTAs share an H100 SM), within the 99 KB of shared memory that every GPU from sm_80 on
// grants a CTA. A warp's 16-key stage of K and V is 16 KB at d = 256, hence two warps
// above d = 128. kStagesWanted and kWarpsWanted (0: these) give d = 64 and 128 a shape
// with four CTAs an SM (d = 64: three stages; d = 128: two warps of three stages), that
// the planner takes where it runs the work in one wave unsplit (measured slower than the
// default at d = 64 once there are several waves). Mirrored by decode_shape and
// DECODE_MORE_CTAS in cufa/_compile.py.
template <int kHeadDim, int kStagesWanted = 0, int kWarpsWanted = 0>
struct DecodeShape {
  static constexpr int kWarps = kWarpsWanted ? kWarpsWanted : kHeadDim <= 128 ? 4 : 2;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kStages = kStagesWanted ? kStagesWanted : kHeadDim <= 64 ? 4 : 2;
  // 16-key tiles a warp's softmax step folds in: two where two stages can be computing
  // while two are in flight, so the max, sum and output rescale run once per 32 keys
  static constexpr int kStepTiles = kStages >= 4 ? 2 : 1;
  // Ring tiles a warp issues before Q has landed; the rest of the ring goes out after. Q
  // waits in the memory queues behind every copy issued with it: with 6 tiles a warp
  // ahead (4 x 8 stages at 1 x 32k) Q landed after 3.6 us, with 2 after 2.0.
  static constexpr int kTilesBeforeQ = kStages - kStepTiles < 2 ? kStages - kStepTiles : 2;
  static constexpr int kTileBytes = kTileKeys * kHeadDim * 2;
  static constexpr int kWarpBytes = kStages * 2 * kTileBytes;  // K and V per stage
  static constexpr int kQBytes = kDecodeRows * kHeadDim * 2;
  static constexpr int kOStride = kHeadDim + 4;  // floats a row: rows 4 banks apart
  static_assert(kDecodeRows * kOStride * 4 <= kWarpBytes,
                "a warp's float outputs reuse its cache stages");
  static constexpr int kBytes = kQBytes + kWarps * kWarpBytes;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(kBytes <= 227 * 1024, "shared memory a CTA of sm_90");
#else
  static_assert(kBytes <= 99 * 1024, "shared memory of sm_86/89");
#endif
};

// -- where a sequence's keys live --
struct CacheSeq {
  int b;
  int seqlen_k;  // keys the queries attend to: cache_seqlens + seqlen_new - leftpad
  int start;     // cache position of key 0 (cache_leftpad)
  int end;       // cache position after the old keys: where the append writes
  int row;       // cache row (contiguous cache)
  const int* pages;  // block_table row (paged cache)
  int seqlen_q;  // query rows: p.seqlen_q, or a packed sequence's own
  int q_row0;    // row of query 0 in q and o (a packed batch's cu_seqlens_q; else 0)
};

// Every value read from the device is clamped, so malformed lengths or ids can make the
// result wrong but never make an access leave the arrays.
__device__ __forceinline__ CacheSeq cache_seq(const DecodeParams& p, int b) {
  CacheSeq s;
  s.b = b;
  s.pages = reinterpret_cast<const int*>(p.block_table) + b * p.block_table_batch_stride;
  if (p.cu_seqlens_q) {  // a packed batch: rows and keys from the offsets, no append
    const int* cu_q = reinterpret_cast<const int*>(p.cu_seqlens_q);
    const int* cu_k = reinterpret_cast<const int*>(p.cu_seqlens_k);
    s.q_row0 = min(max(cu_q[b], 0), p.total_q);
    s.seqlen_q = min(max(cu_q[b + 1], s.q_row0), p.total_q) - s.q_row0;
    const int keys = p.seqused_k ? reinterpret_cast<const int*>(p.seqused_k)[b]
                                 : cu_k[b + 1] - cu_k[b];
    s.start = p.block_table ? 0 : min(max(cu_k[b], 0), p.capacity);  // packed rows: row 0
    s.end = s.start + min(max(keys, 0), p.capacity - s.start);
    s.seqlen_k = s.end - s.start;
    s.row = 0;
    return s;
  }
  s.seqlen_q = p.seqlen_q;
  s.q_row0 = 0;
  const int cached = p.cache_seqlens ? reinterpret_cast<const int*>(p.cache_seqlens)[b]
                                     : p.cache_seqlen_fixed;
  s.end = min(max(cached, 0), p.capacity);
  const int used_end = min(s.end + p.seqlen_new, p.capacity);
  s.start = p.cache_leftpad ? min(max(reinterpret_cast<const int*>(p.cache_leftpad)[b], 0), used_end)
                            : 0;
  s.seqlen_k = used_end - s.start;
  s.row = p.cache_batch_idx
              ? min(max(reinterpret_cast<const int*>(p.cache_batch_idx)[b], 0), p.cache_rows - 1)
              : b;
  return s;
}

// Where cache position `pos` lives: a cache row (contiguous) or a page, and the row in it.
struct CacheSlot {
  i64 block;
  int row;
};

// Position `pos` in page `page` (an id as the block table holds it: clamped to the cache).
__device__ __forceinline__ CacheSlot page_slot(const DecodeParams& p, int page, int pos) {
  return CacheSlot{min(max(page, 0), p.cache_rows - 1), pos & ((1 << p.page_shift) - 1)};
}

__device__ __forceinline__ CacheSlot cache_slot(const DecodeParams& p, const CacheSeq& s, int pos) {
  if (p.block_table) return page_slot(p, s.pages[pos >> p.page_shift], pos);
  return CacheSlot{s.row, pos};
}

// Cache position `pos` of one KV head (head: the cache's base plus the head's offset).
__device__ __forceinline__ const u16* cache_row(const DecodeParams& p, const CacheSeq& s,
                                                const u16* head, i64 batch_stride,
                                                i64 row_stride, int pos) {
  const CacheSlot slot = cache_slot(p, s, pos);
  return head + slot.block * batch_stride + slot.row * row_stride;
}

// -- a query row of the CTA: (token, head of the KV head's group) --
struct DecodeRow {
  int t, h;
  bool valid;
};

__device__ __forceinline__ DecodeRow decode_row(const DecodeParams& p, const CacheSeq& s,
                                                int m_block, int h_k, int r) {
  const int gr = m_block * kDecodeRows + r;
  DecodeRow row;
  row.valid = gr < s.seqlen_q * p.group;
  row.t = gr / p.group;
  row.h = h_k * p.group + gr % p.group;
  return row;
}

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

// -- a paged cache's page ids, looked up a step before the copies that need them: lane l
//    loads the page of the tile's row l % 16, and the copies take each row's page from a
//    shuffle, instead of a dependent load in front of their cp.async. 0 where no page is
//    read: a contiguous cache, rows past the sequence --
__device__ __forceinline__ int tile_row_page(const DecodeParams& p, const CacheSeq& s, int key0,
                                             int lane) {
  const int r = lane % kTileKeys;
  if (!p.block_table || r >= s.seqlen_k - key0) return 0;
  return s.pages[(s.start + key0 + r) >> p.page_shift];
}

// -- load one warp's 16-key tile of K and V into its stage: rows past the sequence and
//    columns past head_dim read as zeros. A paged cache's rows take their pages from
//    row_page, this lane's tile_row_page (kPagesAhead), or look them up here --
template <int kHeadDim, bool kPagesAhead>
__device__ __forceinline__ void load_kv_tile(u32 sk, u32 sv, const DecodeParams& p,
                                             const CacheSeq& s, const u16* k_head,
                                             const u16* v_head, int key0, int row_page, int lane) {
  constexpr int kChunks = kHeadDim / 8;
  const int rows_valid = s.seqlen_k - key0;
  // A contiguous cache's tile is rows of one base: a row stride a chunk, not a slot lookup
  // and two 64-bit products (ncu: our loop issued over twice cuDNN's instructions a byte).
  // A paged tile inside one page (pages of 16 rows or more, a 16-aligned first key) is
  // such a tile too, from its page: one lookup a tile, not one a row (pages of 256 1-2 %
  // faster on an H100, pages of 16 within +-1.5 %).
  const int pos0 = s.start + key0;
  const bool one_page = p.page_shift >= 4 && (pos0 & (kTileKeys - 1)) == 0;
  const bool paged = p.block_table != 0 && !one_page;
  i64 block = s.row;
  if (p.block_table && one_page)
    block = page_slot(p, kPagesAhead ? __shfl_sync(0xffffffffu, row_page, 0)
                                     : s.pages[pos0 >> p.page_shift], pos0).block;
  const int row0 = p.block_table ? pos0 & ((1 << p.page_shift) - 1) : pos0;
  const i64 first = paged ? 0 : block * p.k_batch_stride + (i64)row0 * p.k_row_stride;
  const i64 first_v = paged ? 0 : block * p.v_batch_stride + (i64)row0 * p.v_row_stride;
#pragma unroll
  for (int idx = lane; idx < kTileKeys * kChunks; idx += 32) {
    const int r = idx / kChunks, c = idx % kChunks;
    const bool valid = r < rows_valid && c * 8 < p.head_dim;
    const u16* k_src = k_head;  // any valid address: a zero-filling copy reads nothing
    const u16* v_src = v_head;
    if (valid && !paged) {
      k_src += first + r * p.k_row_stride + c * 8;
      v_src += first_v + r * p.v_row_stride + c * 8;
    } else if (paged) {  // (the whole warp: the shuffle)
      const int pos = s.start + key0 + r;
      const CacheSlot slot = page_slot(p, kPagesAhead ? __shfl_sync(0xffffffffu, row_page, r)
                                                      : valid ? s.pages[pos >> p.page_shift] : 0,
                                       pos);
      if (valid) {
        k_src += slot.block * p.k_batch_stride + slot.row * p.k_row_stride + c * 8;
        v_src += slot.block * p.v_batch_stride + slot.row * p.v_row_stride + c * 8;
      }
    }
    const u32 at = Swizzle<kHeadDim>::offset(r, c);
    cp_async_16(sk + at, k_src, valid ? 16 : 0);
    cp_async_16(sv + at, v_src, valid ? 16 : 0);
  }
}

// -- Q: the CTA's 16 query rows (`rows` of them, zeros after) into sq, by cp.async from
//    `threads` threads --
template <int kHeadDim, int kThreads>
__device__ __forceinline__ void load_q_rows(u32 sq, const DecodeParams& p, const CacheSeq& s,
                                            int m_block, int h_k, int rows, int thread) {
  const u16* q = reinterpret_cast<const u16*>(p.q);
  copy_rows_async<kDecodeRows, kHeadDim, kThreads>(
      sq, [&](int r) {
        const DecodeRow row = decode_row(p, s, m_block, h_k, r);
        return q + s.b * p.q_batch_stride + (s.q_row0 + row.t) * p.q_row_stride +
               row.h * p.q_head_stride;
      },
      q, rows, p.head_dim, [](int r, int c) { return Swizzle<kHeadDim>::offset(r, c); }, thread);
}

// What one lane needs of its two accumulator rows (lane / 4 and lane / 4 + 8).
struct LaneRows {
  i64 lo[2], hi[2];  // visible keys [lo, hi] of each row
  float slope[2];    // ALiBi slope of each row's head (0 without ALiBi)
  int t[2];
};

__device__ __forceinline__ LaneRows lane_rows(const DecodeParams& p, const CacheSeq& s, int m_block,
                                              int h_k, int lane) {
  LaneRows lr;
  const i64 diag = s.seqlen_k - s.seqlen_q;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const DecodeRow row = decode_row(p, s, m_block, h_k, (lane >> 2) + 8 * i);
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
//    the CTA sees (tiles inside them need no mask) --
struct TileScoring {
  LaneRows lr;
  int all_lo, all_hi;  // (visible_span's ints)
};

__device__ __forceinline__ TileScoring tile_scoring(const DecodeParams& p, const CacheSeq& s,
                                                    int m_block, int h_k, int rows, int lane) {
  TileScoring sc;
  sc.lr = lane_rows(p, s, m_block, h_k, lane);
  const int t_first = (m_block * kDecodeRows) / p.group;
  const int t_last = (m_block * kDecodeRows + rows - 1) / p.group;
  sc.all_lo = visible_span(p, s.seqlen_k, s.seqlen_q, t_last, t_last).begin;
  sc.all_hi = visible_span(p, s.seqlen_k, s.seqlen_q, t_first, t_first).end;
  return sc;
}

// -- S += Q K^T of the 16-key tile at k_tile (keys key0..), then score mods and mask --
template <int kDtype, int kHeadDim>
__device__ __forceinline__ void score_tile(float (&tile_s)[1][2][4], const LdmatrixAddr<kHeadDim>& q_frag,
                                           u32 k_tile, const DecodeParams& p, const CacheSeq& s,
                                           const TileScoring& sc, bool score_mods, int key0,
                                           int lane) {
  const LdmatrixAddr<kHeadDim> k_frag(k_tile, (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
  gemm_qk<kDtype>(tile_s, q_frag, k_frag);
  if (score_mods) decode_score_mods(tile_s, p, s, sc.lr, key0, lane);
  if (key0 < sc.all_lo || key0 + kTileKeys > sc.all_hi) decode_mask(tile_s, sc.lr, key0, lane);
}

// -- O += P V of the 16-key tile at v_tile --
template <int kDtype, int kHeadDim, int kDTiles>
__device__ __forceinline__ void accumulate_tile(float (&acc_o)[1][kDTiles][4],
                                                const float (&tile_p)[1][2][4], u32 v_tile,
                                                int lane) {
  const LdmatrixAddr<kHeadDim> v_frag(v_tile, (lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4);
  gemm_pv<kDtype>(acc_o, tile_p, v_frag);
}

// -- epilogue: each warp's row maxima and sums to shared memory, then each warp's output
//    rescaled to its rows' max over the warps (every lane takes the warps' maxima itself:
//    no pass of a few threads and a barrier between), staged in s_out
//    ([warp][row][kOStride] floats) for write_decode_output, which forms the sums. Warps
//    without a softmax state (has_state false: the TMA kernel's producer) meet the
//    barriers only --
template <int kWarps>
__device__ __forceinline__ float warps_row_max(const float (&s_warp_max)[kWarps][kDecodeRows], int r) {
  float mx = -CUFA_INF;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, s_warp_max[w][r]);
  return mx;
}

template <int kWarps, int kOStride, int kDTiles>
__device__ __forceinline__ void stage_warp_outputs(const OnlineSoftmax<1>& softmax,
                                                   const float (&acc_o)[1][kDTiles][4],
                                                   bool has_state,
                                                   float (&s_warp_max)[kWarps][kDecodeRows],
                                                   float (&s_warp_sum)[kWarps][kDecodeRows],
                                                   float* s_out, float scale_log2) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (has_state) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float sum = quad_sum(softmax.row_sum[0][i]);
      if ((lane & 3) == 0) {
        s_warp_max[warp][(lane >> 2) + 8 * i] = softmax.row_max[0][i];
        s_warp_sum[warp][(lane >> 2) + 8 * i] = sum;
      }
    }
  }
  __syncthreads();
  if (has_state) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = (lane >> 2) + 8 * i;
      const float mine = softmax.row_max[0][i];
      const float mx = warps_row_max(s_warp_max, r);
      const float factor = mine == -CUFA_INF ? 0.f : fast_exp2((mine - mx) * scale_log2);
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt)
        *reinterpret_cast<float2*>(&s_out[(warp * kDecodeRows + r) * kOStride + dt * 8 + 2 * (lane & 3)]) =
            make_float2(acc_o[0][dt][2 * i] * factor, acc_o[0][dt][2 * i + 1] * factor);
    }
  }
  __syncthreads();
}

// -- 8 columns of an output row, packed to its dtype --
template <int kDtype>
__device__ __forceinline__ void store8(u16* dst, const float (&acc)[8]) {
  uint4 packed;
  packed.x = pack2<kDtype>(acc[0], acc[1]);
  packed.y = pack2<kDtype>(acc[2], acc[3]);
  packed.z = pack2<kDtype>(acc[4], acc[5]);
  packed.w = pack2<kDtype>(acc[6], acc[7]);
  *reinterpret_cast<uint4*>(dst) = packed;
}

// -- epilogue: merge the warps' states, then write the output (or this split's share) --
template <int kDtype, int kHeadDim, class Shape>
__device__ __forceinline__ void write_decode_output(const DecodeParams& p, const CacheSeq& s,
                                                    int m_block, int h_k, int split, float* s_out,
                                                    const float (&s_warp_max)[Shape::kWarps][kDecodeRows],
                                                    const float (&s_warp_sum)[Shape::kWarps][kDecodeRows],
                                                    float scale_log2) {
  constexpr int kChunks = kHeadDim / 8;
  for (int idx = threadIdx.x; idx < kDecodeRows * kChunks; idx += Shape::kThreads) {
    const int r = idx / kChunks, c = idx % kChunks;
    const DecodeRow row = decode_row(p, s, m_block, h_k, r);
    if (!row.valid || c * 8 >= p.head_dim) continue;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int w = 0; w < Shape::kWarps; ++w)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] += s_out[(w * kDecodeRows + r) * Shape::kOStride + c * 8 + e];
    // the row's sum over the warps, each warp's rescaled to the row's max
    const float mx = warps_row_max(s_warp_max, r);
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < Shape::kWarps; ++w)
      if (s_warp_max[w][r] != -CUFA_INF)
        sum += s_warp_sum[w][r] * fast_exp2((s_warp_max[w][r] - mx) * scale_log2);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;  // explicit 0: a row that saw no key
    const float lse = sum > 0.f ? (mx * scale_log2 + log2f(sum)) * CUFA_LN2 : -CUFA_INF;
    if (p.num_splits > 1) {
      const i64 o_row = ((i64)(split * p.batch + s.b) * p.seqlen_q + row.t) * p.nheads + row.h;
      float4* dst = reinterpret_cast<float4*>(reinterpret_cast<float*>(p.o_partial) +
                                              o_row * p.head_dim + c * 8);
      dst[0] = make_float4(acc[0] * inv, acc[1] * inv, acc[2] * inv, acc[3] * inv);
      dst[1] = make_float4(acc[4] * inv, acc[5] * inv, acc[6] * inv, acc[7] * inv);
      if (c == 0)
        reinterpret_cast<float*>(p.lse_partial)[((i64)(split * p.batch + s.b) * p.nheads + row.h) *
                                                    p.seqlen_q + row.t] = lse;
    } else {
      const float out[8] = {acc[0] * inv, acc[1] * inv, acc[2] * inv, acc[3] * inv,
                            acc[4] * inv, acc[5] * inv, acc[6] * inv, acc[7] * inv};
      store8<kDtype>(reinterpret_cast<u16*>(p.o) + s.b * p.o_batch_stride +
                         (s.q_row0 + row.t) * p.o_row_stride + row.h * p.o_head_stride + c * 8,
                     out);
      if (c == 0 && p.lse)
        reinterpret_cast<float*>(p.lse)[s.b * p.lse_batch_stride + row.h * p.lse_head_stride +
                                        s.q_row0 + row.t] = lse;
    }
  }
}

// -- split-KV: each (batch, token, head) row's splits merged by their lse, by
//    decode_combine or, for an eager call, in the decode launch (merge_if_last). Both run
//    merge_split_row, so they add the same terms in the same order and an eager call gives
//    the bits a graph or jax.jit replay of it gives.
// The reads are few (splits x head_dim floats a row) but, done one split after another,
// each waits a full memory latency: a row's threads share out the splits as well as the
// columns, so its reads are in flight at once. kRows rows a 128-thread group: 1 (128
// threads a row) for many splits; 4 (a warp a row) for a few, where a CTA a row would leave
// most of its threads idle and make the combine launch a long queue of tiny CTAs (64
// sequences x 4 tokens x 32 heads are 8192 rows). --
constexpr int kMaxSplits = 128;  // MAX_SPLITS in cufa/kvcache.py
constexpr int kCombineThreads = 128;
constexpr int kCombineEarly = 4;  // a thread's first splits of o_partial, loaded with the lse
static_assert(kMaxSplits <= kCombineThreads, "a row's lse values, one a thread");

template <bool kMax>
__device__ __forceinline__ float warp_butterfly(float x) {
#pragma unroll
  for (int o = 16; o; o >>= 1) {
    const float y = __shfl_xor_sync(0xffffffffu, x, o);
    x = kMax ? fmaxf(x, y) : x + y;
  }
  return x;
}

// A row of 128 threads meets on named barrier 1 (threads 0-127), so that a decode CTA with
// a producer warp past them can merge a row without it.
template <int kRows>
__device__ __forceinline__ void row_sync() {
  if constexpr (kRows == 1) asm volatile("bar.sync 1, %0;\n" ::"n"(kCombineThreads) : "memory");
  else __syncwarp();
}

// max or sum over the threads of one row: a warp's shuffles, then (a CTA a row) the
// warps' values through shared memory
template <int kRows, bool kMax>
__device__ __forceinline__ float row_reduce(float x, float* warp_value) {
  x = warp_butterfly<kMax>(x);
  if constexpr (kRows == 1) {
    row_sync<1>();  // earlier readers of warp_value are done with it
    if (threadIdx.x % 32 == 0) warp_value[threadIdx.x / 32] = x;
    row_sync<1>();
    x = warp_value[0];
#pragma unroll
    for (int w = 1; w < kCombineThreads / 32; ++w)
      x = kMax ? fmaxf(x, warp_value[w]) : x + warp_value[w];
  }
  return x;
}

// acc += w * (a, b): one split's 8 columns into a partial sum
__device__ __forceinline__ void add_weighted8(float (&acc)[8], float w, const float4& a,
                                              const float4& b) {
  if (w != 0.f) {  // an empty split's output may be anything, NaN included
    acc[0] += w * a.x; acc[1] += w * a.y; acc[2] += w * a.z; acc[3] += w * a.w;
    acc[4] += w * b.x; acc[5] += w * b.y; acc[6] += w * b.z; acc[7] += w * b.w;
  }
}

// A row (b, t, h) of o_partial's order, and what each of its threads reads before anything
// else: one split's lse (a thread a split) and its first kCombineEarly splits of its
// columns (thread = split group x 8-column chunk). L2 reads: in the decode launch the other
// splits' SMs wrote them.
struct SplitRow {
  int b, t, h;
  float lse;
  float4 early[kCombineEarly][2];
};

template <int kRows>
__device__ __forceinline__ SplitRow load_split_row(const DecodeParams& p, int b, int t, int h,
                                                   int tid) {
  constexpr int kRowThreads = kCombineThreads / kRows;
  SplitRow in{b, t, h};
  const float* lse_part = reinterpret_cast<const float*>(p.lse_partial) +
                          ((i64)b * p.nheads + h) * p.seqlen_q + t;
  in.lse = tid < p.num_splits ? __ldcg(lse_part + tid * ((i64)p.batch * p.nheads * p.seqlen_q))
                              : -CUFA_INF;
  const int chunks = p.head_dim / 8, groups = kRowThreads / chunks;
  const int chunk = tid % chunks, group = tid / chunks;
  const i64 split_o = (i64)p.batch * p.seqlen_q * p.nheads * p.head_dim;
  const float* o_part = reinterpret_cast<const float*>(p.o_partial) +
                        (((i64)b * p.seqlen_q + t) * p.nheads + h) * p.head_dim + chunk * 8;
#pragma unroll
  for (int i = 0; i < kCombineEarly; ++i) {
    const int sp = group + i * groups;
    if (group < groups && sp < p.num_splits) {
      in.early[i][0] = __ldcg(reinterpret_cast<const float4*>(o_part + sp * split_o));
      in.early[i][1] = __ldcg(reinterpret_cast<const float4*>(o_part + sp * split_o) + 1);
    }
  }
  return in;
}

// The row's weights exp(lse - max) / sum, its lse, then each thread's splits of its
// columns weighted and summed in split order, the groups' sums added in group order.
// weight: the row's [kMaxSplits]; partial: the row's [kRowThreads][8]; warp_value: [4].
template <int kDtype, int kRows>
__device__ __forceinline__ void merge_split_row(const DecodeParams& p, const SplitRow& in,
                                                int q_row0, int tid, float* weight, float* partial,
                                                float* warp_value) {
  constexpr int kRowThreads = kCombineThreads / kRows;
  const float mx = row_reduce<kRows, true>(in.lse, warp_value);
  const float base = mx == -CUFA_INF ? 0.f : mx;
  const float e = in.lse == -CUFA_INF ? 0.f : fast_exp2((in.lse - base) * CUFA_LOG2E);
  const float sum = row_reduce<kRows, false>(e, warp_value);
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  if (tid < p.num_splits) weight[tid] = e * inv;
  if (tid == 0 && p.lse)
    reinterpret_cast<float*>(p.lse)[in.b * p.lse_batch_stride + in.h * p.lse_head_stride + q_row0 + in.t] =
        sum > 0.f ? base + logf(sum) : -CUFA_INF;
  row_sync<kRows>();  // every weight of the row written

  const int chunks = p.head_dim / 8, groups = kRowThreads / chunks;
  const int chunk = tid % chunks, group = tid / chunks;
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if (group < groups) {
#pragma unroll
    for (int i = 0; i < kCombineEarly; ++i) {
      const int sp = group + i * groups;
      if (sp < p.num_splits) add_weighted8(acc, weight[sp], in.early[i][0], in.early[i][1]);
    }
    const i64 split_o = (i64)p.batch * p.seqlen_q * p.nheads * p.head_dim;
    const float* o_part = reinterpret_cast<const float*>(p.o_partial) +
                          (((i64)in.b * p.seqlen_q + in.t) * p.nheads + in.h) * p.head_dim + chunk * 8;
#pragma unroll 4
    for (int sp = group + kCombineEarly * groups; sp < p.num_splits; sp += groups)
      add_weighted8(acc, weight[sp], __ldcg(reinterpret_cast<const float4*>(o_part + sp * split_o)),
                    __ldcg(reinterpret_cast<const float4*>(o_part + sp * split_o) + 1));
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) partial[tid * 8 + i] = acc[i];
  row_sync<kRows>();
  if (tid >= chunks) return;
  for (int g = 1; g < groups; ++g)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] += partial[(g * chunks + tid) * 8 + i];
  store8<kDtype>(reinterpret_cast<u16*>(p.o) + in.b * p.o_batch_stride + (q_row0 + in.t) * p.o_row_stride +
                     in.h * p.o_head_stride + tid * 8,
                 acc);
}

// merge_if_last's scratch: weights, partial sums (a warp a row: 8 floats a thread of the
// CTA; a row: 8 floats a thread of 0-127) and 4 warp values
__host__ __device__ constexpr int merge_partial_threads(int threads) {
  return threads > kCombineThreads ? threads : kCombineThreads;
}
__host__ __device__ constexpr int merge_scratch_bytes(int threads) {
  return (kDecodeRows * kMaxSplits + merge_partial_threads(threads) * 8 + 4) * 4;
}

// The count a unit's splits take: release of this CTA's partials (ordered before it by the
// barrier the caller passed, as cooperative groups' grid barrier does) and, for the last
// split, acquire of the others'.
__device__ __forceinline__ int count_split_done(int* counter) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;\n" : "=r"(old) : "l"(counter) : "memory");
  return old;
}

// -- split-KV merged in the launch (p.split_counters set): the last split of a (query
//    block, KV head, sequence) to finish merges the unit's rows as decode_combine would,
//    a warp a row or (one row) threads 0-127, where the host saw that one pass of the CTA
//    covers them (kvcache._merge_in_launch). The counter is left zeroed for the next
//    launch on the stream. scratch: the CTA's cache stages. --
template <int kDtype, int kThreads>
__device__ __forceinline__ void merge_if_last(const DecodeParams& p, const CacheSeq& s, int m_block,
                                              int h_k, int rows, float* scratch) {
  __shared__ int s_last;
  __syncthreads();  // every thread's partials written (and every reader of `scratch` done)
  if (threadIdx.x == 0) {
    int* counter = reinterpret_cast<int*>(p.split_counters) +
                   ((i64)blockIdx.z * gridDim.y + blockIdx.y) * p.num_m_blocks + m_block;
    const bool last = count_split_done(counter) == p.num_splits - 1;
    if (last) atomicExch(counter, 0);
    s_last = last;
  }
  __syncthreads();
  if (!s_last) return;
  float* weight = scratch;                              // [rows][kMaxSplits]
  float* partial = scratch + kDecodeRows * kMaxSplits;  // [merge_partial_threads(kThreads)][8]
  float* warp_value = partial + merge_partial_threads(kThreads) * 8;  // [4]
  if (p.combine_row_threads == 32) {  // a warp a row
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int r = warp; r < rows; r += kThreads / 32) {
      const DecodeRow row = decode_row(p, s, m_block, h_k, r);
      const SplitRow in = load_split_row<4>(p, s.b, row.t, row.h, lane);
      merge_split_row<kDtype, 4>(p, in, s.q_row0, lane, weight + r * kMaxSplits,
                                 partial + warp * 32 * 8, warp_value);
    }
  } else if constexpr (kThreads >= kCombineThreads) {  // a row on threads 0-127
    if (threadIdx.x >= kCombineThreads) return;
    for (int r = 0; r < rows; ++r) {
      const DecodeRow row = decode_row(p, s, m_block, h_k, r);
      const SplitRow in = load_split_row<1>(p, s.b, row.t, row.h, threadIdx.x);
      merge_split_row<kDtype, 1>(p, in, s.q_row0, threadIdx.x, weight, partial, warp_value);
      row_sync<1>();  // the next row rewrites weight and partial
    }
  }
}

// grid: (num_m_blocks * num_splits, nheads_k, batch)
template <int kDtype, int kHeadDim, int kStages, int kWarpCount>
__global__ void __launch_bounds__(DecodeShape<kHeadDim, kStages, kWarpCount>::kThreads)
    decode_kernel(const DecodeParams p) {
  using Shape = DecodeShape<kHeadDim, kStages, kWarpCount>;
  constexpr int kWarps = Shape::kWarps;
  constexpr int kDTiles = kHeadDim / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ float s_warp_max[kWarps][kDecodeRows], s_warp_sum[kWarps][kDecodeRows];

  // -- which rows, keys and split --
  const int m_block = blockIdx.x % p.num_m_blocks, split = blockIdx.x / p.num_m_blocks;
  const int h_k = blockIdx.y;
  const int b = p.decode_order ? reinterpret_cast<const int*>(p.decode_order)[blockIdx.z] : blockIdx.z;
  if (b < 0) return;
  const CacheSeq s = cache_seq(p, b);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int rows = min(kDecodeRows, s.seqlen_q * p.group - m_block * kDecodeRows);
  // (a packed batch: past this sequence's rows, or a sequence the forward kernel takes)
  if (rows <= 0 || s.seqlen_q > p.seqlen_q) return;
  const KeySpan span = visible_span(p, s.seqlen_k, s.seqlen_q, (m_block * kDecodeRows) / p.group,
                                    (m_block * kDecodeRows + rows - 1) / p.group);
  const int num_tiles = (span.end - span.begin + kTileKeys - 1) / kTileKeys;
  const int split_tiles = (num_tiles + p.num_splits - 1) / p.num_splits;
  const int tile_begin = min(split * split_tiles, num_tiles);
  const int tile_end = min(tile_begin + split_tiles, num_tiles);
  // this warp's tiles: tile_begin + warp, + kWarps, ...
  const int my_tiles = max(0, (tile_end - tile_begin - warp + kWarps - 1) / kWarps);

  // -- Q: the CTA's 16 rows, zeros past the last --
  const u32 sq = smem_u32(smem);
  load_q_rows<kHeadDim, Shape::kThreads>(sq, p, s, m_block, h_k, rows, threadIdx.x);
  cp_async_commit();

  // -- prologue: the first kStages - kStep tiles of this warp, a commit group each --
  constexpr int kStep = Shape::kStepTiles;
  // Page ids a step ahead: pages of 16 and 256 read 1-2 % faster at d = 128 on an H100;
  // at d = 64 (two tiles a step, more CTAs an SM) they read within +-2 %, as often
  // slower, so it keeps the lookup at the copy (bench/NOTES.md).
  constexpr bool kPagesAhead = kStep == 1;
  const u32 stages = sq + Shape::kQBytes + warp * Shape::kWarpBytes;
  const u16* k_head = reinterpret_cast<const u16*>(p.k) + h_k * p.k_head_stride;
  const u16* v_head = reinterpret_cast<const u16*>(p.v) + h_k * p.v_head_stride;
  const auto tile_key0 = [&](int i) { return span.begin + (tile_begin + warp + i * kWarps) * kTileKeys; };
  const auto stage_k = [&](int i) { return stages + (i % kStages) * 2 * Shape::kTileBytes; };
  const auto ahead_pages = [&](int i) {
    return kPagesAhead && i < my_tiles ? tile_row_page(p, s, tile_key0(i), lane) : 0;
  };
  const auto prologue_tile = [&](int i) {
    if (i < my_tiles)
      load_kv_tile<kHeadDim, kPagesAhead>(stage_k(i), stage_k(i) + Shape::kTileBytes, p, s,
                                          k_head, v_head, tile_key0(i), ahead_pages(i), lane);
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
#pragma unroll
  for (int i = Shape::kTilesBeforeQ; i < kStages - kStep; ++i) prologue_tile(i);

  const TileScoring scoring = tile_scoring(p, s, m_block, h_k, rows, lane);
  const bool score_mods = score_mods_on(p);
  const float scale_log2 = score_mods ? 1.f : p.scale_log2;  // score mods leave log2 units
  const LdmatrixAddr<kHeadDim> q_frag(sq, lane & 15, lane >> 4);

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
      if (ahead < my_tiles)
        load_kv_tile<kHeadDim, kPagesAhead>(stage_k(ahead), stage_k(ahead) + Shape::kTileBytes, p,
                                            s, k_head, v_head, tile_key0(ahead), next_pages[u], lane);
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
        score_tile<kDtype>(tile_s, q_frag, stage_k(i + u), p, s, scoring, score_mods,
                           tile_key0(i + u), lane);
    }

    // -- update m_i and l_i once for the step, rescale acc, then acc += P V per tile --
    float correction[1][2];
    softmax.update(acc_s, scale_log2, correction);
    softmax.rescale_output(acc_o, correction);
#pragma unroll
    for (int u = 0; u < kStep; ++u) {
      if (u > 0 && i + u >= my_tiles) continue;
      const float(&tile_p)[1][2][4] = *reinterpret_cast<const float(*)[1][2][4]>(&acc_s[0][2 * u]);
      accumulate_tile<kDtype, kHeadDim>(acc_o, tile_p, stage_k(i + u) + Shape::kTileBytes, lane);
    }
    __syncwarp();  // every lane is done with these stages before they are refilled
  }

  cp_async_wait<0>();  // (the outputs are staged over the cache stages)
  float* s_out = reinterpret_cast<float*>(smem + Shape::kQBytes);
  stage_warp_outputs<kWarps, Shape::kOStride>(softmax, acc_o, true, s_warp_max, s_warp_sum, s_out,
                                              scale_log2);
  write_decode_output<kDtype, kHeadDim, Shape>(p, s, m_block, h_k, split, s_out, s_warp_max,
                                               s_warp_sum, scale_log2);
  static_assert(merge_scratch_bytes(Shape::kThreads) <= kWarps * Shape::kWarpBytes,
                "the merge's weights and partial sums fit the cache stages");
  if (p.num_splits > 1 && p.split_counters)
    merge_if_last<kDtype, Shape::kThreads>(p, s, m_block, h_k, rows, s_out);
}


// grid: ceil(batch * seqlen_q * nheads / kRows); kRows rows of 128 / kRows threads a CTA
template <int kDtype, int kRows>
__global__ void __launch_bounds__(kCombineThreads) decode_combine(const DecodeParams p) {
  static_assert(kRows == 1 || kRows == kCombineThreads / 32, "a CTA a row, or a warp a row");
  constexpr int kRowThreads = kCombineThreads / kRows;
  __shared__ float weight[kRows][kMaxSplits];
  __shared__ float partial[kCombineThreads * 8];
  __shared__ float warp_value[kCombineThreads / 32];
  const int slot = threadIdx.x / kRowThreads, tid = threadIdx.x % kRowThreads;
  // (b, t, h) in o_partial's order; the host keeps the row count below 2^31. The returns
  // below leave a whole CTA (a CTA a row) or a whole warp (a warp a row, which then meets
  // no CTA barrier).
  const int row = blockIdx.x * kRows + slot;
  if (row >= p.batch * p.seqlen_q * p.nheads) return;
  const int h = row % p.nheads, t = (row / p.nheads) % p.seqlen_q, b = row / (p.nheads * p.seqlen_q);
  // The row's reads go out before cache_seq's, so that it waits about one memory latency,
  // not one for cache_seq, then one for the partials. (Rows that cache_seq then skips read
  // partials nobody wrote, inside the workspace, and drop them.)
  const SplitRow in = load_split_row<kRows>(p, b, t, h, tid);
  const CacheSeq s = cache_seq(p, b);
  // (a packed batch: past this sequence's rows, or a sequence the forward kernel takes,
  // the same test as decode_kernel's)
  if (t >= s.seqlen_q || s.seqlen_q > p.seqlen_q) return;
  merge_split_row<kDtype, kRows>(p, in, s.q_row0, tid, weight[slot], partial + slot * kRowThreads * 8,
                                 warp_value);
}

// -- rotary embedding of one row (d elements) from src to dst, at cache position pos --
template <int kDtype>
__device__ __forceinline__ float load_half(const u16* x, int i) {
  return kDtype == FP16 ? fp16_to_float(x[i]) : bf16_to_float(x[i]);
}
template <int kDtype>
__device__ __forceinline__ u16 to_half(float x) {
  return static_cast<u16>(pack2<kDtype>(x, 0.f) & 0xffffu);
}

__device__ __forceinline__ float rotary_value(const DecodeParams& p, u64 table, i64 i) {
  if (p.rotary_dtype == 2) return reinterpret_cast<const float*>(table)[i];
  const u16 h = reinterpret_cast<const u16*>(table)[i];
  return p.rotary_dtype == FP16 ? fp16_to_float(h) : bf16_to_float(h);
}

template <int kDtype>
__device__ __forceinline__ void rotate_row(const DecodeParams& p, const u16* src, u16* dst, int pos,
                                           int lane) {
  const int half = p.rotary_dim / 2;
  const i64 at = (i64)min(max(pos, 0), p.seqlen_ro - 1) * half;
  for (int i = lane; i < half; i += 32) {
    const int a = p.rotary_interleaved ? 2 * i : i, b = p.rotary_interleaved ? 2 * i + 1 : i + half;
    const float c = rotary_value(p, p.rotary_cos, at + i), s = rotary_value(p, p.rotary_sin, at + i);
    const float x0 = load_half<kDtype>(src, a), x1 = load_half<kDtype>(src, b);
    dst[a] = to_half<kDtype>(x0 * c - x1 * s);
    dst[b] = to_half<kDtype>(x0 * s + x1 * c);
  }
  for (int i = p.rotary_dim + lane; i < p.head_dim; i += 32) dst[i] = src[i];  // (all without rotary)
}

// -- append: new keys (rotated) and values into the cache; q rotated into its buffer.
//    One warp per row: batch x seqlen_new x nheads_k cache rows, then batch x seqlen_q x
//    nheads query rows when rotary is on. --
template <int kDtype>
__global__ void __launch_bounds__(128) decode_append(const DecodeParams p) {
  const int lane = threadIdx.x % 32;
  int row = blockIdx.x * 4 + threadIdx.x / 32;  // the host keeps the row counts below 2^31
  const int kv_rows = p.k_new ? p.batch * p.seqlen_new * p.nheads_k : 0;
  const u16* src;
  u16* dst;
  int pos;
  if (row < kv_rows) {  // -- a new key and value --
    const int hk = row % p.nheads_k, i = (row / p.nheads_k) % p.seqlen_new;
    const CacheSeq s = cache_seq(p, row / (p.nheads_k * p.seqlen_new));
    pos = s.end + i;
    if (pos >= p.capacity) return;  // past the cache: dropped (check_inputs reports it)
    const u16* v_src = reinterpret_cast<const u16*>(p.v_new) + s.b * p.v_new_batch_stride +
                       i * p.v_new_row_stride + hk * p.v_new_head_stride;
    u16* v_dst = const_cast<u16*>(cache_row(p, s, reinterpret_cast<const u16*>(p.v) + hk * p.v_head_stride,
                                            p.v_batch_stride, p.v_row_stride, pos));
    for (int c = lane; c < p.head_dim; c += 32) v_dst[c] = v_src[c];
    src = reinterpret_cast<const u16*>(p.k_new) + s.b * p.k_new_batch_stride + i * p.k_new_row_stride +
          hk * p.k_new_head_stride;
    dst = const_cast<u16*>(cache_row(p, s, reinterpret_cast<const u16*>(p.k) + hk * p.k_head_stride,
                                     p.k_batch_stride, p.k_row_stride, pos));
  } else {  // -- a query row, when rotary is on --
    row -= kv_rows;
    if (!p.q_source || row >= p.batch * p.seqlen_q * p.nheads) return;
    const int h = row % p.nheads, t = (row / p.nheads) % p.seqlen_q;
    const CacheSeq s = cache_seq(p, row / (p.nheads * p.seqlen_q));
    src = reinterpret_cast<const u16*>(p.q_source) + s.b * p.q_source_batch_stride +
          t * p.q_source_row_stride + h * p.q_source_head_stride;
    dst = reinterpret_cast<u16*>(p.q) + s.b * p.q_batch_stride + t * p.q_row_stride + h * p.q_head_stride;
    pos = s.end + (p.rotary_q_per_token ? t : 0);
  }
  rotate_row<kDtype>(p, src, dst, pos, lane);
}

}  // namespace cufa
