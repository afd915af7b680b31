// cufa fwd_sm90.cu sha256:bd8fe95758c7e7d3
// Forward attention on Hopper's warpgroup MMA (sm_90a). Two warpgroups of 4 warps own
// 64 query rows each (a CTA owns 128 rows of one (batch, head)); both matrix products
// are wgmma: S = Q K^T with Q and K read from shared memory through descriptors, and
// O += P V with P straight from the S registers. K/V blocks stream through a two-stage
// cp.async ring: block j+1 loads while block j computes.
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

}  // namespace cufa

#pragma once
// Parameters of the forward kernel family, passed by value. The Python mirror is
// cufa/_params.py; every compile appends static_asserts generated from it, so a
// layout mismatch is a compile error, never a silent misread.

namespace cufa {

// What attn_mask points to (SDPA's explicit mask), a runtime choice in the
// score-mods variants.
enum AttnMaskType { ATTN_MASK_NONE = 0, ATTN_MASK_BOOL = 1, ATTN_MASK_FP16 = 2,
                    ATTN_MASK_BF16 = 3, ATTN_MASK_FP32 = 4 };

struct FwdParams {
  // Device addresses as integers: a struct of plain numbers can be bit_cast at
  // compile time, which is how the layout check reads field offsets.
  u64 q, k, v, o;
  u64 lse;           // float32 (batch, nheads, seqlen_q)
  u64 attn_mask;     // broadcast through zero strides; 0 if none
  u64 alibi_slopes;  // float32 (batch or 1, nheads); 0 if none

  // Strides in elements; 64-bit because a tensor may exceed 2^31 elements.
  i64 q_batch_stride, q_row_stride, q_head_stride;
  i64 k_batch_stride, k_row_stride, k_head_stride;
  i64 v_batch_stride, v_row_stride, v_head_stride;
  i64 o_batch_stride, o_row_stride, o_head_stride;
  i64 lse_batch_stride, lse_head_stride;
  i64 mask_batch_stride, mask_head_stride, mask_row_stride, mask_col_stride;
  i64 alibi_batch_stride;

  int batch, nheads, nheads_k;
  int seqlen_q, seqlen_k, head_dim;
  int num_m_blocks;
  // Query i sees key j iff i + diag_offset - window_left <= j <= i + diag_offset + window_right.
  // diag_offset is seqlen_k - seqlen_q (flash-attn, bottom-right) or 0 (SDPA, top-left);
  // an unbounded side holds a value larger than any sequence.
  int diag_offset, window_left, window_right;
  int attn_mask_type;

  float scale;       // softmax scale
  float scale_log2;  // scale * log2(e): one FFMA per score before exp2
  float softcap;     // 0 = off
  float softcap_inv;
};

}  // namespace cufa

namespace cufa {

// Offset of a field, computed at compile time: set the field to a value whose
// lowest byte is non-zero, bit_cast the struct to bytes, find that byte.
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

#pragma once
// Which keys a query sees. Causal is the window (unbounded, 0); both are one
// predicate, so the kernels carry a single compile-time mask kind.

namespace cufa {

enum MaskKind { MASK_NONE = 0, MASK_WINDOW = 1 };

struct KeyRange {
  int begin, end;  // keys [begin, end) that some row of the query block sees
};

template <int kMask>
__device__ __forceinline__ KeyRange key_range(const FwdParams& p, int row_begin, int row_end) {
  KeyRange r{0, p.seqlen_k};
  if (kMask == MASK_WINDOW) {
    i64 lo = (i64)row_begin + p.diag_offset - p.window_left;
    i64 hi = (i64)(row_end - 1) + p.diag_offset + p.window_right + 1;
    r.begin = (int)max((i64)0, min(lo, (i64)p.seqlen_k));
    r.end = (int)max((i64)r.begin, min(hi, (i64)p.seqlen_k));
  }
  return r;
}

// True when some (row, key) pair of the block is not visible, so the block
// needs the per-element predicate; interior blocks skip it.
template <int kMask>
__device__ __forceinline__ bool block_needs_mask(const FwdParams& p, int row_begin, int row_end,
                                                 int key_begin, int key_end) {
  if (key_end > p.seqlen_k) return true;
  if (kMask == MASK_WINDOW) {
    i64 lowest_hi = (i64)row_begin + p.diag_offset + p.window_right;   // first row's last key
    i64 highest_lo = (i64)(row_end - 1) + p.diag_offset - p.window_left;  // last row's first key
    if (lowest_hi < key_end - 1 || highest_lo > key_begin) return true;
  }
  return false;
}

template <int kMask>
__device__ __forceinline__ bool key_visible(const FwdParams& p, int row, int key) {
  if (key >= p.seqlen_k) return false;
  if (kMask == MASK_WINDOW) {
    i64 diag = (i64)row + p.diag_offset;
    if (key < diag - p.window_left || key > diag + p.window_right) return false;
  }
  return true;
}

}  // namespace cufa

#pragma once
// Online softmax over the mma.sync accumulator layout: each thread holds rows
// g and g+8 of every 16-row tile (g = lane / 4), spread over the 4 lanes of a quad.

namespace cufa {

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

template <int kMTiles>
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

  // Folds one block of scores in: raises the row max, computes the probabilities
  // exp2(score * scale_log2 - max * scale_log2) and hands each pair (elements 2h, 2h+1
  // of tile (mt, nt)) to store(mt, nt, h, p0, p1); returns in `correction` the factor
  // exp2(old max - new max) that the partial output must be multiplied by
  // (rescale_output: separate, so that it can wait for an in-flight MMA).
  template <int kNTiles, typename Store>
  __device__ __forceinline__ void update(const float (&s)[kMTiles][kNTiles][4], float scale_log2,
                                         float (&correction)[kMTiles][2], Store store) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = row_max[mt][h];
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
          mx = fmaxf(mx, fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
        mx = quad_max(mx);
        // A row that has seen only masked keys keeps max -inf: subtract 0 so
        // exp2(-inf - 0) = 0 rather than exp2(-inf + inf) = NaN.
        const float max_scaled = mx == -CUFA_INF ? 0.f : mx * scale_log2;
        correction[mt][h] = fast_exp2(row_max[mt][h] * scale_log2 - max_scaled);
        row_max[mt][h] = mx;
        float sum = row_sum[mt][h] * correction[mt][h];
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          const float p0 = fast_exp2(s[mt][nt][2 * h] * scale_log2 - max_scaled);
          const float p1 = fast_exp2(s[mt][nt][2 * h + 1] * scale_log2 - max_scaled);
          sum += p0 + p1;
          store(mt, nt, h, p0, p1);
        }
        row_sum[mt][h] = sum;
      }
  }

  // The same, with the probabilities written over the scores.
  template <int kNTiles>
  __device__ __forceinline__ void update(float (&s)[kMTiles][kNTiles][4], float scale_log2,
                                         float (&correction)[kMTiles][2]) {
    update(s, scale_log2, correction, [&](int mt, int nt, int h, float p0, float p1) {
      s[mt][nt][2 * h] = p0;
      s[mt][nt][2 * h + 1] = p1;
    });
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

  // Divides the output by the row sum and returns lse = max*scale + ln(sum).
  // A row that saw no key (sum 0) gets output 0 and lse -inf; NaN passes through.
  template <int kDTiles>
  __device__ __forceinline__ void finalize(float (&o)[kMTiles][kDTiles][4], float (&lse)[kMTiles][2],
                                           float scale_log2) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float sum = quad_sum(row_sum[mt][h]);
        const bool empty = sum == 0.f;
        const float inv = 1.f / sum;
        lse[mt][h] = empty ? -CUFA_INF : (row_max[mt][h] * scale_log2 + log2f(sum)) * CUFA_LN2;
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          // Explicit zero: P = 0 times a NaN in a masked-out V row would leave NaN.
          o[mt][dt][2 * h] = empty ? 0.f : o[mt][dt][2 * h] * inv;
          o[mt][dt][2 * h + 1] = empty ? 0.f : o[mt][dt][2 * h + 1] * inv;
        }
      }
  }
};

}  // namespace cufa

