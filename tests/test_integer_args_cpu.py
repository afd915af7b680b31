"""CPU: sizes and windows take any integer held on the host, as flash-attn does (Python
ints, NumPy integers, 0-d integer CPU tensors and arrays, a window given as a 2-element
tensor), and reach the kernels' params exactly as the Python ints would; device scalars
and bools are refused, naming the argument, without reading the device. And
return_attn_probs=True returns flash-attn's (out, lse, S_dmask), eagerly, under jax.jit
and under torch.compile. Launches go to test_launch_path_cpu's recorder."""
import numpy as np
import pytest

import cufa
from cufa import _interop, _params, _runtime
from test_launch_path_cpu import device, record, view  # noqa: F401 (device: a fixture)

torch = pytest.importorskip("torch")


class DeviceScalar:
    """A 0-d array on a CUDA device (as DLPack reports it) that fails the test if anything
    reads its value or its repr: refusing it must not wait for the device."""
    dtype = "int32"
    ndim = 0

    def __dlpack_device__(self):
        return (2, 0)

    def __index__(self):
        raise AssertionError("a device scalar was read")

    __int__ = __index__

    def __repr__(self):
        raise AssertionError("a device scalar was printed")


def _without_outputs(launch, fields=_params.FWD):
    """A launch's params record less the addresses of the outputs (new every call)."""
    r = record(launch, fields).copy()
    for name in ("o", "lse"):
        r[name] = 0
    return r.tobytes()


def _host_integers(n):
    """n as every host integer flash-attn accepts."""
    return [n, np.int64(n), np.int32(n), np.array(n), torch.tensor(n),
            torch.tensor(n, dtype=torch.int32)]


@pytest.mark.parametrize("left", _host_integers(5), ids=repr)
def test_window_entries_reach_the_params_as_ints(device, left):
    q, k = view((2, 100, 4, 64)), view((2, 130, 2, 64))
    cufa.flash_attn_func(q, k, k, window_size=(5, 0))
    expected = _without_outputs(device.launches[-1])
    cufa.flash_attn_func(q, k, k, window_size=(left, torch.tensor(0)))
    got = record(device.launches[-1])
    assert (got["window_left"], got["window_right"]) == (5, 0)
    assert _without_outputs(device.launches[-1]) == expected
    assert len(_runtime.plans) == 1  # the same plan: its key holds the ints


@pytest.mark.parametrize("window", [torch.tensor([7, 3]), np.array([7, 3]), [7, 3]],
                         ids=["tensor", "ndarray", "list"])
def test_window_as_one_array_of_two(device, window):
    # flash-attn's own tests pass torch.randint(0, seqlen_k, (2,))
    q, k = view((1, 40, 2, 32)), view((1, 50, 2, 32))
    cufa.flash_attn_func(q, k, k, window_size=window)
    r = record(device.launches[-1])
    assert (r["window_left"], r["window_right"]) == (7, 3)


def test_varlen_sizes_and_window_take_host_integers(device):
    q, k = view((10, 4, 64)), view((12, 2, 64))
    cu = view((3,), "int32")
    cufa.flash_attn_varlen_func(q, k, k, cu, cu, 6, 7, window_size=(2, 1))
    expected = _without_outputs(device.launches[-1])
    for n in (np.int64(6), torch.tensor(6), np.array(6)):
        cufa.flash_attn_varlen_func(q, k, k, cu, cu, n, n,
                                    window_size=(np.int32(2), torch.tensor(1)))
        assert _without_outputs(device.launches[-1]) == expected


def test_kvcache_cache_seqlens_and_num_splits_take_host_integers(device):
    q, cache = view((2, 1, 8, 64)), view((2, 300, 2, 64))
    cufa.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=123, num_splits=3)
    expected = _without_outputs(device.launches[-1], _params.DECODE)
    r = record(device.launches[-1], _params.DECODE)
    assert r["cache_seqlen_fixed"] == 123 and r["num_splits"] == 3
    for n, splits in ((np.int64(123), np.int32(3)), (torch.tensor(123), torch.tensor(3)),
                      (np.array(123), np.array(3)),
                      (torch.tensor(123, dtype=torch.int32), 3)):
        cufa.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=n, num_splits=splits)
        assert _without_outputs(device.launches[-1], _params.DECODE) == expected


def _calls(arg):
    """Each integer argument of the entry points, given `arg`, as (name, call)."""
    q, k = view((2, 30, 4, 64)), view((2, 40, 2, 64))
    qp, kp, cu = view((10, 4, 64)), view((12, 2, 64)), view((3,), "int32")
    q1, cache = view((2, 1, 4, 64)), view((2, 300, 2, 64))
    return [
        ("window_size left", lambda: cufa.flash_attn_func(q, k, k, window_size=(arg, -1))),
        ("window_size right", lambda: cufa.flash_attn_func(q, k, k, window_size=(3, arg))),
        ("max_seqlen_q", lambda: cufa.flash_attn_varlen_func(qp, kp, kp, cu, cu, arg, 7)),
        ("max_seqlen_k", lambda: cufa.flash_attn_varlen_func(qp, kp, kp, cu, cu, 6, arg)),
        ("cache_seqlens", lambda: cufa.flash_attn_with_kvcache(q1, cache, cache,
                                                                cache_seqlens=arg)),
        ("num_splits", lambda: cufa.flash_attn_with_kvcache(q1, cache, cache, num_splits=arg)),
    ]


