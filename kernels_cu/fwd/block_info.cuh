#pragma once
// Which (sequence, head, query block) a CTA owns, and where that sequence lives.
#include "params.cuh"

namespace cufa {

struct Tile {
  int b, h, h_k, m_block;
  int seqlen_q, seqlen_k;
  int diag_offset;      // query i's diagonal key is i + diag_offset
  i64 q_start, k_start;  // first row of the sequence in q/o and k/v (0 for padded batches)
};

__device__ __forceinline__ void set_diag_offset(const FwdParams& p, Tile& t) {
  t.diag_offset = p.bottom_right ? t.seqlen_k - t.seqlen_q : 0;
}

// Tile number `block` of the launch (false past the last one). Padded batches: index =
// ((batch, head) group, reversed query block, head in the group): the query blocks of a
// group's heads run together, so their K/V stay in L2, heaviest (last, under a causal
// mask) first. Groups hold heads_per_group pairs but the last, from tail_group_head on,
// which holds the rest: under a causal mask enough to end the launch balanced
// (_heuristics.tail_group_head). Packed (varlen)
// batches: index = (list entry, head); the list, built on the device by varlen_schedule,
// holds (sequence, query block) pairs longest sequences and last query blocks first, and
// only real tiles: no block is spent on padding. Sequence bounds are clamped to the
// tensors, so even malformed cu_seqlens never index outside them.
__device__ __forceinline__ bool get_tile(const FwdParams& p, int block, Tile& t) {
  if (p.tile_list) {
    const int entry = block / p.nheads;
    if (entry >= *reinterpret_cast<const int*>(p.tile_count)) return false;
    const int2 e = reinterpret_cast<const int2*>(p.tile_list)[entry];
    t.b = e.x;
    t.m_block = e.y;
    t.h = block % p.nheads;
    const int* cu_q = reinterpret_cast<const int*>(p.cu_seqlens_q);
    const int* cu_k = reinterpret_cast<const int*>(p.cu_seqlens_k);
    const int q0 = min(max(cu_q[t.b], 0), p.seqlen_q);  // seqlen_q/k hold the total rows
    t.q_start = q0;
    t.seqlen_q = min(max(cu_q[t.b + 1], q0), p.seqlen_q) - q0;
    if (p.block_table) {  // keys 0.. of the sequence's pages; seqlen_k holds their capacity
      t.k_start = 0;
      t.seqlen_k = (int)min(max((i64)cu_k[t.b + 1] - cu_k[t.b], (i64)0), (i64)p.seqlen_k);
    } else {
      const int k0 = min(max(cu_k[t.b], 0), p.seqlen_k);
      t.k_start = k0;
      t.seqlen_k = min(max(cu_k[t.b + 1], k0), p.seqlen_k) - k0;
    }
    if (p.seqused_k)
      t.seqlen_k = min(max(reinterpret_cast<const int*>(p.seqused_k)[t.b], 0), t.seqlen_k);
  } else {
    const int bh_count = p.batch * p.nheads;
    if (block / p.num_m_blocks >= bh_count) return false;
    const int tail_tiles = p.tail_group_head * p.num_m_blocks;  // the tiles before the last group
    int head0 = p.tail_group_head, group_heads = bh_count - p.tail_group_head,
        in_group = block - tail_tiles;
    if (block < tail_tiles) {
      const int group_tiles = p.heads_per_group * p.num_m_blocks;
      head0 = block / group_tiles * p.heads_per_group;
      group_heads = p.heads_per_group;
      in_group = block % group_tiles;
    }
    const int bh = head0 + in_group % group_heads;
    t.m_block = p.num_m_blocks - 1 - in_group / group_heads;
    t.b = bh / p.nheads;
    t.h = bh % p.nheads;
    t.q_start = t.k_start = 0;
    t.seqlen_q = p.seqlen_q;
    t.seqlen_k = p.seqlen_k;
  }
  t.h_k = t.h / (p.nheads / p.nheads_k);
  set_diag_offset(p, t);
  return true;
}

// Row 0 of the tile's sequence: q and o for head h, k and v for its KV head h_k (paged
// K/V: the head's offset within a page; kv_row_ptr finds each row).
struct TilePointers {
  const u16 *q, *k, *v;
  u16* o;
  float* lse;
};

__device__ __forceinline__ TilePointers tile_pointers(const FwdParams& p, const Tile& t) {
  TilePointers r;
  r.q = reinterpret_cast<const u16*>(p.q) + t.b * p.q_batch_stride + t.h * p.q_head_stride +
        t.q_start * p.q_row_stride;
  const i64 kv_batch = p.block_table ? 0 : t.b;
  r.k = reinterpret_cast<const u16*>(p.k) + kv_batch * p.k_batch_stride + t.h_k * p.k_head_stride +
        t.k_start * p.k_row_stride;
  r.v = reinterpret_cast<const u16*>(p.v) + kv_batch * p.v_batch_stride + t.h_k * p.v_head_stride +
        t.k_start * p.v_row_stride;
  r.o = reinterpret_cast<u16*>(p.o) + t.b * p.o_batch_stride + t.h * p.o_head_stride +
        t.q_start * p.o_row_stride;
  r.lse = reinterpret_cast<float*>(p.lse) + t.b * p.lse_batch_stride + t.h * p.lse_head_stride +
          t.q_start;
  return r;
}

// Key `key` of the tile's sequence in a paged cache: its page (clamped to the cache, so a
// bad page id reads a wrong page, never outside), then its row there.
__device__ __forceinline__ const u16* paged_row(const FwdParams& p, const Tile& t, const u16* head,
                                                i64 page_stride, i64 row_stride, int key) {
  const int* pages = reinterpret_cast<const int*>(p.block_table) + t.b * p.block_table_batch_stride;
  const int page = min(max(pages[key >> p.page_shift], 0), p.num_pages - 1);
  return head + page * page_stride + (key & ((1 << p.page_shift) - 1)) * row_stride;
}

}  // namespace cufa
