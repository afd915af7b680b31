// merge_attention_states: the attention over the union of two disjoint key sets, from
// each part's normalized output and lse. With m = max(lse_a, lse_b):
//   lse = m + log(exp(lse_a - m) + exp(lse_b - m))
//   out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b
// A part with lse -inf saw no key and weighs 0 (its output is not read: it may hold
// anything); two such parts give 0 and -inf. lse +inf, flash-attn 2's mark of a row
// without keys, counts as -inf; a NaN lse makes the row NaN.
#include "params.cuh"

namespace cufa {

enum MergeDtype { MERGE_FP16 = 0, MERGE_BF16 = 1, MERGE_FP32 = 2 };

template <int kDtype>
__device__ __forceinline__ float load_value(u64 base, i64 i) {
  if (kDtype == MERGE_FP32) return reinterpret_cast<const float*>(base)[i];
  const u16 h = reinterpret_cast<const u16*>(base)[i];
  return kDtype == MERGE_FP16 ? fp16_to_float(h) : bf16_to_float(h);
}

template <int kDtype>
__device__ __forceinline__ void store_value(u64 base, i64 i, float x) {
  if (kDtype == MERGE_FP32) {
    reinterpret_cast<float*>(base)[i] = x;
  } else {
    reinterpret_cast<u16*>(base)[i] = static_cast<u16>(pack2<kDtype>(x, 0.f) & 0xffffu);
  }
}

// One warp per (batch, row, head); the host keeps their count below 2^31.
template <int kDtype>
__global__ void __launch_bounds__(128) merge_states(const MergeParams p) {
  const int lane = threadIdx.x % 32;
  const int index = blockIdx.x * 4 + threadIdx.x / 32;
  if (index >= p.batch * p.seqlen * p.nheads) return;
  const i64 h = index % p.nheads, s = (index / p.nheads) % p.seqlen;
  const i64 b = index / (p.nheads * p.seqlen);
  float la = reinterpret_cast<const float*>(p.lse_a)[b * p.lse_a_batch_stride + h * p.lse_a_head_stride + s * p.lse_a_row_stride];
  float lb = reinterpret_cast<const float*>(p.lse_b)[b * p.lse_b_batch_stride + h * p.lse_b_head_stride + s * p.lse_b_row_stride];
  if (la == CUFA_INF) la = -CUFA_INF;
  if (lb == CUFA_INF) lb = -CUFA_INF;
  const float m = (la != la || lb != lb) ? la + lb : fmaxf(la, lb);  // NaN passes through
  const float base = m == -CUFA_INF ? 0.f : m;
  float wa = expf(la - base), wb = expf(lb - base);
  const float sum = wa + wb;
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  wa *= inv;
  wb *= inv;
  if (lane == 0)
    reinterpret_cast<float*>(p.lse)[b * p.lse_batch_stride + h * p.lse_head_stride + s * p.lse_row_stride] =
        m != m ? m : (sum > 0.f ? base + logf(sum) : -CUFA_INF);
  const i64 at_a = b * p.out_a_batch_stride + s * p.out_a_row_stride + h * p.out_a_head_stride;
  const i64 at_b = b * p.out_b_batch_stride + s * p.out_b_row_stride + h * p.out_b_head_stride;
  const i64 at = b * p.out_batch_stride + s * p.out_row_stride + h * p.out_head_stride;
  for (int c = lane; c < p.head_dim; c += 32) {
    float x = 0.f;
    if (wa != 0.f) x += wa * load_value<kDtype>(p.out_a, at_a + c * p.out_a_col_stride);
    if (wb != 0.f) x += wb * load_value<kDtype>(p.out_b, at_b + c * p.out_b_col_stride);
    if (m != m) x = m;
    store_value<kDtype>(p.out, at + c * p.out_col_stride, x);
  }
}

}  // namespace cufa
