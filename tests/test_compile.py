"""CPU: kernel variants compile with NVRTC for sm_80 and sm_90 (sm_90a) without spills,
ptxas warnings or performance notes (the portable forward and backward for sm_90 to PTX
alone: compile_arch), and the params layout check really catches a drifted struct. No GPU
needed.

By default one representative variant of each kind of kernel compiles (seconds on two
cores): the README's test command stays short. CUFA_TEST_ALL_VARIANTS=1 compiles every
variant the library can launch (about 20 CPU-minutes on two cores; .ci/run does it in a
step of its own), with a progress line every 25 compiles when pytest shows output (-s)."""
import hashlib
import itertools
import json
import os
import re
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from cufa import _checks, _compile, _heuristics, _params, api



# ptxas lines that fail a compile here: its warnings, and the "info" lines that say the
# kernel runs slower than its source asks (C7511, "Potential Performance Loss: wgmma.
# mma_async instructions are serialized ...", is an info line, not a warning: it let a
# 10-15 % loss on the H200's short d = 128 rows through unnoticed)
_PTXAS_FINDINGS = re.compile(r"warning|performance loss|serialized", re.I)


def ptxas_findings(log):
    return [line for line in log.splitlines() if _PTXAS_FINDINGS.search(line)]


def _compile_one(args):
    variant, arch = args
    try:
        r = _compile.compile_for_arch(variant, arch)
    except Exception as e:  # report, don't raise across the process boundary
        return variant.key, arch, None, f"{type(e).__name__}: {e}"
    return variant.key, arch, (r.registers, r.stack_bytes, r.spill_bytes, r.cubin_bytes), \
        "\n".join(ptxas_findings(r.log))


def _report_file(job):
    """Where a compile's report is kept, under CUFA_TEST_COMPILE_CACHE: .ci/run sets it for
    one run, in which this file runs twice on the same sources (the checkout's, then the
    installed package's). A report depends only on the assembled source (every header
    inlined), the name expression, the arch and the NVRTC release, so the second run
    assembles each source from its own files and reads the first run's report."""
    from cupy.cuda import nvrtc
    variant, arch = job
    key = "\0".join([_compile.assembled_source(variant.source), variant.name_expression, arch,
                     str(nvrtc.getVersion())])
    name = hashlib.sha256(key.encode()).hexdigest() + ".json"
    return Path(os.environ["CUFA_TEST_COMPILE_CACHE"]) / name


ALL_VARIANTS = os.environ.get("CUFA_TEST_ALL_VARIANTS") == "1"


def representative_variants():
    """One variant of each kind of kernel: each kernel source, each sm90 tile class and
    consumer count, the held P V wait, score mods, one K/V stage (d = 256's mid tiles),
    the element-wise I/O variants, each decode shape. The mid d = 128 variant is the one
    ptxas once serialized (C7511)."""
    C = _compile
    return [
        C.fwd_variant("fp16", 128, "window", True, "sm80"),
        C.fwd_element_io_variant("bf16", 64),
        C.fwd_variant("fp16", 128, "none", False, "sm90", "mid"),
        C.fwd_variant("bf16", 64, "window", False, "sm90", "short"),
        C.fwd_variant("fp16", 64, "window", False, "sm90", "long"),       # held P V wait
        C.fwd_variant("bf16", 128, "window", False, "sm90", "long"),      # 192 rows
        C.fwd_variant("fp16", 256, "window", False, "sm90", "mid"),       # one K/V stage
        C.fwd_variant("bf16", 128, "none", True, "sm90", "mid"),          # score mods
        C.fwd_variant("fp16", 192, "window", False, "sm90", head_dim_v=128),  # V's own
        C.fwd_variant("bf16", 512, "window", True, "sm90"),               # column halves
        C.VARLEN_SCHEDULE,
        C.decode_kernel("fp16", 128),
        C.decode_kernel("bf16", 512),                                     # V's halves
        C.decode_kernel("bf16", 59, element_io=True),
        C.decode_kernel_with_more_ctas("fp16", 64),
        C.decode_tma_kernel("bf16", 64, 2),
        C.MlaVariant("bf16"),
        C.CombineVariant("fp16", rows=4),
        C.AppendVariant("bf16"),
        C.MergeVariant("fp32"),
        C.TransposeVVariant(),
        C.GatherPagesVariant(),
        *C.bwd_variants("bf16", 128, "window", True),  # preprocess, dq, dk and dv together
        C.bwd_variants("fp16", 256, "none", False)[3],  # dv alone
        *C.bwd_sm90_variants("fp16", 128, "window", False)[1:],  # dq, dk and dv on wgmma
        *C.bwd_sm90_variants("bf16", 64, "none", True)[1:],  # dk/dv on 128-query blocks
        *C.bwd_sm90_variants("bf16", 128, "window", False)[1:],  # two warpgroups
        *C.bwd_sm90_variants("fp16", 128, "none", True,
                             C.parse_bwd_sm90_tiles(C.BWD_SM90_ONE_WARPGROUP))[1:],
        *C.bwd_sm90_variants("fp16", 256, "window", True)[1:],  # dq on 32 keys; dk, dv apart
        *C.bwd_sm90_fused_variants("bf16", 128, "window", False)[1:],  # dq fused on wgmma
        *C.bwd_sm90_variants("bf16", 128, "window", False, producer=True,
                             tma=True)[1:],  # producers streaming by TMA
        *C.bwd_sm90_variants("bf16", 256, "window", False, producer=True, tma=True,
                             split_cols=True)[1:],  # dk and dv split by columns
        C.bwd_sm90_variants("fp16", 192, "none", False, producer=True,
                            split_cols=True)[2],  # (128 and 64 columns; cp.async)
        *C.bwd_sm90_fused_variants("bf16", 256, "none", False)[1:],  # and dq fused
    ]


