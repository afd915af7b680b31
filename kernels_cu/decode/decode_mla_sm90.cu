// MLA decode (DeepSeek's multi-head latent attention, in FlashAttention-3's qv form) on
// Hopper. A key is a 512-dim latent row c_kv (v_cache) and a 64-dim rotary row k_pe
// (k_cache); its value is the latent row itself. A query is qv (512, the absorbed part)
// and q (64): score = qv . c_kv + q . k_pe, output = P c_kv (512 columns).
//
// With many query heads on one latent head (128 on DeepSeek-V3) the work is compute-bound
// even at one query token (~240 FLOPs a cache byte), so the kernel is built around the
// matrix units rather than around HBM as decode_kernel is:
// - a CTA takes 64 query rows (a GQA group's heads x new tokens) of one (sequence, KV
//   head, split) and reads each key block once for all of them;
// - a producer warpgroup copies the key blocks (latent row and rotary row side by side,
//   576 columns in nine 128-byte-swizzled panels) into a ring of MlaSmem::kStages buffers,
//   whole blocks as TMA boxes where the call's maps describe the cache (kTma);
// - two consumer warpgroups hold O's columns 0-255 and 256-511 (64 x 256 floats each: all
//   of O would not fit one warpgroup's registers). They take turns at the scores: block t
//   is owned by consumer t % 2, which computes S = Q K^T over all 576 columns, the online
//   softmax's new row max and P; it hands P (through shared memory), the factor O must be
//   rescaled by and the new max to the other consumer, and both add P V over their
//   columns. So each consumer computes half of the scores and half of P V, and the scores
//   of block t + 1 run while block t's softmax does.
// The splits' shares merge in decode_combine, as decode_kernel's do.
// An e4m3 cache (kFp8) arrives as bytes in a staging ring (its latent as TMA boxes where
// maps describe it, its rope and the other blocks by the producer's copies) and is widened
// to the 16-bit dtype by the producer on its way into the ring, exactly (e4m3 values over
// e4m3_to_half_scale<kDtype, true>() are fp16 and bf16 values); the scores' latent and rotary parts sum
// in two accumulators, each times its descale, and O takes v's descale at the end.
#include "cache.cuh"
#include "score.cuh"
#include "../common/sm90.cuh"
#include "../common/softmax.cuh"
#include "../common/wgmma_ops.cuh"

