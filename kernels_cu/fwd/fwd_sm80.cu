// Forward attention on the Ampere instruction set (mma.sync, ldmatrix, cp.async):
// runs on sm_80 and every later GPU. One CTA of 4 warps owns kBlockM query rows of
// one (batch, head); it streams K/V blocks of kBlockN keys through shared memory,
// from the last visible block to the first, so blocks that need masking come first.
#include "../common/sm80.cuh"
#include "../common/element_io.cuh"
#include "params.cuh"
#include "block_info.cuh"
#include "mask.cuh"
#include "../common/softmax.cuh"
#include "score.cuh"
#include "../common/mma_tiles.cuh"
#include "../common/e4m3_mma.cuh"

namespace cufa {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

// -- load a tile: rows past `rows_valid` and columns past `head_dim` read as zeros (by
//    cp.async; kElementIO: by plain loads, stored before this returns) --
template <int kRows, int kHeadDim, bool kElementIO>
__device__ __forceinline__ void load_tile(u32 smem, const u16* gmem, i64 row_stride, int rows_valid,
                                          int head_dim) {
  if constexpr (kElementIO)
    copy_rows_elementwise<kRows, kHeadDim, kThreads>(
        smem, [=](int r) { return gmem + r * row_stride; }, rows_valid, head_dim,
        [](int r, int c) { return Swizzle<kHeadDim>::offset(r, c); }, threadIdx.x);
  else
    copy_tile_async<kRows, kHeadDim, kThreads>(
        smem, gmem, row_stride, rows_valid, head_dim,
        [](int r, int c) { return Swizzle<kHeadDim>::offset(r, c); });
}

// -- the head dim of K's rows, or with kOwnHeadDim of V's and O's --
template <bool kOwnHeadDim>
__device__ __forceinline__ int head_dim_of(const FwdParams& p) {
  return kOwnHeadDim ? p.head_dim_v : p.head_dim;
}

// -- load keys [key0, key0 + kRows) of K or V (head: the sequence's row 0 of this head).
//    kE4m3: an e4m3 cache, whose rows of kHeadDim bytes move as kHeadDim / 2 16-bit
//    elements (the host gives its strides in those) into E4m3Tile rows. kOwnHeadDim: V's
//    rows of p.head_dim_v, from column col0 on (head: already there) --
template <int kRows, int kHeadDim, bool kElementIO, bool kE4m3 = false, bool kOwnHeadDim = false>
__device__ __forceinline__ void load_kv_block(u32 smem, const FwdParams& p, const Tile& t,
                                              const u16* head, i64 batch_stride, i64 row_stride,
                                              int key0, int col0 = 0) {
  const int rows_valid = t.seqlen_k - key0;
  const auto head_dim = [&] { return head_dim_of<kOwnHeadDim>(p) - col0; };  // (read where used)
  if constexpr (kE4m3) {
    static_assert(!kElementIO, "an e4m3 cache takes the 16-byte path");
    const auto offset = [](int r, int c) { return E4m3Tile<kHeadDim>::offset(r, c); };
    if (!p.block_table)
      copy_tile_async<kRows, kHeadDim / 2, kThreads>(smem, head + key0 * row_stride, row_stride,
                                                     rows_valid, head_dim() / 2, offset);
    else
      copy_rows_async<kRows, kHeadDim / 2, kThreads>(
          smem, [&](int r) { return paged_row(p, t, head, batch_stride, row_stride, key0 + r); },
          head, rows_valid, head_dim() / 2, offset, threadIdx.x);
    return;
  }
  if (!p.block_table) {
    load_tile<kRows, kHeadDim, kElementIO>(smem, head + key0 * row_stride, row_stride, rows_valid,
                                           head_dim());
    return;
  }
  const auto row = [&](int r) { return paged_row(p, t, head, batch_stride, row_stride, key0 + r); };
  const auto offset = [](int r, int c) { return Swizzle<kHeadDim>::offset(r, c); };
  if constexpr (kElementIO)
    copy_rows_elementwise<kRows, kHeadDim, kThreads>(smem, row, rows_valid, head_dim(), offset,
                                                     threadIdx.x);
  else
    copy_rows_async<kRows, kHeadDim, kThreads>(smem, row, head, rows_valid, head_dim(), offset,
                                               threadIdx.x);
}

// -- the element-wise variant's V block in registers from its loads (issue, before the QK
//    product) to its stores (land, after it), so that the loads' latency hides under the
//    product as cp.async's does. Where a thread's chunks of a block take at most 32
//    registers (d <= 128); above, and for K (held under softmax and P V it spills at
//    d = 64 and 128), a block is loaded and stored in one go --
template <int kHeadDim, int kBlockN>
struct VInFlight {
  TileInFlight<kBlockN, kHeadDim, kThreads> tile;
  static constexpr bool kFits = TileInFlight<kBlockN, kHeadDim, kThreads>::kChunks <= 8;

