#pragma once
// Which keys a query sees. Causal is the window (unbounded, 0); both are one
// predicate, so the kernels carry a single compile-time mask kind.
#include "block_info.cuh"

namespace cufa {

enum MaskKind { MASK_NONE = 0, MASK_WINDOW = 1 };

// A window side this large is unbounded (api._UNBOUNDED): no sequence the int32
// params hold is that long.
constexpr int kUnboundedWindow = 1 << 30;

struct KeyRange {
  int begin, end;  // keys [begin, end) that some row of the query block sees
};

template <int kMask>
__device__ __forceinline__ KeyRange key_range(const FwdParams& p, const Tile& t, int row_begin,
                                              int row_end) {
  KeyRange r{0, t.seqlen_k};
  if (kMask == MASK_WINDOW) {
    i64 lo = (i64)row_begin + t.diag_offset - p.window_left;
    i64 hi = (i64)(row_end - 1) + t.diag_offset + p.window_right + 1;
    r.begin = (int)max((i64)0, min(lo, (i64)t.seqlen_k));
    r.end = (int)max((i64)r.begin, min(hi, (i64)t.seqlen_k));
  }
  return r;
}

// True when some (row, key) pair of the block is not visible, so the block
// needs the per-element predicate; interior blocks skip it.
template <int kMask>
__device__ __forceinline__ bool block_needs_mask(const FwdParams& p, const Tile& t, int row_begin,
                                                 int row_end, int key_begin, int key_end) {
  if (key_end > t.seqlen_k) return true;
  if (kMask == MASK_WINDOW) {
    i64 lowest_hi = (i64)row_begin + t.diag_offset + p.window_right;   // first row's last key
    i64 highest_lo = (i64)(row_end - 1) + t.diag_offset - p.window_left;  // last row's first key
    if (lowest_hi < key_end - 1 || highest_lo > key_begin) return true;
  }
  return false;
}

// Keys [begin, end) one query row sees.
template <int kMask>
__device__ __forceinline__ KeyRange row_keys(const FwdParams& p, const Tile& t, int row) {
  return key_range<kMask>(p, t, row, row + 1);
}

// The same in 32 bits, the window's sums saturating: row + diag_offset fits (a tile's
// rows end at most 191 past seqlen_q, and diag_offset is seqlen_k - seqlen_q or 0), and
// a side that saturates lies beyond 0 or seqlen_k, where the clamps take it anyway. (The
// fp8 forward at d = 256 keeps S, P and O in registers at once; with the 64-bit bounds
// its window variant spilled 20 bytes.)
__device__ __forceinline__ int add_sat(int a, int b) {
  int r;
  asm("add.sat.s32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
template <int kMask>
__device__ __forceinline__ KeyRange row_keys_32(const FwdParams& p, const Tile& t, int row) {
  KeyRange r{0, t.seqlen_k};
  if (kMask == MASK_WINDOW) {
    const int diagonal =
        static_cast<int>(static_cast<unsigned>(row) + static_cast<unsigned>(t.diag_offset));
    r.begin = max(0, min(add_sat(diagonal, -p.window_left), t.seqlen_k));
    r.end = max(r.begin, min(add_sat(add_sat(diagonal, p.window_right), 1), t.seqlen_k));
  }
  return r;
}

}  // namespace cufa
