// Backward attention on the Ampere instruction set (mma.sync, ldmatrix, cp.async), on
// sm_80 and every later GPU. Three launches, no atomics on the gradients (so dq, dk and
// dv are the same bits on every run):
//   preprocess  D = rowsum(dout * out), in lse's layout (and the sink's gradient);
//   dq          one CTA a (sequence, head, query block), as the forward's tiles: streams the
//               key blocks, recomputes P = exp(S - lse), dS = P (dP - D), dq += dS K;
//   dk, dv      one CTA a (sequence, KV head, key block): streams the query blocks of every
//               query head of the group, in the transposed products (S^T = K Q^T), so
//               dv += P^T dout and dk += dS^T Q take P^T and dS^T straight from the
//               accumulators, as the forward's P V takes P.
// S and dP are recomputed in both of the last two (seven products where an atomic dq would
// take five), the price of determinism without a float32 dq buffer.
#include "../common/softmax.cuh"
#include "common.cuh"

namespace cufa {

template <int kRows, int kHeadDim>
__device__ __forceinline__ void load_rows(u32 smem, const u16* gmem, i64 row_stride,
                                          int rows_valid, int head_dim) {
  copy_tile_async<kRows, kHeadDim, kBwdThreads>(
      smem, gmem, row_stride, rows_valid, head_dim,
      [](int r, int c) { return Swizzle<kHeadDim>::offset(r, c); });
}

// ---------------------------------------------------------------------------------------
// preprocess: D = rowsum(dout * out) for every (row, head) (less lse's gradient, where
// given), and the sink's gradient dsink_h = -sum_rows exp(sink_h - lse) * D (a row's output
// falls by its sink's share as the sink grows). A CTA of 8 warps takes 128 rows of one head.
// A row is read in 16-byte pieces (the backward's alignment rule) by the fewest lanes that
// cover it in one pass, so a warp takes several short rows at once: one lane a row with a
// loop of dependent reductions left the small head dims latency-bound (d = 64 took 2x d =
// 128's time on an H200). 32 lanes cover 256, the backward's widest head; a loop for wider
// rows cost 14 registers. With dq fused, the CTAs also zero its float32 sums, a share each
// (a memset of its own took another pass over the same bytes: 30 us of a d = 128 call of
// 16k tokens on an H200).
__device__ __forceinline__ int lanes_per_row(int head_dim) {
  int lanes = 32;
  while (lanes > 1 && (lanes / 2) * 8 >= head_dim) lanes /= 2;
  return lanes;
}

template <int kDtype>
__device__ __forceinline__ float dot8(const uint4& a, const uint4& b) {
  const u16* x = reinterpret_cast<const u16*>(&a);
  const u16* y = reinterpret_cast<const u16*>(&b);
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) sum += to_float<kDtype>(x[j]) * to_float<kDtype>(y[j]);
  return sum;
}

// rows [first, rows) of a gradient (heads of row_stride / head_stride elements each,
// head_dim of them written) as zeros, 16 bytes a thread over the launch
__device__ __forceinline__ void zero_rows(u64 grad, i64 row_stride, i64 head_stride, int first,
                                          int rows, int heads, int head_dim) {
  const int chunks = head_dim / 8;
  const i64 count = static_cast<i64>(max(rows - first, 0)) * heads * chunks;
  for (i64 i = static_cast<i64>(blockIdx.x) * 256 + threadIdx.x; i < count;
       i += static_cast<i64>(gridDim.x) * 256) {
    const i64 row_head = i / chunks, row = first + row_head / heads;
    u16* at = reinterpret_cast<u16*>(grad) + row * row_stride + (row_head % heads) * head_stride;
    *reinterpret_cast<uint4*>(at + (i % chunks) * 8) = make_uint4(0, 0, 0, 0);
  }
}

// A CTA takes 8 * kPreprocessRowsPerWarp rows of one head (the host's grid: _bwd_plan)
enum : int { kPreprocessRowsPerWarp = 16, kPassesInFlight = 4 };

