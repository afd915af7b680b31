#pragma once
// A diagnostic build of the Hopper forward (CUFA_TRACE=1: cufa/_compile.py's
// debug_options): each consumer warpgroup's first thread stamps its tiles' times into a
// global table, which bench/profile/tile_timeline.py reads back to split a launch's time
// into key blocks, per-tile costs, waits for Q and the tail. Without the flag every stamp
// compiles to nothing, so the kernels' code stays as it is.
#include "../common/types.cuh"

namespace cufa {

// The table: kTraceCtas x kTraceTiles x kTraceFields (below). A tile's fields: the SM
// clock (clock64) where consumer 0 began to wait for the tile's Q, where Q was there, where consumer 0 and consumer 1 had written their rows; the
// global timer (ns) at Q's arrival and at consumer 0's end; (head << 32 | query block);
// (batch << 32 | key blocks); the SM clock where consumer 0 had its first block's P and
// where its last P V was complete (its epilogue's start)
enum TraceField {
  kTraceWait = 0, kTraceQReady, kTraceEnd0, kTraceEnd1, kTraceNsReady, kTraceNsEnd0,
  kTraceHeadBlock, kTraceBatchBlocks, kTraceFirstP, kTraceLoopEnd
};

#ifdef CUFA_TRACE
constexpr int kTraceCtas = 264, kTraceTiles = 512, kTraceFields = 10;
extern "C" {
__device__ u64 cufa_tile_trace[kTraceCtas][kTraceTiles][kTraceFields];
}
#endif

__device__ __forceinline__ u64 trace_clock() {
#ifdef CUFA_TRACE
  return clock64();
#else
  return 0;
#endif
}

__device__ __forceinline__ u64 trace_ns() {
#ifdef CUFA_TRACE
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#else
  return 0;
#endif
}

// (only the warpgroup's first thread writes)
__device__ __forceinline__ void trace_tile(int tile, TraceField field, u64 value) {
#ifdef CUFA_TRACE
  if (threadIdx.x % 128 == 0 && blockIdx.x < kTraceCtas && tile < kTraceTiles)
    cufa_tile_trace[blockIdx.x][tile][field] = value;
#endif
}

}  // namespace cufa