@pytest.mark.parametrize("index", range(6))
def test_device_scalars_are_refused_without_being_read(device, index):
    name, call = _calls(DeviceScalar())[index]
    with pytest.raises(ValueError, match=f"{name} is a .*CUDA.* Python int or a CPU tensor"):
        call()
    assert device.launches == []
    meta = torch.tensor(3, device="meta")  # a torch tensor off the host
    name, call = _calls(meta)[index]
    with pytest.raises(ValueError, match=f"{name} is a PyTorch tensor on META"):
        call()


@pytest.mark.parametrize("index", range(6))
@pytest.mark.parametrize("bad", [True, np.True_, torch.tensor(True), 2.0, torch.tensor(2.0),
                                 np.array([1, 2]), "3"], ids=repr)
def test_bools_floats_and_non_scalars_are_refused(device, index, bad):
    name, call = _calls(bad)[index]
    # (cache_seqlens may also be an array: a float, string or 2-element host array is then
    # refused as an array, by type)
    expected = (ValueError, TypeError) if name == "cache_seqlens" else ValueError
    with pytest.raises(expected, match=name):
        call()
    assert device.launches == []


# -- return_attn_probs -----------------------------------------------------------------------

@pytest.fixture
def numpy_outputs(device, monkeypatch):
    """The recorder, with outputs that are NumPy arrays (so that their values can be seen)."""
    def allocate(framework, shape, dtype, device_, stream, like=None):
        a = np.full(shape, 7, dtype=dtype)
        return a, a.ctypes.data
    monkeypatch.setattr(_interop, "allocate", allocate)
    return device


def test_return_attn_probs_gives_out_lse_and_an_empty_s_dmask(numpy_outputs):
    q, k = view((2, 100, 4, 64)), view((2, 130, 2, 64))
    out, lse, s = cufa.flash_attn_func(q, k, k, return_attn_probs=True)
    r = record(numpy_outputs.launches[-1])
    assert (r["o"], r["lse"]) == (out.ctypes.data, lse.ctypes.data)  # the launch wrote both
    assert out.shape == (2, 100, 4, 64) and lse.shape == (2, 4, 100) and lse.dtype == np.float32
    assert s.shape == (0,) and s.dtype == np.float16 and type(s) is np.ndarray
    # return_lse alongside changes nothing
    assert len(cufa.flash_attn_func(q, k, k, return_attn_probs=True, return_lse=True)) == 3

    qp, kp, cu = view((10, 4, 64)), view((12, 2, 64)), view((3,), "int32")
    out, lse, s = cufa.flash_attn_varlen_func(qp, kp, kp, cu, cu, 6, 7, return_attn_probs=True)
    assert out.shape == (10, 4, 64) and lse.shape == (4, 10) and s.shape == (0,)


def test_return_attn_probs_with_dropout_still_refused(device):
    q = view((1, 8, 2, 64))
    with pytest.raises(NotImplementedError, match="dropout_p"):
        cufa.flash_attn_func(q, q, q, 0.1, return_attn_probs=True)


def test_empty_of_keeps_framework_dtype_and_device():
    t = torch.empty(3, 5, 2, 8, dtype=torch.bfloat16, device="meta")
    e = _interop.empty_of(t)
    assert e.shape == (0,) and e.dtype == torch.bfloat16 and e.device == t.device
    assert e._base is None  # its own tensor, not a view of out
    a = np.empty((4, 2, 8), np.float16)[:, :, ::2]  # strided: still no copy
    assert _interop.empty_of(a).shape == (0,) and _interop.empty_of(a).dtype == np.float16


def test_return_attn_probs_and_tensor_windows_under_torch_compile():
    import torch._dynamo

    from cufa import _torch_ops
    _torch_ops.register_if_torch_loaded()
    q = torch.empty(2, 64, 4, 32, dtype=torch.float16, device="meta")
    for window, breaks in (((8, -1), 0), ((np.int64(8), -1), 1), ((torch.tensor(8), -1), 1)):
        def f(q):
            out, lse, s = cufa.flash_attn_func(q, q, q, window_size=window,
                                               return_attn_probs=True)
            assert out.shape == q.shape and lse.shape == (2, 4, 64) and s.shape == (0,)
            return out * 2, lse, s
        torch._dynamo.reset()
        explain = torch._dynamo.explain(f)(q)
        # Python ints are constants of the graph; other integers are read at a graph break
        assert explain.graph_break_count == breaks, explain.break_reasons
        assert any("torch.ops.cufa.flash_attn.default(" in g.code and ", 8, -1, " in g.code
                   for g in explain.graphs)