template <int kDtype>
__global__ void __launch_bounds__(256) bwd_preprocess_kernel(const FwdParams p, const BwdParams g) {
  constexpr int kRowsPerWarp = kPreprocessRowsPerWarp, kRowsPerCta = 8 * kRowsPerWarp;
  const int h = blockIdx.x % p.nheads;
  const i64 first_row = (i64)(blockIdx.x / p.nheads) * kRowsPerCta;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int lanes = lanes_per_row(p.head_dim), rows_at_once = 32 / lanes;
  const int sub_row = lane / lanes, first_col = (lane % lanes) * 8;
  const float sink = load_sink(p.learnable_sink, p.sink_dtype, h);
  float dsink = 0.f;
  if (g.tile_counter && blockIdx.x == 0 && threadIdx.x == 0)
    *reinterpret_cast<int*>(g.tile_counter) = 0;
  if (g.dq_accum) {
    float* sums = reinterpret_cast<float*>(g.dq_accum);
    for (i64 i = static_cast<i64>(blockIdx.x) * 256 + threadIdx.x; i < g.dq_accum_floats / 4;
         i += static_cast<i64>(gridDim.x) * 256)
      reinterpret_cast<float4*>(sums)[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (blockIdx.x == 0 && threadIdx.x < g.dq_accum_floats % 4)
      sums[g.dq_accum_floats - 1 - threadIdx.x] = 0.f;
  }
  // a packed batch's rows past its last sequence (of q, and of k and v): no output reads
  // them, so their gradients are zeros, which the dq and dk/dv kernels (the sequences'
  // rows alone) leave to this launch (seqlen_q, seqlen_k: the tensors' rows)
  if (p.cu_seqlens_q) {
    const int* cu_q = reinterpret_cast<const int*>(p.cu_seqlens_q);
    const int* cu_k = reinterpret_cast<const int*>(p.cu_seqlens_k);
    const int end_q = min(max(cu_q[p.batch], 0), p.seqlen_q);
    const int end_k = min(max(cu_k[p.batch], 0), p.seqlen_k);
    zero_rows(g.dq, g.dq_row_stride, g.dq_head_stride, end_q, p.seqlen_q, p.nheads, p.head_dim);
    zero_rows(g.dk, g.dk_row_stride, g.dk_head_stride, end_k, p.seqlen_k, p.nheads_k, p.head_dim);
    zero_rows(g.dv, g.dv_row_stride, g.dv_head_stride, end_k, p.seqlen_k, p.nheads_k, p.head_dim);
  }
  // (every lane runs every pass: the reductions' shuffles take the whole warp). A warp's
  // passes go kPassesInFlight at a time, their 16-byte pieces loaded before any is
  // reduced, so that each thread has several loads in flight (one pass at a time left
  // the preprocess at ~3.3 TB/s on an H200)
  auto row_of = [&](int i0, int j, int& b, int& row) {  // (false: past the warp's rows)
    const int in_warp = i0 + j * rows_at_once + sub_row;
    const i64 r = first_row + warp * kRowsPerWarp + in_warp;
    const bool valid = in_warp < kRowsPerWarp && r < g.rows;
    b = valid ? static_cast<int>(r / p.seqlen_q) : 0;
    row = valid ? static_cast<int>(r % p.seqlen_q) : 0;
    return valid;
  };
  auto piece = [&](u64 base, i64 batch_stride, i64 row_stride, i64 head_stride, int b, int row,
                   int col) {
    return *reinterpret_cast<const uint4*>(reinterpret_cast<const u16*>(base) + b * batch_stride +
                                           row * row_stride + h * head_stride + col);
  };
  for (int i0 = 0; i0 < kRowsPerWarp; i0 += kPassesInFlight * rows_at_once) {
    uint4 o_piece[kPassesInFlight], dout_piece[kPassesInFlight];
#pragma unroll
    for (int j = 0; j < kPassesInFlight; ++j) {
      int b, row;
      o_piece[j] = dout_piece[j] = make_uint4(0, 0, 0, 0);
      if (row_of(i0, j, b, row) && first_col < p.head_dim) {
        o_piece[j] = piece(p.o, p.o_batch_stride, p.o_row_stride, p.o_head_stride, b, row,
                           first_col);
        dout_piece[j] = piece(g.dout, g.dout_batch_stride, g.dout_row_stride,
                              g.dout_head_stride, b, row, first_col);
      }
    }
#pragma unroll
    for (int j = 0; j < kPassesInFlight; ++j) {
      int b, row;
      const bool valid = row_of(i0, j, b, row);
      float sum = dot8<kDtype>(o_piece[j], dout_piece[j]);
      for (int s = lanes / 2; s > 0; s >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, s);
      if (valid && lane % lanes == 0) {
        const i64 at = b * p.lse_batch_stride + h * p.lse_head_stride + row;
        if (g.dlse) sum -= reinterpret_cast<const float*>(g.dlse)[at];
        reinterpret_cast<float*>(g.softmax_d)[at] = sum;
        if (g.dsink && sum != 0.f)  // (a row without keys: lse = sink, out 0, nothing to add)
          dsink -= __expf(sink - reinterpret_cast<const float*>(p.lse)[at]) * sum;
      }
    }
  }
  if (!g.dsink) return;
#pragma unroll
  for (int s = 16; s > 0; s >>= 1) dsink += __shfl_xor_sync(0xffffffffu, dsink, s);
  __shared__ float warp_sums[8];
  if (lane == 0) warp_sums[warp] = dsink;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.f;
    for (int w = 0; w < 8; ++w) total += warp_sums[w];
    atomicAdd(reinterpret_cast<float*>(g.dsink) + h, total);
  }
}

