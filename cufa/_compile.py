"""Kernel sources -> compiled functions: source loading, variant keys, NVRTC options, caches.

A variant is one template instantiation, named by a key a person can read
(``fwd_bf16_hd128_bm128_bn64_window``). Sources are read from ``kernels_cu/`` with
their ``#include "..."`` files inlined, so the string CuPy hashes for its disk
cache covers every header (CuPy's key sees only the top-level string). Compiled
functions are cached in memory per (device, variant); the first use of a variant
compiles it once even when several threads ask at the same time.
"""
import hashlib
import importlib.resources
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from . import _params

DTYPES = ("fp16", "bf16")           # index = Dtype in common.cuh
MASKS = ("none", "window")          # index = MaskKind in mask.cuh
PADDED_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)
MAX_HEAD_DIM = PADDED_HEAD_DIMS[-1]
THREADS = 128                       # kThreads in fwd_sm80.cu

# (block_m, block_n) per padded head dim: the largest tile whose accumulators
# (O: block_m * head_dim / 128 floats a thread, S: block_m * block_n / 128) fit in
# 255 registers without ptxas spilling. block_m 128 gives each warp 32 rows, so a
# K/V fragment read from shared memory feeds two MMAs; above head dim 128 only 16
# rows a warp fit. The score-mods variants need more registers at head dim 128.
TILES = {32: (128, 64), 64: (128, 64), 96: (128, 32), 128: (128, 32),
         160: (64, 64), 192: (64, 64), 224: (64, 64), 256: (64, 64)}
TILES_SCORE_MODS = {**TILES, 128: (64, 64)}

NVRTC_OPTIONS = ("-std=c++17",)


@dataclass(frozen=True)
class FwdVariant:
    dtype: str          # "fp16" | "bf16"
    head_dim: int       # padded head dim, one of PADDED_HEAD_DIMS
    mask: str           # "none" | "window" (causal is a window)
    score_mods: bool    # softcap / ALiBi / explicit attn_mask, chosen at run time
    block_m: int
    block_n: int

    source = "fwd_sm80.cu"

    @property
    def key(self):
        mods = "_mods" if self.score_mods else ""
        return (f"fwd_{self.dtype}_hd{self.head_dim}_bm{self.block_m}_bn{self.block_n}"
                f"_{self.mask}{mods}")

    @property
    def name_expression(self):
        return (f"cufa::fwd_kernel<{DTYPES.index(self.dtype)}, {self.head_dim}, "
                f"{MASKS.index(self.mask)}, {str(self.score_mods).lower()}, "
                f"{self.block_m}, {self.block_n}>")

    @property
    def smem_bytes(self):
        return (self.block_m + 2 * self.block_n) * self.head_dim * 2


def padded_head_dim(head_dim):
    for hd in PADDED_HEAD_DIMS:
        if head_dim <= hd:
            return hd
    raise ValueError(f"head dim {head_dim} exceeds {MAX_HEAD_DIM}")


def fwd_variant(dtype, head_dim, mask, score_mods):
    hd = padded_head_dim(head_dim)
    block_m, block_n = (TILES_SCORE_MODS if score_mods else TILES)[hd]
    return FwdVariant(dtype, hd, mask, bool(score_mods), block_m, block_n)


def all_variants():
    """Every kernel variant the library can launch."""
    return [fwd_variant(dt, hd, mask, mods)
            for dt in DTYPES for hd in PADDED_HEAD_DIMS for mask in MASKS
            for mods in (False, True)]


# -- sources ---------------------------------------------------------------------------

def _kernel_dir():
    try:
        path = Path(str(importlib.resources.files("cufa.kernels_cu")))
        if (path / "common.cuh").is_file():
            return path
    except (ModuleNotFoundError, TypeError):
        pass
    return Path(__file__).resolve().parent.parent / "kernels_cu"


KERNEL_DIR = _kernel_dir()
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)
_source_cache = {}


def _inline(name, seen):
    if name in seen:               # every header is #pragma once
        return ""
    seen.add(name)
    text = (KERNEL_DIR / name).read_text()
    return _INCLUDE.sub(lambda m: _inline(m.group(1), seen), text)


def assembled_source(filename):
    """One self-contained source string: includes inlined, layout checks appended."""
    src = _source_cache.get(filename)
    if src is None:
        body = _inline(filename, set()) + "\n" + _params.layout_asserts()
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
    """The compiled function of `variant` on `device_id`, compiled on first use."""
    fn = _kernels.get((device_id, variant))
    if fn is not None:
        return fn
    with _lock:
        fn = _kernels.get((device_id, variant))
        if fn is None:
            import cupy
            with cupy.cuda.Device(device_id):
                module = cupy.RawModule(code=assembled_source(variant.source),
                                        options=NVRTC_OPTIONS,
                                        name_expressions=[variant.name_expression])
                fn = module.get_function(variant.name_expression)
                if variant.smem_bytes > 48 * 1024:
                    fn.max_dynamic_shared_size_bytes = variant.smem_bytes
            _kernels[(device_id, variant)] = fn
    return fn


def compiled_keys():
    return sorted(f"{v.key} (device {d})" for d, v in _kernels)


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


def compile_for_arch(variant, arch):
    """Compile `variant` for `arch` (e.g. "sm_90") with NVRTC, no GPU needed.

    Raises cupy.cuda.compiler.CompileException on a compile error.
    """
    from cupy.cuda import compiler, nvrtc
    src = assembled_source(variant.source)
    options = NVRTC_OPTIONS + (f"-arch={arch}", "-Xptxas=-v")
    prog = nvrtc.createProgram(src, variant.source, (), ())
    try:
        nvrtc.addNameExpression(prog, variant.name_expression)
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError:
            raise compiler.CompileException(nvrtc.getProgramLog(prog), src, variant.source,
                                            options, "nvrtc") from None
        log = nvrtc.getProgramLog(prog).rstrip("\x00")
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    regs = _PTXAS_REGS.search(log)
    frame = _PTXAS_FRAME.search(log)
    stack, stores, loads = (int(x) for x in frame.groups()) if frame else (0, 0, 0)
    return CompileReport(variant, arch, len(cubin), int(regs.group(1)) if regs else -1,
                         stack, stores + loads, log)
