#pragma once
// Where a decode CTA's rows and keys live: the CTA's query rows (a GQA group's heads x
// new tokens, one mma tile), a sequence's place in a contiguous or paged cache, and the
// cp.async loads of Q and of a warp's K/V tiles from it.
#include "params.cuh"
#include "../common/mma_tiles.cuh"
#include "../common/element_io.cuh"
#include "../common/e4m3_mma.cuh"

namespace cufa {

constexpr int kDecodeRows = 16;  // query rows per CTA: one mma tile
constexpr int kTileKeys = 16;    // keys a warp takes per step
static_assert(kDecodeRows % 2 == 0, "a tile's rows split evenly between two heads");

// -- where a sequence's keys live --
struct CacheSeq {
  int b;
  int seqlen_k;  // keys the queries attend to: cache_seqlens + seqlen_new - leftpad
  int start;     // cache position of key 0 (cache_leftpad)
  int end;       // cache position after the old keys: where the append writes
  int row;       // cache row (contiguous cache)
  const int* pages;  // block_table row (paged cache)
  int seqlen_q;  // query rows: p.seqlen_q, or a packed sequence's own
  int q_row0;    // row of query 0 in q and o (a packed batch's cu_seqlens_q; else 0)
};

// Every value read from the device is clamped, so malformed lengths or ids can make the
// result wrong but never make an access leave the arrays.
__device__ __forceinline__ CacheSeq cache_seq(const DecodeParams& p, int b) {
  CacheSeq s;
  s.b = b;
  s.pages = reinterpret_cast<const int*>(p.block_table) + b * p.block_table_batch_stride;
  if (p.cu_seqlens_q) {  // a packed batch: rows and keys from the offsets, no append
    const int* cu_q = reinterpret_cast<const int*>(p.cu_seqlens_q);
    const int* cu_k = reinterpret_cast<const int*>(p.cu_seqlens_k);
    s.q_row0 = min(max(cu_q[b], 0), p.total_q);
    s.seqlen_q = min(max(cu_q[b + 1], s.q_row0), p.total_q) - s.q_row0;
    const int keys = p.seqused_k ? reinterpret_cast<const int*>(p.seqused_k)[b]
                                 : cu_k[b + 1] - cu_k[b];
    s.start = p.block_table ? 0 : min(max(cu_k[b], 0), p.capacity);  // packed rows: row 0
    s.end = s.start + min(max(keys, 0), p.capacity - s.start);
    s.seqlen_k = s.end - s.start;
    s.row = 0;
    return s;
  }
  s.seqlen_q = p.seqlen_q;
  s.q_row0 = 0;
  const int cached = p.cache_seqlens ? reinterpret_cast<const int*>(p.cache_seqlens)[b]
                                     : p.cache_seqlen_fixed;
  s.end = min(max(cached, 0), p.capacity);
  const int used_end = min(s.end + p.seqlen_new, p.capacity);
  s.start = p.cache_leftpad ? min(max(reinterpret_cast<const int*>(p.cache_leftpad)[b], 0), used_end)
                            : 0;
  s.seqlen_k = used_end - s.start;
  s.row = p.cache_batch_idx
              ? min(max(reinterpret_cast<const int*>(p.cache_batch_idx)[b], 0), p.cache_rows - 1)
              : b;
  return s;
}

// Where cache position `pos` lives: a cache row (contiguous) or a page, and the row in it.
struct CacheSlot {
  i64 block;
  int row;
};

// Position `pos` in page `page` (an id as the block table holds it: clamped to the cache).
__device__ __forceinline__ CacheSlot page_slot(const DecodeParams& p, int page, int pos) {
  return CacheSlot{min(max(page, 0), p.cache_rows - 1), pos & ((1 << p.page_shift) - 1)};
}

__device__ __forceinline__ CacheSlot cache_slot(const DecodeParams& p, const CacheSeq& s, int pos) {
  if (p.block_table) return page_slot(p, s.pages[pos >> p.page_shift], pos);
  return CacheSlot{s.row, pos};
}

// Cache position `pos` of one KV head (head: the cache's base plus the head's offset).
template <class Elem>
__device__ __forceinline__ const Elem* cache_row(const DecodeParams& p, const CacheSeq& s,
                                                 const Elem* head, i64 batch_stride,
                                                 i64 row_stride, int pos) {
  const CacheSlot slot = cache_slot(p, s, pos);
  return head + slot.block * batch_stride + slot.row * row_stride;
}

// -- the cache's element: u16 (q's dtype), or u8 for an e4m3 cache --
template <bool kFp8>
struct CacheElem {
  using type = u16;
};
template <>
struct CacheElem<true> {
  using type = u8;
};

// -- a query row of the CTA: (token, head of the KV head's group) --
struct DecodeRow {
  int t, h;
  bool valid;
};

// kHeads KV heads a CTA (2: an e4m3 cache at d = 64 read as rows of two adjacent heads,
// decode_sm80.cu): tile rows kRowsPerHead * i .. are head h_k * kHeads + i's group, and
// its Q (and its output) the tile's columns kHeadDim / kHeads * i ..; h_k counts tiles
template <int kHeads>
__device__ constexpr int rows_per_head() {
  return kDecodeRows / kHeads;
}

template <int kHeads = 1>
__device__ __forceinline__ DecodeRow decode_row(const DecodeParams& p, const CacheSeq& s,
                                                int m_block, int h_k, int r) {
  constexpr int kRows = rows_per_head<kHeads>();
  const int gr = m_block * kRows + (kHeads == 1 ? r : r % kRows);
  DecodeRow row;
  row.valid = gr < s.seqlen_q * p.group;
  row.t = gr / p.group;
  row.h = (kHeads == 1 ? h_k : h_k * kHeads + r / kRows) * p.group + gr % p.group;
  return row;
}

// the tile row of the CTA's i-th query row (of `rows` a head)
template <int kHeads>
__device__ __forceinline__ int tile_row(int i, int rows) {
  return kHeads == 1 ? i : (i / rows) * rows_per_head<kHeads>() + i % rows;
}

// -- a paged cache's page ids, looked up a step before the copies that need them: lane l
//    loads the page of the tile's row l % 16, and the copies take each row's page from a
//    shuffle, instead of a dependent load in front of their cp.async. 0 where no page is
//    read: a contiguous cache, rows past the sequence --
__device__ __forceinline__ int tile_row_page(const DecodeParams& p, const CacheSeq& s, int key0,
                                             int lane) {
  const int r = lane % kTileKeys;
  if (!p.block_table || r >= s.seqlen_k - key0) return 0;
  return s.pages[(s.start + key0 + r) >> p.page_shift];
}

// -- load_kv_tile's tile by plain loads (the element-wise I/O variant): a lane's chunks of
//    K and V, kBatch of each in flight, stored before this returns. Each row's slot is
//    looked up (its page from row_page's lane r with kPagesAhead) --
template <int kHeadDim, bool kPagesAhead>
__device__ __forceinline__ void load_kv_tile_elementwise(u32 sk, u32 sv, const DecodeParams& p,
                                                         const CacheSeq& s, const u16* k_head,
                                                         const u16* v_head, int key0,
                                                         int row_page, int lane) {
  constexpr int kChunks = kHeadDim / 8;
  constexpr int kLaneChunks = kTileKeys * kChunks / 32;
  constexpr int kBatch = kLaneChunks % 4 == 0 ? 4 : 2;  // (whole batches: no stack frame)
  const int rows_valid = s.seqlen_k - key0;
#pragma unroll
  for (int first = 0; first < kLaneChunks; first += kBatch) {
    uint4 kx[kBatch], vx[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int idx = lane + 32 * (first + j), r = idx / kChunks, c = idx % kChunks;
      const int page = kPagesAhead ? __shfl_sync(0xffffffffu, row_page, r) : 0;  // (whole warp)
      const bool valid = r < rows_valid;
      const u16 *k_src = nullptr, *v_src = nullptr;
      if (valid) {
        const int pos = s.start + key0 + r;
        const CacheSlot slot =
            !p.block_table ? CacheSlot{s.row, pos}
                           : page_slot(p, kPagesAhead ? page : s.pages[pos >> p.page_shift], pos);
        k_src = k_head + slot.block * p.k_batch_stride + slot.row * p.k_row_stride + c * 8;
        v_src = v_head + slot.block * p.v_batch_stride + slot.row * p.v_row_stride + c * 8;
      }
      const int cols = valid ? p.head_dim - c * 8 : 0;
      kx[j] = load8_elementwise(k_src, cols);
      vx[j] = load8_elementwise(v_src, cols);
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int idx = lane + 32 * (first + j);
      const u32 at = Swizzle<kHeadDim>::offset(idx / kChunks, idx % kChunks);
      st_shared_16(sk + at, kx[j]);
      st_shared_16(sv + at, vx[j]);
    }
  }
}

// -- load one warp's 16-key tile of K and V into its stage: rows past the sequence and
//    columns past head_dim read as zeros. A paged cache's rows take their pages from
//    row_page, this lane's tile_row_page (kPagesAhead), or look them up here. By cp.async
//    (kElementIO: plain loads, load_kv_tile_elementwise). Elem: u16 (a swizzled tile), or
//    u8 for an e4m3 cache (E4m3Tile rows). kHeadDimV < kHeadDim: V's columns col0 ..
//    col0 + kHeadDimV (v_head: already at col0; 16-bit, 16-byte path) --
// -- where a 16-key tile's rows start: a contiguous cache's tile, or a paged one inside one
//    page, is rows of one base (k and v: element offsets of its first row); otherwise
//    (paged) each row looks up its page --
struct TileBase {
  bool paged;
  i64 k, v;
};
template <bool kPagesAhead>
__device__ __forceinline__ TileBase tile_base(const DecodeParams& p, const CacheSeq& s, int key0,
                                              int row_page) {
  const int pos0 = s.start + key0;
  const bool one_page = p.page_shift >= 4 && (pos0 & (kTileKeys - 1)) == 0;
  TileBase b;
  b.paged = p.block_table != 0 && !one_page;
  i64 block = s.row;
  if (p.block_table && one_page)
    block = page_slot(p, kPagesAhead ? __shfl_sync(0xffffffffu, row_page, 0)
                                     : s.pages[pos0 >> p.page_shift], pos0).block;
  const int row0 = p.block_table ? pos0 & ((1 << p.page_shift) - 1) : pos0;
  b.k = b.paged ? 0 : block * p.k_batch_stride + (i64)row0 * p.k_row_stride;
  b.v = b.paged ? 0 : block * p.v_batch_stride + (i64)row0 * p.v_row_stride;
  return b;
}

// -- load_kv_tile's tile where V's stage holds kHeadDimV of its columns (from col0): row
//    by row, a warp's 32 lanes on consecutive chunks, so that a row's address, swizzle and
//    slot lookup are worked out once a row and each copy costs an add (a loop over
//    (row, chunk) pairs split by division issued ~2,900 instructions a 16-key tile at
//    d = 512, ncu on an H200, and held the kernel to 8-16 % of copy bandwidth) --
// -- row r of a swizzled tile of kCols columns: a warp's lanes on consecutive chunks of
//    the row at head + row (elements), its first `cols` columns where row_valid, zeros
//    elsewhere --
template <int kCols>
__device__ __forceinline__ void copy_tile_row(u32 tile, int r, const u16* head, i64 row,
                                              bool row_valid, int cols, int lane) {
  static_assert(kCols % 256 == 0, "whole warps of 16-byte chunks a row");
#pragma unroll
  for (int j = 0; j < kCols / 256; ++j) {
    const int chunk = lane + 32 * j;
    const bool valid = row_valid && chunk * 8 < cols;
    // (any valid address where nothing is read: a zero-filling copy reads nothing)
    cp_async_16(tile + Swizzle<kCols>::offset(r, chunk), head + (valid ? row + chunk * 8 : 0),
                valid ? 16 : 0);
  }
}

template <int kHeadDim, int kHeadDimV, bool kPagesAhead>
__device__ __forceinline__ void load_kv_tile_halves(u32 sk, u32 sv, const DecodeParams& p,
                                                    const CacheSeq& s, const u16* k_head,
                                                    const u16* v_head, int key0, int row_page,
                                                    int lane, int col0) {
  const int rows_valid = s.seqlen_k - key0;
  const TileBase base = tile_base<kPagesAhead>(p, s, key0, row_page);
  const int pos0 = s.start + key0;
  const int k_cols = p.head_dim, v_cols = p.head_dim_v - col0;
#pragma unroll
  for (int r = 0; r < kTileKeys; ++r) {
    const bool row_valid = r < rows_valid;
    i64 k_row = base.k + r * p.k_row_stride, v_row = base.v + r * p.v_row_stride;
    if (base.paged) {
      const int page = kPagesAhead ? __shfl_sync(0xffffffffu, row_page, r) : 0;  // (whole warp)
      k_row = v_row = 0;
      if (row_valid) {
        const int pos = pos0 + r;
        const CacheSlot slot = page_slot(p, kPagesAhead ? page : s.pages[pos >> p.page_shift], pos);
        k_row = slot.block * p.k_batch_stride + slot.row * p.k_row_stride;
        v_row = slot.block * p.v_batch_stride + slot.row * p.v_row_stride;
      }
    }
    copy_tile_row<kHeadDim>(sk, r, k_head, k_row, row_valid, k_cols, lane);
    copy_tile_row<kHeadDimV>(sv, r, v_head, v_row, row_valid, v_cols, lane);
  }
}

// -- the columns of a cache row that a CTA copies: head_dim, read where it is used, or a
//    pair's both heads' (pair_cols, worked out once by the kernel). At sm_90's bound of 128
//    registers ptxas 13.0 spilled 8 bytes of the bf16 d = 64 kernel where its head_dim was
//    worked out once, and of the pairs' where theirs was the constant 128 --
template <int kHeads>
__device__ __forceinline__ int cache_cols(const DecodeParams& p, int pair_cols) {
  return kHeads == 1 ? p.head_dim : pair_cols;
}

template <class Elem, int kHeadDim>
__device__ __forceinline__ u32 kv_stage_offset(int r, int c) {
  if constexpr (sizeof(Elem) == 2) return Swizzle<kHeadDim>::offset(r, c);
  return E4m3Tile<kHeadDim>::offset(r, c);
}

template <int kHeadDim, bool kPagesAhead, bool kElementIO = false, class Elem = u16,
          int kHeadDimV = kHeadDim, int kHeads = 1>
__device__ __forceinline__ void load_kv_tile(u32 sk, u32 sv, const DecodeParams& p,
                                             const CacheSeq& s, const Elem* k_head,
                                             const Elem* v_head, int key0, int row_page, int lane,
                                             int pair_cols = 0, int col0 = 0) {
  if constexpr (kHeadDimV != kHeadDim) {
    static_assert(!kElementIO && sizeof(Elem) == 2, "V's column halves: 16-bit, 16-byte path");
    load_kv_tile_halves<kHeadDim, kHeadDimV, kPagesAhead>(sk, sv, p, s, k_head, v_head, key0,
                                                          row_page, lane, col0);
    return;
  }
  if constexpr (kElementIO) {
    load_kv_tile_elementwise<kHeadDim, kPagesAhead>(sk, sv, p, s, k_head, v_head, key0,
                                                    row_page, lane);
    return;
  }
  constexpr int kChunkElems = 16 / sizeof(Elem);
  constexpr int kChunks = kHeadDim / kChunkElems;
  const int rows_valid = s.seqlen_k - key0;
  // A contiguous cache's tile is rows of one base, and so is a paged tile inside one page
  // (pages of 16 rows or more, a 16-aligned first key): one lookup a tile, not one a row
  // (pages of 256 1-2 % faster on an H100, pages of 16 within +-1.5 %).
  const TileBase base = tile_base<kPagesAhead>(p, s, key0, row_page);
  if constexpr (32 % kChunks == 0) {
    if (!base.paged && rows_valid >= kTileKeys) {
      // A whole tile of one base: a lane copies one chunk column (lane % kChunks), from
      // row lane / kChunks down by kPassRows rows a copy, so each copy's source is the
      // last one's plus a fixed stride, with no test a row: where a (row, chunk) split, a
      // 64-bit product and a row test a copy issued ~130 instructions a 16-key tile, a
      // sixth of the e4m3 kernel's (ncu on an H200: that loop was issue-bound, at 48 % of
      // the copy bandwidth). A column past head_dim copies zeros (from a valid address).
      constexpr int kPassRows = 32 / kChunks;
      const int c = lane % kChunks, r0 = lane / kChunks;
      const bool col_valid = c * kChunkElems < cache_cols<kHeads>(p, pair_cols);
      const int col = col_valid ? c * kChunkElems : 0;
      const Elem* k_src = k_head + base.k + (r0 * p.k_row_stride + col);
      const Elem* v_src = v_head + base.v + (r0 * p.v_row_stride + col);
      const i64 k_pass = kPassRows * p.k_row_stride, v_pass = kPassRows * p.v_row_stride;
#pragma unroll
      for (int j = 0; j < kTileKeys / kPassRows; ++j) {
        const u32 at = kv_stage_offset<Elem, kHeadDim>(r0 + j * kPassRows, c);
        cp_async_16(sk + at, k_src, col_valid ? 16 : 0);
        cp_async_16(sv + at, v_src, col_valid ? 16 : 0);
        k_src += k_pass;
        v_src += v_pass;
      }
      return;
    }
  }
  const bool paged = base.paged;
  const i64 first = base.k, first_v = base.v;
#pragma unroll
  for (int idx = lane; idx < kTileKeys * kChunks; idx += 32) {
    const int r = idx / kChunks, c = idx % kChunks;
    const bool valid = r < rows_valid && c * kChunkElems < cache_cols<kHeads>(p, pair_cols);
    const Elem* k_src = k_head;  // any valid address: a zero-filling copy reads nothing
    const Elem* v_src = v_head;
    if (valid && !paged) {
      k_src += first + r * p.k_row_stride + c * kChunkElems;
      v_src += first_v + r * p.v_row_stride + c * kChunkElems;
    } else if (paged) {  // (the whole warp: the shuffle)
      const int pos = s.start + key0 + r;
      const CacheSlot slot = page_slot(p, kPagesAhead ? __shfl_sync(0xffffffffu, row_page, r)
                                                      : valid ? s.pages[pos >> p.page_shift] : 0,
                                       pos);
      if (valid) {
        k_src += slot.block * p.k_batch_stride + slot.row * p.k_row_stride + c * kChunkElems;
        v_src += slot.block * p.v_batch_stride + slot.row * p.v_row_stride + c * kChunkElems;
      }
    }
    const u32 at = kv_stage_offset<Elem, kHeadDim>(r, c);
    cp_async_16(sk + at, k_src, valid ? 16 : 0);
    cp_async_16(sv + at, v_src, valid ? 16 : 0);
  }
}

// -- a warp's whole tiles of a contiguous cache, in the order the warp takes them (every
//    kWarps-th 16-key tile): each copies from where the last one's sources were, a fixed
//    stride on, as load_kv_tile copies a tile of one base but with the base and the lane's
//    (row, chunk) offsets worked out once, where they took ~90 of the e4m3 kernel's ~330
//    instructions a tile at d = 64 (ncu, H200) --
template <int kHeadDim, int kWarps, class Elem, int kHeads = 1>
struct ContiguousTiles {
  static constexpr int kChunkElems = 16 / sizeof(Elem);
  static constexpr int kChunks = kHeadDim / kChunkElems;
  static_assert(32 % kChunks == 0, "a row's chunks in one pass of the warp");
  static constexpr int kPassRows = 32 / kChunks;
  const Elem *k, *v;  // this lane's first copy of the next tile
  int chunk, row0;
  bool col_valid;  // (a column past head_dim copies zeros, from a valid address)

