// decode_append: runs before the decode kernel when a call appends keys to the cache or
// applies rotary embedding.
#include "cache.cuh"
#include "rotary.cuh"

namespace cufa {

// -- append: new keys (rotated) and values into the cache; q rotated into its buffer.
//    One warp per row: batch x seqlen_new x nheads_k cache rows, then batch x seqlen_q x
//    nheads query rows when rotary is on. --
template <int kDtype>
__global__ void __launch_bounds__(128) decode_append(const DecodeParams p) {
  const int lane = threadIdx.x % 32;
  int row = blockIdx.x * 4 + threadIdx.x / 32;  // the host keeps the row counts below 2^31
  const int kv_rows = p.k_new ? p.batch * p.seqlen_new * p.nheads_k : 0;
  const u16* src;
  u16* dst;
  int pos;
  if (row < kv_rows) {  // -- a new key and value --
    const int hk = row % p.nheads_k, i = (row / p.nheads_k) % p.seqlen_new;
    const CacheSeq s = cache_seq(p, row / (p.nheads_k * p.seqlen_new));
    pos = s.end + i;
    if (pos >= p.capacity) return;  // past the cache: dropped (check_inputs reports it)
    const u16* v_src = reinterpret_cast<const u16*>(p.v_new) + s.b * p.v_new_batch_stride +
                       i * p.v_new_row_stride + hk * p.v_new_head_stride;
    u16* v_dst = const_cast<u16*>(cache_row(p, s, reinterpret_cast<const u16*>(p.v) + hk * p.v_head_stride,
                                            p.v_batch_stride, p.v_row_stride, pos));
    for (int c = lane; c < p.head_dim; c += 32) v_dst[c] = v_src[c];
    src = reinterpret_cast<const u16*>(p.k_new) + s.b * p.k_new_batch_stride + i * p.k_new_row_stride +
          hk * p.k_new_head_stride;
    dst = const_cast<u16*>(cache_row(p, s, reinterpret_cast<const u16*>(p.k) + hk * p.k_head_stride,
                                     p.k_batch_stride, p.k_row_stride, pos));
  } else {  // -- a query row, when rotary is on --
    row -= kv_rows;
    if (!p.q_source || row >= p.batch * p.seqlen_q * p.nheads) return;
    const int h = row % p.nheads, t = (row / p.nheads) % p.seqlen_q;
    const CacheSeq s = cache_seq(p, row / (p.nheads * p.seqlen_q));
    src = reinterpret_cast<const u16*>(p.q_source) + s.b * p.q_source_batch_stride +
          t * p.q_source_row_stride + h * p.q_source_head_stride;
    dst = reinterpret_cast<u16*>(p.q) + s.b * p.q_batch_stride + t * p.q_row_stride + h * p.q_head_stride;
    pos = s.end + (p.rotary_q_per_token ? t : 0);
  }
  rotate_row<kDtype>(p, src, dst, pos, lane);
}

}  // namespace cufa
