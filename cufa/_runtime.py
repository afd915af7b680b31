"""The device at run time: what a device is (SM count, shared memory, bandwidth), the
launch plans cached per call signature, the caller's stream and outputs, per-stream
buffers, and the launch straight through the driver (a CUfunction handle in, never a
variant: compiling is _compile's)."""
import collections
import ctypes
import threading

from . import _interop

# -- launch plans ----------------------------------------------------------------------------

# ("entry", options) + _interop.signature key -> plan, of every entry point. Ordered: past
# MAX_PLANS the oldest goes, in O(1) (a dict's first item after many deletions is a scan
# away)
plans = collections.OrderedDict()
MAX_PLANS = 4096


def remember(key, plan):
    """Plans use the environment's overrides (CUFA_KERNEL_FAMILY, CUFA_SM90_BLOCK_M,
    CUFA_DECODE_TMA) as last read: api.clear_plans() after changing them in a running
    process."""
    if len(plans) >= MAX_PLANS:   # signatures that keep changing: the oldest goes
        plans.popitem(last=False)
    plans[key] = plan
    return plan


# -- a call's stream and outputs ---------------------------------------------------------------

class caller_stream:
    """Context: `device` current, with its context (for the driver calls); gives the
    stream the caller's framework is issuing work on. When the device's context is current
    already (the usual case) it switches nothing: a launch's host cost is what a small
    model step waits on."""
    __slots__ = ("framework", "device", "stream", "_switch")

    def __init__(self, framework, device, stream=None):
        """stream: a CUstream handle to use instead (XLA's, in a jax.jit callback)."""
        self.framework, self.device, self.stream, self._switch = framework, device, stream, None

    def __enter__(self):
        driver = _driver()
        if _contexts.get(self.device) != driver.ctxGetCurrent():
            import cupy
            self._switch = cupy.cuda.Device(self.device)
            self._switch.__enter__()
            if driver.ctxGetCurrent() == 0:  # a thread new to CUDA: the driver calls
                cupy.cuda.runtime.free(0)    # need the device's context made current
            _contexts[self.device] = driver.ctxGetCurrent()
        if self.stream is not None:
            return self.stream
        return _interop.current_stream_ptr(self.framework, self.device)

    def __exit__(self, *exc):
        if self._switch is not None:
            self._switch.__exit__(*exc)


_contexts = {}  # device -> its context handle, as current during our launches


def outputs(plan, out, o_ptr, lse_out, want_lse, stream, like=None):
    """(out, its address, lse, its address) of a call, inside caller_stream: the caller's
    out= (or, under jax.jit, XLA's buffers out and lse_out) where given, else new arrays of
    the caller's framework; without want_lse no lse at all (None, 0), which the kernels
    skip: one allocation less a call. Plans of every entry point have the fields read.
    like: the caller's q, whose shape, dtype and device every plan's out has."""
    if out is None:
        out, o_ptr = _interop.allocate(plan.framework, plan.out_shape, plan.dtype,
                                       plan.device, stream, like)
    if lse_out is not None:
        return out, o_ptr, lse_out, lse_out.ptr
    if not want_lse:
        return out, o_ptr, None, 0
    lse, lse_ptr = _interop.allocate(plan.framework, plan.lse_shape, "float32", plan.device,
                                     stream)
    return out, o_ptr, lse, lse_ptr


def returned(plan, out, lse, with_lse):
    """What the caller gets back: out (and lse), as JAX arrays for a JAX caller."""
    if plan.to_jax:
        out, lse = _interop.to_jax(out, lse if with_lse else None)
    return (out, lse) if with_lse else out


def check_scratch(scratch, needed):
    """scratch: None, or (address, bytes) of a caller-provided device buffer (XLA's, under
    jax.jit); its address, or 0 for none."""
    if scratch is None:
        return 0
    ptr, size = scratch
    if size < needed:
        raise RuntimeError(f"the scratch buffer traced for this jitted call has {size} bytes "
                           f"but the launch needs {needed}: the device it runs on differs "
                           "from the one it was traced for; trace it again there")
    return ptr


