"""GPU, two devices or more: arrays on cuda:1 while cuda:0 is current (the usual state of a
process that serves or trains on several GPUs), calls on both devices in turn with one
signature (plans, kernels, stream buffers and TMA maps are per device), two threads each
on its own device, a CUDA graph captured on cuda:1, CuPy and JAX arrays on the second
device. Every output against the float64 reference under the per-row pass rule, and bit
for bit against the same call on cuda:0 (the same card, the same kernels). Skipped with
fewer than two devices."""
import threading

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import cufa  # noqa: E402
from cufa import reference  # noqa: E402
from _attention_check import (  # noqa: E402
    capture_cuda_graph, check_attention, check_kvcache, cu_seqlens, i32, randn)
from _backward_check import check_grads  # noqa: E402

if torch.cuda.device_count() < 2:
    pytest.skip("fewer than two CUDA devices", allow_module_level=True)

DEV = torch.device("cuda", 1)


@pytest.fixture(autouse=True)
def device_zero_current():
    """Each test starts with cuda:0 current (conftest's _cuda0_current), and must leave it
    so: a call on cuda:1 may not move the caller's current device."""
    yield
    assert torch.cuda.current_device() == 0, "a call left another device current"


def on(dev, *xs):
    return [None if x is None else x.to(dev) for x in xs]


def bits_equal(a, b, label):
    assert a.device != b.device
    assert torch.equal(a.cpu().view(torch.uint8) if a.element_size() == 1 else a.cpu(),
                       b.cpu().view(torch.uint8) if b.element_size() == 1 else b.cpu()), \
        f"{label}: cuda:1's result differs from cuda:0's"


@pytest.mark.parametrize("d,causal,heads,seqlen", [
    (64, True, (4, 4), 333), (128, False, (8, 2), 1000), (128, True, (8, 2), 1000),
    (256, True, (4, 1), 257), (96, False, (3, 3), 77)])
def test_dense_on_the_second_device(d, causal, heads, seqlen):
    rng = np.random.default_rng(d + seqlen)
    h, hk = heads
    q = randn(rng, (2, seqlen, h, d), "bfloat16")
    k, v = (randn(rng, (2, seqlen + 5, hk, d), "bfloat16") for _ in range(2))
    out1 = torch.full_like(q.to(DEV), float("nan"))
    res, lse1 = cufa.flash_attn_func(*on(DEV, q, k, v), causal=causal, return_lse=True, out=out1)
    assert res.data_ptr() == out1.data_ptr() and lse1.device == DEV
    alloc1 = cufa.flash_attn_func(*on(DEV, q, k, v), causal=causal)
    assert alloc1.device == DEV
    torch.cuda.synchronize(DEV)
    check_attention(out1, lse1, q, k, v, label=f"d={d} on cuda:1", causal=causal)
    out0, lse0 = cufa.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    bits_equal(out1, out0, "out")
    bits_equal(lse1, lse0, "lse")
    bits_equal(alloc1, out0, "allocated out")


def test_devices_in_turn_with_one_signature():
    """The same shapes on cuda:0, cuda:1, cuda:0, ...: each call with its own data, so a
    plan, kernel handle or buffer of the other device would show as a fault or as the
    other device's values."""
    rng = np.random.default_rng(7)
    shape, kv = (1, 700, 8, 128), (1, 700, 2, 128)
    calls = []
    for turn in range(6):
        dev = torch.device("cuda", turn % 2)
        q = randn(rng, shape, "float16").to(dev)
        k, v = (randn(rng, kv, "float16").to(dev) for _ in range(2))
        calls.append((q, k, v, cufa.flash_attn_func(q, k, v, causal=True, return_lse=True)))
    for turn, (q, k, v, (out, lse)) in enumerate(calls):
        assert out.device == q.device
        check_attention(out, lse, q, k, v, label=f"turn {turn} on {q.device}", causal=True)


