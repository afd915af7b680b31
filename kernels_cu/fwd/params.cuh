#pragma once
// Parameters of the forward kernel family (FwdParams) and of the packed batch's work list
// (ScheduleParams), passed by value. The Python mirror is cufa/_params.py; every compile
// appends static_asserts generated from it, so a layout mismatch is a compile error,
// never a silent misread.
#include "../common/types.cuh"

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
  // Packed (varlen) batches; all 0 for padded ones. int32 cu_seqlens (batch + 1,),
  // seqused_k (batch,), and the work list built by varlen_schedule: int2 entries
  // (sequence, query block) and their count.
  u64 cu_seqlens_q, cu_seqlens_k, seqused_k, tile_list, tile_count;
  // sm90 (persistent): uint32 count of the tiles taken past the first gridDim.x, then the
  // count of CTAs done; zero at the start of a launch, and left zero at its end.
  u64 tile_counter;
  // Packed batches reading K/V from a paged cache: int32 (batch, max pages) page ids;
  // 0 when K/V are plain rows. Key j of sequence b is row j % page_size of page
  // block_table[b][j / page_size]; k/v_batch_stride is then the page stride.
  u64 block_table;
  // float32, fp16 or bf16 (nheads,) (sink_dtype: common/softmax.cuh's SinkDtype): query
  // head h's learnable sink, a logit in every row's softmax denominator; 0 if none
  u64 learnable_sink;

  // Strides in elements; 64-bit because a tensor may exceed 2^31 elements.
  i64 q_row_stride, q_head_stride;
  i64 k_row_stride, k_head_stride;
  i64 v_row_stride, v_head_stride;
  i64 o_row_stride, o_head_stride;
  i64 mask_batch_stride, mask_head_stride, mask_row_stride, mask_col_stride;
  i64 alibi_batch_stride;
  i64 block_table_batch_stride;

  // What a call's sizes set, in one run of fields from the batch strides to
  // tail_group_head: a plan moved to new sizes writes them with one pack (api._Mover).
  i64 q_batch_stride, k_batch_stride, v_batch_stride, o_batch_stride;
  i64 lse_batch_stride, lse_head_stride;
  int batch;
  int seqlen_q, seqlen_k;  // packed batches: total rows of q and of k
  int num_m_blocks;        // padded batches
  int heads_per_group;     // padded batches: (batch, head) pairs scheduled together,
  int tail_group_head;     // but the last group's, from this pair on (block_info.cuh)

  int nheads, nheads_k, head_dim;
  int kv_tail_maps;                  // sm90, packed: TensorMaps::k_tail/v_tail are valid
  // Query i sees key j iff i + d - window_left <= j <= i + d + window_right, where the
  // diagonal offset d is seqlen_k - seqlen_q of the sequence when bottom_right
  // (flash-attn), else 0 (SDPA, top-left); an unbounded side holds a value larger than
  // any sequence.
  int bottom_right, window_left, window_right;
  int attn_mask_type;
  int page_shift;  // log2(page_size), paged K/V only
  int num_pages;   // pages in the cache: page ids are clamped to it
  int sink_dtype;

  float scale;       // softmax scale
  float scale_log2;  // scale * log2(e): one FFMA per score before exp2
  float softcap;     // 0 = off
  float softcap_inv;

  // An e4m3 K/V cache (the kE4m3 variants): float32 scales of (sequence, KV head), 0 for
  // none; key j of KV head h_k is its e4m3 value times k_descale[b, h_k] (strides 0: one
  // scale). Last, so that the other fields keep their offsets (the sm90 kernels' TMA
  // descriptors, passed after the struct, move by 64 bytes).
  u64 k_descale, v_descale;
  i64 k_descale_batch_stride, k_descale_head_stride;
  i64 v_descale_batch_stride, v_descale_head_stride;
  // V's and O's head dim, where it is not head_dim's (the kHeadDimVWanted variants)
  int head_dim_v;
  // The fp8 forward's (e4m3 q, k, v) q scale, as k_descale's: the scores are q_descale *
  // k_descale times the e4m3 product, O v_descale times P V (0: 1)
  u64 q_descale;
  i64 q_descale_batch_stride, q_descale_head_stride;
};

// varlen_schedule's, passed by value as one record (the host packs it once per plan and writes only the
// pointers a call): ten separate kernel arguments cost the launch ten ctypes objects.
// scratch: 3 * num_buckets ints; num_buckets > the largest possible block count.
// tile_counter (or null): the persistent forward's tile counter (2 uint32), zeroed here
// so the launch needs no memset of its own. decode_rows: sequences with at most this many
// query rows get no tiles (the decode kernel takes them; 0 when it is not launched).
// decode_order (or null): int (batch,), the decode kernel's sequences, most keys first
// (key counts from cu_seqlens_k / seqused_k as the decode kernel reads them, capped at
// capacity, in buckets of 2^key_shift keys), then -1 for the rest.
struct ScheduleParams {
  u64 cu_seqlens_q, scratch, tile_list, tile_count, tile_counter;  // int*, int2* for the list
  u64 cu_seqlens_k, seqused_k, decode_order;
  int batch, total_q, block_m, num_buckets, decode_rows;
  int capacity, key_shift;
};

}  // namespace cufa
