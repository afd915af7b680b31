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

// kChains: a row's block max and sum run as that many independent chains, joined at the
// end. One chain of 16-64 dependent adds is latency the scheduler cannot fill while the
// SM's other warps wait on their products (sm90 forward at d <= 128: ncu's "wait" stalls
// 1.58 an instruction against cuDNN's 0.91; docs/decisions.md step 43).
template <int kMTiles, int kChains = 1>
struct OnlineSoftmax {
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
        row_sum[mt][h] = exponentiate_row(s, mt, h, scale_log2, max_scaled,
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
    constexpr float kLazySlack = 8.f;
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
        row_sum[mt][h] = exponentiate_row(s, mt, h, scale_log2, max_scaled,
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

  // Divides the output by the row sum and returns lse = max*scale + ln(sum). A row that
  // saw a key has sum >= 1 (its max scores exp2(0) = 1), so one-instruction reciprocal and
  // log2 (rcp/lg2.approx, <= 2 ulp there) serve; the IEEE ones cost ~30 instructions a row.
  // A row that saw no key (sum 0) gets output 0 and lse -inf; NaN passes through.
  template <int kDTiles>
  __device__ __forceinline__ void finalize(float (&o)[kMTiles][kDTiles][4], float (&lse)[kMTiles][2],
                                           float scale_log2) {
    float inv[kMTiles][2];
    bool any_empty = false;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float sum = quad_sum(row_sum[mt][h]);
        const bool empty = sum == 0.f;
        any_empty |= empty;
        inv[mt][h] = empty ? 0.f : fast_rcp(sum);
        lse[mt][h] = empty ? -CUFA_INF : (row_max[mt][h] * scale_log2 + fast_log2(sum)) * CUFA_LN2;
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
