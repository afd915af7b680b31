"""CPU: bad input raises an error that names the argument, before anything touches a GPU.

Arrays are described by cufa's own view type (pointer, shape, strides, dtype, device),
which the public functions accept as they accept framework arrays; so every check
runs here without a GPU.
"""
import re

import numpy as np
import pytest

import cufa
from cufa import _checks
from cufa._interop import DeviceArray


def arr(shape, dtype="float16", strides=None, device=0, ptr=0x7f0000000000, framework="cupy"):
    if strides is None:
        strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    itemsize = {"float16": 2, "bfloat16": 2, "float32": 4, "bool": 1, "int32": 4, "int64": 8,
                "float64": 8}[dtype]
    return DeviceArray(None, framework, ptr, tuple(shape), tuple(strides), dtype, device, itemsize)


def qkv(b=2, sq=33, sk=47, h=4, hk=2, d=64, dtype="float16"):
    return arr((b, sq, h, d), dtype), arr((b, sk, hk, d), dtype), arr((b, sk, hk, d), dtype)


q0, k0, v0 = qkv()

FLASH_CASES = [
    # (id, args, kwargs, exception, message fragment)
    ("q fp32", (arr((2, 33, 4, 64), "float32"), k0, v0), {}, TypeError, "q has dtype float32"),
    ("k dtype differs", (q0, arr((2, 47, 2, 64), "bfloat16"), v0), {}, TypeError,
     "k has dtype bfloat16 but q has float16"),
    ("v on another device", (q0, k0, arr((2, 47, 2, 64), device=1)), {}, ValueError,
     "v is on cuda:1 but q is on cuda:0"),
    ("q rank 3", (arr((33, 4, 64)), k0, v0), {}, ValueError, "q must be 4-D"),
    ("head dim 0", qkv(d=0), {}, ValueError, "q has head dim 0; cufa supports head dims from 1"),
    ("head dim 520", qkv(d=520), {}, ValueError, "head dim 520; cufa supports head dims from "
     "1 to 512"),
    ("head dim 264, v's own", (qkv(d=264)[0], qkv(d=264)[1], arr((2, 47, 2, 256))), {},
     ValueError, "above head dim 256 cufa needs equal key and value shapes"),
    ("k head dim differs", (q0, arr((2, 47, 2, 128)), arr((2, 47, 2, 128))), {}, ValueError,
     "k has head dim 128 but q has 64"),
    ("v length differs", (q0, k0, arr((2, 48, 2, 64))), {}, ValueError, "v has shape"),
    ("batch differs", (q0, arr((3, 47, 2, 64)), arr((3, 47, 2, 64))), {}, ValueError,
     "k has batch 3 but q has 2"),
    ("heads not divisible", qkv(h=6, hk=4), {}, ValueError, "q has 6 heads, not a multiple"),
    ("strided last dim", (arr((2, 33, 4, 64), strides=(33 * 4 * 128, 4 * 128, 128, 2)), k0, v0),
     {}, ValueError, "q must be contiguous in its last dimension"),
    ("dropout", (q0, k0, v0), dict(dropout_p=0.1), NotImplementedError, "dropout_p"),
    ("negative dropout", (q0, k0, v0), dict(dropout_p=-0.1), ValueError, "dropout_p"),
    ("attn probs with dropout", (q0, k0, v0), dict(return_attn_probs=True, dropout_p=0.1),
     NotImplementedError, "dropout_p"),
    ("scale zero", (q0, k0, v0), dict(softmax_scale=0.0), ValueError, "softmax_scale"),
    ("scale nan", (q0, k0, v0), dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    ("scale negative", (q0, k0, v0), dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
    ("window not a pair", (q0, k0, v0), dict(window_size=3), ValueError, "window_size"),
    ("window -2", (q0, k0, v0), dict(window_size=(-2, 0)), ValueError, "window_size left"),
    ("window float", (q0, k0, v0), dict(window_size=(1.5, 0)), ValueError, "window_size left"),
    ("softcap negative", (q0, k0, v0), dict(softcap=-1.0), ValueError, "softcap"),
    ("softcap inf", (q0, k0, v0), dict(softcap=float("inf")), ValueError, "softcap"),
    ("alibi fp16", (q0, k0, v0), dict(alibi_slopes=arr((4,), "float16")), TypeError,
     "alibi_slopes must be float32"),
    ("alibi shape", (q0, k0, v0), dict(alibi_slopes=arr((3,), "float32")), ValueError,
     "alibi_slopes must have shape (4,) or (2, 4)"),
    ("alibi device", (q0, k0, v0), dict(alibi_slopes=arr((4,), "float32", device=1)), ValueError,
     "alibi_slopes is on cuda:1"),
    ("out shape", (q0, k0, v0), dict(out=arr((2, 33, 4, 32))), ValueError, "out must have q's shape"),
    ("out dtype", (q0, k0, v0), dict(out=arr((2, 33, 4, 64), "bfloat16")), ValueError,
     "out must have q's shape"),
    ("out framework", (q0, k0, v0), dict(out=arr((2, 33, 4, 64), framework="torch")), TypeError,
     "out is a torch array but q is a cupy array"),
    ("q host numpy", (np.zeros((2, 33, 4, 64), np.float16), k0, v0), {}, TypeError,
     "cufa needs CUDA device arrays; got a CPU (NumPy) array for q"),
    ("v host numpy", (q0, k0, np.zeros((2, 47, 2, 64), np.float16)), {}, TypeError,
     "cufa needs CUDA device arrays; got a CPU (NumPy) array for v"),
    ("q a list", ([[1.0]], k0, v0), {}, TypeError, "q must be a CUDA array"),
    # flags and numbers as flash-attn takes them, nothing that merely reads as true
    ("causal a string", (q0, k0, v0), dict(causal="no"), TypeError, "causal must be a bool"),
    ("causal 2", (q0, k0, v0), dict(causal=2), TypeError, "causal must be a bool"),
    ("scale True", (q0, k0, v0), dict(softmax_scale=True), ValueError, "softmax_scale"),
    ("scale a string", (q0, k0, v0), dict(softmax_scale="0.1"), ValueError, "softmax_scale"),
    ("scale an array", (q0, k0, v0), dict(softmax_scale=np.ones(2)), ValueError,
     "softmax_scale"),
    ("scale a device scalar", (q0, k0, v0), dict(softmax_scale=arr((), "float32")), ValueError,
     "softmax_scale must be a finite number"),
    ("softcap True", (q0, k0, v0), dict(softcap=True), ValueError, "softcap"),
    ("dropout a string", (q0, k0, v0), dict(dropout_p="0"), ValueError, "dropout_p"),
    # out= whose elements share memory: each row would be written twice
    ("out expanded", (q0, k0, v0), dict(out=arr((2, 33, 4, 64), strides=(33 * 256, 0, 64, 1))),
     ValueError, "out is written, and its elements share memory"),
    ("out rows overlap", (q0, k0, v0), dict(out=arr((2, 33, 4, 64),
                                                    strides=(33 * 128, 128, 32, 1))),
     ValueError, "out is written, and its elements share memory"),
]


@pytest.mark.parametrize("case", FLASH_CASES, ids=[c[0] for c in FLASH_CASES])
def test_flash_attn_func_rejects(case):
    _, args, kwargs, exc, msg = case
    with pytest.raises(exc, match=msg.replace("(", r"\(").replace(")", r"\)")):
        cufa.flash_attn_func(*args, **kwargs)


def sdpa_qkv(b=2, h=4, hk=4, L=33, S=47, d=64):
    return arr((b, h, L, d)), arr((b, hk, S, d)), arr((b, hk, S, d))


SDPA_CASES = [
    ("gqa without enable_gqa", sdpa_qkv(hk=2), {}, ValueError, "pass enable_gqa=True"),
    ("value dim differs", (*sdpa_qkv()[:2], arr((2, 4, 47, 32))), {}, ValueError, "value has shape"),
    ("mask not broadcastable", sdpa_qkv(), dict(attn_mask=arr((33, 46), "bool")), ValueError,
     "attn_mask of shape (33, 46) is not broadcastable"),
    ("mask rank 5", sdpa_qkv(), dict(attn_mask=arr((1, 2, 4, 33, 47), "bool")), ValueError,
     "not broadcastable"),
    ("mask int32", sdpa_qkv(), dict(attn_mask=arr((33, 47), "int32")), TypeError,
     "attn_mask must be bool or float"),
    ("mask on another device", sdpa_qkv(), dict(attn_mask=arr((33, 47), "bool", device=1)),
     ValueError, "attn_mask is on cuda:1"),
    ("dropout", sdpa_qkv(), dict(dropout_p=0.5), NotImplementedError, "dropout_p"),
    ("scale nan", sdpa_qkv(), dict(scale=float("nan")), ValueError, "scale must be"),
    ("query rank 3", (arr((4, 33, 64)), *sdpa_qkv()[1:]), {}, ValueError, "query must be 4-D"),
]


@pytest.mark.parametrize("case", SDPA_CASES, ids=[c[0] for c in SDPA_CASES])
def test_sdpa_rejects(case):
    _, args, kwargs, exc, msg = case
    with pytest.raises(exc, match=msg.replace("(", r"\(").replace(")", r"\)")):
        cufa.scaled_dot_product_attention(*args, **kwargs)


HOST_CASES = [
    # (id, framework module, call on its CPU arrays -> raises, message)
    ("numpy kvcache", "numpy", lambda np_: cufa.flash_attn_with_kvcache(
        arr((2, 1, 4, 64)), np_.zeros((2, 64, 2, 64), np_.float16), arr((2, 64, 2, 64))),
     "got a CPU (NumPy) array for k_cache"),
    ("numpy merge", "numpy", lambda np_: cufa.merge_attention_states(
        q0, arr((2, 4, 33), "float32"), q0, np_.zeros((2, 4, 33), np_.float32)),
     "got a CPU (NumPy) array for lse_b"),
    ("torch", "torch", lambda torch: cufa.flash_attn_func(
        *(torch.zeros(2, 33, 4, 64, dtype=torch.float16) for _ in range(3))),
     "got a CPU (PyTorch) tensor for q"),
    ("torch varlen", "torch", lambda torch: cufa.flash_attn_varlen_func(
        arr((10, 4, 64)), arr((12, 2, 64)), arr((12, 2, 64)),
        torch.zeros(3, dtype=torch.int32), arr((3,), "int32"), 6, 7),
     "got a CPU (PyTorch) tensor for cu_seqlens_q"),
    ("jax", "jax.numpy", lambda jnp: cufa.flash_attn_func(
        *(jnp.zeros((2, 33, 4, 64), jnp.float16) for _ in range(3))),
     "got a CPU (JAX) array for q"),
    ("jax sdpa", "jax.numpy", lambda jnp: cufa.scaled_dot_product_attention(
        *(jnp.zeros((2, 4, 33, 64), jnp.float16) for _ in range(3))),
     "got a CPU (JAX) array for query"),
]


@pytest.mark.parametrize("case", HOST_CASES, ids=[c[0] for c in HOST_CASES])
def test_host_arrays_are_refused_naming_device_framework_and_argument(case):
    _, module, call, msg = case
    framework = pytest.importorskip(module)
    with pytest.raises(TypeError, match="cufa needs CUDA device arrays; " + re.escape(msg)):
        call(framework)


def test_import_is_light():
    import subprocess
    import sys
    code = "import sys, cufa; print(sorted(m for m in ('torch', 'jax', 'cupy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


VARLEN_CASES = [
    ("q 4-D", dict(q=arr((1, 10, 2, 64))), ValueError, "q must be 3-D"),
    ("cu int64", dict(cu_seqlens_q=arr((3,), "int64")), TypeError, "cu_seqlens_q must be int32"),
    ("cu 2-D", dict(cu_seqlens_k=arr((1, 3), "int32")), ValueError, "cu_seqlens_k must be 1-D"),
    ("cu lengths differ", dict(cu_seqlens_k=arr((4,), "int32")), ValueError,
     "cu_seqlens_k has 4 entries but cu_seqlens_q has 3"),
    ("cu other device", dict(cu_seqlens_q=arr((3,), "int32", device=1)), ValueError,
     "cu_seqlens_q is on cuda:1"),
    ("seqused float", dict(seqused_k=arr((2,), "float32")), TypeError, "seqused_k must be int32"),
    ("seqused shape", dict(seqused_k=arr((3,), "int32")), ValueError, "seqused_k must be (2,)"),
    ("max_seqlen negative", dict(max_seqlen_q=-1), ValueError, "max_seqlen_q must be an int"),
    ("alibi batch", dict(alibi_slopes=arr((3, 4), "float32")), ValueError,
     "alibi_slopes must have shape (4,) or (2, 4)"),
    ("k head dim", dict(k=arr((12, 2, 32)), v=arr((12, 2, 32))), ValueError,
     "k has head dim 32 but q has 64"),
]


@pytest.mark.parametrize("case", VARLEN_CASES, ids=[c[0] for c in VARLEN_CASES])
def test_flash_attn_varlen_func_rejects(case):
    _, changes, exc, msg = case
    kw = dict(q=arr((10, 4, 64)), k=arr((12, 2, 64)), v=arr((12, 2, 64)),
              cu_seqlens_q=arr((3,), "int32"), cu_seqlens_k=arr((3,), "int32"),
              max_seqlen_q=6, max_seqlen_k=7)
    kw.update(changes)
    with pytest.raises(exc, match=msg.replace("(", r"\(").replace(")", r"\)")):
        cufa.flash_attn_varlen_func(**kw)


# learnable_sink on every entry point (4 query heads): (id, sink, exception, message)
SINK_CASES = [
    ("int32", arr((4,), "int32"), TypeError,
     "learnable_sink must be float32, float16 or bfloat16; got int32"),
    ("float64", arr((4,), "float64"), TypeError, "learnable_sink must be float32"),
    ("too short", arr((3,), "float32"), ValueError,
     "learnable_sink must have shape (4,), one logit a query head"),
    ("2-D", arr((1, 4), "float32"), ValueError, "learnable_sink must have shape (4,)"),
    ("per KV head", arr((2,), "bfloat16"), ValueError, "learnable_sink must have shape (4,)"),
    ("strided", arr((4,), "float32", strides=(2,)), ValueError,
     "learnable_sink must be contiguous; got stride 2"),
    ("misaligned", arr((4,), "float32", ptr=0x7f0000000002), ValueError,
     "learnable_sink must start at a multiple of its 4-byte elements"),
    ("other device", arr((4,), "float16", device=1), ValueError,
     "learnable_sink is on cuda:1 but (q|query) is on cuda:0"),
    ("host", np.zeros(4, np.float32), TypeError,
     "cufa needs CUDA device arrays; got a CPU (NumPy) array for learnable_sink"),
]
SINK_CALLS = {
    "flash_attn_func": lambda sink: cufa.flash_attn_func(*qkv(), learnable_sink=sink),
    "varlen": lambda sink: cufa.flash_attn_varlen_func(
        arr((10, 4, 64)), arr((12, 2, 64)), arr((12, 2, 64)), arr((3,), "int32"),
        arr((3,), "int32"), 6, 7, learnable_sink=sink),
    "paged varlen": lambda sink: cufa.flash_attn_varlen_func(
        arr((10, 4, 64)), arr((8, 16, 2, 64)), arr((8, 16, 2, 64)), arr((3,), "int32"),
        arr((3,), "int32"), 6, 7, block_table=arr((2, 4), "int32"), learnable_sink=sink),
    "kvcache": lambda sink: cufa.flash_attn_with_kvcache(
        arr((2, 1, 4, 64)), arr((2, 64, 2, 64)), arr((2, 64, 2, 64)), num_splits=3,
        learnable_sink=sink),
    "sdpa": lambda sink: cufa.scaled_dot_product_attention(*sdpa_qkv(hk=2), enable_gqa=True,
                                                           learnable_sink=sink),
}


@pytest.mark.parametrize("entry", list(SINK_CALLS))
@pytest.mark.parametrize("case", SINK_CASES, ids=[c[0] for c in SINK_CASES])
def test_learnable_sink_rejects(case, entry):
    _, sink, exc, msg = case
    with pytest.raises(exc, match=msg.replace("(", r"\(").replace(")", r"\)").replace(
            r"\(q|query\)", "(q|query)")):
        SINK_CALLS[entry](sink)


@pytest.mark.parametrize("entry", list(SINK_CALLS))
def test_a_sink_that_requires_grad_is_refused_while_autograd_records(entry):
    """Functions without a backward pass refuse a sink whose gradient autograd would want,
    naming it; flash_attn_func and flash_attn_varlen_func take it (autograd gets its
    gradient), and so does scaled_dot_product_attention. Under no_grad or inference_mode the parameter is taken as it is (detached).
    Either way the checks go on (here: it lives on the host)."""
    torch = pytest.importorskip("torch")
    sink = torch.nn.Parameter(torch.zeros(4))
    on_host = r"got a CPU \(PyTorch\) tensor for learnable_sink"
    if entry in ("flash_attn_func", "varlen", "paged varlen", "sdpa"):
        with pytest.raises(TypeError, match=on_host):
            SINK_CALLS[entry](sink)
    else:
        with pytest.raises(NotImplementedError, match="learnable_sink requires grad, but this "
                                                      "cufa function has no backward pass"):
            SINK_CALLS[entry](sink)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode(), pytest.raises(TypeError, match=on_host):
            SINK_CALLS[entry](sink)


def test_host_numbers_of_any_kind_are_taken():
    """softmax_scale, softcap and dropout_p as NumPy numbers or 0-d CPU arrays (1 /
    np.sqrt(d) is a np.float64; np.float32 arithmetic gives np.float32), and flags as NumPy
    bools or the ints 0 and 1: what they are worth, as Python floats and bools."""
    for scale in (np.float32(0.125), np.float64(0.125), np.array(0.125), 1 / np.sqrt(64)):
        assert _checks.check_scale(scale, "softmax_scale") == 0.125
        assert type(_checks.check_scale(scale, "softmax_scale")) is float
    assert _checks.check_softcap(np.float32(50)) == 50.0
    _checks.reject_unsupported(np.float32(0))
    for flag, want in ((np.bool_(True), True), (1, True), (0, False), (np.int32(1), True)):
        assert _checks.check_flag(flag, "causal") is want
    assert _checks.check_options(None, np.bool_(True), _checks.NO_WINDOW, 0.0) == (
        _checks.check_options(None, True, _checks.NO_WINDOW, 0.0))


@pytest.mark.parametrize("causal", [False, True])
def test_default_options_skip_the_checks_but_mean_what_the_checked_ones_do(causal):
    default = _checks.check_options(None, causal, _checks.NO_WINDOW, 0.0)  # the fast path
    assert default == _checks.check_options(None, causal, [-1, -1], 0.0)  # not the default object
    assert default == _checks.check_options(None, causal, (-1, -1), 0) == (
        (_checks.UNBOUNDED, 0 if causal else _checks.UNBOUNDED), None, 0.0)
    # value-equal to the default, but refused: only the default object skips the checks
    for window in ((-1.0, -1), (-1, -1.0), (True, -1)):
        with pytest.raises(ValueError, match="window_size"):
            _checks.check_options(None, causal, window, 0.0)
    with pytest.raises(ValueError, match="softcap"):
        _checks.check_options(None, causal, _checks.NO_WINDOW, -0.5)
    with pytest.raises(ValueError, match="softmax_scale"):
        _checks.check_options(0.0, causal, _checks.NO_WINDOW, 0.0)


def test_arrays_off_their_element_size_are_refused():
    """A CuPy or DLPack array can start or step at any byte; a kernel reading whole
    elements there would fault at launch, so the view refuses it, naming the argument."""
    from cufa import _interop
    _interop.check_element_aligned(0x1000, (128, 2), (4, 64), 2, "q")
    _interop.check_element_aligned(0x1001, (1,), (5,), 1, "k_cache")  # (bytes: any address)
    _interop.check_element_aligned(0x1000, (6, 4), (1, 3), 4, "lens")  # (a dim of one: unused)
    with pytest.raises(ValueError, match=r"cu_seqlens_q starts or steps off its 4-byte "
                                         r"elements \(address 0x1002"):
        _interop.check_element_aligned(0x1002, (4,), (3,), 4, "cu_seqlens_q")
    with pytest.raises(ValueError, match="q starts or steps off its 2-byte elements"):
        _interop.check_element_aligned(0x1000, (129, 2), (4, 64), 2, "q")


def test_arrays_of_two_frameworks_are_refused():
    """cufa launches on q's framework's stream (torch's current one, or CuPy's, which DLPack
    imports are ordered on): a torch k beside a CuPy q, or the reverse, would be read while
    its own framework's work on it may still be queued."""
    q, k, v = qkv()
    torch_k = arr(k.shape, framework="torch")
    with pytest.raises(TypeError, match="k is a torch array but q is a cupy array: pass "
                                        "arrays of one framework"):
        cufa.flash_attn_func(q, torch_k, v)
    with pytest.raises(TypeError, match="v is a cupy array but q is a torch array"):
        cufa.flash_attn_func(arr(q.shape, framework="torch"), torch_k, v)
    dlpack_k = arr(k.shape, framework="dlpack")  # (JAX's, imported on CuPy's stream: fine)
    try:
        cufa.flash_attn_func(q, dlpack_k, v)
    except Exception as e:  # (no GPU here: whatever fails, it is past the framework check)
        assert "one framework" not in str(e)


def test_jax_outputs_are_handed_over_once_the_stream_is_done(monkeypatch):
    """to_jax: CuPy's stream on the output's device is synchronized before JAX imports it
    (the caller may free the DLPack-imported inputs once the call returns, and JAX reuses
    memory on its own stream)."""
    jax_dlpack = pytest.importorskip("jax.dlpack")
    import contextlib

    import cupy
    from cufa import _interop
    order = []

    class Stream:
        def synchronize(self):
            order.append("synchronize")
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda *a: Stream())
    monkeypatch.setattr(jax_dlpack, "from_dlpack", lambda x: order.append("import") or "jax")
    native = type("Native", (), {"device": contextlib.nullcontext()})()
    assert _interop.to_jax(native) == ["jax"] and order == ["synchronize", "import"]