def compile_arch(variant, arch):
    """The arch a variant's compile here targets. The portable families' forward and
    backward (sm80) for sm_90 stop at the PTX (compute_90): NVRTC's front end and
    optimizer run as for sm_90, ptxas does not. Their cubins (registers, spills) are
    checked for sm_80, the family's own GPUs; on an H100 or H200 they are fallbacks, and
    ptxas took about half of their 350 sm_90 compiles' time (1.9 s a compile against 1.0 to
    the PTX, one desk core), in a CI that had run past its 8 minutes."""
    portable = isinstance(variant, (_compile.FwdVariant, _compile.BwdVariant)) and \
        variant.family == "sm80"
    return "compute_90" if portable and arch == "sm_90" else arch


@pytest.fixture(scope="module")
def reports():
    variants = _compile.all_variants() if ALL_VARIANTS else representative_variants()
    jobs = [(v, compile_arch(v, a)) for v in variants for a in v.archs]
    kept = {}  # job -> its report's file, with CUFA_TEST_COMPILE_CACHE set
    if os.environ.get("CUFA_TEST_COMPILE_CACHE"):
        kept = {job: _report_file(job) for job in jobs}
    todo = [job for job in jobs if job not in kept or not kept[job].exists()]
    fresh = {}
    with ProcessPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        for i, (job, report) in enumerate(zip(todo, pool.map(_compile_one, todo)), 1):
            fresh[job] = report
            if i % 25 == 0 or i == len(todo):
                print(f"  compiled {i} of {len(todo)} ({len(jobs) - len(todo)} from the "
                      "report cache)", flush=True)
    for job in todo:
        if job in kept:
            kept[job].parent.mkdir(parents=True, exist_ok=True)
            kept[job].write_text(json.dumps(fresh[job]))
    return [fresh[job] if job in fresh else json.loads(kept[job].read_text()) for job in jobs]


def test_representatives_cover_every_kernel_source_and_shape():
    reps = representative_variants()
    assert {v.source for v in reps} == {v.source for v in _compile.all_variants()}
    sm90 = [v for v in reps if getattr(v, "family", "") == "sm90" and getattr(v, "block_m", 0)]
    assert {v.block_m for v in sm90} == {64, 128, 192}
    assert any(v.hold_pv_wait for v in sm90) and any(v.score_mods for v in sm90)
    assert any(v.kv_stages == 1 for v in sm90) and any(v.kv_stages == 2 for v in sm90)
    assert all(v in _compile.all_variants() for v in reps)


@pytest.mark.skipif(not ALL_VARIANTS, reason="compiles one variant of each kind; "
                    "CUFA_TEST_ALL_VARIANTS=1 compiles all of them (.ci/run does)")
def test_all_variants_were_compiled(reports):
    assert len(reports) == sum(len(v.archs) for v in _compile.all_variants())