// ---------------------------------------------------------------------------------------
// dq: the forward's tile (get_tile over FwdParams: the padded grid, or the work list of
// query blocks), its key blocks in order through kStages K/V buffers: with two, the next
// block's copy runs under this block's products.
template <int kDtype, int kHeadDim, int kMask, bool kScoreMods, int kBlockM, int kBlockN,
          int kStages>
__global__ void __launch_bounds__(kBwdThreads, 1) bwd_dq_kernel(const FwdParams p, const BwdParams g) {
  constexpr int kMTiles = kBlockM / (16 * kBwdWarps);
  constexpr int kNTiles = kBlockN / 8;
  constexpr int kDTiles = kHeadDim / 8;
  constexpr int kTileBytes = kBlockN * kHeadDim * 2;  // one K or V block
  static_assert(kMTiles * 16 * kBwdWarps == kBlockM && kNTiles % 2 == 0, "tile shape");
  static_assert(kStages == 1 || kStages == 2, "one or two K/V buffers");
  extern __shared__ __align__(128) unsigned char smem[];
  u16* sQ = reinterpret_cast<u16*>(smem);
  u16* sdO = sQ + kBlockM * kHeadDim;
  u16* sKV = sdO + kBlockM * kHeadDim;  // stage s: K at s * 2 tiles, V after it

  Tile t;
  if (!get_tile(p, static_cast<int>(blockIdx.x), t)) return;
  const int row0 = t.m_block * kBlockM;
  const int row_end = min(row0 + kBlockM, t.seqlen_q);
  const int lane = threadIdx.x % 32;
  const int warp_row0 = (threadIdx.x / 32) * kMTiles * 16;
  const TilePointers ptr = tile_pointers(p, t);
  const i64 q_row = t.q_start + row0;
  const u16* dout = reinterpret_cast<const u16*>(g.dout) + t.b * g.dout_batch_stride +
                    t.h * g.dout_head_stride + q_row * g.dout_row_stride;
  u16* dq = reinterpret_cast<u16*>(g.dq) + t.b * g.dq_batch_stride + t.h * g.dq_head_stride +
            q_row * g.dq_row_stride;
  const TileMods mods = tile_mods<kScoreMods>(p, t);

  // this lane's rows' lse (log2 units) and D
  const float* lse = reinterpret_cast<const float*>(p.lse) + row_stats_offset(p, t);
  const float* dsum_of = reinterpret_cast<const float*>(g.softmax_d) + row_stats_offset(p, t);
  float lse_log2[kMTiles][2], dsum[kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = frag_row(row0 + warp_row0, mt, 2 * h, lane);
      lse_log2[mt][h] = lse_log2_of(lse, row, t.seqlen_q);
      dsum[mt][h] = row < t.seqlen_q ? dsum_of[row] : 0.f;
    }

  float acc_dq[kMTiles][kDTiles][4];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_dq[mt][dt][e] = 0.f;

  const KeyRange keys = key_range<kMask>(p, t, row0, row_end);
  const int n_block_min = keys.begin / kBlockN;
  const int n_block_max = (keys.end + kBlockN - 1) / kBlockN;
  const u32 sq = smem_u32(sQ), sdo = smem_u32(sdO), skv = smem_u32(sKV);
  // A operands: this warp's rows of Q and dout
  const LdmatrixAddr<kHeadDim> q_frag(sq + warp_row0 * (kHeadDim / 8) * 16, lane & 15, lane >> 4);
  const LdmatrixAddr<kHeadDim> do_frag(sdo + warp_row0 * (kHeadDim / 8) * 16, lane & 15, lane >> 4);
  const auto load_kv = [&](int step, int stage) {  // (step: key block n_block_min + step)
    const int key0 = (n_block_min + step) * kBlockN;
    const u32 sk = skv + stage * 2 * kTileBytes;
    load_rows<kBlockN, kHeadDim>(sk, ptr.k + key0 * p.k_row_stride, p.k_row_stride,
                                 t.seqlen_k - key0, p.head_dim);
    load_rows<kBlockN, kHeadDim>(sk + kTileBytes, ptr.v + key0 * p.v_row_stride, p.v_row_stride,
                                 t.seqlen_k - key0, p.head_dim);
    cp_async_commit();
  };
  if (n_block_min < n_block_max) {  // (Q and dout in the first block's copy group)
    load_rows<kBlockM, kHeadDim>(sq, ptr.q + row0 * p.q_row_stride, p.q_row_stride,
                                 t.seqlen_q - row0, p.head_dim);
    load_rows<kBlockM, kHeadDim>(sdo, dout, g.dout_row_stride, t.seqlen_q - row0, p.head_dim);
    load_kv(0, 0);
  }
  int stage = 0;
  for (int nb = n_block_min; nb < n_block_max; ++nb) {
    const int key0 = nb * kBlockN;
    await_step<kStages>(nb - n_block_min, n_block_max - n_block_min, stage, load_kv);
    // B operands of the score products (key rows), and the transposed B of dS K
    const u32 sk = skv + stage * 2 * kTileBytes, sv = sk + kTileBytes;
    const LdmatrixAddr<kHeadDim> k_frag(sk, (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
    const LdmatrixAddr<kHeadDim> v_frag(sv, (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
    const LdmatrixAddr<kHeadDim> kt_frag(sk, (lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4);

    float s[kMTiles][kNTiles][4], dp[kMTiles][kNTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = dp[mt][nt][e] = 0.f;
    gemm_qk<kDtype>(s, q_frag, k_frag);
    gemm_qk<kDtype>(dp, do_frag, v_frag);

    // scores in log2 units (their derivatives kept where score mods change them), masked,
    // then dS = P (dP - D) times d(score)/d(raw score), in place of S
    float grad[kScoreMods ? kMTiles : 1][kScoreMods ? kNTiles : 1][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if constexpr (kScoreMods)
            s[mt][nt][e] = modded_score(s[mt][nt][e], p, t, mods,
                                        frag_row(row0 + warp_row0, mt, e, lane),
                                        frag_col(key0, nt, e, lane), grad[mt][nt][e]);
          else
            s[mt][nt][e] *= p.scale_log2;
        }
    if (block_needs_mask<kMask>(p, t, row0, row_end, key0, key0 + kBlockN))
      apply_mask<kMask>(s, p, t, row0 + warp_row0, key0, lane);
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float prob = fast_exp2(s[mt][nt][e] - lse_log2[mt][e >> 1]);
          const float ds = prob * (dp[mt][nt][e] - dsum[mt][e >> 1]);
          if (kScoreMods && g.dmask)
            add_mask_grad(g, t, frag_row(row0 + warp_row0, mt, e, lane),
                          frag_col(key0, nt, e, lane), ds);
          const float d_raw = kScoreMods ? grad[kScoreMods ? mt : 0][kScoreMods ? nt : 0][e] : p.scale;
          s[mt][nt][e] = ds * d_raw;
        }
    gemm_pv<kDtype>(acc_dq, s, kt_frag);
    __syncthreads();  // every warp is done with this block's K and V
    stage ^= kStages - 1;
  }
  store_rows<kDtype>(acc_dq, dq, g.dq_row_stride, warp_row0, t.seqlen_q - row0, p.head_dim, lane);
}

// ---------------------------------------------------------------------------------------
// dq fused into the key-block kernel: the step's dS^T (each warp's 16 keys x kBlockM
// queries, in its accumulators) into shared memory as kDtype, then this CTA's share of the
// step's dq tile, dS (kBlockM x kBlockN) K (kBlockN x head dim), each warp a quarter of
// the head dim's columns, added to g.dq_accum atomically. dS through ldmatrix.trans of its
// transposed rows (the A operand), K as P V's V (the B operand).
template <int kDtype, int kHeadDim, int kBlockM, int kBlockN, int kQTiles>
__device__ __forceinline__ void add_dq_share(const float (&ds_t)[1][kQTiles][4],
                                             unsigned char* s_ds, u32 sk, const BwdParams& g,
                                             const Tile& t, int q0, int seqlen_q, int head_dim,
                                             int warp_row0, int lane) {
  constexpr int kQMTiles = kBlockM / 16;
  constexpr int kCTiles = kHeadDim / kBwdWarps / 8;  // a warp's 8-column tiles of dq
  const int warp = threadIdx.x / 32;
#pragma unroll
  for (int nt = 0; nt < kQTiles; ++nt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int key = warp_row0 + (lane >> 2) + 8 * h;
      *reinterpret_cast<u32*>(s_ds + Swizzle<kBlockM>::offset(key, nt) + 4 * (lane & 3)) =
          pack2<kDtype>(ds_t[0][nt][2 * h], ds_t[0][nt][2 * h + 1]);
    }
  __syncthreads();  // every warp's keys in place
  float acc[kQMTiles][kCTiles][4];
#pragma unroll
  for (int mt = 0; mt < kQMTiles; ++mt)
#pragma unroll
    for (int ct = 0; ct < kCTiles; ++ct)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][ct][e] = 0.f;
  const LdmatrixAddr<kBlockM> ds_frag(smem_u32(s_ds), (lane & 7) + ((lane >> 4) << 3),
                                      (lane >> 3) & 1);
  // (K's addresses from the swizzle itself: LdmatrixAddr's per-lane bases indexed by this
  // warp's column pairs, a run-time index, would sit in local memory)
  const int k_row = (lane & 7) + (((lane >> 3) & 1) << 3), k_chunk = lane >> 4;
#pragma unroll
  for (int ks = 0; ks < kBlockN / 16; ++ks) {
    u32 a[kQMTiles][4];
#pragma unroll
    for (int mt = 0; mt < kQMTiles; ++mt) ldmatrix_x4_trans(a[mt], ds_frag.at(ks * 16, mt));
#pragma unroll
    for (int cp = 0; cp < kCTiles / 2; ++cp) {
      u32 b[4];
      ldmatrix_x4_trans(b, sk + Swizzle<kHeadDim>::offset(ks * 16 + k_row,
                                                         warp * kCTiles + 2 * cp + k_chunk));
#pragma unroll
      for (int mt = 0; mt < kQMTiles; ++mt) {
        mma_16816<kDtype>(acc[mt][2 * cp], a[mt], b[0], b[1]);
        mma_16816<kDtype>(acc[mt][2 * cp + 1], a[mt], b[2], b[3]);
      }
    }
  }
  float* dq = reinterpret_cast<float*>(g.dq_accum) + t.b * g.dq_accum_batch_stride +
              t.h * g.dq_accum_head_stride + (t.q_start + q0) * g.dq_accum_row_stride;
#pragma unroll
  for (int mt = 0; mt < kQMTiles; ++mt)
#pragma unroll
    for (int ct = 0; ct < kCTiles; ++ct)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = frag_row(0, mt, e, lane), col = frag_col(warp * kCTiles * 8, ct, e, lane);
        if (q0 + row < seqlen_q && col < head_dim)
          atomicAdd(dq + row * g.dq_accum_row_stride + col, acc[mt][ct][e]);
      }
}

// dq fused: g.dq_accum (float32) to dq in kDtype, an element a thread
template <int kDtype>
__global__ void __launch_bounds__(256) bwd_dq_convert_kernel(const FwdParams p, const BwdParams g) {
  const i64 i = static_cast<i64>(blockIdx.x) * 256 + threadIdx.x;
  if (i >= static_cast<i64>(g.rows) * p.nheads * p.head_dim) return;
  const int c = static_cast<int>(i % p.head_dim);
  const i64 row_head = i / p.head_dim;
  const int h = static_cast<int>(row_head % p.nheads);
  const i64 r = row_head / p.nheads;
  const i64 b = r / p.seqlen_q, row = r % p.seqlen_q;  // (packed: batch strides 0, b = 0)
  const float x = reinterpret_cast<const float*>(g.dq_accum)[
      b * g.dq_accum_batch_stride + row * g.dq_accum_row_stride + h * g.dq_accum_head_stride + c];
  reinterpret_cast<u16*>(g.dq)[b * g.dq_batch_stride + row * g.dq_row_stride +
                               h * g.dq_head_stride + c] =
      static_cast<u16>(pack2<kDtype>(x, 0.f) & 0xffffu);
}

// ---------------------------------------------------------------------------------------
// dk, dv: a key block of one KV head; each warp owns 16 of its keys. Sequence and key
// block from get_tile over the KV heads (the padded grid, or the work list of key blocks).
// The steps are (query head of the group, query block) pairs, their Q, dout, lse and D
// through kStages buffers: with two, the next step's copy runs under this step's products.
// kFusedDq: dq too, FlashAttention-2's way: each step's dS^T goes through shared memory,
// the CTA's 64 keys' share of the step's dq tile (dS K, the head dim split over the warps)
// is added to a float32 buffer atomically, and a last launch converts it (five products
// where the dq kernel makes it seven; not the same bits from run to run).
template <int kDtype, int kHeadDim, int kMask, bool kScoreMods, int kBlockM, int kGrads,
          int kStages, bool kFusedDq = false>
__global__ void __launch_bounds__(kBwdThreads, 1) bwd_dkdv_kernel(const FwdParams p, const BwdParams g) {
  constexpr int kBlockN = 16 * kBwdWarps;
  constexpr int kQTiles = kBlockM / 8;  // the transposed scores' columns: queries
  constexpr int kDTiles = kHeadDim / 8;
  constexpr bool kDk = kGrads != KV_DV, kDv = kGrads != KV_DK;
  // a stage: Q and dout (kBlockM rows each), then lse (log2 units) and D, a float a row
  constexpr int kTileBytes = kBlockM * kHeadDim * 2;
  constexpr int kStageBytes = 2 * kTileBytes + 8 * kBlockM;
  static_assert(kQTiles % 2 == 0, "tile shape");
  static_assert(kStages == 1 || kStages == 2, "one or two Q/dout buffers");
  static_assert(!kFusedDq || (kGrads == KV_BOTH && kBlockM >= 32 && kHeadDim % 64 == 0),
                "dq fused: both gradients, 32 query rows or more, 16 columns a warp");
  extern __shared__ __align__(128) unsigned char smem[];
  u16* sK = reinterpret_cast<u16*>(smem);
  u16* sV = sK + kBlockN * kHeadDim;
  unsigned char* stages = reinterpret_cast<unsigned char*>(sV + kBlockN * kHeadDim);

  // the tile of a KV head: get_tile over FwdParams as if the KV heads were the query heads
  Tile t;
  {
    FwdParams by_key = p;
    by_key.nheads = p.nheads_k;
    by_key.tile_list = g.kv_tile_list;
    by_key.tile_count = g.kv_tile_count;
    by_key.num_m_blocks = g.num_n_blocks;
    by_key.heads_per_group = 1;
    by_key.tail_group_head = p.batch * p.nheads_k;
    if (!get_tile(by_key, static_cast<int>(blockIdx.x), t)) return;
  }
  const int h_k = t.h;
  const int group = p.nheads / p.nheads_k;
  const int lane = threadIdx.x % 32;
  const int warp_row0 = (threadIdx.x / 32) * 16;
  // rows to write: every key of the sequence's block, those past seqused_k (which no query
  // sees) as zeros
  int rows_out = t.seqlen_k;
  if (p.cu_seqlens_k && p.seqused_k) {
    const int* cu_k = reinterpret_cast<const int*>(p.cu_seqlens_k);
    rows_out = min(max(cu_k[t.b + 1], 0), p.seqlen_k) - (int)t.k_start;
  }
  const int key0 = heaviest_first<kMask, kBlockN>(p, t.m_block, rows_out) * kBlockN;
  t.h = h_k * group;
  const TilePointers kv = tile_pointers(p, t);
  const i64 k_row = t.k_start + key0;

  float acc_dk[1][kDk ? kDTiles : 2][4], acc_dv[1][kDv ? kDTiles : 2][4];
#pragma unroll
  for (int dt = 0; dt < (kDk ? kDTiles : 2); ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dk[0][dt][e] = 0.f;
#pragma unroll
  for (int dt = 0; dt < (kDv ? kDTiles : 2); ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dv[0][dt][e] = 0.f;

  // the queries that see some key of the block
  const int key_end = min(key0 + kBlockN, t.seqlen_k);
  int q_begin = 0, q_end = key0 < t.seqlen_k ? t.seqlen_q : 0;
  if (kMask == MASK_WINDOW && q_end) {
    const i64 lo = (i64)key0 - t.diag_offset - p.window_right;
    const i64 hi = (i64)(key_end - 1) - t.diag_offset + p.window_left + 1;
    q_begin = (int)max((i64)0, min(lo, (i64)t.seqlen_q));
    q_end = (int)max((i64)q_begin, min(hi, (i64)t.seqlen_q));
  }
  const int m_block_min = q_begin / kBlockM;
  const int m_blocks = (q_end + kBlockM - 1) / kBlockM - m_block_min;
  const int steps = group * m_blocks;

  const u32 sk = smem_u32(sK), sv = smem_u32(sV), sstages = smem_u32(stages);
  const LdmatrixAddr<kHeadDim> k_frag(sk + warp_row0 * (kHeadDim / 8) * 16, lane & 15, lane >> 4);
  const LdmatrixAddr<kHeadDim> v_frag(sv + warp_row0 * (kHeadDim / 8) * 16, lane & 15, lane >> 4);
  // step i's query head and block
  const auto head_of = [&](int i) { return h_k * group + i / m_blocks; };
  const auto q0_of = [&](int i) { return (m_block_min + i % m_blocks) * kBlockM; };
  const auto load_step = [&](int i, int stage) {
    Tile th = t;
    th.h = head_of(i);
    const int q0 = q0_of(i);
    const TilePointers ptr = tile_pointers(p, th);
    const u16* dout = reinterpret_cast<const u16*>(g.dout) + th.b * g.dout_batch_stride +
                      th.h * g.dout_head_stride + (th.q_start + q0) * g.dout_row_stride;
    const u32 sq = sstages + stage * kStageBytes;
    load_rows<kBlockM, kHeadDim>(sq, ptr.q + q0 * p.q_row_stride, p.q_row_stride,
                                 t.seqlen_q - q0, p.head_dim);
    load_rows<kBlockM, kHeadDim>(sq + kTileBytes, dout, g.dout_row_stride, t.seqlen_q - q0,
                                 p.head_dim);
    cp_async_commit();
    // lse and D: plain loads, stored before the step's barrier
    const i64 at = row_stats_offset(p, th) + q0;
    float* s_lse = reinterpret_cast<float*>(stages + stage * kStageBytes + 2 * kTileBytes);
    for (int r = threadIdx.x; r < kBlockM; r += kBwdThreads) {
      s_lse[r] = lse_log2_of(reinterpret_cast<const float*>(p.lse) + at, r, t.seqlen_q - q0);
      s_lse[kBlockM + r] = q0 + r < t.seqlen_q ? reinterpret_cast<const float*>(g.softmax_d)[at + r]
                                               : 0.f;
    }
  };
  if (steps) {  // (K and V in the first step's copy group)
    load_rows<kBlockN, kHeadDim>(sk, kv.k + key0 * p.k_row_stride, p.k_row_stride,
                                 t.seqlen_k - key0, p.head_dim);
    if (kDk)
      load_rows<kBlockN, kHeadDim>(sv, kv.v + key0 * p.v_row_stride, p.v_row_stride,
                                   t.seqlen_k - key0, p.head_dim);
    load_step(0, 0);
  }
  const int first_key = frag_row(key0 + warp_row0, 0, 0, lane);  // this lane's keys: + 0, + 8

  int stage = 0;
  for (int i = 0; i < steps; ++i) {
    await_step<kStages>(i, steps, stage, load_step);
    Tile th = t;
    th.h = head_of(i);
    const int q0 = q0_of(i);
    const TileMods mods = tile_mods<kScoreMods>(p, th);
    const u32 sq = sstages + stage * kStageBytes, sdo = sq + kTileBytes;
    const float* s_lse = reinterpret_cast<const float*>(stages + stage * kStageBytes +
                                                        2 * kTileBytes);
    const float* s_d = s_lse + kBlockM;
    const LdmatrixAddr<kHeadDim> q_frag(sq, (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
    const LdmatrixAddr<kHeadDim> do_frag(sdo, (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
    const LdmatrixAddr<kHeadDim> qt_frag(sq, (lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4);
    const LdmatrixAddr<kHeadDim> dot_frag(sdo, (lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4);

    // S^T = K Q^T: rows this warp's keys, columns the block's queries
    float st[1][kQTiles][4];
#pragma unroll
    for (int nt = 0; nt < kQTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[0][nt][e] = 0.f;
    gemm_qk<kDtype>(st, k_frag, q_frag);

    const bool masked = block_needs_mask<kMask>(p, th, q0, min(q0 + kBlockM, t.seqlen_q),
                                                key0, key0 + kBlockN);
    float grad[1][kScoreMods ? kQTiles : 1][4];
    // (dq fused: one loop, which fits at d = 128)
    probs_t<kMask, kScoreMods, !kFusedDq>(st, grad, masked, p, th, mods, q0, first_key, s_lse,
                                          lane);
    if constexpr (kDv) gemm_pv<kDtype>(acc_dv, st, dot_frag);
    if constexpr (kDk) {
      // dP^T = V dout^T, then dS^T = P^T (dP^T - D) d(score)/d(raw score)
      float dpt[1][kQTiles][4];
#pragma unroll
      for (int nt = 0; nt < kQTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dpt[0][nt][e] = 0.f;
      gemm_qk<kDtype>(dpt, v_frag, do_frag);
#pragma unroll
      for (int nt = 0; nt < kQTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = frag_col(0, nt, e, lane);
          const float d_raw = kScoreMods ? grad[0][kScoreMods ? nt : 0][e] : p.scale;
          dpt[0][nt][e] = st[0][nt][e] * (dpt[0][nt][e] - s_d[col]) * d_raw;
        }
      gemm_pv<kDtype>(acc_dk, dpt, qt_frag);
      if constexpr (kFusedDq)
        add_dq_share<kDtype, kHeadDim, kBlockM, kBlockN>(
            dpt, stages + kStages * kStageBytes, sk, g, th, q0, t.seqlen_q, p.head_dim,
            warp_row0, lane);
    }
    __syncthreads();  // every warp is done with this step's buffers
    stage ^= kStages - 1;
  }
  const int rows = rows_out - key0;
  if constexpr (kDk) {
    u16* dk = reinterpret_cast<u16*>(g.dk) + t.b * g.dk_batch_stride + h_k * g.dk_head_stride +
              k_row * g.dk_row_stride;
    store_rows<kDtype>(acc_dk, dk, g.dk_row_stride, warp_row0, rows, p.head_dim, lane);
  }
  if constexpr (kDv) {
    u16* dv = reinterpret_cast<u16*>(g.dv) + t.b * g.dv_batch_stride + h_k * g.dv_head_stride +
              k_row * g.dv_row_stride;
    store_rows<kDtype>(acc_dv, dv, g.dv_row_stride, warp_row0, rows, p.head_dim, lane);
  }
}

}  // namespace cufa
