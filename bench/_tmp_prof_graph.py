import sys, os, statistics
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.getcwd() + "/bench")
import torch, torch.nn.functional as F
import cufa
from bench_fwd import queue_ahead
b, n, hk, d = 1, 32768, 8, 64
sets = []
for _ in range(2):
    k, v = (torch.randn(b, n, hk, d, device="cuda", dtype=torch.float16) for _ in range(2))
    q = torch.randn(b, 1, 32, d, device="cuda", dtype=torch.float16)
    lens = torch.full((b,), n, device="cuda", dtype=torch.int32)
    sets.append((q, k, v, lens))
def cufa_call(q, k, v, lens):
    return cufa.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)
def cudnn_call(q, k, v, lens):
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)
def graphs(fn):
    gs = []
    for s in sets:
        fn(*s); torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(*s)
        gs.append(g)
    return gs
for name, fn in (("cufa", cufa_call), ("cudnn", cudnn_call)):
    for mode in ("eager", "graph"):
        gs = graphs(fn) if mode == "graph" else None
        run = (lambda i: gs[i % 2].replay()) if gs else (lambda i: fn(*sets[i % 2]))
        for i in range(20): run(i)
        torch.cuda.synchronize()
        marker = torch.zeros(1, device="cuda")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            queue_ahead(torch, 30)
            for i in range(60):
                marker.add_(1)
                run(i)
            marker.add_(1)
            torch.cuda.synchronize()
        ev = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA)
        calls, cur = [], None
        for s, e, nm in ev:
            if "spin" in nm.lower(): continue
            if "elementwise" in nm.lower() and "add" in nm.lower():
                if cur: calls.append(cur)
                cur = []
                continue
            if cur is not None: cur.append((s, e, nm))
        calls = calls[5:]
        per = {}
        for c in calls:
            for j, (s, e, nm) in enumerate(c):
                per.setdefault((j, nm[:70]), []).append(e - s)
                if j: per.setdefault((j, "gap before"), []).append(s - c[j-1][1])
        spans = [c[-1][1] - c[0][0] for c in calls if c]
        print(f"{name} {mode}: span {statistics.median(spans):.2f} us, {len(calls)} calls")
        for key, t in sorted(per.items()):
            print(f"   {key[0]} {key[1]}: {statistics.median(t):.2f}")