#pragma once
// Score stages shared by the forward kernels, on the mma.sync accumulator layout
// (wgmma accumulators use the same layout per warp): element e of tile (mt, nt)
// is row 16 * mt + lane / 4 + 8 * (e / 2), column 8 * nt + 2 * (lane % 4) + e % 2.


namespace cufa {

// Row and key of accumulator element e of tile (mt, nt) for this lane.
__device__ __forceinline__ int frag_row(int row_base, int mt, int e, int lane) {
  return row_base + mt * 16 + (lane >> 2) + 8 * (e >> 1);
}
__device__ __forceinline__ int frag_col(int col_base, int nt, int e, int lane) {
  return col_base + nt * 8 + 2 * (lane & 3) + (e & 1);
}

// -- mask: keys outside the window or past seqlen_k get -inf --
template <int kMask, int kMTiles, int kNTiles>
__device__ __forceinline__ void apply_mask(float (&s)[kMTiles][kNTiles][4], const FwdParams& p,
                                           int row_base, int key0, int lane) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (!key_visible<kMask>(p, frag_row(row_base, mt, e, lane), frag_col(key0, nt, e, lane)))
          s[mt][nt][e] = -CUFA_INF;
}

__device__ __forceinline__ float attn_mask_value(const FwdParams& p, i64 offset) {
  switch (p.attn_mask_type) {
    case ATTN_MASK_BOOL: return reinterpret_cast<const unsigned char*>(p.attn_mask)[offset] ? 0.f : -CUFA_INF;
    case ATTN_MASK_FP16: return fp16_to_float(reinterpret_cast<const u16*>(p.attn_mask)[offset]);
    case ATTN_MASK_BF16: return bf16_to_float(reinterpret_cast<const u16*>(p.attn_mask)[offset]);
    case ATTN_MASK_FP32: return reinterpret_cast<const float*>(p.attn_mask)[offset];
    default: return 0.f;
  }
}

// -- score mods: scale, softcap, ALiBi, explicit mask; leaves scores in log2 units --
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void apply_score_mods(float (&s)[kMTiles][kNTiles][4], const FwdParams& p,
                                                 float alibi_slope, i64 mask_offset, int row_base,
                                                 int key0, int lane) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = frag_row(row_base, mt, e, lane), key = frag_col(key0, nt, e, lane);
        float x = s[mt][nt][e] * p.scale;
        if (p.softcap > 0.f) x = p.softcap * tanhf(x * p.softcap_inv);
        x -= alibi_slope * fabsf(static_cast<float>((i64)row + p.diag_offset - key));
        if (p.attn_mask_type != ATTN_MASK_NONE && row < p.seqlen_q && key < p.seqlen_k)
          x += attn_mask_value(p, mask_offset + row * p.mask_row_stride + key * p.mask_col_stride);
        s[mt][nt][e] = x * CUFA_LOG2E;
      }
}

}  // namespace cufa

#pragma once
// Hopper building blocks (sm_90a): shared-memory matrix descriptors, wgmma ordering,
// and the 128-byte-swizzled tile layout the descriptors describe.

namespace cufa {

// Tiles are stored as panels of 64 columns (128 bytes a row); rows of a panel are
// consecutive, and 16-byte chunk c of row r sits at chunk c ^ (r % 8): the canonical
// 128B-swizzle layout, for K-major operands (Q, K) and MN-major ones (V) alike.
// Panels start at 1024-byte boundaries so the swizzle phase is 0.
template <int kRows>
__device__ __forceinline__ int panel_offset(int row, int chunk) {  // bytes
  return (chunk / 8) * (kRows * 128) + row * 128 + (((chunk % 8) ^ (row % 8)) * 16);
}

// wgmma shared-memory descriptor: start address, leading and stride byte offsets
// (each >> 4), swizzle mode 1 = 128 bytes.
__device__ __forceinline__ u64 smem_desc(u32 addr, u32 leading_bytes, u32 stride_bytes) {
  return static_cast<u64>((addr & 0x3FFFF) >> 4) |
         (static_cast<u64>((leading_bytes >> 4) & 0x3FFF) << 16) |
         (static_cast<u64>((stride_bytes >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// cp.async writes are generic-proxy stores; wgmma reads through the async proxy.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// wgmma reads and writes its registers asynchronously, but the compiler sees the asm
// as done at issue. Passing each register through an empty volatile asm after
// wgmma_wait keeps the compiler from reading accumulators, or reusing A-operand
// registers, before the hardware is finished with them.
template <int A, int B, int C>
__device__ __forceinline__ void fence_registers(float (&x)[A][B][C]) {
#pragma unroll
  for (int i = 0; i < A; ++i)
#pragma unroll
    for (int j = 0; j < B; ++j)
#pragma unroll
      for (int k = 0; k < C; ++k) asm volatile("" : "+f"(x[i][j][k])::"memory");
}
template <int A, int B>
__device__ __forceinline__ void fence_registers(u32 (&x)[A][B]) {
#pragma unroll
  for (int i = 0; i < A; ++i)
#pragma unroll
    for (int j = 0; j < B; ++j) asm volatile("" : "+r"(x[i][j])::"memory");
}

}  // namespace cufa

#pragma once
// Generated by tools/gen_wgmma.py: do not edit by hand.
// wgmma.mma_async m64nNk16 with fp32 accumulators, fp16/bf16 operands.
//   wgmma_ss: A and B from shared memory (descriptors), both K-major (S = Q K^T).
//   wgmma_rs: A from registers, B from shared memory MN-major (O += P V).
// accumulate = 0 overwrites d, 1 adds to it. Accumulators use the mma.sync C layout
// per warp: d[0][n / 8][e] is row 16 * warp + lane / 4 + 8 * (e / 2), column n.

namespace cufa {

template <int DT>
__device__ __forceinline__ void wgmma_ss(float (&d)[1][4][4], u64 desc_a, u64 desc_b, int accumulate) {
  if (DT == FP16)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0][0]), "+f"(d[0][0][1]), "+f"(d[0][0][2]), "+f"(d[0][0][3]), "+f"(d[0][1][0]), "+f"(d[0][1][1]), "+f"(d[0][1][2]), "+f"(d[0][1][3]), "+f"(d[0][2][0]), "+f"(d[0][2][1]), "+f"(d[0][2][2]), "+f"(d[0][2][3]), "+f"(d[0][3][0]), "+f"(d[0][3][1]), "+f"(d[0][3][2]), "+f"(d[0][3][3])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  if (DT == BF16)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0][0]), "+f"(d[0][0][1]), "+f"(d[0][0][2]), "+f"(d[0][0][3]), "+f"(d[0][1][0]), "+f"(d[0][1][1]), "+f"(d[0][1][2]), "+f"(d[0][1][3]), "+f"(d[0][2][0]), "+f"(d[0][2][1]), "+f"(d[0][2][2]), "+f"(d[0][2][3]), "+f"(d[0][3][0]), "+f"(d[0][3][1]), "+f"(d[0][3][2]), "+f"(d[0][3][3])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

template <int DT>
__device__ __forceinline__ void wgmma_ss(float (&d)[1][8][4], u64 desc_a, u64 desc_b, int accumulate) {
  if (DT == FP16)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0][0]), "+f"(d[0][0][1]), "+f"(d[0][0][2]), "+f"(d[0][0][3]), "+f"(d[0][1][0]), "+f"(d[0][1][1]), "+f"(d[0][1][2]), "+f"(d[0][1][3]), "+f"(d[0][2][0]), "+f"(d[0][2][1]), "+f"(d[0][2][2]), "+f"(d[0][2][3]), "+f"(d[0][3][0]), "+f"(d[0][3][1]), "+f"(d[0][3][2]), "+f"(d[0][3][3]), "+f"(d[0][4][0]), "+f"(d[0][4][1]), "+f"(d[0][4][2]), "+f"(d[0][4][3]), "+f"(d[0][5][0]), "+f"(d[0][5][1]), "+f"(d[0][5][2]), "+f"(d[0][5][3]), "+f"(d[0][6][0]), "+f"(d[0][6][1]), "+f"(d[0][6][2]), "+f"(d[0][6][3]), "+f"(d[0][7][0]), "+f"(d[0][7][1]), "+f"(d[0][7][2]), "+f"(d[0][7][3])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  if (DT == BF16)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0][0]), "+f"(d[0][0][1]), "+f"(d[0][0][2]), "+f"(d[0][0][3]), "+f"(d[0][1][0]), "+f"(d[0][1][1]), "+f"(d[0][1][2]), "+f"(d[0][1][3]), "+f"(d[0][2][0]), "+f"(d[0][2][1]), "+f"(d[0][2][2]), "+f"(d[0][2][3]), "+f"(d[0][3][0]), "+f"(d[0][3][1]), "+f"(d[0][3][2]), "+f"(d[0][3][3]), "+f"(d[0][4][0]), "+f"(d[0][4][1]), "+f"(d[0][4][2]), "+f"(d[0][4][3]), "+f"(d[0][5][0]), "+f"(d[0][5][1]), "+f"(d[0][5][2]), "+f"(d[0][5][3]), "+f"(d[0][6][0]), "+f"(d[0][6][1]), "+f"(d[0][6][2]), "+f"(d[0][6][3]), "+f"(d[0][7][0]), "+f"(d[0][7][1]), "+f"(d[0][7][2]), "+f"(d[0][7][3])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

