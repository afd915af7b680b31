#pragma once
// Rows of 16-bit elements moved one element at a time, for the element-wise I/O variants:
// arrays whose head dim is no multiple of 8, or whose strides or start are not 16-byte
// aligned, which cp.async, TMA and 16-byte stores cannot move. A thread still handles a
// 16-byte chunk of a shared-memory tile (8 elements, the swizzle's unit), so the tiles are
// laid out as the 16-byte paths lay them out and the products read them unchanged.
#include "sm80.cuh"

namespace cufa {

__device__ __forceinline__ void st_shared_16(u32 dst, const uint4& x) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(x.x), "r"(x.y),
               "r"(x.z), "r"(x.w)
               : "memory");
}

__device__ __forceinline__ uint4 ld_shared_16(u32 src) {
  uint4 x;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w)
               : "r"(src)
               : "memory");
  return x;
}

// Eight elements from src; those from `cols` on (all when cols <= 0) read as zeros, and
// nothing is read for them.
__device__ __forceinline__ uint4 load8_elementwise(const u16* src, int cols) {
  u32 w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const u32 lo = 2 * i < cols ? src[2 * i] : 0u;
    const u32 hi = 2 * i + 1 < cols ? src[2 * i + 1] : 0u;
    w[i] = lo | (hi << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// The first `cols` (at most 8) of eight packed elements to dst, one element a store.
__device__ __forceinline__ void store8_elementwise(u16* dst, const uint4& x, int cols) {
  const u32 w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int e = 0; e < 8; ++e)
    if (e < cols) dst[e] = static_cast<u16>(w[e / 2] >> (16 * (e % 2)));
}

// copy_rows_async's tile (chunk (row, c) at byte offset(row, c); rows past rows_valid and
// columns past head_dim as zeros) by plain loads. A thread loads kBatch chunks, then stores
// them: that many chunks' loads in flight, at 4 registers a chunk (2 chunks above d = 128,
// whose accumulators leave fewer: 4 spill the forward's at d = 256 on sm_90). row_ptr(r)
// is called for valid rows only.
template <int kRows, int kHeadDim, int kThreads, typename RowPtr, typename Offset>
__device__ __forceinline__ void copy_rows_elementwise(u32 smem, RowPtr row_ptr, int rows_valid,
                                                      int head_dim, Offset offset, int thread) {
  constexpr int kChunks = kHeadDim / 8;
  constexpr int kBatch = kHeadDim > 128 ? 2 : 4;
#pragma unroll 1
  for (int first = thread; first < kRows * kChunks; first += kBatch * kThreads) {
    uint4 x[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int idx = first + j * kThreads, r = idx / kChunks, c = idx % kChunks;
      const bool valid = idx < kRows * kChunks && r < rows_valid;
      x[j] = load8_elementwise(valid ? row_ptr(r) + c * 8 : nullptr, valid ? head_dim - c * 8 : 0);
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int idx = first + j * kThreads;
      if (idx < kRows * kChunks) st_shared_16(smem + offset(idx / kChunks, idx % kChunks), x[j]);
    }
  }
}

// A thread's chunks of a kRows x kHeadDim tile (as copy_rows_elementwise lays them out),
// held in registers from their loads to their stores: the loads issued before a product
// land under it.
template <int kRows, int kHeadDim, int kThreads>
struct TileInFlight {
  static constexpr int kChunks = kRows * (kHeadDim / 8) / kThreads;  // a thread's
  static_assert(kChunks * kThreads == kRows * (kHeadDim / 8), "whole chunks a thread");
  uint4 x[kChunks];

  template <typename RowPtr>
  __device__ __forceinline__ void load(RowPtr row_ptr, int rows_valid, int head_dim, int thread) {
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int idx = thread + j * kThreads, r = idx / (kHeadDim / 8), c = idx % (kHeadDim / 8);
      const bool valid = r < rows_valid;
      x[j] = load8_elementwise(valid ? row_ptr(r) + c * 8 : nullptr, valid ? head_dim - c * 8 : 0);
    }
  }
  template <typename Offset>
  __device__ __forceinline__ void store(u32 smem, Offset offset, int thread) const {
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int idx = thread + j * kThreads;
      st_shared_16(smem + offset(idx / (kHeadDim / 8), idx % (kHeadDim / 8)), x[j]);
    }
  }
};

}  // namespace cufa
