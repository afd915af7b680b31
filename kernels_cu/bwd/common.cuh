#pragma once
// What the backward's kernels share, on either instruction set: the CTA's shape, the rows'
// lse and D, the scores' mods and masks as the forward applies them, and the gradients'
// stores and the streamed steps' buffering.
#include "../common/sm80.cuh"
#include "../common/mma_tiles.cuh"
#include "../fwd/params.cuh"
#include "../fwd/block_info.cuh"
#include "../fwd/mask.cuh"
#include "../fwd/score.cuh"
#include "params.cuh"

namespace cufa {

constexpr int kBwdWarps = 4;
constexpr int kBwdThreads = kBwdWarps * 32;

// What the key-block kernel computes: both gradients, or (head dims over 128, where both
// accumulators do not fit in registers) one of them a launch.
enum KvGrads { KV_BOTH = 0, KV_DK = 1, KV_DV = 2 };

template <int DT>
__device__ __forceinline__ float to_float(u16 x) {
  return DT == FP16 ? fp16_to_float(x) : bf16_to_float(x);
}

// Offset of a tile's row 0 in lse's layout (and D's, the same)
__device__ __forceinline__ i64 row_stats_offset(const FwdParams& p, const Tile& t) {
  return t.b * p.lse_batch_stride + t.h * p.lse_head_stride + t.q_start;
}

// A row's lse in log2 units for P = exp2(score - lse): +inf for rows past the sequence and
// rows that saw no key (lse -inf), whose P is then 0 for every key, masked or not
__device__ __forceinline__ float lse_log2_of(const float* lse, int row, int rows) {
  if (row >= rows) return CUFA_INF;
  const float x = lse[row];
  return x == -CUFA_INF ? CUFA_INF : x * CUFA_LOG2E;
}

// -- a scaled, modded score in log2 units, as the forward's apply_score_mods makes it, and
//    its derivative by the raw score (natural units): the scale, times 1 - tanh^2 under a
//    softcap; ALiBi and attn_mask add constants --
__device__ __forceinline__ float modded_score(float s, const FwdParams& p, const Tile& t,
                                              const TileMods& m, int row, int key, float& grad) {
  float x = s * p.scale;
  grad = p.scale;
  if (p.softcap > 0.f) {
    const float th = fast_tanh(x * p.softcap_inv);
    x = p.softcap * th;
    grad *= 1.f - th * th;
  }
  if (m.alibi_slope != 0.f)
    x -= m.alibi_slope * fabsf(static_cast<float>((i64)row + t.diag_offset - key));
  if (p.attn_mask_type != ATTN_MASK_NONE && row < t.seqlen_q && key < t.seqlen_k)
    x += attn_mask_value(p, m.mask_offset + row * p.mask_row_stride + key * p.mask_col_stride);
  return x * CUFA_LOG2E;
}

// -- an additive mask's gradient: dS at (row, key) (natural units: the mask adds to the
//    scaled score), summed where the mask broadcasts (its zero strides), so atomically --
__device__ __forceinline__ void add_mask_grad(const BwdParams& g, const Tile& t, int row, int key,
                                              float ds) {
  if (row < t.seqlen_q && key < t.seqlen_k)
    atomicAdd(reinterpret_cast<float*>(g.dmask) + t.b * g.dmask_batch_stride +
                  t.h * g.dmask_head_stride + row * g.dmask_row_stride + key * g.dmask_col_stride,
              ds);
}

// Whether key `key` is within a window side of `side` keys of `diagonal` (a side of
// kUnboundedWindow or more has no bound)
__device__ __forceinline__ bool within_side(i64 distance, int side) {
  return side >= kUnboundedWindow || distance <= side;
}

// Whether query `row` sees key `key` (both in the sequence's numbering)
template <int kMask>
__device__ __forceinline__ bool visible(const FwdParams& p, const Tile& t, int row, int key) {
  if (key >= t.seqlen_k) return false;
  if (kMask == MASK_NONE) return true;
  const i64 diagonal = (i64)row + t.diag_offset;
  return within_side(diagonal - key, p.window_left) && within_side(key - diagonal, p.window_right);
}

// The query rows lo..hi that see key `key`, as visible() has it (none where lo > hi),
// worked out once in 64 bits and clamped to int: the rows compared are ints from 0, and
// the host's windows (0..kUnboundedWindow) and diagonal offsets (0 or seqlen_k -
// seqlen_q) keep an unclamped lo below seqlen_q and hi above INT_MIN, where the clamps
// do not reach
struct RowSpan {
  int lo, hi;
};
template <int kMask>
__device__ __forceinline__ RowSpan rows_seeing(const FwdParams& p, const Tile& t, int key) {
  constexpr i64 kLowest = -0x7fffffffll - 1, kHighest = 0x7fffffffll;
  if (key >= t.seqlen_k) return {1, 0};
  if (kMask == MASK_NONE) return {static_cast<int>(kLowest), static_cast<int>(kHighest)};
  const i64 on_diagonal = static_cast<i64>(key) - t.diag_offset;  // (the row whose diagonal key it is)
  const i64 lo = p.window_right >= kUnboundedWindow ? kLowest : on_diagonal - p.window_right;
  const i64 hi = p.window_left >= kUnboundedWindow ? kHighest : on_diagonal + p.window_left;
  return {static_cast<int>(max(lo, kLowest)), static_cast<int>(min(hi, kHighest))};
}

// -- a dk/dv step's P^T in place (rows: this lane's keys first_key and first_key + 8;
//    columns: the step's queries from q0): scores scaled (and modded, their derivatives
//    into grad), masked where the step crosses the mask's edge, exp2 against each query's
//    lse. Without score mods the masked steps get a loop of their own: a mask test inside
//    the one loop made a branch of every element, and the exponentials ran one at a time
//    on every step. Score mods keep one loop and exp2f (two loops, or ex2.approx.ftz,
//    spilled on mma.sync at d = 128); callers that pass kSplit false keep one loop --
// kSpans: in the masked steps' own loop under a window, the rows that see each of the
// lane's two keys are worked out once (rows_seeing) and a score is tested by two compares
// (visible() on each score, in 64 bits under a branch, was ~20 instructions an element:
// ncu counted 18-45 % more instructions than cuDNN's kernel under a causal mask at
// d = 64). The one loop of every step (score mods, or kSplit false) keeps visible(), and
// so do 128-query steps, for their registers (the spans spilled 60-80 bytes at d = 128
// with score mods, 8-16 at d = 64 on 128 queries); without a window visible() is one
// compare
template <int kMask, bool kScoreMods, bool kMaskTest, bool kSpans, int kQTiles,
          int kGradTiles>
__device__ __forceinline__ void probs_t_of(float (&st)[1][kQTiles][4],
                                           float (&grad)[1][kGradTiles][4], bool masked,
                                           const FwdParams& p, const Tile& th,
                                           const TileMods& mods, int q0, int first_key,
                                           const float* s_lse, int lane) {
  RowSpan seen[2];
  if constexpr (kSpans)
#pragma unroll
    for (int h = 0; h < 2; ++h) seen[h] = rows_seeing<kMask>(p, th, first_key + 8 * h);
#pragma unroll
  for (int nt = 0; nt < kQTiles; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = first_key + 8 * (e >> 1);
      const int col = frag_col(0, nt, e, lane);
      float x;
      if constexpr (kScoreMods)
        x = modded_score(st[0][nt][e], p, th, mods, q0 + col, key, grad[0][nt][e]);
      else
        x = st[0][nt][e] * p.scale_log2;
      if constexpr (kSpans) {
        if (q0 + col < seen[e >> 1].lo || q0 + col > seen[e >> 1].hi) x = -CUFA_INF;
      } else if (kMaskTest && masked && !visible<kMask>(p, th, q0 + col, key)) {
        x = -CUFA_INF;
      }
      st[0][nt][e] = kScoreMods ? exp2f(x - s_lse[col]) : fast_exp2(x - s_lse[col]);
    }
}
template <int kMask, bool kScoreMods, bool kSplit, int kQTiles, int kGradTiles>
__device__ __forceinline__ void probs_t(float (&st)[1][kQTiles][4],
                                        float (&grad)[1][kGradTiles][4], bool masked,
                                        const FwdParams& p, const Tile& th, const TileMods& mods,
                                        int q0, int first_key, const float* s_lse, int lane) {
  constexpr bool kSpans = kMask == MASK_WINDOW && kQTiles <= 8;
  if (kScoreMods || !kSplit)
    probs_t_of<kMask, kScoreMods, true, false>(st, grad, masked, p, th, mods, q0, first_key,
                                               s_lse, lane);
  else if (masked)
    probs_t_of<kMask, kScoreMods, true, kSpans>(st, grad, true, p, th, mods, q0, first_key,
                                                s_lse, lane);
  else
    probs_t_of<kMask, kScoreMods, false, false>(st, grad, false, p, th, mods, q0, first_key,
                                                s_lse, lane);
}

// -- store a warp's 16-row tiles of float accumulators as rows of kDtype, rows below
//    `rows` and columns below head_dim (a multiple of 8): 4 bytes a lane, a quad's 16 in a
//    row. The last write of each launch, a small share of its time --
template <int kDtype, int kMTiles, int kDTiles>
__device__ __forceinline__ void store_rows(const float (&acc)[kMTiles][kDTiles][4], u16* dst,
                                           i64 row_stride, int row_base, int rows, int head_dim,
                                           int lane) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = frag_row(row_base, mt, 2 * h, lane);
      if (row >= rows) continue;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        const int col = frag_col(0, dt, 0, lane);
        if (col < head_dim)
          *reinterpret_cast<u32*>(dst + row * row_stride + col) =
              pack2<kDtype>(acc[mt][dt][2 * h], acc[mt][dt][2 * h + 1]);
      }
    }
}

