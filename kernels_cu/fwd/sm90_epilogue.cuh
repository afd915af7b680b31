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
//    area (common/sm90.cuh's store_rows_staged). Straight from registers: 7-13 % slower on
//    short sequences at d = 128. At d = 64 the direct stores measured 2-3 % faster (the Q
//    stage is then released at the last Q K^T, not after the epilogue) --
template <int kHeadDim>
constexpr bool kStagedOutput = kHeadDim >= 128;

// head_dim_v: O's columns in the array (where V has Q's head dim, p.head_dim);
// stage: the staging area's base, whose panels are kPanelRows rows; stage_row0: this
// warp's first row in it; row_base: the warp's first row in the sequence. O goes out in
// passes of kPassColumns (the whole head dim where the area holds it; d = 256 staged in
// a K stage: two of 128, each warp's rows written and read back before the next)
template <int kDtype, int kPanelRows, int kPassColumns, int kHeadDim, int kDTiles>
__device__ __forceinline__ void write_output_staged(const float (&o)[1][kDTiles][4],
                                                    const float (&lse)[1][2], const FwdParams& p,
                                                    int seqlen_q, const int& head_dim_v, u16* o_ptr,
                                                    float* lse_ptr, u32 stage, int stage_row0,
                                                    int row_base, int lane) {
  store_rows_staged<kDtype, kPanelRows, kPassColumns, kHeadDim>(
      o, o_ptr, p.o_row_stride, seqlen_q, head_dim_v, stage, stage_row0, row_base, lane);
  if (p.lse) write_lse(lse, seqlen_q, lse_ptr, row_base, lane);  // lse asked for
}

template <int kDtype, int kDTiles>
__device__ __forceinline__ void write_output_direct(const float (&o)[1][kDTiles][4],
                                                    const float (&lse)[1][2], const FwdParams& p,
                                                    int seqlen_q, const int& head_dim_v, u16* o_ptr,
                                                    float* lse_ptr, int row_base, int lane) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = frag_row(row_base, 0, 2 * h, lane);
    if (row >= seqlen_q) continue;
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
      const int col = frag_col(0, dt, 0, lane);
      if (col < head_dim_v)
        *reinterpret_cast<u32*>(o_ptr + row * p.o_row_stride + col) =
            pack2<kDtype>(o[0][dt][2 * h], o[0][dt][2 * h + 1]);
    }
  }
  if (p.lse) write_lse(lse, seqlen_q, lse_ptr, row_base, lane);  // lse asked for
}

}  // namespace cufa
