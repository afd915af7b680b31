#pragma once
// The Hopper forward's producer warp: each tile's Q and its K/V blocks into shared
// memory by TMA (cp.async where TMA would read past a sequence), announced on mbarriers.
#include "sm90_smem.cuh"
#include "vt_layout.cuh"

namespace cufa {

// -- the producer warp loads a tile into the panel layout with cp.async: rows past
//    `rows_valid`, columns past `head_dim` as zeros --
template <int kRows, int kHeadDim>
__device__ __forceinline__ void load_panels(u32 smem, const u16* gmem, i64 row_stride,
                                            int rows_valid, int head_dim) {
  copy_tile_async<kRows, kHeadDim, 32>(smem, gmem, row_stride, rows_valid, head_dim,
                                        [](int r, int c) { return panel_offset<kRows>(r, c); });
}

// -- a K and V stage the producer warp filled with cp.async (a sequence's last key
//    block): once its copies have landed, fenced for the async proxy that wgmma reads
//    through (they came through the generic one), lane 0 marks both full --
template <class Smem>
__device__ __forceinline__ void mark_copied_stage_full(const Smem& sm, u32 stage) {
  cp_async_wait_all();
  fence_proxy_async();
  __syncwarp();
  if (threadIdx.x == 0) {
    mbar_arrive(sm.k_full() + 8 * stage);
    mbar_arrive(sm.v_full() + 8 * stage);
  }
}

// -- a key block's K or V (kColumns wide) from a paged cache: lane i < boxes issues box
//    i, rows page_row.. of its page there; `elected` (lane 0) expects the bytes. A box a lane,
//    each lane issuing its own copies: one lane issuing them all, the pages passed to it
//    by shuffles, read pages of 16 at 60-65 % of a contiguous cache's speed on an H100,
//    against 85-92 % so (docs/decisions.md) --
template <int kBlockN, int kColumns>
__device__ __forceinline__ void load_page_boxes(u32 dst, const TensorMap& map, u32 bar,
                                                bool elected, int lane, int boxes, int box_shift,
                                                int page, int page_row, int head, int col0 = 0) {
  if (elected) mbar_arrive_expect_bytes(bar, kBlockN * kColumns * 2);
  __syncwarp();  // the bytes expected before any box's land
  if (lane < boxes) {
#pragma unroll
    for (int panel = 0; panel < kColumns / 64; ++panel)
      tma_load_4d(dst + panel * kBlockN * 128 + (lane << box_shift) * 128, map, bar,
                  col0 + panel * 64, page_row, head, page);
  }
}

// -- a key block of a paged cache (block_table): boxes of whole rows inside one page by
//    TMA, each from its page (the maps view K and V as (columns, page rows, heads, pages)
//    in boxes of the page's rows, or of the largest power of two up to 128 dividing
//    kBlockN where that is fewer: api._paged_box_rows; so no box crosses a page). The
//    lanes look the boxes' pages up before the stage is free, so the lookup's latency
//    hides under that wait. The sequence's last block is copied with cp.async instead,
//    with zeros past the end: the rest of its last page is whatever the cache holds there
//    (a stray NaN would turn P = 0 into NaN). --
template <class Smem>
__device__ __forceinline__ void produce_paged_block(const FwdParams& p, const TensorMaps& maps,
                                                    const Smem& sm, const Tile& t, int key0,
                                                    int block_count, int v_col0) {
  constexpr int kHeadDim = Smem::kHeadDim, kHeadDimV = Smem::kHeadDimV, kBlockN = Smem::kBlockN;
  constexpr int kBlockNShift =
      kBlockN % 128 == 0 ? 7 : kBlockN % 64 == 0 ? 6 : kBlockN % 32 == 0 ? 5 : 4;
  const bool elected = threadIdx.x == 0;
  const int lane = threadIdx.x % 32;
  const u32 stage = Smem::stage(block_count), parity = Smem::parity(block_count);
  const u32 k_dst = sm.k() + stage * Smem::kKVBytes, v_dst = sm.v() + stage * Smem::kVBytes;
  const bool reused = block_count >= Smem::kStages;
  if (key0 + kBlockN > t.seqlen_k) {
    if (reused) {
      mbar_wait(sm.k_empty() + 8 * stage, parity ^ 1);
      mbar_wait(sm.v_empty() + 8 * stage, parity ^ 1);
    }
    const TilePointers ptr = tile_pointers(p, t);
    const auto panels = [](int r, int c) { return panel_offset<kBlockN>(r, c); };
    copy_rows_async<kBlockN, kHeadDim, 32>(
        k_dst, [&](int r) { return paged_row(p, t, ptr.k, p.k_batch_stride, p.k_row_stride, key0 + r); },
        ptr.k, t.seqlen_k - key0, p.head_dim, panels, lane);
    copy_rows_async<kBlockN, kHeadDimV, 32>(
        v_dst,
        [&](int r) {
          return paged_row(p, t, ptr.v, p.v_batch_stride, p.v_row_stride, key0 + r) + v_col0;
        },
        ptr.v, t.seqlen_k - key0, head_dim_v<Smem>(p) - v_col0, panels, lane);
    mark_copied_stage_full(sm, stage);
    return;
  }
  const int box_shift = min(p.page_shift, kBlockNShift);
  const int boxes = kBlockN >> box_shift;  // at most 16: pages of 8 rows and more take this path
  int page_row = 0, page = 0;
  if (lane < boxes) {
    const int key = key0 + (lane << box_shift);
    const int* pages = reinterpret_cast<const int*>(p.block_table) + t.b * p.block_table_batch_stride;
    page = min(max(pages[key >> p.page_shift], 0), p.num_pages - 1);
    page_row = key & ((1 << p.page_shift) - 1);
  }
  if (reused) mbar_wait(sm.k_empty() + 8 * stage, parity ^ 1);
  load_page_boxes<kBlockN, kHeadDim>(k_dst, maps.k, sm.k_full() + 8 * stage, elected, lane,
                                     boxes, box_shift, page, page_row, t.h_k);
  if (reused) mbar_wait(sm.v_empty() + 8 * stage, parity ^ 1);
  load_page_boxes<kBlockN, kHeadDimV>(v_dst, maps.v, sm.v_full() + 8 * stage, elected,
                                      lane, boxes, box_shift, page, page_row, t.h_k, v_col0);
  __syncwarp();
}

// -- the producer's K and V copies of key block `it` of a tile, the CTA's block number
//    `block_count` (16-bit K and V; V's columns from v_col0) --
template <class Smem>
__device__ __forceinline__ void produce_16bit_block(const FwdParams& p, const TensorMaps& maps,
                                                    const Smem& sm, const Sm90Work& w, int it,
                                                    int block_count, int v_col0) {
  constexpr int kHeadDim = Smem::kHeadDim, kHeadDimV = Smem::kHeadDimV, kBlockN = Smem::kBlockN;
  const bool elected = threadIdx.x == 0;
  const bool packed = p.cu_seqlens_k != 0;
  const Tile& t = w.t;
  const int key0 = (w.n_block_max - 1 - it) * kBlockN;
  if (p.block_table) {
    produce_paged_block(p, maps, sm, t, key0, block_count, v_col0);
    return;
  }
  const u32 stage = Smem::stage(block_count), parity = Smem::parity(block_count);
  const u32 k_dst = sm.k() + stage * Smem::kKVBytes, v_dst = sm.v() + stage * Smem::kVBytes;
  if (block_count >= Smem::kStages) mbar_wait(sm.k_empty() + 8 * stage, parity ^ 1);
  // (map, row coordinate, last coordinate) of this block's K and V boxes
  const TensorMap *k_map = &maps.k, *v_map = &maps.v;
  int row = static_cast<int>(t.k_start) + key0, last = packed ? 0 : t.b;
  if (packed && key0 + kBlockN > t.seqlen_k) {
    const int shift = key0 + kBlockN - t.seqlen_k;  // rows of the box past the sequence
    if (p.kv_tail_maps && row >= shift) {
      k_map = &maps.k_tail;
      v_map = &maps.v_tail;
      last = row - shift;
      row = shift;
    } else {
      if (block_count >= Smem::kStages) mbar_wait(sm.v_empty() + 8 * stage, parity ^ 1);
      const TilePointers ptr = tile_pointers(p, t);
      load_panels<kBlockN, kHeadDim>(k_dst, ptr.k + key0 * p.k_row_stride, p.k_row_stride,
                                     t.seqlen_k - key0, p.head_dim);
      load_panels<kBlockN, kHeadDimV>(v_dst, ptr.v + key0 * p.v_row_stride + v_col0,
                                      p.v_row_stride, t.seqlen_k - key0,
                                      head_dim_v<Smem>(p) - v_col0);
      mark_copied_stage_full(sm, stage);
      return;
    }
  }
  if (elected) {
    mbar_arrive_expect_bytes(sm.k_full() + 8 * stage, Smem::kKVBytes);
    tma_load_panels<kBlockN, kHeadDim>(k_dst, *k_map, sm.k_full() + 8 * stage, row, t.h_k, last);
  }
  if (block_count >= Smem::kStages) mbar_wait(sm.v_empty() + 8 * stage, parity ^ 1);
  if (elected) {
    mbar_arrive_expect_bytes(sm.v_full() + 8 * stage, Smem::kVBytes);
    tma_load_panels<kBlockN, kHeadDimV>(v_dst, *v_map, sm.v_full() + 8 * stage, row, t.h_k, last,
                                        v_col0);
  }
  __syncwarp();
}

// -- the fp8 forward's key block: K's e4m3 rows as panels (the maps view a row's bytes as
//    16-bit pairs), and V^T's block, its head-dim rows of kBlockN keys, as one box from the
//    transposed copy (vt_layout.cuh; the map's columns pairs of keys). Past the sequence,
//    K's rows read as zeros (a padded batch's map ends there; a packed one's last block
//    comes through the tail map, or is copied where that map would start before row 0, as
//    16-bit K's is) and V^T's keys are zeros (the copy's padding) --
template <class Smem>
__device__ __forceinline__ void produce_e4m3_block(const FwdParams& p, const TensorMaps& maps,
                                                   const Smem& sm, const Sm90Work& w, int it,
                                                   int block_count) {
  constexpr int kBlockN = Smem::kBlockN;
  static_assert(kBlockN == kVtBlockKeys, "a V^T row of the block is one 128-byte panel");
  const Tile& t = w.t;
  const bool packed = p.cu_seqlens_k != 0;
  const int key0 = (w.n_block_max - 1 - it) * kBlockN;
  const u32 stage = Smem::stage(block_count), parity = Smem::parity(block_count);
  const u32 k_dst = sm.k() + stage * Smem::kKVBytes, v_dst = sm.v() + stage * Smem::kKVBytes;
  const bool elected = threadIdx.x == 0;
  if (block_count >= Smem::kStages) mbar_wait(sm.k_empty() + 8 * stage, parity ^ 1);
  const TensorMap* k_map = &maps.k;
  int row = static_cast<int>(t.k_start) + key0, last = packed ? 0 : t.b;
  bool copied = false;
  if (packed && key0 + kBlockN > t.seqlen_k) {
    const int shift = key0 + kBlockN - t.seqlen_k;  // rows of the box past the sequence
    copied = !(p.kv_tail_maps && row >= shift);
    k_map = &maps.k_tail;
    last = row - shift;
    row = shift;
  }
  if (copied) {
    const TilePointers ptr = tile_pointers(p, t);
    load_panels<kBlockN, Smem::kRowUnits>(k_dst, ptr.k + key0 * p.k_row_stride, p.k_row_stride,
                                          t.seqlen_k - key0, p.head_dim / 2);
    cp_async_wait_all();
    fence_proxy_async();
    __syncwarp();
    if (elected) mbar_arrive(sm.k_full() + 8 * stage);
  } else if (elected) {
    mbar_arrive_expect_bytes(sm.k_full() + 8 * stage, Smem::kKVBytes);
    tma_load_panels<kBlockN, Smem::kRowUnits>(k_dst, *k_map, sm.k_full() + 8 * stage, row,
                                              t.h_k, last);
  }
  if (block_count >= Smem::kStages) mbar_wait(sm.v_empty() + 8 * stage, parity ^ 1);
  if (elected) {
    const int column = static_cast<int>(packed ? vt_sequence_start(t.k_start, t.b) + key0 : key0);
    mbar_arrive_expect_bytes(sm.v_full() + 8 * stage, Smem::kKVBytes);
    tma_load_4d(v_dst, maps.v, sm.v_full() + 8 * stage, column / 2, 0, t.h_k, packed ? 0 : t.b);
  }
  __syncwarp();
}

template <class Smem>
__device__ __forceinline__ void produce_block(const FwdParams& p, const TensorMaps& maps,
                                              const Smem& sm, const Sm90Work& w, int it,
                                              int block_count, int v_col0) {
  if constexpr (Smem::kE4m3)
    produce_e4m3_block(p, maps, sm, w, it, block_count);
  else
    produce_16bit_block(p, maps, sm, w, it, block_count, v_col0);
}

// -- the last CTA out of the tile loop zeroes the tile counter (and its count of CTAs
//    out, counter[1]) for the next launch on the stream, so the host needs no memset:
//    every CTA has then taken its last tile, so no atomicAdd on counter[0] is to come --
__device__ __forceinline__ void leave_tile_loop(u32* counter) {
  __threadfence();  // our last counter[0] atomic before our count below
  if (atomicAdd(counter + 1, 1u) == gridDim.x - 1) {
    __threadfence();  // every other CTA's counter[0] atomics before the reset
    atomicExch(counter, 0u);
    atomicExch(counter + 1, 0u);
  }
}

// -- producer: one warp; lane 0 issues TMA copies, whose bytes complete the stage's
//    barrier. A packed batch's last key block must not bring in the next sequence's rows
//    (a stray inf there would turn P = 0 into NaN): it comes through the tail maps, whose
//    window ends with the sequence. Where the window would start before row 0 (the
//    first sequence) or the maps are missing, the warp copies it with cp.async, which
//    fills those rows with zeros. All lanes wait for every stage, so none runs a phase
//    ahead of the barriers. Every tile, with keys or not, and the end of the list pass
//    through a Q stage, which carries the tile to the consumers. --
template <int kMask, class Smem>
__device__ __forceinline__ void produce(const FwdParams& p, const TensorMaps& maps, const Smem& sm) {
  constexpr int kQStages = Smem::kQStages;
  const bool elected = threadIdx.x == 0;
  const bool packed = p.cu_seqlens_k != 0;
  u32* counter = reinterpret_cast<u32*>(p.tile_counter);
  int block_count = 0, tile_count = 0;
  for (u32 index = blockIdx.x;; ++tile_count) {  // < 2^31 + gridDim.x: the host keeps tiles in int32
    Tile t{};  // stored whole even past the end of the list
    // (column halves: two work units a tile, its halves of V's and O's columns)
    const u32 tile_index = Smem::kColumnHalves ? index >> 1 : index;
    const int v_col0 = Smem::kColumnHalves ? static_cast<int>(index & 1) * Smem::kHeadDimV : 0;
    const bool more = index <= 0x7fffffffu && get_tile(p, static_cast<int>(tile_index), t);
    const Sm90Work w = sm90_work<Smem::kBlockM, kMask, Smem::kBlockN>(p, t);
    const u32 q_stage = Smem::q_stage(tile_count);
    if (tile_count >= kQStages) mbar_wait(sm.q_empty() + 8 * q_stage, Smem::q_parity(tile_count) ^ 1);
    if (elected) {
      if constexpr (Smem::kColumnHalves)  // the half for the consumers (split_half); w has t's
        t.m_block = 2 * t.m_block + static_cast<int>(index & 1);
      store_tile(sm.tile() + 32 * q_stage, t, more);
      if (more && w.n_blocks > 0) {
        mbar_arrive_expect_bytes(sm.q_full() + 8 * q_stage, Smem::kQBytes);
        tma_load_panels<Smem::kBlockM, Smem::kRowUnits>(sm.q + q_stage * Smem::kQBytes, maps.q,
                                               sm.q_full() + 8 * q_stage,
                                               static_cast<int>(t.q_start) + w.row0, t.h,
                                               packed ? 0 : t.b);
      } else {
        mbar_arrive(sm.q_full() + 8 * q_stage);  // the tile alone
      }
    }
    if (!more) {
      if (elected) leave_tile_loop(counter);
      break;
    }
    u32 next = 0;
    if (elected) next = atomicAdd(counter, 1u);  // in flight while the K/V copies go out
    for (int it = 0; it < w.n_blocks; ++it, ++block_count)
      produce_block(p, maps, sm, w, it, block_count, v_col0);
    index = gridDim.x + __shfl_sync(0xffffffffu, next, 0);
  }
}

}  // namespace cufa