namespace cufa {

constexpr int kMlaLatent = 512;                  // c_kv's, qv's, V's and O's columns
constexpr int kMlaRope = 64;                     // k_pe's and q's columns
constexpr int kMlaDim = kMlaLatent + kMlaRope;   // the scores' columns
constexpr int kMlaChunks = kMlaDim / 8;          // 16-byte chunks a row (latent first)
constexpr int kMlaRows = 64;                     // query rows a CTA: a consumer's M
constexpr int kMlaKeys = 32;                     // keys a block
constexpr int kMlaLatentSteps = kMlaLatent / 16;  // S's k-steps over the latent (then the rope's)
// Q's last k-steps (the rope dims and the latent's tail), held by each consumer as A
// fragments for the whole split: S at N = 32 reads Q's 2 KB a k-step from shared memory
// for 1 KB of keys, more than the tensor cores' 16 cycles can take in; these k-steps read
// the keys alone. (An e4m3 cache's rope accumulator takes four k-steps' registers.)
template <bool kFp8> constexpr int kMlaQRegSteps = kFp8 ? 8 : 12;
template <bool kFp8> constexpr int kMlaQSmemSteps = kMlaDim / 16 - kMlaQRegSteps<kFp8>;
constexpr int kMlaHalf = kMlaLatent / 2;         // O's columns a consumer
constexpr int kMlaQBytes = kMlaRows * kMlaDim * 2;
constexpr int kMlaBlockBytes = kMlaKeys * kMlaDim * 2;
// An e4m3 block staged: the latent in four 128-byte-swizzled panels of 128 values (as TMA
// boxes land), then the rope's rows, 64 bytes each, unswizzled
constexpr int kMlaE4m3LatentBytes = kMlaKeys * kMlaLatent;
constexpr int kMlaE4m3BlockBytes = kMlaKeys * kMlaDim;
constexpr int kMlaPBytes = kMlaRows * 64 * 2;    // P in one 64-column panel (32 used)
// An e4m3 cache's producer widens every block, with its loads ahead of their conversions
// (mla_widen_e4m3): 56 registers, which its consumers (fewer of Q's k-steps in registers)
// give up
template <bool kFp8> constexpr int kMlaProducerRegs = kFp8 ? 56 : 40;
template <bool kFp8> constexpr int kMlaConsumerRegs = kFp8 ? 224 : 232;
// setmaxnreg moves registers between the warpgroups within the CTA's allotment (384
// threads at 168, __launch_bounds__(384, 1)); asked for more, the consumers would wait for
// registers forever
static_assert(128 * kMlaProducerRegs<false> + 256 * kMlaConsumerRegs<false> <= 384 * 168 &&
                  128 * kMlaProducerRegs<true> + 256 * kMlaConsumerRegs<true> <= 384 * 168,
              "the warpgroups' registers within the CTA's");
// named barriers (0 is __syncthreads'): "block t's P is ready" for consumer 0 and 1 (1, 2),
// and the consumers' meeting before the epilogue (3); an e4m3 cache's producer has a
// fourth (mla_produce_e4m3)
constexpr int kMlaReadyBarrier = 1, kMlaEndBarrier = 3;

// Shared memory from a 1024-byte boundary: Q, the ring, an e4m3 cache's staged blocks, P,
// the rows' running max and rescale factors (double-buffered by block parity) and final
// sums, then the mbarriers. One P panel serves both consumers: block t's P is written by
// its owner, read by the other alone, which rewrites it with block t + 1's P only after
// that read has completed, so the panel passes from one to the other in turn; the space
// of a second panel holds the ring's fourth buffer (with e4m3, the staging ring: three
// 16-bit buffers and two staged blocks). MlaVariant.smem_bytes in cufa/_compile.py
// mirrors kBytes (232,008 of sm_90's 232,448 bytes a CTA, either way).
template <bool kFp8>
struct MlaSmem {
  static constexpr int kStages = kFp8 ? 3 : 4;  // 16-bit blocks
  static constexpr int kStaged = kFp8 ? 2 : 0;  // e4m3 blocks
  static constexpr u32 kRing = kMlaQBytes;
  static constexpr u32 kStaging = kRing + kStages * kMlaBlockBytes;
  static constexpr u32 kP = kStaging + kStaged * kMlaE4m3BlockBytes;
  static constexpr u32 kMax = kP + kMlaPBytes;       // float [2][kMlaRows]
  static constexpr u32 kCorr = kMax + 2 * kMlaRows * 4;
  static constexpr u32 kSum = kCorr + 2 * kMlaRows * 4;
  static constexpr u32 kBars = kSum + 2 * kMlaRows * 4;  // full, empty, staged_full, q_full
  static constexpr int kBytes = kBars + 8 * (2 * kStages + kStaged + 1) + 1024;  // (+ the alignment)
  u32 base;
  __device__ u32 q() const { return base; }
  __device__ u32 block(int stage) const { return base + kRing + stage * kMlaBlockBytes; }
  __device__ u32 staged(int i) const { return base + kStaging + i * kMlaE4m3BlockBytes; }
  __device__ u32 p() const { return base + kP; }
  __device__ float* row_floats(unsigned char* raw, u32 at) const {
    return reinterpret_cast<float*>(raw + (base - smem_u32(raw)) + at);
  }
  __device__ u32 full(int stage) const { return base + kBars + 8 * stage; }
  __device__ u32 empty(int stage) const { return base + kBars + 8 * (kStages + stage); }
  __device__ u32 staged_full(int i) const { return base + kBars + 8 * (2 * kStages + i); }
  __device__ u32 q_full() const { return base + kBars + 8 * (2 * kStages + kStaged); }
};
static_assert(MlaSmem<false>::kBytes <= 227 * 1024 && MlaSmem<true>::kBytes <= 227 * 1024,
              "shared memory a CTA of sm_90");
static_assert(MlaSmem<true>::kStaging % 1024 == 0 && kMlaE4m3BlockBytes % 1024 == 0 &&
                  MlaSmem<true>::kP % 1024 == 0 && MlaSmem<false>::kP % 1024 == 0,
              "swizzled panels (boxes, P) on 1024-byte boundaries");

// -- a diagnostic build (CUFA_TRACE=1: cufa/_compile.py's debug_options) stamps each CTA's
//    start, Q's arrival, its first P, the end of its loop and of its stores (consumer 0's
//    first thread), the producer's end, its key blocks and its SM, on the global timer
//    (ns), for bench/profile/mla_timeline.py. Without the flag the stamps compile to
//    nothing --
enum MlaTraceField : int {
  kMlaStart = 0, kMlaQReady, kMlaFirstP, kMlaLoopEnd, kMlaWritten, kMlaProducerEnd,
  kMlaBlocks, kMlaSm
};
#ifdef CUFA_TRACE
constexpr int kMlaTraceCtas = 4096, kMlaTraceFields = 8;
extern "C" {
__device__ u64 cufa_mla_trace[kMlaTraceCtas][kMlaTraceFields];
}
#endif
__device__ __forceinline__ void mla_trace(MlaTraceField field, u64 value = 0) {
#ifdef CUFA_TRACE
  const u32 cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (cta >= kMlaTraceCtas) return;
  if (field == kMlaBlocks) {
    cufa_mla_trace[cta][field] = value;
    return;
  }
  u64 ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  cufa_mla_trace[cta][field] = ns;
  if (field == kMlaStart) {
    u32 sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    cufa_mla_trace[cta][kMlaSm] = sm;
  }
#endif
}

// -- the CTA's work: its rows (row r: token r / group, head h_k * group + r % group of
//    the CTA's 64 consecutive (token, head) rows) and its split's key blocks --
struct MlaWork {
  CacheSeq s;
  int row0;        // the CTA's first (token, head) row
  int rows;        // of them, the valid ones (1..64)
  int key0;        // the split's first key (a sequence's key index)
  int key_end;     // past the split's last key
  int blocks;      // key blocks of kMlaKeys
};

__device__ __forceinline__ bool mla_work(const DecodeParams& p, MlaWork& w) {
  const int m_block = blockIdx.x % p.num_m_blocks, split = blockIdx.x / p.num_m_blocks;
  w.s = cache_seq(p, blockIdx.z);
  w.row0 = m_block * kMlaRows;
  w.rows = min(kMlaRows, w.s.seqlen_q * p.group - w.row0);
  if (w.rows <= 0) return false;
  const KeySpan span = visible_span(p, w.s.seqlen_k, w.s.seqlen_q, w.row0 / p.group,
                                    (w.row0 + w.rows - 1) / p.group);
  const int all_blocks = (span.end - span.begin + kMlaKeys - 1) / kMlaKeys;
  const int per_split = (all_blocks + p.num_splits - 1) / p.num_splits;
  const int first = min(split * per_split, all_blocks);
  w.blocks = min(first + per_split, all_blocks) - first;
  w.key0 = span.begin + first * kMlaKeys;
  w.key_end = min(w.key0 + w.blocks * kMlaKeys, span.end);
  return true;
}

// -- Q: the CTA's 64 rows of qv and q (72 16-byte chunks a row) copied by all 384 threads
//    before the warpgroups part, six threads a row, each every sixth chunk of it, its row's
//    addresses worked out once; rows past the CTA's are zeros. The copies announce
//    themselves on q_full. (The producer's 128 threads alone, with a division a chunk, took
//    6 us of a 14 us launch on a 1k cache; all threads, 3: H200.) --
constexpr int kMlaThreads = 384;
constexpr int kMlaQThreadsARow = kMlaThreads / kMlaRows;
static_assert(kMlaThreads % kMlaRows == 0 && kMlaChunks % kMlaQThreadsARow == 0,
              "Q's chunks shared evenly");
__device__ __forceinline__ void mla_copy_q(const DecodeParams& p, const MlaWork& w, u32 sq) {
  const int r = threadIdx.x / kMlaQThreadsARow, first = threadIdx.x % kMlaQThreadsARow;
  const bool valid = r < w.rows;
  const int gr = w.row0 + (valid ? r : 0);
  const int t = gr / p.group, h = blockIdx.y * p.group + gr % p.group;
  const i64 row = w.s.q_row0 + t;
  const u16* qv = reinterpret_cast<const u16*>(p.qv) + w.s.b * p.qv_batch_stride +
                  row * p.qv_row_stride + h * p.qv_head_stride;
  const u16* q = reinterpret_cast<const u16*>(p.q) + w.s.b * p.q_batch_stride +
                 row * p.q_row_stride + h * p.q_head_stride;
#pragma unroll
  for (int j = 0; j < kMlaChunks / kMlaQThreadsARow; ++j) {
    const int c = first + j * kMlaQThreadsARow;
    cp_async_16(sq + panel_offset<kMlaRows>(r, c),
                c < kMlaLatent / 8 ? qv + c * 8 : q + (c - kMlaLatent / 8) * 8, valid ? 16 : 0);
  }
}

// -- Q as TMA boxes (kTma: the host's maps describe qv and q with the cache), where the
//    CTA's rows are one token's consecutive heads: qv's eight boxes of 64 columns and q's
//    one, each of 64 heads (heads past the last read as zeros), issued by one thread.
//    (The threads' copies took 3 us of a 1k cache's launch: H200.) maps.q is qv's,
//    maps.k_tail q's, both (columns, heads, tokens, batch) views --
__device__ __forceinline__ bool mla_q_boxed(const DecodeParams& p) {
  return p.seqlen_q == 1 || p.group % kMlaRows == 0;
}
__device__ __forceinline__ void mla_box_q(const DecodeParams& p, const TensorMaps& maps,
                                          const MlaWork& w, u32 sq, u32 full) {
  const int token = w.s.q_row0 + w.row0 / p.group;
  const int head = blockIdx.y * p.group + w.row0 % p.group;
  mbar_expect_bytes(full, kMlaQBytes);
#pragma unroll
  for (int j = 0; j < kMlaLatent / 64; ++j)
    tma_load_4d(sq + j * kMlaRows * 128, maps.q, full, 64 * j, head, token,
                p.qv_batch_stride ? w.s.b : 0);
  tma_load_4d(sq + kMlaLatent / 64 * kMlaRows * 128, maps.k_tail, full, 0, head, token,
              p.q_batch_stride ? w.s.b : 0);
}

// -- the producer: block i of the split into stage i % kStages once both consumers have
//    released it. Each thread's copies announce themselves on the stage's full barrier as
//    they land (cp.async's own arrival), so every free buffer has its copy in flight, and
//    a block is announced the moment it is in, not when the producer next gets round to
//    it. A thread copies a quarter of one key's chunks, its page looked up a block ahead
//    (the lookup's latency under the wait for a buffer); keys past the split, and rows
//    past the CTA's, are zeros --
// This thread's key in block `block`: its cache position (the split's first key's for a
// key past the split, whose copy is zeros).
__device__ __forceinline__ int mla_key_pos(const MlaWork& w, int block, int tid) {
  const int key = w.key0 + block * kMlaKeys + tid / 4;  // (128 threads, 32 keys)
  return w.s.start + (key < w.key_end ? key : w.key0);
}

// The page that key's row is in (paged caches; 0 otherwise), read a block ahead of its copy.
__device__ __forceinline__ int mla_key_page(const DecodeParams& p, const MlaWork& w, int block,
                                            int tid) {
  return p.block_table ? w.s.pages[mla_key_pos(w, block, tid) >> p.page_shift] : 0;
}

// This thread's key of block `block` (key tid / 4) in the cache: its latent and rope rows,
// and whether it is the split's (else the rows are the split's first key's, copied as
// zeros). Elem: the cache's element (u16, or u8 for e4m3; strides are in elements).
template <class Elem>
struct MlaKeyRows {
  const Elem* latent;
  const Elem* rope;
  bool valid;
};
template <class Elem>
__device__ __forceinline__ MlaKeyRows<Elem> mla_key_rows(const DecodeParams& p, const MlaWork& w,
                                                         int block, int page, int tid) {
  const int pos = mla_key_pos(w, block, tid);
  const CacheSlot slot = p.block_table ? page_slot(p, page, pos) : CacheSlot{w.s.row, pos};
  return {reinterpret_cast<const Elem*>(p.v) + slot.block * p.v_batch_stride +
              slot.row * p.v_row_stride + blockIdx.y * p.v_head_stride,
          reinterpret_cast<const Elem*>(p.k) + slot.block * p.k_batch_stride +
              slot.row * p.k_row_stride + blockIdx.y * p.k_head_stride,
          w.key0 + block * kMlaKeys + tid / 4 < w.key_end};
}

__device__ __forceinline__ void mla_copy_block(const DecodeParams& p, const MlaWork& w, int block,
                                               int page, u32 dst, int tid) {
  const int r = tid / 4;
  const auto [latent, rope, valid] = mla_key_rows<u16>(p, w, block, page, tid);
#pragma unroll
  for (int j = 0; j < kMlaChunks / 4; ++j) {
    const int c = tid % 4 + 4 * j;
    const u16* src = c < kMlaLatent / 8 ? latent + c * 8 : rope + (c - kMlaLatent / 8) * 8;
    cp_async_16(dst + panel_offset<kMlaKeys>(r, c), src, valid ? 16 : 0);
  }
}

// -- with maps (kTma): a block whose 32 keys are all the split's and lie in one page (or
//    one contiguous cache row) comes as nine boxes of 32 rows x 64 columns, issued by one
//    thread (eight of the latent, from v's map, then the rope's, from k's), which land in
//    the ring's panels as the copies would lay them out. The other blocks (a split's
//    partial last one, whose rows past the split must be zeros, not the cache's contents;
//    one across a page boundary) are copied as without maps. Every thread still arrives
//    through cp.async (count 128), so that a boxed and a copied block are covered alike;
//    a box's bytes are expected before the issuing thread arrives, so the phase cannot
//    complete without them --
__device__ __forceinline__ bool mla_block_boxed(const DecodeParams& p, const MlaWork& w, int block) {
  const int key = w.key0 + block * kMlaKeys;
  if (key + kMlaKeys > w.key_end) return false;
  if (!p.block_table) return true;
  const int in_page = (w.s.start + key) & ((1 << p.page_shift) - 1);
  return in_page + kMlaKeys <= (1 << p.page_shift);
}

// A boxed block's TMA boxes, issued by one thread: the latent's (eight of 64 16-bit
// columns, or for an e4m3 cache four of 128 bytes through the map of its bytes as
// bfloat16 pairs), then, 16-bit, the rope's. (Not inlined: in the producer's 40 registers,
// inlined beside the copy path, it spills.)
template <bool kFp8>
__device__ __noinline__ void mla_box_block(const DecodeParams& p, const TensorMaps& maps,
                                           const MlaWork& w, int block, int page, u32 dst,
                                           u32 full) {
  constexpr int kLatentBoxes = kMlaLatent / (kFp8 ? 128 : 64);
  const int pos = w.s.start + w.key0 + block * kMlaKeys;
  const CacheSlot slot = p.block_table ? page_slot(p, page, pos) : CacheSlot{w.s.row, pos};
  mbar_expect_bytes(full, kFp8 ? kMlaE4m3LatentBytes : kMlaBlockBytes);
#pragma unroll
  for (int j = 0; j < kLatentBoxes; ++j)
    tma_load_4d(dst + j * kMlaKeys * 128, maps.v, full, 64 * j, slot.row, blockIdx.y, (int)slot.block);
  if (!kFp8)
    tma_load_4d(dst + kLatentBoxes * kMlaKeys * 128, maps.k, full, 0, slot.row, blockIdx.y,
                (int)slot.block);
}

template <bool kTma>
__device__ __forceinline__ void mla_produce(const DecodeParams& p, const TensorMaps& maps,
                                            const MlaWork& w, const MlaSmem<false>& sm, int tid) {
  constexpr int kStages = MlaSmem<false>::kStages;
  int next_page = w.blocks ? mla_key_page(p, w, 0, tid) : 0;
  for (int i = 0; i < w.blocks; ++i) {
    const int stage = i % kStages;
    const int page = next_page;
    if (i + 1 < w.blocks) next_page = mla_key_page(p, w, i + 1, tid);
    if (i >= kStages) mbar_wait(sm.empty(stage), ((i / kStages) & 1) ^ 1);
    if (kTma && mla_block_boxed(p, w, i)) {
      // (thread 0's page is its first key's, tid / 4 = 0: the block's)
      if (tid == 0) mla_box_block<false>(p, maps, w, i, page, sm.block(stage), sm.full(stage));
    } else {
      mla_copy_block(p, w, i, page, sm.block(stage), tid);
    }
    cp_async_mbar_arrive(sm.full(stage));
  }
  cp_async_wait_all();  // (no thread leaves with its copies in flight)
}

// -- an e4m3 cache's producer. Block i's bytes go into staging buffer i % kStaged,
//    kStaged blocks ahead: the latent as four TMA boxes of 128 values (maps describe the
//    cache's bytes as bfloat16 pairs, so a 64-column box is 128 bytes) where the block is
//    boxed, else by the threads' copies into the same swizzled panels; the rope by the
//    threads' copies (one 16-byte chunk each: 32 keys of 64 bytes). Once a block's bytes
//    have landed and its 16-bit buffer is free, every thread widens its share of it and
//    announces it; the staging buffer is refilled once all have (named barrier) --
__device__ __forceinline__ u32 mla_e4m3_latent_offset(int r, int c) {  // c: 16-byte chunk 0..31
  return (c / 8) * (kMlaKeys * 128) + r * 128 + (((c % 8) ^ (r % 8)) * 16);
}
__device__ __forceinline__ u32 mla_e4m3_rope_offset(int r, int c) {  // c: 0..3
  return kMlaE4m3LatentBytes + r * (kMlaRope) + c * 16;
}

// This thread's rope chunk (key tid / 4, chunk tid % 4), or every chunk of its key (all):
// zeros for a key past the split.
__device__ __forceinline__ void mla_copy_e4m3(const DecodeParams& p, const MlaWork& w, int block,
                                              int page, u32 dst, int tid, bool all) {
  const int r = tid / 4;
  const auto [latent, rope, valid] = mla_key_rows<u8>(p, w, block, page, tid);
  cp_async_16(dst + mla_e4m3_rope_offset(r, tid % 4), rope + (tid % 4) * 16, valid ? 16 : 0);
  if (all) {
#pragma unroll 1
    for (int j = 0; j < kMlaLatent / 16 / 4; ++j) {
      const int c = tid % 4 + 4 * j;
      cp_async_16(dst + mla_e4m3_latent_offset(r, c), latent + c * 16, valid ? 16 : 0);
    }
  }
}

// One staged 16-byte chunk (16 e4m3 values) -> the 16-bit chunks `chunk` and `chunk` + 1
// of key r of the block.
template <int kDtype>
__device__ __forceinline__ void mla_widen_chunk(uint4 x, u32 dst, int r, int chunk) {
  u32 h[8];
  e4m3x4_to_halves<kDtype>(x.x, h[0], h[1]);
  e4m3x4_to_halves<kDtype>(x.y, h[2], h[3]);
  e4m3x4_to_halves<kDtype>(x.z, h[4], h[5]);
  e4m3x4_to_halves<kDtype>(x.w, h[6], h[7]);
  st_shared_16(dst + panel_offset<kMlaKeys>(r, chunk), make_uint4(h[0], h[1], h[2], h[3]));
  st_shared_16(dst + panel_offset<kMlaKeys>(r, chunk + 1), make_uint4(h[4], h[5], h[6], h[7]));
}

// This thread's nine chunks of a staged block -> the 16-bit block: latent chunk tid % 32 of
// keys tid / 32 + 4j (a warp reads 512 contiguous bytes), then rope chunk tid % 4 of key
// tid / 4. The latent's loads go kMlaWidenLoads at a time ahead of their conversions: one
// chunk at a time, each load's latency and its conversion's chain were the loop's, and the
// widening bounded the e4m3 kernel (half its time at 16 heads: H200). (fp16's conversions
// hold more registers: four at a time spilled 8 bytes in the producer's 56.)
template <int kDtype>
constexpr int kMlaWidenLoads = kDtype == FP16 ? 2 : 4;
template <int kDtype>
__device__ __forceinline__ void mla_widen_e4m3(u32 src, u32 dst, int tid) {
  constexpr int kLoads = kMlaWidenLoads<kDtype>;
  static_assert((kMlaKeys / 4) % kLoads == 0, "every latent chunk of the thread's widened");
  const int c = tid % 32;
#pragma unroll 1
  for (int j0 = 0; j0 < kMlaKeys / 4; j0 += kLoads) {
    uint4 x[kLoads];
#pragma unroll
    for (int j = 0; j < kLoads; ++j)
      x[j] = ld_shared_16(src + mla_e4m3_latent_offset(tid / 32 + 4 * (j0 + j), c));
#pragma unroll
    for (int j = 0; j < kLoads; ++j)
      mla_widen_chunk<kDtype>(x[j], dst, tid / 32 + 4 * (j0 + j), 2 * c);
  }
  mla_widen_chunk<kDtype>(ld_shared_16(src + mla_e4m3_rope_offset(tid / 4, tid % 4)), dst, tid / 4,
                          kMlaLatent / 8 + 2 * (tid % 4));
}

template <int kDtype, bool kTma>
__device__ __forceinline__ void mla_produce_e4m3(const DecodeParams& p, const TensorMaps& maps,
                                                 const MlaWork& w, const MlaSmem<true>& sm,
                                                 int tid) {
  constexpr int kStages = MlaSmem<true>::kStages, kStaged = MlaSmem<true>::kStaged;
  constexpr int kStagedBarrier = 4;  // (named: "every thread has widened the staged block")
  const auto stage_bytes = [&](int i, int page) {
    const u32 dst = sm.staged(i % kStaged), bar = sm.staged_full(i % kStaged);
    const bool boxed = kTma && mla_block_boxed(p, w, i);
    if (boxed && tid == 0) mla_box_block<true>(p, maps, w, i, page, dst, bar);
    mla_copy_e4m3(p, w, i, page, dst, tid, !boxed);
    cp_async_mbar_arrive(bar);
  };
  for (int i = 0; i < kStaged && i < w.blocks; ++i) stage_bytes(i, mla_key_page(p, w, i, tid));
  for (int i = 0; i < w.blocks; ++i) {
    const int stage = i % kStages;
    // (block i + kStaged's page read now, its latency under the waits)
    const int page = i + kStaged < w.blocks ? mla_key_page(p, w, i + kStaged, tid) : 0;
    mbar_wait(sm.staged_full(i % kStaged), (i / kStaged) & 1);
    if (i >= kStages) mbar_wait(sm.empty(stage), ((i / kStages) & 1) ^ 1);
    mla_widen_e4m3<kDtype>(sm.staged(i % kStaged), sm.block(stage), tid);
    fence_proxy_async();  // (the widened block and Q, generic writes, are read by wgmma)
    mbar_arrive(sm.full(stage));
    if (i + kStaged < w.blocks) {
      named_barrier_sync(kStagedBarrier, 128);  // (every thread's reads of the buffer done)
      stage_bytes(i + kStaged, page);
    }
  }
  cp_async_wait_all();  // (no thread leaves with its copies in flight)
}

// -- a consumer's rows: r = 16 * warp + lane / 4 + 8 * i of the CTA's 64, each with the
//    keys it sees [lo, hi] (sequence key indices; rows past the CTA's valid ones take the
//    last valid row's, and are not written) --
struct MlaRows {
  int lo[2], hi[2];
};

__device__ __forceinline__ MlaRows mla_rows(const DecodeParams& p, const MlaWork& w, int lane,
                                            int warp) {
  MlaRows rows;
  const int diag = w.s.seqlen_k - w.s.seqlen_q;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = 16 * warp + lane / 4 + 8 * i;
    const int t = (w.row0 + min(r, w.rows - 1)) / p.group;
    rows.lo[i] = max(t + diag - p.window_left, 0);
    rows.hi[i] = min(t + diag + p.window_right, w.s.seqlen_k - 1);
  }
  return rows;
}