def test_only_the_portable_families_sm_90_compiles_stop_at_the_ptx():
    jobs = [(v, a, compile_arch(v, a)) for v in representative_variants() for a in v.archs]
    ptx = {(type(v).__name__, v.family) for v, _, arch in jobs if arch.startswith("compute_")}
    assert ptx == {("FwdVariant", "sm80"), ("BwdVariant", "sm80")}
    C = _compile
    portable = C.fwd_variant("fp16", 128, "window", True, "sm80")
    assert [compile_arch(portable, a) for a in portable.archs] == ["sm_80", "compute_90"]
    for v in (C.decode_kernel("fp16", 128), C.CombineVariant("fp16", rows=4),
              C.fwd_variant("bf16", 64, "window", False, "sm90", "short"), C.MlaVariant("bf16"),
              C.bwd_sm90_variants("fp16", 128, "window", False)[1]):
        assert [compile_arch(v, a) for a in v.archs] == list(v.archs), v.key


def test_variant_list_is_complete_and_keys_unique():
    keys = [v.key for v in _compile.all_variants()]
    assert len(set(keys)) == len(keys) and "varlen_schedule" in keys
    variants = [v for v in _compile.all_variants() if isinstance(v, _compile.FwdVariant)]
    assert {v.dtype for v in variants} == set(_compile.DTYPES)
    for family, dims in (("sm80", _compile.SM80_HEAD_DIMS + (_compile.WIDE_HEAD_DIM,
                                                         _compile.WIDE_QK_HEAD_DIM)),
                         ("sm90", _compile.SM90_HEAD_DIMS + (_compile.WIDE_HEAD_DIM,))):
        assert {v.head_dim for v in variants if v.family == family} == set(dims)
    assert {(v.mask, v.score_mods) for v in variants} == {
        (m, s) for m in _compile.MASKS for s in (False, True)}
    for v in variants:  # sm80 must fit sm_86/89's 99 KB (but the wide tiles the planner
        # takes where a block gets 112 KB); sm90 the H100's 228 KB per SM
        wide = v.head_dim > _compile.MAX_HEAD_DIM and (v.block_m, v.block_n) == _compile.WIDE_TILES
        # (d = 640's: wide tiles alone, 136 KB: not on sm_86/89)
        assert v.smem_bytes <= v.smem_limit or wide, v.key
        assert v.ctas_per_sm * (v.smem_bytes + 1024) <= 228 * 1024 or v.family == "sm80", v.key
    short = [v for v in variants if v.family == "sm90" and v.block_m == 64]
    assert {(v.head_dim, v.mask) for v in short} == (
        {(hd, "none") for hd in _compile.SM90_SHORT_TILES}
        | {(hd, "window") for hd in _compile.SM90_SHORT_TILES_WINDOW})


@pytest.fixture
def setenv(monkeypatch):
    """Set (value) or unset (None) an override; plans read them by clear_plans()."""
    def set_override(name, value):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        api.clear_plans()
    yield set_override
    monkeypatch.undo()
    api.clear_plans()