def test_packed_batch_on_the_second_device():
    rng = np.random.default_rng(11)
    lens = [1, 190, 0, 513, 64]
    total, d = sum(lens), 128
    q = randn(rng, (1, total, 8, d), "float16")[0]
    k, v = (randn(rng, (1, total, 4, d), "float16")[0] for _ in range(2))
    cu = cu_seqlens(lens)
    out1, lse1 = cufa.flash_attn_varlen_func(*on(DEV, q, k, v, cu, cu), max(lens), max(lens),
                                             causal=True, return_lse=True)
    torch.cuda.synchronize(DEV)
    assert out1.device == DEV
    starts = np.concatenate([[0], np.cumsum(lens)])
    for i, n in enumerate(lens):
        if n == 0:
            continue
        rows = slice(int(starts[i]), int(starts[i + 1]))
        check_attention(out1[rows][None], lse1[:, rows][None], q[rows][None], k[rows][None],
                        v[rows][None], label=f"sequence {i} ({n} rows)", causal=True)
    out0, lse0 = cufa.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens),
                                             causal=True, return_lse=True)
    bits_equal(out1, out0, "packed out")


@pytest.mark.parametrize("cache", ["float16", "float8_e4m3fn"])
def test_paged_decode_with_splits_and_append_on_the_second_device(cache):
    """A decode step with split keys (the per-stream workspace and the merge) and an append
    into a paged cache, on cuda:1."""
    if cache == "float8_e4m3fn" and not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this PyTorch has no float8_e4m3fn")
    rng = np.random.default_rng(13)
    batch, capacity, page, d, (h, hk) = 3, 2048, 16, 128, (16, 2)
    lens = [1500, 7, 2000]
    q = randn(rng, (batch, 1, h, d), "float16")
    k_new, v_new = (randn(rng, (batch, 1, hk, d), "float16", scale=0.5) for _ in range(2))
    k_cache, v_cache = (randn(rng, (batch, capacity, hk, d), "float16") for _ in range(2))
    extra = {}
    if cache != "float16":
        e4m3 = getattr(torch, cache)
        k_cache, v_cache = (c.float().clamp(-448, 448).to(e4m3) for c in (k_cache, v_cache))
        extra = {n: torch.from_numpy(rng.uniform(0.05, 0.5, (batch, hk)).astype(np.float32)).cuda()
                 for n in ("k_descale", "v_descale")}
    table, num_pages = reference.paged_layout(batch, capacity, page, rng)
    as_bytes = (lambda c: c.view(torch.uint8) if c.element_size() == 1 else c)
    k_cache, v_cache = (reference.to_paged(as_bytes(c), table, num_pages, fill=0).view(c.dtype)
                        for c in (k_cache, v_cache))
    kw = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k_new, v=v_new, cache_seqlens=i32(lens),
              block_table=i32(table), **extra)
    before = {n: x.clone() for n, x in kw.items()}
    on1 = {n: x.to(DEV) for n, x in kw.items()}
    out1, lse1 = cufa.flash_attn_with_kvcache(**on1, num_splits=8, return_softmax_lse=True)
    torch.cuda.synchronize(DEV)
    assert out1.device == DEV
    check_kvcache(out1, lse1, before["q"], before["k_cache"], before["v_cache"], k_new, v_new,
                  label=f"{cache} cache on cuda:1", cache_seqlens=before["cache_seqlens"],
                  block_table=before["block_table"], **extra)
    out0, lse0 = cufa.flash_attn_with_kvcache(**kw, num_splits=8, return_softmax_lse=True)
    bits_equal(out1, out0, "decode out")
    bits_equal(on1["k_cache"], kw["k_cache"], "appended k_cache")
    bits_equal(on1["v_cache"], kw["v_cache"], "appended v_cache")


def test_fp8_forward_on_the_second_device():
    """The fp8 forward on cuda:1 (its V^T pre-pass and workspace on that device too)."""
    from cufa import _compile, _runtime
    if not hasattr(torch, "float8_e4m3fn") or _compile.family_for(
            _runtime.compute_capability(1)) != "sm90":  # CUFA_KERNEL_FAMILY=sm80 has none
        pytest.skip("the fp8 forward runs on Hopper's kernels with float8_e4m3fn")
    import math
    from test_gpu_fp8_forward import _fp8_case, assert_fp8_rows, assert_no_scale_bug
    (q, k, v), descales, (qf, kf, vf) = _fp8_case()
    o1, lse1 = cufa.flash_attn_func(*on(DEV, q, k, v), causal=True, return_lse=True,
                                    **dict(zip(("q_descale", "k_descale", "v_descale"),
                                               on(DEV, *descales))))
    torch.cuda.synchronize(DEV)
    assert o1.device == DEV and o1.dtype == torch.bfloat16
    assert_no_scale_bug(*assert_fp8_rows(
        o1.float().cpu().numpy().astype(np.float64), lse1.cpu().numpy().astype(np.float64),
        qf, kf, vf, True, (-1, -1), 1.0 / math.sqrt(q.shape[-1]), torch.bfloat16))
    o0 = cufa.flash_attn_func(q, k, v, causal=True, **dict(zip(
        ("q_descale", "k_descale", "v_descale"), descales)))
    bits_equal(o1, o0, "fp8 out")