// -- before step i of n: the copy of step i + 1 issued into the other buffer (two stages;
//    every warp is past the step that read it), or of step i (one stage), then step i's
//    copy waited for and made visible. load(step, stage) issues and commits one step;
//    publish() runs between the wait and the barrier (the wgmma kernels make the copies
//    visible to the async proxy there) --
template <int kStages, typename Load, typename Publish>
__device__ __forceinline__ void await_step(int i, int n, int stage, Load load, Publish publish) {
  if (kStages == 1 && i > 0) load(i, 0);
  if (kStages == 2 && i + 1 < n) {
    load(i + 1, stage ^ 1);
    cp_async_wait<1>();
  } else {
    cp_async_wait<0>();
  }
  publish();
  __syncthreads();
}
template <int kStages, typename Load>
__device__ __forceinline__ void await_step(int i, int n, int stage, Load load) {
  await_step<kStages>(i, n, stage, load, [] {});
}

// -- one barrier a step (two buffers): step i's copy waited for and published, the barrier
//    (past it, every warp is also done with step i - 1, whose buffer is the other one),
//    then step i + 1's copy issued into that buffer, under step i's products --
template <typename Load, typename Publish>
__device__ __forceinline__ void await_then_prefetch(int i, int n, int stage, Load load,
                                                    Publish publish) {
  cp_async_wait<0>();
  publish();
  __syncthreads();
  if (i + 1 < n) load(i + 1, stage ^ 1);
}

