#pragma once
// The fp8 forward's V^T (transpose_v_e4m3 writes it, the forward's producer reads it):
// rows of head-dim entries over keys, each 32-key step in P's register order (vt_key_of).
// Padded batches: (batch, nheads_k, d, keys padded to the kernel's key block). Packed
// batches: (nheads_k, d, vt_packed_keys) with sequence b's keys from vt_sequence_start:
// 64-aligned (a box's start), and each region at least its keys rounded up to 64, plus
// 128: room for the sequence's last key block (128 or 192 keys) before the next region,
// zeros past its keys:
// start_{b+1} - start_b = 64 (floor(cu[b+1] / 64) - floor(cu[b] / 64) + 3).
#include "../common/types.cuh"

namespace cufa {

constexpr int kVtPanelKeys = 128;  // a V^T box: 128 keys, one 128-byte panel a row
constexpr int kVtAlignKeys = 64;   // packed regions start on these (cufa/_fp8.py's VT_ALIGN)
constexpr int kVtGapAligns = 3;    // and are kVtGapAligns - 1 aligns longer than their keys

__device__ __forceinline__ i64 vt_sequence_start(i64 k_start, int b) {
  return kVtAlignKeys * (k_start / kVtAlignKeys + static_cast<i64>(kVtGapAligns) * b);
}

// Column k of a 32-key step of vt holds key vt_key_of(k) of the step: the P operand's
// k-index 4t + i (t = lane % 4) is the score accumulator's key 8 (i / 2) + 2t + i % 2, and
// k-index 16 + 4t + i is 16 past that (cufa/_fp8.py's vt_key_of mirrors it).
__device__ __forceinline__ int vt_key_of(int k) {
  const int half = k / 16, t = (k % 16) / 4, i = k % 4;
  return 16 * half + 8 * (i / 2) + 2 * t + i % 2;
}

}  // namespace cufa
