// Forward attention on Hopper (sm_90a): persistent, warp-specialized. One CTA per SM
// (two on 64-row tiles, below) works through tiles of 128 (64, 192) query rows of one
// (batch, head), taking the next tile of the list from a global counter when it is ready
// for one (tiles differ in cost under a causal mask; a fixed stride left some SMs twice
// the work of others). A producer warp streams Q and the K/V blocks of its tiles into
// shared memory with TMA (a ring of stages, each announced on an mbarrier), running ahead
// across tile boundaries; consumer warpgroups of 64 rows each run both products on
// wgmma (S = Q K^T from shared memory, O += P V with P from registers) and write O (from
// d = 128 through their Q stage). Two consumers take turns issuing their products (named
// barriers), so one's softmax runs under the other's matrix work.
#include "sm90_smem.cuh"
#include "sm90_producer.cuh"
#include "sm90_consumer.cuh"

namespace cufa {

// kHoldPVWait: the P V wait held below the softmax (hold_wait_below; the host picks it,
// _compile.SM90_HOLD_PV_WAIT)
// kE4m3: the fp8 forward (q, k, v e4m3, V transposed by transpose_v_e4m3 beforehand; out
// in kDtype), on padded and packed batches
// kHeadDimV: V's (and O's) padded head dim where V has one of its own (p.head_dim_v its
// columns), else 0
template <int kDtype, int kHeadDim, int kMask, bool kScoreMods, int kBlockM, int kBlockN,
          int kQStages, int kKVStages, bool kHoldPVWait, bool kE4m3 = false, int kHeadDimV = 0>
__global__ void __launch_bounds__(kSm90Threads<kBlockM>, kCtasPerSm<kBlockM>)
    fwd_sm90_kernel(const __grid_constant__ FwdParams p, const __grid_constant__ TensorMaps maps) {
  static_assert(kHeadDim % 64 == 0 && kHeadDimV % 64 == 0 && kBlockN % 16 == 0,
                "whole 128-byte panels, 16-key steps");
  static_assert(!kE4m3 || (kHeadDim % 128 == 0 && kBlockN == 128 && !kScoreMods),
                "fp8: whole 128-byte panels of e4m3, 128-key blocks, no score mods");
  static_assert(kBlockM == 64 || kBlockM == 128 || kBlockM == 192, "one to three consumer warpgroups");
  constexpr int kConsumerThreads = 128 * kConsumers<kBlockM>;
  // setmaxnreg moves registers between warpgroups; it cannot hand out more than the
  // launch allotted (65536 an SM, shared by its CTAs)
  static_assert(128 * kProducerRegs<kBlockM, kE4m3> +
                        kConsumerThreads * kConsumerRegs<kBlockM, kE4m3> <=
                    65536 / kCtasPerSm<kBlockM>,
                "register split over the SM's file");
  extern __shared__ unsigned char smem_raw[];
  const Sm90Smem<kBlockM, kHeadDim, kBlockN, kQStages, kKVStages, kE4m3, kHeadDimV> sm(
      smem_u32(smem_raw));
  if (threadIdx.x == 0) {
    for (int s = 0; s < kQStages; ++s) {
      mbar_init(sm.q_full() + 8 * s, 1);  // the producer's one arrival, plus the bytes its copies bring
      mbar_init(sm.q_empty() + 8 * s, kConsumerThreads);  // every consumer thread is done reading
    }
    for (int s = 0; s < kKVStages; ++s) {
      mbar_init(sm.k_full() + 8 * s, 1);
      mbar_init(sm.v_full() + 8 * s, 1);
      mbar_init(sm.k_empty() + 8 * s, kConsumers<kBlockM>);  // one thread a warpgroup
      mbar_init(sm.v_empty() + 8 * s, kConsumers<kBlockM>);
    }
  }
  __syncthreads();
  if (threadIdx.x < 128) {
    setmaxnreg_dec<kProducerRegs<kBlockM, kE4m3>>();
    if (threadIdx.x < 32) produce<kMask>(p, maps, sm);
    return;
  }
  setmaxnreg_inc<kConsumerRegs<kBlockM, kE4m3>>();
  // Broadcast from lane 0 so that ptxas sees it uniform (as consume's key-block count):
  // the consumer index picks this warpgroup's Q rows.
  const int consumer = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128) - 1, 0);
  consume<kDtype, kMask, kScoreMods, kHoldPVWait>(p, sm, kConsumers<kBlockM> == 1 ? 0 : consumer);
}

}  // namespace cufa
