#pragma once
// Hopper building blocks (sm_90a): shared-memory matrix descriptors, wgmma ordering,
// the 128-byte-swizzled tile layout the descriptors describe, mbarriers, named barriers
// and per-warpgroup register budgets.
#include "sm80.cuh"

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

// A descriptor moved by `offset` 16-byte units within shared memory. The start address
// is the low 14 bits and never carries into the fields above (shared memory is under
// 256 KB), so a 32-bit add on the low word does it: a 64-bit add costs two more
// instructions before every wgmma, which at 64-key blocks delays their issue.
__device__ __forceinline__ u64 desc_add(u64 desc, u32 offset) {
  u32 lo, hi;
  asm("mov.b64 {%0, %1}, %2;\n" : "=r"(lo), "=r"(hi) : "l"(desc));
  u64 moved;
  asm("mov.b64 %0, {%1, %2};\n" : "=l"(moved) : "r"(lo + offset), "r"(hi));
  return moved;
}

// Descriptor offsets (16-byte units): of k-step ks (16 columns) in a K-major tile of
// `rows` rows (4 k-steps a panel), and of k-step kk (16 rows) in an MN-major one.
__device__ __forceinline__ u32 kstep_offset(int ks, int rows) {
  return static_cast<u32>(((ks / 4) * rows * 128 + (ks % 4) * 32) >> 4);
}
__device__ __forceinline__ u32 mn_kstep_offset(int kk) {
  return static_cast<u32>(kk * 16 * 128 >> 4);
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

// -- mbarriers: 64-bit shared-memory barriers whose phase flips when `count` arrivals land --
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes barriers just initialized visible to the copy engine, whose bytes complete them.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the phase with this parity has completed. Built with CUFA_SPIN_LIMIT (the
// environment variable of that name, for a new kernel's first runs), a wait that has not
// seen its phase after that many tries traps: a deadlock becomes a launch error instead of
// a process that never returns.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  u32 done;
#ifdef CUFA_SPIN_LIMIT
  unsigned tries = 0;
#endif
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done) : "r"(bar), "r"(parity) : "memory");
#ifdef CUFA_SPIN_LIMIT
    if (!done && ++tries > CUFA_SPIN_LIMIT) __trap();
