#pragma once
// Online softmax over the mma.sync accumulator layout: each thread holds rows
// g and g+8 of every 16-row tile (g = lane / 4), spread over the 4 lanes of a quad.
#include "types.cuh"

namespace cufa {

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// -- learnable sink: one logit a query head, in natural-log units, that joins every row's
//    softmax denominator and adds no value. Params hold its address (0: none) and its
//    dtype, read here, so the host converts nothing. SinkDtype mirrors cufa/_params.py --
enum SinkDtype { SINK_FP32 = 0, SINK_FP16 = 1, SINK_BF16 = 2 };

// Query head h's sink; -inf where there is none (which then changes nothing below)
__device__ __forceinline__ float load_sink(u64 sinks, int dtype, int h) {
  if (!sinks) return -CUFA_INF;
  if (dtype == SINK_FP32) return reinterpret_cast<const float*>(sinks)[h];
  const u16 x = reinterpret_cast<const u16*>(sinks)[h];
  return dtype == SINK_FP16 ? fp16_to_float(x) : bf16_to_float(x);
}

// -- a row's normalization: max m and sum = sum_j exp2(s_j - m) of its scores (log2 units;
//    sum 0: the row saw no key), and its sink (natural log; -inf: none) -> out = acc * inv
//    and lse. With M = max(m, sink in log2 units) neither exponential overflows:
//      den = sum exp2(m - M) + exp2(sink - M),  inv = exp2(m - M) / den,
//      lse = (M + log2 den) ln 2.
//    den >= 1 (M is m, and a row that saw a key has sum >= 1: its max scores exp2(0); or M
//    is the sink, whose term is exp2(0)), where the one-instruction rcp and lg2 are within
//    2 ulp; the IEEE ones cost ~30 instructions a row. Without a sink, M = m and den = sum,
//    the plain softmax's. A row that saw no key gets inv 0 and lse = sink --
struct RowScale {
  float inv, lse;
};
__device__ __forceinline__ RowScale sink_row_scale(float m, float sum, float sink) {
  if (sum == 0.f) return RowScale{0.f, sink};
  const float sink_log2 = sink * CUFA_LOG2E;
  const float mx = fmaxf(m, sink_log2);
  const float factor = fast_exp2(m - mx);
  const float den = sum * factor + fast_exp2(sink_log2 - mx);
  return RowScale{factor * fast_rcp(den), (mx + fast_log2(den)) * CUFA_LN2};
}

// kChains: a row's block max and sum run as that many independent chains, joined at the
// end. One chain of 16-64 dependent adds is latency the scheduler cannot fill while the
// SM's other warps wait on their products (sm90 forward at d <= 128: ncu's "wait" stalls
// 1.58 an instruction against cuDNN's 0.91; docs/decisions.md step 43).
// kProbLog2: the probabilities come out times 2^kProbLog2 (the fp8 forward's P, whose e4m3
// rounding keeps small ones normal that way: 8), with the sums likewise; finalize takes it
// back out of lse, and out's ratio never saw it. update_lazy's slack is what is left of
// the 2^8 headroom, so a probability stays <= 2^8 either way.
template <int kMTiles, int kChains = 1, int kProbLog2 = 0>
struct OnlineSoftmax {
  static_assert(0 <= kProbLog2 && kProbLog2 <= 8, "probabilities stay <= 2^8");
  float row_max[kMTiles][2];  // raw score units; -inf until the row sees a key
  float row_sum[kMTiles][2];  // this lane's share; summed over the quad in finalize

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        row_max[mt][h] = -CUFA_INF;
        row_sum[mt][h] = 0.f;
      }
  }

  // The max of `init` and this block's scores of row half h (rows g and g + 8) of m-tile
  // mt, over the quad.
  template <int kNTiles>
  __device__ __forceinline__ static float row_block_max(const float (&s)[kMTiles][kNTiles][4],
                                                        int mt, int h, float init) {
    float mx[kChains];
#pragma unroll
    for (int c = 0; c < kChains; ++c) mx[c] = init;
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
      mx[nt % kChains] = fmaxf(mx[nt % kChains], fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
#pragma unroll
    for (int c = 1; c < kChains; ++c) mx[0] = fmaxf(mx[0], mx[c]);
    return quad_max(mx[0]);
  }

  // The subtracted max, less kProbLog2 (so the exponentials come out times 2^kProbLog2)
  __device__ __forceinline__ static float prob_offset(float max_scaled) {
    if constexpr (kProbLog2 != 0)
      return max_scaled - static_cast<float>(kProbLog2);
    else
      return max_scaled;
  }

  // That row half's scores -> exp2(score * scale_log2 - max_scaled), in place; returns
  // `sum` plus them (this lane's share).
  template <int kNTiles>
  __device__ __forceinline__ static float exponentiate_row(float (&s)[kMTiles][kNTiles][4], int mt,
                                                           int h, float scale_log2,
                                                           float max_scaled, float sum) {
    float sums[kChains] = {sum};
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float prob = fast_exp2(s[mt][nt][2 * h + e] * scale_log2 - max_scaled);
        s[mt][nt][2 * h + e] = prob;
        sums[(2 * nt + e) % kChains] += prob;
      }
#pragma unroll
    for (int c = 1; c < kChains; ++c) sums[0] += sums[c];
    return sums[0];
  }

  // Folds one block of scores in: raises the row max, turns the scores into
  // probabilities exp2(score * scale_log2 - max * scale_log2), and returns in
  // `correction` the factor exp2(old max - new max) that the partial output must be
  // multiplied by (rescale_output: separate, so that it can wait for an in-flight MMA).
  template <int kNTiles>
  __device__ __forceinline__ void update(float (&s)[kMTiles][kNTiles][4], float scale_log2,
                                         float (&correction)[kMTiles][2]) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float mx = row_block_max(s, mt, h, row_max[mt][h]);
        // A row that has seen only masked keys keeps max -inf: subtract 0 so
        // exp2(-inf - 0) = 0 rather than exp2(-inf + inf) = NaN.
        const float max_scaled = mx == -CUFA_INF ? 0.f : mx * scale_log2;
        correction[mt][h] = fast_exp2(row_max[mt][h] * scale_log2 - max_scaled);
        row_max[mt][h] = mx;
        row_sum[mt][h] = exponentiate_row(s, mt, h, scale_log2, prob_offset(max_scaled),
                                          row_sum[mt][h] * correction[mt][h]);
      }
  }

  // update() with a lazy max: the max the exponentials subtract is raised only when a
  // row's scores pass it by more than kLazySlack (log2 units), so probabilities stay
  // <= 2^8 (a 16-bit P keeps its relative precision at any size; the sums and O are
  // fp32) and most blocks after the first leave every correction 1. Returns whether any
  // row of the warp was raised, i.e. whether O needs rescale_output at all: at d >= 128
  // that is 64-128 multiplies a thread a block against 40-64 exponentials. (A row that
  // saw a key still has sum >= 1, as finalize's approximations need: its largest score
  // gives exp2(>= 0).)
  template <int kNTiles>
  __device__ __forceinline__ bool update_lazy(float (&s)[kMTiles][kNTiles][4], float scale_log2,
                                              float (&correction)[kMTiles][2]) {
    constexpr float kLazySlack = 8.f - kProbLog2;  // (0: the exact max, O rescaled only where raised)
    bool raised = false;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float mx = row_block_max(s, mt, h, -CUFA_INF);
        // (-inf until the row sees a key: -inf + slack stays -inf, so its first key raises)
        const bool raise = mx * scale_log2 > row_max[mt][h] * scale_log2 + kLazySlack;
        correction[mt][h] = 1.f;
        if (raise) {
          correction[mt][h] = fast_exp2((row_max[mt][h] - mx) * scale_log2);
          row_max[mt][h] = mx;
        }
        raised |= raise;
        const float max_scaled = row_max[mt][h] == -CUFA_INF ? 0.f : row_max[mt][h] * scale_log2;
        row_sum[mt][h] = exponentiate_row(s, mt, h, scale_log2, prob_offset(max_scaled),
                                          row_sum[mt][h] * correction[mt][h]);
      }
    return __any_sync(0xffffffffu, raised);
  }

  template <int kDTiles>
  __device__ __forceinline__ static void rescale_output(float (&o)[kMTiles][kDTiles][4],
                                                        const float (&correction)[kMTiles][2]) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mt][dt][e] *= correction[mt][e >> 1];
  }

  // Divides the output by the row's denominator and returns its lse (natural log), the
  // sink in both (sink_row_scale; -inf: none). A row that saw no key (sum 0) gets output 0
  // and lse = sink (-inf without one); NaN passes through.
  template <int kDTiles>
  __device__ __forceinline__ void finalize(float (&o)[kMTiles][kDTiles][4], float (&lse)[kMTiles][2],
                                           float scale_log2, float sink) {
    float inv[kMTiles][2];
    bool any_empty = false;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float sum = quad_sum(row_sum[mt][h]);
        any_empty |= sum == 0.f;
        // (the sum is of probabilities times 2^kProbLog2: of exp2(score - (max - kProbLog2)))
        const RowScale r = sink_row_scale(prob_offset(row_max[mt][h] * scale_log2), sum, sink);
        inv[mt][h] = r.inv;
        lse[mt][h] = r.lse;
      }
    // Empty rows need explicit zeros (P = 0 times a NaN in a masked-out V row would leave
    // NaN), a select per element; behind a warp vote, rows with keys skip it.
    if (__any_sync(0xffffffffu, any_empty)) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            o[mt][dt][e] = inv[mt][e >> 1] == 0.f ? 0.f : o[mt][dt][e] * inv[mt][e >> 1];
    } else {
      rescale_output(o, inv);
    }
  }
};

}  // namespace cufa