// -- S of block t -> P in place (unnormalized, against the row max), the factor O must be
//    rescaled by, and this lane's share of P's row sums; row_max: the max after block
//    t - 1 (raw units), then after block t. The max is lazy, as the forward's
//    (OnlineSoftmax::update_lazy): raised only where a row's scores pass it by more than
//    kMlaLazySlack in log2 units, so P stays <= 2^8 and most blocks after a row's first
//    leave its factor 1, and O unscaled (mla_rescale) --
constexpr float kMlaLazySlack = 8.f;
__device__ __forceinline__ void mla_softmax(float (&s)[1][kMlaKeys / 8][4], const MlaRows& rows,
                                            int key0, int lane, float scale_log2,
                                            float (&row_max)[2], float (&corr)[2],
                                            float (&sum)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float before = row_max[i];
    float mx = before;
#pragma unroll
    for (int nt = 0; nt < kMlaKeys / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int key = key0 + nt * 8 + 2 * (lane % 4) + e;
        float& x = s[0][nt][2 * i + e];
        if (key < rows.lo[i] || key > rows.hi[i]) x = -CUFA_INF;
        mx = fmaxf(mx, x);
      }
    mx = quad_max(mx);
    // (-inf until the row sees a key: -inf + slack stays -inf, so its first key raises)
    corr[i] = 1.f;
    if (mx * scale_log2 > before * scale_log2 + kMlaLazySlack) {
      corr[i] = fast_exp2((before - mx) * scale_log2);
      row_max[i] = mx;
    }
    // (no key seen yet: exp2 of -inf - -inf would be NaN)
    const float base = row_max[i] == -CUFA_INF ? 0.f : row_max[i] * scale_log2;
    float row_sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < kMlaKeys / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[0][nt][2 * i + e];
        x = fast_exp2(x * scale_log2 - base);
        row_sum += x;
      }
    sum[i] = row_sum;  // (this lane's share)
  }
}