  __device__ __forceinline__ void issue(const FwdParams& p, const Tile& t, const u16* head,
                                        i64 batch_stride, i64 row_stride, int key0) {
    tile.load([&](int r) {
      return p.block_table ? paged_row(p, t, head, batch_stride, row_stride, key0 + r)
                           : head + (key0 + r) * row_stride;
    }, t.seqlen_k - key0, p.head_dim, threadIdx.x);
  }
  __device__ __forceinline__ void land(u32 smem) const {
    tile.store(smem, [](int r, int c) { return Swizzle<kHeadDim>::offset(r, c); }, threadIdx.x);
  }
};

// -- epilogue: O through this warp's rows of sQ (only this warp read them), then 16-byte
//    stores (kElementIO: a store an element). kE4m3Columns: the output tiles hold
//    gemm_pv_e4m3's dims, written back in order. kOwnHeadDim: rows of p.head_dim_v, from
//    column col0 on (o_ptr: already there; lse by the CTA of column 0) --
template <int kDtype, int kHeadDim, bool kElementIO, bool kE4m3Columns = false,
          bool kOwnHeadDim = false, int kMTiles, int kDTiles>
__device__ __forceinline__ void write_output(const float (&o)[kMTiles][kDTiles][4],
                                             const float (&lse)[kMTiles][2], const FwdParams& p,
                                             int seqlen_q, u16* s_stage, u16* o_ptr, float* lse_ptr,
                                             int row0,
                                             int warp_row0, int lane, int col0 = 0) {
  unsigned char* stage = reinterpret_cast<unsigned char*>(s_stage);
  if constexpr (kE4m3Columns) {  // (a lane holds dims 16c + 4t .. + 3: half a chunk)
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int c = 0; c < kDTiles / 2; ++c)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = warp_row0 + mt * 16 + (lane >> 2) + 8 * h, t = lane & 3;
          const float4 x = e4m3_output_dims(o, mt, c, h);
          *reinterpret_cast<uint2*>(stage + Swizzle<kHeadDim>::offset(r, 2 * c + (t >> 1)) +
                                    8 * (t & 1)) =
              make_uint2(pack2<kDtype>(x.x, x.y), pack2<kDtype>(x.z, x.w));
        }
  } else {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = warp_row0 + mt * 16 + (lane >> 2) + 8 * h;
          *reinterpret_cast<u32*>(stage + Swizzle<kHeadDim>::offset(r, dt) + 4 * (lane & 3)) =
              pack2<kDtype>(o[mt][dt][2 * h], o[mt][dt][2 * h + 1]);
        }
  }
  __syncwarp();
  constexpr int kChunks = kHeadDim / 8;
#pragma unroll
  for (int i = 0; i < kMTiles * 16 * kChunks / 32; ++i) {
    const int idx = i * 32 + lane;
    const int r = idx / kChunks, c = idx % kChunks;
    const int row = row0 + warp_row0 + r;
    if (row < seqlen_q && c * 8 < head_dim_of<kOwnHeadDim>(p) - col0) {
      const uint4 x =
          *reinterpret_cast<const uint4*>(stage + Swizzle<kHeadDim>::offset(warp_row0 + r, c));
      u16* dst = o_ptr + row * p.o_row_stride + c * 8;
      if constexpr (kElementIO)
        store8_elementwise(dst, x, head_dim_of<kOwnHeadDim>(p) - col0 - c * 8);
      else
        *reinterpret_cast<uint4*>(dst) = x;
    }
  }
  if ((lane & 3) == 0 && p.lse && col0 == 0) {  // (no lse buffer: the caller asked for none)
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row0 + warp_row0 + mt * 16 + (lane >> 2) + 8 * h;
        if (row < seqlen_q) lse_ptr[row] = lse[mt][h];
      }
  }
}

