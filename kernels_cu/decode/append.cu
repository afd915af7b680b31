// decode_append: runs before the decode kernel when a call appends keys to the cache or
// applies rotary embedding.
#include "cache.cuh"
#include "rotary.cuh"

namespace cufa {

// -- an e4m3 cache's append: new key i (rotated) and value of sequence b, KV head hk, at
//    cache position pos, quantized by the sequence's descales (rotate_row_e4m3) --
template <int kDtype>
__device__ __forceinline__ void append_e4m3(const DecodeParams& p, const CacheSeq& s, int i,
                                            int hk, int pos, int lane) {
  const u16* k_src = reinterpret_cast<const u16*>(p.k_new) + s.b * p.k_new_batch_stride +
                     i * p.k_new_row_stride + hk * p.k_new_head_stride;
  const u16* v_src = reinterpret_cast<const u16*>(p.v_new) + s.b * p.v_new_batch_stride +
                     i * p.v_new_row_stride + hk * p.v_new_head_stride;
  u8* k_dst = const_cast<u8*>(cache_row(p, s, reinterpret_cast<const u8*>(p.k) + hk * p.k_head_stride,
                                        p.k_batch_stride, p.k_row_stride, pos));
  u8* v_dst = const_cast<u8*>(cache_row(p, s, reinterpret_cast<const u8*>(p.v) + hk * p.v_head_stride,
                                        p.v_batch_stride, p.v_row_stride, pos));
  const float k_descale = cache_descale(p.k_descale, p.k_descale_batch_stride,
                                        p.k_descale_head_stride, s.b, hk);
  const float v_descale = cache_descale(p.v_descale, p.v_descale_batch_stride,
                                        p.v_descale_head_stride, s.b, hk);
  for (int c = lane; c < p.head_dim_v; c += 32) v_dst[c] = to_e4m3<kDtype>(load_half<kDtype>(v_src, c), v_descale);
  rotate_row_e4m3<kDtype>(p, k_src, k_dst, pos, k_descale, lane);
}

// -- append: new keys (rotated) and values into the cache; q rotated into its buffer.
//    One warp per row: batch x seqlen_new x nheads_k cache rows, then batch x seqlen_q x
//    nheads query rows when rotary is on. kFp8: the cache holds e4m3 (append_e4m3) --
template <int kDtype, bool kFp8 = false>
__global__ void __launch_bounds__(128) decode_append(const DecodeParams p) {
  const int lane = threadIdx.x % 32;
  int row = blockIdx.x * 4 + threadIdx.x / 32;  // the host keeps the row counts below 2^31
  const int kv_rows = p.k_new ? p.batch * p.seqlen_new * p.nheads_k : 0;
  if constexpr (kFp8) {
    if (row < kv_rows) {
      const int hk = row % p.nheads_k, i = (row / p.nheads_k) % p.seqlen_new;
      const CacheSeq s = cache_seq(p, row / (p.nheads_k * p.seqlen_new));
      if (s.end + i < p.capacity) append_e4m3<kDtype>(p, s, i, hk, s.end + i, lane);
      return;
    }
  }
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
    for (int c = lane; c < p.head_dim_v; c += 32) v_dst[c] = v_src[c];
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