template <int DT>
__device__ __forceinline__ void wgmma_ss(float (&d)[1][16][4], u64 desc_a, u64 desc_b, int accumulate) {
  if (DT == FP16)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0][0]), "+f"(d[0][0][1]), "+f"(d[0][0][2]), "+f"(d[0][0][3]), "+f"(d[0][1][0]), "+f"(d[0][1][1]), "+f"(d[0][1][2]), "+f"(d[0][1][3]), "+f"(d[0][2][0]), "+f"(d[0][2][1]), "+f"(d[0][2][2]), "+f"(d[0][2][3]), "+f"(d[0][3][0]), "+f"(d[0][3][1]), "+f"(d[0][3][2]), "+f"(d[0][3][3]), "+f"(d[0][4][0]), "+f"(d[0][4][1]), "+f"(d[0][4][2]), "+f"(d[0][4][3]), "+f"(d[0][5][0]), "+f"(d[0][5][1]), "+f"(d[0][5][2]), "+f"(d[0][5][3]), "+f"(d[0][6][0]), "+f"(d[0][6][1]), "+f"(d[0][6][2]), "+f"(d[0][6][3]), "+f"(d[0][7][0]), "+f"(d[0][7][1]), "+f"(d[0][7][2]), "+f"(d[0][7][3]), "+f"(d[0][8][0]), "+f"(d[0][8][1]), "+f"(d[0][8][2]), "+f"(d[0][8][3]), "+f"(d[0][9][0]), "+f"(d[0][9][1]), "+f"(d[0][9][2]), "+f"(d[0][9][3]), "+f"(d[0][10][0]), "+f"(d[0][10][1]), "+f"(d[0][10][2]), "+f"(d[0][10][3]), "+f"(d[0][11][0]), "+f"(d[0][11][1]), "+f"(d[0][11][2]), "+f"(d[0][11][3]), "+f"(d[0][12][0]), "+f"(d[0][12][1]), "+f"(d[0][12][2]), "+f"(d[0][12][3]), "+f"(d[0][13][0]), "+f"(d[0][13][1]), "+f"(d[0][13][2]), "+f"(d[0][13][3]), "+f"(d[0][14][0]), "+f"(d[0][14][1]), "+f"(d[0][14][2]), "+f"(d[0][14][3]), "+f"(d[0][15][0]), "+f"(d[0][15][1]), "+f"(d[0][15][2]), "+f"(d[0][15][3])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  if (DT == BF16)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0][0]), "+f"(d[0][0][1]), "+f"(d[0][0][2]), "+f"(d[0][0][3]), "+f"(d[0][1][0]), "+f"(d[0][1][1]), "+f"(d[0][1][2]), "+f"(d[0][1][3]), "+f"(d[0][2][0]), "+f"(d[0][2][1]), "+f"(d[0][2][2]), "+f"(d[0][2][3]), "+f"(d[0][3][0]), "+f"(d[0][3][1]), "+f"(d[0][3][2]), "+f"(d[0][3][3]), "+f"(d[0][4][0]), "+f"(d[0][4][1]), "+f"(d[0][4][2]), "+f"(d[0][4][3]), "+f"(d[0][5][0]), "+f"(d[0][5][1]), "+f"(d[0][5][2]), "+f"(d[0][5][3]), "+f"(d[0][6][0]), "+f"(d[0][6][1]), "+f"(d[0][6][2]), "+f"(d[0][6][3]), "+f"(d[0][7][0]), "+f"(d[0][7][1]), "+f"(d[0][7][2]), "+f"(d[0][7][3]), "+f"(d[0][8][0]), "+f"(d[0][8][1]), "+f"(d[0][8][2]), "+f"(d[0][8][3]), "+f"(d[0][9][0]), "+f"(d[0][9][1]), "+f"(d[0][9][2]), "+f"(d[0][9][3]), "+f"(d[0][10][0]), "+f"(d[0][10][1]), "+f"(d[0][10][2]), "+f"(d[0][10][3]), "+f"(d[0][11][0]), "+f"(d[0][11][1]), "+f"(d[0][11][2]), "+f"(d[0][11][3]), "+f"(d[0][12][0]), "+f"(d[0][12][1]), "+f"(d[0][12][2]), "+f"(d[0][12][3]), "+f"(d[0][13][0]), "+f"(d[0][13][1]), "+f"(d[0][13][2]), "+f"(d[0][13][3]), "+f"(d[0][14][0]), "+f"(d[0][14][1]), "+f"(d[0][14][2]), "+f"(d[0][14][3]), "+f"(d[0][15][0]), "+f"(d[0][15][1]), "+f"(d[0][15][2]), "+f"(d[0][15][3])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

