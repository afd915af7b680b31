# temporary: the TMA decode kernel's timeline (polled merge), thread 0 of each CTA
import os, sys
sys.path.insert(0, os.getcwd())
import numpy as np, torch
import cufa
from cufa import _compile, api
MAX, SLOTS = 4096, 16
MARK = ("if (threadIdx.x == 0) {{ unsigned long long t_; asm volatile(\"mov.u64 %0, %%globaltimer;\""
        " : \"=l\"(t_)); cufa_tl[((blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x)"
        " % 4096][{i}] = t_; }}\n")
CLK = ("if (threadIdx.x == 0) {{ unsigned long long c_; asm volatile(\"mov.u64 %0, %%clock64;\""
        " : \"=l\"(c_)); cufa_tl[((blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x)"
        " % 4096][{i}] = c_; }}\n")
src = _compile.assembled_source("decode_sm90.cu")
head, body = src.split("\n", 1)
def put(text, i, where, count=1):
    global body
    assert body.count(text) == count, (text, body.count(text))
    m = MARK.format(i=i)
    body = body.replace(text, m + text if where == "before" else text + m)
put("  const u32 full = smem_u32(bars), empty = full + 8 * kStages;\n", 0, "after")
put('      asm volatile("bar.sync 2, %0;\\n" ::"n"(32 * kWarps) : "memory");  // Q landed\n', 1, "after")
put("    box_count += ring_boxes;\n", 2, "after")
TWICE = "twice" in sys.argv
if TWICE:
    sys.argv.remove("twice")
    st = "    stage_warp_outputs<kWarps, Shape::kOStride>("
    i0 = body.index(st)
    wr = "    write_decode_output<kDtype, kHeadDim, Shape>(p, s, m_block, h_k, split, s_out, s_max, s_sum,\n                                                 scale_log2);\n"
    i1 = body.index(wr) + len(wr)
    body = (body[:i0] + "#pragma unroll 1\n    for (int rep_ = 0; rep_ < 2; ++rep_) {\n" + body[i0:i1]
            + MARK.format(i="rep_ ? 9 : 3") + "    }\n" + body[i1:])
else:
    put("    write_decode_output<kDtype, kHeadDim, Shape>(p, s, m_block, h_k, split, s_out, s_max, s_sum,\n                                                 scale_log2);\n", 3, "after")
put("    __syncthreads();  // the staging read before the next unit's copies overwrite the ring\n", 4, "before")
put("    const SplitRow in = poll_split_row(p, s.b, row.t, row.h, lane);\n", 5, "after")
put("  if (!s_last) return;\n", 6, "after")
put("    stage_warp_outputs<kWarps, Shape::kOStride>(", 7, "before")
body = body.replace("    stage_warp_outputs<kWarps, Shape::kOStride>(", CLK.format(i=14) + "    stage_warp_outputs<kWarps, Shape::kOStride>(", 1)
put("  __syncthreads();\n  if (threadIdx.x < kDecodeRows) {\n", 10, "after")
put("  __syncthreads();\n  if (has_state) {\n#pragma unroll\n    for (int i = 0; i < 2; ++i) {\n      const int r = (lane >> 2) + 8 * i;\n", 11, "before")
put("  }\n  __syncthreads();\n}\n\n// -- merge_polled's words", 12, "before")
_t = "  }\n  __syncthreads();\n}\n\n// -- merge_polled's words"
assert body.count(_t) == 1
body = body.replace(_t, "  }\n  __syncthreads();\n" + MARK.format(i=13) + CLK.format(i=6) + "}\n\n// -- merge_polled's words")
# declare the global before namespace use
first = body.index("namespace cufa {")
body = body[:first] + "namespace cufa { __device__ unsigned long long cufa_tl[4096][16]; }\n" + body[first:]
_compile._source_cache["decode_sm90.cu"] = head + " tl\n" + body
mods = []
orig = _compile.raw_module
def keep(v):
    m = orig(v)
    if v.source == "decode_sm90.cu":
        mods.append(m)
    return m
_compile.raw_module = keep
b, n, hk, d = 1, 32768, 8, 64
sets = []
for _ in range(2):
    k, v = (torch.randn(b, n, hk, d, device="cuda", dtype=torch.float16) for _ in range(2))
    q = torch.randn(b, 1, 32, d, device="cuda", dtype=torch.float16)
    sets.append((q, k, v, torch.full((b,), n, device="cuda", dtype=torch.int32)))
import cupy
for mode in sys.argv[1:] or ["polled", "counter"]:
    api.clear_plans()
    call = lambda q, k, v, l: cufa.flash_attn_with_kvcache(q, k, v, cache_seqlens=l)
    call(*sets[0])
    plans = [pl for key, pl in api._plans.items() if key[0] == "kvcache"]
    if mode == "counter":
        for pl in plans: pl.polled_words = ()
    if mode == "combine":
        for pl in plans: pl.merge_in_launch = False
    for i in range(30): call(*sets[i % 2])
    torch.cuda.synchronize()
    arr = cupy.ndarray((MAX, SLOTS), dtype=cupy.uint64, memptr=mods[-1].get_global("cufa::cufa_tl") if False else mods[-1].get_global("_ZN4cufa7cufa_tlE"))
    arr.fill(0)
    call(*sets[0]); torch.cuda.synchronize()
    t = cupy.asnumpy(arr)
    t = t[t[:, 0] > 0]
    t0 = t[:, 0].min()
    rel = lambda i: (t[:, i].astype(np.int64) - int(t0)) / 1e3
    pct = lambda x: f"{np.min(x):.2f}/{np.median(x):.2f}/{np.max(x):.2f}"
    print(f"{mode}: {len(t)} CTAs; entry {pct(rel(0))} | Q {pct(rel(1)-rel(0))} | loop end {pct(rel(2))} | staged {pct(rel(7)-rel(2))} | written {pct(rel(3)-rel(7))} | end {pct(rel(4))}")
    print(f"   barrier1 at {pct(rel(10)-rel(7))}, barrier2 at {pct(rel(11)-rel(7))}, before barrier3 {pct(rel(12)-rel(7))}, after {pct(rel(13)-rel(7))}")
    cyc = (t[:, 6].astype(np.int64) - t[:, 14].astype(np.int64)) / ((t[:, 13].astype(np.int64) - t[:, 7].astype(np.int64)))
    print(f"   SM clock over the staging: {pct(cyc)} GHz")
    if TWICE:
        print(f"   second stage+write pass {pct(rel(9) - rel(3))}")
    m = t[:, 5] > 0
    if m.any():
        print(f"   pollers {m.sum()}: written at {pct(rel(3)[m])}, polled at {pct(rel(5)[m])}, end {pct(rel(4)[m])}; last written overall {rel(3).max():.2f}")
    m = t[:, 6] > 0
    if m.any():
        print(f"   counter-last {m.sum()}: written at {pct(rel(3)[m])}, knows last {pct(rel(6)[m])}, end {pct(rel(4)[m])}; last written overall {rel(3).max():.2f}")
