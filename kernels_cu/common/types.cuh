#pragma once
// Scalar types and the PTX instructions the sm_80 path is built from.
// No CUDA headers: NVRTC compiles these sources with an empty include path, so
// half types live in plain 16-bit integers and conversions go through PTX.

namespace cufa {

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

enum Dtype { FP16 = 0, BF16 = 1 };

#define CUFA_INF __int_as_float(0x7f800000)
#define CUFA_LOG2E 1.4426950408889634f
#define CUFA_LN2 0.6931471805599453f

// Two floats -> one register holding two 16-bit values, `lo` in the low half.
template <int DT>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r;
  if (DT == FP16) {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
}

__device__ __forceinline__ float fp16_to_float(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

__device__ __forceinline__ float bf16_to_float(u16 h) {
  return __uint_as_float(static_cast<u32>(h) << 16);
}

// exp2 on the special-function unit; exp2(-inf) = 0, which masking relies on.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// tanh as 1 - 2 / (e^{2x} + 1) on the special-function unit: absolute error ~1e-7 (near 0
// the difference loses relative precision, not absolute, which is what a softcap's score
// keeps); +-1 for large |x|, NaN kept. libdevice's tanhf is ~20 instructions with a full
// division, a few times the cost of the rest of a score's work.
__device__ __forceinline__ float fast_tanh(float x) {
  return 1.f - 2.f * fast_rcp(fast_exp2(x * 2.8853900817779268f) + 1.f);  // 2 log2(e)
}

__device__ __forceinline__ u32 smem_u32(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy; src_bytes = 0 writes zeros (rows or columns past
// the end of the tensor) without touching global memory.
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
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

// Offset of a params field, computed at compile time (the layout checks): set the field
// to a value whose lowest byte is non-zero, bit_cast the struct to bytes, find that
// byte. Params structs hold addresses as integers so that they can be bit_cast.
template <typename T>
struct StructBytes {
  unsigned char b[sizeof(T)];
};
template <typename T, typename M>
__device__ constexpr int field_offset(M T::*field, M marker) {
  T t{};
  t.*field = marker;
  const StructBytes<T> bytes = __builtin_bit_cast(StructBytes<T>, t);
  for (int i = 0; i < (int)sizeof(T); ++i)
    if (bytes.b[i]) return i;
  return -1;
}

}  // namespace cufa