// kElementIO: the element-wise I/O variant (common/element_io.cuh), for any head dim and
// any strides. Its loads of Q and K (and of V above d = 128) wait for memory where cp.async's
// run under the products; V's at d <= 128 land under the QK product (VInFlight).
// kE4m3: K and V from an e4m3 cache (q and out stay kDtype): E4m3Tile rows in shared
// memory, read into mma fragments as kDtype values (common/e4m3_mma.cuh), k_descale folded
// into the scores, v_descale into the output. kHeadDimVWanted: V's and O's head dim where
// it is not Q's and K's (p.head_dim_v; 0: kHeadDim), at most kHeadDim (O is staged over Q).
// Above head dim 256 (kColumnHalves) O's 16 rows a warp would not fit in registers: each
// query tile is two CTAs, blockIdx.x's low bit picking which kHeadDimV columns of V and O
// (both compute the scores; the first writes lse). V's own head dim (p.head_dim_v) may be
// under Q's and K's there too (576 and 512 on 640 and two halves of 256): the halves cover
// V's columns, not Q's.
template <int kDtype, int kHeadDim, int kMask, bool kScoreMods, int kBlockM, int kBlockN,
          bool kElementIO = false, bool kE4m3 = false, int kHeadDimVWanted = 0>
__global__ void __launch_bounds__(kThreads, 1) fwd_kernel(const FwdParams p) {
  constexpr bool kOwnV = kHeadDimVWanted != 0;
  constexpr int kHeadDimV = kOwnV ? kHeadDimVWanted : kHeadDim;
  constexpr int kMTiles = kBlockM / (16 * kWarps);
  constexpr int kNTiles = kBlockN / 8;
  constexpr int kDTiles = kHeadDimV / 8;
  static_assert(kMTiles * 16 * kWarps == kBlockM && kNTiles % 2 == 0, "tile shape");
  static_assert(!(kElementIO && kE4m3), "an e4m3 cache takes the 16-byte path");
  static_assert(kHeadDimV <= kHeadDim && (!kOwnV || !(kElementIO || kE4m3)),
                "a head dim of V's own: at most Q's, on the 16-bit 16-byte path");
  constexpr bool kColumnHalves = kHeadDim > 256;
  static_assert(!kColumnHalves || kOwnV, "above 256, V's and O's columns in two halves");

  extern __shared__ __align__(128) unsigned char smem[];
  u16* sQ = reinterpret_cast<u16*>(smem);
  u16* sK = sQ + kBlockM * kHeadDim;
  // (an e4m3 block: kBlockN rows of E4m3Tile<kHeadDim>::kRowBytes, as 16-bit units)
  u16* sV = sK + (kE4m3 ? kBlockN * E4m3Tile<kHeadDim>::kRowBytes / 2 : kBlockN * kHeadDim);

  // -- which tile --
  Tile t;
  if (!get_tile(p, static_cast<int>(kColumnHalves ? blockIdx.x >> 1 : blockIdx.x), t)) return;
  const int v_col0 = kColumnHalves ? (blockIdx.x & 1) * kHeadDimV : 0;
  const int row0 = t.m_block * kBlockM;
  const int row_end = min(row0 + kBlockM, t.seqlen_q);
  const int lane = threadIdx.x % 32;
  const int warp_row0 = (threadIdx.x / 32) * kMTiles * 16;

  const TilePointers ptr = tile_pointers(p, t);
  const u16* q_ptr = ptr.q + row0 * p.q_row_stride;

  const TileMods mods = tile_mods<kScoreMods>(p, t);
  const float scale_log2 = kScoreMods ? 1.f : p.scale_log2;  // score mods leave log2 units
  // an e4m3 cache: the fragments' keys are the cache's over e4m3_to_half_scale<kDtype>()
  const float k_scale = kE4m3 ? cache_descale(p.k_descale, p.k_descale_batch_stride,
                                              p.k_descale_head_stride, t.b, t.h_k) *
                                    e4m3_to_half_scale<kDtype>()
                              : 1.f;

  float acc_o[kMTiles][kDTiles][4];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mt][dt][e] = 0.f;
  OnlineSoftmax<kMTiles> softmax;
  softmax.init();

  const KeyRange keys = key_range<kMask>(p, t, row0, row_end);
  const int n_block_min = keys.begin / kBlockN;
  const int n_block_max = (keys.end + kBlockN - 1) / kBlockN;  // rows with no key skip the loop

  if (n_block_min < n_block_max) {
    const u32 sq = smem_u32(sQ), sk = smem_u32(sK), sv = smem_u32(sV);
    // Lane -> (row, chunk) maps that make ldmatrix fragments match the mma operand layouts.
    const LdmatrixAddr<kHeadDim> q_frag(sq + warp_row0 * (kHeadDim / 8) * 16, lane & 15, lane >> 4);
    const LdmatrixAddr<kHeadDim> k_frag(sk, (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
    const LdmatrixAddr<kHeadDimV> v_frag(sv, (lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4);
    load_tile<kBlockM, kHeadDim, kElementIO>(sq, q_ptr, p.q_row_stride, t.seqlen_q - row0,
                                             p.head_dim);
    if constexpr (kE4m3) {  // Q in the keys' dim order before any product reads it
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
      order_q_for_e4m3_keys<kBlockM, kHeadDim, kThreads>(sq, threadIdx.x);
    }
    int nb = n_block_max - 1;
    load_kv_block<kBlockN, kHeadDim, kElementIO, kE4m3>(sk, p, t, ptr.k, p.k_batch_stride,
                                                        p.k_row_stride, nb * kBlockN);
    cp_async_commit();
    constexpr bool kInFlight = kElementIO && VInFlight<kHeadDim, kBlockN>::kFits;
    VInFlight<kHeadDim, kBlockN> in_flight;

    for (; nb >= n_block_min; --nb) {
      const int key0 = nb * kBlockN;
      float acc_s[kMTiles][kNTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_s[mt][nt][e] = 0.f;

      // -- K_nb has landed and every warp is done with V_{nb+1}: fetch V_nb under the QK product --
      cp_async_wait<0>();
      __syncthreads();
      if constexpr (kInFlight) {
        in_flight.issue(p, t, ptr.v, p.v_batch_stride, p.v_row_stride, key0);
      } else {
        load_kv_block<kBlockN, kHeadDimV, kElementIO, kE4m3, kOwnV>(sv, p, t, ptr.v + v_col0,
                                                                   p.v_batch_stride,
                                                                   p.v_row_stride, key0, v_col0);
        cp_async_commit();
      }

      // -- compute qk, then score mods and mask --
      if constexpr (kE4m3) {
        gemm_qk_e4m3<kDtype, kHeadDim>(acc_s, q_frag, sk, lane);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_s[mt][nt][e] *= k_scale;
      } else {
        gemm_qk<kDtype>(acc_s, q_frag, k_frag);
      }
      if (kScoreMods)
        apply_score_mods(acc_s, p, t, mods, row0 + warp_row0, key0, lane);
      if (block_needs_mask<kMask>(p, t, row0, row_end, key0, key0 + kBlockN))
        apply_mask<kMask>(acc_s, p, t, row0 + warp_row0, key0, lane);
      if constexpr (kInFlight) in_flight.land(sv);

      // -- V_nb has landed and every warp is done with K_nb: fetch K_{nb-1} under softmax and PV --
      cp_async_wait<0>();
      __syncthreads();
      if (nb > n_block_min) {
        load_kv_block<kBlockN, kHeadDim, kElementIO, kE4m3>(sk, p, t, ptr.k, p.k_batch_stride,
                                                            p.k_row_stride, key0 - kBlockN);
        cp_async_commit();
      }

      // -- update m_i and l_i, rescale acc, then acc += P V --
      float correction[kMTiles][2];
      softmax.update(acc_s, scale_log2, correction);
      softmax.rescale_output(acc_o, correction);
      if constexpr (kE4m3)
        gemm_pv_e4m3<kDtype, kHeadDim>(acc_o, acc_s, sv, lane);
      else
        gemm_pv<kDtype>(acc_o, acc_s, v_frag);
    }
  }
  if constexpr (kE4m3) {
    const float v_scale = cache_descale(p.v_descale, p.v_descale_batch_stride,
                                        p.v_descale_head_stride, t.b, t.h_k) *
                          e4m3_to_half_scale<kDtype>();
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_o[mt][dt][e] *= v_scale;
  }

  float lse[kMTiles][2];
  softmax.finalize(acc_o, lse, scale_log2, load_sink(p.learnable_sink, p.sink_dtype, t.h));
  write_output<kDtype, kHeadDimV, kElementIO, kE4m3, kOwnV>(acc_o, lse, p, t.seqlen_q, sQ,
                                                           ptr.o + v_col0, ptr.lse, row0,
                                                           warp_row0, lane, v_col0);
}

}  // namespace cufa
