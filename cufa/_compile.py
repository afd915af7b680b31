"""Kernel sources -> compiled functions: source loading, variant keys, NVRTC options, caches.

A variant is one template instantiation, named by a key a person can read
(``fwd_sm90_bf16_hd128_bm128_bn128_window``). Sources are read from ``kernels_cu/`` with
their ``#include "..."`` files inlined, so the string CuPy hashes for its disk
cache covers every header (CuPy's key sees only the top-level string). Compiled
functions are cached in memory per (device, variant); the first use of a variant
compiles it once even when several threads ask at the same time.
"""
import contextlib
import dataclasses
import functools
import hashlib
import importlib.resources
import os
import posixpath
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from . import _dtypes, _params

DTYPES = _dtypes.keys_by_code("kernel")  # ("fp16", "bf16"): index = Dtype in common/types.cuh
MASKS = ("none", "window")          # index = MaskKind in fwd/mask.cuh
FAMILIES = ("sm80", "sm90")         # kernels_cu/fwd/fwd_<family>.cu
MAX_HEAD_DIM = 256

# sm80: mma.sync on any GPU from sm_80 on. Head dims padded to a multiple of 32;
# (block_m, block_n) is the largest tile whose accumulators (O: block_m * head_dim / 128
# floats a thread, S: block_m * block_n / 128) fit in 255 registers without ptxas
# spilling. block_m 128 gives each warp 32 rows, so a K/V fragment read from shared
# memory feeds two MMAs; above head dim 128 only 16 rows a warp fit. The score-mods
# variants need more registers at head dim 128.
SM80_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)
SM80_TILES = {32: (128, 64), 64: (128, 64), 96: (128, 32), 128: (128, 32),
              160: (64, 64), 192: (64, 64), 224: (64, 64), 256: (64, 64)}
SM80_TILES_SCORE_MODS = {**SM80_TILES, 128: (64, 64)}
# Head dims of V (and out) of their own: padded (Q and K's, V's) pairs, V's smaller (out is
# staged over Q's tile); the tiles are Q's head dim's, on either family (the Hopper kernel's
# V stages are then V's width). DeepSeek's prefill (MLA's keys of 128 + 64 rotary dims
# against values of 128).
HEAD_DIM_V_PAIRS = ((192, 128),)
# Head dims above 256, up to WIDE_HEAD_DIM (Gemma 4's global layers), for flash_attn_func and
# flash_attn_varlen_func: the sm80 family's kernel (any GPU) on Q and K padded to 512, V's
# and O's columns in two halves of 256 a query tile (two CTAs, each computing the scores:
# 1.5x the products of one pass; O's 16 rows a warp of 512 columns would not fit in
# registers). 32-key blocks where a block gets 112 KB (A100, H100, H200: 1.12-1.20x the
# TFLOP/s of 16-key blocks on an H200, 64-key ones 0.93-0.96x), else 16-key blocks, which
# keep Q and a K/V block in 99 KB (sm_86/89); 207-247 registers, no spills.
WIDE_HEAD_DIM = 512
# A head dim of v's own above that, on the same kernel: q and k padded to WIDE_QK_HEAD_DIM
# against v's columns in two halves of WIDE_V_HEAD_DIM / 2 (DeepSeek's latent attention in
# its absorbed form: scores over 576 dims, the 512 latent dims as the values). 64 x 32
# tiles take 136 KB (A100, H100, H200); the 64 x 16 ones 108 KB, over sm_86/89's 99.
WIDE_QK_HEAD_DIM, WIDE_V_HEAD_DIM = 640, 512
WIDE_TILES = (64, 32)
WIDE_TILES_PORTABLE = (64, 16)
# CUFA_WIDE_TILES="64xN" (N: 16, 32 or 64) replaces them, to time others: 64-key blocks
# take 160 KB and 250-252 registers without spills (NVRTC 13.0, sm_90); compiled when
# first called.
WIDE_TILES_ENV = "CUFA_WIDE_TILES"
WIDE_KEY_BLOCKS = (16, 32, 64)
# Element-wise I/O (kElementIO in fwd/fwd_sm80.cu and decode/decode_sm80.cu): rows moved an
# element at a time, for calls with an array that cp.async and TMA cannot move in 16-byte
# chunks (any head dim from 1 to 256, any strides: _checks.chunk_aligned). One variant per
# dtype and padded head dim: the forward's has the window mask and the score mods, both
# general at run time (an unbounded window, no mods), on the score-mods tiles.

# sm90: wgmma on Hopper (sm_90a). Head dims padded to whole 128-byte panels (64). Each
# (block_m, block_n) fits its Q stage and two K/V stages in shared memory (227 KB) and, on
# 192-row tiles, the three consumer warpgroups' accumulators in 160 registers; block_n is
# the widest of those that read fastest (docs/decisions.md). Tiles by class
# (_heuristics.sm90_rows picks the class):
# - long: 192 query rows (three consumer warpgroups) up to d = 128, 128 (two) above;
SM90_HEAD_DIMS = (64, 128, 192, 256)
SM90_TILES = {64: (192, 128), 128: (192, 80), 192: (128, 64), 256: (128, 80)}
SM90_TILES_WINDOW = dict(SM90_TILES)  # causal / local (the same; docs/decisions.md)
SM90_TILES_SCORE_MODS = {**SM90_TILES_WINDOW, 128: (128, 64), 256: (128, 32)}  # else ptxas spills
SM90_KV_STAGES = 2  # Sm90Smem::kStages in fwd_sm90.cu, where two fit (else one)
# - a HEAD_DIM_V_PAIRS pair without score mods: V's narrower stages leave room for two of
#   128 keys beside one Q stage (H200, bf16 192/128, 16 heads: 1.10-1.15x the TFLOP/s of
#   128 x 64 from 4k rows, 1.00 and 0.98 at 1k; bench/results/sm90_head_dim_v_h200.md)
SM90_HEAD_DIM_V_TILES = {192: (128, 128)}
# - above 256 (WIDE_HEAD_DIM, one head dim for q, k and v): q and k padded to 512, a query
#   tile two CTAs, each computing the scores and one half of v's and out's 512 columns (as
#   the sm80 family's kernel, whose O would not fit in registers either). Q (128 KB), one
#   64-key K stage (64 KB) and one V stage of 256 columns (32 KB) fill the SM.
SM90_WIDE_TILES = (128, 64)
# - mid: 128-row tiles at d = 128, where a sequence's last 192-row tile would be mostly
#   empty and fewer tiles fill the SMs unevenly; at d = 256 128-key blocks (cuDNN's
#   shape: one K and one V buffer fit, and the kernel waits for each product where it
#   issues it);
SM90_MID_TILES = {128: (128, 128), 256: (128, 128)}
# - short, causal or windowed: 64-row tiles, one consumer warpgroup, two CTAs an SM (half
#   the query-row rounding of 128-row tiles); the two CTAs share the SM's shared memory,
#   so the key blocks are narrower. Without a mask the longer tiles read faster (at
#   d = 128 64-key blocks cost more a FLOP), so there are none.
SM90_SHORT_TILES = {}
SM90_SHORT_TILES_WINDOW = {64: (64, 128), 128: (64, 64)}
# "64" / "128" / "192": force the short, middle or long tiles' table (tests, bench); a head
# dim without tiles of that class gets the next longer class's
SM90_ROWS_ENV = "CUFA_SM90_BLOCK_M"
# Long tiles on which the P V wait is held below the exponentials, so that a warpgroup's
# exponentials run under its own P V (hold_wait_below in sm90.cuh; ptxas otherwise waits
# for P V before the first one): only d = 64's, the one shape where that reads faster on
# long sequences (on short ones it reads slower, so the mid class keeps these tiles
# without it). Score mods spill with it.
SM90_HOLD_PV_WAIT = {64: (192, 128)}
SM90_ROW_CLASSES = {"64": "short", "128": "mid", "192": "long"}

NVRTC_OPTIONS = ("-std=c++17",)
SM90_SMEM_PER_SM = 228 * 1024  # of which the system reserves 1 KB per CTA


