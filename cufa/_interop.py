"""Arrays in, arrays out: any CUDA array to (pointer, shape, strides), and outputs
allocated by the caller's own framework, launched on the caller's current stream.

PyTorch tensors and CuPy arrays are read directly (no DLPack round trip, so
bfloat16 needs no extra package); anything else with ``__dlpack__`` goes through
``cupy.from_dlpack``. Nothing here copies data.
"""
from dataclasses import dataclass

from . import _torch_ops

_DL_CUDA, _DL_CUDA_MANAGED = 2, 13


@dataclass
class DeviceArray:
    """A view of a caller's array: enough to hand its memory to a kernel."""
    obj: object             # the caller's array, kept alive for the call
    framework: str          # "torch" | "cupy" | "dlpack" (anything else, seen through CuPy)
    ptr: int
    shape: tuple
    strides: tuple          # in elements
    dtype: str              # "float16", "bfloat16", "float32", "bool", "int32", ...
    device: int
    itemsize: int

    @property
    def ndim(self):
        return len(self.shape)


def _torch_view(x, name):
    _torch_ops.register_if_torch_loaded()
    if not x.is_cuda:
        raise TypeError(f"{name} is a PyTorch tensor on {x.device}; cufa needs CUDA tensors")
    if x.requires_grad:
        raise NotImplementedError(
            f"{name} requires grad, but cufa has no backward pass yet: pass {name}.detach() "
            "or call under torch.no_grad()")
    described = _torch_dtype_names.get(x.dtype)
    if described is None:
        described = _torch_dtype_names[x.dtype] = (str(x.dtype).replace("torch.", ""),
                                                   x.element_size())
    return DeviceArray(x, "torch", x.data_ptr(), tuple(x.shape), x.stride(), described[0],
                       x.get_device(), described[1])


_torch_dtype_names = {}


def _cupy_view(x, obj, framework):
    itemsize = x.dtype.itemsize
    return DeviceArray(obj, framework, x.data.ptr, tuple(x.shape),
                       tuple(s // itemsize for s in x.strides), x.dtype.name, x.device.id,
                       itemsize)


def as_device_array(x, name):
    """View `x` (PyTorch, CuPy, JAX or any CUDA __dlpack__ object) without copying."""
    if isinstance(x, DeviceArray):
        return x
    module = type(x).__module__.split(".")[0]
    if module == "torch":
        return _torch_view(x, name)
    if module == "cupy":
        return _cupy_view(x, x, "cupy")
    if is_jax(x) and _is_jax_tracer(x):
        raise TypeError(f"{name} is a JAX tracer, which this cufa function cannot take (the "
                        "attention functions can: inside jax.jit they run as XLA callbacks); "
                        "call it outside the jitted function, on concrete arrays")
    if not hasattr(x, "__dlpack__") or not hasattr(x, "__dlpack_device__"):
        raise TypeError(f"{name} must be a CUDA array (CuPy, PyTorch, JAX or any object with "
                        f"__dlpack__); got {type(x).__module__}.{type(x).__name__}")
    device_type, _ = x.__dlpack_device__()
    if int(device_type) not in (_DL_CUDA, _DL_CUDA_MANAGED):
        raise TypeError(f"{name} is not on a CUDA device (DLPack device type {int(device_type)}); "
                        "cufa needs CUDA arrays")
    import cupy
    return _cupy_view(cupy.from_dlpack(x), x, "dlpack")


def optional_array(x, name):
    return None if x is None else as_device_array(x, name)


def current_stream_ptr(framework, device):
    """The stream the caller's framework is issuing work on (a CUstream handle)."""
    if framework == "torch":
        global _torch_raw_stream
        if _torch_raw_stream is None:
            _torch_raw_stream = _find_torch_raw_stream()
        return _torch_raw_stream(device)
    import cupy
    return cupy.cuda.get_current_stream(device).ptr


def _find_torch_raw_stream():
    """torch's own fast read of the current stream (what its compiled code calls), where
    this torch has it; torch.cuda.current_stream builds a Stream object each call."""
    import torch
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw if raw is not None else (lambda device: torch.cuda.current_stream(device).cuda_stream)


_torch_raw_stream = None


def allocate(framework, shape, dtype, device):
    """A new array of the caller's framework: (native array, device address)."""
    if framework == "torch":
        import torch
        native = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        return native, native.data_ptr()
    import cupy
    with cupy.cuda.Device(device):
        native = cupy.empty(shape, dtype=_cupy_dtype(dtype))
    return native, native.data.ptr


def _cupy_dtype(dtype):
    if dtype == "bfloat16":
        import ml_dtypes  # CuPy represents bfloat16 through ml_dtypes
        return ml_dtypes.bfloat16
    return dtype


def contiguous_strides(shape):
    """Row-major strides, in elements."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def to_numpy(x):
    """A DeviceArray's values on the host (a device sync)."""
    if x.framework == "torch":
        return x.obj.detach().cpu().numpy()
    import cupy
    return cupy.asnumpy(x.obj if x.framework == "cupy" else cupy.from_dlpack(x.obj))


def is_jax(x):
    return type(x).__module__.split(".")[0] in ("jax", "jaxlib")


def _is_jax_tracer(x):
    import jax
    return isinstance(x, jax.core.Tracer)


def to_caller(native, like):
    """`native` (a torch or CuPy array) as the caller's type: JAX callers get JAX arrays."""
    if like.framework == "dlpack" and is_jax(like.obj):
        import jax.dlpack
        return jax.dlpack.from_dlpack(native)
    return native