#endif
  } while (!done);
}
// An arrival on `bar` once every cp.async this thread has issued so far has landed, so a
// producer announces a copy without waiting for it (noinc: the barrier's count includes
// these arrivals).
__device__ __forceinline__ void cp_async_mbar_arrive(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// -- TMA: bulk tensor copies described by maps the host builds (cuTensorMapEncodeTiled);
//    kernels take them as a __grid_constant__ parameter, so their address is usable --
struct alignas(64) TensorMap {
  u64 opaque[16];
};
struct TensorMaps {
  TensorMap q, k, v;  // (columns, rows, heads, batch) views, 128-byte swizzle
  // Packed batches: k and v again as (columns, window, heads, start row) views, whose
  // window and start-row dimensions both step one row. A box at (.., kBlockN - r, h, s)
  // reads rows s + kBlockN - r .. and zero-fills from its (r+1)-th row on (the window
  // ends): the last r keys of a sequence without the next sequence's rows.
  TensorMap k_tail, v_tail;
};

// Arrives and adds `bytes` to the transactions the current phase waits for.
__device__ __forceinline__ void mbar_arrive_expect_bytes(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
// The same bytes expected without an arrival: where the barrier's count is met by other
// arrivals (the issuing thread's among them, after this).
__device__ __forceinline__ void mbar_expect_bytes(u32 bar, u32 bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
// Fetches a map's descriptor ahead of the first copy through it, which would wait for it.
__device__ __forceinline__ void prefetch_tensor_map(const TensorMap& map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(&map)) : "memory");
}

// One box at (c0, c1, c2, c3) into shared memory; its bytes count on `bar` when they land.
__device__ __forceinline__ void tma_load_4d(u32 dst, const TensorMap& map, u32 bar, int c0, int c1,
                                            int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
      ::"r"(dst), "l"(reinterpret_cast<u64>(&map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// -- one thread loads a tile with TMA, one 64-column panel per copy: rows `row`.. of
//    head `head` (columns, rows, heads, batch map), kHeadDim columns from col0; past the
//    tensor's ends come zeros --
template <int kRows, int kHeadDim>
__device__ __forceinline__ void tma_load_panels(u32 smem, const TensorMap& map, u32 bar, int row,
                                                int head, int batch, int col0 = 0) {
#pragma unroll
  for (int panel = 0; panel < kHeadDim / 64; ++panel)
    tma_load_4d(smem + panel * kRows * 128, map, bar, panel * 64 + col0, row, head, batch);
}

// -- shared memory by address (ordered with the barrier asm around it) --
__device__ __forceinline__ uint4 ld_shared_v4(u32 addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
  return v;
}

// One 16-byte global store. Assigned through a uint4 pointer, ld_shared_v4's four
// registers went out as four 4-byte stores (NVVM splits the vector it cannot see whole),
// four instructions each writing a quarter of the bytes.
__device__ __forceinline__ void st_global_v4(void* ptr, uint4 v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(ptr), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w) : "memory");
}

// -- named barriers (0 is __syncthreads'): `threads` arrivals complete one --
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// -- register budget per warpgroup (all four warps must execute it) --
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
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

// Four 8x8 b16 matrices into shared memory: lanes 8i..8i+7 give the row addresses of
// matrix i, and register i holds a lane's pair of it in the mma fragment layout (row
// lane / 4, columns 2 * (lane % 4) + {0, 1}): a warp's 16 x 16 block of O in one store.
__device__ __forceinline__ void stmatrix_x4(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(addr),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// The same, each matrix stored transposed: lane's address i's row j receives column j of
// matrix i (8 elements that were 8 lanes' rows), so a fragment of dS^T lands as dS.
__device__ __forceinline__ void stmatrix_x4_trans(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(addr),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// -- a warp's 16 rows of an accumulator (the mma fragment layout, kDTiles 8-column tiles)
//    out through its own rows of a staging area (read for the last time by now): a 16 x 16
//    block a stmatrix into panels of kPanelRows rows, then 16-byte chunks, whole rows per
//    store. Straight from registers each quad stores 4 bytes of 8 rows at a time, half a
//    32-byte sector, with four times the store instructions. In passes of kPassColumns
//    (the whole head dim where the area holds it), each read back before the next is
//    staged. dst: row 0, of `rows` rows (those from there, and chunks from head_dim, are
//    left alone); row_base: the warp's first row there, stage_row0 its first row in the
//    area (multiples of 16, so the swizzle sees only the row within the warp's).
//    row_stride and head_dim by reference: the forward passes its parameters' fields,
//    read where the stores use them, as its epilogue read them before it called this --
template <int kDtype, int kPanelRows, int kPassColumns, int kHeadDim, int kDTiles>
__device__ __forceinline__ void store_rows_staged(const float (&acc)[1][kDTiles][4], u16* dst,
                                                  const i64& row_stride, int rows,
                                                  const int& head_dim,
                                                  u32 stage, int stage_row0, int row_base,
                                                  int lane) {
  // matrices 0 and 1 of a stmatrix are the warp's rows 0-7 and 8-15 of chunk 2j, 2 and 3
  // those of chunk 2j + 1
  static_assert(kDTiles % 2 == 0 && kHeadDim % kPassColumns == 0 && kPassColumns % 16 == 0,
                "stmatrix stores 16-column pairs of chunks");
  constexpr int kPasses = kHeadDim / kPassColumns, kPassChunks = kPassColumns / 8;
  const int lane_row = stage_row0 + (lane & 15), lane_chunk = lane >> 4;
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    if (pass > 0) __syncwarp();  // the warp has read the previous pass back
#pragma unroll
    for (int j = 0; j < kPassChunks / 2; ++j) {
      const int dt = pass * kPassChunks + 2 * j;
      stmatrix_x4(stage + panel_offset<kPanelRows>(lane_row, 2 * j + lane_chunk),
                  pack2<kDtype>(acc[0][dt][0], acc[0][dt][1]),
                  pack2<kDtype>(acc[0][dt][2], acc[0][dt][3]),
                  pack2<kDtype>(acc[0][dt + 1][0], acc[0][dt + 1][1]),
                  pack2<kDtype>(acc[0][dt + 1][2], acc[0][dt + 1][3]));
    }
    __syncwarp();
    // (what a store does not change is worked out once)
    u16* const warp_rows = dst + row_base * row_stride;
    const u32 stage_rows = stage + stage_row0 * 128;
    const int rows_left = rows - row_base;
#pragma unroll 4
    for (int i = 0; i < 16 * kPassChunks / 32; ++i) {
      const int idx = i * 32 + lane;
      const int r = idx / kPassChunks, c = pass * kPassChunks + idx % kPassChunks;
      if (r < rows_left && c * 8 < head_dim)
        st_global_v4(warp_rows + r * row_stride + c * 8,
                     ld_shared_v4(stage_rows + panel_offset<kPanelRows>(r, c - pass * kPassChunks)));
    }
  }
}

// -- bulk float additions from shared to global memory (the async proxy; `bytes` a
//    multiple of 16, both addresses 16-byte aligned): issue, commit, and wait until at
//    most kPending of this thread's groups still read their shared memory --
__device__ __forceinline__ void bulk_add_f32(float* gmem, u32 smem, u32 bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               ::"l"(gmem), "r"(smem), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}
// ... and until they are complete (before the CTA's shared memory goes away)
template <int kPending>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// -- a product's float accumulators, rounded to kDtype, as the A fragments of the next
//    wgmma (P for P V): 16 of the accumulators' columns a fragment --
template <int kDtype, int kNTiles>
__device__ __forceinline__ void pack_p(u32 (&a)[kNTiles / 2][4], const float (&s)[1][kNTiles][4]) {
#pragma unroll
  for (int kk = 0; kk < kNTiles / 2; ++kk) {
    a[kk][0] = pack2<kDtype>(s[0][2 * kk][0], s[0][2 * kk][1]);
    a[kk][1] = pack2<kDtype>(s[0][2 * kk][2], s[0][2 * kk][3]);
    a[kk][2] = pack2<kDtype>(s[0][2 * kk + 1][0], s[0][2 * kk + 1][1]);
    a[kk][3] = pack2<kDtype>(s[0][2 * kk + 1][2], s[0][2 * kk + 1][3]);
  }
}

// ptxas places the wait for an in-flight wgmma as early as it may, above independent
// work: the P V wait went above the whole softmax, so a warpgroup's exponentials never ran
// under its own product. A shared-memory store that depends on the row sums and never
// runs (sums are >= 0) holds the wait below them (docs/decisions.md steps 27 and 44).
__device__ __forceinline__ void hold_wait_below(float a, float b, u32 smem) {
  asm volatile(
      "{\n.reg .pred p, q;\n"
      "setp.lt.f32 p, %0, 0f00000000;\n"
      "setp.lt.or.f32 q, %1, 0f00000000, p;\n"
      "@q st.shared.b32 [%2], 0;\n}\n" ::"f"(a), "f"(b), "r"(smem) : "memory");
}

}  // namespace cufa
