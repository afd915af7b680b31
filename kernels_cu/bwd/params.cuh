#pragma once
// Parameters of the backward kernels beyond the forward's. The backward launches read the
// forward's FwdParams (q, k, v, out, lse, masks, score mods, sequences) and this record
// beside it; the Python mirror is cufa/_params.py (BWD_FIELDS), checked at compile time.
#include "../fwd/params.cuh"

namespace cufa {

struct BwdParams {
  u64 dout;             // the output's gradient, out's shape
  u64 dq, dk, dv;       // the gradients, q's, k's and v's shapes
  u64 softmax_d;        // float32 in lse's layout: rowsum(dout * out), the preprocess's
  u64 dsink;            // float32 (nheads,), summed into (zeroed by the host); 0: no sink
  u64 dlse;             // float32 in lse's layout: lse's own gradient (it enters as D - dlse,
                        // lse's derivative by a score being P); 0: none
  // float32 in attn_mask's shape, zeroed: an additive mask's gradient, dS summed over the
  // dimensions the mask broadcasts along (its strides below, 0 there); 0: none
  u64 dmask;
  // dq fused into the key-block kernel: float32 sums (zeroed by the preprocess),
  // dq_accum_floats of them, strides below
  u64 dq_accum;
  // Packed batches: the (sequence, key block) list of the key-block kernel, built by
  // varlen_schedule over cu_seqlens_k, and its length; 0 for padded batches
  u64 kv_tile_list, kv_tile_count;
  i64 dout_batch_stride, dout_row_stride, dout_head_stride;
  i64 dq_batch_stride, dq_row_stride, dq_head_stride;
  i64 dk_batch_stride, dk_row_stride, dk_head_stride;
  i64 dv_batch_stride, dv_row_stride, dv_head_stride;
  i64 dmask_batch_stride, dmask_head_stride, dmask_row_stride, dmask_col_stride;
  i64 dq_accum_batch_stride, dq_accum_row_stride, dq_accum_head_stride;
  i64 dq_accum_floats;
  int num_n_blocks;     // padded batches: key blocks a sequence
  int rows;             // the preprocess's rows: batch * seqlen_q (packed: total_q)
  // the persistent dk/dv kernel's count of key blocks taken beyond its CTAs' first ones
  // (int, zeroed by the preprocess); 0: none. (Fields are added after the others, so that
  // those keep their places)
  u64 tile_counter;
  // the key-block launches' order for padded batches, as FwdParams' heads_per_group and
  // tail_group_head order the forward's tiles (over batch x KV heads): one head at a time
  // (1, all of them) without a mask; under a causal or local mask groups whose heaviest
  // blocks go first and a tail group that ends the launch balanced (_heuristics.bwd_groups;
  // Hopper's kernels: the mma.sync dk/dv kernel keeps one head at a time)
  int kv_heads_per_group, kv_tail_group_head;
};

}  // namespace cufa