# -- per-stream buffers ------------------------------------------------------------------------

def stream_tile_counter(framework, device, stream):
    """(owner, address) of the persistent kernel's tile counter (2 zeroed uint32s) for a
    launch on `stream`. The kernel leaves its counter zeroed, and launches on one stream
    run one after another, so each stream keeps one (zeroed when it is made) and a call
    needs no memset. A stream being captured into a CUDA graph gets a counter of its own,
    zeroed by a memset in the graph: a graph may be replayed on any stream, beside any
    other work."""
    return _stream_buffer(_tile_counters, framework, device, stream, 8, zeroed=True)


def stream_workspace(framework, device, stream, nbytes, capturing=None):
    """(owner, address) of at least nbytes of device memory for one call's scratch on
    `stream` (a packed batch's work list, a decode's split-KV partials), kept per stream
    and thread, so a call allocates nothing; from the caller's allocator under graph
    capture. Launches on the stream run in order, so one call's kernels are done with it
    before the next call's write it; but a call queues several kernels, and two threads
    queueing calls on one stream at once would interleave them over one buffer, so each
    thread has its own. capturing: as _stream_buffer's."""
    return _stream_buffer(_workspaces, framework, device, stream, nbytes, zeroed=False,
                          capturing=capturing, per_thread=True)


def stream_split_counters(framework, device, stream, nbytes):
    """(owner, address) of nbytes of zeroed int32 counters for a split decode on `stream`,
    which the decode kernel leaves zeroed (as stream_tile_counter's). Not for a stream
    under graph capture: there the graph's own would need a memset node each replay, so
    graphs keep decode_combine."""
    return _stream_buffer(_split_counters, framework, device, stream, nbytes, zeroed=True,
                          capturing=False)


def stream_capturing(stream):
    """Whether `stream` is being captured into a CUDA graph."""
    global _stream_is_capturing
    if _stream_is_capturing is None:  # (looked up once: cupy.cuda's lookups are slow)
        import cupy
        _stream_is_capturing = cupy.cuda.runtime.streamIsCapturing
    return bool(_stream_is_capturing(stream))


_stream_is_capturing = None


_captured = []  # memory taken under a CuPy stream capture: held for the life of the process
_tile_counters = {}  # (device, stream, thread or 0) -> (address, bytes)
_split_counters = {}
_workspaces = {}
_buffer_growth = threading.Lock()


