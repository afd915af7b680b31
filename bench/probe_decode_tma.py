#!/usr/bin/env python3
"""A decode kernel whose K/V tiles come by TMA, timed against cufa's decode kernel on the
same calls (sm_90, d = 64, contiguous caches; a probe, not wired into the library).

`bench/probe_kv_rows.py` measured the copy engine reading one KV head's stripe of a large
cache at 3.1 TB/s where per-thread loads read 3.0, which is the ~4 % cuDNN's decode leads
ours by on d = 64's large rows. This kernel keeps the decode kernel's math (its device
functions, from kernels_cu/decode.cu) and changes where the bytes come from: one producer
lane issues a 64-key box of K and one of V a stage (tensor maps encoded by cufa._tma,
128-byte swizzle, which at d = 64 is the layout `Swizzle<64>` gives ldmatrix) into a
CTA-wide ring of mbarrier stages; each of four consumer warps takes 16 keys of a box. TMA
fills past the map's end, not past cache_seqlens, so a warp whose 16 keys cross the
sequence's end zeroes their V rows in shared memory before the P V product (a NaN in an
unused slot would otherwise make P = 0 times V NaN).

The probe swaps the decode launch of a planned call for this kernel (same params record,
grid and split count; splits then cut 64-key boxes instead of 16-key tiles; the partials
merge in decode_combine), checks the output against cufa's own (with NaN in every slot past
the sequences), and times both from CUDA graph replays beside SDPA cuDNN.

    python3 bench/probe_decode_tma.py [--stages 3,4,8] [--rounds 4]
"""
import argparse
import ctypes
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cupy  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import cufa  # noqa: E402
from cufa import _compile, _tma, api, kvcache  # noqa: E402