// (O's 128 multiplies a thread only where a row of the warp's 16 was raised: no product
// may be in flight on O here)
template <int kDTiles>
__device__ __forceinline__ void mla_rescale(float (&o)[1][kDTiles][4], float (&l)[2],
                                            const float (&corr)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) l[i] *= corr[i];
  if (!__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) return;
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[0][dt][e] *= corr[e / 2];
}

// -- P (this warp's 16 rows x 32 keys, as A fragments) into the consumer's P panel, the
//    K-major A operand of the other consumer's P V --
__device__ __forceinline__ void mla_stage_p(const u32 (&a)[kMlaKeys / 16][4], u32 sp, int warp,
                                            int lane) {
  const int m = lane / 8;  // (lane's address: row lane % 8 of matrix m)
  const int row = 16 * warp + (m & 1) * 8 + lane % 8;
#pragma unroll
  for (int kk = 0; kk < kMlaKeys / 16; ++kk)
    stmatrix_x4(sp + panel_offset<kMlaRows>(row, 2 * kk + (m >> 1)), a[kk][0], a[kk][1],
                a[kk][2], a[kk][3]);
}

// -- the output: O / l of each row (and lse, by consumer 0), or a split's normalized
//    share and its lse. Unsplit, where the CTA's rows lie a stride apart (one token's
//    heads, or tokens whose heads are laid out back to back), O goes out through shared
//    memory (Q's and the ring's, free once both consumers have met), whole rows per
//    store: 2 us against 4 from registers, a quad storing 4 bytes of 8 rows at a time. A
//    split's float shares staged so measured 1.5 us slower (H200), and go out directly --
template <int kDtype, int kDTiles>
__device__ __forceinline__ void mla_write(const DecodeParams& p, const MlaWork& w,
                                          const float (&o)[1][kDTiles][4], const float (&m)[2],
                                          const float (&l)[2], float scale_log2, int consumer,
                                          int warp, int lane, u32 stage) {
  const int split = blockIdx.x / p.num_m_blocks;
  const bool one_token = p.seqlen_q == 1 || p.group % kMlaRows == 0;
  const bool staged =
      p.num_splits == 1 && (one_token || p.o_row_stride == p.group * p.o_head_stride);
  if (staged) {
    float on[1][kDTiles][4];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float inv = sink_row_scale(m[i] * scale_log2, l[i], -CUFA_INF).inv;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
        for (int e = 0; e < 2; ++e) on[0][dt][2 * i + e] = o[0][dt][2 * i + e] * inv;
    }
    const int t0 = w.row0 / p.group, h0 = blockIdx.y * p.group + w.row0 % p.group;
    u16* dst = reinterpret_cast<u16*>(p.o) + w.s.b * p.o_batch_stride +
               (w.s.q_row0 + t0) * p.o_row_stride + h0 * p.o_head_stride + consumer * kMlaHalf;
    const int cols = kMlaHalf;
    store_rows_staged<kDtype, kMlaRows, kMlaHalf, kMlaHalf>(
        on, dst, p.o_head_stride, w.rows, cols, stage + consumer * (kMlaRows * kMlaHalf * 2),
        16 * warp, 16 * warp, lane);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = 16 * warp + lane / 4 + 8 * i;
    if (r >= w.rows) continue;
    const int gr = w.row0 + r;
    const int t = gr / p.group, h = blockIdx.y * p.group + gr % p.group;
    const RowScale n = sink_row_scale(m[i] * scale_log2, l[i], -CUFA_INF);
    const int col0 = consumer * kMlaHalf + 2 * (lane % 4);
    if (p.num_splits > 1) {
      const i64 o_row = ((i64)(split * p.batch + w.s.b) * p.seqlen_q + t) * p.nheads + h;
      float* dst = reinterpret_cast<float*>(p.o_partial) + o_row * kMlaLatent + col0;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt)
        *reinterpret_cast<float2*>(dst + dt * 8) =
            make_float2(o[0][dt][2 * i] * n.inv, o[0][dt][2 * i + 1] * n.inv);
      if (consumer == 0 && lane % 4 == 0)
        reinterpret_cast<float*>(p.lse_partial)[((i64)(split * p.batch + w.s.b) * p.nheads + h) *
                                                    p.seqlen_q + t] = n.lse;
    } else {
      u16* dst = reinterpret_cast<u16*>(p.o) + w.s.b * p.o_batch_stride +
                 (w.s.q_row0 + t) * p.o_row_stride + h * p.o_head_stride + col0;
#pragma unroll
      for (int dt = 0; dt < kDTiles && !staged; ++dt)
        *reinterpret_cast<u32*>(dst + dt * 8) =
            pack2<kDtype>(o[0][dt][2 * i] * n.inv, o[0][dt][2 * i + 1] * n.inv);
      if (consumer == 0 && lane % 4 == 0 && p.lse)
        reinterpret_cast<float*>(p.lse)[w.s.b * p.lse_batch_stride + h * p.lse_head_stride +
                                        w.s.q_row0 + t] = n.lse;
    }
  }
}