template <int DT>
__device__ __forceinline__ void wgmma_rs(float (&d)[1][8][4], const u32 (&a)[4], u64 desc_b, int accumulate) {
  if (DT == FP16)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : "+f"(d[0][0][0]), "+f"(d[0][0][1]), "+f"(d[0][0][2]), "+f"(d[0][0][3]), "+f"(d[0][1][0]), "+f"(d[0][1][1]), "+f"(d[0][1][2]), "+f"(d[0][1][3]), "+f"(d[0][2][0]), "+f"(d[0][2][1]), "+f"(d[0][2][2]), "+f"(d[0][2][3]), "+f"(d[0][3][0]), "+f"(d[0][3][1]), "+f"(d[0][3][2]), "+f"(d[0][3][3]), "+f"(d[0][4][0]), "+f"(d[0][4][1]), "+f"(d[0][4][2]), "+f"(d[0][4][3]), "+f"(d[0][5][0]), "+f"(d[0][5][1]), "+f"(d[0][5][2]), "+f"(d[0][5][3]), "+f"(d[0][6][0]), "+f"(d[0][6][1]), "+f"(d[0][6][2]), "+f"(d[0][6][3]), "+f"(d[0][7][0]), "+f"(d[0][7][1]), "+f"(d[0][7][2]), "+f"(d[0][7][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
  if (DT == BF16)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : "+f"(d[0][0][0]), "+f"(d[0][0][1]), "+f"(d[0][0][2]), "+f"(d[0][0][3]), "+f"(d[0][1][0]), "+f"(d[0][1][1]), "+f"(d[0][1][2]), "+f"(d[0][1][3]), "+f"(d[0][2][0]), "+f"(d[0][2][1]), "+f"(d[0][2][2]), "+f"(d[0][2][3]), "+f"(d[0][3][0]), "+f"(d[0][3][1]), "+f"(d[0][3][2]), "+f"(d[0][3][3]), "+f"(d[0][4][0]), "+f"(d[0][4][1]), "+f"(d[0][4][2]), "+f"(d[0][4][3]), "+f"(d[0][5][0]), "+f"(d[0][5][1]), "+f"(d[0][5][2]), "+f"(d[0][5][3]), "+f"(d[0][6][0]), "+f"(d[0][6][1]), "+f"(d[0][6][2]), "+f"(d[0][6][3]), "+f"(d[0][7][0]), "+f"(d[0][7][1]), "+f"(d[0][7][2]), "+f"(d[0][7][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

template <int DT>
__device__ __forceinline__ void wgmma_rs(float (&d)[1][16][4], const u32 (&a)[4], u64 desc_b, int accumulate) {
  if (DT == FP16)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0][0][0]), "+f"(d[0][0][1]), "+f"(d[0][0][2]), "+f"(d[0][0][3]), "+f"(d[0][1][0]), "+f"(d[0][1][1]), "+f"(d[0][1][2]), "+f"(d[0][1][3]), "+f"(d[0][2][0]), "+f"(d[0][2][1]), "+f"(d[0][2][2]), "+f"(d[0][2][3]), "+f"(d[0][3][0]), "+f"(d[0][3][1]), "+f"(d[0][3][2]), "+f"(d[0][3][3]), "+f"(d[0][4][0]), "+f"(d[0][4][1]), "+f"(d[0][4][2]), "+f"(d[0][4][3]), "+f"(d[0][5][0]), "+f"(d[0][5][1]), "+f"(d[0][5][2]), "+f"(d[0][5][3]), "+f"(d[0][6][0]), "+f"(d[0][6][1]), "+f"(d[0][6][2]), "+f"(d[0][6][3]), "+f"(d[0][7][0]), "+f"(d[0][7][1]), "+f"(d[0][7][2]), "+f"(d[0][7][3]), "+f"(d[0][8][0]), "+f"(d[0][8][1]), "+f"(d[0][8][2]), "+f"(d[0][8][3]), "+f"(d[0][9][0]), "+f"(d[0][9][1]), "+f"(d[0][9][2]), "+f"(d[0][9][3]), "+f"(d[0][10][0]), "+f"(d[0][10][1]), "+f"(d[0][10][2]), "+f"(d[0][10][3]), "+f"(d[0][11][0]), "+f"(d[0][11][1]), "+f"(d[0][11][2]), "+f"(d[0][11][3]), "+f"(d[0][12][0]), "+f"(d[0][12][1]), "+f"(d[0][12][2]), "+f"(d[0][12][3]), "+f"(d[0][13][0]), "+f"(d[0][13][1]), "+f"(d[0][13][2]), "+f"(d[0][13][3]), "+f"(d[0][14][0]), "+f"(d[0][14][1]), "+f"(d[0][14][2]), "+f"(d[0][14][3]), "+f"(d[0][15][0]), "+f"(d[0][15][1]), "+f"(d[0][15][2]), "+f"(d[0][15][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
  if (DT == BF16)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0][0][0]), "+f"(d[0][0][1]), "+f"(d[0][0][2]), "+f"(d[0][0][3]), "+f"(d[0][1][0]), "+f"(d[0][1][1]), "+f"(d[0][1][2]), "+f"(d[0][1][3]), "+f"(d[0][2][0]), "+f"(d[0][2][1]), "+f"(d[0][2][2]), "+f"(d[0][2][3]), "+f"(d[0][3][0]), "+f"(d[0][3][1]), "+f"(d[0][3][2]), "+f"(d[0][3][3]), "+f"(d[0][4][0]), "+f"(d[0][4][1]), "+f"(d[0][4][2]), "+f"(d[0][4][3]), "+f"(d[0][5][0]), "+f"(d[0][5][1]), "+f"(d[0][5][2]), "+f"(d[0][5][3]), "+f"(d[0][6][0]), "+f"(d[0][6][1]), "+f"(d[0][6][2]), "+f"(d[0][6][3]), "+f"(d[0][7][0]), "+f"(d[0][7][1]), "+f"(d[0][7][2]), "+f"(d[0][7][3]), "+f"(d[0][8][0]), "+f"(d[0][8][1]), "+f"(d[0][8][2]), "+f"(d[0][8][3]), "+f"(d[0][9][0]), "+f"(d[0][9][1]), "+f"(d[0][9][2]), "+f"(d[0][9][3]), "+f"(d[0][10][0]), "+f"(d[0][10][1]), "+f"(d[0][10][2]), "+f"(d[0][10][3]), "+f"(d[0][11][0]), "+f"(d[0][11][1]), "+f"(d[0][11][2]), "+f"(d[0][11][3]), "+f"(d[0][12][0]), "+f"(d[0][12][1]), "+f"(d[0][12][2]), "+f"(d[0][12][3]), "+f"(d[0][13][0]), "+f"(d[0][13][1]), "+f"(d[0][13][2]), "+f"(d[0][13][3]), "+f"(d[0][14][0]), "+f"(d[0][14][1]), "+f"(d[0][14][2]), "+f"(d[0][14][3]), "+f"(d[0][15][0]), "+f"(d[0][15][1]), "+f"(d[0][15][2]), "+f"(d[0][15][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

template <int DT>
__device__ __forceinline__ void wgmma_rs(float (&d)[1][24][4], const u32 (&a)[4], u64 desc_b, int accumulate) {
  if (DT == FP16)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %101, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, {%96, %97, %98, %99}, %100, p, 1, 1, 1;\n}\n"
        : "+f"(d[0][0][0]), "+f"(d[0][0][1]), "+f"(d[0][0][2]), "+f"(d[0][0][3]), "+f"(d[0][1][0]), "+f"(d[0][1][1]), "+f"(d[0][1][2]), "+f"(d[0][1][3]), "+f"(d[0][2][0]), "+f"(d[0][2][1]), "+f"(d[0][2][2]), "+f"(d[0][2][3]), "+f"(d[0][3][0]), "+f"(d[0][3][1]), "+f"(d[0][3][2]), "+f"(d[0][3][3]), "+f"(d[0][4][0]), "+f"(d[0][4][1]), "+f"(d[0][4][2]), "+f"(d[0][4][3]), "+f"(d[0][5][0]), "+f"(d[0][5][1]), "+f"(d[0][5][2]), "+f"(d[0][5][3]), "+f"(d[0][6][0]), "+f"(d[0][6][1]), "+f"(d[0][6][2]), "+f"(d[0][6][3]), "+f"(d[0][7][0]), "+f"(d[0][7][1]), "+f"(d[0][7][2]), "+f"(d[0][7][3]), "+f"(d[0][8][0]), "+f"(d[0][8][1]), "+f"(d[0][8][2]), "+f"(d[0][8][3]), "+f"(d[0][9][0]), "+f"(d[0][9][1]), "+f"(d[0][9][2]), "+f"(d[0][9][3]), "+f"(d[0][10][0]), "+f"(d[0][10][1]), "+f"(d[0][10][2]), "+f"(d[0][10][3]), "+f"(d[0][11][0]), "+f"(d[0][11][1]), "+f"(d[0][11][2]), "+f"(d[0][11][3]), "+f"(d[0][12][0]), "+f"(d[0][12][1]), "+f"(d[0][12][2]), "+f"(d[0][12][3]), "+f"(d[0][13][0]), "+f"(d[0][13][1]), "+f"(d[0][13][2]), "+f"(d[0][13][3]), "+f"(d[0][14][0]), "+f"(d[0][14][1]), "+f"(d[0][14][2]), "+f"(d[0][14][3]), "+f"(d[0][15][0]), "+f"(d[0][15][1]), "+f"(d[0][15][2]), "+f"(d[0][15][3]), "+f"(d[0][16][0]), "+f"(d[0][16][1]), "+f"(d[0][16][2]), "+f"(d[0][16][3]), "+f"(d[0][17][0]), "+f"(d[0][17][1]), "+f"(d[0][17][2]), "+f"(d[0][17][3]), "+f"(d[0][18][0]), "+f"(d[0][18][1]), "+f"(d[0][18][2]), "+f"(d[0][18][3]), "+f"(d[0][19][0]), "+f"(d[0][19][1]), "+f"(d[0][19][2]), "+f"(d[0][19][3]), "+f"(d[0][20][0]), "+f"(d[0][20][1]), "+f"(d[0][20][2]), "+f"(d[0][20][3]), "+f"(d[0][21][0]), "+f"(d[0][21][1]), "+f"(d[0][21][2]), "+f"(d[0][21][3]), "+f"(d[0][22][0]), "+f"(d[0][22][1]), "+f"(d[0][22][2]), "+f"(d[0][22][3]), "+f"(d[0][23][0]), "+f"(d[0][23][1]), "+f"(d[0][23][2]), "+f"(d[0][23][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
  if (DT == BF16)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %101, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, {%96, %97, %98, %99}, %100, p, 1, 1, 1;\n}\n"
        : "+f"(d[0][0][0]), "+f"(d[0][0][1]), "+f"(d[0][0][2]), "+f"(d[0][0][3]), "+f"(d[0][1][0]), "+f"(d[0][1][1]), "+f"(d[0][1][2]), "+f"(d[0][1][3]), "+f"(d[0][2][0]), "+f"(d[0][2][1]), "+f"(d[0][2][2]), "+f"(d[0][2][3]), "+f"(d[0][3][0]), "+f"(d[0][3][1]), "+f"(d[0][3][2]), "+f"(d[0][3][3]), "+f"(d[0][4][0]), "+f"(d[0][4][1]), "+f"(d[0][4][2]), "+f"(d[0][4][3]), "+f"(d[0][5][0]), "+f"(d[0][5][1]), "+f"(d[0][5][2]), "+f"(d[0][5][3]), "+f"(d[0][6][0]), "+f"(d[0][6][1]), "+f"(d[0][6][2]), "+f"(d[0][6][3]), "+f"(d[0][7][0]), "+f"(d[0][7][1]), "+f"(d[0][7][2]), "+f"(d[0][7][3]), "+f"(d[0][8][0]), "+f"(d[0][8][1]), "+f"(d[0][8][2]), "+f"(d[0][8][3]), "+f"(d[0][9][0]), "+f"(d[0][9][1]), "+f"(d[0][9][2]), "+f"(d[0][9][3]), "+f"(d[0][10][0]), "+f"(d[0][10][1]), "+f"(d[0][10][2]), "+f"(d[0][10][3]), "+f"(d[0][11][0]), "+f"(d[0][11][1]), "+f"(d[0][11][2]), "+f"(d[0][11][3]), "+f"(d[0][12][0]), "+f"(d[0][12][1]), "+f"(d[0][12][2]), "+f"(d[0][12][3]), "+f"(d[0][13][0]), "+f"(d[0][13][1]), "+f"(d[0][13][2]), "+f"(d[0][13][3]), "+f"(d[0][14][0]), "+f"(d[0][14][1]), "+f"(d[0][14][2]), "+f"(d[0][14][3]), "+f"(d[0][15][0]), "+f"(d[0][15][1]), "+f"(d[0][15][2]), "+f"(d[0][15][3]), "+f"(d[0][16][0]), "+f"(d[0][16][1]), "+f"(d[0][16][2]), "+f"(d[0][16][3]), "+f"(d[0][17][0]), "+f"(d[0][17][1]), "+f"(d[0][17][2]), "+f"(d[0][17][3]), "+f"(d[0][18][0]), "+f"(d[0][18][1]), "+f"(d[0][18][2]), "+f"(d[0][18][3]), "+f"(d[0][19][0]), "+f"(d[0][19][1]), "+f"(d[0][19][2]), "+f"(d[0][19][3]), "+f"(d[0][20][0]), "+f"(d[0][20][1]), "+f"(d[0][20][2]), "+f"(d[0][20][3]), "+f"(d[0][21][0]), "+f"(d[0][21][1]), "+f"(d[0][21][2]), "+f"(d[0][21][3]), "+f"(d[0][22][0]), "+f"(d[0][22][1]), "+f"(d[0][22][2]), "+f"(d[0][22][3]), "+f"(d[0][23][0]), "+f"(d[0][23][1]), "+f"(d[0][23][2]), "+f"(d[0][23][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

template <int DT>
__device__ __forceinline__ void wgmma_rs(float (&d)[1][32][4], const u32 (&a)[4], u64 desc_b, int accumulate) {
  if (DT == FP16)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
        : "+f"(d[0][0][0]), "+f"(d[0][0][1]), "+f"(d[0][0][2]), "+f"(d[0][0][3]), "+f"(d[0][1][0]), "+f"(d[0][1][1]), "+f"(d[0][1][2]), "+f"(d[0][1][3]), "+f"(d[0][2][0]), "+f"(d[0][2][1]), "+f"(d[0][2][2]), "+f"(d[0][2][3]), "+f"(d[0][3][0]), "+f"(d[0][3][1]), "+f"(d[0][3][2]), "+f"(d[0][3][3]), "+f"(d[0][4][0]), "+f"(d[0][4][1]), "+f"(d[0][4][2]), "+f"(d[0][4][3]), "+f"(d[0][5][0]), "+f"(d[0][5][1]), "+f"(d[0][5][2]), "+f"(d[0][5][3]), "+f"(d[0][6][0]), "+f"(d[0][6][1]), "+f"(d[0][6][2]), "+f"(d[0][6][3]), "+f"(d[0][7][0]), "+f"(d[0][7][1]), "+f"(d[0][7][2]), "+f"(d[0][7][3]), "+f"(d[0][8][0]), "+f"(d[0][8][1]), "+f"(d[0][8][2]), "+f"(d[0][8][3]), "+f"(d[0][9][0]), "+f"(d[0][9][1]), "+f"(d[0][9][2]), "+f"(d[0][9][3]), "+f"(d[0][10][0]), "+f"(d[0][10][1]), "+f"(d[0][10][2]), "+f"(d[0][10][3]), "+f"(d[0][11][0]), "+f"(d[0][11][1]), "+f"(d[0][11][2]), "+f"(d[0][11][3]), "+f"(d[0][12][0]), "+f"(d[0][12][1]), "+f"(d[0][12][2]), "+f"(d[0][12][3]), "+f"(d[0][13][0]), "+f"(d[0][13][1]), "+f"(d[0][13][2]), "+f"(d[0][13][3]), "+f"(d[0][14][0]), "+f"(d[0][14][1]), "+f"(d[0][14][2]), "+f"(d[0][14][3]), "+f"(d[0][15][0]), "+f"(d[0][15][1]), "+f"(d[0][15][2]), "+f"(d[0][15][3]), "+f"(d[0][16][0]), "+f"(d[0][16][1]), "+f"(d[0][16][2]), "+f"(d[0][16][3]), "+f"(d[0][17][0]), "+f"(d[0][17][1]), "+f"(d[0][17][2]), "+f"(d[0][17][3]), "+f"(d[0][18][0]), "+f"(d[0][18][1]), "+f"(d[0][18][2]), "+f"(d[0][18][3]), "+f"(d[0][19][0]), "+f"(d[0][19][1]), "+f"(d[0][19][2]), "+f"(d[0][19][3]), "+f"(d[0][20][0]), "+f"(d[0][20][1]), "+f"(d[0][20][2]), "+f"(d[0][20][3]), "+f"(d[0][21][0]), "+f"(d[0][21][1]), "+f"(d[0][21][2]), "+f"(d[0][21][3]), "+f"(d[0][22][0]), "+f"(d[0][22][1]), "+f"(d[0][22][2]), "+f"(d[0][22][3]), "+f"(d[0][23][0]), "+f"(d[0][23][1]), "+f"(d[0][23][2]), "+f"(d[0][23][3]), "+f"(d[0][24][0]), "+f"(d[0][24][1]), "+f"(d[0][24][2]), "+f"(d[0][24][3]), "+f"(d[0][25][0]), "+f"(d[0][25][1]), "+f"(d[0][25][2]), "+f"(d[0][25][3]), "+f"(d[0][26][0]), "+f"(d[0][26][1]), "+f"(d[0][26][2]), "+f"(d[0][26][3]), "+f"(d[0][27][0]), "+f"(d[0][27][1]), "+f"(d[0][27][2]), "+f"(d[0][27][3]), "+f"(d[0][28][0]), "+f"(d[0][28][1]), "+f"(d[0][28][2]), "+f"(d[0][28][3]), "+f"(d[0][29][0]), "+f"(d[0][29][1]), "+f"(d[0][29][2]), "+f"(d[0][29][3]), "+f"(d[0][30][0]), "+f"(d[0][30][1]), "+f"(d[0][30][2]), "+f"(d[0][30][3]), "+f"(d[0][31][0]), "+f"(d[0][31][1]), "+f"(d[0][31][2]), "+f"(d[0][31][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
  if (DT == BF16)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
        : "+f"(d[0][0][0]), "+f"(d[0][0][1]), "+f"(d[0][0][2]), "+f"(d[0][0][3]), "+f"(d[0][1][0]), "+f"(d[0][1][1]), "+f"(d[0][1][2]), "+f"(d[0][1][3]), "+f"(d[0][2][0]), "+f"(d[0][2][1]), "+f"(d[0][2][2]), "+f"(d[0][2][3]), "+f"(d[0][3][0]), "+f"(d[0][3][1]), "+f"(d[0][3][2]), "+f"(d[0][3][3]), "+f"(d[0][4][0]), "+f"(d[0][4][1]), "+f"(d[0][4][2]), "+f"(d[0][4][3]), "+f"(d[0][5][0]), "+f"(d[0][5][1]), "+f"(d[0][5][2]), "+f"(d[0][5][3]), "+f"(d[0][6][0]), "+f"(d[0][6][1]), "+f"(d[0][6][2]), "+f"(d[0][6][3]), "+f"(d[0][7][0]), "+f"(d[0][7][1]), "+f"(d[0][7][2]), "+f"(d[0][7][3]), "+f"(d[0][8][0]), "+f"(d[0][8][1]), "+f"(d[0][8][2]), "+f"(d[0][8][3]), "+f"(d[0][9][0]), "+f"(d[0][9][1]), "+f"(d[0][9][2]), "+f"(d[0][9][3]), "+f"(d[0][10][0]), "+f"(d[0][10][1]), "+f"(d[0][10][2]), "+f"(d[0][10][3]), "+f"(d[0][11][0]), "+f"(d[0][11][1]), "+f"(d[0][11][2]), "+f"(d[0][11][3]), "+f"(d[0][12][0]), "+f"(d[0][12][1]), "+f"(d[0][12][2]), "+f"(d[0][12][3]), "+f"(d[0][13][0]), "+f"(d[0][13][1]), "+f"(d[0][13][2]), "+f"(d[0][13][3]), "+f"(d[0][14][0]), "+f"(d[0][14][1]), "+f"(d[0][14][2]), "+f"(d[0][14][3]), "+f"(d[0][15][0]), "+f"(d[0][15][1]), "+f"(d[0][15][2]), "+f"(d[0][15][3]), "+f"(d[0][16][0]), "+f"(d[0][16][1]), "+f"(d[0][16][2]), "+f"(d[0][16][3]), "+f"(d[0][17][0]), "+f"(d[0][17][1]), "+f"(d[0][17][2]), "+f"(d[0][17][3]), "+f"(d[0][18][0]), "+f"(d[0][18][1]), "+f"(d[0][18][2]), "+f"(d[0][18][3]), "+f"(d[0][19][0]), "+f"(d[0][19][1]), "+f"(d[0][19][2]), "+f"(d[0][19][3]), "+f"(d[0][20][0]), "+f"(d[0][20][1]), "+f"(d[0][20][2]), "+f"(d[0][20][3]), "+f"(d[0][21][0]), "+f"(d[0][21][1]), "+f"(d[0][21][2]), "+f"(d[0][21][3]), "+f"(d[0][22][0]), "+f"(d[0][22][1]), "+f"(d[0][22][2]), "+f"(d[0][22][3]), "+f"(d[0][23][0]), "+f"(d[0][23][1]), "+f"(d[0][23][2]), "+f"(d[0][23][3]), "+f"(d[0][24][0]), "+f"(d[0][24][1]), "+f"(d[0][24][2]), "+f"(d[0][24][3]), "+f"(d[0][25][0]), "+f"(d[0][25][1]), "+f"(d[0][25][2]), "+f"(d[0][25][3]), "+f"(d[0][26][0]), "+f"(d[0][26][1]), "+f"(d[0][26][2]), "+f"(d[0][26][3]), "+f"(d[0][27][0]), "+f"(d[0][27][1]), "+f"(d[0][27][2]), "+f"(d[0][27][3]), "+f"(d[0][28][0]), "+f"(d[0][28][1]), "+f"(d[0][28][2]), "+f"(d[0][28][3]), "+f"(d[0][29][0]), "+f"(d[0][29][1]), "+f"(d[0][29][2]), "+f"(d[0][29][3]), "+f"(d[0][30][0]), "+f"(d[0][30][1]), "+f"(d[0][30][2]), "+f"(d[0][30][3]), "+f"(d[0][31][0]), "+f"(d[0][31][1]), "+f"(d[0][31][2]), "+f"(d[0][31][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

}  // namespace cufa

namespace cufa {

constexpr int kSm90Threads = 256;
constexpr int kSm90BlockM = 128;

// -- load a tile into the panel layout: rows past `rows_valid`, columns past `head_dim` as zeros --
template <int kRows, int kHeadDim>
__device__ __forceinline__ void load_panels(u32 smem, const u16* gmem, i64 row_stride,
                                            int rows_valid, int head_dim) {
  constexpr int kChunks = kHeadDim / 8;
#pragma unroll 1
  for (int idx = threadIdx.x; idx < kRows * kChunks; idx += kSm90Threads) {
    const int r = idx / kChunks, c = idx % kChunks;
    const bool valid = r < rows_valid && c * 8 < head_dim;
    const u16* src = valid ? gmem + r * row_stride + c * 8 : gmem;
    cp_async_16(smem + panel_offset<kRows>(r, c), src, valid ? 16 : 0);
  }
}

// -- epilogue: straight from registers; each quad writes 16 contiguous bytes of a row --
template <int kDtype, int kDTiles>
__device__ __forceinline__ void write_output_direct(const float (&o)[1][kDTiles][4],
                                                    const float (&lse)[1][2], const FwdParams& p,
                                                    u16* o_ptr, float* lse_ptr, int row_base,
                                                    int lane) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = frag_row(row_base, 0, 2 * h, lane);
    if (row >= p.seqlen_q) continue;
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
      const int col = frag_col(0, dt, 0, lane);
      if (col < p.head_dim)
        *reinterpret_cast<u32*>(o_ptr + row * p.o_row_stride + col) =
            pack2<kDtype>(o[0][dt][2 * h], o[0][dt][2 * h + 1]);
    }
    if ((lane & 3) == 0) lse_ptr[row] = lse[0][h];
  }
}

template <int kDtype, int kHeadDim, int kMask, bool kScoreMods, int kBlockN>
__global__ void __launch_bounds__(kSm90Threads, 1) fwd_sm90_kernel(const FwdParams p) {
  constexpr int kBlockM = kSm90BlockM;
  constexpr int kNTiles = kBlockN / 8;
  constexpr int kDTiles = kHeadDim / 8;
  constexpr int kQBytes = kBlockM * kHeadDim * 2;
  constexpr int kKVBytes = kBlockN * kHeadDim * 2;
  static_assert(kHeadDim % 64 == 0 && kBlockN % 16 == 0, "whole 128-byte panels, 16-key steps");

  // Dynamic shared memory is only 16-byte aligned; the swizzle needs 1024.
  extern __shared__ unsigned char smem_raw[];
  const u32 smem = (smem_u32(smem_raw) + 1023) & ~1023u;
  // Q, then the two K/V stages: stage s of K at sk + s * kKVBytes, of V at sv + s * kKVBytes
  // (arithmetic, not arrays: a run-time index into an array would put it in local memory).
  const u32 sq = smem;
  const u32 sk = sq + kQBytes;
  const u32 sv = sk + 2 * kKVBytes;

  // -- which tile: query blocks of the last rows first (under causal masks they see the most keys) --
  const int bh_count = p.batch * p.nheads;
  const int m_block = p.num_m_blocks - 1 - static_cast<int>(blockIdx.x) / bh_count;
  const int bh = static_cast<int>(blockIdx.x) % bh_count;
  const int b = bh / p.nheads, h = bh % p.nheads;
  const int h_k = h / (p.nheads / p.nheads_k);
  const int row0 = m_block * kBlockM;
  const int row_end = min(row0 + kBlockM, p.seqlen_q);
  const int lane = threadIdx.x % 32;
  const int warpgroup = threadIdx.x / 128;
  const int row_base = row0 + warpgroup * 64 + ((threadIdx.x / 32) % 4) * 16;  // this warp's rows

  const u16* q_ptr = reinterpret_cast<const u16*>(p.q) + b * p.q_batch_stride +
                     h * p.q_head_stride + row0 * p.q_row_stride;
  const u16* k_ptr = reinterpret_cast<const u16*>(p.k) + b * p.k_batch_stride + h_k * p.k_head_stride;
  const u16* v_ptr = reinterpret_cast<const u16*>(p.v) + b * p.v_batch_stride + h_k * p.v_head_stride;
  u16* o_ptr = reinterpret_cast<u16*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride;
  float* lse_ptr = reinterpret_cast<float*>(p.lse) + b * p.lse_batch_stride + h * p.lse_head_stride;

  const float alibi_slope =
      (kScoreMods && p.alibi_slopes)
          ? reinterpret_cast<const float*>(p.alibi_slopes)[b * p.alibi_batch_stride + h]
          : 0.f;
  const i64 mask_offset = b * p.mask_batch_stride + h * p.mask_head_stride;
  const float scale_log2 = kScoreMods ? 1.f : p.scale_log2;  // score mods leave log2 units

  float acc_o[1][kDTiles][4];
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_o[0][dt][e] = 0.f;
  OnlineSoftmax<1> softmax;
  softmax.init();

  const KeyRange keys = key_range<kMask>(p, row0, row_end);
  const int n_block_min = keys.begin / kBlockN;
  const int n_block_max = (keys.end + kBlockN - 1) / kBlockN;  // rows with no key skip the loop

  if (n_block_min < n_block_max) {
    // K-major Q and K: 8-row groups 1024 bytes apart; 16 columns (32 bytes) per k-step
    // inside a panel. MN-major V: 64-column panels kBlockN * 128 bytes apart, 8-key
    // groups 1024 bytes apart; 16 keys (2048 bytes) per k-step.
    const u64 q_desc = smem_desc(sq + warpgroup * 64 * 128, 16, 1024);
    const u64 k_desc = smem_desc(sk, 16, 1024);
    const u64 v_desc = smem_desc(sv, kBlockN * 128, 1024);
    auto kstep = [](int ks, int rows) {  // descriptor offset (16-byte units) of k-step ks
      return static_cast<u64>(((ks / 4) * rows * 128 + (ks % 4) * 32) >> 4);
    };
    constexpr u64 kStageStep = kKVBytes >> 4;
    // Block `it` of the loop is key block n_block_max - 1 - it, in stage it % 2.
    const int n_blocks = n_block_max - n_block_min;
    auto load_k = [&](int it) {
      const int key0 = (n_block_max - 1 - it) * kBlockN;
      load_panels<kBlockN, kHeadDim>(sk + (it & 1) * kKVBytes, k_ptr + key0 * p.k_row_stride,
                                     p.k_row_stride, p.seqlen_k - key0, p.head_dim);
      cp_async_commit();
    };
    auto load_v = [&](int it) {
      const int key0 = (n_block_max - 1 - it) * kBlockN;
      load_panels<kBlockN, kHeadDim>(sv + (it & 1) * kKVBytes, v_ptr + key0 * p.v_row_stride,
                                     p.v_row_stride, p.seqlen_k - key0, p.head_dim);
      cp_async_commit();
    };
    auto issue_pv = [&](const u32 (&pa)[kNTiles / 2][4], int it) {
#pragma unroll
      for (int kk = 0; kk < kNTiles / 2; ++kk)
        wgmma_rs<kDtype>(acc_o, pa[kk], v_desc + (it & 1) * kStageStep + (kk * 16 * 128 >> 4), 1);
      wgmma_commit();
    };

    // Software pipeline: iteration `it` issues S_it = Q K_it^T and O += P_{it-1} V_{it-1}
    // together, and computes the exponentials of S_it while the P V product runs. Copies
    // run one iteration ahead: the top of iteration `it` fetches K_{it+1} and V_it, into
    // stages whose last readers (S_{it-1}, P_{it-2} V_{it-2}) finished before the barrier.
    load_panels<kBlockM, kHeadDim>(sq, q_ptr, p.q_row_stride, p.seqlen_q - row0, p.head_dim);
    load_k(0);
    u32 p_prev[kNTiles / 2][4];
    for (int it = 0; it < n_blocks; ++it) {
      const int key0 = (n_block_max - 1 - it) * kBlockN;
      cp_async_wait<0>();
      fence_proxy_async();
      __syncthreads();  // K_it and V_{it-1} visible to all; every warp is past S_{it-1}, P V_{it-2}
      if (it + 1 < n_blocks) load_k(it + 1);
      load_v(it);

      // -- issue qk, and the previous block's P V --
      float acc_s[1][kNTiles][4];
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks)
        wgmma_ss<kDtype>(acc_s, q_desc + kstep(ks, kBlockM),
                         k_desc + (it & 1) * kStageStep + kstep(ks, kBlockN), ks > 0);
      wgmma_commit();
      if (it > 0) issue_pv(p_prev, it - 1);
      if (it > 0) wgmma_wait<1>(); else wgmma_wait<0>();
      fence_registers(acc_s);

      // -- score mods and mask, then softmax while P V runs --
      if (kScoreMods) apply_score_mods(acc_s, p, alibi_slope, mask_offset, row_base, key0, lane);
      if (block_needs_mask<kMask>(p, row0, row_end, key0, key0 + kBlockN))
        apply_mask<kMask>(acc_s, p, row_base, key0, lane);
      // P goes straight to 16-bit wgmma A fragments in fresh registers: 16 keys per
      // fragment, tile nt's pair h at slot 2 * (nt % 2) + h. Writing the probabilities
      // over S instead lets ptxas hold them back until the P V product is done.
      float correction[1][2];
      u32 p_next[kNTiles / 2][4];
      softmax.update(acc_s, scale_log2, correction, [&](int, int nt, int h, float p0, float p1) {
        p_next[nt / 2][2 * (nt % 2) + h] = pack2<kDtype>(p0, p1);
      });
      fence_registers(p_next);

      // -- P V done: rescale O, keep P for the next iteration's product --
      wgmma_wait<0>();
      fence_registers(acc_o);
      fence_registers(p_prev);
      softmax.rescale_output(acc_o, correction);
#pragma unroll
      for (int kk = 0; kk < kNTiles / 2; ++kk)
#pragma unroll
        for (int j = 0; j < 4; ++j) p_prev[kk][j] = p_next[kk][j];
    }
    // -- the last block's P V --
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    wgmma_fence();
    issue_pv(p_prev, n_blocks - 1);
    wgmma_wait<0>();
    fence_registers(acc_o);
  }

  float lse[1][2];
  softmax.finalize(acc_o, lse, scale_log2);
  write_output_direct<kDtype>(acc_o, lse, p, o_ptr, lse_ptr, row_base, lane);
}

}  // namespace cufa

static_assert(sizeof(cufa::FwdParams) == 272, "cufa::FwdParams size differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::q, decltype(cufa::FwdParams::q)(1)) == 0, "cufa::FwdParams::q offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::k, decltype(cufa::FwdParams::k)(1)) == 8, "cufa::FwdParams::k offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::v, decltype(cufa::FwdParams::v)(1)) == 16, "cufa::FwdParams::v offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::o, decltype(cufa::FwdParams::o)(1)) == 24, "cufa::FwdParams::o offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::lse, decltype(cufa::FwdParams::lse)(1)) == 32, "cufa::FwdParams::lse offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::attn_mask, decltype(cufa::FwdParams::attn_mask)(1)) == 40, "cufa::FwdParams::attn_mask offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::alibi_slopes, decltype(cufa::FwdParams::alibi_slopes)(1)) == 48, "cufa::FwdParams::alibi_slopes offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::q_batch_stride, decltype(cufa::FwdParams::q_batch_stride)(1)) == 56, "cufa::FwdParams::q_batch_stride offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::q_row_stride, decltype(cufa::FwdParams::q_row_stride)(1)) == 64, "cufa::FwdParams::q_row_stride offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::q_head_stride, decltype(cufa::FwdParams::q_head_stride)(1)) == 72, "cufa::FwdParams::q_head_stride offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::k_batch_stride, decltype(cufa::FwdParams::k_batch_stride)(1)) == 80, "cufa::FwdParams::k_batch_stride offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::k_row_stride, decltype(cufa::FwdParams::k_row_stride)(1)) == 88, "cufa::FwdParams::k_row_stride offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::k_head_stride, decltype(cufa::FwdParams::k_head_stride)(1)) == 96, "cufa::FwdParams::k_head_stride offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::v_batch_stride, decltype(cufa::FwdParams::v_batch_stride)(1)) == 104, "cufa::FwdParams::v_batch_stride offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::v_row_stride, decltype(cufa::FwdParams::v_row_stride)(1)) == 112, "cufa::FwdParams::v_row_stride offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::v_head_stride, decltype(cufa::FwdParams::v_head_stride)(1)) == 120, "cufa::FwdParams::v_head_stride offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::o_batch_stride, decltype(cufa::FwdParams::o_batch_stride)(1)) == 128, "cufa::FwdParams::o_batch_stride offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::o_row_stride, decltype(cufa::FwdParams::o_row_stride)(1)) == 136, "cufa::FwdParams::o_row_stride offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::o_head_stride, decltype(cufa::FwdParams::o_head_stride)(1)) == 144, "cufa::FwdParams::o_head_stride offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::lse_batch_stride, decltype(cufa::FwdParams::lse_batch_stride)(1)) == 152, "cufa::FwdParams::lse_batch_stride offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::lse_head_stride, decltype(cufa::FwdParams::lse_head_stride)(1)) == 160, "cufa::FwdParams::lse_head_stride offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::mask_batch_stride, decltype(cufa::FwdParams::mask_batch_stride)(1)) == 168, "cufa::FwdParams::mask_batch_stride offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::mask_head_stride, decltype(cufa::FwdParams::mask_head_stride)(1)) == 176, "cufa::FwdParams::mask_head_stride offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::mask_row_stride, decltype(cufa::FwdParams::mask_row_stride)(1)) == 184, "cufa::FwdParams::mask_row_stride offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::mask_col_stride, decltype(cufa::FwdParams::mask_col_stride)(1)) == 192, "cufa::FwdParams::mask_col_stride offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::alibi_batch_stride, decltype(cufa::FwdParams::alibi_batch_stride)(1)) == 200, "cufa::FwdParams::alibi_batch_stride offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::batch, decltype(cufa::FwdParams::batch)(1)) == 208, "cufa::FwdParams::batch offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::nheads, decltype(cufa::FwdParams::nheads)(1)) == 212, "cufa::FwdParams::nheads offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::nheads_k, decltype(cufa::FwdParams::nheads_k)(1)) == 216, "cufa::FwdParams::nheads_k offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::seqlen_q, decltype(cufa::FwdParams::seqlen_q)(1)) == 220, "cufa::FwdParams::seqlen_q offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::seqlen_k, decltype(cufa::FwdParams::seqlen_k)(1)) == 224, "cufa::FwdParams::seqlen_k offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::head_dim, decltype(cufa::FwdParams::head_dim)(1)) == 228, "cufa::FwdParams::head_dim offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::num_m_blocks, decltype(cufa::FwdParams::num_m_blocks)(1)) == 232, "cufa::FwdParams::num_m_blocks offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::diag_offset, decltype(cufa::FwdParams::diag_offset)(1)) == 236, "cufa::FwdParams::diag_offset offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::window_left, decltype(cufa::FwdParams::window_left)(1)) == 240, "cufa::FwdParams::window_left offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::window_right, decltype(cufa::FwdParams::window_right)(1)) == 244, "cufa::FwdParams::window_right offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::attn_mask_type, decltype(cufa::FwdParams::attn_mask_type)(1)) == 248, "cufa::FwdParams::attn_mask_type offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::scale, decltype(cufa::FwdParams::scale)(1.0000001f)) == 252, "cufa::FwdParams::scale offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::scale_log2, decltype(cufa::FwdParams::scale_log2)(1.0000001f)) == 256, "cufa::FwdParams::scale_log2 offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::softcap, decltype(cufa::FwdParams::softcap)(1.0000001f)) == 260, "cufa::FwdParams::softcap offset differs from cufa/_params.py");
static_assert(cufa::field_offset(&cufa::FwdParams::softcap_inv, decltype(cufa::FwdParams::softcap_inv)(1.0000001f)) == 264, "cufa::FwdParams::softcap_inv offset differs from cufa/_params.py");

template __global__ void cufa::fwd_sm90_kernel<0, 128, 0, false, 128>(const cufa::FwdParams);