KERNEL = r"""
namespace cufa {

struct DecodeMaps {
  TensorMap k, v;  // the cache as (columns, positions, KV heads, cache rows)
};

// The epilogue helpers' view of this kernel: four consumer warps (their softmax states
// merge), 160 threads (the producer warp helps write the output)
struct TmaDecodeShape {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 160;
  static constexpr int kOStride = 64 + 4;
};

// kUnits: (sequence, KV head) units a CTA takes one after another (heads blockIdx.y,
// + gridDim.y, ...): fewer concurrent streams over the cache
template <int kDtype, int kStages, int kUnits>
__global__ void __launch_bounds__(160) decode_tma_kernel(const __grid_constant__ DecodeParams p,
                                                         const __grid_constant__ DecodeMaps maps) {
  constexpr int kHeadDim = 64, kWarps = 4, kBoxKeys = 64, kDTiles = kHeadDim / 8;
  constexpr u32 kBoxBytes = kBoxKeys * 128;
  constexpr u32 kStageBytes = 2 * kBoxBytes;  // K, then V
  using Shape = TmaDecodeShape;
  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) unsigned long long bars[2 * kStages];  // full, then empty
  __shared__ float s_warp_max[kWarps][kDecodeRows], s_warp_sum[kWarps][kDecodeRows];
  __shared__ float s_max[kDecodeRows], s_sum[kDecodeRows];

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const u32 base = (smem_u32(smem_raw) + 1023) & ~1023u;  // the swizzle's 1 KB period
  const u32 sq = base;
  const u32 ring = base + 2048;  // after Q's 16 rows
  const u32 full = smem_u32(bars), empty = full + 8 * kStages;
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
    const int h_k = blockIdx.y + unit * gridDim.y;
    const int b = blockIdx.z;
    const CacheSeq s = cache_seq(p, b);
    const int rows = min(kDecodeRows, s.seqlen_q * p.group - m_block * kDecodeRows);
    if (rows <= 0) continue;
    const KeySpan span = visible_span(p, s.seqlen_k, s.seqlen_q, (m_block * kDecodeRows) / p.group,
                                      (m_block * kDecodeRows + rows - 1) / p.group);
    const int num_boxes = (span.end - span.begin + kBoxKeys - 1) / kBoxKeys;
    const int split_boxes = (num_boxes + p.num_splits - 1) / p.num_splits;
    const int box_begin = min(split * split_boxes, num_boxes);
    const int my_boxes = min(box_begin + split_boxes, num_boxes) - box_begin;

    const u16* q = reinterpret_cast<const u16*>(p.q);
    if (warp < kWarps) {
      copy_rows_async<kDecodeRows, kHeadDim, 128>(
          sq, [&](int r) {
            const DecodeRow row = decode_row(p, s, m_block, h_k, r);
            return q + s.b * p.q_batch_stride + (s.q_row0 + row.t) * p.q_row_stride +
                   row.h * p.q_head_stride;
          },
          q, rows, p.head_dim, [](int r, int c) { return Swizzle<kHeadDim>::offset(r, c); },
          threadIdx.x);
      cp_async_commit();
      cp_async_wait<0>();
    }
    __syncthreads();  // Q landed

    float acc_o[1][kDTiles][4];
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[0][dt][e] = 0.f;
    OnlineSoftmax<1> softmax;
    softmax.init();
    const bool score_mods = p.softcap > 0.f || p.alibi_slopes;
    const float scale_log2 = score_mods ? 1.f : p.scale_log2;

    if (warp == kWarps) {  // -- the producer: one lane issues every box --
      if (lane == 0) {
        for (int j = 0; j < my_boxes; ++j) {
          const int g = box_count + j, st = g % kStages;
          if (g >= kStages) mbar_wait(empty + 8 * st, ((g / kStages) - 1) & 1);
          mbar_arrive_expect_bytes(full + 8 * st, kStageBytes);
          const int pos = s.start + span.begin + (box_begin + j) * kBoxKeys;
          tma_load_4d(ring + st * kStageBytes, maps.k, full + 8 * st, 0, pos, h_k, s.row);
          tma_load_4d(ring + st * kStageBytes + kBoxBytes, maps.v, full + 8 * st, 0, pos, h_k, s.row);
        }
      }
    } else {  // -- a consumer warp: 16 keys of every box --
      const LaneRows lr = lane_rows(p, s, m_block, h_k, lane);
      const int t_first = (m_block * kDecodeRows) / p.group;
      const int t_last = (m_block * kDecodeRows + rows - 1) / p.group;
      const i64 all_lo = visible_span(p, s.seqlen_k, s.seqlen_q, t_last, t_last).begin;
      const i64 all_hi = visible_span(p, s.seqlen_k, s.seqlen_q, t_first, t_first).end;
      const LdmatrixAddr<kHeadDim> q_frag(sq, lane & 15, lane >> 4);
      for (int j = 0; j < my_boxes; ++j) {
        const int g = box_count + j, st = g % kStages;
        mbar_wait(full + 8 * st, (g / kStages) & 1);
        const int key0 = span.begin + (box_begin + j) * kBoxKeys + warp * kTileKeys;
        if (key0 < span.end) {
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
#pragma unroll
          for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_s[0][nt][e] = 0.f;
          const LdmatrixAddr<kHeadDim> k_frag(k_tile, (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
          gemm_qk<kDtype>(acc_s, q_frag, k_frag);
          if (score_mods) decode_score_mods(acc_s, p, s, lr, key0, lane);
          if (key0 < all_lo || key0 + kTileKeys > all_hi) decode_mask(acc_s, lr, key0, lane);
          float correction[1][2];
          softmax.update(acc_s, scale_log2, correction);
          softmax.rescale_output(acc_o, correction);
          const LdmatrixAddr<kHeadDim> v_frag(v_tile, (lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4);
          gemm_pv<kDtype>(acc_o, acc_s, v_frag);
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(empty + 8 * st);
      }
    }
    box_count += my_boxes;

    // -- merge the consumer warps, then write (decode_kernel's epilogue) --
    if (warp < kWarps) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float sum = quad_sum(softmax.row_sum[0][i]);
        if ((lane & 3) == 0) {
          s_warp_max[warp][(lane >> 2) + 8 * i] = softmax.row_max[0][i];
          s_warp_sum[warp][(lane >> 2) + 8 * i] = sum;
        }
      }
    }
    __syncthreads();
    if (threadIdx.x < kDecodeRows) {
      const int r = threadIdx.x;
      float mx = -CUFA_INF;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, s_warp_max[w][r]);
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w)
        if (s_warp_max[w][r] != -CUFA_INF)
          sum += s_warp_sum[w][r] * fast_exp2((s_warp_max[w][r] - mx) * scale_log2);
      s_max[r] = mx;
      s_sum[r] = sum;
    }
    __syncthreads();
    float* s_out = reinterpret_cast<float*>(smem_raw + (ring - smem_u32(smem_raw)));
    if (warp < kWarps) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = (lane >> 2) + 8 * i;
        const float mine = softmax.row_max[0][i];
        const float factor = mine == -CUFA_INF ? 0.f : fast_exp2((mine - s_max[r]) * scale_log2);
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt)
          *reinterpret_cast<float2*>(&s_out[(warp * kDecodeRows + r) * Shape::kOStride + dt * 8 + 2 * (lane & 3)]) =
              make_float2(acc_o[0][dt][2 * i] * factor, acc_o[0][dt][2 * i + 1] * factor);
      }
    }
    __syncthreads();
    write_decode_output<kDtype, kHeadDim, Shape>(p, s, m_block, h_k, split, s_out, s_max, s_sum,
                                                 scale_log2);
    __syncthreads();  // the staging read before the next unit's copies overwrite the ring
    if (warp == kWarps && lane == 0) fence_proxy_async();  // generic writes, then TMA's
  }
}

}  // namespace cufa
"""


