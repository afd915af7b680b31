// The fp8 forward over a paged cache: the pages of K and V copied into rows as a packed
// batch's k and v lie (sequence b's keys from row clamp(cu_seqlens_k[b]) on), which V's
// transpose and the forward then read as a packed batch. The forward's K loads are TMA
// boxes of 128 rows and V's transpose wants 64-key tiles, neither of which a page of 1-64
// rows gives. seqused_out[b] is the keys the two take of sequence b: seqused_k's (or the
// sequence's length), and at most what its pages hold, so no key is read from the rows of
// the sequence after it.
#include "../common/types.cuh"

namespace cufa {

struct GatherPagesParams {
  u64 k_cache, v_cache, k_out, v_out;  // pages (num_pages, page_size, nheads_k, d); rows
                                       // (total_rows, nheads_k, d), contiguous
  u64 block_table, cu_seqlens_k, seqused_k, seqused_out;
  i64 k_page_stride, k_row_stride, k_head_stride;  // (elements: bytes)
  i64 v_page_stride, v_row_stride, v_head_stride;
  int batch, nheads_k, head_dim, page_shift, num_pages, max_pages, table_stride;
  int total_rows;  // k_out's and v_out's: batch * max_pages * page_size
};

constexpr int kGatherRows = 64;  // keys a CTA copies at a time

// -- sequence b's first row and the keys the forward takes of it: as the forward's get_tile
//    clamps a packed sequence to k's rows, then seqused_k, then the pages' capacity --
struct GatheredSequence {
  int start, used;
};
__device__ __forceinline__ GatheredSequence gathered_sequence(const GatherPagesParams& p, int b) {
  const int* cu = reinterpret_cast<const int*>(p.cu_seqlens_k);
  const int start = min(max(cu[b], 0), p.total_rows);
  const int length = min(max(cu[b + 1], start), p.total_rows) - start;
  const int used =
      p.seqused_k ? min(max(reinterpret_cast<const int*>(p.seqused_k)[b], 0), length) : length;
  return GatheredSequence{start, min(used, p.max_pages << p.page_shift)};
}

// grid: (key tiles, sequences), each looping with the grid's stride over both (y's limit is
// 65535); 256 threads, a 16-byte chunk of K and of V each a step
__global__ void __launch_bounds__(256) gather_pages_e4m3(const GatherPagesParams p) {
  if (blockIdx.x == 0 && blockIdx.y == 0)
    for (int b = threadIdx.x; b < p.batch; b += blockDim.x)
      reinterpret_cast<int*>(p.seqused_out)[b] = gathered_sequence(p, b).used;
  const int head_chunks = p.head_dim / 16, row_chunks = p.nheads_k * head_chunks;
  const int slot_mask = (1 << p.page_shift) - 1;
  for (int b = blockIdx.y; b < p.batch; b += gridDim.y) {
    const GatheredSequence s = gathered_sequence(p, b);
    const int* table = reinterpret_cast<const int*>(p.block_table) + static_cast<i64>(b) * p.table_stride;
    for (int key0 = blockIdx.x * kGatherRows; key0 < s.used; key0 += gridDim.x * kGatherRows) {
      const int keys = min(kGatherRows, s.used - key0);
      for (int i = threadIdx.x; i < keys * row_chunks; i += blockDim.x) {
        const int key = key0 + i / row_chunks, h = (i % row_chunks) / head_chunks;
        const int byte = 16 * (i % head_chunks);
        // (page ids outside the cache clamped, as the 16-bit paged kernels clamp them)
        const i64 page = min(max(table[key >> p.page_shift], 0), p.num_pages - 1);
        const int slot = key & slot_mask;
        const i64 row = static_cast<i64>(s.start + key) * (p.nheads_k * p.head_dim) + h * p.head_dim + byte;
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
