// The fp8 forward's V, transposed: fp8 wgmma reads both operands K-major, so O += P V needs
// V as (d, keys) rows (vt_layout.cuh: the layout, padded and packed). Each (sequence, KV
// head)'s V (keys, d) becomes its rows of vt, zeros past the sequence up to its last key
// block's end, with the keys of every 32-key step in the order the P operand's registers
// hold them (vt_key_of): S's accumulators then pack into P's e4m3 A fragments without
// shuffles between lanes. A CTA turns a tile of 64 keys x 64 dims through shared memory:
// 16-byte reads along d, 16-byte writes along the keys.
#include "vt_layout.cuh"

namespace cufa {

struct TransposeVParams {
  u64 v, vt;
  i64 v_batch_stride, v_row_stride, v_head_stride;  // (elements: bytes)
  int batch, seqlen, nheads_k, head_dim;
  int padded_seqlen;  // vt's keys a row (padded batches: seqlen rounded up to key blocks;
                      // packed: vt_packed_keys)
  u64 cu_seqlens_k;   // packed batches: int32 (batch + 1,); 0 for padded ones
  u64 seqused_k;      // packed batches: int32 (batch,) keys used of each, or 0 for all
};

// -- packed batches: sequence b's first key in k, clamped to k's rows as the forward's
//    get_tile clamps it (so both find its region of vt at the same start) --
__device__ __forceinline__ int packed_key_start(const int* cu, int b, int total) {
  return min(max(cu[b], 0), total);
}

// -- packed batches: the sequence whose region of vt's keys holds column `column` (the last
//    b whose region starts at or before it: the starts rise with b) --
__device__ __forceinline__ int vt_sequence_of(const int* cu, int batch, int total, int column) {
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (vt_sequence_start(packed_key_start(cu, mid, total), mid) <= column) lo = mid; else hi = mid - 1;
  }
  return lo;
}

constexpr int kVtTileKeys = 64, kVtTileDims = 64;

// grid: (padded_seqlen / 64 * pairs, head_dim / 64 rounded up), the pairs (padded batches:
// (sequence, KV head); packed: KV heads) and their key tiles in x, whose limit is 2^31 - 1
// (z's is 65535, under what batch * nheads_k may reach); 256 threads
__global__ void __launch_bounds__(256) transpose_v_e4m3(const TransposeVParams p) {
  __shared__ __align__(16) u8 tile[kVtTileKeys][kVtTileDims + 16];  // (+16: no bank conflicts down a column)
  const int key_tiles = p.padded_seqlen / kVtTileKeys;
  const int pair = blockIdx.x / key_tiles;
  const int column0 = (blockIdx.x % key_tiles) * kVtTileKeys, dim0 = blockIdx.y * kVtTileDims;
  const u8* v = reinterpret_cast<const u8*>(p.v);
  // (the tile's first key of its sequence; the keys copied, zeros from there on)
  int key0 = column0, seqlen = p.seqlen;
  if (p.cu_seqlens_k) {
    const int* cu = reinterpret_cast<const int*>(p.cu_seqlens_k);
    const int b = vt_sequence_of(cu, p.batch, p.seqlen, column0);
    const int k0 = packed_key_start(cu, b, p.seqlen);
    const int length = min(max(cu[b + 1], k0), p.seqlen) - k0;  // (as get_tile's)
    key0 = column0 - static_cast<int>(vt_sequence_start(k0, b));
    if (key0 >= (length + kVtBlockKeys - 1) / kVtBlockKeys * kVtBlockKeys)
      return;  // (between two sequences' regions: never read; the whole CTA leaves)
    // Keys past seqused_k are zeros too: the forward's last block reads up to the next 128
    // from there, and P = 0 times a NaN byte of V would be NaN.
    seqlen = p.seqused_k ? min(max(reinterpret_cast<const int*>(p.seqused_k)[b], 0), length)
                         : length;
    v += static_cast<i64>(k0) * p.v_row_stride + pair * p.v_head_stride;
  } else {
    v += (pair / p.nheads_k) * p.v_batch_stride + (pair % p.nheads_k) * p.v_head_stride;
  }
  // -- in: 64 keys x 4 chunks of 16 dims, one chunk a thread; zeros past the sequence or
  //    the head dim (whole 16-byte chunks: the host takes head dims of 16s) --
  {
    const int r = threadIdx.x / 4, c = threadIdx.x % 4;
    const int key = key0 + r, dim = dim0 + 16 * c;
    uint4 x = make_uint4(0, 0, 0, 0);
    if (key < seqlen && dim < p.head_dim)
      x = *reinterpret_cast<const uint4*>(v + key * p.v_row_stride + dim);
    *reinterpret_cast<uint4*>(&tile[r][16 * c]) = x;
  }
  __syncthreads();
  // -- out: 64 dims x 4 chunks of 16 keys, the keys of each 32-key step permuted --
  {
    const int d = threadIdx.x / 4, c = threadIdx.x % 4;
    if (dim0 + d >= p.head_dim) return;
    u32 words[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      u32 word = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int k = 16 * c + 4 * w + j;  // (vt's column within the tile)
        const int key = (k / 32) * 32 + vt_key_of(k % 32);
        word |= static_cast<u32>(tile[key][d]) << (8 * j);
      }
      words[w] = word;
    }
    u8* vt = reinterpret_cast<u8*>(p.vt) +
             (static_cast<i64>(pair) * p.head_dim + dim0 + d) * p.padded_seqlen + column0 + 16 * c;
    *reinterpret_cast<uint4*>(vt) = make_uint4(words[0], words[1], words[2], words[3]);
  }
}

}  // namespace cufa
