"""From a padded batch with a key-padding mask to the packed (varlen) form and back, on
the GPU, in the caller's framework (PyTorch ops for torch tensors, CuPy for the rest)."""
from . import _interop


def _framework(x):
    return type(x).__module__.split(".")[0]


def _is_torch(x):
    return _framework(x) == "torch"


def _dtype_name(x):
    return str(x.dtype).replace("torch.", "")


def _as_cupy(x, name):
    import cupy
    a = _interop.as_device_array(x, name)
    return x if a.framework == "cupy" else cupy.from_dlpack(x)


def _check_rank(x, name, min_rank, layout):
    if not hasattr(x, "shape"):
        raise TypeError(f"{name} must be an array; got {type(x).__name__}")
    if len(x.shape) < min_rank:
        raise ValueError(f"{name} must have rank >= {min_rank} {layout}; got shape "
                         f"{tuple(x.shape)}")


def _check_companion(x, name, ref, ref_name):
    """x must come from ref's framework (mixing would copy, or fail deep inside a kernel)
    and, for torch, sit on ref's device; CuPy devices are compared after conversion."""
    if _framework(x) != _framework(ref):
        raise TypeError(f"{name} is a {_framework(x)}.{type(x).__name__} but {ref_name} is a "
                        f"{_framework(ref)}.{type(ref).__name__}; pass both from one framework")
    if _is_torch(ref) and x.device != ref.device:
        raise ValueError(f"{name} is on {x.device} but {ref_name} is on {ref.device}")


def _check_same_cupy_device(x, name, ref, ref_name):
    if x.device.id != ref.device.id:
        raise ValueError(f"{name} is on cuda:{x.device.id} but {ref_name} is on "
                         f"cuda:{ref.device.id}")


def _check_in_range(ok, n):
    """check_indices=True: reading the verdict is the one device sync."""
    if not bool(ok.all()):
        raise ValueError(f"indices must lie in [0, batch*seqlen) = [0, {n}); "
                         "found values outside")


def unpad_input(hidden, attention_mask):
    """Pack the real tokens of a padded batch.

    hidden: (batch, seqlen, ...); attention_mask: (batch, seqlen), bool or integer,
    nonzero = real token (any positions, not only a prefix), same framework and device
    as hidden. Returns (packed (nnz, ...), indices (nnz,) int64 — rows of hidden viewed
    as (batch * seqlen, ...), cu_seqlens int32 (batch + 1,), max_seqlen int). Finding
    the tokens and reading max_seqlen cost a device sync, as in flash-attn.
    """
    _check_rank(hidden, "hidden", 2, "(batch, seqlen, ...)")
    _check_companion(attention_mask, "attention_mask", hidden, "hidden")
    if tuple(attention_mask.shape) != tuple(hidden.shape[:2]):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; expected "
                         f"(batch, seqlen) = {tuple(hidden.shape[:2])} from hidden")
    mask_dtype = _dtype_name(attention_mask)
    if mask_dtype != "bool" and not mask_dtype.startswith(("int", "uint")):
        # A float mask is ambiguous: an additive mask (0 = keep) would invert the meaning.
        raise TypeError(f"attention_mask must be bool or integer, got {mask_dtype}")
    if _is_torch(hidden):
        import torch
        keep = attention_mask != 0
        lens = keep.sum(dim=1, dtype=torch.int32)
        indices = torch.nonzero(keep.flatten(), as_tuple=False).flatten()
        cu_seqlens = torch.nn.functional.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))
        packed = hidden.reshape(-1, *hidden.shape[2:]).index_select(0, indices)
        return packed, indices, cu_seqlens, int(lens.max()) if lens.numel() else 0
    import cupy
    h, m = _as_cupy(hidden, "hidden"), _as_cupy(attention_mask, "attention_mask")
    _check_same_cupy_device(m, "attention_mask", h, "hidden")
    with cupy.cuda.Device(h.device.id):
        keep = m != 0
        lens = keep.sum(axis=1, dtype=cupy.int32)
        indices = cupy.flatnonzero(keep.ravel()).astype(cupy.int64)
        cu_seqlens = cupy.concatenate([cupy.zeros(1, cupy.int32), cupy.cumsum(lens, dtype=cupy.int32)])
        packed = h.reshape(-1, *h.shape[2:])[indices]
        max_seqlen = int(lens.max()) if lens.size else 0
    like = _interop.as_device_array(hidden, "hidden")
    if _interop.returns_jax(like):  # (one wait for the three)
        packed, indices, cu_seqlens = _interop.to_jax(packed, indices, cu_seqlens)
    return packed, indices, cu_seqlens, max_seqlen


def pad_input(packed, indices, batch, seqlen, *, check_indices=False):
    """The inverse of unpad_input: (nnz, ...) -> (batch, seqlen, ...), zeros at padding.

    indices: (nnz,) int64 or int32, same framework and device as packed, one row of the
    (batch * seqlen, ...) output per packed row. Indices outside [0, batch * seqlen)
    are dropped (their rows are not written) rather than trusted: an out-of-range
    scatter on CUDA is a device-side assert that kills the process's CUDA context.
    check_indices=True raises ValueError on them instead, at the cost of a device sync.
    """
    for x, n in ((batch, "batch"), (seqlen, "seqlen")):
        if not isinstance(x, int) or isinstance(x, bool) or x < 0:
            raise ValueError(f"{n} must be an int >= 0; got {x!r}")
    _check_rank(packed, "packed", 1, "(nnz, ...)")
    _check_companion(indices, "indices", packed, "packed")
    if _dtype_name(indices) not in ("int64", "int32"):
        raise TypeError(f"indices must be int64 or int32, got {_dtype_name(indices)}")
    if len(indices.shape) != 1:
        raise ValueError(f"indices must be 1-D (nnz,); got shape {tuple(indices.shape)}")
    if indices.shape[0] != packed.shape[0]:
        raise ValueError(f"indices has {indices.shape[0]} entries but packed has "
                         f"{packed.shape[0]} rows")
    n, rest = batch * seqlen, tuple(packed.shape[1:])
    # Row n is a trash row for out-of-range indices: an elementwise where keeps the scatter
    # in bounds without the device sync that checking the values would cost.
    if _is_torch(packed):
        import torch
        idx = indices.long()  # index_copy_ takes int64; int32 compares would wrap n >= 2**31
        ok = (idx >= 0) & (idx < n)
        if check_indices:
            _check_in_range(ok, n)
        out = torch.zeros((n + 1, *rest), dtype=packed.dtype, device=packed.device)
        out.index_copy_(0, torch.where(ok, idx, n), packed)
        return out[:n].reshape(batch, seqlen, *rest)
    import cupy
    p, idx = _as_cupy(packed, "packed"), _as_cupy(indices, "indices")
    _check_same_cupy_device(idx, "indices", p, "packed")
    with cupy.cuda.Device(p.device.id):
        idx = idx.astype(cupy.int64, copy=False)
        ok = (idx >= 0) & (idx < n)
        if check_indices:
            _check_in_range(ok, n)
        out = cupy.zeros((n + 1, *rest), dtype=p.dtype)
        out[cupy.where(ok, idx, n)] = p
    return _interop.to_caller(out[:n].reshape(batch, seqlen, *rest),
                              _interop.as_device_array(packed, "packed"))