def test_tile_class_follows_the_mean_sequence_length(setenv):
    setenv(_compile.SM90_ROWS_ENV, None)
    rows = _heuristics.sm90_rows
    limit = _heuristics.SM90_SHORT_MAX_MEAN_SEQLEN
    assert rows(True, limit * 10, 10, 128, "none") == "short"
    assert rows(True, limit * 10 + 1, 10, 128, "none") == "mid"
    dense = _heuristics.SM90_SHORT_DENSE_MAX_SEQLEN  # padded: d <= 64 and short only
    assert rows(False, dense, 10, 64, "none") == "short"
    assert rows(False, dense + 1, 10, 64, "none") == "long"
    # (no 64-row tiles without a mask: d = 64 short batches take the long ones, step 36)
    assert _compile.fwd_variant("fp16", 64, "none", False, "sm90", "short").block_m == 192
    assert _compile.fwd_variant("fp16", 64, "window", False, "sm90", "short").block_m == 64
    assert rows(False, 64, 10, 128, "none") == "mid"
    for mask, long_from in _heuristics.SM90_LONG_MIN_SEQLEN.items():
        assert rows(False, long_from - 1, 3, 128, mask) == "mid"
        assert rows(False, long_from, 3, 128, mask) == "long"
        assert rows(True, long_from * 3 - 1, 3, 128, mask) == "mid"  # packed: the mean
        assert rows(True, long_from * 3, 3, 128, mask) == "long"
    # d <= 64 causal: the long tiles (the held P V wait) from 8k rows
    d64_long = _heuristics.SM90_LONG_MIN_SEQLEN_D64_WINDOW
    assert rows(False, d64_long - 1, 1, 64, "window") == "mid"
    assert rows(False, d64_long, 1, 64, "window") == "long"
    assert rows(False, 2048, 1, 64, "none") == "long"  # (without a mask as before)
    mid = _compile.fwd_variant("fp16", 64, "window", False, "sm90", "mid")
    long = _compile.fwd_variant("fp16", 64, "window", False, "sm90", "long")
    assert (mid.block_m, mid.block_n) == (long.block_m, long.block_n)
    assert long.hold_pv_wait and not mid.hold_pv_wait
    # chunked prefill (keys at least twice the query rows) from 128 rows, above d = 64
    chunk = _heuristics.SM90_CHUNK_MIN_MEAN_SEQLEN
    assert rows(True, chunk * 8, 8, 128, "window", keys_per_sequence=2 * chunk) == "mid"
    assert rows(True, chunk * 8, 8, 128, "window", keys_per_sequence=2 * chunk - 1) == "short"
    assert rows(True, chunk * 8 - 1, 8, 128, "window", keys_per_sequence=4096) == "short"
    assert rows(True, chunk * 8, 8, 64, "window", keys_per_sequence=4096) == "short"
    assert rows(True, limit * 8, 8, 256, "window", keys_per_sequence=4096) == "mid"
    setenv(_compile.SM90_ROWS_ENV, "64")
    assert rows(False, 1 << 20, 1, 128, "none") == "short"
    setenv(_compile.SM90_ROWS_ENV, "128")
    assert rows(True, 64, 10, 64, "none") == "mid"
    setenv(_compile.SM90_ROWS_ENV, "192")
    assert rows(True, 64, 10, 64, "window") == "long"
    setenv(_compile.SM90_ROWS_ENV, "32")
    with pytest.raises(ValueError, match=_compile.SM90_ROWS_ENV):
        rows(True, 64, 10, 64, "none")