// get_tile's block `block` of a sequence's key blocks (rows_out keys: the blocks it counts)
// in the dk/dv kernels' order: get_tile hands out the last blocks first, the heaviest
// query blocks under a causal mask, but the first key blocks are the ones the most
// queries see, so under a window open to the left the order is turned around (heaviest
// first: the launch ends on light blocks; 7 % of the time of 16k causal rows at d = 128
// in a greedy model of 132 SMs)
template <int kMask, int kBlockN>
__device__ __forceinline__ int heaviest_first(const FwdParams& p, int block, int rows_out) {
  if (kMask != MASK_WINDOW || p.window_left < kUnboundedWindow) return block;
  return (rows_out + kBlockN - 1) / kBlockN - 1 - block;
}

// -- a dk/dv CTA's key block: its KV head's tile (get_tile over FwdParams as if the KV
//    heads were the query heads, t.h the group's first query head), the rows of dk and dv
//    to write (every key of the sequence's block, those past seqused_k, which no query
//    sees, as zeros) and the query blocks of a head whose rows see some key of it.
//    get_tile hands out a sequence's last blocks first (see heaviest_first) --
struct KeyBlock {
  Tile t;
  int h_k, key0, rows_out, m_block_min, m_blocks;
};
template <int kMask, int kBlockM, int kBlockN>
__device__ __forceinline__ bool key_block(const FwdParams& p, const BwdParams& g, KeyBlock& kb,
                                          int tile) {
  Tile& t = kb.t;
  {
    FwdParams by_key = p;
    by_key.nheads = p.nheads_k;
    by_key.tile_list = g.kv_tile_list;
    by_key.tile_count = g.kv_tile_count;
    by_key.num_m_blocks = g.num_n_blocks;
    by_key.heads_per_group = g.kv_heads_per_group;
    by_key.tail_group_head = g.kv_tail_group_head;
    if (!get_tile(by_key, tile, t)) return false;
  }
  kb.h_k = t.h;
  kb.rows_out = t.seqlen_k;
  if (p.cu_seqlens_k && p.seqused_k) {
    const int* cu_k = reinterpret_cast<const int*>(p.cu_seqlens_k);
    kb.rows_out = min(max(cu_k[t.b + 1], 0), p.seqlen_k) - (int)t.k_start;
  }
  t.m_block = heaviest_first<kMask, kBlockN>(p, t.m_block, kb.rows_out);
  kb.key0 = t.m_block * kBlockN;
  t.h = kb.h_k * (p.nheads / p.nheads_k);
  const int key_end = min(kb.key0 + kBlockN, t.seqlen_k);
  int q_begin = 0, q_end = kb.key0 < t.seqlen_k ? t.seqlen_q : 0;
  if (kMask == MASK_WINDOW && q_end) {
    const i64 lo = (i64)kb.key0 - t.diag_offset - p.window_right;
    const i64 hi = (i64)(key_end - 1) - t.diag_offset + p.window_left + 1;
    q_begin = (int)max((i64)0, min(lo, (i64)t.seqlen_q));
    q_end = (int)max((i64)q_begin, min(hi, (i64)t.seqlen_q));
  }
  kb.m_block_min = q_begin / kBlockM;
  kb.m_blocks = (q_end + kBlockM - 1) / kBlockM - kb.m_block_min;
  return true;
}
// (the launch's own: a CTA a key block)
template <int kMask, int kBlockM, int kBlockN>
__device__ __forceinline__ bool key_block(const FwdParams& p, const BwdParams& g, KeyBlock& kb) {
  return key_block<kMask, kBlockM, kBlockN>(p, g, kb, static_cast<int>(blockIdx.x));
}

}  // namespace cufa