@pytest.mark.parametrize("batch,seqlen", [(2, 300), (1, 2100)])  # (2k+ causal: dq fused)
def test_backward_on_the_second_device(batch, seqlen):
    rng = np.random.default_rng(17 + seqlen)
    q = randn(rng, (batch, seqlen, 4, 64), "bfloat16")
    k, v = (randn(rng, (batch, seqlen, 2, 64), "bfloat16") for _ in range(2))
    dout = randn(rng, (batch, seqlen, 4, 64), "bfloat16")
    leaves = [x.to(DEV).requires_grad_() for x in (q, k, v)]
    out = cufa.flash_attn_func(*leaves, causal=True)
    out.backward(dout.to(DEV))
    torch.cuda.synchronize(DEV)
    grads = [x.grad for x in leaves]
    assert all(g.device == DEV for g in grads)
    # (the out the backward read: D = rowsum(dout * out) comes from it)
    check_grads(grads, q, k, v, dout, "backward on cuda:1", out=out, causal=True)
    # deterministic=True on both devices: the same bits (the default may add dq's sums
    # in any order)
    pair = []
    for dev in (DEV, q.device):
        leaves = [x.detach().clone().to(dev).requires_grad_() for x in (q, k, v)]
        cufa.flash_attn_func(*leaves, causal=True, deterministic=True).backward(dout.to(dev))
        pair.append([x.grad for x in leaves])
    for name, g1, g0 in zip(("dq", "dk", "dv"), *pair):
        bits_equal(g1, g0, name)


def test_two_threads_each_on_its_own_device():
    """Each thread runs calls on its own device, concurrently, on its device's current
    stream; the plans and compiled kernels are shared, the launches must not be."""
    rng = np.random.default_rng(19)
    inputs = {i: [randn(rng, (2, 400, 8, 128), "float16").to(f"cuda:{i}") for _ in range(3)]
              for i in (0, 1)}
    results, errors = {}, []

    def work(i):
        try:
            torch.cuda.set_device(i)
            q, k, v = inputs[i]
            outs = [cufa.flash_attn_func(q, k, v, causal=bool(r % 2)) for r in range(20)]
            torch.cuda.synchronize(i)
            results[i] = outs
        except Exception as e:  # reported below, in the test's thread
            errors.append((i, e))

    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in (0, 1):
        q, k, v = inputs[i]
        for causal in (False, True):
            out = results[i][int(causal)]
            assert out.device == q.device
            check_attention(out, None, q, k, v, label=f"thread on cuda:{i}", causal=causal)
            assert all(torch.equal(o, out) for o in results[i][int(causal)::2])


def test_cuda_graph_captured_on_the_second_device():
    rng = np.random.default_rng(23)
    batch, capacity, d, (h, hk) = 2, 1024, 64, (8, 8)
    q = randn(rng, (batch, 1, h, d), "float16").to(DEV)
    k_cache, v_cache = (randn(rng, (batch, capacity, hk, d), "float16").to(DEV) for _ in range(2))
    seqlens = torch.tensor([5, 900], dtype=torch.int32, device=DEV)
    call = (lambda: cufa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens))
    with torch.cuda.device(DEV):
        # (a capture stream of cuda:1's own: torch.cuda.graph's default one is made once a
        # process, on the device current at its first capture)
        graph, out = capture_cuda_graph(call, torch.cuda.Stream(DEV))
        for lens in ([700, 1], [1024, 333]):
            seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
            q.copy_(randn(rng, tuple(q.shape), "float16").to(DEV))
            graph.replay()
            torch.cuda.synchronize(DEV)
            check_kvcache(out, None, q, k_cache, v_cache, label=f"replay {lens} on cuda:1",
                          cache_seqlens=seqlens)