  __device__ __forceinline__ ContiguousTiles(const DecodeParams& p, const CacheSeq& s,
                                             const Elem* k_head, const Elem* v_head, int key0,
                                             int pair_cols, int lane) {
    chunk = lane % kChunks;
    row0 = lane / kChunks;
    col_valid = chunk * kChunkElems < cache_cols<kHeads>(p, pair_cols);
    const int col = col_valid ? chunk * kChunkElems : 0;
    const i64 pos = static_cast<i64>(s.start) + key0 + row0;
    k = k_head + s.row * p.k_batch_stride + pos * p.k_row_stride + col;
    v = v_head + s.row * p.v_batch_stride + pos * p.v_row_stride + col;
  }

  // the warp's next tile into stages sk, sv
  __device__ __forceinline__ void load_next(u32 sk, u32 sv, const DecodeParams& p) {
#pragma unroll
    for (int j = 0; j < kTileKeys / kPassRows; ++j) {
      const u32 at = kv_stage_offset<Elem, kHeadDim>(row0 + j * kPassRows, chunk);
      cp_async_16(sk + at, k + j * kPassRows * p.k_row_stride, col_valid ? 16 : 0);
      cp_async_16(sv + at, v + j * kPassRows * p.v_row_stride, col_valid ? 16 : 0);
    }
    k += kWarps * kTileKeys * p.k_row_stride;
    v += kWarps * kTileKeys * p.v_row_stride;
  }
};

// -- Q: the CTA's 16 query rows (`rows` of them a head, zeros after) into sq, by cp.async
//    (kElementIO: plain loads) from `threads` threads. kHeads 2: a row's head_dim (the
//    tile's half) columns in its head's half of the row, zeros in the other, so that one
//    product with a tile of both heads' keys scores each row against its own head's --
template <int kHeadDim, int kThreads, bool kElementIO = false, int kHeads = 1>
__device__ __forceinline__ void load_q_rows(u32 sq, const DecodeParams& p, const CacheSeq& s,
                                            int m_block, int h_k, int rows, int thread) {
  const u16* q = reinterpret_cast<const u16*>(p.q);
  const auto row_ptr = [&](int r) {
    const DecodeRow row = decode_row<kHeads>(p, s, m_block, h_k, r);
    return q + s.b * p.q_batch_stride + (s.q_row0 + row.t) * p.q_row_stride +
           row.h * p.q_head_stride;
  };
  const auto offset = [](int r, int c) { return Swizzle<kHeadDim>::offset(r, c); };
  if constexpr (kHeads > 1) {
    static_assert(!kElementIO, "heads side by side: 16-byte rows");
    constexpr int kChunks = kHeadDim / 8, kHeadChunks = kChunks / kHeads;
#pragma unroll 1
    for (int idx = thread; idx < kDecodeRows * kChunks; idx += kThreads) {
      const int r = idx / kChunks, c = idx % kChunks;
      const int slot = r / rows_per_head<kHeads>();
      const bool valid = r % rows_per_head<kHeads>() < rows && c / kHeadChunks == slot;
      cp_async_16(sq + offset(r, c), valid ? row_ptr(r) + (c % kHeadChunks) * 8 : q, valid ? 16 : 0);
    }
  } else if constexpr (kElementIO) {
    copy_rows_elementwise<kDecodeRows, kHeadDim, kThreads>(sq, row_ptr, rows, p.head_dim, offset,
                                                           thread);
  } else {
    copy_rows_async<kDecodeRows, kHeadDim, kThreads>(sq, row_ptr, q, rows, p.head_dim, offset,
                                                     thread);
  }
}

}  // namespace cufa