def build(stages_list):
    seen = set()
    body = _compile._inline("decode.cu", seen) + _compile._inline("sm90.cuh", seen)
    from cufa import _params
    body += "\n" + _params.layout_asserts(_params.DECODE) + KERNEL
    names = [f"cufa::decode_tma_kernel<{dt}, {st}, {u}>" for dt in (0, 1) for st in stages_list
             for u in (1, 2)]
    mod = cupy.RawModule(code=body, options=("-std=c++17",), name_expressions=names)
    out = {}
    for dt in (0, 1):
        for st in stages_list:
            for u in (1, 2):
                fn = mod.get_function(f"cufa::decode_tma_kernel<{dt}, {st}, {u}>")
                smem = 1024 + 2048 + st * 2 * 64 * 128
                fn.max_dynamic_shared_size_bytes = smem
                out[(dt, st, u)] = (fn, smem, u)
    return out


def cache_maps(k, v):
    """K's and V's tensor maps (64 columns x 64 positions boxes), as one 256-byte record."""
    buf = ctypes.create_string_buffer(256 + 64)
    at = ctypes.addressof(buf) + (-ctypes.addressof(buf) % 64)
    for i, x in enumerate((k, v)):
        b, n, hk, d = x.shape
        ok = _tma._encode_at(at + 128 * i, "float16" if x.dtype == torch.float16 else "bfloat16",
                             x.data_ptr(), (b, n, hk, d), tuple(x.stride()), 64)
        assert ok
    return (ctypes.c_char * 256).from_buffer_copy(ctypes.string_at(at, 256))


_mode = {"tma": None, "maps": None}
_driver_launch = api.driver_launch
_launch_decode = kvcache._launch_decode
_decode_functions = set()


