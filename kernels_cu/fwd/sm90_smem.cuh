#pragma once
// The Hopper forward's CTA, as its producer and consumers share it: the warpgroups and
// their registers, the shared memory (Q stages, the K/V ring, the mbarriers), the tile
// the producer hands the consumers through it, and the work both derive from a tile.
#include "block_info.cuh"
#include "mask.cuh"
#include "../common/sm90.cuh"

namespace cufa {

// Three shapes: 128-row tiles, two consumers, one CTA per SM (d > 64); 192-row tiles,
// three consumers, one CTA per SM (d = 64, whose loop is short on matrix work per
// exponential: a third warpgroup keeps the matrix units fed, +3-12 % in docs/decisions.md step
// 33); or 64-row tiles, one consumer, two CTAs per SM (short sequences, whose tiles are
// mostly partial: half the rounding of query rows, and the SM's two CTAs hide each
// other's per-tile latency the way the turns do for two consumers).
template <int kBlockM> constexpr int kConsumers = kBlockM / 64;
template <int kBlockM> constexpr int kSm90Threads = 128 * (1 + kConsumers<kBlockM>);
template <int kBlockM> constexpr int kCtasPerSm = kBlockM == 64 ? 2 : 1;
// 128 x 56 + 256 x 224 = 384 x 168, 128 x 32 + 384 x 160 = 512 x 128 and
// 128 x 56 + 128 x 200 = 256 x 128: the launch allotments (at 152 the three consumers
// spill; the producer fits in 32). The fp8 forward (kE4m3) takes 128 x 24 + 256 x 240:
// at d = 256 its pipelined loop holds S (64 registers), P (16) and O (128) at once, which
// left ptxas short at 224 (it serialized the products); its producer fits in 24.
template <int kBlockM, bool kE4m3 = false>
constexpr int kProducerRegs = kE4m3 && kBlockM == 128 ? 24 : kBlockM == 192 ? 32 : 56;
template <int kBlockM, bool kE4m3 = false>
constexpr int kConsumerRegs = kE4m3 && kBlockM == 128 ? 240 : kBlockM == 64 ? 200 : kBlockM == 192 ? 160 : 224;

// -- shared memory: Q stages, the K/V ring, the mbarriers. The CTA's key blocks are
//    counted over all its tiles: block g sits in stage g % kStages, whose barriers are
//    then on their (g / kStages)-th phase; tile number n's Q likewise in Q stage
//    n % kQStages (two where they fit, so the next tile's Q loads during this one), and
//    the producer hands the consumers that tile in the slot tile() + 32 * s. The fp8
//    forward's (kE4m3) tiles hold a byte an element: Q and K as rows of e4m3, and V
//    transposed, kHeadDim rows of kBlockN keys (fp8 wgmma reads both operands K-major).
//    V's rows (and O's) are kHeadDimV wide where V has a head dim of its own (DeepSeek's
//    prefill: 192 for Q and K, 128 for V); 0: kHeadDim. Above head dim 256
//    (kColumnHalves) a query tile is two CTAs, each computing the scores and one half of
//    V's and O's columns (O's 64 rows a warpgroup of 512 columns would not fit in
//    registers), kHeadDimV = 256 --
template <int kBlockM_, int kHeadDim_, int kBlockN_, int kQStages_, int kStages_,
          bool kE4m3_ = false, int kHeadDimV_ = 0>
struct Sm90Smem {
  static constexpr int kBlockM = kBlockM_, kHeadDim = kHeadDim_, kBlockN = kBlockN_;
  static constexpr bool kOwnHeadDimV = kHeadDimV_ != 0;
  static constexpr int kHeadDimV = kOwnHeadDimV ? kHeadDimV_ : kHeadDim_;
  static constexpr bool kE4m3 = kE4m3_;
  static constexpr bool kColumnHalves = kHeadDim > 256;
  static_assert(!kE4m3 || kHeadDimV == kHeadDim, "fp8: one head dim");
  static_assert(!kColumnHalves || (kOwnHeadDimV && kHeadDimV == 256 && !kE4m3),
                "above 256: 16-bit, V's and O's columns in halves of 256");
  static constexpr int kElemBytes = kE4m3 ? 1 : 2;
  // a row's 16-bit units, which the TMA maps and the 64-column panels count (an e4m3 row
  // moves as pairs of bytes)
  static constexpr int kRowUnits = kHeadDim * kElemBytes / 2;
  // K/V ring depth: two stages (three measured no faster: docs/decisions.md), or one where two do
  // not fit (d = 256's 128-key blocks: the loop then waits for each product, as cuDNN's)
  static constexpr int kQStages = kQStages_, kStages = kStages_;
  static constexpr int kQBytes = kBlockM * kHeadDim * kElemBytes;
  static constexpr int kKVBytes = kBlockN * kHeadDim * kElemBytes;  // a K stage
  static constexpr int kVBytes = kBlockN * kHeadDimV * kElemBytes;   // a V stage
  // Offsets from q, the 1024-aligned base; stage s of K at k() + s * kKVBytes, of V at
  // v() + s * kVBytes, stage s's barrier at + 8 * s. (Addresses are computed, not stored:
  // the producer warp has few registers, and arrays indexed at run time would go to local
  // memory.)
  static constexpr u32 kK = kQStages * kQBytes, kV = kK + kStages * kKVBytes;
  static constexpr u32 kQFull = kV + kStages * kVBytes, kQEmpty = kQFull + 8 * kQStages;
  static constexpr u32 kKFull = kQEmpty + 8 * kQStages, kVFull = kKFull + 8 * kStages;
  static constexpr u32 kKEmpty = kVFull + 8 * kStages, kVEmpty = kKEmpty + 8 * kStages;
  static constexpr u32 kTile = (kVEmpty + 8 * kStages + 15) & ~15u;
  u32 q;

