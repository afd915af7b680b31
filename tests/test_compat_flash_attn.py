"""CPU: cufa.compat.flash_attn as a user switching from flash-attn 2 meets it -- its
modules and names, flash-attn's signatures and defaults, the arguments that reach cufa
(packed inputs as views of the packed tensor, never copies; flash-attn's large pages as
cufa's), inputs that require grad, the errors flash-attn raises as RuntimeError, and the
plain-PyTorch helpers (bert_padding against hand-computed values, apply_rotary_emb
against NumPy). cufa's kernels are replaced by a recorder; the GPU tests
(test_gpu_compat_flash_attn.py) run them."""
import inspect
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cufa  # noqa: E402
import cufa.compat.flash_attn as flash_attn  # noqa: E402
from cufa.compat.flash_attn import _gpu, bert_padding, flash_attn_interface  # noqa: E402
from cufa.compat.flash_attn.layers.rotary import (  # noqa: E402
    RotaryEmbedding, apply_rotary_emb, apply_rotary_emb_kv_, apply_rotary_emb_qkv_,
    apply_rotary_emb_torch)

# flash-attn 2's signatures (flash_attn/flash_attn_interface.py, its raw entry points in
# csrc/flash_attn/flash_api.cpp, bert_padding.py, layers/rotary.py): parameter names, with
# the default where there is one.
_OPTIONS = ("dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), "
            "softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False")
SIGNATURES = {
    flash_attn.flash_attn_func: "q, k, v, " + _OPTIONS,
    flash_attn.flash_attn_qkvpacked_func: "qkv, " + _OPTIONS,
    flash_attn.flash_attn_kvpacked_func: "q, kv, " + _OPTIONS,
    flash_attn.flash_attn_varlen_func: "q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, "
                                       "max_seqlen_k, " + _OPTIONS + ", block_table=None",
    flash_attn.flash_attn_varlen_qkvpacked_func: "qkv, cu_seqlens, max_seqlen, " + _OPTIONS,
    flash_attn.flash_attn_varlen_kvpacked_func: "q, kv, cu_seqlens_q, cu_seqlens_k, "
                                                "max_seqlen_q, max_seqlen_k, " + _OPTIONS,
    flash_attn.flash_attn_with_kvcache:
        "q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, "
        "cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None, "
        "softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
        "rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False",
    flash_attn_interface._flash_attn_forward:
        "q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, "
        "softcap, alibi_slopes, return_softmax",
    flash_attn_interface._flash_attn_varlen_forward:
        "q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, "
        "softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0, "
        "alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None, "
        "seqused_k=None, zero_tensors=False, num_splits=0",
    flash_attn_interface._get_block_size_n: "device, head_dim, is_dropout, is_causal",
    flash_attn_interface.flash_attn_gpu.fwd:
        "q, k, v, out_, alibi_slopes_, p_dropout, softmax_scale, is_causal, window_size_left, "
        "window_size_right, softcap, return_softmax, gen_",
    flash_attn_interface.flash_attn_gpu.varlen_fwd:
        "q, k, v, out_, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k_, block_table_, "
        "alibi_slopes_, max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, "
        "is_causal, window_size_left, window_size_right, softcap, return_softmax, gen_, "
        "num_splits=0",
    flash_attn_interface.flash_attn_gpu.bwd:
        "dout, q, k, v, out, softmax_lse, dq_, dk_, dv_, alibi_slopes_, p_dropout, "
        "softmax_scale, is_causal, window_size_left, window_size_right, softcap, "
        "deterministic, gen_, rng_state",
    flash_attn_interface.flash_attn_gpu.varlen_bwd:
        "dout, q, k, v, out, softmax_lse, dq_, dk_, dv_, cu_seqlens_q, cu_seqlens_k, "
        "alibi_slopes_, max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, "
        "is_causal, window_size_left, window_size_right, softcap, deterministic, gen_, "
        "rng_state",
    flash_attn_interface.flash_attn_gpu.fwd_kvcache:
        "q, kcache, vcache, k_, v_, seqlens_k_, rotary_cos_, rotary_sin_, cache_batch_idx_, "
        "leftpad_k_, block_table_, alibi_slopes_, out_, softmax_scale, is_causal, "
        "window_size_left, window_size_right, softcap, is_rotary_interleaved, num_splits",
    bert_padding.unpad_input: "hidden_states, attention_mask, unused_mask=None",
    bert_padding.pad_input: "hidden_states, indices, batch, seqlen",
    bert_padding.index_first_axis: "input, indices",
    bert_padding.index_put_first_axis: "values, indices, first_axis_dim",
    bert_padding.unpad_input_for_concatenated_sequences:
        "hidden_states, attention_mask_in_length",
    apply_rotary_emb: "x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, "
                      "cu_seqlens=None, max_seqlen=None",
    apply_rotary_emb_qkv_: "qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False, "
                           "seqlen_offsets=0, num_heads_q=None",
    apply_rotary_emb_kv_: "kv, cos, sin, interleaved=False, seqlen_offsets=0",
    apply_rotary_emb_torch: "x, cos, sin, interleaved=False",
    RotaryEmbedding: "dim, base=10000.0, interleaved=False, scale_base=None, "
                     "pos_idx_in_fp32=True, device=None",
    RotaryEmbedding.forward: "self, qkv, kv=None, seqlen_offset=0, max_seqlen=None, "
                             "num_heads_q=None",
}


