"""CPU: the backward's host side. Bad input raises an error naming the argument; a valid
call builds the records and launches the kernels with the grids the kernels expect (the
driver, the allocator and the compiler replaced by recorders, the records read back
through their NumPy layouts); a repeated call launches its kept plan; and the torch route
sends a call that autograd records to the backward through the ops' autograd formulas (as
an autograd.Function where eager, the ops themselves under torch.compile)."""
import contextlib
import dataclasses

import numpy as np
import pytest

import cufa
from cufa import _bwd_plan, _checks, _compile, _heuristics, _params, _tma
from cufa._interop import DeviceArray


def arr(shape, dtype="float16", strides=None, ptr=0x7f0000000000, framework="cupy"):
    if strides is None:
        strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    itemsize = {"float16": 2, "bfloat16": 2, "float32": 4, "int32": 4}[dtype]
    return DeviceArray(None, framework, ptr, tuple(shape), tuple(strides), dtype, 0, itemsize)


def dense_args(b=2, sq=33, sk=47, h=4, hk=2, d=64, dtype="float16"):
    q, k, v = arr((b, sq, h, d), dtype, ptr=0x1000), arr((b, sk, hk, d), dtype, ptr=0x2000), \
        arr((b, sk, hk, d), dtype, ptr=0x3000)
    out, dout = arr((b, sq, h, d), dtype, ptr=0x4000), arr((b, sq, h, d), dtype, ptr=0x5000)
    lse = arr((b, h, sq), "float32", ptr=0x6000)
    return dout, q, k, v, out, lse


CASES = [
    ("dout shape", dict(dout=arr((2, 33, 4, 32))), ValueError, "dout must have out's shape"),
    ("dout dtype", dict(dout=arr((2, 33, 4, 64), "bfloat16")), ValueError, "dout must have"),
    ("lse dtype", dict(lse=arr((2, 4, 33), "float16")), TypeError, "lse must be float32"),
    ("lse shape", dict(lse=arr((2, 33, 4), "float32")), ValueError, "lse must have shape (2, 4, 33)"),
    ("lse strided", dict(lse=arr((2, 4, 33), "float32", strides=(4 * 40, 40, 1))), ValueError,
     "lse must be contiguous"),
    ("out shape", dict(out=arr((2, 33, 4, 32))), ValueError, "out must have q's shape"),
    ("dq shape", dict(dq=arr((2, 33, 4, 32))), ValueError, "dq must have q's shape"),
    ("dk dtype", dict(dk=arr((2, 47, 2, 64), "bfloat16")), ValueError, "dk must have k's shape"),
    ("odd head dim", dict(zip(("dout", "q", "k", "v", "out", "lse"), dense_args(d=36))),
     NotImplementedError, "16-byte chunks"),
    ("k dtype", dict(k=arr((2, 47, 2, 64), "bfloat16")), TypeError, "k has dtype bfloat16"),
    ("no out", dict(out=None), ValueError, "out, the forward's output"),
    # gradients written where they would be read, or twice into one element
    ("dq is q", dict(dq=arr((2, 33, 4, 64), ptr=0x1000)), ValueError, "dq and q are one array"),
    ("dq is dout", dict(dq=arr((2, 33, 4, 64), ptr=0x5000)), ValueError,
     "dq and dout are one array"),
    ("dk is dv", dict(dk=arr((2, 47, 2, 64), ptr=0x8000), dv=arr((2, 47, 2, 64), ptr=0x8000)),
     ValueError, "dv and dk are one array"),
    ("dq expanded", dict(dq=arr((2, 33, 4, 64), strides=(0, 0, 64, 1), ptr=0x9000)), ValueError,
     "dq is written, and its elements share memory"),
    ("dk rows overlap", dict(dk=arr((2, 47, 2, 64), strides=(47 * 32, 32, 16, 1), ptr=0x9000)),
     ValueError, "dk is written, and its elements share memory"),
]


