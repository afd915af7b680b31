"""From a padded batch with a key-padding mask to the packed (varlen) form and back, on
the GPU, in the caller's framework (PyTorch ops for torch tensors, CuPy for the rest)."""
from . import _interop


def _is_torch(x):
    return type(x).__module__.split(".")[0] == "torch"


def _as_cupy(x, name):
    import cupy
    a = _interop.as_device_array(x, name)
    return x if a.framework == "cupy" else cupy.from_dlpack(x)


def unpad_input(hidden, attention_mask):
    """Pack the real tokens of a padded batch.

    hidden: (batch, seqlen, ...); attention_mask: (batch, seqlen), bool or integer,
    nonzero = real token (any positions, not only a prefix). Returns (packed (nnz, ...),
    indices (nnz,) int64 — rows of hidden viewed as (batch * seqlen, ...), cu_seqlens
    int32 (batch + 1,), max_seqlen int). Finding the tokens and reading max_seqlen cost a
    device sync, as in flash-attn.
    """
    if tuple(attention_mask.shape) != tuple(hidden.shape[:2]):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; expected "
                         f"(batch, seqlen) = {tuple(hidden.shape[:2])} from hidden")
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
    with cupy.cuda.Device(h.device.id):
        keep = m != 0
        lens = keep.sum(axis=1, dtype=cupy.int32)
        indices = cupy.flatnonzero(keep.ravel()).astype(cupy.int64)
        cu_seqlens = cupy.concatenate([cupy.zeros(1, cupy.int32), cupy.cumsum(lens, dtype=cupy.int32)])
        packed = h.reshape(-1, *h.shape[2:])[indices]
        max_seqlen = int(lens.max()) if lens.size else 0
    like = _interop.as_device_array(hidden, "hidden")
    return (_interop.to_caller(packed, like), _interop.to_caller(indices, like),
            _interop.to_caller(cu_seqlens, like), max_seqlen)


def pad_input(packed, indices, batch, seqlen):
    """The inverse of unpad_input: (nnz, ...) -> (batch, seqlen, ...), zeros at padding."""
    if _is_torch(packed):
        import torch
        out = torch.zeros((batch * seqlen, *packed.shape[1:]), dtype=packed.dtype,
                          device=packed.device)
        out.index_copy_(0, indices, packed)
        return out.reshape(batch, seqlen, *packed.shape[1:])
    import cupy
    p, idx = _as_cupy(packed, "packed"), _as_cupy(indices, "indices")
    with cupy.cuda.Device(p.device.id):
        out = cupy.zeros((batch * seqlen, *p.shape[1:]), dtype=p.dtype)
        out[idx] = p
    return _interop.to_caller(out.reshape(batch, seqlen, *p.shape[1:]),
                              _interop.as_device_array(packed, "packed"))
