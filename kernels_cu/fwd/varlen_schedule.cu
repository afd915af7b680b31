// The work list of a packed (varlen) batch: one entry (sequence, query block) per real
// tile, so the forward launch spends nothing on padding, ordered longest sequence first
// and, within a sequence, last query block first (under causal masks the heaviest), so
// long sequences start early instead of finishing last. One CTA, no host round trip.
//
// A counting sort by block count: sequences with n query blocks get consecutive slots
// after all sequences with more blocks. The order among sequences of equal length
// follows atomics; every tile is computed independently, so results do not depend on it.
// A paged batch's decode-sized sequences (the decode kernel's) are ordered too: by keys.
#include "params.cuh"

namespace cufa {

__device__ __forceinline__ int query_rows(const int* cu_seqlens_q, int b, int total_q) {
  const int q0 = min(max(cu_seqlens_q[b], 0), total_q);  // clamped as in get_tile
  return min(max(cu_seqlens_q[b + 1], q0), total_q) - q0;
}

__device__ __forceinline__ int query_blocks(const int* cu_seqlens_q, int b, int total_q,
                                            int block_m, int decode_rows) {
  const int rows = query_rows(cu_seqlens_q, b, total_q);
  if (rows <= decode_rows) return 0;  // none, or the decode kernel's (cache_seq there)
  return (rows + block_m - 1) / block_m;
}

constexpr int kKeyBuckets = 128;  // the host picks key_shift so capacity >> key_shift < this

// Longest decode first: under a thousand (sequence, KV head) CTAs of 1-8k keys each, the
// ones left running at the end are then the short ones (the serving step's decodes on an
// H100: 836 -> 785 us, docs/decisions.md). Sequences of equal bucket follow atomics.
__device__ void order_decodes(const ScheduleParams& p) {
  __shared__ int count[kKeyBuckets], first[kKeyBuckets], decodes;
  const int* cu_q = reinterpret_cast<const int*>(p.cu_seqlens_q);
  const int* cu_k = reinterpret_cast<const int*>(p.cu_seqlens_k);
  const int* used = reinterpret_cast<const int*>(p.seqused_k);
  int* order = reinterpret_cast<int*>(p.decode_order);
  const auto bucket = [&](int b) {  // -1: not the decode kernel's
    const int rows = query_rows(cu_q, b, p.total_q);
    if (rows == 0 || rows > p.decode_rows) return -1;
    const int keys = min(max(used ? used[b] : cu_k[b + 1] - cu_k[b], 0), p.capacity);
    return min(keys >> p.key_shift, kKeyBuckets - 1);
  };
  for (int i = threadIdx.x; i < kKeyBuckets; i += blockDim.x) count[i] = 0;
  __syncthreads();
  for (int b = threadIdx.x; b < p.batch; b += blockDim.x) {
    const int n = bucket(b);
    if (n >= 0) atomicAdd(&count[n], 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int slot = 0;
    for (int n = kKeyBuckets - 1; n >= 0; --n) {
      first[n] = slot;
      slot += count[n];
    }
    decodes = slot;
  }
  __syncthreads();
  for (int b = threadIdx.x; b < p.batch; b += blockDim.x) {
    const int n = bucket(b);
    if (n >= 0) order[atomicAdd(&first[n], 1)] = b;
  }
  for (int i = decodes + threadIdx.x; i < p.batch; i += blockDim.x) order[i] = -1;
}

extern "C" __global__ void varlen_schedule(const ScheduleParams p) {
  const int* cu_seqlens_q = reinterpret_cast<const int*>(p.cu_seqlens_q);
  const int batch = p.batch, total_q = p.total_q, block_m = p.block_m;
  const int num_buckets = p.num_buckets, decode_rows = p.decode_rows;
  int* scratch = reinterpret_cast<int*>(p.scratch);
  int2* tile_list = reinterpret_cast<int2*>(p.tile_list);
  int* tile_count = reinterpret_cast<int*>(p.tile_count);
  int* tile_counter = reinterpret_cast<int*>(p.tile_counter);
  int* count = scratch;                    // sequences with n blocks
  int* taken = scratch + num_buckets;      // of those, placed so far
  int* first = scratch + 2 * num_buckets;  // first slot of the sequences with n blocks
  for (int i = threadIdx.x; i < num_buckets; i += blockDim.x) count[i] = taken[i] = 0;
  if (threadIdx.x < 2 && tile_counter) tile_counter[threadIdx.x] = 0;
  __syncthreads();
  for (int b = threadIdx.x; b < batch; b += blockDim.x)
    atomicAdd(&count[query_blocks(cu_seqlens_q, b, total_q, block_m, decode_rows)], 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    int slot = 0;
    for (int n = num_buckets - 1; n > 0; --n) {
      first[n] = slot;
      slot += count[n] * n;
    }
    *tile_count = slot;
  }
  __syncthreads();
  for (int b = threadIdx.x; b < batch; b += blockDim.x) {
    const int n = query_blocks(cu_seqlens_q, b, total_q, block_m, decode_rows);
    if (n == 0) continue;
    const int base = first[n] + atomicAdd(&taken[n], 1) * n;
    for (int j = 0; j < n; ++j) tile_list[base + j] = int2{b, n - 1 - j};
  }
  if (p.decode_order) order_decodes(p);
}

}  // namespace cufa