// grid: (num_m_blocks * num_splits, nheads_k, batch); 384 threads: the producer
// warpgroup, then consumers 0 and 1. maps (kTma): k's (the rope) and v's (the latent)
// (columns, rows, heads, pages or batch) views in boxes of 32 rows (kFp8: the latent's
// bytes as bfloat16 pairs, in k's slot too), and in the q and k_tail slots qv's and q's
// (columns, heads, tokens, batch) views in boxes of 64 heads; unused otherwise. kFp8: the
// caches hold e4m3.
template <int kDtype, bool kTma, bool kFp8>
__global__ void __launch_bounds__(kMlaThreads, 1) decode_mla_kernel(const DecodeParams p,
                                                            const __grid_constant__ TensorMaps maps) {
  constexpr int kDTiles = kMlaHalf / 8;
  constexpr int kNTiles = kMlaKeys / 8;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  using Smem = MlaSmem<kFp8>;
  constexpr int kStages = Smem::kStages;
  constexpr int kQRegSteps = kMlaQRegSteps<kFp8>, kQSmemSteps = kMlaQSmemSteps<kFp8>;
  const Smem sm{(smem_u32(smem_raw) + 1023) & ~1023u};
  if (threadIdx.x == 0) mla_trace(kMlaStart);
  MlaWork w;
  if (!mla_work(p, w)) return;  // (the whole CTA: no barrier has been met yet)
  if (threadIdx.x == 0) mla_trace(kMlaBlocks, w.blocks);
  if (kTma && threadIdx.x == 0) {  // (fetched while the barriers are set up)
    prefetch_tensor_map(maps.q);
    prefetch_tensor_map(maps.k_tail);
    if (!kFp8) prefetch_tensor_map(maps.k);
    prefetch_tensor_map(maps.v);
  }
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(sm.full(s), 128);  // each producer thread's copies, or its arrival
      mbar_init(sm.empty(s), 2);   // one thread a consumer
    }
    for (int s = 0; s < Smem::kStaged; ++s) mbar_init(sm.staged_full(s), 128);  // (copies)
    mbar_init(sm.q_full(), kMlaThreads);
    if (kTma) asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // (for the copy engine)
  }
  __syncthreads();
  if (kTma && mla_q_boxed(p)) {
    if (threadIdx.x == 0) mla_box_q(p, maps, w, sm.q(), sm.q_full());  // (before its arrival)
  } else {
    mla_copy_q(p, w, sm.q());
  }
  cp_async_mbar_arrive(sm.q_full());
  if (threadIdx.x < 128) {
    setmaxnreg_dec<kMlaProducerRegs<kFp8>>();
    if constexpr (kFp8)
      mla_produce_e4m3<kDtype, kTma>(p, maps, w, sm, threadIdx.x);
    else
      mla_produce<kTma>(p, maps, w, sm, threadIdx.x);
    if (threadIdx.x == 0) mla_trace(kMlaProducerEnd);
    return;
  }
  setmaxnreg_inc<kMlaConsumerRegs<kFp8>>();
  const int consumer = threadIdx.x / 128 - 1, tid = threadIdx.x % 128;
  const int warp = tid / 32, lane = tid % 32;
  const float scale_log2 = p.scale_log2;
  const MlaRows rows = mla_rows(p, w, lane, warp);
  float* s_max = sm.row_floats(smem_raw, Smem::kMax);    // [block parity][row]
  float* s_corr = sm.row_floats(smem_raw, Smem::kCorr);  // [block parity][row]
  float* s_sum = sm.row_floats(smem_raw, Smem::kSum);    // [consumer][row]
  // an e4m3 cache's scales: the scores' latent and rotary parts (each e4m3 value was
  // widened to itself over e4m3_to_half_scale<kDtype, true>()), and the output's (the latent's)
  const float latent_scale = kFp8 ? cache_descale(p.v_descale, p.v_descale_batch_stride,
                                                  p.v_descale_head_stride, w.s.b, blockIdx.y) *
                                        e4m3_to_half_scale<kDtype, true>() : 1.f;
  const float rope_scale = kFp8 ? cache_descale(p.k_descale, p.k_descale_batch_stride,
                                                p.k_descale_head_stride, w.s.b, blockIdx.y) *
                                      e4m3_to_half_scale<kDtype, true>() : 1.f;
  const int row_of[2] = {16 * warp + lane / 4, 16 * warp + lane / 4 + 8};

  // K-major Q and K: 8-row groups 1024 bytes apart, 16 columns a k-step; V (a block's
  // latent panels, this consumer's four) MN-major: panels kMlaKeys * 128 bytes apart
  const u64 q_desc = smem_desc(sm.q(), 16, 1024);
  const auto k_desc = [&](int stage) { return smem_desc(sm.block(stage), 16, 1024); };
  const auto v_desc = [&](int stage) {
    return smem_desc(sm.block(stage) + consumer * 4 * kMlaKeys * 128, kMlaKeys * 128, 1024);
  };
  const u64 other_p_desc = smem_desc(sm.p(), 16, 1024);

  float acc_o[1][kDTiles][4];
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_o[0][dt][e] = 0.f;
  // Q's k-steps from kQSmemSteps on, once Q has landed (every consumer waits for it: the
  // epilogue may stage O where Q was)
  mbar_wait(sm.q_full(), 0);
  fence_proxy_async();  // (cp.async wrote Q through the generic proxy; wgmma reads it)
  if (consumer == 0 && tid == 0) mla_trace(kMlaQReady);
  u32 q_frag[kQRegSteps][4];
  if (w.blocks > consumer) {
    const int m = lane / 8;  // (lane's address: row lane % 8 of matrix m, as in mla_stage_p)
    const int row = 16 * warp + (m & 1) * 8 + lane % 8;
#pragma unroll
    for (int j = 0; j < kQRegSteps; ++j)
      ldmatrix_x4(q_frag[j], sm.q() + panel_offset<kMlaRows>(row, 2 * (kQSmemSteps + j) + (m >> 1)));
  }
  float row_max[2] = {-CUFA_INF, -CUFA_INF};  // after the last block this consumer saw
  float l[2] = {0.f, 0.f};                    // this lane's share of the row sums

  const auto release = [&](int block) {
    if (tid == 0) mbar_arrive(sm.empty(block % kStages));
  };
  // the other consumer's block t (its P, rescale factors and max are ready once its
  // barrier completes): O rescaled, then O += P V from shared memory, issued. The
  // caller has waited for this consumer's earlier products on O.
  const auto take_other = [&](int t) {
    named_barrier_sync(kMlaReadyBarrier + consumer, 256);
    // (complete already, as the owner waited for it: this consumer's own acquire of the
    // copies its wgmma reads)
    mbar_wait(sm.full(t % kStages), (t / kStages) & 1);
    fence_proxy_async();
    float corr[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      corr[i] = s_corr[(t & 1) * kMlaRows + row_of[i]];
      row_max[i] = s_max[(t & 1) * kMlaRows + row_of[i]];
    }
    mla_rescale(acc_o, l, corr);
    wgmma_fence();
    const u64 v = v_desc(t % kStages);
#pragma unroll
    for (int kk = 0; kk < kMlaKeys / 16; ++kk)
      wgmma_ss_mn<kDtype>(acc_o, desc_add(other_p_desc, kstep_offset(kk, kMlaRows)),
                          desc_add(v, mn_kstep_offset(kk)), 1);
    wgmma_commit();
  };

  // This consumer's block t: its S, waited for; the other's block t - 1 (other: but for
  // block 0) taken, its P V running under this block's softmax; P handed over; this
  // block's P V, waited for, and the block released at once, so that the producer can
  // refill its buffer while the other consumer works (a block held until this
  // consumer's next S would leave a buffer idle for a block's time). No product is in
  // flight from one block to the next or across a branch (where ptxas serializes every
  // wgmma of the kernel, C7514): the first block is peeled off the loop, its flag a
  // constant where it is inlined.
  const auto own_block = [&](int t, bool other) {
    const int stage = t % kStages;
    mbar_wait(sm.full(stage), (t / kStages) & 1);
    // (cp.async wrote the block through the generic proxy, and the producer could not
    // fence what had not landed: the reader orders its wgmma after what it acquired)
    fence_proxy_async();
    float acc_s[1][kNTiles][4];
    float acc_rope[1][kNTiles][4];  // (e4m3: the rotary part, under its own descale)
    wgmma_fence();
    const u64 k = k_desc(stage);
    static_assert(kQSmemSteps <= kMlaLatentSteps, "Q's k-steps in shared memory: the latent's");
#pragma unroll
    for (int ks = 0; ks < kQSmemSteps; ++ks)
      wgmma_ss<kDtype>(acc_s, desc_add(q_desc, kstep_offset(ks, kMlaRows)),
                       desc_add(k, kstep_offset(ks, kMlaKeys)), ks > 0);
#pragma unroll
    for (int j = 0; j < kQRegSteps; ++j) {
      const int ks = kQSmemSteps + j;
      if (kFp8 && ks >= kMlaLatentSteps)
        wgmma_rs_k<kDtype>(acc_rope, q_frag[j], desc_add(k, kstep_offset(ks, kMlaKeys)),
                           ks > kMlaLatentSteps);
      else
        wgmma_rs_k<kDtype>(acc_s, q_frag[j], desc_add(k, kstep_offset(ks, kMlaKeys)), 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(acc_s);
    if constexpr (kFp8) {
      fence_registers(acc_rope);
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          acc_s[0][nt][e] = acc_s[0][nt][e] * latent_scale + acc_rope[0][nt][e] * rope_scale;
    }
    if (other) take_other(t - 1);
    // -- the softmax against the max after block t - 1 --
    float corr[2], sum[2];
    mla_softmax(acc_s, rows, w.key0 + t * kMlaKeys, lane, scale_log2, row_max, corr, sum);
    u32 p_frag[kMlaKeys / 16][4];
    pack_p<kDtype>(p_frag, acc_s);
    if (t == 0 && tid == 0) mla_trace(kMlaFirstP);  // (block 0 is consumer 0's)
    // -- the other's P V of block t - 1 done before P is staged: it reads this
    //    consumer's O and the one P panel, which this block's P overwrites (the panel's
    //    hand-over rests on this wait; no P V of the other's block may still be in flight
    //    here) --
    if (other) {
      wgmma_wait<0>();
      fence_registers(acc_o);
      release(t - 1);
    }
    mla_stage_p(p_frag, sm.p(), warp, lane);
    if (lane % 4 == 0) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        s_max[(t & 1) * kMlaRows + row_of[i]] = row_max[i];
        s_corr[(t & 1) * kMlaRows + row_of[i]] = corr[i];
      }
    }
    fence_proxy_async();  // (the P panel, stored through the generic proxy, is read by wgmma)
    named_barrier_arrive(kMlaReadyBarrier + 1 - consumer, 256);
    // -- O += P V of block t, from registers --
    mla_rescale(acc_o, l, corr);
#pragma unroll
    for (int i = 0; i < 2; ++i) l[i] += sum[i];
    wgmma_fence();
    const u64 v = v_desc(stage);
#pragma unroll
    for (int kk = 0; kk < kMlaKeys / 16; ++kk)
      wgmma_rs<kDtype>(acc_o, p_frag[kk], desc_add(v, mn_kstep_offset(kk)), 1);
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(acc_o);
    release(t);
  };
  if (w.blocks > consumer) {
    if (consumer == 0)
      own_block(0, false);
    else
      own_block(1, true);
    for (int t = consumer + 2; t < w.blocks; t += 2) own_block(t, true);
  }
  // -- the other's last block, where it has the last one --
  const int last = w.blocks - 1;
  if (last >= 0 && last % 2 != consumer) {
    take_other(last);
    wgmma_wait<0>();
    fence_registers(acc_o);
  }

  if (consumer == 0 && tid == 0) mla_trace(kMlaLoopEnd);
  // -- the row sums over both consumers (both rescaled to the last max), then the output --
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] = quad_sum(l[i]);
    if (lane % 4 == 0) s_sum[consumer * kMlaRows + row_of[i]] = l[i];
  }
  named_barrier_sync(kMlaEndBarrier, 256);
#pragma unroll
  for (int i = 0; i < 2; ++i) l[i] += s_sum[(1 - consumer) * kMlaRows + row_of[i]];
  if constexpr (kFp8) {  // (v's descale, with 1 / l in mla_write)
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[0][dt][e] *= latent_scale;
  }
  mla_write<kDtype>(p, w, acc_o, row_max, l, scale_log2, consumer, warp, lane, sm.q());
  if (consumer == 0 && tid == 0) mla_trace(kMlaWritten);
}

}  // namespace cufa