def _patched_launch(function, blocks, threads, smem, stream, args):
    tma = _mode["tma"]
    if tma is not None and function in _decode_functions:
        fn, tma_smem, units = tma
        x, y, z = blocks
        return _driver_launch(fn.kernel.ptr, (x, y // units, z), 160, tma_smem, stream,
                              args + (_mode["maps"],))
    return _driver_launch(function, blocks, threads, smem, stream, args)


def _patched_decode(record, launches, workspace, merge_in_launch, *a, **kw):
    for entry in launches:
        if entry[0] == "decode":
            _decode_functions.add(entry[1])
    return _launch_decode(record, launches, workspace, False, *a, **kw)


api.driver_launch = _patched_launch
kvcache._launch_decode = _patched_decode


def graph_us(fn, reps=20):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start, stop in events:
        start.record()
        graph.replay()
        stop.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1e3 for a, b in events)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8x16384:32,1x131072:8,1x32768:8,8x16384:8,64x4096:8,"
                                        "1x131072:32,128x2048:8")
    ap.add_argument("--stages", default="3,4,8")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--splits", type=int, default=0, help="num_splits of the timed calls (0: planned)")
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}")
    stages_list = [int(x) for x in args.stages.split(",")]
    kernels = build(stages_list)
    d = 64
    for shape in args.shapes.split(","):
        bn, hk = shape.split(":")
        b, n = (int(x) for x in bn.split("x"))
        hk = int(hk)
        q = torch.randn(b, 1, 32, d, dtype=torch.float16, device="cuda")
        k, v = (torch.randn(b, n, hk, d, dtype=torch.float16, device="cuda") for _ in range(2))
        maps = cache_maps(k, v)
        # -- correctness: lengths short of the capacity, NaN in every slot past them --
        lens = torch.randint(max(1, n // 2), n + 1, (b,), dtype=torch.int32, device="cuda")
        lens[0] = n - 37 if n > 37 else n
        kn, vn = k.clone(), v.clone()
        for i, ln in enumerate(lens.tolist()):
            kn[i, ln:] = float("nan")
            vn[i, ln:] = float("nan")
        maps_nan = cache_maps(kn, vn)
        _mode["tma"] = None
        api._plans.clear()
        want = cufa.flash_attn_with_kvcache(q, kn, vn, cache_seqlens=lens)
        errs = []
        for st in stages_list:
            for units in (1, 2) if hk % 2 == 0 else (1,):
                _mode["tma"], _mode["maps"] = kernels[(0, st, units)], maps_nan
                api._plans.clear()
                got = cufa.flash_attn_with_kvcache(q, kn, vn, cache_seqlens=lens)
                errs.append((got.float() - want.float()).abs().max().item())
        ok = all(e < 2e-3 for e in errs)
        del kn, vn
        # -- time: graph replays, full caches --
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        runs = ([("cufa", None)] + [(f"tma{st}", (st, 1)) for st in stages_list] +
                [(f"tma{st}x2", (st, 2)) for st in stages_list if hk % 2 == 0] + [("cudnn", -1)])
        times = {}
        for _ in range(args.rounds):
            random.shuffle(runs)
            for name, st in runs:
                if st == -1:
                    def fn():
                        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=hk != 32)
                else:
                    _mode["tma"] = None if st is None else kernels[(0, *st)]
                    _mode["maps"] = maps
                    api._plans.clear()

                    def fn():
                        return cufa.flash_attn_with_kvcache(q, k, v, cache_seqlens=n,
                                                           num_splits=args.splits)
                times.setdefault(name, []).append(graph_us(fn))
        _mode["tma"] = None
        gb = 2 * k.numel() * 2 / 1e9
        base = statistics.median(times["cufa"])
        line = " ".join(f"{nm} {statistics.median(t):.1f} ({statistics.median(t) / base:.3f})"
                        for nm, t in sorted(times.items()))
        print(f"{shape} d=64 ({gb:.2f} GB) splits {args.splits or 'planned'} check {'ok' if ok else 'FAILED'} {[f'{e:.1e}' for e in errs]}: "
              f"{line}", flush=True)
        del k, v


if __name__ == "__main__":
    main()
