"""Arrays in, arrays out: any CUDA array to (pointer, shape, strides), and outputs
allocated by the caller's own framework, launched on the caller's current stream.

PyTorch tensors and CuPy arrays are read directly (no DLPack round trip, so
bfloat16 needs no extra package); anything else with ``__dlpack__`` goes through
``cupy.from_dlpack``. Nothing here copies data.
"""
import sys
from dataclasses import dataclass

_DL_CUDA, _DL_CUDA_MANAGED = 2, 13
# where an array lives that cufa cannot take: DLPack's device types, and torch's names
_DL_DEVICES = {1: "CPU", 3: "pinned host (CUDA)", 4: "OpenCL", 7: "Vulkan", 8: "Metal",
               9: "VPI", 10: "ROCm", 11: "pinned host (ROCm)", 14: "oneAPI", 15: "WebGPU",
               16: "Hexagon", "cpu": "CPU", "mps": "Metal", "xpu": "oneAPI"}
_FRAMEWORKS = {"numpy": "NumPy", "jax": "JAX", "jaxlib": "JAX", "torch": "PyTorch",
               "cupy": "CuPy", "tensorflow": "TensorFlow", "mlx": "MLX", "paddle": "Paddle"}


def on_torch_tensor():
    """Called where a torch tensor is viewed: cufa's __init__ sets it to register the
    torch.compile ops (_torch_ops), which needs torch imported."""


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
    on_torch_tensor()
    if not x.is_cuda:
        device = x.device.type
        raise TypeError(f"cufa needs CUDA device arrays; got a "
                        f"{_DL_DEVICES.get(device, device)} (PyTorch) tensor for {name}")
    # (the functions with a backward route recording calls to the torch ops, which detach)
    if x.requires_grad and _torch_grad_enabled():
        raise NotImplementedError(
            f"{name} requires grad, but this cufa function has no backward pass: pass "
            f"{name}.detach() or call under torch.no_grad()")
    described = _torch_dtype_names.get(x.dtype)
    if described is None:
        described = _torch_dtype_names[x.dtype] = (str(x.dtype).replace("torch.", ""),
                                                   x.element_size())
    return DeviceArray(x, "torch", x.data_ptr(), tuple(x.shape), x.stride(), described[0],
                       x.get_device(), described[1])


_torch_dtype_names = {}


def know_torch(torch):
    """Keep torch's tensor type and allocators for the fast checks. Also done when the
    torch.compile ops are registered, before any trace: a trace that read these as None
    would be guarded on None, and recompiled once the first call had set them."""
    global _torch_tensor, _torch_empty_like, _torch_contiguous, _torch_grad_enabled
    _torch_tensor, _torch_empty_like = torch.Tensor, torch.empty_like
    _torch_grad_enabled = torch.is_grad_enabled
    _torch_contiguous = torch.contiguous_format


