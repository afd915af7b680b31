// The decode kernel with its K/V tiles by TMA (sm_90, head dim 64, contiguous caches): on
// an H100 it reads the large caches 1-3.5 % faster than decode_kernel's per-thread
// cp.async (docs/decisions.md: the copy engine reads one KV head's stripe at 3.1 TB/s where
// per-thread loads read 3.0). The math is decode_kernel's, through the same headers;
// what changes is where the bytes come from:
// - one producer lane issues a 64-key box of K and one of V a stage (the maps view the
//   cache as (columns, positions, KV heads, cache rows), 128-byte swizzle: at d = 64 the
//   layout Swizzle<64> gives ldmatrix) into a CTA-wide ring of mbarrier stages; each of
//   four consumer warps takes 16 keys of a box;
// - TMA fills zeros past the map's end, not past cache_seqlens, so a warp whose keys cross
//   the sequence's end zeroes those V rows in shared memory (a NaN in an unused slot
//   would make P = 0 times V NaN; their scores are masked);
// - kUnits (sequence, KV head) units a CTA, one after another (sequences blockIdx.z,
//   + gridDim.z): where the units outnumber the SMs, one stream a CTA over the cache reads
//   faster than two. The CTAs that run at once take every KV head of their sequences, so
//   together they read whole cache rows (all heads of a position), as the one-unit grid
//   does; pairing heads h and h + H/2 instead had them read half rows;
// - splits cut 64-key boxes (split_boxes); their partials merge as decode_kernel's do (in
//   the launch, by the last split to finish, for an eager call with one unit a CTA; else
//   decode_combine);
// - the start waits on as little as it can: the producer prefetches its maps' descriptors
//   and issues the ring's first boxes before cache_seq's lengths land (their positions
//   need none), and Q's copies go out before the lengths too; only the consumer warps
//   wait for Q, on a named barrier. (An H100 timeline: Q lands ~1.8 us after entry, with
//   the ring's first boxes already in flight; docs/decisions.md.)
#include "cache.cuh"
#include "score.cuh"
#include "epilogue.cuh"
#include "split_merge.cuh"
#include "../common/sm90.cuh"

