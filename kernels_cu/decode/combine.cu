// decode_combine: the splits of split-KV merged by their lse in a launch of their own,
// where the decode launch does not merge them itself (merge_if_last).
#include "split_merge.cuh"

namespace cufa {

// grid: (ceil(batch * seqlen_q * nheads / kRows), the row's slices); kRows rows of
// 128 / kRows threads a CTA. kElementIO: the partials of the element-wise decode variant,
// stored an element at a time. kSliceCols: a CTA merges that many columns of a row (a CTA
// a row), 0 all of them (split_merge.cuh).
template <int kDtype, int kRows, bool kElementIO = false, int kSliceCols = 0>
__global__ void __launch_bounds__(kCombineThreads) decode_combine(const DecodeParams p) {
  static_assert(kRows == 1 || kRows == kCombineThreads / 32, "a CTA a row, or a warp a row");
  static_assert(kSliceCols == 0 || kRows == 1, "slices of a row a CTA");
  constexpr int kRowThreads = kCombineThreads / kRows;
  __shared__ float weight[kRows][kMaxSplits];
  __shared__ float partial[kCombineThreads * 8];
  __shared__ float warp_value[kCombineThreads / 32];
  const int slot = threadIdx.x / kRowThreads, tid = threadIdx.x % kRowThreads;
  // (b, t, h) in o_partial's order; the host keeps the row count below 2^31. The returns
  // below leave a whole CTA (a CTA a row) or a whole warp (a warp a row, which then meets
  // no CTA barrier).
  const int row = blockIdx.x * kRows + slot;
  if (row >= p.batch * p.seqlen_q * p.nheads) return;
  const int h = row % p.nheads, t = (row / p.nheads) % p.seqlen_q, b = row / (p.nheads * p.seqlen_q);
  // The row's reads go out before cache_seq's, so that it waits about one memory latency,
  // not one for cache_seq, then one for the partials. (Rows that cache_seq then skips read
  // partials nobody wrote, inside the workspace, and drop them.)
  const SplitRow in = load_split_row<kRows, kElementIO, kSliceCols>(p, b, t, h, tid);
  const CacheSeq s = cache_seq(p, b);
  // (a packed batch: past this sequence's rows, or a sequence the forward kernel takes,
  // the same test as decode_kernel's)
  if (t >= s.seqlen_q || s.seqlen_q > p.seqlen_q) return;
  merge_split_row<kDtype, kRows, kElementIO, kSliceCols>(
      p, in, s.q_row0, tid, weight[slot], partial + slot * kRowThreads * 8, warp_value);
}

}  // namespace cufa