def _stream_buffer(held_by, framework, device, stream, nbytes, zeroed, capturing=None,
                   per_thread=False):
    """A buffer `stream` keeps in held_by, grown (to twice the size asked) when a call
    needs more. The default streams' handles are shared across threads that may not share
    the stream, so theirs are per thread too, and every stream's with per_thread (memory
    that one call's kernels hand each other; a counter that one kernel leaves zeroed is
    safe to share). capturing: whether `stream` is under graph capture, where the caller
    knows it (None: asked here); captured, the call gets memory of its own."""
    recording.replayable = False  # this memory is not XLA's: a jax.jit replay must not reuse it
    if capturing is None:
        capturing = stream_capturing(stream)
    if capturing:
        import cupy
        owner, ptr = _interop.allocate(framework, (-(-nbytes // 4),), "int32", device, stream)
        if zeroed:
            cupy.cuda.runtime.memsetAsync(ptr, 0, nbytes, stream)
        if framework != "torch":
            # PyTorch takes it from the graph's private pool, which lives as the graph does;
            # CuPy's pool knows no graphs, and would hand the memory to the next allocation
            # once the call dropped it, while every replay still writes there
            _captured.append(owner)
        return owner, ptr
    key = (device, stream, threading.get_ident() if per_thread or stream <= 2 else 0)
    held = held_by.get(key)
    if held is None or held[1] < nbytes:
        import cupy
        runtime = cupy.cuda.runtime
        with _buffer_growth:  # two threads on one stream must not free it twice
            held = held_by.get(key)
            if held is None or held[1] < nbytes:
                if held is not None:  # launches queued on the stream may still use it
                    runtime.streamSynchronize(stream)
                    runtime.free(held[0])
                ptr = runtime.malloc(2 * nbytes)
                if zeroed:
                    runtime.memsetAsync(ptr, 0, 2 * nbytes, stream)
                held = held_by[key] = (ptr, 2 * nbytes)
    return None, held[0]


# -- the launch ----------------------------------------------------------------------------------

def driver_launch(function, blocks, threads, smem_bytes, stream, args):
    """Straight through the driver, each argument (a ctypes object) passed by address:
    a fraction of the cost of CuPy's argument conversion for the records. blocks: a count
    or an (x, y, z) grid."""
    grid = (blocks, 1, 1) if isinstance(blocks, int) else blocks
    pointers = _POINTER_ARRAYS[len(args)](*map(ctypes.addressof, args))
    stream_call(_driver().launchKernel, function, *grid, threads, 1, 1, smem_bytes, stream,
                ctypes.addressof(pointers), 0, keep=(pointers, args))


_POINTER_ARRAYS = [ctypes.c_void_p * n for n in range(4)]  # kernel arguments: 1 or 2 records


def stream_call(fn, *args, keep=None):
    """fn(*args): a driver or runtime call that queues work on a stream. Inside a jax.jit
    callback that _jax.on_device records, the call is also kept (with `keep`, the memory
    its arguments point to) so that the next run with the same buffers repeats it."""
    fn(*args)
    calls = getattr(recording, "calls", None)
    if calls is not None:
        calls.append((fn, args, keep))


# _jax.on_device's recording: `calls` (a list) while one is made on this thread, and
# `replayable`, cleared where a call takes memory only that one call holds.
recording = threading.local()


def _driver():
    global _driver_module
    if _driver_module is None:
        from cupy_backends.cuda.api import driver
        _driver_module = driver
    return _driver_module


_driver_module = None


# -- device facts (each asked once a device) -----------------------------------------------------

_capabilities = {}
_attributes = {}  # (device, attribute name) -> value


def _attribute(device, name):
    """A CUDA device attribute (CuPy's name), asked once a device."""
    value = _attributes.get((device, name))
    if value is None:
        import cupy
        value = _attributes[device, name] = cupy.cuda.Device(device).attributes[name]
    return value


def sm_count(device):
    return _attribute(device, "MultiProcessorCount")


def compute_capability(device):
    cc = _capabilities.get(device)
    if cc is None:
        import cupy
        cc = _capabilities[device] = cupy.cuda.Device(device).compute_capability
    return cc


def smem_per_block(device):
    """The dynamic shared memory a CTA may ask for (opt-in)."""
    return _attribute(device, "MaxSharedMemoryPerBlockOptin")


def smem_per_sm(device):
    return _attribute(device, "MaxSharedMemoryPerMultiprocessor")


def peak_bytes_per_s(device):
    """Peak DRAM bytes/s (double data rate x memory clock x bus width), or None where the
    driver does not say."""
    import cupy
    try:
        khz = cupy.cuda.runtime.deviceGetAttribute(_ATTR_MEMORY_CLOCK_KHZ, device)
        bits = cupy.cuda.runtime.deviceGetAttribute(_ATTR_MEMORY_BUS_BITS, device)
    except cupy.cuda.runtime.CUDARuntimeError:
        return None
    return 2 * khz * 1e3 * bits / 8 if khz > 0 and bits > 0 else None


# cudaDevAttrMemoryClockRate (kHz) and cudaDevAttrGlobalMemoryBusWidth (bits)
_ATTR_MEMORY_CLOCK_KHZ, _ATTR_MEMORY_BUS_BITS = 36, 37