@dataclass(frozen=True)
class FwdVariant:
    family: str         # "sm80" | "sm90"
    dtype: str          # "fp16" | "bf16"
    head_dim: int       # padded head dim
    mask: str           # "none" | "window" (causal is a window)
    score_mods: bool    # softcap / ALiBi / explicit attn_mask, chosen at run time
    block_m: int
    block_n: int
    hold_pv_wait: bool = False  # sm90: SM90_HOLD_PV_WAIT
    element_io: bool = False    # sm80: rows moved an element at a time (ELEMENT_IO)
    e4m3_kv: bool = False       # sm80: K and V from an e4m3 cache (q and out stay dtype)
    head_dim_v: int = 0         # V's and out's padded head dim, where not head_dim's
    fp8: bool = False           # sm90: q, k, v e4m3, V transposed beforehand; out in dtype

    @property
    def source(self):
        return f"fwd/fwd_{self.family}.cu"

    @functools.cached_property
    def elem_bytes(self):
        """Bytes an element of q, k, v (and out, but for fp8's)."""
        return 1 if self.fp8 else _dtypes.size_of(self.dtype)

    @functools.cached_property  # read by every launch
    def threads(self):
        # sm90: a producer warpgroup and one consumer warpgroup per 64 rows
        return 128 if self.family == "sm80" else 128 * (1 + self.block_m // 64)

    @functools.cached_property  # read by every launch
    def persistent(self):
        """sm90 kernels loop over tiles: launch at most ctas_per_sm CTAs per SM."""
        return self.family == "sm90"

    @property
    def ctas_per_tile(self):
        """Above head dim 256 two CTAs a query tile, one a half of V's and O's columns
        (kColumnHalves in fwd/fwd_sm80.cu)."""
        return 2 if self.head_dim > MAX_HEAD_DIM else 1

    @functools.cached_property
    def ctas_per_sm(self):
        """sm90: CTAs resident on one SM (kCtasPerSm in fwd/sm90_smem.cuh)."""
        return 2 if self.block_m == 64 else 1

    @property
    def key(self):
        mods = "_mods" if self.score_mods else ""
        hold = "_hold" if self.hold_pv_wait else ""
        elem = "_elem" if self.element_io else ""
        e4m3 = "_e4m3kv" if self.e4m3_kv else ""
        dv = f"_dv{self.head_dim_v}" if self.head_dim_v else ""
        fp8 = "_fp8" if self.fp8 else ""
        return (f"fwd_{self.family}_{self.dtype}_hd{self.head_dim}_bm{self.block_m}"
                f"_bn{self.block_n}_{self.mask}{mods}{hold}{elem}{e4m3}{dv}{fp8}")

    @property
    def name_expression(self):
        args = (f"{DTYPES.index(self.dtype)}, {self.head_dim}, {MASKS.index(self.mask)}, "
                f"{str(self.score_mods).lower()}")
        if self.family == "sm80":
            elem = ", false, true" if self.e4m3_kv else ", true" if self.element_io else ""
            if self.head_dim_v:
                elem = f", false, false, {self.head_dim_v}"
            return f"cufa::fwd_kernel<{args}, {self.block_m}, {self.block_n}{elem}>"
        fp8 = ", true" if self.fp8 else ""
        if self.head_dim_v:
            fp8 = f", {str(self.fp8).lower()}, {self.head_dim_v}"
        return (f"cufa::fwd_sm90_kernel<{args}, {self.block_m}, {self.block_n}, {self.q_stages}, "
                f"{self.kv_stages}, {str(self.hold_pv_wait).lower()}{fp8}>")

    @functools.cached_property  # read by every launch
    def smem_bytes(self):
        if self.family == "sm80":
            # (e4m3 K/V: rows of a byte a value and a 16-byte pad to an odd number of
            # 16-byte chunks, E4m3Tile)
            kv_row = (((self.head_dim // 16) | 1) * 16 if self.e4m3_kv
                      else self.head_dim * self.elem_bytes)
            v_row = self.head_dim_v * self.elem_bytes if self.head_dim_v else kv_row
            return (self.block_m * self.head_dim * self.elem_bytes
                    + self.block_n * (kv_row + v_row))
        return self._sm90_smem(self.q_stages, self.kv_stages)

    def _sm90_smem(self, q_stages, kv_stages):
        # Q and K/V stages; 1024 for the swizzle's alignment, the mbarriers and then,
        # 16-byte aligned, a 32-byte tile slot per Q stage
        kv_row = self.head_dim + (self.head_dim_v or self.head_dim)  # a K row and a V row
        tiles = (q_stages * self.block_m * self.head_dim + kv_stages * self.block_n * kv_row) * \
            self.elem_bytes
        return tiles + 1024 + 8 * (2 * q_stages + 4 * kv_stages) + 8 + 32 * q_stages

    @functools.cached_property
    def kv_stages(self):
        """sm90: K/V ring depth, SM90_KV_STAGES where that fits beside one Q stage, else one."""
        return SM90_KV_STAGES if self._sm90_smem(1, SM90_KV_STAGES) <= self.smem_limit else 1

    @functools.cached_property
    def q_stages(self):
        """sm90: two Q buffers where they fit (the next tile's Q loads during this one)."""
        return 2 if self._sm90_smem(2, self.kv_stages) <= self.smem_limit else 1

    @functools.cached_property
    def smem_limit(self):
        """Dynamic shared memory one CTA may use with ctas_per_sm of them on an SM."""
        if self.family == "sm80":
            return 99 * 1024  # sm_86/89
        return SM90_SMEM_PER_SM // self.ctas_per_sm - 1024

    @property
    def archs(self):
        """What the CPU compile check builds it for."""
        return ("sm_80", "sm_90") if self.family == "sm80" else ("sm_90a",)

    @property
    def options(self):
        """NVRTC options beyond the arch CuPy picks: wgmma needs the sm_90a target."""
        return NVRTC_OPTIONS + (("-arch=sm_90a",) if self.family == "sm90" else ())


# The backward (bwd/bwd_sm80.cu), mma.sync on any GPU from sm_80 on; head dims padded as
# the sm80 forward's. dq: (block_m, block_n) of its query tile and key blocks; dk, dv:
# 64 keys a CTA (16 a warp), block_m queries a step, both gradients in one launch up to
# d = 128 and one a launch above (their accumulators together would spill). Each the
# widest that ptxas keeps in 255 registers without spilling; score mods (their
# derivatives held a score) and masks (the predicates' bounds) take narrower steps.
BWD_DQ_TILES = {32: (64, 64), 64: (64, 64), 96: (64, 64), 128: (64, 64),
                160: (64, 32), 192: (64, 32), 224: (64, 32), 256: (64, 32)}
BWD_DQ_TILES_SCORE_MODS = {**BWD_DQ_TILES, 256: (64, 16)}
BWD_DKDV_BLOCK_M = {32: 64, 64: 64, 96: 64, 128: 32, 160: 32, 192: 32, 224: 32, 256: 32}
BWD_DKDV_BLOCK_M_SCORE_MODS = {**BWD_DKDV_BLOCK_M, 96: 32}
BWD_DKDV_BLOCK_M_MASKED_MODS = {**BWD_DKDV_BLOCK_M_SCORE_MODS, 128: 16}  # (window and mods)
BWD_KEYS_PER_CTA = 64
BWD_SMEM_LIMIT = 99 * 1024  # sm_86/89's, the least of the GPUs the kernels run on
BWD_SPLIT_ABOVE = 128
BWD_GRADS = ("both", "dk", "dv")  # index = KvGrads in bwd/bwd_sm80.cu


@dataclass(frozen=True)
class BwdVariant:
    """One backward launch: kind "preprocess" (D = rowsum(dout * out)), "dq" or "dkdv", or
    with dq fused "dq_convert" (sm80: the sums in rows) or "dq_blocks" (sm90: in blocks)."""
    kind: str
    dtype: str
    head_dim: int = 0       # padded; 0 for the preprocess
    mask: str = "none"
    score_mods: bool = False
    block_m: int = 0
    block_n: int = 0
    grads: str = "both"     # dkdv: BWD_GRADS
    stages: int = 1         # dq: K/V buffers (2: the next block's copy under the products);
                            # dkdv: Q/dout buffers, the same
    fused_dq: bool = False  # dkdv: dq too, added to float32 sums (kFusedDq: by atomics in
                            # bwd/bwd_sm80.cu, by bulk reductions in bwd/bwd_sm90.cu)
    producer: bool = False  # sm90 dq, dkdv: a producer warpgroup streams the steps (kProducer)
    tma: bool = False       # sm90 dq, dkdv: the steps' tiles by TMA (kTma; launch maps)
    # sm90 dkdv with dq fused at d = 64: a CTA an SM taking key blocks from a counter
    # (bwd_dkdv_persistent_sm90_kernel; TMA, a producer)
    persistent: bool = False
    # sm90 dkdv above d = 128: both gradients by two warpgroups on one 64-key block, one
    # taking S and P, the other dP and dS, each a share of the columns (kSplitCols)
    split_cols: bool = False
    family: str = "sm80"    # dq, dkdv: "sm90", wgmma (bwd/bwd_sm90.cu)
    ctas_per_sm: int = 1

    @property
    def source(self):
        return "bwd/bwd_sm90.cu" if self.family == "sm90" else "bwd/bwd_sm80.cu"

    @property
    def archs(self):
        return ("sm_90a",) if self.family == "sm90" else ("sm_80", "sm_90")

    @property
    def options(self):
        return NVRTC_OPTIONS + (("-arch=sm_90a",) if self.family == "sm90" else ())

    @property
    def key(self):
        if self.kind in ("preprocess", "dq_convert"):
            return f"bwd_{self.kind}_{self.dtype}"
        if self.kind == "dq_blocks":
            return f"bwd_{self.kind}_{self.dtype}_hd{self.head_dim}"
        mods = "_mods" if self.score_mods else ""
        grads = f"_{self.grads}" if self.kind == "dkdv" else ""
        fused = "_fdq" if self.fused_dq else ""
        producer = "_wp" if self.producer else ""
        tma = "_tma" if self.tma else ""
        persistent = "_pers" if self.persistent else ""
        split = "_sc" if self.split_cols else ""
        family = "_sm90" if self.family == "sm90" else ""
        return (f"bwd_{self.kind}{family}_{self.dtype}_hd{self.head_dim}_bm{self.block_m}"
                f"_bn{self.block_n}_{self.mask}{mods}{grads}_s{self.stages}{fused}{producer}"
                f"{tma}{persistent}{split}")

    @property
    def name_expression(self):
        dt = DTYPES.index(self.dtype)
        if self.kind in ("preprocess", "dq_convert"):
            return f"cufa::bwd_{self.kind}_kernel<{dt}>"
        if self.kind == "dq_blocks":
            return f"cufa::bwd_dq_blocks_kernel<{dt}, {self.head_dim}>"
        args = (f"{dt}, {self.head_dim}, {MASKS.index(self.mask)}, "
                f"{str(self.score_mods).lower()}, {self.block_m}")
        if self.kind == "dq":
            kernel = "bwd_dq_sm90_kernel" if self.family == "sm90" else "bwd_dq_kernel"
            return (f"cufa::{kernel}<{args}, {self.block_n}, {self.stages}"
                    f"{_flags(self.producer, self.tma)}>")
        if self.persistent:
            return (f"cufa::bwd_dkdv_persistent_sm90_kernel<{dt}, {MASKS.index(self.mask)}, "
                    f"{self.stages}>")
        if self.family == "sm90":
            return (f"cufa::bwd_dkdv_sm90_kernel<{args}, {BWD_GRADS.index(self.grads)}, "
                    f"{self.stages}, {self.block_n}"
                    f"{_flags(self.fused_dq, self.producer, self.tma, self.split_cols)}>")
        fused = ", true" if self.fused_dq else ""
        kernel = "bwd_dkdv_kernel"
        return (f"cufa::{kernel}<{args}, {BWD_GRADS.index(self.grads)}, "
                f"{self.stages}{fused}>")

    @property
    def threads(self):
        if self.kind == "dq_blocks":
            return 256
        if self.family == "sm90":  # a warpgroup every 64 keys (dk/dv) or query rows (dq),
            # and the producer's
            consumers = 256 if self.split_cols else 2 * (
                self.block_n if self.kind == "dkdv" else self.block_m)
            return consumers + (128 if self.producer else 0)
        return 256 if self.kind in ("preprocess", "dq_convert") else 128

    @functools.cached_property
    def smem_bytes(self):
        return self.smem_with(self.stages)

    def smem_with(self, stages):
        row = self.head_dim * _dtypes.size_of(self.dtype)
        if self.kind == "dq_blocks":
            return 0
        if self.family == "sm90":  # (1024 bytes to align the panels to their swizzle)
            # (each buffer's two mbarriers: a producer's ring, or TMA's full barriers)
            ring = 2 * 8 * stages if self.producer or self.tma else 0
            if self.kind == "dq":
                return 1024 + 2 * (self.block_m + stages * self.block_n) * row + ring
            stage = -(-(2 * self.block_m * row + 8 * self.block_m) // 1024) * 1024
            # the persistent kernel: a second K/V buffer, kv_empty[2], the tile ring (four
            # mbarriers, two numbers) and the sender's record (a pointer a stage)
            persistent = 2 * self.block_n * row + 16 + 40 + 8 * stages if self.persistent else 0
            # dq fused: two tiles of the step's dS (16-bit), each warpgroup's slab of 64 x
            # 64 sums (kDqSlabBytes; at d = 64 warpgroup 1 has two) and the slabs' mbarrier
            # (at d = 64 four more: stage_dq_pair's)
            slabs = 3 if self.head_dim == 64 else 2
            fused = (2 * 2 * self.block_m * self.block_n + slabs * 64 * 64 * 4 + 8
                     + (32 if self.head_dim == 64 else 0)
                     if self.fused_dq and not self.split_cols else 0)
            # columns split: the exchange's P^T (fp32) and dS^T (16-bit) of 64 x 64
            split = 64 * 64 * (4 + 2) if self.split_cols else 0
            return (1024 + 2 * self.block_n * row + stages * stage + fused + ring + persistent
                    + split)
        if self.kind == "dq":  # Q, dout; the stages' K, V
            return 2 * (self.block_m + stages * self.block_n) * row
        if self.kind == "dkdv":  # K, V; the stages' Q, dout, lse and D of block_m rows
            fused = 2 * self.block_n * self.block_m if self.fused_dq else 0  # dS^T, 16-bit
            return (2 * self.block_n * row + stages * (2 * self.block_m * row + 8 * self.block_m)
                    + fused)
        return 0


def _flags(*flags):
    """Trailing bool template arguments, up to the last true one (the rest default)."""
    while flags and not flags[-1]:
        flags = flags[:-1]
    return "".join(f", {str(f).lower()}" for f in flags)


@functools.lru_cache(maxsize=None)
def bwd_variants(dtype, head_dim, mask, score_mods):
    """The backward's launches for a call, in order: (preprocess, dq, dkdv...)."""
    hd = padded_head_dim(head_dim)
    block_m, block_n = (BWD_DQ_TILES_SCORE_MODS if score_mods else BWD_DQ_TILES)[hd]
    dq = _two_stages_where_they_fit(
        BwdVariant("dq", dtype, hd, mask, bool(score_mods), block_m, block_n))
    kv_block_m = ((BWD_DKDV_BLOCK_M_MASKED_MODS if mask == "window" else
                   BWD_DKDV_BLOCK_M_SCORE_MODS) if score_mods else BWD_DKDV_BLOCK_M)[hd]
    kv = [_two_stages_where_they_fit(BwdVariant("dkdv", dtype, hd, mask, bool(score_mods),
                                                kv_block_m, BWD_KEYS_PER_CTA, grads))
          for grads in (("dk", "dv") if hd > BWD_SPLIT_ABOVE else ("both",))]
    return (BwdVariant("preprocess", dtype), dq, *kv)


# dq fused into the dk/dv kernel (FlashAttention-2's atomic dq): (padded head dim, mask,
# score mods) -> (block_m, stages), where ptxas keeps it in 255 registers unspilled (the
# others spill 8-96 bytes: they keep the dq kernel). Off by default until timed
# (CUFA_BWD_FUSED_DQ=1 takes it where it applies).
BWD_FUSED_TILES = {(64, "none", False): (32, 2), (64, "none", True): (64, 2),
                   (64, "window", False): (64, 2), (64, "window", True): (64, 2),
                   (128, "window", False): (32, 1)}
BWD_FUSED_ENV = "CUFA_BWD_FUSED_DQ"


@functools.lru_cache(maxsize=None)
def bwd_fused_variants(dtype, head_dim, mask, score_mods):
    """(preprocess, dk/dv with dq fused, dq convert) for a call, or None where the fused
    kernel does not apply."""
    pre, _, *kv = bwd_variants(dtype, head_dim, mask, score_mods)
    tiles = BWD_FUSED_TILES.get((kv[0].head_dim, mask, bool(score_mods)))
    if tiles is None:
        return None
    fused = dataclasses.replace(kv[0], fused_dq=True, block_m=tiles[0], stages=tiles[1])
    return pre, fused, BwdVariant("dq_convert", dtype)


# dq fused on wgmma (kFusedDq in bwd/bwd_sm90.cu): padded head dims 64 and 128, two
# warpgroups of 64 keys, 64-query steps, a producer warpgroup (which also sends the sums),
# no score mods (above d = 128: the split kernel's consumers add each step's dq from
# registers); Hopper's default where bwd_sm90_fused_by_default says, everywhere with
# CUFA_BWD_FUSED_DQ=1. padded head dim -> (keys, queries, buffers: as many as fit)
BWD_SM90_FUSED_TILES = {64: (128, 64, 3), 128: (128, 64, 2)}


@functools.lru_cache(maxsize=None)
def bwd_sm90_fused_variants(dtype, head_dim, mask, score_mods, tma=True, persistent=False):
    """(preprocess, dk/dv with dq fused on wgmma, dq's sums from blocks to rows) for a
    call, or None where it does not apply. tma: the steps' tiles by TMA; persistent: at
    BWD_PERSISTENT_HEAD_DIMS with TMA, a CTA an SM that takes key blocks one after
    another."""
    pre, _, *kv = bwd_variants(dtype, head_dim, mask, score_mods)
    if len(kv) == 2:  # (above d = 128: dq fused into the kernel split by columns)
        wgmma = None if score_mods else bwd_sm90_variants(
            dtype, head_dim, mask, False, producer=True, tma=tma, split_cols=True)
        if not wgmma or not wgmma[-1].split_cols:
            return None
        return (pre, dataclasses.replace(wgmma[-1], fused_dq=True),
                BwdVariant("dq_blocks", dtype, wgmma[-1].head_dim, family="sm90"))
    tiles = BWD_SM90_FUSED_TILES.get(kv[0].head_dim)
    if tiles is None or score_mods or len(kv) != 1:
        return None
    fused = dataclasses.replace(kv[0], family="sm90", fused_dq=True, producer=True, tma=tma,
                                block_n=tiles[0], block_m=tiles[1], stages=tiles[2],
                                persistent=persistent and tma
                                and kv[0].head_dim in BWD_PERSISTENT_HEAD_DIMS)
    return pre, fused, BwdVariant("dq_blocks", dtype, kv[0].head_dim, family="sm90")


# The persistent fused kernel (bwd_dkdv_persistent_sm90_kernel): at d = 64, where two K/V
# buffers fit beside the ring (d = 128's would not), Hopper's default for windowed (causal)
# calls of at most PERSISTENT_MAX_ROWS query rows (a packed batch's total), where a key
# block's CTA runs few steps. On an H200, since a CTA a key block holds K, V and K^T in
# registers and tests a masked score against its key's row span: causal 0.96x the time
# at 512 rows, 1.02-1.03x at 1k, 1.07x at 2k; without a mask 1.01x at 512, 1.04-1.07x
# from 1k (bench/results/bwd_mask_rows_h200.md; before the row spans 0.94x at 1k causal:
# bwd_d64_held_h200.md). CUFA_BWD_PERSISTENT=0 keeps a CTA a key block, =1 takes the
# persistent kernel wherever it applies (to time it there).
BWD_PERSISTENT_HEAD_DIMS = (64,)
BWD_PERSISTENT_MAX_ROWS = 512
BWD_PERSISTENT_ENV = "CUFA_BWD_PERSISTENT"


def bwd_persistent_wanted(seqlen_q, mask):
    """Whether a call of seqlen_q query rows and this mask kind (_bwd_plan.variants_of's)
    takes the persistent kernel where it applies: CUFA_BWD_PERSISTENT "0" never, "1"
    always, unset or empty under a window up to BWD_PERSISTENT_MAX_ROWS; anything else is
    refused."""
    value = _overrides.get(BWD_PERSISTENT_ENV)
    if value not in (None, "", "0", "1"):
        raise ValueError(f"{BWD_PERSISTENT_ENV} takes 0 (never) or 1 (wherever it applies); "
                         f"got {value!r}")
    return value == "1" or (value != "0" and mask == "window"
                            and seqlen_q <= BWD_PERSISTENT_MAX_ROWS)


def bwd_fused_wanted():
    """CUFA_BWD_FUSED_DQ: True ("1": wherever dq fused applies), False ("0": never) or None
    (unset or empty: where bwd_sm90_fused_by_default says); anything else is refused (a
    "false" read as unset would fuse)."""
    value = _overrides.get(BWD_FUSED_ENV)
    if value not in (None, "", "0", "1"):
        raise ValueError(f"{BWD_FUSED_ENV} takes 1 (dq fused wherever it applies) or 0 (never);"
                         f" got {value!r}")
    return {"1": True, "0": False}.get(value)


def bwd_sm90_fused_by_default(head_dim):
    """Whether a call whose wgmma kernels have this padded head dim takes dq fused where
    it is not asked for deterministic bits: where it was faster on an H200 with its
    producer and TMA on (bf16 and fp16, 1k-16k tokens, no mask and causal): d = 128,
    0.83-0.99x the time of the dq and dk/dv kernels (bench/results/bwd_fused_dq_h200.md);
    d = 64, once warpgroup 1 hands its sums over without a barrier a step and the
    producer's warps wait apart, 0.98-0.99x at 1k and 0.86-0.95x from 4k
    (bench/results/bwd_fused_dq64_handover_h200.md; before that, only under a window past
    1024 rows)."""
    if not (bwd_producer_wanted() and bwd_tma_wanted()):
        return False
    return head_dim in (64, 128)


# dq and dk, dv on Hopper's wgmma (bwd/bwd_sm90.cu), a warpgroup every 64 query rows (dq)
# or keys (dk/dv) of a CTA, two buffers of what each streams: padded head dim -> the dq
# kernel's (query rows, key block) and the dk/dv kernel's (keys, query block). Hopper's
# default where they apply (1.2-1.5x the mma.sync kernels' speed on an H200);
# CUFA_BWD_SM90=0 keeps the mma.sync ones. From a sweep on an H200
# (bench/results/bwd_sm90_tiles_h200.md): at d = 128 two warpgroups sharing each block
# (128 rows, 128 keys a CTA; 1.02-1.20x one warpgroup's speed), at d = 64 one warpgroup's
# 64 keys against 128-query blocks (1.01-1.14x, but 0.97x causal at N = 1024; with score
# mods they spill 216 bytes, so 64); a 128-query block at d = 128 spills.
# Above d = 128 dq takes two warpgroups of 64 rows on 32-key blocks with a producer (one
# warpgroup on 64-key blocks, 192 KB, left one warpgroup an SM: 1.03-1.10x the time on an
# H200, bench/results/bwd_split_cols_h200.md), score mods one warpgroup on 32-key blocks
# (64 spill 8-108 bytes); dk and dv come from one launch split by columns (_split_cols),
# or with score mods, or CUFA_BWD_SPLIT_COLS=0, are launched apart (as on mma.sync). The
# wgmma kernels there take 0.46-0.66x the mma.sync time (bench/results/bwd_gaps_h200.md).
# Where one of them spills, that launch stays on mma.sync.
BWD_SM90_TILES = {64: ((64, 64), (64, 128)), 128: ((128, 64), (128, 64)),
                  192: ((128, 32), (64, 64)), 256: ((128, 32), (64, 64))}
BWD_SM90_TILES_SCORE_MODS = {**BWD_SM90_TILES, 64: ((64, 64), (64, 64)),
                             192: ((64, 32), (64, 64)), 256: ((64, 32), (64, 64))}
# Windowed (causal) calls of at most SHORT_WINDOW_ROWS query rows (a packed batch's total)
# at d = 64 keep 64-query dk/dv blocks: with few query blocks a key block, the diagonal's
# masked half of a 128-query block costs more than it saves (0.97x at N = 1024, 1.02x at
# 2048, 1.10x at 4096 on an H200).
BWD_SM90_SHORT_WINDOW_ROWS = 1024
BWD_SM90_SHORT_WINDOW_KV = {64: (64, 64)}
# With TMA and a producer (below) windowed d = 64 dk/dv takes two warpgroups of 64 keys
# instead, 64-query blocks streamed to both (the 128-query block would spill under TMA,
# BWD_SM90_TMA_SPILLS): causal N = 1k, 4k, 16k took 0.98, 0.87 and 0.84x the time of one
# warpgroup's 64 keys, 1.00-1.02x without a mask (H200, bench/results/bwd_tma_h200.md).
BWD_SM90_WINDOW_KV_TMA = {64: (128, 64)}
BWD_SM90_SPILLS = {("dkdv", 128, "window", True)}  # (20 bytes; the same with 128 keys)
BWD_SM90_ENV = "CUFA_BWD_SM90"
BWD_SM90_HEAD_DIMS = tuple(BWD_SM90_TILES)  # (so CUFA_BWD_SM90=all is the default)
# CUFA_BWD_SM90_TILES="dq=RxK,kv=KxQ" (either part alone) replaces those tiles at every
# head dim, to time others: dq's R query rows (64 or 128: one or two warpgroups sharing
# each K/V block) and key block K (32, 64 or 128); dk/dv's K keys (64 or 128, the same) and
# query block Q (64 or 128). ONE_WARPGROUP, the tiles before the sweep, is compiled too
# (up to d = 128; above, it is the table's but for score mods' dq, where it spills).
BWD_SM90_TILES_ENV = "CUFA_BWD_SM90_TILES"
BWD_SM90_TILE_CHOICES = {"dq": ((64, 128), (32, 64, 128)), "kv": ((64, 128), (64, 128))}
BWD_SM90_ONE_WARPGROUP = "dq=64x64,kv=64x64"
SM90_SMEM_LIMIT = 227 * 1024
# The dq and dk/dv kernels with a producer warpgroup (kProducer in bwd/bwd_sm90.cu): the
# consumer warpgroups stop meeting at a CTA-wide barrier each step and stop issuing
# copies; a ring of three buffers lets them drift a step apart. The default where it
# applies (H200, d = 128: 1-10 % less time a backward, bench/results/bwd_producer_h200.md);
# CUFA_BWD_SM90_PRODUCER=0 turns it off. Without score mods (with them the dk/dv
# consumers need more than their 240 registers).
BWD_SM90_PRODUCER_ENV = "CUFA_BWD_SM90_PRODUCER"
BWD_SM90_PRODUCER_STAGES = 3
# Above d = 128, where one warpgroup cannot hold both gradients of its keys, dk and dv come
# from one launch with the work split between two warpgroups (_split_cols; it needs the
# producer): on an H200 0.49-0.54x the time of dk's and dv's launches apart
# (bench/results/bwd_split_cols_h200.md). CUFA_BWD_SPLIT_COLS=0 launches them apart.
BWD_SPLIT_COLS_ENV = "CUFA_BWD_SPLIT_COLS"
# Kernels with two consumer warpgroups, which the producer keeps from waiting on each
# other: those of d = 128 and above (d = 192 and 256's dq: 0.92-0.95x the time without
# it on an H200); at d = 64 only those streaming by TMA (the windowed dk/dv of
# BWD_SM90_WINDOW_KV_TMA, or tiles CUFA_BWD_SM90_TILES sets): d = 64's others have one
# warpgroup (two to four CTAs an SM), where a producer's warpgroup would cost CTAs an SM
# and spare no wait, and with cp.async it cost more than it spared.
BWD_SM90_PRODUCER_HEAD_DIMS = (128, 192, 256)
BWD_SM90_TMA_PRODUCER_HEAD_DIMS = (64,)
# The wgmma kernels stream each step's tiles by TMA (kTma: one thread's boxes, by the
# producer or a consumer): the cp.async address arithmetic of 128 threads had held the
# consumers back (with the copies left out the backward took 0.68-0.89x the time on an
# H200; bench/results/bwd_tma_h200.md). Where the copy engine cannot describe an array
# the launch keeps cp.async. CUFA_BWD_SM90_TMA=0 turns it off.
BWD_SM90_TMA_ENV = "CUFA_BWD_SM90_TMA"
# (kind, head dim, query block, mask, score mods) where TMA's registers spill: 48 bytes
BWD_SM90_TMA_SPILLS = {("dkdv", 64, 128, "window", False)}


def parse_bwd_sm90_tiles(text):
    """CUFA_BWD_SM90_TILES's value -> (("dq", (rows, keys)), ("kv", (keys, queries))),
    the parts given; () for none."""
    if not text:
        return ()
    parts = {}
    for part in text.replace(" ", "").split(","):
        kernel, _, shape = part.partition("=")
        try:
            sizes = tuple(int(x) for x in shape.split("x"))
        except ValueError:
            sizes = ()
        choices = BWD_SM90_TILE_CHOICES.get(kernel)
        if (choices is None or kernel in parts or len(sizes) != 2
                or any(n not in c for n, c in zip(sizes, choices))):
            raise ValueError(
                f"{BWD_SM90_TILES_ENV} takes 'dq=RxK,kv=KxQ' (either part alone) with dq's R "
                f"in {BWD_SM90_TILE_CHOICES['dq'][0]}, K in "
                f"{BWD_SM90_TILE_CHOICES['dq'][1]}, dk/dv's K in "
                f"{BWD_SM90_TILE_CHOICES['kv'][0]}, Q in {BWD_SM90_TILE_CHOICES['kv'][1]}; "
                f"got {text!r}")
        parts[kernel] = sizes
    return tuple(sorted(parts.items()))


@functools.lru_cache(maxsize=None)
def bwd_sm90_variants(dtype, head_dim, mask, score_mods, override=(), short_window=False,
                      producer=False, tma=False, split_cols=False):
    """(preprocess, dq, dk/dv...), those on wgmma that it has, for a call; None where it has
    neither. override: parse_bwd_sm90_tiles' tiles in place of the table's; short_window:
    a windowed call of few query rows (BWD_SM90_SHORT_WINDOW_KV's tiles); producer: the
    kernels with a producer warpgroup (BWD_SM90_PRODUCER_STAGES buffers) where they have
    one (two consumer warpgroups); tma: the wgmma kernels stream their steps' tiles by TMA
    (BWD_SM90_TMA_ENV); split_cols: above d = 128 with a producer and no score mods, dk and
    dv from one launch (_split_cols)."""
    pre, dq, *kv = bwd_variants(dtype, head_dim, mask, score_mods)
    table = BWD_SM90_TILES_SCORE_MODS if score_mods else BWD_SM90_TILES
    if dq.head_dim not in table:
        return None
    tiles = dict(zip(("dq", "kv"), table[dq.head_dim]))
    if short_window and mask == "window" and dq.head_dim in BWD_SM90_SHORT_WINDOW_KV:
        tiles["kv"] = BWD_SM90_SHORT_WINDOW_KV[dq.head_dim]
    if (tma and producer and mask == "window" and not score_mods
            and dq.head_dim in BWD_SM90_WINDOW_KV_TMA):
        tiles["kv"] = BWD_SM90_WINDOW_KV_TMA[dq.head_dim]
    tiles.update(override)
    wgmma = [dataclasses.replace(v, family="sm90", stages=2, tma=tma, **(
        dict(zip(("block_m", "block_n"), tiles["dq"])) if v.kind == "dq" else
        dict(zip(("block_n", "block_m"), tiles["kv"]))))
        if (v.kind, v.head_dim, mask, bool(score_mods)) not in BWD_SM90_SPILLS else v
        for v in (dq, *kv)]
    wgmma = [dataclasses.replace(v, tma=False) if (
        v.kind, v.head_dim, v.block_m, v.mask, v.score_mods) in BWD_SM90_TMA_SPILLS else v
        for v in wgmma]
    if producer and not score_mods and (dq.head_dim in BWD_SM90_PRODUCER_HEAD_DIMS or (
            tma and dq.head_dim in BWD_SM90_TMA_PRODUCER_HEAD_DIMS)):
        wgmma = [_with_producer(v) for v in wgmma]
    if split_cols and producer and not score_mods and len(kv) == 2:
        wgmma = [wgmma[0], _split_cols(wgmma[1])]
    for v in wgmma:
        if v.smem_bytes > SM90_SMEM_LIMIT:
            raise ValueError(f"{BWD_SM90_TILES_ENV}={_overrides.get(BWD_SM90_TILES_ENV)!r}: the "
                             f"{v.kind} kernel's tiles at head dim {v.head_dim} take "
                             f"{v.smem_bytes} bytes of shared memory, over {SM90_SMEM_LIMIT}")
    return (pre, *wgmma)


def _split_cols(dk):
    """The dk/dv kernel that takes both gradients of a 64-key block on two warpgroups split
    by product and columns (BwdVariant.split_cols), with a producer and as many buffers as
    fit, in place of dk's and dv's launches apart (dk: the dk launch's variant)."""
    split = dataclasses.replace(dk, grads="both", split_cols=True, producer=True,
                                block_m=64, block_n=64, stages=BWD_SM90_PRODUCER_STAGES)
    while split.smem_bytes > SM90_SMEM_LIMIT:
        split = dataclasses.replace(split, stages=split.stages - 1)
    return split


def bwd_split_cols_wanted():
    return _overrides.get(BWD_SPLIT_COLS_ENV) != "0"


def _with_producer(v):
    """v with a producer warpgroup where it has two consumer warpgroups and the third
    buffer fits (CUFA_BWD_SM90_TILES' larger tiles may not); else v."""
    if v.family != "sm90" or v.threads != 256:
        return v
    with_producer = dataclasses.replace(v, producer=True, stages=BWD_SM90_PRODUCER_STAGES)
    return with_producer if with_producer.smem_bytes <= SM90_SMEM_LIMIT else v


def bwd_producer_wanted():
    return _overrides.get(BWD_SM90_PRODUCER_ENV) != "0"


def bwd_tma_wanted():
    return _overrides.get(BWD_SM90_TMA_ENV) != "0"


def bwd_sm90_tiles():
    """The environment's tiles for the wgmma backward (parse_bwd_sm90_tiles)."""
    return parse_bwd_sm90_tiles(_overrides.get(BWD_SM90_TILES_ENV))


def bwd_sm90_head_dims():
    """The padded head dims the wgmma backward takes: none with CUFA_BWD_SM90=0, else
    BWD_SM90_HEAD_DIMS ("1" and "all", which once added 192 and 256, are the default)."""
    value = _overrides.get(BWD_SM90_ENV)
    if value not in (None, "", "0", "1", "all"):
        raise ValueError(f"{BWD_SM90_ENV} takes 0, 1 or all; got {value!r}")
    return () if value == "0" else BWD_SM90_HEAD_DIMS


def _two_stages_where_they_fit(variant):
    """variant with two buffers of what it streams where they fit in the shared memory
    of every GPU it runs on (sm_86/89's 99 KB), else one."""
    if variant.smem_with(2) <= BWD_SMEM_LIMIT:
        return dataclasses.replace(variant, stages=2)
    return variant


@dataclass(frozen=True)
class ScheduleKernel:
    """fwd/varlen_schedule.cu: builds the work list of a packed batch (one CTA)."""
    key: str = "varlen_schedule"
    source: str = "fwd/varlen_schedule.cu"
    name_expression: str = "cufa::varlen_schedule"
    threads: int = 1024
    smem_bytes: int = 0
    ctas_per_sm: int = 1
    archs: tuple = ("sm_80", "sm_90")
    options: tuple = NVRTC_OPTIONS


VARLEN_SCHEDULE = ScheduleKernel()

# KV-cache kernels (decode.cu, merge.cu): mma.sync, for every GPU from sm_80 on. Decode
# is bound by reading the cache, so Hopper gains nothing from wgmma here. One variant per
# dtype and padded head dim; masks and score mods are runtime branches, whose cost hides
# under the memory traffic.
DECODE_HEAD_DIMS = SM80_HEAD_DIMS
DECODE_ROWS, DECODE_TILE_KEYS = 16, 16  # query rows a CTA, keys a warp's tile (decode.cu)
COMBINE_THREADS = 128  # kCombineThreads in decode.cu; decode_append and merge_states take as many
MAX_SPLITS = 128       # kMaxSplits in decode.cu: the splits of the keys the merge takes, at most
COMBINE_EARLY = 4      # kCombineEarly in decode/split_merge.cuh: a thread's splits read at once
COMBINE_SLICE_COLS = 128  # a sliced decode_combine's columns a CTA (CombineVariant.slice_cols)
DECODE_STATIC_SMEM = 640                # decode_kernel's __shared__ arrays, at most
MERGE_DTYPES = _dtypes.keys_by_code("merge")  # index = MergeDtype in decode/merge.cu


def decode_shape(head_dim):
    """(warps, cp.async stages per warp) of the decode kernel (DecodeShape in decode.cu),
    an e4m3 cache's too: on an H200 its d = 64 and 128 kernels read no faster with more
    stages (4-8 and 2-5 tried; again with the strided copies, 5-8 and 3: up to 1.38x and
    1.12x the time), though shared memory would hold them. Above d = 256 (V's
    columns in two halves, a CTA each) one warp of two stages of K's rows and V's half
    (64 KB: three CTAs an SM on Hopper, one on sm_86/89); Hopper takes DECODE_HALVES_SM90."""
    if head_dim > MAX_HEAD_DIM:
        return 1, 2
    return (4 if head_dim <= 128 else 2), (4 if head_dim <= 64 else 2)


# Above d = 256 on Hopper: two warps of two stages (112 KB, over sm_86/89's 99), two CTAs
# an SM. On an H200 (fp16, 32/8 heads, d = 512) they read 3.6-3.8 TB/s at 64 x 4k,
# 256 x 1k and 8 x 16k, where one warp of two stages read 2.1-2.9 and of three 1.9-2.0.
DECODE_HALVES_SM90 = (2, 2)
DECODE_PORTABLE_SMEM = 99 * 1024  # a CTA's shared memory on sm_86/89


# The e4m3 decode kernels' launch bounds on sm_90, by padded head dim: CTAs an SM that
# ptxas must fit in registers (else one: it takes 152-156 registers at d = 128, three CTAs;
# 132 at d = 64 with fp16 products, three CTAs, which read 13-24 % slower on an H200).
DECODE_FP8_MIN_CTAS = {64: 4, 128: 4}

# The head dim whose heads a CTA takes two at a time where they sit side by side
# (_heuristics.head_pairs): an e4m3 cache's row slice is then 64 bytes, half a 128-byte
# line, and a 16-bit cache's one line, where two read 1-3 % faster on an H200
PAIRED_HEAD_DIM = 64


# Decode kernels with less shared memory and so four CTAs an SM, (warps, stages) by padded
# head dim; _heuristics.decode_kernel_and_splits says where they run.
DECODE_MORE_CTAS = {64: (4, 3), 128: (2, 3)}

# The TMA decode kernel (decode_sm90.cu, sm_90): head dims, mbarrier stages of a 64-key K
# and V box (16 KB at d = 64), and its threads (four consumer warps and a producer warp).
# _heuristics.tma_units says where it runs.
DECODE_TMA_HEAD_DIMS = (64,)
DECODE_TMA_STAGES = 4
DECODE_TMA_THREADS = 160
DECODE_TMA_BOX_KEYS = 64
# CUFA_DECODE_TMA: 0 never takes the TMA decode kernel, 1 or 2 takes it wherever it can run
# (that many units a CTA; an odd batch's last CTAs take one), for tests and A/Bs; unset: the
# planner's rule
DECODE_TMA_ENV = "CUFA_DECODE_TMA"


def decode_tma_forced():
    """CUFA_DECODE_TMA as read (read_overrides): None, 0, 1 or 2."""
    forced = _overrides.get(DECODE_TMA_ENV)
    if not forced:
        return None
    if forced not in ("0", "1", "2"):
        raise ValueError(f"{DECODE_TMA_ENV} must be 0, 1 or 2; got {forced!r}")
    return int(forced)


class _CacheKernel:
    """What the KV-cache family's kernels (decode/) share; a kernel without shared memory
    of its own (combine, append, merge) runs COMBINE_THREADS threads, one CTA an SM."""
    archs = ("sm_80", "sm_90")
    options = NVRTC_OPTIONS
    threads = COMBINE_THREADS
    smem_bytes = 0
    units = 0  # (sequence, KV head) units a CTA takes: the TMA decode kernel's; 0: one
    ctas_per_unit = 1  # CTAs a unit takes (DecodeVariant's two above d = 256)
    element_io = False  # rows moved an element at a time (the decode and combine kernels')

    @property
    def elem_bytes(self):
        """Bytes an element of the arrays it reads and writes (q, the caches, out)."""
        return _dtypes.size_of(self.dtype)

    def ctas_per_sm_on(self, smem_per_sm):
        """CTAs an SM holds, by shared memory (1 KB reserved per CTA), and no more than a
        kernel's launch bounds fit in registers where it has them (min_ctas: the e4m3
        decode kernels on sm_90, 4 where shared memory would hold 5; ptxas gives them
        exactly that share). Registers allow more for the others."""
        if not self.smem_bytes:
            return 1
        ctas = max(1, min(16, smem_per_sm // (self.smem_bytes + 1024 + DECODE_STATIC_SMEM)))
        return min(ctas, getattr(self, "min_ctas", 0) or ctas)

    @property
    def ctas_per_sm(self):
        """On an H100 (228 KB of shared memory an SM)."""
        return self.ctas_per_sm_on(SM90_SMEM_PER_SM)


@dataclass(frozen=True)
class DecodeVariant(_CacheKernel):
    """decode/decode_sm80.cu's decode_kernel: a CTA's query rows against the cache, each
    warp streaming its share of the keys through cp.async stages."""
    dtype: str
    head_dim: int             # the padded head dim
    stages: int = 0           # cp.async stages a warp (0: decode_shape's)
    warps: int = 0            # warps a CTA (0: decode_shape's)
    element_io: bool = False  # the element-wise I/O variant
    fp8_cache: bool = False   # the cache holds e4m3 (q and out stay dtype)
    min_ctas: int = 0         # e4m3: launch bounds' CTAs an SM on sm_90 (0: one)
    head_pairs: bool = False  # head_dim 2 x 64: two adjacent KV heads a CTA
    kind = "decode"
    source = "decode/decode_sm80.cu"

    @property
    def shape(self):
        """(warps, stages)."""
        warps, stages = decode_shape(self.head_dim)
        return self.warps or warps, self.stages or stages

    @property
    def key(self):
        warps, stages = self.shape
        other = f"_w{warps}" if warps != decode_shape(self.head_dim)[0] else ""
        elem = "_elem" if self.element_io else ""
        fp8 = "_e4m3" if self.fp8_cache else ""
        ctas = f"_c{self.min_ctas}" if self.min_ctas else ""
        pairs = "_pairs" if self.head_pairs else ""
        return f"decode_{self.dtype}_hd{self.head_dim}_s{stages}{other}{elem}{fp8}{ctas}{pairs}"

    @property
    def name_expression(self):
        warps, stages = self.shape
        flags = (", false, true" if self.fp8_cache else ", true" if self.element_io else "")
        if self.min_ctas or self.head_pairs:  # (every flag before them spelled out)
            flags = (f", {str(self.element_io).lower()}, {str(self.fp8_cache).lower()}, "
                     f"{self.min_ctas}")
        if self.head_pairs:
            flags += ", true"
        return (f"cufa::decode_kernel<{DTYPES.index(self.dtype)}, {self.head_dim}, {stages}, "
                f"{warps}{flags}>")

    @property
    def threads(self):
        return 32 * self.shape[0]

    @property
    def archs(self):
        """Hopper's alone where the shape needs more shared memory than sm_86/89 give."""
        return ("sm_90",) if self.smem_bytes > DECODE_PORTABLE_SMEM else _CacheKernel.archs

    @property
    def ctas_per_unit(self):
        """CTAs a (query block, KV head, sequence, split): two above d = 256, each with half
        of V's and O's columns (the grid's x, low bit)."""
        return 2 if self.head_dim > MAX_HEAD_DIM else 1

    @property
    def smem_bytes(self):
        """Dynamic shared memory: Q, then each warp's K/V stages (an e4m3 cache's rows: a
        byte a value and a 16-byte pad, to an odd number of 16-byte chunks, E4m3Tile; above
        d = 256, V's rows are half K's)."""
        warps, stages = self.shape
        row = self.head_dim * self.elem_bytes
        cache_row = ((self.head_dim // 16) | 1) * 16 if self.fp8_cache else row
        v_row = cache_row // self.ctas_per_unit
        return DECODE_ROWS * row + warps * stages * DECODE_TILE_KEYS * (cache_row + v_row)


@dataclass(frozen=True)
class DecodeTmaVariant(_CacheKernel):
    """decode/decode_sm90.cu's decode_tma_kernel (sm_90): a producer warp's TMA boxes of
    DECODE_TMA_BOX_KEYS keys in a ring of mbarrier stages, for `units` (sequence, KV head)
    units a CTA."""
    dtype: str
    head_dim: int
    units: int
    stages: int = 0           # the ring's stages (0: DECODE_TMA_STAGES)
    kind = "decode_tma"
    source = "decode/decode_sm90.cu"
    archs = ("sm_90",)
    threads = DECODE_TMA_THREADS

    @property
    def tma_stages(self):
        return self.stages or DECODE_TMA_STAGES

    @property
    def key(self):
        return f"decode_tma_{self.dtype}_hd{self.head_dim}_s{self.tma_stages}_u{self.units}"

    @property
    def name_expression(self):
        return (f"cufa::decode_tma_kernel<{DTYPES.index(self.dtype)}, {self.tma_stages}, "
                f"{self.units}>")

    @property
    def smem_bytes(self):
        """Q, its 1 KB alignment, the ring of K and V boxes."""
        row = self.head_dim * self.elem_bytes
        return 1024 + DECODE_ROWS * row + self.tma_stages * 2 * DECODE_TMA_BOX_KEYS * row


# MLA decode (decode/decode_mla_sm90.cu, wgmma: Hopper alone): a key is a latent row of
# MLA_LATENT_DIM (v_cache, also the value) and a rotary row of MLA_ROPE_DIM (k_cache); a
# CTA takes MLA_ROWS (token, head) rows of a KV head, MLA_KEYS keys a block through a
# ring of 16-bit blocks (and, for an e4m3 cache, a staging ring of its bytes), a producer
# warpgroup and two consumer warpgroups.
MLA_LATENT_DIM, MLA_ROPE_DIM = 512, 64
MLA_ROWS, MLA_KEYS = 64, 32


@dataclass(frozen=True)
class MlaVariant(_CacheKernel):
    """decode/decode_mla_sm90.cu's decode_mla_kernel; tma: whole blocks come as TMA boxes
    through the call's maps (a cache the maps can describe); fp8_cache: the caches hold
    e4m3, widened to the 16-bit dtype by the producer."""
    dtype: str
    tma: bool = False
    fp8_cache: bool = False
    kind = "decode_mla"
    source = "decode/decode_mla_sm90.cu"
    archs = ("sm_90a",)
    options = NVRTC_OPTIONS + ("-arch=sm_90a",)
    threads = 384

    @property
    def key(self):
        return (f"decode_mla_{self.dtype}" + ("_e4m3" if self.fp8_cache else "")
                + ("_tma" if self.tma else ""))

    @property
    def name_expression(self):
        flags = ", ".join("true" if f else "false" for f in (self.tma, self.fp8_cache))
        return f"cufa::decode_mla_kernel<{DTYPES.index(self.dtype)}, {flags}>"

    @property
    def stages(self):
        """MlaSmem::kStages and kStaged: the ring's 16-bit blocks, the e4m3 blocks staged."""
        return (3, 2) if self.fp8_cache else (4, 0)

    @property
    def smem_bytes(self):
        """MlaSmem::kBytes: Q and the ring's blocks (576 columns), the staged e4m3 blocks,
        the one P panel (64 columns), three float arrays of two rows' worth, the mbarriers
        (each stage's full and empty, each staged block's, Q's), the alignment."""
        dim = MLA_LATENT_DIM + MLA_ROPE_DIM
        stages, staged = self.stages
        return (MLA_ROWS * dim * 2 + stages * MLA_KEYS * dim * 2 + staged * MLA_KEYS * dim
                + MLA_ROWS * 64 * 2 + 3 * 2 * MLA_ROWS * 4 + 8 * (2 * stages + staged + 1) + 1024)

    @property
    def ctas_per_sm(self):
        return 1


@dataclass(frozen=True)
class CombineVariant(_CacheKernel):
    """decode/combine.cu's decode_combine: merges the splits of split-KV, `rows` rows a CTA
    (1, or 4: a warp a row); slice_cols: a CTA a slice of that many columns of its row
    (grid y: the slices), 0 the whole row."""
    dtype: str
    rows: int = 1
    element_io: bool = False  # the partials of the element-wise I/O decode kernel
    slice_cols: int = 0
    kind = "combine"
    source = "decode/combine.cu"

    @property
    def key(self):
        return (f"decode_combine_r{self.rows}_{self.dtype}{'_elem' if self.element_io else ''}"
                + (f"_c{self.slice_cols}" if self.slice_cols else ""))

    @property
    def name_expression(self):
        tail = (f", {str(self.element_io).lower()}, {self.slice_cols}" if self.slice_cols
                else ", true" if self.element_io else "")
        return f"cufa::decode_combine<{DTYPES.index(self.dtype)}, {self.rows}{tail}>"

    def slices(self, cols):
        """Grid y for rows of `cols` floats (o_partial's)."""
        return -(-cols // self.slice_cols) if self.slice_cols else 1


@dataclass(frozen=True)
class AppendVariant(_CacheKernel):
    """decode/append.cu's decode_append: new keys and values into the cache, rotary
    (fp8_cache: quantized into an e4m3 cache)."""
    dtype: str
    fp8_cache: bool = False
    kind = "append"
    source = "decode/append.cu"

    @property
    def key(self):
        return f"decode_append_{self.dtype}" + ("_e4m3" if self.fp8_cache else "")

    @property
    def name_expression(self):
        fp8 = ", true" if self.fp8_cache else ""
        return f"cufa::decode_append<{DTYPES.index(self.dtype)}{fp8}>"


class _Fp8PrePass(_CacheKernel):
    """A pre-pass of the fp8 forward (Hopper's): one kernel of e4m3 bytes, fwd/<kind>_e4m3.cu's
    <kind>_e4m3, 256 threads."""
    dtype = "e4m3"
    archs = ("sm_90",)  # (the fp8 forward is Hopper's)
    threads = 256

    @property
    def source(self):
        return f"fwd/{self.key}.cu"

    @property
    def key(self):
        return f"{self.kind}_e4m3"

    @property
    def name_expression(self):
        return f"cufa::{self.key}"


@dataclass(frozen=True)
class TransposeVVariant(_Fp8PrePass):
    """transpose_v_e4m3: the fp8 forward's V as (d, keys) rows, each 32-key step in the P
    operand's key order (cufa/_fp8.py)."""
    kind = "transpose_v"


@dataclass(frozen=True)
class GatherPagesVariant(_Fp8PrePass):
    """gather_pages_e4m3: a paged e4m3 cache's K and V pages as a packed batch's rows, for
    the fp8 forward (cufa/_fp8.py)."""
    kind = "gather_pages"


@dataclass(frozen=True)
class MergeVariant(_CacheKernel):
    """decode/merge.cu's merge_states (merge_attention_states), parts in MERGE_DTYPES."""
    dtype: str
    kind = "merge"
    source = "decode/merge.cu"

    @property
    def key(self):
        return f"merge_{self.dtype}"

    @property
    def name_expression(self):
        return f"cufa::merge_states<{MERGE_DTYPES.index(self.dtype)}>"


@functools.lru_cache(maxsize=None)  # a handful of values; planning a new signature asks
def decode_kernel(dtype, head_dim, element_io=False, fp8_cache=False, family="sm80",
                  head_pairs=False):
    """The decode kernel for a head dim on a kernel family's GPUs (family_for);
    head_pairs: the kernel of two adjacent KV heads a CTA (head_dim 64, the tile rows of
    d = 128's kernel), over an e4m3 cache or a 16-bit one."""
    if head_pairs:
        if element_io or head_dim != PAIRED_HEAD_DIM:
            raise ValueError(f"head pairs: 16-byte rows at d = {PAIRED_HEAD_DIM}")
        d = 2 * PAIRED_HEAD_DIM
        return DecodeVariant(dtype, d, fp8_cache=fp8_cache,
                             min_ctas=DECODE_FP8_MIN_CTAS.get(d, 0) if fp8_cache else 0,
                             head_pairs=True)
    d = padded_head_dim(head_dim)
    if d > MAX_HEAD_DIM and family == "sm90":
        warps, stages = DECODE_HALVES_SM90
        return DecodeVariant(dtype, d, stages=stages, warps=warps)
    return DecodeVariant(dtype, d, element_io=element_io, fp8_cache=fp8_cache,
                         min_ctas=DECODE_FP8_MIN_CTAS.get(d, 0) if fp8_cache else 0)


def _decode_shape_of(shapes, dtype, head_dim, head_pairs=False):
    """The decode kernel of shapes[padded head dim] ((warps, stages)), or None; head_pairs:
    of two heads of head_dim a CTA, d = 2 head_dim's shape."""
    d = 2 * head_dim if head_pairs else padded_head_dim(head_dim)
    if d not in shapes:
        return None
    warps, stages = shapes[d]
    return DecodeVariant(dtype, d, stages=stages, warps=warps, head_pairs=head_pairs)


@functools.lru_cache(maxsize=None)
def decode_kernel_with_more_ctas(dtype, head_dim, head_pairs=False):
    """The DECODE_MORE_CTAS shape for head_dim (with head_pairs: of a 16-bit cache's head
    pairs, d = 128's), or None."""
    return _decode_shape_of(DECODE_MORE_CTAS, dtype, head_dim, head_pairs)


@functools.lru_cache(maxsize=None)
def decode_tma_kernel(dtype, head_dim, units):
    """The TMA decode kernel (sm_90) at a padded head dim of DECODE_TMA_HEAD_DIMS."""
    return DecodeTmaVariant(dtype, head_dim, units)


def decode_variants():
    return ([DecodeVariant(dt, hd) for dt in DTYPES for hd in (*DECODE_HEAD_DIMS, WIDE_HEAD_DIM)]
            + [decode_kernel(dt, WIDE_HEAD_DIM, family="sm90") for dt in DTYPES]
            + [decode_kernel_with_more_ctas(dt, hd) for dt in DTYPES for hd in DECODE_MORE_CTAS]
            + [decode_tma_kernel(dt, hd, units) for dt in DTYPES for hd in DECODE_TMA_HEAD_DIMS
               for units in (1, 2)]
            + [decode_kernel(dt, hd, element_io=True) for dt in DTYPES for hd in DECODE_HEAD_DIMS]
            + [decode_kernel(dt, hd, fp8_cache=True) for dt in DTYPES for hd in DECODE_HEAD_DIMS]
            + [decode_kernel(dt, PAIRED_HEAD_DIM, fp8_cache=fp8, head_pairs=True)
               for dt in DTYPES for fp8 in (True, False)]
            + [decode_kernel_with_more_ctas(dt, PAIRED_HEAD_DIM, head_pairs=True)
               for dt in DTYPES]
            + [MlaVariant(dt, tma, fp8) for dt in DTYPES for tma in (False, True)
               for fp8 in (False, True)]

            + [CombineVariant(dt, rows=rows, element_io=elem) for dt in DTYPES
               for rows in (1, 4) for elem in (False, True)]
            + [CombineVariant(dt, element_io=elem, slice_cols=COMBINE_SLICE_COLS)
               for dt in DTYPES for elem in (False, True)]
            + [AppendVariant(dt, fp8) for dt in DTYPES for fp8 in (False, True)]
            + [MergeVariant(dt) for dt in MERGE_DTYPES])


def padded_head_dim(head_dim, family="sm80"):
    for hd in (SM80_HEAD_DIMS if family == "sm80" else SM90_HEAD_DIMS):
        if head_dim <= hd:
            return hd
    if family == "sm80" and head_dim <= WIDE_HEAD_DIM:
        return WIDE_HEAD_DIM
    raise ValueError(f"head dim {head_dim} exceeds {MAX_HEAD_DIM}")


FP8_TILES = (128, 128)  # the fp8 forward's (block_m, block_n): a V^T row of a block is a panel
FP8_HEAD_DIMS = (128, 256)  # padded: an e4m3 row of whole 128-byte panels


def fwd_fp8_variant(dtype, head_dim, mask):
    """The fp8 forward's variant (Hopper): e4m3 q, k, v, out in dtype."""
    hd = next(h for h in FP8_HEAD_DIMS if head_dim <= h)
    return FwdVariant("sm90", dtype, hd, mask, False, *FP8_TILES, fp8=True)


@functools.lru_cache(maxsize=None)  # a handful of values; planning a new signature calls it
def fwd_variant(dtype, head_dim, mask, score_mods, family="sm80", rows="long", e4m3_kv=False,
                head_dim_v=0, wide_tiles=WIDE_TILES):
    """rows: the sm90 tile class of the batch (sm90_rows): "short" takes the 64-row
    tiles, "mid" the middle ones, where the head dim has them, else the next longer.
    e4m3_kv: K and V from an e4m3 cache, on the sm80 family's kernel (any GPU), as head
    dims above 256 are (WIDE_HEAD_DIM, on wide_tiles); head_dim_v: V's head dim where it
    is not Q's (a HEAD_DIM_V_PAIRS pair, on either family)."""
    if e4m3_kv or (head_dim > MAX_HEAD_DIM and head_dim_v not in (0, head_dim)):
        family = "sm80"  # (and the latent pair, q and k over 512: below)
    if head_dim > WIDE_HEAD_DIM:  # (a wide pair: check_head_dim_v has checked v's)
        if e4m3_kv or not head_dim_v or head_dim > WIDE_QK_HEAD_DIM:
            raise ValueError(f"head dim {head_dim} (over {WIDE_HEAD_DIM}) takes 16-bit k and "
                             f"a v of its own head dim, up to {WIDE_QK_HEAD_DIM} and "
                             f"{WIDE_V_HEAD_DIM}")
        return FwdVariant("sm80", dtype, WIDE_QK_HEAD_DIM, mask, bool(score_mods), *wide_tiles,
                          head_dim_v=WIDE_V_HEAD_DIM // 2)
    if family == "sm90" and head_dim > MAX_HEAD_DIM:
        return FwdVariant("sm90", dtype, WIDE_HEAD_DIM, mask, bool(score_mods), *SM90_WIDE_TILES,
                          head_dim_v=WIDE_HEAD_DIM // 2)
    hd = padded_head_dim(head_dim, family)
    if hd > MAX_HEAD_DIM:
        if e4m3_kv or (head_dim_v and head_dim_v != head_dim):
            raise ValueError(f"head dim {head_dim} (over {MAX_HEAD_DIM}) takes 16-bit k and v "
                             f"of q's head dim")
        return FwdVariant("sm80", dtype, hd, mask, bool(score_mods), *wide_tiles,
                          head_dim_v=hd // 2)
    dv = 0
    if head_dim_v and padded_head_dim(head_dim_v) != hd:  # the pair's v head dim covers it
        dv = next((hv for h, hv in HEAD_DIM_V_PAIRS if h == hd and head_dim_v <= hv), 0)
        if not dv or e4m3_kv:
            raise ValueError(f"no kernel for head dims {head_dim} (q, k) and {head_dim_v} (v)"
                             + (" with e4m3 k, v" if e4m3_kv else ""))
    short_tiles = SM90_SHORT_TILES_WINDOW if mask == "window" else SM90_SHORT_TILES
    if family == "sm80":
        block_m, block_n = (SM80_TILES_SCORE_MODS if score_mods else SM80_TILES)[hd]
    elif rows == "short" and hd in short_tiles:
        block_m, block_n = short_tiles[hd]
    elif score_mods:
        block_m, block_n = SM90_TILES_SCORE_MODS[hd]
    elif rows != "long" and hd in SM90_MID_TILES:
        block_m, block_n = SM90_MID_TILES[hd]
    else:
        block_m, block_n = (SM90_TILES_WINDOW if mask == "window" else SM90_TILES)[hd]
    if family == "sm90" and dv and not score_mods:
        block_m, block_n = SM90_HEAD_DIM_V_TILES[hd]
    hold = (family == "sm90" and rows == "long" and not score_mods
            and SM90_HOLD_PV_WAIT.get(hd) == (block_m, block_n))
    return FwdVariant(family, dtype, hd, mask, bool(score_mods), block_m, block_n, hold,
                      e4m3_kv=e4m3_kv, head_dim_v=dv)


@functools.lru_cache(maxsize=None)
def fwd_element_io_variant(dtype, head_dim):
    """The forward's element-wise I/O variant for a head dim (sm80 family, any GPU)."""
    hd = padded_head_dim(head_dim)
    block_m, block_n = SM80_TILES_SCORE_MODS[hd]
    return FwdVariant("sm80", dtype, hd, "window", True, block_m, block_n, element_io=True)


FAMILY_ENV = "CUFA_KERNEL_FAMILY"
SPIN_LIMIT_ENV = "CUFA_SPIN_LIMIT"  # debug_options
TRACE_ENV = "CUFA_TRACE"  # debug_options


def family_for(compute_capability):
    """The kernel family for a device: wgmma on Hopper (9.0), mma.sync elsewhere.
    CUFA_KERNEL_FAMILY=sm80 forces the portable path (tests use it on Hopper)."""
    forced = _overrides[FAMILY_ENV]
    if forced:
        if forced not in FAMILIES:
            raise ValueError(f"{FAMILY_ENV} must be one of {FAMILIES}; got {forced!r}")
        return forced
    return "sm90" if str(compute_capability) == "90" else "sm80"


def wide_tiles():
    """The forward's tiles above d = 256 that CUFA_WIDE_TILES asks for, or None (the
    planner's choice: WIDE_TILES where they fit, else WIDE_TILES_PORTABLE)."""
    text = (_overrides.get(WIDE_TILES_ENV) or "").replace(" ", "")
    if not text:
        return None
    rows, _, keys = text.partition("x")
    if rows != str(WIDE_TILES[0]) or keys not in {str(n) for n in WIDE_KEY_BLOCKS}:
        raise ValueError(f"{WIDE_TILES_ENV} takes '{WIDE_TILES[0]}xN' with N in "
                         f"{WIDE_KEY_BLOCKS}; got {text!r}")
    return WIDE_TILES[0], int(keys)


def read_overrides():
    """Read CUFA_KERNEL_FAMILY, CUFA_SM90_BLOCK_M, CUFA_DECODE_TMA and the backward's
    CUFA_BWD_* choices from the environment: at import, and again by api.clear_plans(). Plans are made with the values last read,
    not read from os.environ for each new signature's plan."""
    _overrides.update((name, os.environ.get(name))
                      for name in (FAMILY_ENV, SM90_ROWS_ENV, DECODE_TMA_ENV, BWD_FUSED_ENV,
                                   BWD_SM90_ENV, BWD_SM90_TILES_ENV, WIDE_TILES_ENV,
                                   BWD_SM90_PRODUCER_ENV, BWD_SM90_TMA_ENV, SPIN_LIMIT_ENV,
                                   TRACE_ENV, BWD_PERSISTENT_ENV, BWD_SPLIT_COLS_ENV))


_overrides = {}
read_overrides()


def all_variants():
    """Every kernel variant the library can launch (tile classes that fall back to the
    same tiles counted once)."""
    variants = [fwd_variant(dt, hd, mask, mods, family, rows)
                for family, dims in (("sm80", SM80_HEAD_DIMS), ("sm90", SM90_HEAD_DIMS))
                for rows in SM90_ROW_CLASSES.values() for dt in DTYPES for hd in dims
                for mask in MASKS
                for mods in (False, True)]
    variants += [fwd_element_io_variant(dt, hd) for dt in DTYPES for hd in SM80_HEAD_DIMS]
    variants += [fwd_variant(dt, hd, mask, mods, e4m3_kv=True) for dt in DTYPES
                 for hd in SM80_HEAD_DIMS for mask in MASKS for mods in (False, True)]
    variants += [fwd_variant(dt, hd, mask, mods, family, rows, head_dim_v=dv)
                 for family in ("sm80", "sm90") for rows in SM90_ROW_CLASSES.values()
                 for dt in DTYPES for hd, dv in HEAD_DIM_V_PAIRS for mask in MASKS
                 for mods in (False, True)]
    variants += [fwd_variant(dt, WIDE_HEAD_DIM, mask, mods, wide_tiles=tiles) for dt in DTYPES
                 for mask in MASKS for mods in (False, True)
                 for tiles in (WIDE_TILES, WIDE_TILES_PORTABLE)]
    variants += [fwd_variant(dt, WIDE_HEAD_DIM, mask, mods, "sm90") for dt in DTYPES
                 for mask in MASKS for mods in (False, True)]
    variants += [fwd_variant(dt, WIDE_QK_HEAD_DIM, mask, mods, head_dim_v=WIDE_V_HEAD_DIM)
                 for dt in DTYPES for mask in MASKS for mods in (False, True)]
    variants += [TransposeVVariant(), GatherPagesVariant()]  # (the fp8 forward's pre-passes)
    variants += [fwd_fp8_variant(dt, hd, mask) for dt in DTYPES for hd in FP8_HEAD_DIMS
                 for mask in MASKS]
    variants += [v for dt in DTYPES for hd in SM80_HEAD_DIMS for mask in MASKS
                 for mods in (False, True) for v in bwd_variants(dt, hd, mask, mods)]
    variants += [v for dt in DTYPES for hd in SM80_HEAD_DIMS for mask in MASKS
                 for mods in (False, True) for v in (bwd_fused_variants(dt, hd, mask, mods)
                                                     or ())]
    variants += [v for dt in DTYPES for hd in SM80_HEAD_DIMS for mask in MASKS
                 for tma, persistent in ((False, False), (True, False), (True, True))
                 for v in (bwd_sm90_fused_variants(dt, hd, mask, False, tma, persistent)
                           or ())]
    variants += [v for dt in DTYPES for hd in SM80_HEAD_DIMS for mask in MASKS
                 for mods in (False, True)
                 for tiles in ((), parse_bwd_sm90_tiles(BWD_SM90_ONE_WARPGROUP))
                 if not tiles or padded_head_dim(hd) <= 128
                 for tma in (False, True)  # (without TMA: arrays the copy engine refuses)
                 for v in (bwd_sm90_variants(dt, hd, mask, mods, tiles, tma=tma) or ())]
    variants += [v for dt in DTYPES
                 for hd in BWD_SM90_PRODUCER_HEAD_DIMS + BWD_SM90_TMA_PRODUCER_HEAD_DIMS
                 for mask in MASKS for tma in (False, True)
                 for v in bwd_sm90_variants(dt, hd, mask, False, producer=True, tma=tma)
                 if v.producer]
    variants += [v for dt in DTYPES for hd in SM80_HEAD_DIMS for mask in MASKS
                 for tma in (False, True)
                 for v in (bwd_sm90_variants(dt, hd, mask, False, producer=True, tma=tma,
                                             split_cols=True) or ())
                 if v.split_cols]
    # and each TMA kernel's cp.async twin, which a launch takes where the copy engine
    # cannot describe its arrays (_bwd_plan._launch)
    variants += [dataclasses.replace(v, tma=False, persistent=False) for v in variants
                 if getattr(v, "tma", False)]
    return list(dict.fromkeys(variants)) + [VARLEN_SCHEDULE] + decode_variants()


# -- sources ---------------------------------------------------------------------------

def _kernel_files():
    """The kernel sources as an importlib.resources tree: the installed package's data
    (a wheel, an sdist or an editable install; also inside a zip), or in a checkout run
    without installing (PYTHONPATH=.), the kernels_cu/ beside cufa/."""
    try:
        return importlib.resources.files("cufa.kernels_cu")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parent.parent / "kernels_cu"


KERNEL_FILES = _kernel_files()
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)
_source_cache = {}


def kernel_source(name):
    """The text of one kernel source file, named by its path under kernels_cu/ with "/"
    (e.g. "fwd/fwd_sm80.cu"), read as text (not through a file path, which a zipped install
    does not have)."""
    file = KERNEL_FILES
    for part in name.split("/"):
        file = file / part
    return file.read_text(encoding="utf-8")


def _inline(name, seen):
    """`name` with its includes inlined, each resolved from the including file's folder as
    the C preprocessor resolves a quoted include."""
    if name in seen:               # every header is #pragma once
        return ""
    seen.add(name)
    folder = posixpath.dirname(name)

    def include(m):
        return _inline(posixpath.normpath(posixpath.join(folder, m.group(1))), seen)
    return _INCLUDE.sub(include, kernel_source(name))


def assembled_source(filename):
    """One self-contained source string: includes inlined, layout checks appended."""
    src = _source_cache.get(filename)
    if src is None:
        body = _inline(filename, set())
        for marker, record in _params.RECORDS.items():
            if marker in body:
                body += "\n" + _params.layout_asserts(record)
        digest = hashlib.sha256(body.encode()).hexdigest()[:16]
        src = f"// cufa {filename} sha256:{digest}\n{body}"
        _source_cache[filename] = src
    return src


def source_digest(filename):
    return assembled_source(filename).split("\n", 1)[0].rsplit(":", 1)[1]


# -- compiling on a GPU (cupy.RawModule: NVRTC for the device's arch + CuPy's disk cache) --

_lock = threading.Lock()
_kernels = {}


def get_kernel(variant, device_id):
    """The compiled function of `variant` on `device_id`, compiled on first use: CuPy's
    RawKernel and its Function on that device. (A RawKernel loads its module for whichever
    device is current when its `.kernel` is read, so the Function is read here, with
    `device_id` current: read later, under a caller's other current device, it would be
    that device's, which a launch on `device_id` refuses as an invalid handle.)"""
    key = (device_id, variant)
    compiled = _kernels.get(key)
    if compiled is not None:
        return compiled
    with _lock:
        compiled = _kernels.get(key)
        if compiled is None:
            import cupy
            with cupy.cuda.Device(device_id):
                fn = raw_module(variant).get_function(variant.name_expression)
                if variant.smem_bytes > 48 * 1024:
                    fn.max_dynamic_shared_size_bytes = variant.smem_bytes
                if variant.ctas_per_sm > 1:  # room in shared memory for all of them, not one
                    fn.preferred_shared_memory_carveout = 100
                compiled = _kernels[key] = (fn, fn.kernel)
    return compiled


def raw_module(variant):
    """The cupy.RawModule a call compiles `variant` through, for the current device."""
    import cupy
    return cupy.RawModule(code=assembled_source(variant.source),
                          options=variant.options + debug_options(),
                          name_expressions=[variant.name_expression])


def debug_options():
    """NVRTC options from the environment, for debugging: CUFA_SPIN_LIMIT=N builds every
    kernel with mbarrier waits that trap after N tries (common/sm90.cuh's mbar_wait), so
    that a new kernel's deadlock fails its launch rather than hanging the process;
    CUFA_TRACE=1 builds the Hopper forward with its tiles' timeline (fwd/sm90_trace.cuh,
    read by bench/profile/tile_timeline.py), and the backward's dk/dv and the MLA decode
    kernels with their CTAs' (bwd_timeline.py, mla_timeline.py). CuPy's disk cache keys
    the options, so such builds sit beside the plain ones."""
    options = ()
    limit = _overrides.get(SPIN_LIMIT_ENV)
    if limit:
        if not limit.isdigit() or not 0 < int(limit) < 2**32:
            raise ValueError(f"{SPIN_LIMIT_ENV} takes a number of tries from 1 to 2^32 - 1; "
                             f"got {limit!r}")
        options += (f"-DCUFA_SPIN_LIMIT={int(limit)}u",)
    trace = _overrides.get(TRACE_ENV)
    if trace:
        if trace != "1":
            raise ValueError(f"{TRACE_ENV} takes 1 (or is unset); got {trace!r}")
        options += ("-DCUFA_TRACE",)
    return options


def function_pointer(variant, device_id):
    """The CUfunction handle of `variant` on `device_id` (for a launch through the
    driver), compiled on first use."""
    return get_kernel(variant, device_id)[1].ptr


def compiled_keys():
    return sorted(f"{v.key} (device {d})" for d, v in _kernels)


# -- filling CuPy's disk cache ahead of the calls (python -m cufa warmup), GPU or not --

def runs_on(variant, cc):
    """Whether `variant` runs on a GPU of compute capability `cc` (90 for sm_90). Its archs
    name the oldest GPU it runs on ("sm_80") or the only one ("sm_90a": wgmma, 9.0 only)."""
    for arch in variant.archs:
        n = int(arch[3:].rstrip("a"))
        if (cc == n) if arch.endswith("a") else (cc >= n):
            return True
    return False


@contextlib.contextmanager
def arch_flags_without_a_device():
    """CuPy memoizes its `-arch=` flag per current device, so it asks the driver even when
    the arch is given; the flag depends only on the arch, so while this is open CuPy
    calls the function under the memo. Needed to compile for a named arch without a GPU."""
    from cupy.cuda import compiler
    memoized = compiler._get_arch_for_options_for_nvrtc
    if not hasattr(memoized, "__wrapped__"):
        raise RuntimeError("this CuPy's compiler is not the one cufa's warmup knows (CuPy 14): "
                           "it cannot compile for a named arch without a GPU")
    compiler._get_arch_for_options_for_nvrtc = memoized.__wrapped__
    try:
        yield
    finally:
        compiler._get_arch_for_options_for_nvrtc = memoized


def compile_into_cache(variant, cc):
    """Compile `variant` into CuPy's on-disk kernel cache as a call on a GPU of compute
    capability `cc` would: the function raw_module's compile goes through, with the same
    source, options and name expression, so the cache key is the call's own. An entry
    already there costs a file read. Without a GPU, run it in arch_flags_without_a_device."""
    import cupy
    from cupy._core import core
    try:
        core.compile_with_cache(assembled_source(variant.source), tuple(variant.options),
                                arch=str(cc), prepend_cupy_headers=False,
                                name_expressions=(variant.name_expression,))
    except (cupy.cuda.runtime.CUDARuntimeError, cupy.cuda.driver.CUDADriverError):
        pass  # CuPy saves the cubin, then loads it: with no GPU of that arch the load fails


# -- compiling without a GPU (NVRTC for a named arch; ptxas report parsed) -------------

@dataclass
class CompileReport:
    variant: FwdVariant
    arch: str
    cubin_bytes: int
    registers: int
    stack_bytes: int
    spill_bytes: int
    log: str


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_for_arch(variant, arch, extra_options=()):
    """Compile `variant` for `arch` (e.g. "sm_90", "sm_90a") with NVRTC, no GPU needed
    (extra_options: more NVRTC options, as debug_options'). A virtual arch ("compute_90")
    stops at the PTX: no ptxas, so no registers (-1) or spills in the report, and its
    size is the PTX's.

    Raises cupy.cuda.compiler.CompileException on a compile error.
    """
    from cupy.cuda import compiler, nvrtc
    src = assembled_source(variant.source)
    ptx_only = arch.startswith("compute_")
    options = (NVRTC_OPTIONS + (f"-arch={arch}",) + (() if ptx_only else ("-Xptxas=-v",))
               + tuple(extra_options))
    prog = nvrtc.createProgram(src, variant.source, (), ())
    try:
        nvrtc.addNameExpression(prog, variant.name_expression)
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError:
            raise compiler.CompileException(nvrtc.getProgramLog(prog), src, variant.source,
                                            options, "nvrtc") from None
        log = nvrtc.getProgramLog(prog).rstrip("\x00")
        cubin = nvrtc.getPTX(prog) if ptx_only else nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    regs = _PTXAS_REGS.search(log)
    frame = _PTXAS_FRAME.search(log)
    stack, stores, loads = (int(x) for x in frame.groups()) if frame else (0, 0, 0)
    return CompileReport(variant, arch, len(cubin), int(regs.group(1)) if regs else -1,
                         stack, stores + loads, log)
