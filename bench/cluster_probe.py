#!/usr/bin/env python3
"""How thread-block clusters of the split decode's size are placed on this GPU (sm_90):
a spinning kernel with compile-time cluster dims, CLUSTER CTAs a cluster, launched as
GRID CTAs with SMEM bytes of dynamic shared memory each; every CTA records its SM, its
cluster and when it started and ended (%globaltimer). Prints how many clusters ran at once
and how many CTAs shared an SM: whether 8 clusters of 16 (batch 1 x 8 KV heads x 16
splits) run in one wave, one CTA an SM.

    python3 bench/cluster_probe.py
"""
import cupy

SOURCE = r"""
template <int kCluster>
__global__ void __cluster_dims__(kCluster, 1, 1) spin(unsigned long long* out, long long ns) {
  unsigned long long t0, t1;
  unsigned smid, cluster;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(cluster));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  } while ((long long)(t1 - t0) < ns);
  if (threadIdx.x == 0) {  // (the dynamic shared memory is held at launch, used or not)
    out[4 * blockIdx.x] = t0;
    out[4 * blockIdx.x + 1] = t1;
    out[4 * blockIdx.x + 2] = smid;
    out[4 * blockIdx.x + 3] = cluster;
  }
}
"""


def run(cluster, grid, smem, ns=50_000):
    mod = cupy.RawModule(code=SOURCE, options=("-std=c++17",),
                         name_expressions=[f"spin<{cluster}>"])
    fn = mod.get_function(f"spin<{cluster}>")
    fn.max_dynamic_shared_size_bytes = smem
    if cluster > 8:
        from cupy_backends.cuda.api import driver
        driver.funcSetAttribute(fn.kernel.ptr, 14, 1)  # CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
    out = cupy.zeros(4 * grid, dtype=cupy.uint64)
    for _ in range(2):
        fn((grid,), (128,), (out, cupy.int64(ns)), shared_mem=smem)
    cupy.cuda.Device().synchronize()
    rec = out.reshape(grid, 4).get()
    t0 = rec[:, 0].min()
    starts = (rec[:, 0] - t0) / 1e3
    waves = int(starts.max() // (ns / 1e3 * 0.9)) + 1
    per_sm = {}
    for sm in rec[:, 2]:
        per_sm[int(sm)] = per_sm.get(int(sm), 0) + 1
    span = (rec[:, 1].max() - t0) / 1e3
    print(f"cluster {cluster:2d} grid {grid:4d} smem {smem // 1024:3d} KB: span {span:7.1f} us "
          f"(one wave {ns / 1e3:.0f}), waves ~{waves}, SMs used {len(per_sm)}, "
          f"max CTAs an SM {max(per_sm.values())}, starts {starts.min():.1f}-{starts.max():.1f} us")


def main():
    dev = cupy.cuda.Device()
    print("SMs", dev.attributes["MultiProcessorCount"])
    for cluster, grid, smem in ((16, 128, 120 * 1024), (16, 112, 120 * 1024), (16, 96, 120 * 1024),
                                (16, 128, 67 * 1024), (16, 256, 67 * 1024), (8, 120, 120 * 1024),
                                (8, 128, 120 * 1024), (8, 128, 67 * 1024), (8, 256, 67 * 1024),
                                (4, 128, 120 * 1024), (2, 132, 120 * 1024), (12, 96, 120 * 1024)):
        try:
            run(cluster, grid, smem)
        except Exception as e:  # noqa: BLE001 (a size the driver refuses: say so, go on)
            print(f"cluster {cluster} grid {grid} smem {smem // 1024} KB: {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