@pytest.mark.parametrize("fn", SIGNATURES, ids=lambda fn: fn.__qualname__)
def test_signature_is_flash_attns(fn):
    assert str(inspect.signature(fn)) == f"({SIGNATURES[fn]})"


def test_modules_and_names_are_flash_attns():
    assert set(flash_attn.__all__) == {
        "flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
        "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func",
        "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"}
    for name in flash_attn.__all__:
        assert getattr(flash_attn, name) is getattr(flash_attn.flash_attn_interface, name)
    assert flash_attn.bert_padding.pad_input is bert_padding.pad_input
    assert flash_attn.layers.rotary.apply_rotary_emb is apply_rotary_emb
    assert flash_attn_interface.USE_TRITON_ROCM is False
    assert flash_attn.__version__.startswith("2.")
    assert flash_attn_interface._get_block_size_n("cuda", 59, False, True) in (64, 128)


def test_import_cufa_alone_does_not_import_torch():
    code = ("import sys, cufa, cufa.compat; assert 'torch' not in sys.modules; "
            "import cufa.compat.flash_attn; assert 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- what reaches cufa ------------------------------------------------------------------------

class Recorder:
    """Stands in for cufa's three functions: records each call's arguments and returns
    outputs of the right shapes (out = q + 1, lse = zeros, and S_dmask as cufa's)."""

    def __init__(self):
        self.calls = []

    def _record(self, name, args, kwargs):
        bound = inspect.signature(getattr(cufa.api, name)).bind(*args, **kwargs)
        bound.apply_defaults()
        self.calls.append((name, dict(bound.arguments)))
        return bound.arguments

    def flash_attn_func(self, *args, **kwargs):
        a = self._record("flash_attn_func", args, kwargs)
        b, s, h, _ = a["q"].shape
        return self._outputs(a, a["q"], torch.zeros(b, h, s), a["return_lse"])

    def flash_attn_varlen_func(self, *args, **kwargs):
        a = self._record("flash_attn_varlen_func", args, kwargs)
        total, h, _ = a["q"].shape
        return self._outputs(a, a["q"], torch.zeros(h, total), a["return_lse"])

    def flash_attn_with_kvcache(self, *args, **kwargs):
        a = self._record("flash_attn_with_kvcache", args, kwargs)
        out = a["q"] + 1
        b, s, h, _ = a["q"].shape
        return (out, torch.zeros(b, h, s)) if a["return_softmax_lse"] else out

    @staticmethod
    def _outputs(a, q, lse, return_lse):
        out = q + 1 if a["out"] is None else a["out"]
        if a["return_attn_probs"]:
            return out, lse, q.new_empty((0,))
        return (out, lse) if return_lse else out

    def last(self):
        return self.calls[-1][1]


@pytest.fixture
def kernels(monkeypatch):
    recorder = Recorder()
    for name in ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"):
        monkeypatch.setattr(cufa, name, getattr(recorder, name))
    return recorder


def _is_view_of(x, packed, index, dim):
    """x is packed.select(dim, index) itself: the same memory and strides, not a copy."""
    part = packed.select(dim, index)
    return (x.data_ptr() == part.data_ptr() and x.shape == part.shape
            and x.stride() == part.stride())


def randn(*shape, requires_grad=False):
    return torch.randn(*shape, dtype=torch.float16).requires_grad_(requires_grad)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_packed_entry_points_pass_views_of_the_packed_tensor(kernels, requires_grad):
    qkv = randn(2, 37, 3, 4, 40, requires_grad=requires_grad)
    q, kv = randn(2, 37, 4, 40), randn(2, 41, 2, 2, 40, requires_grad=requires_grad)
    cu = torch.tensor([0, 30, 74], dtype=torch.int32)

    flash_attn.flash_attn_qkvpacked_func(qkv)
    a = kernels.last()
    assert all(_is_view_of(a[n], qkv, i, 2) for i, n in enumerate("qkv"))
    flash_attn.flash_attn_kvpacked_func(q, kv, causal=True)
    a = kernels.last()
    assert a["q"].data_ptr() == q.data_ptr() and a["q"].stride() == q.stride()
    assert _is_view_of(a["k"], kv, 0, 2) and _is_view_of(a["v"], kv, 1, 2)
    assert a["causal"] is True

    packed = qkv.detach().reshape(74, 3, 4, 40).requires_grad_(requires_grad)
    flash_attn.flash_attn_varlen_qkvpacked_func(packed, cu, 44)
    a = kernels.last()
    assert all(_is_view_of(a[n], packed, i, 1) for i, n in enumerate("qkv"))
    assert a["cu_seqlens_q"] is cu and a["cu_seqlens_k"] is cu and a["max_seqlen_k"] == 44
    kv_packed = kv.detach().reshape(82, 2, 2, 40).requires_grad_(requires_grad)
    flash_attn.flash_attn_varlen_kvpacked_func(q.reshape(74, 4, 40), kv_packed, cu, cu, 44, 44)
    a = kernels.last()
    assert _is_view_of(a["k"], kv_packed, 0, 1) and _is_view_of(a["v"], kv_packed, 1, 1)
    # cufa gets the views themselves: where they require grad, its autograd op records
    # the backward, whose gradients reach the packed tensor through the views
    assert all(a[n].requires_grad == requires_grad for n in "kv")


def test_options_reach_cufa_as_given(kernels):
    q = randn(1, 9, 2, 16)
    window = torch.randint(0, 9, (2,))  # as flash-attn's tests pass it
    alibi = torch.rand(2)
    flash_attn.flash_attn_func(q, q, q, 0.0, 0.5, True, window, 3.0, alibi, True, True)
    a = kernels.last()
    assert (a["dropout_p"], a["softmax_scale"], a["causal"], a["softcap"],
            a["deterministic"], a["return_attn_probs"]) == (0.0, 0.5, True, 3.0, True, True)
    assert a["window_size"] is window and a["alibi_slopes"] is alibi
    assert cufa._checks.window_ints(a["window_size"]) == tuple(int(w) for w in window)
    flash_attn.flash_attn_func(q, q, q)
    a = kernels.last()
    assert a["window_size"] == (-1, -1) and a["return_attn_probs"] is False


def test_windows_and_softcap_as_flash_attn_reads_them(kernels):
    """flash_api.cpp: a window side that is negative, or reaches the keys' count or further
    (seqlen_k; max_seqlen_k for a packed batch; a cache's capacity), is unbounded; a right
    side so made unbounded is bounded at that count again where the left one is bounded;
    a negative softcap is off. With 6 query rows over 2 keys, (-1, 2) taken at its word
    would hide every key from rows 0 and 1 (bottom-right alignment)."""
    q, k = randn(1, 6, 2, 16), randn(1, 2, 2, 16)
    for window, softcap, want in (((-1, 2), 0.0, (-1, -1)), ((-5, 1), -1.0, (-1, 1)),
                                  ((2, 0), 3.0, (-1, 0)), ((1, 1), 0.0, (1, 1)),
                                  ((1, -1), 0.0, (1, 2)), ((0, 5), 0.0, (0, 2))):
        flash_attn.flash_attn_func(q, k, k, window_size=window, softcap=softcap)
        a = kernels.last()
        assert (a["window_size"], a["softcap"]) == (want, max(softcap, 0.0)), window
    cu = torch.tensor([0, 6], dtype=torch.int32)
    flash_attn.flash_attn_varlen_func(q[0], k[0], k[0], cu, torch.tensor([0, 2], dtype=torch.int32),
                                      6, 4, window_size=(3, 4))
    assert kernels.last()["window_size"] == (3, 4)  # (max_seqlen_k = 4: as given)
    cache = randn(1, 20, 2, 16)
    flash_attn.flash_attn_with_kvcache(q[:, :1], cache, cache, cache_seqlens=7,
                                       window_size=(19, 20))
    assert kernels.last()["window_size"] == (19, 20)  # (the cache's 20 positions)
    flash_attn.flash_attn_with_kvcache(q[:, :1], cache, cache, cache_seqlens=7,
                                       window_size=(30, 25))
    assert kernels.last()["window_size"] == (-1, -1)


def test_requires_grad_reaches_cufas_autograd_but_kvcache_raises(kernels):
    """Tensors that require grad go to cufa as they are (its flash_attn_func and
    flash_attn_varlen_func record their backward); flash_attn_with_kvcache has none: its
    forward runs detached and a backward through its output raises, naming it."""
    q, k = randn(2, 9, 2, 16, requires_grad=True), randn(2, 9, 2, 16)
    flash_attn.flash_attn_func(q, k, k)
    assert kernels.last()["q"] is q
    qkv = randn(1, 5, 3, 2, 16, requires_grad=True)
    flash_attn.flash_attn_qkvpacked_func(qkv)
    assert kernels.last()["q"].requires_grad
    cache = randn(1, 20, 2, 16)
    out = flash_attn.flash_attn_with_kvcache(q[:1, :1], cache, cache, cache_seqlens=7)
    assert not kernels.last()["q"].requires_grad and out.requires_grad
    with pytest.raises(NotImplementedError, match="flash_attn_with_kvcache"):
        out.sum().backward()
    with torch.no_grad():
        assert not flash_attn.flash_attn_with_kvcache(q[:1, :1], cache, cache,
                                                      cache_seqlens=7).requires_grad


# -- paged caches ----------------------------------------------------------------------------

def test_pages_of_256_rows_multiples_are_cufas_pages_of_256(kernels):
    cache = torch.arange(3 * 512 * 2 * 8, dtype=torch.float16).reshape(3, 512, 2, 8)
    table = torch.tensor([[2, 0], [1, 2]], dtype=torch.int32)
    q = randn(2, 1, 2, 8)
    lens = torch.tensor([700, 1024], dtype=torch.int32)
    flash_attn.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lens, block_table=table)
    a = kernels.last()
    pages = a["k_cache"]
    assert pages.shape == (6, 256, 2, 8) and pages.data_ptr() == cache.data_ptr()
    assert torch.equal(a["block_table"], torch.tensor([[4, 5, 0, 1], [2, 3, 4, 5]],
                                                      dtype=torch.int32))
    for b in range(2):  # key j of sequence b: the same element either way
        for j in (0, 255, 256, 511, 512, 1023):
            old = cache[table[b, j // 512], j % 512]
            new = pages[a["block_table"][b, j // 256], j % 256]
            assert torch.equal(old, new)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    flash_attn.flash_attn_varlen_func(q.reshape(2, 2, 8), cache, cache, cu, cu, 1, 1024,
                                      block_table=table)
    a = kernels.last()
    assert a["k"].shape == (6, 256, 2, 8) and a["block_table"].shape == (2, 4)
    # pages of 256 (or those cufa takes anyway) reach cufa as they are
    small = cache[:, :256]
    flash_attn.flash_attn_with_kvcache(q, small, small, cache_seqlens=lens // 4,
                                       block_table=table)
    assert kernels.last()["k_cache"] is small and kernels.last()["block_table"] is table


@pytest.mark.parametrize("append", [False, True])
def test_paged_cache_past_the_block_table_raises_runtime_error(kernels, append):
    # flash-attn's test_flash_attn_kvcache_paged_block_table_bounds, its shapes on the CPU
    cache = randn(4, 256, 1, 64)
    table = torch.zeros(1, 1, dtype=torch.int32)
    q = randn(1, 1, 1, 64)
    k = randn(1, 1, 1, 64) if append else None
    over = torch.full((1,), 256 if append else 257, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block_table") as info:
        flash_attn.flash_attn_with_kvcache(q, cache, cache, k=k, v=k, cache_seqlens=over,
                                           block_table=table)
    assert ("+ seqlen_new" in str(info.value)) == append
    with pytest.raises(RuntimeError, match="block_table"):
        flash_attn.flash_attn_with_kvcache(q, cache, cache, k=k, v=k,
                                           cache_seqlens=int(over[0]), block_table=table)
    assert kernels.calls == []
    at_capacity = torch.full((1,), 256 - append, dtype=torch.int32)
    flash_attn.flash_attn_with_kvcache(q, cache, cache, k=k, v=k, cache_seqlens=at_capacity,
                                       block_table=table)
    assert len(kernels.calls) == 1


def test_no_length_is_read_while_a_cuda_graph_is_captured(kernels, monkeypatch):
    monkeypatch.setattr(_gpu, "capturing", lambda x: True)
    cache, table = randn(4, 256, 1, 64), torch.zeros(1, 1, dtype=torch.int32)
    lens = torch.full((1,), 300, dtype=torch.int32)  # past the table: cufa clamps it
    flash_attn.flash_attn_with_kvcache(randn(1, 1, 1, 64), cache, cache, cache_seqlens=lens,
                                       block_table=table)
    assert kernels.last()["cache_seqlens"] is lens


# -- the raw entry points and flash-attn's RuntimeErrors ---------------------------------------

def test_generator_slot_must_be_none_in_every_raw_entry_point(kernels):
    # flash-attn's test_flash_attn_generator_arg_must_be_none, its calls on the CPU
    gpu = flash_attn_interface.flash_attn_gpu
    match = r"generator` argument is no longer supported"
    q, k = randn(1, 1, 2, 8), randn(1, 1, 1, 8)
    lse, bad, scale = torch.randn(1, 2, 1), torch.empty(1), 8 ** -0.5
    qf, kf, cu = q.view(1, 2, 8), k.view(1, 1, 8), torch.arange(0, 2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=match):
        gpu.fwd(q, k, k, None, None, 0.0, scale, True, -1, -1, 0.0, False, bad)
    with pytest.raises(RuntimeError, match=match):
        gpu.bwd(q, q, k, k, q, lse, None, None, None, None, 0.0, scale, True, -1, -1, 0.0,
                False, bad, None)
    with pytest.raises(RuntimeError, match=match):
        gpu.varlen_fwd(qf, kf, kf, None, cu, cu, None, None, None, None, 1, 1, 0.0, scale,
                       False, True, -1, -1, 0.0, False, bad, 0)
    with pytest.raises(RuntimeError, match=match):
        gpu.varlen_bwd(qf, qf, kf, kf, qf, lse, None, None, None, cu, cu, None, 1, 1, 0.0,
                       scale, False, True, -1, -1, 0.0, False, bad, None)
    assert kernels.calls == []
    with pytest.raises(RuntimeError, match="cufa needs CUDA device arrays"):  # (cufa's backward)
        gpu.bwd(q, q, k, k, q, lse, None, None, None, None, 0.0, scale, True, -1, -1, 0.0,
                False, None, None)
    out, lse, s_dmask, rng_state = gpu.fwd(q, k, k, None, None, 0.0, scale, True,
                                           torch.tensor(3), -1, 0.0, False, None)
    assert s_dmask.shape == (0,) and rng_state.shape == (2,)
    a = kernels.last()
    # (3 reaches past the one key: flash-attn reads the side as unbounded)
    assert a["window_size"][0] == -1 and a["return_lse"] and a["causal"]


def test_varlen_paged_num_splits_above_one_raises(kernels):
    # flash-attn's test_flash_attn_varlen_paged_kv_num_splits, its calls on the CPU
    cache, table = randn(4, 256, 2, 64), torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    q, cu_q = randn(2, 4, 64), torch.arange(3, dtype=torch.int32)
    used = torch.tensor([512, 300], dtype=torch.int32)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=torch.tensor([0, 512, 812], dtype=torch.int32),
              max_seqlen_q=1, max_seqlen_k=512, dropout_p=0.0, softmax_scale=0.125,
              causal=False, window_size_left=-1, window_size_right=0, block_table=table,
              seqused_k=used)
    fwd = flash_attn_interface._flash_attn_varlen_forward
    for splits in (0, 1, np.int64(1), torch.tensor(0)):
        out, lse, s_dmask, _ = fwd(q, cache, cache, **kw, num_splits=splits)
        assert kernels.last()["seqused_k"] is used and kernels.last()["block_table"] is table
    for splits in (2, np.int32(2), torch.tensor(5)):
        with pytest.raises(RuntimeError, match="num_splits > 1 is not supported"):
            fwd(q, cache, cache, **kw, num_splits=splits)
    with pytest.raises(NotImplementedError, match="leftpad_k"):
        fwd(q, cache, cache, **kw, leftpad_k=used)
    with pytest.raises(RuntimeError, match="return_softmax"):
        fwd(q, cache, cache, **dict(kw, block_table=None), return_softmax=True)


def test_cufas_errors_are_also_runtime_errors():
    q = torch.zeros(1, 4, 2, 16, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="window_size left") as info:
        flash_attn.flash_attn_func(q, q, q, window_size=(1.5, 0))
    assert isinstance(info.value, ValueError)  # cufa's own type, as well
    with pytest.raises(RuntimeError, match="cufa needs CUDA device arrays") as info:
        flash_attn.flash_attn_func(q, q, q)
    assert isinstance(info.value, TypeError)
    with pytest.raises(RuntimeError, match="dropout_p"):  # NotImplementedError already is one
        flash_attn.flash_attn_func(q, q, q, 0.1)
    with pytest.raises(RuntimeError, match="max_seqlen_q"):
        flash_attn.flash_attn_varlen_func(q[0], q[0], q[0], None, None, -1, 4)


def test_torch_compile_traces_a_packed_call_as_one_op():
    import torch._dynamo

    from cufa import _torch_ops
    _torch_ops.register_if_torch_loaded()
    qkv = torch.empty(2, 64, 3, 4, 32, dtype=torch.float16, device="meta")

    def f(qkv):
        out, lse, s = flash_attn.flash_attn_qkvpacked_func(qkv, causal=True,
                                                           return_attn_probs=True)
        return out * 2, lse, s
    torch._dynamo.reset()
    explain = torch._dynamo.explain(f)(qkv)
    assert explain.graph_break_count == 0, explain.break_reasons
    (graph,) = explain.graphs
    assert graph.code.count("torch.ops.cufa.flash_attn.default(") == 1


# -- bert_padding ------------------------------------------------------------------------------

def test_unpad_input_returns_flash_attns_five_values():
    hidden = torch.arange(3 * 4 * 2, dtype=torch.float32).reshape(3, 4, 2)
    mask = torch.tensor([[1, 1, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    packed, indices, cu, max_seqlen, used = bert_padding.unpad_input(hidden, mask)
    rows = [0, 1, 3, 8, 9, 10, 11]  # (batch * seqlen) rows of the real tokens
    assert indices.tolist() == rows and indices.dtype == torch.int64
    assert torch.equal(packed, hidden.reshape(12, 2)[rows])
    assert cu.tolist() == [0, 3, 3, 7] and cu.dtype == torch.int32
    assert max_seqlen == 4 and type(max_seqlen) is int
    assert used.tolist() == [3, 0, 4] and used.dtype == torch.int32
    assert torch.equal(bert_padding.pad_input(packed, indices, 3, 4),
                       hidden * mask[..., None])

    unused = torch.tensor([[0, 0, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    packed, indices, cu, max_seqlen, used = bert_padding.unpad_input(hidden, mask, unused)
    assert indices.tolist() == [0, 1, 2, 3, 4, 5, 8, 9, 10, 11]
    assert cu.tolist() == [0, 4, 6, 10] and max_seqlen == 4 and used.tolist() == [3, 0, 4]


def test_padding_helpers_are_plain_differentiable_tensor_ops():
    x = torch.randn(5, 3, requires_grad=True)
    idx = torch.tensor([4, 0, 2])
    assert torch.equal(bert_padding.index_first_axis(x, idx), x[idx])
    put = bert_padding.index_put_first_axis(x[:3], idx, 6)
    assert torch.equal(put[idx], x[:3]) and put[[1, 3, 5]].abs().sum() == 0
    put.sum().backward()
    assert x.grad[:3].eq(1).all() and x.grad[3:].eq(0).all()
    picked, residual = bert_padding.index_first_axis_residual(x, idx)
    assert torch.equal(picked, x[idx]) and torch.equal(residual, x)
    x.grad = None  # (a gradient through either output reaches x, as flash-attn's does)
    (picked.sum() + (10 * residual).sum()).backward()
    assert x.grad[:, 0].tolist() == [11, 10, 11, 10, 11]


def test_unpad_input_for_concatenated_sequences():
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]])
    hidden = torch.arange(18, dtype=torch.float32).reshape(3, 6, 1)
    packed, indices, cu, max_seqlen = bert_padding.unpad_input_for_concatenated_sequences(
        hidden, lengths)
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17]
    assert cu.tolist() == [0, 2, 5, 8, 10, 16] and max_seqlen == 6
    assert packed[:, 0].tolist() == [float(i) for i in indices.tolist()]


# -- apply_rotary_emb ------------------------------------------------------------------------

def rotary_numpy(x, cos, sin, positions, interleaved):
    """x (rows, heads, d) float64 with each row's position: the rotary_dim = 2 cos.shape[1]
    first features rotated as complex numbers by the angle at that position (positions
    past cos's rows untouched)."""
    half = cos.shape[1]
    out = x.copy()
    for r, p in enumerate(positions):
        if not 0 <= p < cos.shape[0]:
            continue
        turn = cos[p] + 1j * sin[p]
        if interleaved:
            z = (x[r, :, 0:2 * half:2] + 1j * x[r, :, 1:2 * half:2]) * turn
            out[r, :, 0:2 * half:2], out[r, :, 1:2 * half:2] = z.real, z.imag
        else:
            z = (x[r, :, :half] + 1j * x[r, :, half:2 * half]) * turn
            out[r, :, :half], out[r, :, half:2 * half] = z.real, z.imag
    return out


def _rotary_inputs(rng, rows, heads, d, rotary_dim, seqlen_ro):
    x = torch.from_numpy(rng.standard_normal((rows, heads, d), dtype=np.float32))
    angle = rng.uniform(0, 2 * np.pi, (seqlen_ro, rotary_dim // 2))
    return x, np.cos(angle), np.sin(angle)


def _close(got, expected):
    np.testing.assert_allclose(got.double().numpy(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [16, 24, 40])
def test_apply_rotary_emb_against_numpy(rng, interleaved, rotary_dim):
    batch, seqlen, heads, d, seqlen_ro = 3, 7, 2, 40, 20
    x, cos, sin = _rotary_inputs(rng, batch * seqlen, heads, d, rotary_dim, seqlen_ro)
    x = x.reshape(batch, seqlen, heads, d)
    c, s = torch.from_numpy(cos).float(), torch.from_numpy(sin).float()
    for offsets in (0, 5, torch.tensor([0, 13, 2], dtype=torch.int32)):
        got = apply_rotary_emb(x, c, s, interleaved=interleaved, seqlen_offsets=offsets)
        shift = offsets.tolist() if isinstance(offsets, torch.Tensor) else [offsets] * batch
        positions = [shift[b] + t for b in range(batch) for t in range(seqlen)]
        expected = rotary_numpy(x.reshape(-1, heads, d).double().numpy(), cos, sin, positions,
                                interleaved)
        _close(got.reshape(-1, heads, d), expected)
        assert torch.equal(got[..., rotary_dim:], x[..., rotary_dim:])  # the rest unchanged


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rotary_emb_of_a_packed_batch_and_in_place(rng, interleaved):
    heads, d, rotary_dim = 3, 32, 16
    cu = torch.tensor([0, 4, 4, 11], dtype=torch.int32)  # a sequence of 0 tokens
    x, cos, sin = _rotary_inputs(rng, 12, heads, d, rotary_dim, 16)  # row 11: no sequence
    c, s = torch.from_numpy(cos).float(), torch.from_numpy(sin).float()
    offsets = torch.tensor([3, 0, 10], dtype=torch.int64)
    got = apply_rotary_emb(x, c, s, interleaved, False, offsets, cu, 7)
    positions = [3 + t for t in range(4)] + [10 + t for t in range(7)] + [-1]
    _close(got, rotary_numpy(x.double().numpy(), cos, sin, positions, interleaved))
    fp16 = x.half()
    same = apply_rotary_emb(fp16, c.half(), s.half(), interleaved, True, offsets, cu, 7)
    assert same is fp16
    np.testing.assert_allclose(fp16.double().numpy(),
                               rotary_numpy(x.half().double().numpy(), c.half().double().numpy(),
                                            s.half().double().numpy(), positions, interleaved),
                               rtol=2e-3, atol=2e-3)


# -- RotaryEmbedding and the in-place forms for packed qkv / kv ------------------------------

def _rope_tables(positions, dim, base, decay=None):
    """float64 cos, sin of RoFormer's angles (positions x dim / 2), times decay (xPos)."""
    angle = np.outer(positions, base ** (-np.arange(0, dim, 2) / dim))
    cos, sin = np.cos(angle), np.sin(angle)
    return (cos, sin) if decay is None else (cos * decay, sin * decay)


def _rows(x):
    """(b, s, h, d) -> (b * s, h, d) float64, with each row's position t."""
    b, s = x.shape[:2]
    return x.reshape(b * s, *x.shape[2:]).double().numpy(), [t for _ in range(b) for t in range(s)]


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("layout", ["qkv", "gqa", "kv"])
@pytest.mark.parametrize("offset", [0, 3, "tensor"])
def test_rotary_embedding_against_numpy(rng, interleaved, layout, offset):
    """q and k rotated in place by float64 RoFormer angles at each token's position (its
    offset added), v untouched, for packed qkv, packed GQA qkv and q with a packed kv."""
    batch, seqlen, hq, hk, d, dim, base = 2, 9, 4, 2, 32, 16, 500.0
    module = RotaryEmbedding(dim, base=base, interleaved=interleaved)
    shift = [2, 7] if offset == "tensor" else [offset] * batch
    kw = dict(seqlen_offset=torch.tensor(shift), max_seqlen=20) if offset == "tensor" else dict(
        seqlen_offset=offset)
    cos, sin = _rope_tables(np.arange(20), dim, base)

    def rotated(x):  # (b, s, h, d) -> float64 expected
        rows, t = _rows(x)
        positions = [shift[r // seqlen] + p for r, p in enumerate(t)]
        return rotary_numpy(rows, cos, sin, positions, interleaved).reshape(x.shape)

    def t(*shape):
        return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32))
    if layout == "qkv":
        qkv = t(batch, seqlen, 3, hq, d)
        q0, k0, v0 = (qkv[:, :, i].clone() for i in range(3))
        assert module(qkv, **kw) is qkv
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    elif layout == "gqa":
        qkv = t(batch, seqlen, hq + 2 * hk, d)
        q0, k0 = qkv[:, :, :hq].clone(), qkv[:, :, hq:hq + hk].clone()
        v0 = qkv[:, :, hq + hk:].clone()
        assert module(qkv, num_heads_q=hq, **kw) is qkv
        q, k, v = qkv[:, :, :hq], qkv[:, :, hq:hq + hk], qkv[:, :, hq + hk:]
    else:
        q, kv = t(batch, seqlen, hq, d), t(batch, seqlen, 2, hk, d)
        q0, k0, v0 = q.clone(), kv[:, :, 0].clone(), kv[:, :, 1].clone()
        got_q, got_kv = module(q, kv=kv, **kw)
        assert got_q is q and got_kv is kv
        k, v = kv[:, :, 0], kv[:, :, 1]
    np.testing.assert_allclose(q.double().numpy(), rotated(q0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(k.double().numpy(), rotated(k0), rtol=1e-5, atol=1e-5)
    assert torch.equal(v, v0)


def test_rotary_embedding_xpos_scales_q_up_and_k_down(rng):
    """With scale_base, q's rotation is times scale^p and k's divided by it, p = (position -
    length // 2) / scale_base over the tables' length, scale_i = (2i + 0.4 dim) / (1.4 dim)."""
    batch, seqlen, h, d, dim, scale_base = 1, 12, 2, 16, 16, 8.0
    module = RotaryEmbedding(dim, scale_base=scale_base)
    qkv = torch.from_numpy(rng.standard_normal((batch, seqlen, 3, h, d), dtype=np.float32))
    q0, k0 = qkv[:, :, 0].clone(), qkv[:, :, 1].clone()
    module(qkv)
    scale = (np.arange(0, dim, 2) + 0.4 * dim) / (1.4 * dim)
    decay = scale[None, :] ** ((np.arange(seqlen) - seqlen // 2) / scale_base)[:, None]
    for got, x0, factor in ((qkv[:, :, 0], q0, decay), (qkv[:, :, 1], k0, 1 / decay)):
        cos, sin = _rope_tables(np.arange(seqlen), dim, 10000.0, factor)
        rows, t = _rows(x0)
        np.testing.assert_allclose(got.double().numpy(),
                                   rotary_numpy(rows, cos, sin, t, False).reshape(x0.shape),
                                   rtol=1e-5, atol=1e-5)


def test_rotary_embedding_tables_grow_and_follow_the_dtype(rng):
    module = RotaryEmbedding(8)
    module(torch.zeros(1, 5, 3, 1, 8))
    first = module._cos_cached
    assert module._seq_len_cached == 5 and first.dtype == torch.float32
    module(torch.zeros(1, 4, 3, 1, 8))  # shorter: the tables as they were
    assert module._cos_cached is first
    module(torch.zeros(1, 4, 3, 1, 8), seqlen_offset=6)
    assert module._seq_len_cached == 10 and module._cos_cached.shape == (10, 4)
    module(torch.zeros(1, 4, 3, 1, 8, dtype=torch.float16))
    assert module._cos_cached.dtype == torch.float16
    with pytest.raises(ValueError, match="max_seqlen"):
        RotaryEmbedding(8)(torch.zeros(1, 4, 3, 1, 8), seqlen_offset=torch.tensor([1]))
    with pytest.raises(ValueError, match="num_heads_q"):
        module(torch.zeros(1, 4, 6, 8))


def test_rotary_embedding_subclass_tables_are_used():
    """Subclasses override _update_cos_sin_cache (linear position scaling, say) and set
    flash-attn's table attributes: forward rotates by those."""
    class Still(RotaryEmbedding):
        def _update_cos_sin_cache(self, seqlen, device=None, dtype=None):
            self._cos_cached = torch.ones(seqlen, self.dim // 2, dtype=dtype)
            self._sin_cached = torch.zeros(seqlen, self.dim // 2, dtype=dtype)
    qkv = torch.randn(2, 5, 3, 2, 8)
    before = qkv.clone()
    Still(8)(qkv)
    assert torch.equal(qkv, before)


@pytest.mark.parametrize("leaf", [True, False], ids=["leaf", "inside a graph"])
@pytest.mark.parametrize("form", ["module", "qkv_", "kv_", "inplace"])
def test_in_place_rotary_gradient_is_the_inverse_rotation(rng, leaf, form):
    """d(sum(w * rope(x)))/dx = rope^-1(w) on the rotated parts (a rotation is orthogonal),
    w elsewhere; as with flash-attn, x may be a leaf that requires grad (written in place
    all the same, an alias of it returned)."""
    batch, seqlen, h, d, dim = 2, 6, 2, 16, 12
    shape = {"kv_": (batch, seqlen, 2, h, d), "inplace": (batch, seqlen, h, d)}.get(
        form, (batch, seqlen, 3, h, d))
    x = torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).requires_grad_(True)
    start = x.detach().clone()
    w = torch.from_numpy(rng.standard_normal(shape, dtype=np.float32))
    cos, sin = _rope_tables(np.arange(seqlen), dim, 10000.0)
    c, s = torch.from_numpy(cos).float(), torch.from_numpy(sin).float()
    arg = x if leaf else x * 1.0
    out = {"module": lambda: RotaryEmbedding(dim, interleaved=True)(arg),
           "qkv_": lambda: apply_rotary_emb_qkv_(arg, c, s, interleaved=True),
           "kv_": lambda: apply_rotary_emb_kv_(arg, c, s, interleaved=True),
           "inplace": lambda: apply_rotary_emb(arg, c, s, True, inplace=True)}[form]()
    assert out.data_ptr() == arg.data_ptr()  # (written in place)
    (out * w).sum().backward()
    rotated = {"kv_": (0,), "inplace": (None,)}.get(form, (0, 1))
    for i in rotated:
        part = (lambda a: a) if i is None else (lambda a, i=i: a[:, :, i])
        rows, t = _rows(part(w))
        want = rotary_numpy(rows, cos, -sin, t, True).reshape(part(w).shape)
        np.testing.assert_allclose(part(x.grad).double().numpy(), want, rtol=1e-5, atol=1e-5)
        rows, t = _rows(part(start))
        want = rotary_numpy(rows, cos, sin, t, True).reshape(part(w).shape)
        np.testing.assert_allclose(part(arg).detach().double().numpy(), want, rtol=1e-5,
                                   atol=1e-5)
    for i in set(range(shape[2])) - set(rotated) if rotated != (None,) else ():
        assert torch.equal(x.grad[:, :, i], w[:, :, i])


@pytest.mark.parametrize("interleaved", [False, True])
def test_packed_forms_and_the_torch_reference_agree_with_apply_rotary_emb(rng, interleaved):
    batch, seqlen, hq, hk, d, half = 2, 7, 4, 2, 24, 8
    angle = rng.uniform(0, 2 * np.pi, (seqlen + 3, half))
    c, s = torch.from_numpy(np.cos(angle)).float(), torch.from_numpy(np.sin(angle)).float()
    qkv = torch.from_numpy(rng.standard_normal((batch, seqlen, hq + 2 * hk, d), dtype=np.float32))
    want_q = apply_rotary_emb(qkv[:, :, :hq], c, s, interleaved, seqlen_offsets=3)
    want_k = apply_rotary_emb(qkv[:, :, hq:hq + hk], c, s, interleaved, seqlen_offsets=3)
    v = qkv[:, :, hq + hk:].clone()
    assert apply_rotary_emb_qkv_(qkv, c, s, interleaved=interleaved, seqlen_offsets=3,
                                 num_heads_q=hq) is qkv
    assert torch.equal(qkv[:, :, :hq], want_q) and torch.equal(qkv[:, :, hq:hq + hk], want_k)
    assert torch.equal(qkv[:, :, hq + hk:], v)
    kv = torch.from_numpy(rng.standard_normal((batch, seqlen, 2, hk, d), dtype=np.float32))
    want_k, v = apply_rotary_emb(kv[:, :, 0], c, s, interleaved), kv[:, :, 1].clone()
    assert apply_rotary_emb_kv_(kv, c, s, interleaved) is kv
    assert torch.equal(kv[:, :, 0], want_k) and torch.equal(kv[:, :, 1], v)
    x = torch.from_numpy(rng.standard_normal((batch, seqlen, hq, d), dtype=np.float32))
    np.testing.assert_allclose(apply_rotary_emb_torch(x, c[:seqlen], s[:seqlen], interleaved),
                               apply_rotary_emb(x, c, s, interleaved), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="kv must be"):
        apply_rotary_emb_kv_(kv[:, :, :1], c, s)