@pytest.mark.parametrize("rows", ["short", "mid", "long"])
def test_each_tile_class_takes_its_table_or_the_next_longer(rows):
    for hd, mask, mods in itertools.product((64, 128, 192, 256), _compile.MASKS, (False, True)):
        v = _compile.fwd_variant("bf16", hd, mask, mods, "sm90", rows=rows)
        short = _compile.SM90_SHORT_TILES_WINDOW if mask == "window" else _compile.SM90_SHORT_TILES
        long = _compile.SM90_TILES_WINDOW if mask == "window" else _compile.SM90_TILES
        if rows == "short" and hd in short:
            expected = short[hd]
        elif mods:
            expected = _compile.SM90_TILES_SCORE_MODS[hd]
        elif rows != "long" and hd in _compile.SM90_MID_TILES:
            expected = _compile.SM90_MID_TILES[hd]
        else:
            expected = long[hd]
        assert (v.block_m, v.block_n) == expected, v.key
        assert v.threads == 128 * (1 + v.block_m // 64)
        assert v.ctas_per_sm == (2 if v.block_m == 64 else 1)
        hold = rows == "long" and not mods and hd == 64  # SM90_HOLD_PV_WAIT's tiles
        assert v.hold_pv_wait == hold, v.key
        assert v.key.endswith("_hold") == hold
        assert (f", {v.block_m}, {v.block_n}, {v.q_stages}, {v.kv_stages}, {str(hold).lower()}>"
                in v.name_expression)
        # one K/V stage only where two do not fit beside a Q stage (d = 256's 128-key blocks)
        assert v.kv_stages == (1 if v._sm90_smem(1, 2) > v.smem_limit else 2), v.key
        assert v.smem_bytes <= v.smem_limit, v.key
    mid = _compile.fwd_variant("bf16", 256, "window", False, "sm90", rows="mid")
    assert (mid.block_n, mid.q_stages, mid.kv_stages) == (128, 1, 1)
    assert _compile.fwd_variant("fp16", 64, "none", False, "sm80", rows=rows).block_m == 128
    # d = 128 really has three classes: 64 rows (causal), 128 and 192
    assert _compile.fwd_variant("fp16", 128, "window", False, "sm90", rows=rows).block_m == {
        "short": 64, "mid": 128, "long": 192}[rows]


def test_variants_compile_without_spills_or_ptxas_notes(reports):
    bad = [(k, a, err) for k, a, r, err in reports if err]
    # (a ptxas warning or performance note is an error here: C7514 and C7511, wgmma
    # serialized, cost 10-50 %)
    assert not bad, "compile errors or ptxas warnings:\n" + "\n".join(f"{k} {a}: {e[:2000]}" for k, a, e in bad)
    spills = [(k, a, r) for k, a, r, _ in reports if r and (r[2] or r[1])]
    assert not spills, "local memory (registers, stack, spill bytes):\n" + "\n".join(map(str, spills))
    for key, arch, (regs, _, _, size), _ in reports:
        assert size > 0 and (0 < regs <= 255 or arch.startswith("compute_")), (key, arch)
    regs = [r[0] for _, arch, r, _ in reports if not arch.startswith("compute_")]
    print(f"\n{len(reports)} compiles ({len(reports) - len(regs)} to PTX alone), registers "
          f"{min(regs)}..{max(regs)}")


def test_ptxas_findings_catch_serialized_wgmma():
    # lines as ptxas (CUDA 13) printed them for fwd_sm90_fp16_hd128_bm128_bn128_none
    # before its fix; the C7519 note ("warpgroup.arrive is injected") came with every
    # variant of that consumer, fast ones too, and is not a finding
    fn = "'_ZN4cufa15fwd_sm90_kernelILi0ELi128ELi0ELb0ELi128ELi128ELi2ELi2ELb0EEEvNS_9FwdParamsENS_10TensorMapsE'"
    log = "\n".join([
        "ptxas info    : (C7519) warpgroup.arrive is injected in around line 1597 by compiler "
        f"to allow use of registers in GMMA in function {fn}",
        "ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are "
        "serialized due to insufficient register resources for the wgmma pipeline in the "
        f"function {fn}",
        "ptxas info    : Used 168 registers, used 16 barriers",
        "ptxas warning : (C7514) wgmma.mma_async instructions are serialized due to ...",
    ])
    found = ptxas_findings(log)
    assert [line.split(")")[0][-5:] for line in found] == ["C7511", "C7514"]


def test_kernels_unbounded_window_is_the_hosts():
    # apply_mask's one-compare path keys on it: a window side the host sends as unbounded
    # must read as unbounded in the kernels
    m = re.search(r"constexpr int kUnboundedWindow = 1 << (\d+);", _compile.kernel_source("fwd/mask.cuh"))
    assert m and 1 << int(m.group(1)) == _checks.UNBOUNDED


def test_head_dim_padding():
    dims = (8, 32, 40, 64, 72, 128, 136, 248, 256)
    assert [_compile.padded_head_dim(d) for d in dims] == [32, 32, 64, 64, 96, 128, 160, 256, 256]
    assert [_compile.padded_head_dim(d, "sm90") for d in dims] == [
        64, 64, 64, 64, 128, 128, 192, 256, 256]
    # above 256 the sm80 family's two-half kernel takes any head dim up to 512
    assert [_compile.padded_head_dim(d) for d in (264, 512)] == [512, 512]
    for d, family in ((264, "sm90"), (520, "sm80")):
        with pytest.raises(ValueError):
            _compile.padded_head_dim(d, family)


def test_family_choice(setenv):
    setenv("CUFA_KERNEL_FAMILY", None)
    assert _compile.family_for("90") == "sm90"
    assert [_compile.family_for(cc) for cc in ("80", "86", "89", "100", "120")] == ["sm80"] * 5
    setenv("CUFA_KERNEL_FAMILY", "sm80")
    assert _compile.family_for("90") == "sm80"
    setenv("CUFA_KERNEL_FAMILY", "sm70")
    with pytest.raises(ValueError, match="CUFA_KERNEL_FAMILY"):
        _compile.family_for("90")


def test_wgmma_header_is_generated_from_the_script():
    import importlib.util
    from pathlib import Path
    gen = Path(__file__).resolve().parent.parent / "tools" / "gen_wgmma.py"
    spec = importlib.util.spec_from_file_location("gen_wgmma", gen)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.HEADER.read_text() == module.generate(), "run python tools/gen_wgmma.py"


@pytest.mark.parametrize("source", ["fwd/fwd_sm80.cu", "fwd/fwd_sm90.cu"])
def test_source_has_headers_inlined_and_digest(source):
    src = _compile.assembled_source(source)
    assert '#include "' not in src
    assert src.count("struct FwdParams {") == 1 and "struct OnlineSoftmax" in src
    assert src.startswith(f"// cufa {source} sha256:")
    assert "static_assert(sizeof(cufa::FwdParams)" in src


def test_layout_check_catches_a_swapped_field(monkeypatch):
    from cupy.cuda.compiler import CompileException
    fields = list(_params.FWD_FIELDS)
    i, j = fields.index(("q_row_stride", np.int64)), fields.index(("q_head_stride", np.int64))
    fields[i], fields[j] = fields[j], fields[i]
    monkeypatch.setattr(_params.FWD, "dtype", np.dtype(fields, align=True))
    monkeypatch.setattr(_compile, "_source_cache", {})
    with pytest.raises(CompileException, match="q_row_stride offset differs"):
        _compile.compile_for_arch(_compile.fwd_variant("fp16", 64, "none", False), "sm_80")


def test_spin_limit_builds_trap_on_a_wait_that_never_ends(monkeypatch):
    """CUFA_SPIN_LIMIT (a debugging build: mbarrier waits that trap after so many tries)
    reaches NVRTC as a define, a wrong value is refused naming the variable, and a kernel
    full of mbarrier waits (MLA decode's producer and consumers) compiles with it."""
    monkeypatch.setitem(_compile._overrides, _compile.SPIN_LIMIT_ENV, None)
    assert _compile.debug_options() == ()
    monkeypatch.setitem(_compile._overrides, _compile.SPIN_LIMIT_ENV, "1000000")
    assert _compile.debug_options() == ("-DCUFA_SPIN_LIMIT=1000000u",)
    for bad in ("0", "-5", "1e6", str(2**32)):
        monkeypatch.setitem(_compile._overrides, _compile.SPIN_LIMIT_ENV, bad)
        with pytest.raises(ValueError, match="CUFA_SPIN_LIMIT takes a number of tries"):
            _compile.debug_options()
    report = _compile.compile_for_arch(_compile.MlaVariant("bf16"), "sm_90a",
                                       ("-DCUFA_SPIN_LIMIT=1000000u",))
    assert report.registers > 0


def test_trace_builds_hold_the_tile_table_and_plain_builds_do_not(monkeypatch):
    """CUFA_TRACE=1 (bench/profile/tile_timeline.py's, bwd_timeline.py's and
    mla_timeline.py's build) reaches NVRTC as a define and gives the Hopper forward its
    table of tile stamps (264 CTAs x 512 tiles x 10 u64: ptxas counts it as global memory),
    and the backward's dk/dv kernel and the MLA decode kernel their CTAs'; without it the
    kernels have none, and any other value is refused naming the variable."""
    monkeypatch.setitem(_compile._overrides, _compile.SPIN_LIMIT_ENV, None)
    monkeypatch.setitem(_compile._overrides, _compile.TRACE_ENV, "1")
    assert _compile.debug_options() == ("-DCUFA_TRACE",)
    monkeypatch.setitem(_compile._overrides, _compile.TRACE_ENV, "yes")
    with pytest.raises(ValueError, match="CUFA_TRACE takes 1"):
        _compile.debug_options()
    variant = _compile.fwd_variant("bf16", 256, "window", False, family="sm90", rows="mid")
    table = 264 * 512 * 10 * 8
    gmem = [int(line.split()[-3]) for line in
            _compile.compile_for_arch(variant, "sm_90a", ("-DCUFA_TRACE",)).log.splitlines()
            if line.endswith("bytes gmem")]
    assert gmem and max(gmem) >= table
    gmem = [int(line.split()[-3]) for line in
            _compile.compile_for_arch(variant, "sm_90a").log.splitlines()
            if line.endswith("bytes gmem")]
    assert max(gmem, default=0) < table
    # the backward's dk/dv kernel: its CTAs' stamps (8192 x 8 u64, bench/profile/bwd_timeline.py)
    variant = _compile.bwd_sm90_fused_variants("bf16", 128, "none", False)[1]
    table = 8192 * 8 * 8
    for options, has_table in ((("-DCUFA_TRACE",), True), ((), False)):
        gmem = [int(line.split()[-3]) for line in
                _compile.compile_for_arch(variant, "sm_90a", options).log.splitlines()
                if line.endswith("bytes gmem")]
        assert (max(gmem, default=0) >= table) == has_table, options
    # the MLA decode kernel's: its CTAs' stamps (4096 x 8 u64, bench/profile/mla_timeline.py)
    variant, table = _compile.MlaVariant("bf16", tma=True), 4096 * 8 * 8
    for options, has_table in ((("-DCUFA_TRACE",), True), ((), False)):
        gmem = [int(line.split()[-3]) for line in
                _compile.compile_for_arch(variant, "sm_90a", options).log.splitlines()
                if line.endswith("bytes gmem")]
        assert (max(gmem, default=0) >= table) == has_table, options
