#pragma once
// The fp8 forward's V^T (transpose_v_e4m3 writes it, the forward's producer reads it):
// rows of head-dim entries over keys, each 32-key step in P's register order (vt_key_of).
// Padded batches: (batch, nheads_k, d, keys padded to kVtBlockKeys). Packed batches:
// (nheads_k, d, vt_packed_keys) with sequence b's keys from vt_sequence_start: 128-aligned,
// so a key block never straddles two sequences, and past each sequence's end up to its
// next block boundary there is room (zeros) before the next one starts:
// start_{b+1} - start_b = 128 (floor(cu[b+1] / 128) - floor(cu[b] / 128) + 1), at least
// len_b rounded up to 128.
#include "../common/types.cuh"

namespace cufa {

constexpr int kVtBlockKeys = 128;  // the fp8 forward's key block (FP8_TILES)

__device__ __forceinline__ i64 vt_sequence_start(i64 k_start, int b) {
  return kVtBlockKeys * (k_start / kVtBlockKeys + b);
}

// Column k of a 32-key step of vt holds key vt_key_of(k) of the step: the P operand's
// k-index 4t + i (t = lane % 4) is the score accumulator's key 8 (i / 2) + 2t + i % 2, and
// k-index 16 + 4t + i is 16 past that (cufa/_fp8.py's vt_key_of mirrors it).
__device__ __forceinline__ int vt_key_of(int k) {
  const int half = k / 16, t = (k % 16) / 4, i = k % 4;
  return 16 * half + 8 * (i / 2) + 2 * t + i % 2;
}

}  // namespace cufa
