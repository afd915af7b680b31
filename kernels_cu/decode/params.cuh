#pragma once
// Parameters of the KV-cache kernels (DecodeParams) and of merge_states (MergeParams),
// passed by value. The Python mirror is cufa/_params.py (DECODE_FIELDS, MERGE_FIELDS);
// every compile appends static_asserts generated from it.
#include "../common/types.cuh"

namespace cufa {

struct DecodeParams {
  u64 q;              // (batch, seqlen_q, nheads, d), rotated already when rotary is on
  u64 k, v;           // the cache: (batch_cache, seqlen_cache, nheads_k, d) or pages
  u64 o;              // (batch, seqlen_q, nheads, d)
  u64 lse;            // float32 (batch, nheads, seqlen_q); 0 = not wanted
  // Split-KV: each split's normalized output and lse, float32 (num_splits, batch,
  // seqlen_q, nheads, d) and (num_splits, batch, nheads, seqlen_q); 0 when not split.
  u64 o_partial, lse_partial;
  u64 cache_seqlens;  // int32 (batch,): cache end before the append; 0 = cache_seqlen_fixed
  u64 cache_batch_idx, cache_leftpad;  // int32 (batch,) or 0
  u64 block_table;    // int32 (batch, max_pages) or 0 (contiguous cache)
  u64 alibi_slopes;   // float32 (batch or 1, nheads) or 0
  // decode_append: new keys and values (batch, seqlen_new, nheads_k, d) written into the
  // cache, rotated by rotary_cos/sin (seqlen_ro, rotary_dim / 2); q_source is the caller's
  // q, which decode_append rotates into q (a buffer) when rotary is on, else 0.
  u64 k_new, v_new, q_source, rotary_cos, rotary_sin;
  // A packed batch (flash_attn_varlen_func): int32 (batch + 1,) row offsets of q/o and of
  // the keys, and (batch,) keys in use (or 0). Set, q and o are (total_q, nheads, d) with
  // batch strides 0, seqlen_q is the most query rows a sequence may have to be taken
  // here (longer ones are the forward kernel's), and there is no append.
  u64 cu_seqlens_q, cu_seqlens_k, seqused_k;
  // int32 (batch, nheads_k, num_m_blocks) zeroed counters: the last split of each merges
  // the partials in the decode launch (and zeroes its counter again); 0: decode_combine
  // merges them
  u64 split_counters;
  // A packed batch: int32 (batch,), the sequence of each grid z (-1: none), most keys first
  // (varlen_schedule's decode_order); 0: z is the sequence
  u64 decode_order;
  // float32, fp16 or bf16 (nheads,) or 0: query head h's learnable sink (FwdParams'), added
  // once a row: by the epilogue unsplit, else by the merge of the splits
  u64 learnable_sink;
  // An e4m3 cache (the fp8 variants): float32 scales, a key of the cache is its e4m3 value
  // times k_descale[b][h_k] (v's alike; strides 0 for one scale a tensor); 0: 1
  u64 k_descale, v_descale;
  // MLA (decode_mla_kernel): qv (batch, seqlen_q, nheads, 512), the queries' absorbed
  // part against v's latent rows (q: the 64 rotary columns against k's); 0 otherwise
  u64 qv;

  i64 q_batch_stride, q_row_stride, q_head_stride;
  i64 k_batch_stride, k_row_stride, k_head_stride;  // batch stride: a cache row, or a page
  i64 v_batch_stride, v_row_stride, v_head_stride;
  i64 o_batch_stride, o_row_stride, o_head_stride;
  i64 block_table_batch_stride, alibi_batch_stride;
  i64 k_new_batch_stride, k_new_row_stride, k_new_head_stride;
  i64 v_new_batch_stride, v_new_row_stride, v_new_head_stride;
  i64 q_source_batch_stride, q_source_row_stride, q_source_head_stride;
  i64 lse_batch_stride, lse_head_stride;  // lse's row stride is 1
  i64 k_descale_batch_stride, k_descale_head_stride, v_descale_batch_stride, v_descale_head_stride;
  i64 qv_batch_stride, qv_row_stride, qv_head_stride;

  int batch, seqlen_q, nheads, nheads_k, group, head_dim;  // group = nheads / nheads_k
  int head_dim_v;          // v's and out's (and the splits' partial rows'): MLA's 512
  int total_q;             // a packed batch's q rows (cu_seqlens_q values are clamped to it)
  int cache_seqlen_fixed;  // cache_seqlens given as a Python int
  int seqlen_new;          // keys appended by this call (already in the cache)
  int capacity;            // key positions a sequence can hold
  int cache_rows;          // cache rows (contiguous) or pages (paged): ids are clamped to it
  int page_shift, max_pages;
  int num_splits, num_m_blocks;
  int combine_row_threads;  // decode_combine's threads a row (32 or 128), split or not
  int window_left, window_right;  // unbounded sides hold a value above any length
  int rotary_dim, seqlen_ro;
  int rotary_dtype;        // of cos/sin: 0 fp16, 1 bf16, 2 fp32
  int rotary_interleaved;  // pairs (2i, 2i+1); else (i, i + rotary_dim / 2)
  int rotary_q_per_token;  // q token t at position cache_seqlens + t (causal / window), else + 0
  int sink_dtype;          // of learnable_sink: SinkDtype (common/softmax.cuh)

  float scale, scale_log2, softcap, softcap_inv;
};

// merge_states (merge.cu). Strides in elements; outputs (batch, seqlen, nheads,
// head_dim), lse (batch, nheads, seqlen) (a packed batch is batch 1).
struct MergeParams {
  u64 out_a, lse_a, out_b, lse_b, out, lse;
  i64 out_a_batch_stride, out_a_row_stride, out_a_head_stride, out_a_col_stride;
  i64 out_b_batch_stride, out_b_row_stride, out_b_head_stride, out_b_col_stride;
  i64 out_batch_stride, out_row_stride, out_head_stride, out_col_stride;
  i64 lse_a_batch_stride, lse_a_head_stride, lse_a_row_stride;
  i64 lse_b_batch_stride, lse_b_head_stride, lse_b_row_stride;
  i64 lse_batch_stride, lse_head_stride, lse_row_stride;
  int batch, seqlen, nheads, head_dim;
};

}  // namespace cufa
