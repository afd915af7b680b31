#pragma once
// Split-KV: each (batch, token, head) row's splits merged by their lse, by decode_combine
// or, for an eager call, in the decode launch (merge_if_last). Both run merge_split_row,
// so they add the same terms in the same order and an eager call gives the bits a graph
// or jax.jit replay of it gives.
// The reads are few (splits x head_dim floats a row) but, done one split after another,
// each waits a full memory latency: a row's threads share out the splits as well as the
// columns, so its reads are in flight at once. kRows rows a 128-thread group: 1 (128
// threads a row) for many splits; 4 (a warp a row) for a few, where a CTA a row would leave
// most of its threads idle and make the combine launch a long queue of tiny CTAs (64
// sequences x 4 tokens x 32 heads are 8192 rows). kSliceCols (decode_combine alone): a CTA
// takes that many columns of its row (slice blockIdx.y), so that a wide row over many
// splits (512 columns: 64 chunks, two split groups a CTA) has 8 groups' reads in flight
// in each of 4 CTAs, not 2 in one; its sums run in another order than merge_if_last's, so
// the host takes it only where the launch does not merge.
#include "cache.cuh"
// (store8: a merged row is written as the epilogue writes one)
#include "epilogue.cuh"

namespace cufa {

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

// The columns of a row this CTA merges: from slice_col0, slice_width of them (all of
// o_partial's row but with kSliceCols; 0 a constant, so a whole row's code is as it was)
template <int kSliceCols>
__device__ __forceinline__ int slice_col0() {
  if constexpr (kSliceCols == 0) return 0;
  else return blockIdx.y * kSliceCols;
}
template <int kSliceCols, bool kElementIO>
__device__ __forceinline__ int slice_width(const DecodeParams& p) {
  if constexpr (kSliceCols == 0) return partial_cols<kElementIO>(p.head_dim_v);
  else return min(kSliceCols, partial_cols<kElementIO>(p.head_dim_v) - slice_col0<kSliceCols>());
}

template <int kRows, bool kElementIO = false, int kSliceCols = 0>
__device__ __forceinline__ SplitRow load_split_row(const DecodeParams& p, int b, int t, int h,
                                                   int tid) {
  constexpr int kRowThreads = kCombineThreads / kRows;
  SplitRow in{b, t, h};
  const float* lse_part = reinterpret_cast<const float*>(p.lse_partial) +
                          ((i64)b * p.nheads + h) * p.seqlen_q + t;
  in.lse = tid < p.num_splits ? __ldcg(lse_part + tid * ((i64)p.batch * p.nheads * p.seqlen_q))
                              : -CUFA_INF;
  const int chunks = slice_width<kSliceCols, kElementIO>(p) / 8, groups = kRowThreads / chunks;
  const int chunk = tid % chunks, group = tid / chunks;
  const i64 split_o = (i64)p.batch * p.seqlen_q * p.nheads * partial_cols<kElementIO>(p.head_dim_v);
  const float* o_part = reinterpret_cast<const float*>(p.o_partial) +
                        (((i64)b * p.seqlen_q + t) * p.nheads + h) *
                            partial_cols<kElementIO>(p.head_dim_v) + slice_col0<kSliceCols>() +
                        chunk * 8;
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
// columns weighted and summed in split order, the groups' sums added in group order. The
// splits' shares are sink-free; the row's learnable sink enters here, once: a part of
// output 0 and lse = sink (its term exp(sink - max) in the sum, its max in the max; -inf
// without a sink, which then adds 0).
// weight: the row's [kMaxSplits]; partial: the row's [kRowThreads][8]; warp_value: [4].
template <int kDtype, int kRows, bool kElementIO = false, int kSliceCols = 0>
__device__ __forceinline__ void merge_split_row(const DecodeParams& p, const SplitRow& in,
                                                int q_row0, int tid, float* weight, float* partial,
                                                float* warp_value) {
  constexpr int kRowThreads = kCombineThreads / kRows;
  const float sink = load_sink(p.learnable_sink, p.sink_dtype, in.h);
  const float mx = fmaxf(row_reduce<kRows, true>(in.lse, warp_value), sink);
  const float base = mx == -CUFA_INF ? 0.f : mx;
  const float e = in.lse == -CUFA_INF ? 0.f : fast_exp2((in.lse - base) * CUFA_LOG2E);
  const float sum = row_reduce<kRows, false>(e, warp_value) + fast_exp2((sink - base) * CUFA_LOG2E);
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  if (tid < p.num_splits) weight[tid] = e * inv;
  if (tid == 0 && p.lse && slice_col0<kSliceCols>() == 0)
    reinterpret_cast<float*>(p.lse)[in.b * p.lse_batch_stride + in.h * p.lse_head_stride + q_row0 + in.t] =
        sum > 0.f ? base + logf(sum) : -CUFA_INF;
  row_sync<kRows>();  // every weight of the row written

  const int chunks = slice_width<kSliceCols, kElementIO>(p) / 8, groups = kRowThreads / chunks;
  const int chunk = tid % chunks, group = tid / chunks;
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if (group < groups) {
#pragma unroll
    for (int i = 0; i < kCombineEarly; ++i) {
      const int sp = group + i * groups;
      if (sp < p.num_splits) add_weighted8(acc, weight[sp], in.early[i][0], in.early[i][1]);
    }
    const i64 split_o =
        (i64)p.batch * p.seqlen_q * p.nheads * partial_cols<kElementIO>(p.head_dim_v);
    const float* o_part = reinterpret_cast<const float*>(p.o_partial) +
                          (((i64)in.b * p.seqlen_q + in.t) * p.nheads + in.h) *
                              partial_cols<kElementIO>(p.head_dim_v) + slice_col0<kSliceCols>() +
                          chunk * 8;
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
  store_cols<kDtype, kElementIO>(reinterpret_cast<u16*>(p.o) + in.b * p.o_batch_stride +
                                     (q_row0 + in.t) * p.o_row_stride + in.h * p.o_head_stride +
                                     slice_col0<kSliceCols>() + tid * 8,
                                 acc, p.head_dim_v - slice_col0<kSliceCols>() - tid * 8);
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
//    launch on the stream. scratch: the CTA's cache stages. rows: a head's, of kHeads. --
template <int kDtype, int kThreads, bool kElementIO = false, int kHeads = 1>
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
    for (int i = warp; i < kHeads * rows; i += kThreads / 32) {
      const int r = tile_row<kHeads>(i, rows);
      const DecodeRow row = decode_row<kHeads>(p, s, m_block, h_k, r);
      const SplitRow in = load_split_row<4, kElementIO>(p, s.b, row.t, row.h, lane);
      merge_split_row<kDtype, 4, kElementIO>(p, in, s.q_row0, lane, weight + r * kMaxSplits,
                                             partial + warp * 32 * 8, warp_value);
    }
  } else if constexpr (kThreads >= kCombineThreads) {  // a row on threads 0-127
    if (threadIdx.x >= kCombineThreads) return;
    for (int i = 0; i < kHeads * rows; ++i) {
      const DecodeRow row = decode_row<kHeads>(p, s, m_block, h_k, tile_row<kHeads>(i, rows));
      const SplitRow in = load_split_row<1, kElementIO>(p, s.b, row.t, row.h, threadIdx.x);
      merge_split_row<kDtype, 1, kElementIO>(p, in, s.q_row0, threadIdx.x, weight, partial,
                                             warp_value);
      row_sync<1>();  // the next row rewrites weight and partial
    }
  }
}

}  // namespace cufa