def _cupy_view(x, obj, framework, name):
    itemsize = x.dtype.itemsize
    check_element_aligned(x.data.ptr, x.strides, x.shape, itemsize, name)
    return DeviceArray(obj, framework, x.data.ptr, tuple(x.shape),
                       tuple(s // itemsize for s in x.strides), x.dtype.name, x.device.id,
                       itemsize)


def check_element_aligned(ptr, byte_strides, shape, itemsize, name):
    """A CuPy or DLPack array may start, or step, at any byte (a byte offset); the kernels
    read whole elements, and one off its element size would fault at launch."""
    if ptr % itemsize or any(s % itemsize for s, n in zip(byte_strides, shape) if n > 1):
        raise ValueError(f"{name} starts or steps off its {itemsize}-byte elements (address "
                         f"{ptr:#x}, byte strides {tuple(byte_strides)}); pass an array "
                         "aligned to its element size")


def detached(x):
    """x, or where it is a torch tensor that requires grad, its detached view: what the
    planners take of a tensor autograd tracks (a user's own backward, an op's body given
    the parameter itself by a compiled graph). None and other arrays pass as they are."""
    return x.detach() if getattr(x, "requires_grad", False) else x


def as_device_array(x, name):
    """View `x` (PyTorch, CuPy, JAX or any CUDA __dlpack__ object) without copying."""
    if isinstance(x, DeviceArray):
        return x
    module = type(x).__module__.split(".")[0]
    if module == "torch":
        know_torch(sys.modules["torch"])
        return _torch_view(x, name)
    if module == "cupy":
        global _cupy_array
        _cupy_array = sys.modules["cupy"].ndarray
        return _cupy_view(x, x, "cupy", name)
    if is_jax(x) and _is_jax_tracer(x):
        raise TypeError(f"{name} is a JAX tracer, which this cufa function cannot take (the "
                        "attention functions can: inside jax.jit they run as XLA callbacks); "
                        "call it outside the jitted function, on concrete arrays")
    if not hasattr(x, "__dlpack__") or not hasattr(x, "__dlpack_device__"):
        raise TypeError(f"{name} must be a CUDA array (CuPy, PyTorch, JAX or any object with "
                        f"__dlpack__); got {type(x).__module__}.{type(x).__name__}")
    device_type, _ = x.__dlpack_device__()
    if int(device_type) not in (_DL_CUDA, _DL_CUDA_MANAGED):
        device = _DL_DEVICES.get(int(device_type), f"DLPack device type {int(device_type)}")
        raise TypeError(f"cufa needs CUDA device arrays; got a {device} ({_framework_name(x)}) "
                        f"array for {name}")
    import cupy
    return _cupy_view(cupy.from_dlpack(x), x, "dlpack", name)


def device_scalar(x):
    """What x is (e.g. "PyTorch array on CUDA") where it is an array off the host, whose
    value the host cannot read without waiting for the device; None for host values."""
    module = type(x).__module__.split(".")[0]
    if module in ("builtins", "numpy"):
        return None
    if module == "cupy":
        return "CuPy array on CUDA"
    if module == "torch":  # (read as torch.compile can trace it)
        device = x.device.type
        return None if device == "cpu" else f"PyTorch tensor on {device.upper()}"
    where = getattr(x, "__dlpack_device__", None)
    if where is None:
        return None
    try:
        device_type = int(where()[0])
    except Exception:  # (a traced value, say: operator.index then says what is wrong)
        return None
    if device_type == 1:
        return None
    where = ("CUDA" if device_type in (_DL_CUDA, _DL_CUDA_MANAGED)
             else _DL_DEVICES.get(device_type, f"DLPack device type {device_type}"))
    return f"{_framework_name(x)} array on {where}"


def _framework_name(x):
    module = type(x).__module__.split(".")[0]
    return _FRAMEWORKS.get(module, module)


def signature(arrays, names):
    """(key, addresses): of each array (or None) what a launch plan depends on -- its
    kind (or torch dtype), shape, strides, then its dtype, device and 16-byte alignment
    (shape and strides at 1 and 2 in every entry: _fwd_plan._layout_key) -- and its device
    address.
    Torch tensors and CuPy arrays are read directly, without a view object (a repeated
    call's host cost, docs/decisions.md); anything else is viewed through
    as_device_array, which checks it. Not checked here: a plan is made only after its
    arrays passed validation, so a key that finds one describes valid arrays."""
    key, addresses = [], []
    for x in arrays:  # (most of a decode call's 13 are None: those first)
        if x is None:
            key.append(None)
            addresses.append(0)
            continue
        kind = type(x)
        if kind is _torch_tensor:
            ptr = x.data_ptr()
            key.append((x.dtype, x.shape, x.stride(), x.get_device(), x.requires_grad, ptr % 16))
        elif kind is _cupy_array:
            ptr = x.data.ptr
            key.append((kind, x.shape, x.strides, x.dtype, x.device.id, ptr % 16))
        else:
            view = as_device_array(x, names[len(addresses)])
            ptr = view.ptr
            key.append((type(view.obj), view.shape, view.strides, view.dtype, view.device,
                        ptr % 16))
        addresses.append(ptr)
    return tuple(key), addresses


def _read_off_cupy(entry):
    """Whether signature() read `entry` off a CuPy array itself (its fast path), not off
    a view: then its strides count bytes and its dtype is CuPy's."""
    return entry[0] is _cupy_array and type(entry[3]) is not str


def stride_unit(entry, itemsize):
    """Elements a stride of signature() `entry` counts (of an array with this itemsize)."""
    return itemsize if _read_off_cupy(entry) else 1


def views(arrays, names, entries, addresses, required):
    """as_device_array of each array (the first `required`; the rest may be None) of a
    call whose signature() gave (entries, addresses): torch tensors and CuPy arrays are
    viewed from what signature() read off them, not read again (a torch tensor's reads are
    the costly part of its view), where their entries show a CUDA array as_device_array
    would take; anything else through as_device_array, which says what is wrong."""
    out = []
    for i, (x, entry, ptr) in enumerate(zip(arrays, entries, addresses)):
        kind = type(x)
        # (entries of signature()'s fast paths only: the first array of a framework in a
        # process went through as_device_array there, and its entry is the view's)
        if kind is _torch_tensor and not isinstance(entry[0], type):
            dtype, shape, strides, device, requires_grad, _ = entry
            described = _torch_dtype_names.get(dtype)
            if device >= 0 and not requires_grad and described is not None and x.is_cuda:
                on_torch_tensor()
                out.append(DeviceArray(x, "torch", ptr, tuple(shape), strides, described[0],
                                       device, described[1]))
                continue
        elif kind is _cupy_array and _read_off_cupy(entry):
            _, shape, strides, dtype, device, _ = entry
            itemsize = dtype.itemsize
            check_element_aligned(ptr, strides, shape, itemsize, names[i])
            out.append(DeviceArray(x, "cupy", ptr, shape, tuple(s // itemsize for s in strides),
                                   dtype.name, device, itemsize))
            continue
        elif x is None and i >= required:
            out.append(None)
            continue
        out.append(as_device_array(x, names[i]))
    return out


class _Unseen:
    """Matches no array's type until as_device_array has seen the framework."""


_torch_tensor = _cupy_array = _Unseen
_torch_empty_like = _torch_contiguous = _torch_grad_enabled = None  # set with _torch_tensor


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


def allocate(framework, shape, dtype, device, stream, like=None):
    """A new array of the caller's framework on `device`, for work on `stream`, both
    current (callers are inside api.caller_stream): (native array, device address). A
    CuPy array is taken from the pool of the stream it is used on, as the pool reuses
    freed memory on that stream only (under jax.jit, XLA's stream is not CuPy's).
    like: None, or an array of this shape, dtype and device; for a torch tensor
    torch.empty_like costs less host time than torch.empty."""
    if type(like) is _torch_tensor:
        native = _torch_empty_like(like, memory_format=_torch_contiguous)
        return native, native.data_ptr()
    if framework == "torch":
        import torch
        kind = _torch_kinds.get((dtype, device))
        if kind is None:  # torch.device objects: an int device costs torch a conversion
            kind = _torch_kinds[dtype, device] = (getattr(torch, dtype),
                                                  torch.device("cuda", device))
        native = torch.empty(shape, dtype=kind[0], device=kind[1])
        return native, native.data_ptr()
    import cupy
    if cupy.cuda.get_current_stream().ptr == stream:
        native = cupy.empty(shape, dtype=_cupy_dtype(dtype))
    else:
        with cupy.cuda.Stream.from_external(_StreamHandle(stream)):
            native = cupy.empty(shape, dtype=_cupy_dtype(dtype))
    return native, native.data.ptr


_torch_kinds = {}  # (dtype name, device) -> torch.empty's dtype and device arguments


class _StreamHandle:
    """A raw stream handle in the CUDA stream protocol that CuPy 14 takes."""

    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


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


def returns_jax(like):
    """Whether a call on `like` (a view of its first array) returns JAX arrays."""
    return like.framework == "dlpack" and is_jax(like.obj)


def to_jax(*natives):
    """A call's outputs (CuPy arrays, or None) as JAX arrays, once the kernels that wrote
    them are done: one wait a call. An eager JAX call's inputs came over DLPack and the
    caller may drop them as soon as the call returns, and JAX then reuses their memory on
    its own stream, which cufa's stream does not wait for; on another GPU than CuPy's
    current one, DLPack's handover event would be recorded on the wrong device's stream.
    So the stream is synchronized first (under jax.jit nothing waits: the kernels run on
    XLA's stream). -> a list, None where None was given."""
    import cupy
    import jax.dlpack
    given = [x for x in natives if x is not None]
    if given:
        with given[0].device:  # (one call's outputs: one device)
            cupy.cuda.get_current_stream().synchronize()
    return [None if x is None else jax.dlpack.from_dlpack(x) for x in natives]


def empty_of(like):
    """An empty (0,) array of `like`'s framework, dtype and device (a torch tensor of its
    own: a view would share `like`'s autograd history)."""
    new_empty = getattr(like, "new_empty", None)
    return new_empty((0,)) if new_empty is not None else like[:0].reshape(0)


def to_caller(native, like):
    """`native` (a torch or CuPy array) as the caller's type: JAX callers get JAX arrays."""
    return to_jax(native)[0] if returns_jax(like) else native
