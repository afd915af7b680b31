#pragma once
// How a decode CTA writes its rows: the warps' softmax states merged, then the output
// (or a split's normalized share and lse), 8 columns at a time.
#include "cache.cuh"
#include "../common/softmax.cuh"

namespace cufa {

// -- epilogue: each warp's row maxima and sums to shared memory, then each warp's output
//    rescaled to its rows' max over the warps (every lane takes the warps' maxima itself:
//    no pass of a few threads and a barrier between), staged in s_out
//    ([warp][row][kOStride] floats) for write_decode_output, which forms the sums. Warps
//    without a softmax state (has_state false: the TMA kernel's producer) meet the
//    barriers only. kE4m3Columns: the output tiles hold gemm_pv_e4m3's dims (tile 2c the
//    even dims of the 16-dim chunk c, 2c + 1 the odd ones), written back in order --
template <int kWarps>
__device__ __forceinline__ float warps_row_max(const float (&s_warp_max)[kWarps][kDecodeRows], int r) {
  float mx = -CUFA_INF;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, s_warp_max[w][r]);
  return mx;
}

template <int kWarps, int kOStride, bool kE4m3Columns = false, int kDTiles>
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
      if constexpr (kE4m3Columns) {  // (a lane holds dims 16c + 4t .. 16c + 4t + 3)
#pragma unroll
        for (int c = 0; c < kDTiles / 2; ++c)
        {
          const float4 x = e4m3_output_dims(acc_o, 0, c, i);
          *reinterpret_cast<float4*>(&s_out[(warp * kDecodeRows + r) * kOStride + c * 16 + 4 * (lane & 3)]) =
              make_float4(x.x * factor, x.y * factor, x.z * factor, x.w * factor);
        }
      } else {
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt)
          *reinterpret_cast<float2*>(&s_out[(warp * kDecodeRows + r) * kOStride + dt * 8 + 2 * (lane & 3)]) =
              make_float2(acc_o[0][dt][2 * i] * factor, acc_o[0][dt][2 * i + 1] * factor);
      }
    }
  }
  __syncthreads();
}

// -- 8 columns of an output row, packed to its dtype --
template <int kDtype>
__device__ __forceinline__ uint4 pack8(const float (&acc)[8]) {
  uint4 packed;
  packed.x = pack2<kDtype>(acc[0], acc[1]);
  packed.y = pack2<kDtype>(acc[2], acc[3]);
  packed.z = pack2<kDtype>(acc[4], acc[5]);
  packed.w = pack2<kDtype>(acc[6], acc[7]);
  return packed;
}
template <int kDtype>
__device__ __forceinline__ void store8(u16* dst, const float (&acc)[8]) {
  *reinterpret_cast<uint4*>(dst) = pack8<kDtype>(acc);
}

// -- the element-wise I/O variants: the first `cols` of those columns, a store an element
//    (else store8) --
template <int kDtype, bool kElementIO>
__device__ __forceinline__ void store_cols(u16* dst, const float (&acc)[8], int cols) {
  if constexpr (kElementIO)
    store8_elementwise(dst, pack8<kDtype>(acc), cols);
  else
    store8<kDtype>(dst, acc);
}

// Floats a row of o_partial (split-KV): head_dim_v, in the element-wise I/O variants rounded
// up to whole 8-column chunks, so that a chunk's float4 accesses stay aligned (the columns
// past head_dim_v are written and never stored)
template <bool kElementIO>
__device__ __forceinline__ int partial_cols(int head_dim) {
  return kElementIO ? (head_dim + 7) & ~7 : head_dim;
}

// -- epilogue: merge the warps' states, then write the output (or this split's share):
//    kHeadDim columns of s_out, the output's from col0 on (lse by the CTA of column 0);
//    kHeads 2: a row's own head's half of them (decode_row) --
template <int kDtype, int kHeadDim, class Shape, bool kElementIO = false, int kHeads = 1>
__device__ __forceinline__ void write_decode_output(const DecodeParams& p, const CacheSeq& s,
                                                    int m_block, int h_k, int split, float* s_out,
                                                    const float (&s_warp_max)[Shape::kWarps][kDecodeRows],
                                                    const float (&s_warp_sum)[Shape::kWarps][kDecodeRows],
                                                    float scale_log2, int col0 = 0) {
  constexpr int kChunks = kHeadDim / kHeads / 8;
  for (int idx = threadIdx.x; idx < kDecodeRows * kChunks; idx += Shape::kThreads) {
    const int r = idx / kChunks, c = idx % kChunks;
    const DecodeRow row = decode_row<kHeads>(p, s, m_block, h_k, r);
    if (!row.valid || col0 + c * 8 >= p.head_dim_v) continue;
    const int s_col = (kHeads == 1 ? 0 : r / rows_per_head<kHeads>() * (kHeadDim / kHeads)) + c * 8;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int w = 0; w < Shape::kWarps; ++w)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] += s_out[(w * kDecodeRows + r) * Shape::kOStride + s_col + e];
    // the row's sum over the warps, each warp's rescaled to the row's max
    const float mx = warps_row_max(s_warp_max, r);
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < Shape::kWarps; ++w)
      if (s_warp_max[w][r] != -CUFA_INF)
        sum += s_warp_sum[w][r] * fast_exp2((s_warp_max[w][r] - mx) * scale_log2);
    // (a split's share is sink-free: the merge of the splits adds the sink once)
    const RowScale n = sink_row_scale(
        mx * scale_log2, sum,
        p.num_splits > 1 ? -CUFA_INF : load_sink(p.learnable_sink, p.sink_dtype, row.h));
    const float inv = n.inv, lse = n.lse;  // inv 0: a row that saw no key gets explicit zeros
    if (p.num_splits > 1) {
      const i64 o_row = ((i64)(split * p.batch + s.b) * p.seqlen_q + row.t) * p.nheads + row.h;
      float4* dst = reinterpret_cast<float4*>(reinterpret_cast<float*>(p.o_partial) +
                                              o_row * partial_cols<kElementIO>(p.head_dim_v) +
                                              col0 + c * 8);
      dst[0] = make_float4(acc[0] * inv, acc[1] * inv, acc[2] * inv, acc[3] * inv);
      dst[1] = make_float4(acc[4] * inv, acc[5] * inv, acc[6] * inv, acc[7] * inv);
      if (c == 0 && col0 == 0)
        reinterpret_cast<float*>(p.lse_partial)[((i64)(split * p.batch + s.b) * p.nheads + row.h) *
                                                    p.seqlen_q + row.t] = lse;
    } else {
      const float out[8] = {acc[0] * inv, acc[1] * inv, acc[2] * inv, acc[3] * inv,
                            acc[4] * inv, acc[5] * inv, acc[6] * inv, acc[7] * inv};
      store_cols<kDtype, kElementIO>(reinterpret_cast<u16*>(p.o) + s.b * p.o_batch_stride +
                                         (s.q_row0 + row.t) * p.o_row_stride +
                                         row.h * p.o_head_stride + col0 + c * 8,
                                     out, p.head_dim_v - col0 - c * 8);
      if (c == 0 && col0 == 0 && p.lse)
        reinterpret_cast<float*>(p.lse)[s.b * p.lse_batch_stride + row.h * p.lse_head_stride +
                                        s.q_row0 + row.t] = lse;
    }
  }
}

}  // namespace cufa
