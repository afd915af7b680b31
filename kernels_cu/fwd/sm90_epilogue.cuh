#pragma once
// The Hopper forward's epilogue: a consumer warpgroup's O rows and their lse to global
// memory, staged through shared memory from d = 128 (kStagedOutput: the tile's Q stage, or
// its last K stage where Q has one stage, sm90_consumer.cuh's kStageOInK), else straight
// from registers.
#include "params.cuh"
#include "../common/sm90.cuh"

namespace cufa {

// lse of this thread's two rows (rows row_base + lane / 4 and + 8), one lane of each quad
__device__ __forceinline__ void write_lse(const float (&lse)[1][2], int seqlen_q, float* lse_ptr,
                                          int row_base, int lane) {
  if ((lane & 3) != 0) return;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = frag_row(row_base, 0, 2 * h, lane);
    if (row < seqlen_q) lse_ptr[row] = lse[0][h];
  }
}

// -- epilogue, head dims from 128: each warp's 16 rows through its own rows of a staging
//    area (read for the last time by now), then out in 16-byte chunks, whole rows per
//    store. Straight from registers each quad stores 16 bytes of a row at a time, half a
//    32-byte sector, with four times the store instructions: 7-13 % slower on short
//    sequences at d = 128. At d = 64 the direct stores measured 2-3 % faster (the Q stage
//    is then released at the last Q K^T, not after the epilogue) --
template <int kHeadDim>
constexpr bool kStagedOutput = kHeadDim >= 128;

// (common/sm90.cuh's store_rows_staged, which the backward's dk/dv take, is these steps
// with the addresses as arguments; moving the forward onto it reorders this function's
// PTX, so it waits for a forward A/B.)
// stage: the staging area's base, whose panels are kPanelRows rows; stage_row0: this
// warp's first row in it; row_base: the warp's first row in the sequence. O goes out in
// passes of kPassColumns (the whole head dim where the area holds it; d = 256 staged in
// a K stage: two of 128, each warp's rows written and read back before the next)
template <int kDtype, int kPanelRows, int kPassColumns, int kHeadDim, int kDTiles>
__device__ __forceinline__ void write_output_staged(const float (&o)[1][kDTiles][4],
                                                    const float (&lse)[1][2], const FwdParams& p,
                                                    int seqlen_q, u16* o_ptr, float* lse_ptr,
                                                    u32 stage, int stage_row0, int row_base,
                                                    int lane) {
  // A 16 x 16 block a stmatrix: matrices 0 and 1 are the warp's rows 0-7 and 8-15 of
  // chunk 2j, 2 and 3 those of chunk 2j + 1 (a quarter of the stores of 4-byte pairs)
  static_assert(kDTiles % 2 == 0 && kHeadDim % kPassColumns == 0 && kPassColumns % 16 == 0,
                "stmatrix stores 16-column pairs of chunks");
  constexpr int kPasses = kHeadDim / kPassColumns, kPassChunks = kPassColumns / 8;
  const int lane_row = stage_row0 + (lane & 15), lane_chunk = lane >> 4;
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    if (pass > 0) __syncwarp();  // the warp has read the previous pass back
#pragma unroll
    for (int j = 0; j < kPassChunks / 2; ++j) {
      const int dt = pass * kPassChunks + 2 * j;
      stmatrix_x4(stage + panel_offset<kPanelRows>(lane_row, 2 * j + lane_chunk),
                  pack2<kDtype>(o[0][dt][0], o[0][dt][1]), pack2<kDtype>(o[0][dt][2], o[0][dt][3]),
                  pack2<kDtype>(o[0][dt + 1][0], o[0][dt + 1][1]),
                  pack2<kDtype>(o[0][dt + 1][2], o[0][dt + 1][3]));
    }
    __syncwarp();
    // (What a store does not change is worked out once: the warp's first row in memory
    // and in the stage, a multiple of 16 rows, so the swizzle sees only r.)
    u16* const o_rows = o_ptr + row_base * p.o_row_stride;
    const u32 stage_rows = stage + stage_row0 * 128;
    const int rows_left = seqlen_q - row_base;
#pragma unroll 4
    for (int i = 0; i < 16 * kPassChunks / 32; ++i) {
      const int idx = i * 32 + lane;
      const int r = idx / kPassChunks, c = pass * kPassChunks + idx % kPassChunks;
      if (r < rows_left && c * 8 < p.head_dim)
        st_global_v4(o_rows + r * p.o_row_stride + c * 8,
                     ld_shared_v4(stage_rows + panel_offset<kPanelRows>(r, c - pass * kPassChunks)));
    }
  }
  if (p.lse) write_lse(lse, seqlen_q, lse_ptr, row_base, lane);  // lse asked for
}

template <int kDtype, int kDTiles>
__device__ __forceinline__ void write_output_direct(const float (&o)[1][kDTiles][4],
                                                    const float (&lse)[1][2], const FwdParams& p,
                                                    int seqlen_q, u16* o_ptr, float* lse_ptr,
                                                    int row_base, int lane) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = frag_row(row_base, 0, 2 * h, lane);
    if (row >= seqlen_q) continue;
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
      const int col = frag_col(0, dt, 0, lane);
      if (col < p.head_dim)
        *reinterpret_cast<u32*>(o_ptr + row * p.o_row_stride + col) =
            pack2<kDtype>(o[0][dt][2 * h], o[0][dt][2 * h + 1]);
    }
  }
  if (p.lse) write_lse(lse, seqlen_q, lse_ptr, row_base, lane);  // lse asked for
}

}  // namespace cufa