namespace cufa {

// The epilogue helpers' view of this kernel: four consumer warps (their softmax states
// merge), 160 threads (the producer warp helps write the output)
struct TmaDecodeShape {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 160;
  static constexpr int kOStride = 64 + 4;
};

// How a unit's boxes are dealt to its splits: the first `head` of each split one by one
// (box j of split s: j * splits + s), so that their positions need no length and go out
// before the lengths land; then the rest in one contiguous run a split, as one stream
// reads best (dealt one by one throughout, 1 x 128k 32/32 read 2.6 % slower on an H100).
struct SplitBoxes {
  int head;              // boxes dealt one by one to each split (the ring's stages)
  int count;             // this split's boxes
  int tail_first, splits, split;
  __device__ __forceinline__ int box(int j) const {  // the unit's box of this split's j-th
    return j < head ? j * splits + split : tail_first + (j - head);
  }
};

__device__ __forceinline__ SplitBoxes split_boxes(int boxes, int split, int splits, int head) {
  SplitBoxes sb;
  sb.head = head;
  sb.splits = splits;
  sb.split = split;
  const int dealt = min(boxes, head * splits);
  const int mine = dealt / splits + (split < dealt % splits ? 1 : 0);
  const int rest = boxes - dealt, per = (rest + splits - 1) / splits;
  sb.tail_first = dealt + split * per;
  sb.count = mine + max(0, min(per, rest - split * per));
  return sb;
}

// kUnits: (sequence, KV head) units a CTA takes one after another (sequences blockIdx.z,
// + gridDim.z, ...): fewer concurrent streams over the cache
template <int kDtype, int kStages, int kUnits>
__global__ void __launch_bounds__(160) decode_tma_kernel(const __grid_constant__ DecodeParams p,
                                                         const __grid_constant__ TensorMaps maps) {
  constexpr int kHeadDim = 64, kWarps = 4, kBoxKeys = 64, kDTiles = kHeadDim / 8;
  constexpr u32 kBoxBytes = kBoxKeys * 128;
  constexpr u32 kStageBytes = 2 * kBoxBytes;  // K, then V
  using Shape = TmaDecodeShape;
  static_assert(merge_scratch_bytes(Shape::kThreads) <= kStages * kStageBytes,
                "the merge's weights and partial sums fit the ring");
  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) unsigned long long bars[2 * kStages];  // full, then empty
  __shared__ float s_warp_max[kWarps][kDecodeRows], s_warp_sum[kWarps][kDecodeRows];

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const u32 base = (smem_u32(smem_raw) + 1023) & ~1023u;  // the swizzle's 1 KB period
  const u32 sq = base;
  const u32 ring = base + 2048;  // after Q's 16 rows
  const u32 full = smem_u32(bars), empty = full + 8 * kStages;
  if (threadIdx.x == 32 * kWarps) {  // the producer: its maps fetched while cache_seq loads
    prefetch_tensor_map(maps.k);
    prefetch_tensor_map(maps.v);
  }
  if (threadIdx.x == 0) {
    for (int st = 0; st < kStages; ++st) {
      mbar_init(full + 8 * st, 1);
      mbar_init(empty + 8 * st, kWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  int box_count = 0;  // boxes through the ring so far (their stages and phases)
  for (int unit = 0; unit < kUnits; ++unit) {
    const int m_block = blockIdx.x % p.num_m_blocks, split = blockIdx.x / p.num_m_blocks;
    const int h_k = blockIdx.y;
    const int b = blockIdx.z + unit * gridDim.z;
    if (b >= p.batch) break;  // (the grid rounds the sequences up to whole CTAs)
    // A split's first kStages boxes are dealt one by one (split_boxes), so their positions
    // need no length: where the keys start at cache position 0 of row b, the producer
    // issues them while cache_seq still waits on the lengths (a memory latency the launch
    // saved). Boxes past the sequence are consumed unused.
    const bool first_at_zero = unit == 0 && !p.cache_leftpad && !p.cache_batch_idx &&
                               !p.cu_seqlens_q && p.window_left >= p.capacity &&
                               p.seqlen_q * p.group > m_block * kDecodeRows;  // (rows > 0)
    const int capacity_boxes = (p.capacity + kBoxKeys - 1) / kBoxKeys;
    const int early_boxes =
        first_at_zero ? min(kStages, split_boxes(capacity_boxes, split, p.num_splits, kStages).count)
                      : 0;
    const auto issue_box = [&](int j, int pos, int row) {
      const int g = box_count + j, st = g % kStages;
      if (g >= kStages) mbar_wait(empty + 8 * st, ((g / kStages) - 1) & 1);
      mbar_arrive_expect_bytes(full + 8 * st, kStageBytes);
      tma_load_4d(ring + st * kStageBytes, maps.k, full + 8 * st, 0, pos, h_k, row);
      tma_load_4d(ring + st * kStageBytes + kBoxBytes, maps.v, full + 8 * st, 0, pos, h_k, row);
    };
    if (warp == kWarps && lane == 0)
      for (int j = 0; j < early_boxes; ++j) issue_box(j, (j * p.num_splits + split) * kBoxKeys, b);
    // Q's rows need no length either (no packed batch comes here: the host routes them to
    // decode_kernel), so their copies go out before cache_seq's load is waited on
    const int rows = min(kDecodeRows, p.seqlen_q * p.group - m_block * kDecodeRows);
    if (rows <= 0) continue;  // (never after early boxes: there rows > 0)
    if (warp < kWarps) {
      CacheSeq q_seq{};
      q_seq.b = b;
      q_seq.seqlen_q = p.seqlen_q;
      load_q_rows<kHeadDim, 32 * kWarps>(sq, p, q_seq, m_block, h_k, rows, threadIdx.x);
      cp_async_commit();
    }

    const CacheSeq s = cache_seq(p, b);
    const KeySpan span = visible_span(p, s.seqlen_k, s.seqlen_q, (m_block * kDecodeRows) / p.group,
                                      (m_block * kDecodeRows + rows - 1) / p.group);
    const int num_boxes = (span.end - span.begin + kBoxKeys - 1) / kBoxKeys;
    const SplitBoxes dealt = split_boxes(num_boxes, split, p.num_splits, kStages);
    const int my_boxes = dealt.count;
    const int ring_boxes = max(my_boxes, early_boxes);  // what the ring carries for this unit
    const auto box_key0 = [&](int j) { return span.begin + dealt.box(j) * kBoxKeys; };

    // Q's latency overlaps the first boxes': the producer goes on issuing, and only the
    // consumer warps wait for Q (named barrier 2: threads 0-127)
    if (warp < kWarps) {
      cp_async_wait<0>();
      asm volatile("bar.sync 2, %0;\n" ::"n"(32 * kWarps) : "memory");  // Q landed
    }

    float acc_o[1][kDTiles][4];
    fill(acc_o, 0.f);
    OnlineSoftmax<1> softmax;
    softmax.init();
    const bool score_mods = score_mods_on(p);
    const float scale_log2 = score_mods ? 1.f : p.scale_log2;

    if (warp == kWarps) {  // -- the producer: one lane issues every box --
      if (lane == 0)
        for (int j = early_boxes; j < my_boxes; ++j) issue_box(j, s.start + box_key0(j), s.row);
    } else {  // -- a consumer warp: 16 keys of every box --
      const TileScoring scoring = tile_scoring(p, s, m_block, h_k, rows, lane);
      const LdmatrixAddr<kHeadDim> q_frag(sq, lane & 15, lane >> 4);
      for (int j = 0; j < ring_boxes; ++j) {
        const int g = box_count + j, st = g % kStages;
        mbar_wait(full + 8 * st, (g / kStages) & 1);
        const int key0 = box_key0(j) + warp * kTileKeys;
        if (j < my_boxes && key0 < span.end) {
          const u32 k_tile = ring + st * kStageBytes + warp * kTileKeys * 128;
          const u32 v_tile = k_tile + kBoxBytes;
          if (key0 + kTileKeys > s.seqlen_k) {  // V rows past the sequence: zeros
            for (int idx = lane; idx < kTileKeys * 8; idx += 32) {
              const int r = idx / 8, c = idx % 8;
              if (key0 + r >= s.seqlen_k)
                asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(
                                 v_tile + Swizzle<kHeadDim>::offset(r, c)),
                             "r"(0), "r"(0), "r"(0), "r"(0) : "memory");
            }
            __syncwarp();
          }
          float acc_s[1][2][4];
          fill(acc_s, 0.f);
          score_tile<kDtype>(acc_s, q_frag, k_tile, p, s, scoring, score_mods, key0, lane);
          float correction[1][2];
          softmax.update(acc_s, scale_log2, correction);
          softmax.rescale_output(acc_o, correction);
          accumulate_tile<kDtype, kHeadDim>(acc_o, acc_s, v_tile, lane);
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(empty + 8 * st);
      }
    }
    box_count += ring_boxes;

    // -- merge the consumer warps, then write (decode_kernel's epilogue) --
    float* s_out = reinterpret_cast<float*>(smem_raw + (ring - smem_u32(smem_raw)));
    stage_warp_outputs<kWarps, Shape::kOStride>(softmax, acc_o, warp < kWarps, s_warp_max,
                                                s_warp_sum, s_out, scale_log2);
    write_decode_output<kDtype, kHeadDim, Shape>(p, s, m_block, h_k, split, s_out, s_warp_max,
                                                 s_warp_sum, scale_log2);
    // (one unit a CTA: the split counters are indexed by the grid, as decode_kernel's)
    if (kUnits == 1 && p.num_splits > 1 && p.split_counters)
      merge_if_last<kDtype, Shape::kThreads>(p, s, m_block, h_k, rows, s_out);
    __syncthreads();  // the staging read before the next unit's copies overwrite the ring
    if (warp == kWarps && lane == 0) fence_proxy_async();  // generic writes, then TMA's
  }
}

}  // namespace cufa