@pytest.mark.parametrize("name,change,error,message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_names_the_argument(name, change, error, message):
    args = dict(zip(("dout", "q", "k", "v", "out", "lse"), dense_args()))
    args.update(change)
    kw = {n: args.pop(n) for n in ("dq", "dk", "dv") if n in args}
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        cufa.flash_attn_backward(*args.values(), **kw)


def test_a_packed_dqkv_passes_and_flags_are_bools(monkeypatch):
    """dq, dk, dv as the three parts of one (b, s, 3, h, d) buffer start apart and pass (the
    kernels never write one part's elements through another); deterministic is a flag."""
    Recorder(monkeypatch)
    dout, q, k, v, out, lse = dense_args(sk=33, hk=4)
    row = 3 * 4 * 64  # (the dqkv buffer's row: three parts of 4 heads x 64)
    dq, dk, dv = (arr((2, 33, 4, 64), strides=(33 * row, row, 64, 1), ptr=0x10000 + 128 * i)
                  for i in range(3))
    cufa.flash_attn_backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        cufa.flash_attn_backward(dout, q, k, v, out, lse, deterministic="no")


def test_varlen_backward_checks_max_seqlen():
    dout, q, k, v, out, _ = (x for x in dense_args(b=1))
    q, k, v, out, dout = (arr(x.shape[1:], ptr=x.ptr) for x in (q, k, v, out, dout))
    for bad in (None, -5, "junk"):
        with pytest.raises(ValueError, match="max_seqlen_q must be an int >= 0"):
            cufa.flash_attn_varlen_backward(dout, q, k, v, out, arr((4, 33), "float32"),
                                            arr((2,), "int32"), arr((2,), "int32"), bad, 47)


def test_varlen_bad_cu_seqlens():
    dout, q, k, v, out, _ = (x for x in dense_args(b=1))
    q, k, v, out, dout = (arr(x.shape[1:], ptr=x.ptr) for x in (q, k, v, out, dout))
    lse = arr((4, 33), "float32")
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        cufa.flash_attn_varlen_backward(dout, q, k, v, out, lse, arr((3,), "float32"),
                                        arr((3,), "int32"), 20, 30)


class Recorder:
    """Stands in for the driver, the allocator and the compiler."""

    def __init__(self, monkeypatch):
        self.launches, self.allocations, self.next_ptr = [], [], 0x100000
        monkeypatch.setattr(_bwd_plan, "caller_stream", lambda *a: contextlib.nullcontext(7))
        monkeypatch.setattr(_bwd_plan, "driver_launch", self.launch)
        monkeypatch.setattr(_bwd_plan, "stream_call", lambda *a, **k: None)
        monkeypatch.setattr(_bwd_plan, "stream_workspace", self.workspace)
        monkeypatch.setattr(_bwd_plan._interop, "allocate", self.allocate)
        monkeypatch.setattr(_compile, "function_pointer", lambda variant, device: variant)
        # an A100's: the mma.sync kernels (Hopper's wgmma choice: _compile's own tests)
        monkeypatch.setattr(_bwd_plan._runtime, "compute_capability", lambda device: 80)
        monkeypatch.setattr(_bwd_plan._runtime, "sm_count", lambda device: 132)  # (an H200's)
        # TMA maps without a driver: a record naming what the producer streams
        self.maps = []  # per launch: its maps argument, or None where it takes none
        monkeypatch.setattr(_bwd_plan, "_streamed_template", self.streamed_template)
        monkeypatch.setattr(_bwd_plan._tma, "with_addresses",
                            lambda template, x, x_again, y: template[:2] + (x, y) + template[2:])
        self.maps_refused = False
        # every call planned: the tests change what planning reads between calls of one
        # signature (test_a_kept_plan_launches_as_planned keeps them)
        monkeypatch.setattr(_bwd_plan, "_kept", lambda *args: (None, None))

    def streamed_template(self, variant, x, y, seq_dim, head_dim, d, packed):
        return None if self.maps_refused else ("maps", variant.kind, packed)

    def allocate(self, framework, shape, dtype, device, stream, like=None):
        ptr = self.next_ptr
        self.next_ptr += 0x100000
        self.allocations.append((shape, dtype, ptr))
        return ("array", shape, dtype), ptr

    def workspace(self, framework, device, stream, nbytes):
        self.workspace_bytes = nbytes
        return None, 0x900000

    def launch(self, function, blocks, threads, smem, stream, args):
        records = args  # (a work list's schedule: its one record)
        if len(args) in (2, 3):  # FwdParams, BwdParams (and bwd_sm90.cu's kernels' maps)
            records = [np.frombuffer(bytes(a), dtype=r.dtype)[0]
                       for a, r in zip(args[:2], (_params.FWD, _params.BWD))]
        self.maps.append(args[2] if len(args) == 3 else None)
        self.launches.append((function, blocks, threads, smem, stream, records))


def test_dense_launches_and_records(monkeypatch):
    rec = Recorder(monkeypatch)
    dout, q, k, v, out, lse = dense_args(b=2, sq=33, sk=47, h=4, hk=2, d=72)
    dq, dk, dv, dsink = cufa.flash_attn_backward(dout, q, k, v, out, lse, causal=True)[:3] + (None,)
    assert [a[0] for a in rec.allocations[:3]] == [q.shape, k.shape, v.shape]
    kinds = [(f.kind, f.head_dim) for f, *_ in rec.launches]
    assert kinds == [("preprocess", 0), ("dq", 96), ("dkdv", 96)]
    (pre, pre_blocks, *_), (dqv, dq_blocks, *_), (kv, kv_blocks, _, _, _, (fwd, bwd)) = rec.launches
    assert pre_blocks == -(-2 * 33 // _bwd_plan.PREPROCESS_ROWS_PER_CTA) * 4
    assert dq_blocks == -(-33 // dqv.block_m) * 2 * 4
    assert kv_blocks == -(-47 // 64) * 2 * 2
    assert (fwd["q"], fwd["k"], fwd["v"], fwd["o"], fwd["lse"]) == (0x1000, 0x2000, 0x3000,
                                                                     0x4000, 0x6000)
    assert (fwd["window_left"], fwd["window_right"], fwd["bottom_right"]) == (1 << 30, 0, 1)
    assert (fwd["head_dim"], fwd["nheads"], fwd["nheads_k"]) == (72, 4, 2)
    assert (fwd["lse_batch_stride"], fwd["lse_head_stride"]) == (4 * 33, 33)
    # (the mma.sync kernels: one head at a time, causal or not)
    assert (fwd["num_m_blocks"], fwd["heads_per_group"], fwd["tail_group_head"]) == (
        -(-33 // dqv.block_m), 1, 8)
    assert (bwd["kv_heads_per_group"], bwd["kv_tail_group_head"]) == (1, 4)
    assert (fwd["q_batch_stride"], fwd["q_row_stride"], fwd["q_head_stride"]) == (33 * 288, 288, 72)
    assert (fwd["k_batch_stride"], fwd["k_row_stride"], fwd["k_head_stride"]) == (47 * 144, 144, 72)
    assert fwd["tile_list"] == 0 and bwd["kv_tile_list"] == 0
    assert bwd["dout"] == 0x5000 and bwd["dq"] == rec.allocations[0][2]
    assert bwd["dk"] == rec.allocations[1][2] and bwd["dv"] == rec.allocations[2][2]
    assert bwd["softmax_d"] == 0x900000 and bwd["dsink"] == 0  # D: the stream's workspace
    assert (bwd["num_n_blocks"], bwd["rows"]) == (1, 66)
    assert (bwd["dk_batch_stride"], bwd["dk_row_stride"], bwd["dk_head_stride"]) == (47 * 144, 144, 72)
    assert len(rec.allocations) == 3 and rec.workspace_bytes == -(-4 * 2 * 4 * 33 // 256) * 256


@pytest.mark.parametrize("causal", [True, False])
def test_key_blocks_heaviest_first_in_groups_under_a_mask(monkeypatch, causal):
    """The key blocks' order (BwdParams.kv_heads_per_group, kv_tail_group_head): on Hopper
    at d = 128 causal, 16 x 16 heads of 1k tokens (8 key blocks a head, one CTA an SM):
    Q, dout and dq's sums take 1 MiB a head, so groups of 25 heads and a tail group of at
    least 2 x 132 blocks (33 heads) from head 200; without a mask one head at a time, as
    before. dq's launch (apart at d = 256) gets the forward's fields the same way."""
    rec = Recorder(monkeypatch)
    monkeypatch.setattr(_bwd_plan._runtime, "compute_capability", lambda device: 90)
    for d, fields in ((128, ("kv_heads_per_group", "kv_tail_group_head")),
                      (256, ("heads_per_group", "tail_group_head"))):
        rec.launches.clear()
        dout, q, k, v, out, lse = dense_args(b=16, sq=1024, sk=1024, h=2048 // d,
                                             hk=2048 // d, d=d)
        cufa.flash_attn_backward(dout, q, k, v, out, lse, causal=causal)
        *_, (fwd, bwd) = rec.launches[-1 if d == 128 else 1]
        record = bwd if d == 128 else fwd
        got = tuple(int(record[f]) for f in fields)
        heads = 16 * 2048 // d
        if not causal:
            assert got == (1, heads)
        elif d == 128:
            assert got == (25, 200)
        else:  # dq: 128-row blocks (8 a head) on 132 CTAs, K and V 1 MiB a head
            assert got[0] == _heuristics.L2_BUDGET // (1024 * 256 * 4)
            assert (heads - got[1]) * 8 >= 2 * 132 and got[1] % got[0] == 0


def test_bwd_groups_example():
    assert _heuristics.bwd_groups(256, 8, 2**20, 132, masked=True) == (25, 200)
    assert _heuristics.bwd_groups(256, 8, 2**20, 132, masked=False) == (1, 256)
    assert _heuristics.bwd_groups(16, 128, 16 * 2**20, 132, masked=True) == (1, 13)
    assert _heuristics.bwd_groups(1, 8, 2**20, 132, masked=True) == (1, 1)


@pytest.mark.parametrize("capability, opt_out, families", [
    (90, None, ["sm80", "sm90", "sm90"]), (90, "0", ["sm80"] * 3), (80, None, ["sm80"] * 3)])
def test_hopper_takes_the_wgmma_kernels_unless_told_not_to(monkeypatch, capability, opt_out,
                                                          families):
    rec = Recorder(monkeypatch)
    monkeypatch.setattr(_bwd_plan._runtime, "compute_capability", lambda device: capability)
    monkeypatch.setitem(_compile._overrides, _compile.FAMILY_ENV, None)
    monkeypatch.setitem(_compile._overrides, _compile.BWD_SM90_ENV, opt_out)
    cufa.flash_attn_backward(*dense_args(d=128), causal=True, deterministic=True)
    assert [(f.kind, f.family) for f, *_ in rec.launches] == list(
        zip(["preprocess", "dq", "dkdv"], families))
    assert all(threads == f.threads and smem == f.smem_bytes
               for f, _, threads, smem, *_ in rec.launches)


@pytest.mark.parametrize("packed", [False, True])
def test_two_warpgroups_take_128_keys_and_rows_a_cta(monkeypatch, packed):
    """Hopper's default at d = 128 (dq=128x64,kv=128x64): the dk/dv kernel's CTA holds 128
    keys in two warpgroups, the dq kernel's 128 query rows (and each a producer
    warpgroup: 384 threads); the grids, num_n_blocks,
    num_m_blocks and a packed batch's lists count blocks of 128."""
    rec = Recorder(monkeypatch)
    monkeypatch.setattr(_bwd_plan._runtime, "compute_capability", lambda device: 90)
    monkeypatch.setitem(_compile._overrides, _compile.FAMILY_ENV, None)
    monkeypatch.setitem(_compile._overrides, _compile.BWD_SM90_ENV, None)
    monkeypatch.setitem(_compile._overrides, _compile.BWD_SM90_TILES_ENV, None)
    if packed:
        dout, q, k, v, out, _ = (x.__class__(None, "cupy", x.ptr, x.shape[1:], x.strides[1:],
                                             x.dtype, 0, 2) for x in dense_args(b=1, sq=300,
                                                                                sk=300, d=128))
        cu = arr((3,), "int32", ptr=0x8000)
        lse = arr((4, 300), "float32", ptr=0x6000)
        cufa.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu, cu, 200, 200, causal=True, deterministic=True)
        kv_blocks = q_blocks = 300 // 128 + 2
    else:
        cufa.flash_attn_backward(*dense_args(b=2, sq=300, sk=300, d=128), causal=True, deterministic=True)
        kv_blocks = q_blocks = -(-300 // 128) * 2
    (dq, dq_grid, dq_threads, dq_smem, _, _), (kv, blocks, threads, smem, _, (fwd, bwd)) = \
        rec.launches[-2:]
    assert (dq.kind, dq.family, dq.block_m, dq_threads) == ("dq", "sm90", 128, 384)
    assert (kv.kind, kv.family, kv.block_n, threads) == ("dkdv", "sm90", 128, 384)
    assert dq_grid == q_blocks * 4 and dq_smem == dq.smem_bytes
    assert blocks == kv_blocks * 2 and smem == kv.smem_bytes
    assert bwd["num_n_blocks"] == fwd["num_m_blocks"] == -(-300 // 128)
    if packed:  # the schedule's records for the query and the key list: blocks of 128
        schedule = [r for f, *_, r in rec.launches if f is _compile.VARLEN_SCHEDULE]
        records = [np.frombuffer(bytes(r[0]), dtype=_params.SCHEDULE.dtype)[0] for r in schedule]
        assert [int(r["block_m"]) for r in records] == [128, 128]


@pytest.mark.parametrize("tiles, dq_tile, kv_tile", [
    ("kv=128x64", (64, 64), (64, 128)), ("dq=64x128", (64, 128), (128, 64)),
    ("dq=128x32, kv=128x128", (128, 32), (128, 128))])
def test_tiles_from_the_environment(monkeypatch, tiles, dq_tile, kv_tile):
    monkeypatch.setitem(_compile._overrides, _compile.BWD_SM90_TILES_ENV, tiles)
    _, dq, kv = _compile.bwd_sm90_variants("bf16", 64, "none", False, _compile.bwd_sm90_tiles())
    assert ((dq.block_m, dq.block_n), (kv.block_m, kv.block_n)) == (dq_tile, kv_tile)
    assert (dq.threads, kv.threads) == (2 * dq.block_m, 2 * kv.block_n)


@pytest.mark.parametrize("tiles, message", [
    ("dq=96x64", "takes 'dq=RxK,kv=KxQ'"), ("kv=64", "takes"), ("dk=64x64", "takes"),
    ("kv=128x128", "over 232448")])
def test_tiles_that_do_not_apply_are_refused(monkeypatch, tiles, message):
    monkeypatch.setitem(_compile._overrides, _compile.BWD_SM90_TILES_ENV, tiles)
    with pytest.raises(ValueError, match=message):
        _compile.bwd_sm90_variants("fp16", 256, "none", False, _compile.bwd_sm90_tiles())


@pytest.mark.parametrize("d, mods, split_env, kv", [
    (256, False, None, [("both", True)]), (176, False, None, [("both", True)]),
    (256, False, "0", [("dk", False), ("dv", False)]),
    (192, True, None, [("dk", False), ("dv", False)]),
    (248, True, None, [("dk", False), ("dv", False)])])
def test_hopper_dk_and_dv_above_128(monkeypatch, d, mods, split_env, kv):
    """Above d = 128 on wgmma: dq on 32-key blocks; dk and dv from one launch split by
    columns, or launched apart with score mods or CUFA_BWD_SPLIT_COLS=0."""
    rec = Recorder(monkeypatch)
    monkeypatch.setattr(_bwd_plan._runtime, "compute_capability", lambda device: 90)
    monkeypatch.setitem(_compile._overrides, _compile.FAMILY_ENV, None)
    monkeypatch.setitem(_compile._overrides, _compile.BWD_SM90_ENV, "all")
    monkeypatch.setitem(_compile._overrides, _compile.BWD_SPLIT_COLS_ENV, split_env)
    cufa.flash_attn_backward(*dense_args(d=d), causal=True, softcap=5.0 if mods else 0.0)
    assert [(f.kind, f.family, f.grads, f.block_n, f.split_cols) for f, *_ in rec.launches] == [
        ("preprocess", "sm80", "both", 0, False), ("dq", "sm90", "both", 32, False),
        *(("dkdv", "sm90", grads, 64, split) for grads, split in kv)]
    assert all(threads == f.threads and smem <= 227 * 1024 for f, _, threads, smem, *_ in rec.launches)
    if split_env is None and not mods:
        split = rec.launches[2][0]
        assert (split.threads, split.producer, split.block_m) == (384, True, 64)


@pytest.mark.parametrize("value, wgmma_head_dims", [
    (None, (64, 128, 192, 256)), ("1", (64, 128, 192, 256)), ("0", ()),
    ("all", (64, 128, 192, 256))])
def test_hopper_head_dims_on_wgmma(monkeypatch, value, wgmma_head_dims):
    monkeypatch.setitem(_compile._overrides, _compile.FAMILY_ENV, None)
    monkeypatch.setitem(_compile._overrides, _compile.BWD_SM90_ENV, value)
    for d, padded in ((40, 64), (64, 64), (96, 96), (120, 128), (160, 160), (176, 192),
                      (256, 256)):
        rec = Recorder(monkeypatch)
        monkeypatch.setattr(_bwd_plan._runtime, "compute_capability", lambda device: 90)
        cufa.flash_attn_backward(*dense_args(d=d), causal=True)
        wanted = "sm90" if padded in wgmma_head_dims else "sm80"
        assert {f.family for f, *_ in rec.launches[1:]} == {wanted}, d


@pytest.mark.parametrize("tma", [None, "0"])
@pytest.mark.parametrize("seqlen_q, causal, query_block", [
    (1024, True, 64), (1025, True, 128), (1024, False, 128), (33, False, 128)])
def test_short_windowed_calls_keep_64_query_blocks_at_d64(monkeypatch, seqlen_q, causal,
                                                          query_block, tma):
    """Hopper, d = 64: dk/dv's query block is 128 but for windowed calls of at most 1024
    query rows (BWD_SM90_SHORT_WINDOW_ROWS) by cp.async; windowed calls streamed by TMA
    take two warpgroups of 64 keys and a producer on 64-query blocks at every length
    (BWD_SM90_WINDOW_KV_TMA; the 128-query block would spill there)."""
    rec = Recorder(monkeypatch)
    monkeypatch.setattr(_bwd_plan._runtime, "compute_capability", lambda device: 90)
    for env in (_compile.FAMILY_ENV, _compile.BWD_SM90_ENV, _compile.BWD_SM90_TILES_ENV):
        monkeypatch.setitem(_compile._overrides, env, None)
    monkeypatch.setitem(_compile._overrides, _compile.BWD_SM90_TMA_ENV, tma)
    cufa.flash_attn_backward(*dense_args(b=1, sq=seqlen_q, sk=seqlen_q, d=64), causal=causal, deterministic=True)
    kv = rec.launches[-1][0]
    keys, producer = 64, False
    if causal and tma is None:
        query_block, keys, producer = 64, 128, True
    assert (kv.kind, kv.family, kv.block_n, kv.block_m) == ("dkdv", "sm90", keys, query_block)
    assert (kv.tma, kv.producer) == (tma is None, producer)


def test_bwd_sm90_takes_0_1_or_all(monkeypatch):
    monkeypatch.setitem(_compile._overrides, _compile.BWD_SM90_ENV, "yes")
    with pytest.raises(ValueError, match="CUFA_BWD_SM90 takes 0, 1 or all; got 'yes'"):
        _compile.bwd_sm90_head_dims()


def test_large_head_dims_launch_dk_and_dv_apart(monkeypatch):
    rec = Recorder(monkeypatch)
    cufa.flash_attn_backward(*dense_args(d=256))
    assert [(f.kind, f.grads) for f, *_ in rec.launches] == [
        ("preprocess", "both"), ("dq", "both"), ("dkdv", "dk"), ("dkdv", "dv")]


def test_sink_gradient_is_zeroed_and_passed(monkeypatch):
    rec = Recorder(monkeypatch)
    sink = arr((4,), "float32", ptr=0x7000)
    dq, dk, dv, dsink = cufa.flash_attn_backward(*dense_args(), learnable_sink=sink)
    fwd, bwd = rec.launches[0][-1]
    assert fwd["learnable_sink"] == 0x7000 and bwd["dsink"] == rec.allocations[3][2]
    assert dsink[1] == (4,)


def test_empty_queries_still_zero_dk_dv(monkeypatch):
    rec = Recorder(monkeypatch)
    cufa.flash_attn_backward(*dense_args(sq=0))
    assert [f.kind for f, *_ in rec.launches] == ["dkdv"]  # writes zeros: no query sees a key


def test_varlen_builds_both_work_lists(monkeypatch):
    rec = Recorder(monkeypatch)
    h, hk, d = 4, 2, 64
    q, out, dout = (arr((100, h, d), ptr=p) for p in (0x1000, 0x4000, 0x5000))
    k, v = arr((130, hk, d), ptr=0x2000), arr((130, hk, d), ptr=0x3000)
    lse = arr((h, 100), "float32", ptr=0x6000)
    cu_q, cu_k = arr((4,), "int32", ptr=0xa000), arr((4,), "int32", ptr=0xb000)
    used = arr((3,), "int32", ptr=0xc000)
    cufa.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, 60, 70, causal=True,
                                    seqused_k=used)
    schedules = [launch for launch in rec.launches if launch[0] is _compile.VARLEN_SCHEDULE]
    assert len(schedules) == 2
    kernels = [launch for launch in rec.launches if launch[0] is not _compile.VARLEN_SCHEDULE]
    dqv = kernels[1][0]
    fwd, bwd = kernels[1][-1]
    q_tiles, kv_tiles = 100 // dqv.block_m + 3, 130 // 64 + 3
    assert kernels[1][1] == q_tiles * h and kernels[2][1] == kv_tiles * hk
    assert kernels[0][1] == -(-100 // _bwd_plan.PREPROCESS_ROWS_PER_CTA) * h and bwd["rows"] == 100
    assert (fwd["cu_seqlens_q"], fwd["cu_seqlens_k"], fwd["seqused_k"]) == (0xa000, 0xb000, 0xc000)
    d_bytes = -(-4 * h * 100 // 256) * 256  # D first
    assert bwd["softmax_d"] == 0x900000
    assert fwd["tile_list"] == 0x900000 + d_bytes and fwd["tile_count"] == fwd["tile_list"] + 8 * q_tiles
    assert bwd["kv_tile_count"] == bwd["kv_tile_list"] + 8 * kv_tiles
    assert bwd["kv_tile_list"] > fwd["tile_count"]
    assert (fwd["q_batch_stride"], fwd["lse_batch_stride"], fwd["lse_head_stride"]) == (0, 0, 100)
    assert (fwd["seqlen_q"], fwd["seqlen_k"], fwd["batch"]) == (100, 130, 3)
    for (cu, total, block), launch in zip(((0xa000, 100, dqv.block_m), (0xb000, 130, 64)),
                                          schedules):
        record = np.frombuffer(bytes(launch[-1][0]), dtype=_params.SCHEDULE.dtype)[0]
        assert (record["cu_seqlens_q"], record["total_q"], record["block_m"]) == (cu, total, block)
        assert record["tile_counter"] == 0 and record["decode_order"] == 0


def test_every_backward_variant_is_in_the_library():
    keys = {v.key for v in _compile.all_variants()}
    for dt in ("fp16", "bf16"):
        for hd in _compile.SM80_HEAD_DIMS:
            for v in _compile.bwd_variants(dt, hd, "window", True):
                assert v.key in keys


def test_torch_route_for_a_call_autograd_records():
    torch = pytest.importorskip("torch")
    from cufa import api
    q = torch.zeros(1, 4, 2, 8, requires_grad=True)
    k = torch.zeros(1, 4, 2, 8)
    assert api._records_grad(q, k, k, None)
    assert not api._records_grad(q.detach(), k, k, None)
    with torch.no_grad():
        assert not api._records_grad(q, k, k, None)
    sink = torch.zeros(2, requires_grad=True)
    assert api._records_grad(k, k, k, sink)


def test_torch_ops_carry_deterministic_to_the_backward():
    """flash_attn_func(deterministic=True) reaches the backward through the forward op's
    last argument (setup_context keeps it); torch.use_deterministic_algorithms(True) asks
    for it too."""
    torch = pytest.importorskip("torch")
    from cufa import _torch_ops
    _torch_ops.register_if_torch_loaded()
    for name in ("flash_attn", "flash_attn_varlen", "flash_attn_bwd", "flash_attn_varlen_bwd"):
        schema = str(getattr(torch.ops.cufa, name).default._schema)
        assert schema.split("(", 1)[1].rstrip().endswith(
            "bool deterministic=False) -> (Tensor, Tensor)" if "bwd" not in name else
            "bool deterministic=False) -> (Tensor, Tensor, Tensor, Tensor)"), schema
    assert not _torch_ops._deterministic(False) and _torch_ops._deterministic(True)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert _torch_ops._deterministic(False)
    finally:
        torch.use_deterministic_algorithms(was)


def test_torch_backward_pads_unaligned_head_dims_with_zeros():
    torch = pytest.importorskip("torch")
    from cufa import _torch_ops
    x = torch.randn(2, 5, 3, 59)
    (a, *_), cut = _torch_ops._on_chunks(x, x, x, x, x)
    assert cut == 59 and a.shape == (2, 5, 3, 64) and a.is_contiguous()
    assert torch.equal(a[..., :59], x) and not a[..., 59:].any()
    y = torch.randn(2, 5, 3, 64)
    same, cut = _torch_ops._on_chunks(y, y, y, y, y)
    assert cut is None and all(t is y for t in same)
    odd = torch.randn(2, 5, 3, 65)[..., 1:]  # a head dim of 64 at an odd offset
    copies, cut = _torch_ops._on_chunks(y, odd, y, y, y)
    assert cut == 64 and torch.equal(copies[1], odd) and copies[1].is_contiguous()


def test_sdpa_reads_its_mask_and_top_left_causal(monkeypatch):
    rec = Recorder(monkeypatch)
    b, h, hk, L, S, d = 2, 4, 2, 33, 47, 64
    q, out, dout = (arr((b, h, L, d), ptr=p) for p in (0x1000, 0x4000, 0x5000))
    k, v = arr((b, hk, S, d), ptr=0x2000), arr((b, hk, S, d), ptr=0x3000)
    lse = arr((b, h, L), "float32", ptr=0x6000)
    mask = arr((h, 1, S), "float32", ptr=0x8000)  # an additive mask over heads and keys
    _bwd_plan.sdpa(dout, q, k, v, out, lse, mask, is_causal=True, enable_gqa=True)
    fwd, bwd = rec.launches[-1][-1]
    assert rec.launches[-1][0].score_mods and rec.launches[-1][0].mask == "window"
    assert (fwd["bottom_right"], fwd["window_left"], fwd["window_right"]) == (0, 1 << 30, 0)
    assert (fwd["nheads"], fwd["nheads_k"], fwd["seqlen_q"], fwd["seqlen_k"]) == (h, hk, L, S)
    assert rec.launches[-1][1] == -(-S // 64) * b * hk  # dk/dv: key blocks of each KV head
    assert fwd["attn_mask"] == 0x8000 and fwd["attn_mask_type"] == _checks.ATTN_MASK_TYPES["float32"]
    assert (fwd["mask_batch_stride"], fwd["mask_head_stride"], fwd["mask_row_stride"],
            fwd["mask_col_stride"]) == (0, S, 0, 1)
    assert (fwd["q_batch_stride"], fwd["q_row_stride"], fwd["q_head_stride"]) == (h * L * d, d,
                                                                                  L * d)
    assert (bwd["dk_batch_stride"], bwd["dk_row_stride"], bwd["dk_head_stride"]) == (
        hk * S * d, d, S * d)
    assert bwd["dmask"] == 0
    dmask = arr((h, 1, S), "float32", ptr=0x9000)
    _bwd_plan.sdpa(dout, q, k, v, out, lse, mask, is_causal=True, enable_gqa=True, dmask=dmask)
    bwd = rec.launches[-1][-1][1]
    assert bwd["dmask"] == 0x9000 and (bwd["dmask_batch_stride"], bwd["dmask_head_stride"],
                                       bwd["dmask_row_stride"], bwd["dmask_col_stride"]) == (
        0, S, 0, 1)
    with pytest.raises(ValueError, match="dmask must be a contiguous float32"):
        _bwd_plan.sdpa(dout, q, k, v, out, lse, mask, enable_gqa=True, dmask=arr((h, S)))
    with pytest.raises(ValueError, match="enable_gqa"):
        _bwd_plan.sdpa(dout, q, k, v, out, lse)


def test_lse_gradient_and_detached_inputs(monkeypatch):
    """dlse goes to the kernels (it enters as D - dlse); torch tensors that require grad
    (a user's own backward holds such ones) are read detached."""
    torch = pytest.importorskip("torch")
    rec = Recorder(monkeypatch)
    args = list(dense_args())
    dlse = arr(args[5].shape, "float32", ptr=0xd000)
    cufa.flash_attn_backward(*args, dlse=dlse)
    assert rec.launches[0][-1][1]["dlse"] == 0xd000
    with pytest.raises(ValueError, match="dlse must have shape"):
        cufa.flash_attn_backward(*args, dlse=arr((2, 4, 32), "float32"))
    x = torch.zeros(4, requires_grad=True)
    from cufa import _interop
    y = _interop.detached(x)
    assert not y.requires_grad and y.data_ptr() == x.data_ptr()


def test_dq_fused_where_asked_and_it_applies(monkeypatch):
    """CUFA_BWD_FUSED_DQ=1: the dk/dv kernel adds dq's share atomically into float32 sums
    (after D in the scratch, zeroed by the preprocess) and a last launch converts them; where the fused
    kernel does not apply (d = 96 here) the dq kernel runs as without it."""
    rec = Recorder(monkeypatch)
    monkeypatch.setitem(_compile._overrides, _compile.BWD_FUSED_ENV, "1")
    b, sq, sk, h, hk, d = 2, 33, 47, 4, 2, 64
    cufa.flash_attn_backward(*dense_args(b, sq, sk, h, hk, d), causal=True)
    kinds = [(f.kind, f.fused_dq) for f, *_ in rec.launches]
    assert kinds == [("preprocess", False), ("dkdv", True), ("dq_convert", False)]
    fwd, bwd = rec.launches[1][-1]
    d_bytes = -(-4 * b * h * sq // 256) * 256
    assert bwd["dq_accum"] == 0x900000 + d_bytes
    assert (bwd["dq_accum_batch_stride"], bwd["dq_accum_row_stride"],
            bwd["dq_accum_head_stride"]) == (sq * h * d, h * d, d)
    # (zeroed by the preprocess, which reads the same record)
    assert bwd["dq_accum_floats"] == b * sq * h * d and rec.launches[0][-1][1] == bwd
    assert rec.workspace_bytes == d_bytes + -(-4 * b * h * sq * d // 256) * 256
    assert rec.launches[2][1] == -(-b * sq * h * d // 256)
    assert rec.launches[1][1] == -(-sk // 64) * b * hk
    rec.launches.clear()
    cufa.flash_attn_backward(*dense_args(d=96))
    assert [f.kind for f, *_ in rec.launches] == ["preprocess", "dq", "dkdv"]


@pytest.mark.parametrize("packed", [False, True])
def test_hopper_fuses_dq_on_wgmma_at_d128(monkeypatch, packed):
    """CUFA_BWD_FUSED_DQ=1 on Hopper at d = 128 (and 64) without score mods: the wgmma dk/dv kernel
    with dq fused (two warpgroups of 64 keys, 64-query steps, a producer: 384 threads),
    its float32 sums in blocks of 64 rows (each sequence's from a multiple of 64) zeroed
    by the preprocess and put back in rows last; with softcap the mma.sync fused kernel
    (where it applies), with attn_mask none (the dq kernel sums its gradient)."""
    rec = Recorder(monkeypatch)
    monkeypatch.setattr(_bwd_plan._runtime, "compute_capability", lambda device: 90)
    for env in (_compile.FAMILY_ENV, _compile.BWD_SM90_ENV, _compile.BWD_SM90_TILES_ENV):
        monkeypatch.setitem(_compile._overrides, env, None)
    monkeypatch.setitem(_compile._overrides, _compile.BWD_FUSED_ENV, "1")
    b, sq, sk, h, hk, d = 2, 200, 300, 4, 2, 128
    if packed:
        dout, q, k, v, out, _ = (x.__class__(None, "cupy", x.ptr, x.shape[1:], x.strides[1:],
                                             x.dtype, 0, 2) for x in dense_args(1, 300, 300, h,
                                                                                hk, d))
        cu = arr((3,), "int32", ptr=0x8000)
        lse = arr((h, 300), "float32", ptr=0x6000)
        cufa.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu, cu, 200, 200, causal=True)
    else:
        cufa.flash_attn_backward(*dense_args(b, sq, sk, h, hk, d), causal=True)
    launches = [x for x in rec.launches if x[0] is not _compile.VARLEN_SCHEDULE]
    (pre, *_), (kv, blocks, threads, smem, _, (fwd, bwd)), (conv, *_) = launches
    assert (pre.kind, kv.kind, conv.kind) == ("preprocess", "dkdv", "dq_blocks")
    assert (kv.family, kv.fused_dq, kv.producer, kv.block_n, kv.block_m, threads) == (
        "sm90", True, True, 128, 64, 384)
    assert smem == kv.smem_bytes <= 227 * 1024 and bwd["dq_accum"] != 0
    # blocks of 64 rows x 128 floats, a head's rows after another's: a padded batch's
    # sequences 256 rows apart (200 rounded up), a packed one's from (q_start + 64 b)
    # rounded down, within its rows + 64 a sequence
    rows = 300 + 2 * 64 if packed else b * 256  # (two sequences either way)
    assert (bwd["dq_accum_row_stride"], bwd["dq_accum_head_stride"],
            bwd["dq_accum_batch_stride"]) == (128, rows * 128, 0 if packed else 256 * 128)
    assert conv.head_dim == 128 and conv.threads == 256
    # zeroed by the preprocess; converted a CTA a block of a head's sums (its last block
    # short where a packed batch's rows are not a multiple of 64)
    assert bwd["dq_accum_floats"] == rows * h * 128 and launches[0][-1][1] == bwd
    assert launches[-1][1] == -(-rows // 64) * h
    if not packed:
        assert blocks == -(-sk // 128) * b * hk
        assert fwd["num_m_blocks"] == -(-sq // 64) and bwd["num_n_blocks"] == -(-sk // 128)
    rec.launches.clear()
    cufa.flash_attn_backward(*dense_args(b, sq, sk, h, hk, 40), causal=True)
    assert [(f.kind, f.family, f.fused_dq, f.head_dim) for f, *_ in rec.launches][1] == (
        "dkdv", "sm90", True, 64)
    rec.launches.clear()
    cufa.flash_attn_backward(*dense_args(b, sq, sk, h, hk, 64), causal=True, softcap=5.0)
    assert [(f.kind, f.family, f.fused_dq) for f, *_ in rec.launches][1] == ("dkdv", "sm80",
                                                                               True)


@pytest.mark.parametrize("d, causal, seqlen, fused", [
    (128, True, 300, True), (128, False, 300, True), (112, False, 2000, True),
    (64, True, 1025, True), (64, True, 1024, True), (64, False, 2000, True), (64, False, 7, True),
    (96, True, 300, False),  # (mma.sync's head dim 96: no wgmma kernels there)
])
def test_hopper_fuses_dq_where_it_was_faster(monkeypatch, d, causal, seqlen, fused):
    """Unset, CUFA_BWD_FUSED_DQ leaves dq fused on Hopper where it was faster on an H200:
    head dims that pad to 64 and 128; never with
    deterministic=True, with CUFA_BWD_FUSED_DQ=0, or with TMA or the producer off (what
    it was timed with); on other GPUs the dq kernel."""
    rec = Recorder(monkeypatch)
    monkeypatch.setattr(_bwd_plan._runtime, "compute_capability", lambda device: 90)
    for env in (_compile.FAMILY_ENV, _compile.BWD_SM90_ENV, _compile.BWD_SM90_TILES_ENV,
                _compile.BWD_FUSED_ENV, _compile.BWD_SM90_PRODUCER_ENV, _compile.BWD_SM90_TMA_ENV):
        monkeypatch.setitem(_compile._overrides, env, None)
    args = dense_args(b=1, sq=seqlen, sk=seqlen, d=d)
    split = ["preprocess", "dq", "dkdv"]

    def kinds(**kw):
        rec.launches.clear()
        cufa.flash_attn_backward(*args, causal=causal, **kw)
        return [f.kind for f, *_ in rec.launches]
    assert kinds() == (["preprocess", "dkdv", "dq_blocks"] if fused else split)
    if fused:
        assert rec.launches[1][0].fused_dq and rec.launches[1][0].tma
    assert kinds(deterministic=True) == split
    for env in (_compile.BWD_FUSED_ENV, _compile.BWD_SM90_TMA_ENV,
                _compile.BWD_SM90_PRODUCER_ENV):
        monkeypatch.setitem(_compile._overrides, env, "0")
        assert kinds() == split, env
        monkeypatch.setitem(_compile._overrides, env, None)
    monkeypatch.setattr(_bwd_plan._runtime, "compute_capability", lambda device: 80)
    assert kinds() == split


def test_d64_fused_dq_is_persistent_on_hopper(monkeypatch):
    """At d = 64 under a window (causal) and up to 512 query rows Hopper's fused dk/dv
    kernel is the persistent one (without a mask a CTA a key block): at most a CTA an SM
    (the key blocks past them from a counter that the preprocess zeroes, in the scratch
    after dq's sums); CUFA_BWD_PERSISTENT=0, or arrays the copy engine refuses (its
    cp.async twin), keep a CTA a key block; d = 128 has none."""
    rec = Recorder(monkeypatch)
    monkeypatch.setattr(_bwd_plan._runtime, "compute_capability", lambda device: 90)
    for env in (_compile.FAMILY_ENV, _compile.BWD_SM90_ENV, _compile.BWD_SM90_TILES_ENV,
                _compile.BWD_FUSED_ENV, _compile.BWD_SM90_PRODUCER_ENV, _compile.BWD_SM90_TMA_ENV,
                _compile.BWD_PERSISTENT_ENV):
        monkeypatch.setitem(_compile._overrides, env, None)

    def launch(d, b=2, s=500, hk=2, causal=True):
        rec.launches.clear()
        cufa.flash_attn_backward(*dense_args(b=b, sq=s, sk=s, hk=hk, d=d), causal=causal)
        (pre, _, _, _, _, (_, pre_bwd)), (kv, blocks, _, smem, _, (_, bwd)) = rec.launches[:2]
        return kv, blocks, smem, pre_bwd, bwd
    kv, blocks, smem, pre_bwd, bwd = launch(64)
    assert kv.persistent and kv.fused_dq and kv.tma and kv.threads == 384
    assert blocks == 2 * 2 * -(-500 // 128) and smem == kv.smem_bytes <= 227 * 1024
    assert bwd["tile_counter"] == pre_bwd["tile_counter"] != 0
    assert bwd["tile_counter"] >= bwd["dq_accum"] + 4 * bwd["dq_accum_floats"]
    kv, blocks, *_ = launch(64, b=16, hk=4)  # (16 x 4 x 4 key blocks: more than the SMs)
    assert kv.persistent and blocks == 132
    kv, blocks, *_ = launch(64, s=513)  # (past BWD_PERSISTENT_MAX_ROWS: a CTA a key block)
    assert not kv.persistent and kv.fused_dq and blocks == 2 * 2 * -(-513 // 128)
    kv, blocks, *_ = launch(64, causal=False)  # (no mask: a CTA a key block)
    assert not kv.persistent and kv.fused_dq and blocks == 2 * 2 * -(-500 // 128)
    assert not launch(128)[0].persistent and launch(128)[4]["tile_counter"] == 0
    rec.maps_refused = True
    kv, blocks, _, _, bwd = launch(64, b=16, hk=4)
    assert not kv.persistent and not kv.tma and blocks == 16 * 4 * 4 and bwd["tile_counter"] == 0
    rec.maps_refused = False
    monkeypatch.setitem(_compile._overrides, _compile.BWD_PERSISTENT_ENV, "0")
    kv, blocks, *_ = launch(64, b=16, hk=4)
    assert not kv.persistent and kv.tma and blocks == 16 * 4 * 4
    monkeypatch.setitem(_compile._overrides, _compile.BWD_PERSISTENT_ENV, "1")  # (always)
    kv, blocks, *_ = launch(64, s=4096)
    assert kv.persistent and blocks == 2 * 2 * 4096 // 128
    assert launch(64, causal=False)[0].persistent
    monkeypatch.setitem(_compile._overrides, _compile.BWD_PERSISTENT_ENV, "yes")
    with pytest.raises(ValueError, match="CUFA_BWD_PERSISTENT takes 0 .* or 1"):
        launch(64)
    monkeypatch.setitem(_compile._overrides, _compile.BWD_FUSED_ENV, "0")  # (no fused route)
    with pytest.raises(ValueError, match="CUFA_BWD_PERSISTENT takes 0 .* or 1"):
        launch(128)


def test_fused_dq_variable_takes_0_or_1(monkeypatch):
    """CUFA_BWD_FUSED_DQ: "1", "0", or unset (or empty) for the default; "false" read as
    unset would fuse dq on Hopper, so it is refused naming the variable."""
    Recorder(monkeypatch)
    for value, wanted in ((None, None), ("", None), ("0", False), ("1", True)):
        monkeypatch.setitem(_compile._overrides, _compile.BWD_FUSED_ENV, value)
        assert _compile.bwd_fused_wanted() is wanted
    monkeypatch.setitem(_compile._overrides, _compile.BWD_FUSED_ENV, "false")
    with pytest.raises(ValueError, match="CUFA_BWD_FUSED_DQ takes 1"):
        cufa.flash_attn_backward(*dense_args())


def test_wgmma_kernels_get_their_tiles_and_the_alignment():
    """bwd/bwd_sm90.cu rounds its shared-memory base up to 1024 bytes (the swizzle's
    phase), then lays out its tiles: each variant asks for 1024 bytes beyond them."""
    from cufa import _compile
    seen = 0
    for v in _compile.all_variants():
        if (getattr(v, "family", "") != "sm90" or not v.key.startswith("bwd_")
                or v.kind == "dq_blocks"):
            continue
        seen += 1
        row = 2 * v.head_dim
        if v.kind == "dq":  # Q, dout; two stages of K and V
            tiles = 2 * v.block_m * row + v.stages * 2 * v.block_n * row
            if v.producer or v.tma:  # each buffer's full and empty mbarriers
                tiles += 16 * v.stages
        else:  # K, V; two stages of Q, dout, lse and D, each at a 1024-byte boundary;
            # dq fused: two dS tiles, each warpgroup's slab of sums and their mbarrier
            tiles = 2 * v.block_n * row + v.stages * -(-(2 * v.block_m * row + 8 * v.block_m)
                                                      // 1024) * 1024
            if v.fused_dq and not v.split_cols:  # two dS tiles, two slabs of 64 x 64
                # sums, their mbarrier (split by columns: dS in the exchange's place);
                # d = 64: a third slab and the hand-over's four mbarriers (DqPair)
                slabs, pair = (3, 32) if v.head_dim == 64 else (2, 0)
                tiles += 2 * 2 * v.block_m * v.block_n + slabs * 64 * 64 * 4 + 8 + pair
            if v.producer or v.tma:
                tiles += 16 * v.stages
            if v.split_cols:  # the exchange: P^T in fp32, dS^T in 16 bits
                tiles += 64 * 64 * (4 + 2)
            if v.persistent:  # a second K/V buffer, kv_empty[2], the tile ring (four
                # mbarriers, two numbers) and the sender's record (a pointer a stage)
                tiles += 2 * v.block_n * row + 16 + 40 + 8 * v.stages
        assert v.smem_bytes == 1024 + tiles, v.key
    # the defaults and one warpgroup's tiles: at d = 64 dq on 64 rows, dk/dv on 128- and
    # 64-query blocks (score mods only 64); at d = 128 dq on 128 and 64 rows, dk/dv on 128
    # and 64 keys (not the spilling one); above, dq, dk and dv apart
    # ... and dq fused at d = 64 and 128 (no score mods), and the producer's dq and dk/dv
    # at d = 128 (both masks); all streaming by TMA and by cp.async, but d = 64's windowed
    # dk/dv on 128-query blocks (it would spill); and d = 64's windowed dk/dv on two
    # warpgroups with a producer, by TMA and by cp.async (its twin where the copy engine
    # refuses the arrays); and the persistent fused kernel at d = 64 (both masks); and
    # above d = 128 the producer's dq and the dk/dv split by columns (two dtypes, two
    # head dims, both masks, by TMA and by cp.async), that split kernel with dq fused too
    assert seen == (2 * ((4 * 3 + 4 * 2) + (6 * 4 + 2 * 2) + 16 * 3) - 2 + 8 * 2 + 8 * 2 + 2 * 2
                    + 2 * 2 + 16 + 16 + 16)


@pytest.mark.parametrize("d, causal, seqlen, producer", [
    (128, True, 300, True), (128, False, 300, True), (112, False, 2000, True),
    (64, False, 2000, False),  # (one consumer warpgroup)
    (64, True, 300, (False, True)),  # (dk/dv on two, BWD_SM90_WINDOW_KV_TMA)
])
def test_producer_warpgroup_where_it_applies(monkeypatch, d, causal, seqlen, producer):
    """On Hopper the wgmma dq and dk/dv kernels have a producer warpgroup (128 more
    threads, a ring of three buffers and their mbarriers) where they have two consumer
    warpgroups (d = 128; d = 64's windowed dk/dv); not with score mods, nor with
    CUFA_BWD_SM90_PRODUCER=0."""
    rec = Recorder(monkeypatch)
    monkeypatch.setattr(_bwd_plan._runtime, "compute_capability", lambda device: 90)
    for env in (_compile.FAMILY_ENV, _compile.BWD_SM90_ENV, _compile.BWD_SM90_TILES_ENV,
                _compile.BWD_FUSED_ENV, _compile.BWD_SM90_PRODUCER_ENV, _compile.BWD_SM90_TMA_ENV):
        monkeypatch.setitem(_compile._overrides, env, None)
    cufa.flash_attn_backward(*dense_args(b=1, sq=seqlen, sk=seqlen, d=d), causal=causal, deterministic=True)
    wanted = producer if isinstance(producer, tuple) else (producer, producer)
    for (variant, _, threads, smem, *_), producer in zip(rec.launches[-2:], wanted):
        assert (variant.family, variant.producer) == ("sm90", producer)
        assert threads == variant.threads and smem == variant.smem_bytes <= 227 * 1024
        if producer:
            assert variant.stages == _compile.BWD_SM90_PRODUCER_STAGES
            assert variant.key.endswith("_s3_wp_tma") and variant in set(_compile.all_variants())
            plain = dataclasses.replace(variant, producer=False, tma=False, stages=2)
            assert threads == plain.threads + 128 == 384
            # (a third buffer and each buffer's two mbarriers)
            assert smem == plain.smem_bytes + (plain.smem_with(3) - plain.smem_with(2)) + 48
    rec.launches.clear()
    cufa.flash_attn_backward(*dense_args(b=1, sq=seqlen, sk=seqlen, d=d), causal=causal,
                             softcap=5.0, deterministic=True)
    assert not any(f.producer for f, *_ in rec.launches)
    monkeypatch.setitem(_compile._overrides, _compile.BWD_SM90_PRODUCER_ENV, "0")
    _bwd_plan._runtime.plans.clear()
    rec.launches.clear()
    cufa.flash_attn_backward(*dense_args(b=1, sq=seqlen, sk=seqlen, d=d), causal=causal, deterministic=True)
    assert [f.family for f, *_ in rec.launches[-2:]] == ["sm90", "sm90"]
    assert not any(f.producer for f, *_ in rec.launches)


def test_every_tma_kernel_has_its_cp_async_twin_in_the_library():
    """A launch whose arrays the copy engine cannot describe takes its TMA kernel's
    cp.async twin (_bwd_plan._launch): warmup compiles it too."""
    variants = set(_compile.all_variants())
    tma = [v for v in variants if getattr(v, "tma", False)]
    assert tma and all(dataclasses.replace(v, tma=False, **(
        {"persistent": False} if hasattr(v, "persistent") else {})) in variants for v in tma)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("packed", [False, True])
def test_tma_streams_get_the_maps_of_what_they_stream(monkeypatch, packed, d):
    """The wgmma kernels stream by TMA (kTma; at d = 128 from a producer warpgroup, at 64
    from a consumer thread): dq's launch gets maps of k and v, dk/dv's of q and dout, every
    other launch none (bwd_sm90.cu's kernels: an empty record); where the copy engine
    cannot describe the arrays, cp.async copies with no maps; CUFA_BWD_SM90_TMA=0 turns
    TMA off. A packed batch's record says the tails are there."""
    rec = Recorder(monkeypatch)
    monkeypatch.setattr(_bwd_plan._runtime, "compute_capability", lambda device: 90)
    for env in (_compile.FAMILY_ENV, _compile.BWD_SM90_ENV, _compile.BWD_SM90_TILES_ENV,
                _compile.BWD_FUSED_ENV, _compile.BWD_SM90_PRODUCER_ENV, _compile.BWD_SM90_TMA_ENV):
        monkeypatch.setitem(_compile._overrides, env, None)
    dout, q, k, v, out, lse = dense_args(b=1, sq=300, sk=300, d=d)
    producer = d == 128

    def backward():
        rec.launches.clear()
        rec.maps.clear()
        if packed:
            x = [DeviceArray(None, "cupy", a.ptr, a.shape[1:], a.strides[1:], a.dtype, 0, 2)
                 for a in (dout, q, k, v, out)]
            cu = arr((3,), "int32", ptr=0x8000)
            cufa.flash_attn_varlen_backward(*x, arr((4, 300), "float32", ptr=0x6000), cu, cu,
                                            200, 200, deterministic=True)
        else:
            cufa.flash_attn_backward(dout, q, k, v, out, lse, deterministic=True)
        return [(f, m, r) for (f, *_, r), m in zip(rec.launches, rec.maps)
                if f is not _compile.VARLEN_SCHEDULE]

    launches = backward()
    assert [(f.kind, f.tma) for f, _, _ in launches] == [
        ("preprocess", False), ("dq", True), ("dkdv", True)]
    (_, none, _), (_, dq_maps, (fwd, _)), (_, kv_maps, _) = launches
    assert none is None  # (the preprocess takes the two records alone)
    assert dq_maps == ("maps", "dq", k.ptr, v.ptr, packed)
    assert kv_maps == ("maps", "dkdv", q.ptr, dout.ptr, packed)
    assert fwd["kv_tail_maps"] == int(packed)
    rec.maps_refused = True
    launches = backward()
    assert [(f.kind, f.producer, f.tma) for f, _, _ in launches[1:]] == [
        ("dq", producer, False), ("dkdv", producer, False)]
    assert all(bytes(m) == bytes(_tma.NO_MAPS) for _, m, _ in launches[1:])
    assert launches[1][2][0]["kv_tail_maps"] == 0
    rec.maps_refused = False
    monkeypatch.setitem(_compile._overrides, _compile.BWD_SM90_TMA_ENV, "0")
    _bwd_plan._runtime.plans.clear()
    assert [(f.producer, f.tma) for f, _, _ in backward()[1:]] == [(producer, False)] * 2


@pytest.mark.parametrize("packed", [False, True])
def test_streamed_maps_views(monkeypatch, packed):
    """_streamed_template's layouts: x in the q and k slots and y in v's, boxes of the step's
    rows (dq: its key block; dk/dv: its query block), a padded batch as (batch, rows,
    heads, columns), a packed one as one sequence with x's and y's tails; the driver's
    refusal (None), or a packed batch's tails refused, gives None."""
    made = {}

    def template(dtype, views, tails=()):
        made.update(dtype=dtype, views=views, tails=tails)
        return None if made.get("refuse") else _tma.Template(b"", bool(tails), ())
    monkeypatch.setattr(_bwd_plan._tma, "template", template)
    _, dq, kv = _compile.bwd_sm90_variants("bf16", 128, "none", False, producer=True, tma=True)
    if packed:
        x = arr((300, 4, 128), "bfloat16", strides=(3 * 4 * 128, 128, 1), ptr=0x1000)
        y = arr((300, 4, 128), "bfloat16", ptr=0x2000)
        seq_dim, head_dim = 0, 1
    else:
        x = arr((2, 300, 4, 128), "bfloat16", ptr=0x1000)
        y = arr((2, 300, 4, 128), "bfloat16", strides=(300 * 1024, 1024, 128, 1), ptr=0x2000)
        seq_dim, head_dim = 1, 2
    for variant, box in ((dq, dq.block_n), (kv, kv.block_m)):
        template = _bwd_plan._streamed_template(variant, x, y, seq_dim, head_dim, 120, packed)
        assert template.has_tails == packed
        assert made["dtype"] == "bfloat16"
        if packed:
            assert made["views"] == (((1, 300, 4, 120), (0, 1536, 128), box),) * 2 + (
                ((1, 300, 4, 120), (0, 512, 128), box),)
            assert made["tails"] == (_tma.tail_view(300, 4, 120, 1536, 128, box),
                                     _tma.tail_view(300, 4, 120, 512, 128, box))
        else:
            assert made["views"] == (((2, 300, 4, 120), (300 * 512, 512, 128), box),) * 2 + (
                ((2, 300, 4, 120), (300 * 1024, 1024, 128), box),)
            assert made["tails"] == ()
    made["refuse"] = True
    assert _bwd_plan._streamed_template(kv, x, y, seq_dim, head_dim, 120, packed) is None


@pytest.mark.parametrize("total_q", [300, 0])
def test_packed_preprocess_zeroes_the_rows_past_the_last_sequence(monkeypatch, total_q):
    """A packed batch's rows past cu_seqlens[-1] (of q, k and v) belong to no sequence: the
    preprocess writes their gradients as zeros (the dq and dk/dv kernels write only the
    sequences' rows), so it runs even where q has no rows at all."""
    rec = Recorder(monkeypatch)
    h, hk, d = 4, 2, 64
    dout, q, k, v, out, _ = (x.__class__(None, "cupy", x.ptr, x.shape[1:], x.strides[1:],
                                         x.dtype, 0, 2)
                             for x in dense_args(1, total_q, 300, h, hk, d))
    cu = arr((3,), "int32", ptr=0x8000)
    lse = arr((h, total_q), "float32", ptr=0x6000)
    cufa.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu, cu, 200, 200, causal=True)
    pre, blocks, *_, (fwd, bwd) = next(x for x in rec.launches
                                       if getattr(x[0], "kind", "") == "preprocess")
    assert blocks == max(-(-total_q // _bwd_plan.PREPROCESS_ROWS_PER_CTA) * h, 1)
    assert fwd["cu_seqlens_q"] == fwd["cu_seqlens_k"] == 0x8000
    assert (fwd["seqlen_q"], fwd["seqlen_k"], fwd["nheads_k"]) == (total_q, 300, hk)
    assert bwd["dq"] and bwd["dk"] and bwd["dv"]


def test_dq_blocks_of_a_packed_batch_fit_its_sums_and_are_found_again():
    """The fused wgmma kernel adds sequence b's query block m at row (start_b + 64 b) // 64
    * 64 + 64 m of dq's sums (start_b: cu_seqlens_q[b] clamped to the rows), and
    bwd_dq_blocks_kernel finds (b, m) again from a 64-row block by a binary search for the
    last sequence whose blocks start at or before it. On random packed batches (empty,
    one-row, 63/64/65-row sequences, cu_seqlens_q ending short of the rows): every block
    lies within dq_sums_layout's rows, no two overlap, and the search gives each back."""
    rng = np.random.default_rng(5)
    variants = _compile.bwd_sm90_fused_variants("bf16", 128, "window", False)
    for _ in range(300):
        batch = int(rng.integers(1, 9))
        lens = rng.choice([0, 1, 2, 63, 64, 65, 127, 128, 129, 300], size=batch)
        cu = np.concatenate([[0], np.cumsum(lens)])
        total = int(cu[-1] + rng.integers(0, 70))  # (rows past the last sequence)
        floats, batch_stride, row_stride, head_stride = _bwd_plan.dq_sums_layout(
            variants, (4, total), batch, total, True, 128)
        rows = head_stride // row_stride
        assert (batch_stride, row_stride, floats) == (0, 128, 4 * rows * 128)

        def first_block(s):
            return (min(max(int(cu[s]), 0), total) + 64 * s) // 64

        owner = {}
        for b in range(batch):
            for m in range(-(-int(lens[b]) // 64)):
                block = first_block(b) + m
                assert 64 * block + 64 <= rows and block not in owner
                owner[block] = (b, m)
        for block in range(-(-rows // 64)):  # the conversion's CTAs of a head
            lo, hi = 0, batch - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if first_block(mid) <= block else (lo, mid - 1)
            q0 = 64 * (block - first_block(lo))
            found = (lo, q0 // 64) if 0 <= q0 < lens[lo] else None
            assert found == owner.get(block), (lens, block)


def test_alibi_slopes_that_require_grad_are_refused_at_backward(monkeypatch):
    """cufa computes no gradient for the ALiBi slopes: where autograd asks for one, the
    backward says so rather than leaving the slopes untrained (a forward that never runs
    its backward, inference under grad mode, still works)."""
    torch = pytest.importorskip("torch")
    from cufa import _fwd_plan, _torch_ops
    _torch_ops.register_if_torch_loaded()
    monkeypatch.setattr(_fwd_plan, "dense", lambda q, k, v, *a, **kw: (
        torch.ones_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])))
    q = torch.ones(1, 4, 2, 8, requires_grad=True)
    slopes = torch.ones(2, requires_grad=True)
    out, _ = torch.ops.cufa.flash_attn(q, q, q, None, False, -1, -1, 0.0, slopes, None)
    with pytest.raises(NotImplementedError, match="alibi_slopes requires grad"):
        out.sum().backward()


@pytest.mark.parametrize("packed", [False, True])
def test_a_kept_plan_launches_as_planned(monkeypatch, packed):
    """A call that passes no gradient arrays of its own keeps its plan: the next call of
    its signature (the same arrays at other addresses) is not planned again and launches
    the same kernels with the same records and TMA maps but for the addresses (a packed
    batch with a learnable sink: the same work-list launches, dsink allocated and in the
    record); a call with dq= is planned every time."""
    kept = _bwd_plan._kept
    rec = Recorder(monkeypatch)
    monkeypatch.setattr(_bwd_plan, "_kept", kept)
    monkeypatch.setattr(_bwd_plan._runtime, "compute_capability", lambda device: 90)
    cufa.api.clear_plans()
    planned, plan = [], _bwd_plan._plan
    monkeypatch.setattr(_bwd_plan, "_plan", lambda *a, **kw: planned.append(1) or plan(*a, **kw))
    cu = arr((3,), "int32", ptr=0x8000)  # (where it stays: the work lists' records read it)

    def call(shift, **kw):
        rec.launches.clear()
        rec.allocations.clear()
        rec.maps.clear()
        dout, q, k, v, out, lse = (dataclasses.replace(x, ptr=x.ptr + shift)
                                   for x in dense_args(b=1 if packed else 2))
        if packed:
            dout, q, k, v, out = (DeviceArray(None, "cupy", x.ptr, x.shape[1:], x.strides[1:],
                                              x.dtype, 0, 2) for x in (dout, q, k, v, out))
            sink = arr((4,), "float32", ptr=0x7000 + shift)
            cufa.flash_attn_varlen_backward(
                dout, q, k, v, out, arr((4, 33), "float32", ptr=0x6000 + shift), cu,
                arr((3,), "int32", ptr=0x8100), 20, 30, causal=True, learnable_sink=sink, **kw)
        else:
            cufa.flash_attn_backward(dout, q, k, v, out, lse, causal=True, softcap=3.0, **kw)
        return ([(f, blocks, threads, smem, records) for f, blocks, threads, smem, _, records
                 in rec.launches], [ptr for *_, ptr in rec.allocations], list(rec.maps))

    (first, _, maps), (second, grads, maps2) = call(0), call(0x100)
    assert len(planned) == 1 and len(first) == len(second) >= 3
    assert [m[:2] + tuple(at + 0x100 for at in m[2:4]) + m[4:] if m is not None else None
            for m in maps] == maps2
    moved = dict(q=0x100, k=0x100, v=0x100, o=0x100, lse=0x100, dout=0x100,
                 learnable_sink=0x100 if packed else 0)
    for (f, *launch, records), (f2, *launch2, records2) in zip(first, second):
        assert (f, launch) == (f2, launch2)
        if f is _compile.VARLEN_SCHEDULE:  # (its record: cu_seqlens and the scratch's places)
            assert bytes(records[0]) == bytes(records2[0])
            continue
        for r, r2 in zip(records, records2):
            for name in r.dtype.names:
                if name in ("dq", "dk", "dv", "dsink")[:len(grads)]:
                    assert r2[name] == grads[("dq", "dk", "dv", "dsink").index(name)], name
                else:
                    assert r2[name] == r[name] + moved.get(name, 0), name
    assert len(grads) == 4 if packed else len(grads) == 3
    call(0, dq=arr((33, 4, 64) if packed else (2, 33, 4, 64), ptr=0x20000))
    call(0, dq=arr((33, 4, 64) if packed else (2, 33, 4, 64), ptr=0x20000))
    assert len(planned) == 3
    cufa.api.clear_plans()


def _stub_planners(monkeypatch, torch):
    """The forward's and the backward's planners replaced by CPU stubs (out = 2 q, the
    gradients 3, 0, 0); returns what the backward saw, (dout, dlse) a call, and after
    them "forward" for each forward planned."""
    from cufa import _bwd_plan, _fwd_plan, _torch_ops
    _torch_ops.register_if_torch_loaded()
    seen = []

    def forward(q, k, v, *a, **kw):
        seen.append("forward")
        return 2 * q, torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    monkeypatch.setattr(_fwd_plan, "dense", forward)

    def backward(dout, q, k, v, out, lse, **kw):
        seen.append((dout.clone(), kw["dlse"]))
        return torch.full_like(q, 3), torch.zeros_like(k), torch.zeros_like(v), None

    monkeypatch.setattr(_bwd_plan, "dense", backward)
    monkeypatch.setattr(_torch_ops, "_on_chunks", lambda *xs: (xs, None))
    return seen


def _dense_call(q):
    from cufa import _torch_ops
    return _torch_ops.recorded("flash_attn", q)(q, q.detach(), q.detach(), None, True, -1, 0,
                                                0.0, None, None, False)


def test_eager_autograd_calls_the_backward_function_not_its_op(monkeypatch):
    """An eager call that autograd records takes the ops' own formulas as an
    autograd.Function, which call the backward's function directly (torch.library's
    dispatch of two ops cost about 0.4 ms of host time a call): no cufa op in the
    profile. An unused output's gradient reaches the backward as None (dlse), or zeros
    where out's is the unused one."""
    torch = pytest.importorskip("torch")
    seen = _stub_planners(monkeypatch, torch)
    q = torch.ones(1, 4, 2, 8, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out, lse = _dense_call(q)
        out.sum().backward(retain_graph=True)
    assert not [e.name for e in prof.events() if e.name.startswith("cufa::")]
    assert type(out.grad_fn).__name__.startswith("cufa_flash_attn")
    assert seen[-1][1] is None and torch.equal(seen[-1][0], torch.ones_like(q))
    assert torch.equal(q.grad, torch.full_like(q, 3))
    lse.sum().backward()
    assert torch.equal(seen[-1][0], torch.zeros_like(q))
    assert torch.equal(seen[-1][1], torch.ones_like(lse))


def test_a_second_derivative_raises(monkeypatch):
    """The gradients are made without autograd: differentiating them again raises (eager,
    as through the op, whose backward op has no formula) rather than leaving attention's
    share out of a gradient penalty or a Hessian-vector product."""
    torch = pytest.importorskip("torch")
    _stub_planners(monkeypatch, torch)
    x = torch.ones(1, 4, 2, 8, requires_grad=True)
    loss = _dense_call(x * 1)[0].sum() + (x ** 2).sum()
    grad, = torch.autograd.grad(loss, x, create_graph=True)
    with pytest.raises(RuntimeError, match="first-order: differentiating them again"):
        grad.sum().backward()


def test_dispatch_modes_and_meta_tensors_take_the_op(monkeypatch):
    """Where something watches ops (FakeTensorMode, a dispatch mode such as selective
    activation checkpointing's), or q is a meta tensor, the call goes through the op:
    its fake implementation gives the shapes, and a policy sees it."""
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    planned = _stub_planners(monkeypatch, torch)

    class Names(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    with FakeTensorMode():
        q = torch.empty(1, 64, 2, 64, requires_grad=True)
        out, lse = _dense_call(q)
        assert out.shape == q.shape and lse.shape == (1, 2, 64)
    q = torch.empty(1, 64, 2, 64, device="meta", requires_grad=True)
    assert _dense_call(q)[0].shape == q.shape
    assert not planned  # (the fake implementations, not the planners)
    q = torch.ones(1, 4, 2, 8, requires_grad=True)
    with Names() as mode:
        _dense_call(q)[0].sum().backward()
    assert "cufa.flash_attn.default" in mode.names and "cufa.flash_attn_bwd.default" in mode.names


def test_a_jax_array_is_not_written_as_a_gradient():
    jnp = pytest.importorskip("jax.numpy")
    dout, q, k, v, out, lse = dense_args()
    with pytest.raises(TypeError, match="dq is a JAX array, and JAX arrays are immutable"):
        cufa.flash_attn_backward(dout, q, k, v, out, lse,
                                 dq=jnp.zeros((2, 33, 4, 64), jnp.float16))


def test_kvcache_is_inference_only_under_torch_compile_too(monkeypatch):
    """Eagerly a q that requires grad is refused by the view; while torch.compile traces
    (no views), the same refusal comes before the op is traced."""
    torch = pytest.importorskip("torch")
    from cufa import _torch_ops
    monkeypatch.setattr(_torch_ops, "compiling", lambda q: True)
    q = torch.ones(1, 1, 4, 64, dtype=torch.float16, requires_grad=True)
    cache = torch.ones(1, 16, 2, 64, dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="q requires grad, but flash_attn_with_kvcache "
                                                  "is inference only"):
        cufa.flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=4)