  // dynamic shared memory is 16-byte aligned; the swizzle needs 1024
  __device__ explicit Sm90Smem(u32 base) : q((base + 1023) & ~1023u) {}
  __device__ u32 k() const { return q + kK; }
  __device__ u32 v() const { return q + kV; }
  __device__ u32 q_full() const { return q + kQFull; }
  __device__ u32 q_empty() const { return q + kQEmpty; }
  __device__ u32 k_full() const { return q + kKFull; }
  __device__ u32 v_full() const { return q + kVFull; }
  __device__ u32 k_empty() const { return q + kKEmpty; }
  __device__ u32 v_empty() const { return q + kVEmpty; }
  __device__ u32 tile() const { return q + kTile; }
  __device__ static u32 stage(int g) { return static_cast<u32>(g % kStages); }
  __device__ static u32 parity(int g) { return static_cast<u32>((g / kStages) & 1); }
  __device__ static u32 q_stage(int n) { return static_cast<u32>(n % kQStages); }
  __device__ static u32 q_parity(int n) { return static_cast<u32>((n / kQStages) & 1); }
};

// -- V's and O's columns in the arrays: p.head_dim where V has Q's head dim, which those
//    variants alone read --
template <class Smem>
__device__ __forceinline__ const int& head_dim_v(const FwdParams& p) {
  return Smem::kOwnHeadDimV ? p.head_dim_v : p.head_dim;
}

// -- with column halves (kColumnHalves) the tile the producer hands the consumers carries
//    the CTA's half (its work unit's bit 0) in bit 0 of m_block (the slot's 32 bytes are
//    full); split_half takes it out again --
template <class Smem>
__device__ __forceinline__ int split_half(Tile& t) {  // -> V's and O's first column
  if constexpr (Smem::kColumnHalves) {
    const int v_col0 = (t.m_block & 1) * Smem::kHeadDimV;
    t.m_block >>= 1;
    return v_col0;
  } else {
    return 0;
  }
}

// -- one tile's work: the tile, its rows, and its key blocks n_block_max - n_blocks ..
//    n_block_max - 1, visited last first --
struct Sm90Work {
  Tile t;
  int row0, row_end, n_block_max, n_blocks;
  int last_block_keys;  // keys of the last (highest) block some row of the tile sees
};

template <int kBlockM, int kMask, int kBlockN>
__device__ __forceinline__ Sm90Work sm90_work(const FwdParams& p, const Tile& t) {
  Sm90Work w;
  w.t = t;
  w.row0 = t.m_block * kBlockM;
  w.row_end = min(w.row0 + kBlockM, t.seqlen_q);
  const KeyRange keys = key_range<kMask>(p, t, w.row0, w.row_end);
  w.n_block_max = (keys.end + kBlockN - 1) / kBlockN;  // rows with no key: no blocks
  w.n_blocks = max(w.n_block_max - keys.begin / kBlockN, 0);
  w.last_block_keys = keys.end - (w.n_block_max - 1) * kBlockN;
  return w;
}

// -- the producer looks each tile up once and hands it to the consumers through shared
//    memory (32 bytes a Q stage; b = -1: the end of the list): a packed batch's tile
//    takes two dependent global loads (list entry, then cu_seqlens), which the
//    consumers would otherwise wait for at every tile start. Sequence starts fit in 32
//    bits: they are clamped to the tensors' row counts, which are ints --
__device__ __forceinline__ void store_tile(u32 addr, const Tile& t, bool more) {
  asm volatile(
      "st.shared.v4.s32 [%0], {%1, %2, %3, %4};\n"
      "st.shared.v4.s32 [%0 + 16], {%5, %6, %7, %8};\n"
      ::"r"(addr), "r"(more ? t.b : -1), "r"(t.h), "r"(t.h_k), "r"(t.m_block), "r"(t.seqlen_q),
      "r"(t.seqlen_k), "r"(static_cast<int>(t.q_start)), "r"(static_cast<int>(t.k_start))
      : "memory");
}
__device__ __forceinline__ bool load_tile(u32 addr, const FwdParams& p, Tile& t) {
  int q_start, k_start;
  asm volatile(
      "ld.shared.v4.s32 {%0, %1, %2, %3}, [%8];\n"
      "ld.shared.v4.s32 {%4, %5, %6, %7}, [%8 + 16];\n"
      : "=r"(t.b), "=r"(t.h), "=r"(t.h_k), "=r"(t.m_block), "=r"(t.seqlen_q), "=r"(t.seqlen_k),
        "=r"(q_start), "=r"(k_start)
      : "r"(addr) : "memory");
  t.q_start = q_start;
  t.k_start = k_start;
  set_diag_offset(p, t);
  return t.b >= 0;
}

}  // namespace cufa
