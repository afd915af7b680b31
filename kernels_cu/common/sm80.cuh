#pragma once
// The instructions of the mma.sync path, on every GPU from sm_80 on: shared-memory
// addresses, cp.async copies, ldmatrix, the 16x8x16 product and its accumulator layout.
#include "types.cuh"

namespace cufa {

__device__ __forceinline__ u32 smem_u32(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy; src_bytes = 0 writes zeros (rows or columns past
// the end of the tensor) without touching global memory.
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
// one 4-byte value, likewise (src_bytes = 0: a zero)
__device__ __forceinline__ void cp_async_4(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Copies a kRows x kHeadDim tile of 16-bit elements to shared memory in 16-byte chunks,
// chunk (row, c) at byte `offset(row, c)` (the kernel's swizzle); rows past `rows_valid`
// and columns past `head_dim` become zeros. Not unrolled on purpose: unrolled, the
// compiler keeps every chunk's addresses live across the main loop, which costs more
// registers than the accumulators. row_ptr(r) gives row r's first element (called for
// valid rows only); `any` is a valid address for the zero-filling copies, which read nothing.
template <int kRows, int kHeadDim, int kThreads, typename RowPtr, typename Offset>
__device__ __forceinline__ void copy_rows_async(u32 smem, RowPtr row_ptr, const u16* any,
                                                int rows_valid, int head_dim, Offset offset,
                                                int thread) {
  constexpr int kChunks = kHeadDim / 8;
#pragma unroll 1
  for (int idx = thread; idx < kRows * kChunks; idx += kThreads) {
    const int r = idx / kChunks, c = idx % kChunks;
    const bool valid = r < rows_valid && c * 8 < head_dim;
    const u16* src = valid ? row_ptr(r) + c * 8 : any;
    cp_async_16(smem + offset(r, c), src, valid ? 16 : 0);
  }
}

// The same for rows evenly spaced from gmem.
template <int kRows, int kHeadDim, int kThreads, typename Offset>
__device__ __forceinline__ void copy_tile_async(u32 smem, const u16* gmem, i64 row_stride,
                                                int rows_valid, int head_dim, Offset offset) {
  copy_rows_async<kRows, kHeadDim, kThreads>(
      smem, [=](int r) { return gmem + r * row_stride; }, gmem, rows_valid, head_dim, offset,
      threadIdx.x);
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// c += a * b on a 16x8x16 tile, fp32 accumulators.
template <int DT>
__device__ __forceinline__ void mma_16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  if (DT == FP16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Row and key of accumulator element e of tile (mt, nt) for this lane (the mma.sync
// layout: row lane / 4 + 8 * (e / 2), column 2 * (lane % 4) + e % 2).
__device__ __forceinline__ int frag_row(int row_base, int mt, int e, int lane) {
  return row_base + mt * 16 + (lane >> 2) + 8 * (e >> 1);
}
__device__ __forceinline__ int frag_col(int col_base, int nt, int e, int lane) {
  return col_base + nt * 8 + 2 * (lane & 3) + (e & 1);
}

}  // namespace cufa
