// The fp8 forward over a paged cache: the pages of K and V copied into rows as a packed
// batch's k and v lie, sequence b's keys from row b * capacity on (capacity: the keys its
// pages hold), which V's transpose and the forward then read as a packed batch, with
// cu_seqlens_out (b * capacity) and seqused_out in place of the caller's cu_seqlens_k and
// seqused_k. The forward's K loads are TMA boxes of 128 rows and V's transpose wants 64-key
// tiles, neither of which a page of 1-64 rows gives. seqused_out[b] is the keys the two
// take of sequence b: seqused_k's (or its cu_seqlens_k length), at most its capacity, as
// the 16-bit paged kernels take them; the layout does not depend on cu_seqlens_k's values.
#include "../common/types.cuh"

namespace cufa {

struct GatherPagesParams {
  u64 k_cache, v_cache, k_out, v_out;  // pages (num_pages, page_size, nheads_k, d); rows
                                       // (total_rows, nheads_k, d), contiguous
  u64 block_table, cu_seqlens_k, seqused_k, cu_seqlens_out, seqused_out;
  i64 k_page_stride, k_row_stride, k_head_stride;  // (elements: bytes)
  i64 v_page_stride, v_row_stride, v_head_stride;
  int batch, nheads_k, head_dim, page_shift, num_pages, max_pages, table_stride;
};

constexpr int kGatherRows = 64;  // keys a CTA copies at a time

// -- the keys used of sequence b: seqused_k's, else its cu_seqlens_k length (64-bit: the
//    values are not checked unless the caller asks), at most what its pages hold --
__device__ __forceinline__ int used_keys(const GatherPagesParams& p, int b) {
  const int* cu = reinterpret_cast<const int*>(p.cu_seqlens_k);
  const i64 length = p.seqused_k ? reinterpret_cast<const int*>(p.seqused_k)[b]
                                 : static_cast<i64>(cu[b + 1]) - cu[b];
  return static_cast<int>(min(max(length, i64{0}), static_cast<i64>(p.max_pages) << p.page_shift));
}

// grid: (key tiles, sequences), each looping with the grid's stride over both (y's limit is
// 65535); 256 threads, a 16-byte chunk of K and of V each a step
__global__ void __launch_bounds__(256) gather_pages_e4m3(const GatherPagesParams p) {
  const int capacity = p.max_pages << p.page_shift;
  if (blockIdx.x == 0 && blockIdx.y == 0)
    for (int b = threadIdx.x; b <= p.batch; b += blockDim.x) {
      reinterpret_cast<int*>(p.cu_seqlens_out)[b] = b * capacity;
      if (b < p.batch) reinterpret_cast<int*>(p.seqused_out)[b] = used_keys(p, b);
    }
  const int head_chunks = p.head_dim / 16, row_chunks = p.nheads_k * head_chunks;
  const int slot_mask = (1 << p.page_shift) - 1;
  for (int b = blockIdx.y; b < p.batch; b += gridDim.y) {
    const int used = used_keys(p, b);
    const i64 start = static_cast<i64>(b) * capacity;
    const int* table = reinterpret_cast<const int*>(p.block_table) + static_cast<i64>(b) * p.table_stride;
    for (int key0 = blockIdx.x * kGatherRows; key0 < used; key0 += gridDim.x * kGatherRows) {
      const int keys = min(kGatherRows, used - key0);
      for (int i = threadIdx.x; i < keys * row_chunks; i += blockDim.x) {
        const int key = key0 + i / row_chunks, h = (i % row_chunks) / head_chunks;
        const int byte = 16 * (i % head_chunks);
        // (page ids outside the cache clamped, as the 16-bit paged kernels clamp them)
        const i64 page = min(max(table[key >> p.page_shift], 0), p.num_pages - 1);
        const int slot = key & slot_mask;
        const i64 row = (start + key) * (p.nheads_k * p.head_dim) + h * p.head_dim + byte;
        const u8* k = reinterpret_cast<const u8*>(p.k_cache) + page * p.k_page_stride +
                      slot * p.k_row_stride + h * p.k_head_stride + byte;
        const u8* v = reinterpret_cast<const u8*>(p.v_cache) + page * p.v_page_stride +
                      slot * p.v_row_stride + h * p.v_head_stride + byte;
        *reinterpret_cast<uint4*>(reinterpret_cast<u8*>(p.k_out) + row) = *reinterpret_cast<const uint4*>(k);
        *reinterpret_cast<uint4*>(reinterpret_cast<u8*>(p.v_out) + row) = *reinterpret_cast<const uint4*>(v);
      }
    }
  }
}

}  // namespace cufa