def test_cupy_arrays_on_the_second_device():
    cupy = pytest.importorskip("cupy")
    rng = np.random.default_rng(29)
    q = randn(rng, (2, 130, 4, 64), "float16")
    k, v = (randn(rng, (2, 150, 2, 64), "float16") for _ in range(2))
    with cupy.cuda.Device(1):
        arrays = [cupy.from_dlpack(x.to(DEV)) for x in (q, k, v)]
        out, lse = cufa.flash_attn_func(*arrays, causal=True, return_lse=True)
        assert isinstance(out, cupy.ndarray) and out.device.id == 1 and lse.device.id == 1
        cupy.cuda.get_current_stream().synchronize()
    # and with cuda:0 current in CuPy: the arrays say where they live
    out_b = cufa.flash_attn_func(*arrays, causal=True)
    assert out_b.device.id == 1
    with cupy.cuda.Device(1):
        cupy.cuda.get_current_stream().synchronize()
    check_attention(torch.from_dlpack(out), torch.from_dlpack(lse), q, k, v, causal=True)
    check_attention(torch.from_dlpack(out_b), None, q, k, v, label="cuda:0 current", causal=True)


def test_jax_arrays_on_the_second_device():
    jax = pytest.importorskip("jax")
    gpus = [dv for dv in jax.devices() if dv.platform == "gpu"]
    if len(gpus) < 2:
        pytest.skip("JAX sees fewer than two GPUs")
    import jax.numpy as jnp
    rng = np.random.default_rng(31)
    host = [rng.standard_normal((2, 200, 4, 64)).astype(np.float32) for _ in range(3)]
    q, k, v = (jax.device_put(jnp.asarray(x, jnp.bfloat16), gpus[1]) for x in host)
    eager, lse = cufa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    jitted = jax.jit(lambda a, b, c: cufa.flash_attn_func(a, b, c, causal=True))(q, k, v)
    for x in (eager, lse, jitted):
        assert x.devices() == {gpus[1]}
    to_t = (lambda a: torch.from_dlpack(a))
    check_attention(to_t(eager), to_t(lse), to_t(q), to_t(k), to_t(v), causal=True)
    check_attention(to_t(jitted), None, to_t(q), to_t(k), to_t(v), label="jit", causal=True)


@pytest.fixture
def hf_devices(monkeypatch):
    """cufa registered as transformers' attention; the (entry point, q's device) of each
    call the integration makes."""
    pytest.importorskip("transformers")
    import cufa.integrations.transformers as hf
    hf.register()
    seen = set()

    class Spy:
        def __getattr__(self, name):
            fn = getattr(cufa, name)

            def call(*args, **kwargs):
                seen.add((name, str((args[0] if args else kwargs["q"]).device)))
                return fn(*args, **kwargs)
            return call
    monkeypatch.setattr(hf, "_kernels", Spy())
    return seen


@pytest.mark.parametrize("family,batch_kind,like_accelerate", [
    ("llama", "left", False), ("llama", "left", True), ("llama", "left_short", False),
    ("mistral", "packed", False), ("gemma2", "right", True), ("qwen2", "none", False)])
def test_transformers_model_split_over_two_devices(hf_devices, family, batch_kind,
                                                   like_accelerate):
    """A tiny model's second layer on cuda:1 (device_map's split): the mask, made once on
    cuda:0, reaches that layer's kernels on cuda:1 (moved by the layer, or by the hooks
    through its .to(), as accelerate's)."""
    import _transformers_check as tc
    tc.check_prefill(family, torch.bfloat16, "cuda", batch_kind, label="split over 2 GPUs: ",
                     prepare=tc.split_layers(DEV, like_accelerate=like_accelerate))
    assert {device for _, device in hf_devices} == {"cuda:0", "cuda:1"}, hf_devices


def test_transformers_generation_split_over_two_devices(hf_devices):
    import _transformers_check as tc
    tc.check_generation("llama", torch.bfloat16, "cuda", new_tokens=8,
                        label="split over 2 GPUs: ", prepare=tc.split_layers(DEV))
    assert ("flash_attn_with_kvcache", "cuda:1") in hf_devices, hf_devices
