"""Argument validation: every error names the argument and what was expected. The
planners call these on views of the caller's arrays (_interop.DeviceArray) before they plan
a new call signature; the jax.jit route calls the entry points' checks at trace time."""
import math
import operator

import numpy as np

from . import _compile, _dtypes, _interop, _params

# views of _dtypes' table, by dtype name: the variant key of the kernels' dtypes (q, k, v,
# the caches), of merge_attention_states' parts; the codes of attn_mask and rotary tables
KERNEL_DTYPES = {name: _dtypes.BY_NAME[name].key for name in _dtypes.codes("kernel")}
MERGE_DTYPES = {name: _dtypes.BY_NAME[name].key for name in _dtypes.codes("merge")}
ATTN_MASK_TYPES = _dtypes.codes("attn_mask")
ROTARY_DTYPES = _dtypes.codes("rotary")
FP8_CACHE = "float8_e4m3fn"  # the dtype of an fp8 KV cache (flash_attn_with_kvcache)
UNBOUNDED = 1 << 30     # a window side larger than any sequence the int32 params can hold


def window_mask_kind(window):
    """The kernels' mask kind of a checked window: "none" where neither side is bounded
    (so no key is ever masked), else "window" (causal is one)."""
    return "none" if window == (UNBOUNDED, UNBOUNDED) else "window"
# The entry points' default window_size, this object: check_options takes it unchecked (a
# value-equal pair from the caller, or -1.0, goes through the checks).
NO_WINDOW = (-1, -1)
_DEFAULT_OPTIONS = (((UNBOUNDED, UNBOUNDED), None, 0.0), ((UNBOUNDED, 0), None, 0.0))
INT32_MAX = 2**31 - 1
GRID_YZ_MAX = 65535     # the decode grid's y (KV heads) and z (batch)


# -- arrays and options ----------------------------------------------------------------------

# (comparisons rather than math.isnan / isfinite: torch.compile may pass these as symbolic
# floats, which comparisons handle and math functions do not)
def reject_unsupported(dropout_p):
    if type(dropout_p) is not float or not dropout_p >= 0:
        dropout_p = as_real(dropout_p, "dropout_p", "a number >= 0")
        if not dropout_p >= 0:
            raise ValueError(f"dropout_p must be a number >= 0; got {dropout_p!r}")
    if dropout_p > 0:
        raise NotImplementedError("dropout_p > 0 is not supported: cufa's forward has no "
                                  "dropout; pass dropout_p=0.0")


def as_index(x, name, minimum, expected):
    """x, an integer held on the host (a Python int, a NumPy integer, a 0-d integer CPU
    tensor or array), as a Python int >= minimum, through operator.index as flash-attn
    takes sizes and windows. Bools are refused, and so are device scalars: reading one
    would make the host wait for the device."""
    if type(x) is not int:
        device = _interop.device_scalar(x)
        if device is not None:  # (never repr'd: that too would read it)
            raise ValueError(f"{name} is a {device}, and reading its value would make the host "
                             f"wait for the device; pass {expected} as a Python int or a CPU "
                             "tensor")
        try:
            if isinstance(x, bool) or str(getattr(x, "dtype", "")).endswith("bool"):
                raise TypeError
            x = operator.index(x)
        except TypeError:
            raise ValueError(f"{name} must be {expected}; got {x!r}") from None
    if x < minimum:
        raise ValueError(f"{name} must be {expected}; got {x!r}")
    return x


def as_real(x, name, expected):
    """x, a real number held on the host (a Python int or float, a NumPy number, a 0-d
    CPU tensor or array), as a Python float. Bools are refused (True is no scale), and so
    are device scalars, as in as_index."""
    if type(x) in (int, float):
        return float(x)
    try:
        device = _interop.device_scalar(x)
    except AttributeError:  # (a torch.SymFloat while torch.compile traces: no device)
        device = None
    if device is not None:
        raise ValueError(f"{name} is a {device}, and reading its value would make the host "
                         f"wait for the device; pass {expected} as a Python float")
    kind = str(getattr(x, "dtype", ""))
    if (isinstance(x, (bool, np.bool_, str, bytes)) or kind.endswith("bool")
            or "complex" in kind or getattr(x, "shape", ()) != ()):
        raise ValueError(f"{name} must be {expected}; got {x!r}")
    try:
        return float(x)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be {expected}; got {x!r}") from None


def check_flag(x, name):
    """A flag as flash-attn takes it: a bool (NumPy's too) or the ints 0 and 1. A string
    or any other object would read as true and is refused."""
    if type(x) is bool:
        return x
    if isinstance(x, np.bool_) or (isinstance(x, (int, np.integer)) and x in (0, 1)):
        return bool(x)
    raise TypeError(f"{name} must be a bool; got {x!r}")


def check_dtype_device(x, name, ref, ref_name):
    if (x.framework == "torch") != (ref.framework == "torch"):  # (CuPy and DLPack: one stream)
        raise TypeError(f"{name} is a {x.framework} array but {ref_name} is a "
                        f"{ref.framework} array: pass arrays of one framework (cufa launches "
                        f"on {ref_name}'s framework's stream, which the other's work is not "
                        "ordered with)")
    if x.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {x.dtype} but {ref_name} has {ref.dtype}")
    if x.device != ref.device:
        raise ValueError(f"{name} is on cuda:{x.device} but {ref_name} is on cuda:{ref.device}")


def chunk_aligned(shape, strides, ptr):
    """Whether the kernels may move an array's rows of 16-bit elements in 16-byte chunks
    (cp.async, TMA, 16-byte stores): a last dim (the head dim) that is a multiple of 8,
    strides that are multiples of 8 elements, a 16-byte aligned start. A dimension of one
    element (its stride never used) or an empty array (nothing moved) counts as aligned.
    Calls with an array that is not take the element-wise I/O kernels (_compile)."""
    if 0 in shape:
        return True
    if shape[-1] % 8 or ptr % 16:
        return False
    for s, n in zip(strides[:-1], shape):
        if s % 8 and n > 1:
            return False
    return True


def check_rows_apart(x, name):
    """An array cufa writes: no two of its index tuples may name one element. Its rows (the
    contiguous last dim) overlap where another dim with more than one index has a stride
    under the row's length (0 included: an expanded array). Overlaps between the other
    dims alone are left, as PyTorch leaves them."""
    shape, strides = x.shape, x.strides
    if 0 in shape:
        return
    for n, s in zip(shape[:-1], strides[:-1]):
        if n > 1 and abs(s) < shape[-1]:
            raise ValueError(f"{name} is written, and its elements share memory: shape {shape}, "
                             f"strides {strides} (a stride under the last dim's "
                             f"{shape[-1]} elements); pass an array of distinct elements")


def check_loadable(x, name):
    """The kernels read rows with a contiguous last dim; -> chunk_aligned(x)."""
    shape, strides = x.shape, x.strides
    if 0 in shape:  # nothing is read or written; frameworks report any strides here
        return True
    if strides[-1] != 1 and shape[-1] > 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride 1); "
                         f"got strides {strides}")
    return chunk_aligned(shape, strides, x.ptr)


def check_qkv(q, k, v, names, layout, *, batch_dim, seq_dim, head_dim, own_v_head_dim=False,
              max_head_dim=_compile.MAX_HEAD_DIM):
    """batch_dim None: packed rows, (total_rows, nheads, headdim), or paged k/v with q
    seen through with_leading_one (seq_dim 1). own_v_head_dim: v may have a head dim of its
    own (check_head_dim_v). max_head_dim: the entry point's (_compile.WIDE_HEAD_DIM where
    the wide kernels run). -> whether q, k and v are chunk_aligned."""
    qn, kn, vn = names
    rank = 3 if batch_dim is None and seq_dim == 0 else 4
    for x, n in ((q, qn), (k, kn), (v, vn)):
        if x.ndim != rank:
            raise ValueError(f"{n} must be {rank}-D {layout}; got shape {x.shape}")
    if q.dtype not in KERNEL_DTYPES:
        fp8 = (f" (float8_e4m3fn q, k, v take the fp8 forward: flash_attn_func, eagerly, not "
               f"under torch.compile, autograd or JAX)" if q.dtype.startswith("float8") else "")
        raise TypeError(f"{qn} has dtype {q.dtype}; cufa supports float16 and bfloat16{fp8}")
    check_dtype_device(k, kn, q, qn)
    check_dtype_device(v, vn, q, qn)
    d = q.shape[-1]
    if (own_v_head_dim and max_head_dim == _compile.WIDE_HEAD_DIM and d > max_head_dim
            and v.shape != k.shape):  # (a wide pair's q and k: check_head_dim_v checks v's)
        max_head_dim = _compile.WIDE_QK_HEAD_DIM
    if not 1 <= d <= max_head_dim:
        wide = ("" if max_head_dim > _compile.MAX_HEAD_DIM else
                f" here (up to {_compile.WIDE_HEAD_DIM} with 16-bit k and v in "
                f"flash_attn_func, flash_attn_varlen_func and flash_attn_with_kvcache)")
        raise ValueError(f"{qn} has head dim {d}; cufa supports head dims from 1 to "
                         f"{max_head_dim}{wide}")
    if k.shape[-1] != d:
        raise ValueError(f"{kn} has head dim {k.shape[-1]} but {qn} has {d}")
    if v.shape != k.shape:
        if d > _compile.MAX_HEAD_DIM and not (own_v_head_dim and d > _compile.WIDE_HEAD_DIM):
            wide_pair = (f" (but for q and k over {_compile.WIDE_HEAD_DIM}, up to "
                         f"{_compile.WIDE_QK_HEAD_DIM}, against v's over "
                         f"{_compile.MAX_HEAD_DIM}, up to {_compile.WIDE_V_HEAD_DIM})"
                         if own_v_head_dim else "")
            raise ValueError(f"{vn} has shape {v.shape} but {kn} has {k.shape}; above head "
                             f"dim {_compile.MAX_HEAD_DIM} cufa needs equal key and value "
                             f"shapes{wide_pair}")
        if not (own_v_head_dim and v.shape[:-1] == k.shape[:-1]):
            raise ValueError(f"{vn} has shape {v.shape} but {kn} has {k.shape}; cufa needs "
                             "equal key and value shapes (same length and heads"
                             + (")" if own_v_head_dim else ", and head dim here)"))
        check_head_dim_v(d, v.shape[-1], vn, qn)
    if batch_dim is not None and k.shape[batch_dim] != q.shape[batch_dim]:
        raise ValueError(f"{kn} has batch {k.shape[batch_dim]} but {qn} has "
                         f"{q.shape[batch_dim]}")
    nheads, nheads_k = q.shape[head_dim], k.shape[head_dim]
    if nheads_k == 0 or nheads % nheads_k:
        raise ValueError(f"{qn} has {nheads} heads, not a multiple of the {nheads_k} heads "
                         f"of {kn}")
    aligned = [check_loadable(x, n) for x, n in ((q, qn), (k, kn), (v, vn))]
    if max(q.shape[seq_dim], k.shape[seq_dim]) > INT32_MAX // 2:
        raise ValueError(f"sequence lengths up to {INT32_MAX // 2} are supported; got "
                         f"{qn} {q.shape[seq_dim]}, {kn} {k.shape[seq_dim]}")
    return all(aligned)


def check_head_dim_v(d, dv, vn="v", qn="q"):
    """A head dim of v's own (dv, against q's and k's d): one of the kernels' pairs, or
    the wide one (q and k over WIDE_HEAD_DIM, v's over MAX_HEAD_DIM)."""
    pairs = _compile.HEAD_DIM_V_PAIRS
    wide = (_compile.WIDE_HEAD_DIM < d <= _compile.WIDE_QK_HEAD_DIM
            and _compile.MAX_HEAD_DIM < dv <= _compile.WIDE_V_HEAD_DIM)
    fits = wide or (d <= _compile.MAX_HEAD_DIM and any(
        _compile.padded_head_dim(d) == hd and 0 < dv <= hv and d > hv for hd, hv in pairs))
    if not fits:
        listed = [*pairs, (_compile.WIDE_QK_HEAD_DIM, _compile.WIDE_V_HEAD_DIM)]
        raise ValueError(f"{vn} has head dim {dv} but {qn} has {d}; a head dim of v's own is "
                         f"supported for (q and k, v) head dims up to "
                         f"{', '.join(f'({hd}, {hv})' for hd, hv in listed)} with q's over "
                         f"v's padded one (DeepSeek's 192 and 128), the last with q's over "
                         f"{_compile.WIDE_HEAD_DIM} and v's over {_compile.MAX_HEAD_DIM} "
                         f"(576 and 512)")


def with_leading_one(x):
    """x seen with a leading dimension of 1 (for checks shared with 4-D arrays)."""
    return _interop.DeviceArray(x.obj, x.framework, x.ptr, (1,) + x.shape, (0,) + x.strides,
                                x.dtype, x.device, x.itemsize)


def check_int32_vector(x, name, length, q):
    """An int32 (length,) array on q's device, contiguous (cu_seqlens-like arguments)."""
    if x.dtype != "int32":
        raise TypeError(f"{name} must be int32; got {x.dtype}")
    if x.shape != (length,):
        raise ValueError(f"{name} must be ({length},) int32; got shape {x.shape}")
    if x.strides[0] != 1 and length > 1:
        raise ValueError(f"{name} must be contiguous; got stride {x.strides[0]}")
    if x.device != q.device:
        raise ValueError(f"{name} is on cuda:{x.device} but q is on cuda:{q.device}")


MAX_PAGE_SIZE = 256


def check_block_table(table, cache, q, batch):
    """A paged cache (num_pages, page_size, nheads_k, d) and its int32 (batch, max_pages)
    page table -> {page_shift, num_pages, max_pages, capacity} for the params."""
    if table.dtype != "int32":
        raise TypeError(f"block_table must be int32; got {table.dtype}")
    if table.ndim != 2 or table.shape[0] != batch:
        raise ValueError(f"block_table must be 2-D ({batch}, max_pages_per_sequence); got shape "
                         f"{table.shape}")
    if table.strides[1] != 1 and table.shape[1] > 1:
        raise ValueError(f"block_table must be contiguous in its last dimension; got strides "
                         f"{table.strides}")
    if table.device != q.device:
        raise ValueError(f"block_table is on cuda:{table.device} but q is on cuda:{q.device}")
    num_pages, page_size = cache.shape[0], cache.shape[1]
    if page_size < 1 or page_size > MAX_PAGE_SIZE or page_size & (page_size - 1):
        raise ValueError(f"the paged cache has pages of {page_size} rows (its dim 1); cufa "
                         f"takes powers of two from 1 to {MAX_PAGE_SIZE}")
    if num_pages < 1:
        raise ValueError("the paged cache has no pages (its dim 0 is 0)")
    capacity = table.shape[1] * page_size
    if capacity > INT32_MAX // 2:
        raise ValueError(f"block_table addresses {capacity} keys per sequence; at most "
                         f"{INT32_MAX // 2} are supported")
    return dict(page_shift=page_size.bit_length() - 1, num_pages=num_pages,
                max_pages=table.shape[1], capacity=capacity, table_stride=table.strides[0])


def check_page_ids(table, num_pages):
    """Reads the page table (a device sync): every id within the cache."""
    ids = _interop.to_numpy(table)
    bad = (ids < 0) | (ids >= num_pages)
    if bad.any():
        b, j = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"block_table[{b}, {j}] = {int(ids[b, j])} is not a page of the cache "
                         f"(0 to {num_pages - 1})")


def check_scale(scale, name):
    """None (1 / sqrt(head dim), decided with the plan) or a float."""
    if scale is None:
        return None
    expected = "a finite number > 0"
    scale = as_real(scale, name, expected)
    if not 0 < scale < math.inf:
        raise ValueError(f"{name} must be {expected}; got {scale!r}")
    return scale


def check_softcap(softcap):
    expected = "a finite number >= 0 (0 = off)"
    softcap = as_real(softcap, "softcap", expected)
    if not 0 <= softcap < math.inf:
        raise ValueError(f"softcap must be {expected}; got {softcap!r}")
    return softcap


def check_options(softmax_scale, causal, window_size, softcap):
    """(window, scale, softcap) of flash-attn's options, checked: what a plan depends on."""
    if (window_size is NO_WINDOW and softmax_scale is None and type(softcap) is float
            and softcap == 0.0 and type(causal) is bool):  # the defaults (the usual decode
        return _DEFAULT_OPTIONS[causal]                     # call): nothing to check
    causal = check_flag(causal, "causal")
    return (check_window(window_size, causal), check_scale(softmax_scale, "softmax_scale"),
            check_softcap(softcap))


def window_ints(window_size):
    """flash-attn's (left, right) as two Python ints >= -1 (entries may be any integer
    as_index takes, as flash-attn's own tests pass 0-d CPU tensors)."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right); got {window_size!r}") from None
    if type(left) is not int or type(right) is not int or left < -1 or right < -1:
        left, right = (as_index(side, f"window_size {n}", -1, "an int >= -1 (-1 = unbounded)")
                       for side, n in ((left, "left"), (right, "right")))
    return left, right


def check_window(window_size, causal):
    """flash-attn's (left, right) with -1 = unbounded -> kernel bounds; causal caps right at 0."""
    left, right = window_ints(window_size)
    left = UNBOUNDED if left < 0 else min(left, UNBOUNDED)
    right = UNBOUNDED if right < 0 else min(right, UNBOUNDED)
    if causal:
        right = 0
    return left, right


def check_alibi(a, q, batch, nheads):
    if a is None:
        return
    if a.dtype != "float32":
        raise TypeError(f"alibi_slopes must be float32; got {a.dtype}")
    if a.device != q.device:
        raise ValueError(f"alibi_slopes is on cuda:{a.device} but q is on cuda:{q.device}")
    if a.shape not in ((nheads,), (batch, nheads)):
        raise ValueError(f"alibi_slopes must have shape ({nheads},) or ({batch}, {nheads}); "
                         f"got {a.shape}")
    if a.strides[-1] != 1 and nheads > 1:
        raise ValueError(f"alibi_slopes must be contiguous over heads; got strides {a.strides}")


def check_sink(s, q, nheads, q_name="q"):
    """learnable_sink: float32, float16 or bfloat16 (nheads,), one logit a query head."""
    if s is None:
        return
    if s.dtype not in _params.SINK_DTYPES:
        raise TypeError(f"learnable_sink must be float32, float16 or bfloat16; got {s.dtype}")
    if s.shape != (nheads,):
        raise ValueError(f"learnable_sink must have shape ({nheads},), one logit a query head of "
                         f"{q_name}; got {s.shape}")
    if s.strides[0] != 1 and nheads > 1:
        raise ValueError(f"learnable_sink must be contiguous; got stride {s.strides[0]}")
    if s.ptr % s.itemsize:
        raise ValueError(f"learnable_sink must start at a multiple of its {s.itemsize}-byte "
                         f"elements; got address {s.ptr:#x}")
    if s.device != q.device:
        raise ValueError(f"learnable_sink is on cuda:{s.device} but {q_name} is on "
                         f"cuda:{q.device}")


def sink_without_grad(sink, differentiable=False):
    """A torch learnable_sink that requires grad (an nn.Parameter): detached where autograd
    records nothing (torch.no_grad, inference_mode), so inference passes the parameter as it
    is. Where autograd records: kept for a differentiable call (its gradient is the
    backward's dsink), refused by the others, whose gradient would be lost without a word."""
    if getattr(sink, "requires_grad", False):  # (torch tensors have the attribute)
        import torch
        if torch.is_grad_enabled():
            if differentiable:
                return sink
            raise NotImplementedError(
                "learnable_sink requires grad, but this cufa function has no backward pass: "
                "pass learnable_sink.detach(), or call under torch.no_grad() or "
                "torch.inference_mode()")
        return sink.detach()
    return sink


def check_attn_mask(m, q, full_shape):
    if m is None:
        return
    if m.dtype not in ATTN_MASK_TYPES:
        raise TypeError(f"attn_mask must be bool or float16/bfloat16/float32; got {m.dtype}")
    if m.device != q.device:
        raise ValueError(f"attn_mask is on cuda:{m.device} but query is on cuda:{q.device}")
    if m.ndim > 4 or any(n not in (1, f) for n, f in zip(m.shape[::-1], full_shape[::-1])):
        raise ValueError(f"attn_mask of shape {m.shape} is not broadcastable to "
                         f"(batch, heads, L, S) = {full_shape}")


def check_cu_seqlens(c, name, q):
    if c.dtype != "int32":
        raise TypeError(f"{name} must be int32; got {c.dtype}")
    if c.ndim != 1 or c.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D (batch + 1,); got shape {c.shape}")
    if c.strides[0] != 1 and c.shape[0] > 1:
        raise ValueError(f"{name} must be contiguous; got stride {c.strides[0]}")
    if c.device != q.device:
        raise ValueError(f"{name} is on cuda:{c.device} but q is on cuda:{q.device}")


def check_cu_values(cu_q, name_q, total_q, cu_k, name_k, total_k, used, max_keys=None):
    """The checks that read values: one copy to the host (a device sync). max_keys: what a
    sequence's keys may number at most (a paged batch: its block table's pages)."""
    host = {n: _interop.to_numpy(x) for x, n in ((cu_q, name_q), (cu_k, name_k))}
    for (n, c), total in zip(host.items(), (total_q, total_k)):
        if c[0] != 0:
            raise ValueError(f"{n} must start at 0; got {int(c[0])}")
        if (c[1:] < c[:-1]).any():
            i = int((c[1:] < c[:-1]).argmax())
            raise ValueError(f"{n} must be non-decreasing; {n}[{i + 1}] = {int(c[i + 1])} < "
                             f"{n}[{i}] = {int(c[i])}")
        if total is not None and c[-1] != total:  # (None: keys in a paged cache)
            raise ValueError(f"{n} ends at {int(c[-1])} but the tensor has {total} rows")
    keys = host[name_k][1:] - host[name_k][:-1]  # (each key sequence's length)
    if used is not None:
        u = _interop.to_numpy(used)
        if (u < 0).any() or (u > keys).any():
            i = int(((u < 0) | (u > keys)).argmax())
            raise ValueError(f"seqused_k[{i}] = {int(u[i])} is outside [0, {int(keys[i])}], "
                             f"the length of key sequence {i}")
        keys = u
    if max_keys is not None and (keys > max_keys).any():
        i = int((keys > max_keys).argmax())
        raise ValueError(f"key sequence {i} has {int(keys[i])} keys "
                         f"({'seqused_k' if used is not None else name_k}), more than the "
                         f"{max_keys} its row of block_table holds")


def check_out(out, o, q, name="out", head_dim=None):
    """out: the caller's array (or None); o: its view; head_dim: out's, where not q's (a
    head dim of v's own). -> whether the output is chunk_aligned (a new one, contiguous,
    is where its head dim is a multiple of 8)."""
    shape = q.shape if head_dim is None else q.shape[:-1] + (head_dim,)
    if o is None:
        return shape[-1] % 8 == 0
    if o.framework != q.framework:
        raise TypeError(f"{name} is a {o.framework} array but q is a {q.framework} array")
    if _interop.is_jax(out):
        raise TypeError(f"{name} is a JAX array, and JAX arrays are immutable; "
                        "call without out= to get a new one")
    if o.shape != shape or o.dtype != q.dtype:
        what = "q's shape" if head_dim is None else "the shape of q with v's head dim,"
        raise ValueError(f"{name} must have {what} {shape} and dtype {q.dtype}; got "
                         f"{o.shape} {o.dtype}")
    if o.device != q.device:
        raise ValueError(f"{name} is on cuda:{o.device} but q is on cuda:{q.device}")
    aligned = check_loadable(o, name)
    check_rows_apart(o, name)
    return aligned


# -- the fp8 forward ---------------------------------------------------------------------------

def check_fp8_dense(q, k, v, o, out, descales):
    """flash_attn_func's arrays with q, k, v in FP8_CACHE (views; o: out='s view, out the
    caller's; descales: the (q, k, v)_descale views or None) -> out's dtype: the fp8
    forward reads whole 16-byte chunks of e4m3 rows, of head dims up to 256."""
    _check_fp8_qkv(q, k, v, "(batch, seqlen, nheads, headdim)", 4)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k has batch {k.shape[0]} but q has {q.shape[0]}")
    for x, n in zip(descales, ("q_descale", "k_descale", "v_descale")):
        if x is not None:
            _check_descale(x, n, q, q.shape[0], k.shape[2])
    return _fp8_out_dtype(o, q)


def check_fp8_packed(q, k, v, cu_q, cu_k, used, table, o, out, descales):
    """flash_attn_varlen_func's arrays with q, k, v in FP8_CACHE (views, as
    check_fp8_dense's; k and v a paged cache with block_table) -> (batch, out's dtype,
    check_block_table's dict or None)."""
    if table is None:
        _check_fp8_qkv(q, k, v, "(total_rows, nheads, headdim)", 3)
    else:
        _check_fp8_qkv(q, k, v, "(total_rows, nheads, headdim)", 3,
                       "(num_pages, page_size, nheads_k, headdim) with block_table", 4)
    batch = check_cu_seqlens_pair(cu_q, cu_k, q)
    paged = None if table is None else check_block_table(table, k, q, batch)
    if used is not None:
        check_int32_vector(used, "seqused_k", batch, q)
    for x, n in zip(descales, ("q_descale", "k_descale", "v_descale")):
        if x is not None:
            _check_descale(x, n, q, batch, k.shape[-2])
    return batch, _fp8_out_dtype(o, q), paged


def check_cu_seqlens_pair(cu_q, cu_k, q):
    """cu_seqlens_q and cu_seqlens_k of one packed batch (int32, (batch + 1,) both, on q's
    device) -> batch."""
    check_cu_seqlens(cu_q, "cu_seqlens_q", q)
    check_cu_seqlens(cu_k, "cu_seqlens_k", q)
    batch = cu_q.shape[0] - 1
    if cu_k.shape[0] != batch + 1:
        raise ValueError(f"cu_seqlens_k has {cu_k.shape[0]} entries but cu_seqlens_q has "
                         f"{batch + 1}; both must be (batch + 1,)")
    return batch


def _check_fp8_qkv(q, k, v, layout, rank, kv_layout=None, kv_rank=None):
    """q, k, v of the fp8 forward: e4m3, rank-D (layout; k and v kv_rank-D, kv_layout, where
    given), one head dim in 16s up to 256, k's and v's shapes alike, GQA heads, rows in
    16-byte chunks."""
    for x, n in ((q, "q"), (k, "k"), (v, "v")):
        want, shape = (rank, layout) if n == "q" or kv_rank is None else (kv_rank, kv_layout)
        if x.ndim != want:
            raise ValueError(f"{n} must be {want}-D {shape}; got shape {x.shape}")
        if x.dtype != FP8_CACHE:
            raise TypeError(f"{n} has dtype {x.dtype}: the fp8 forward (the route q_descale, "
                            f"k_descale and v_descale belong to) takes q, k and v all in "
                            f"{FP8_CACHE} (e4m3); with 16-bit inputs pass no descales")
        if x.framework not in ("torch", "cupy"):
            raise NotImplementedError("the fp8 forward takes PyTorch and CuPy arrays; other "
                                      "DLPack arrays do not export float8")
    check_dtype_device(k, "k", q, "q")
    check_dtype_device(v, "v", q, "q")
    for x, n in ((q, "q"), (k, "k"), (v, "v")):
        check_loadable(x, n)  # (its last dim contiguous)
    d, nheads, nheads_k = q.shape[-1], q.shape[-2], k.shape[-2]
    if not (1 <= d <= _compile.MAX_HEAD_DIM and d % 16 == 0):
        raise ValueError(f"q has head dim {d}; the fp8 forward takes head dims that are "
                         f"multiples of 16 up to {_compile.MAX_HEAD_DIM}")
    if k.shape[-1] != d or v.shape != k.shape:
        raise ValueError(f"k and v must be {kv_layout or layout} alike with q's head dim {d}; "
                         f"got k {k.shape}, v {v.shape}")
    if nheads_k == 0 or nheads % nheads_k:
        raise ValueError(f"q has {nheads} heads, not a multiple of the {nheads_k} heads of k")
    if max(q.shape[-3], k.shape[-3]) > INT32_MAX // 2:
        raise ValueError(f"sequence lengths up to {INT32_MAX // 2} are supported")
    if not all(_fp8_aligned(x) for x in (q, k, v)):
        raise NotImplementedError(
            "the fp8 forward reads e4m3 rows in 16-byte chunks: strides (but the last, 1) "
            "must be multiples of 16 elements and the starts 16-byte aligned; got q "
            f"{q.strides}, k {k.strides}, v {v.strides}")


def _fp8_out_dtype(o, q):
    """The fp8 forward's out: bfloat16, or out='s (float16 or bfloat16, q's shape)."""
    if o is None:
        return "bfloat16"
    if o.framework != q.framework:
        raise TypeError(f"out is a {o.framework} array but q is a {q.framework} array")
    if o.shape != q.shape or o.dtype not in KERNEL_DTYPES:
        raise ValueError(f"out must have q's shape {q.shape} and dtype float16 or bfloat16 "
                         f"(the fp8 forward's output); got {o.shape} {o.dtype}")
    if o.device != q.device:
        raise ValueError(f"out is on cuda:{o.device} but q is on cuda:{q.device}")
    if not check_loadable(o, "out"):
        raise NotImplementedError("the fp8 forward writes out in 16-byte chunks: out's strides "
                                  "must be multiples of 8 elements from a 16-byte aligned start")
    return o.dtype


# -- KV cache --------------------------------------------------------------------------------

def _fp8_cache(q, kc, vc, names=("k_cache", "v_cache")):
    """Whether the cache is e4m3 (FP8_CACHE), after checking that k_cache and v_cache agree
    and that q is 16-bit (names: the cache arguments')."""
    for x, n in ((kc, names[0]), (vc, names[1]), (q, "q")):
        if x.dtype.startswith("float8") and x.dtype != FP8_CACHE:
            raise TypeError(f"{n} has dtype {x.dtype}, which cufa does not support: fp8 KV "
                            f"caches are {FP8_CACHE} (e4m3)")
    if q.dtype == FP8_CACHE:  # (flash_attn_with_kvcache dequantizes one first: api)
        raise NotImplementedError("q in float8_e4m3fn against a KV cache is taken by "
                                  "flash_attn_with_kvcache from PyTorch and JAX arrays only "
                                  "(dequantized to bfloat16 by their ops); pass q in float16 "
                                  "or bfloat16 (q times q_descale)")
    fp8 = kc.dtype == FP8_CACHE
    if fp8 != (vc.dtype == FP8_CACHE):
        raise TypeError(f"{names[0]} has dtype {kc.dtype} but {names[1]} has {vc.dtype}: an "
                        f"fp8 cache holds both in {FP8_CACHE}")
    return fp8


def _fp8_aligned(x):
    """An e4m3 cache's rows in 16-byte chunks: a head dim and strides that are multiples
    of 16 elements, a 16-byte aligned start (as chunk_aligned for 16-bit rows)."""
    if 0 in x.shape:
        return True
    return (x.shape[-1] % 16 == 0 and x.ptr % 16 == 0
            and all(s % 16 == 0 or n == 1 for s, n in zip(x.strides[:-1], x.shape)))


def _fp8_rows_as_q(q, k, v, names):
    """An e4m3 cache's k and v, checked for the 16-byte chunks its kernels read, as views of
    q's dtype (for the checks a 16-bit cache takes)."""
    if not (_fp8_aligned(k) and _fp8_aligned(v)):
        raise NotImplementedError(
            f"an fp8 cache is read in 16-byte chunks: its head dim and strides must be "
            f"multiples of 16 and its start 16-byte aligned; got {names[0]} {k.shape} with "
            f"strides {k.strides}, {names[1]} {v.shape} with strides {v.strides}")
    return tuple(_interop.DeviceArray(x.obj, x.framework, x.ptr, x.shape, x.strides, q.dtype,
                                      x.device, q.itemsize) for x in (k, v))


def check_descales(kd, vd, kc, q, batch, nheads_k, fp8, cache="k_cache"):
    """k_descale, v_descale: float32 (batch, nheads_k), or one scale ((1,) or 0-d), on q's
    device; only with an fp8 cache (cache: its argument's name)."""
    for x, n in ((kd, "k_descale"), (vd, "v_descale")):
        if x is None:
            continue
        if not fp8:
            raise TypeError(f"{n} applies to {FP8_CACHE} caches; {cache} has dtype {kc.dtype}")
        _check_descale(x, n, q, batch, nheads_k)


def _check_descale(x, n, q, batch, nheads_k):
    """One descale `n`: float32 (batch, nheads_k), or one scale ((1,) or 0-d), on q's device."""
    check_descale_dtype_and_shape(x.dtype, x.shape, n, batch, nheads_k)
    if x.device != q.device:
        raise ValueError(f"{n} is on cuda:{x.device} but q is on cuda:{q.device}")


def check_descale_dtype_and_shape(dtype, shape, n, batch, nheads_k):
    """A descale `n` by its dtype's name and its shape (what a traced array has too)."""
    if dtype != "float32":
        raise TypeError(f"{n} must be float32; got {dtype}")
    if shape not in ((batch, nheads_k), (1,), ()):
        raise ValueError(f"{n} must be float32 (batch, nheads_k) = ({batch}, {nheads_k}), "
                         f"or (1,) or 0-d for one scale; got shape {shape}")


def check_cache(q, kc, vc, kn, vn, table, idx, head_dim_v=None):
    """The cache (and new keys) against q; returns (paged dict or None, capacity, cache_rows,
    whether q and the cache are chunk_aligned). The new keys are written into the cache an
    element at a time (decode_append): their alignment does not count. An fp8 (e4m3)
    cache is checked as a cache of q's dtype would be, and must be 16-byte aligned (so
    must q and out: no element-wise variant reads it). head_dim_v: v_cache's (and v's)
    where it has one of its own (MLA's latent rows), else None."""
    cache = ("(num_pages, page_size, nheads_k, headdim)" if table is not None
             else "(batch_cache, seqlen_cache, nheads_k, headdim)")
    fp8 = _fp8_cache(q, kc, vc)
    if fp8:
        if kc.framework not in ("torch", "cupy"):  # (JAX's come as XLA buffers, "cupy")
            raise NotImplementedError("fp8 caches are taken from PyTorch, CuPy and JAX "
                                      "arrays; other DLPack arrays do not export float8")
        kc, vc = _fp8_rows_as_q(q, kc, vc, ("k_cache", "v_cache"))
    # what flash_attn_func checks of q, k, v; the batch dims may differ (cache_batch_idx, pages)
    aligned = check_qkv(q, kc, vc if head_dim_v is None else kc, ("q", "k_cache", "v_cache"),
                        f"(q: (batch, seqlen_q, nheads, headdim), cache: {cache})",
                        batch_dim=None, seq_dim=1, head_dim=2,
                        max_head_dim=_compile.MAX_HEAD_DIM if fp8 else _compile.WIDE_HEAD_DIM)
    if head_dim_v is not None:  # (v_cache: k_cache's rows of its own head dim)
        if vc.ndim != 4 or vc.shape != kc.shape[:-1] + (head_dim_v,):
            raise ValueError(f"v_cache must be {cache} = {kc.shape[:-1] + (head_dim_v,)} "
                             f"(k_cache's with head dim {head_dim_v}); got shape {vc.shape}")
        check_dtype_device(vc, "v_cache", q, "q")
        aligned = check_loadable(vc, "v_cache") and aligned
    if fp8:
        aligned = chunk_aligned(q.shape, q.strides, q.ptr)
    batch, d, nheads_k = q.shape[0], q.shape[3], kc.shape[2]
    if table is not None:
        if idx is not None:
            raise ValueError("cache_batch_idx does not apply to a paged cache: block_table "
                             "already says where each sequence's keys live")
        paged = check_block_table(table, kc, q, batch)
        capacity, cache_rows = paged["capacity"], paged["num_pages"]
    else:
        paged, capacity, cache_rows = None, kc.shape[1], kc.shape[0]
        if batch and kc.shape[0] == 0:
            raise ValueError("k_cache has no rows (its dim 0 is 0)")
        if idx is None and kc.shape[0] != batch:
            raise ValueError(f"k_cache has batch {kc.shape[0]} but q has {batch}; pass "
                             "cache_batch_idx to pick cache rows")
    if (kn is None) != (vn is None):
        raise ValueError("k and v must be given together (the new keys and their values)")
    if kn is not None:
        expected = (batch, kn.shape[1] if kn.ndim == 4 else -1, nheads_k, d)
        for x, n in ((kn, "k"), (vn, "v")):
            if n == "v" and head_dim_v is not None:
                expected = expected[:-1] + (head_dim_v,)
            if x.ndim != 4 or x.shape != expected:
                raise ValueError(f"{n} must be (batch, seqlen_new, nheads_k, headdim) = "
                                 f"{expected}; got shape {x.shape}"
                                 + (f" (head dim {x.shape[-1]} but the cache has {d})"
                                    if x.ndim == 4 and x.shape[-1] != d else ""))
            check_dtype_device(x, n, q, "q")
            check_loadable(x, n)
        if kn.shape[1] > capacity:
            raise ValueError(f"k has {kn.shape[1]} new tokens but the cache holds at most "
                             f"{capacity} per sequence")
        check_rows_apart(kc, "k_cache")
        check_rows_apart(vc, "v_cache")
    return paged, capacity, cache_rows, aligned


def check_rotary(cos, sin, q, d, capacity):
    """-> (rotary_dim, seqlen_ro); (0, 0) without rotary."""
    if cos is None and sin is None:
        return 0, 0
    if cos is None or sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together")
    for x, n in ((cos, "rotary_cos"), (sin, "rotary_sin")):
        if x.dtype not in ROTARY_DTYPES or x.dtype not in (q.dtype, "float32"):
            raise TypeError(f"{n} must have q's dtype ({q.dtype}) or float32; got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{n} is on cuda:{x.device} but q is on cuda:{q.device}")
        if x.ndim != 2 or x.shape != cos.shape:
            raise ValueError(f"{n} must be 2-D (seqlen_ro, rotary_dim / 2), the shape of "
                             f"rotary_cos; got {x.shape}")
        if x.shape[1] > 1 and x.strides[1] != 1 or x.shape[0] > 1 and x.strides[0] != x.shape[1]:
            raise ValueError(f"{n} must be contiguous; got strides {x.strides}")
    seqlen_ro, rotary_dim = cos.shape[0], 2 * cos.shape[1]
    if not 0 < rotary_dim <= d:
        raise ValueError(f"rotary_cos gives rotary_dim {rotary_dim} (2 x its dim 1); it must be "
                         f"from 2 to the head dim {d}")
    if seqlen_ro < capacity:
        raise ValueError(f"rotary_cos has {seqlen_ro} positions but the cache has {capacity}; "
                         "it must cover every cache position")
    return rotary_dim, seqlen_ro


def check_cache_values(plan, seqlens, leftpad, table, batch_idx=None, cache_rows=0):
    """check_inputs=True: the device values, read once (a sync). batch_idx: the
    cache_batch_idx view, whose entries must name cache rows (cache_rows of them), each
    once where the call appends (two sequences would write one row)."""
    if batch_idx is not None:
        rows = _interop.to_numpy(batch_idx)
        bad = (rows < 0) | (rows >= cache_rows)
        if bad.any():
            b = int(bad.argmax())
            raise ValueError(f"cache_batch_idx[{b}] = {int(rows[b])} is not a row of the cache "
                             f"(0 to {cache_rows - 1})")
        if plan.seqlen_new and len(np.unique(rows)) < len(rows):
            _, first, counts = np.unique(rows, return_index=True, return_counts=True)
            row = int(rows[first[counts > 1][0]])
            raise ValueError(f"cache_batch_idx names cache row {row} more than once, and the "
                             "call appends k and v: two sequences would write one row")
    lens = _interop.to_numpy(seqlens) if seqlens is not None else None
    if lens is not None:
        bad = (lens < 0) | (lens + plan.seqlen_new > plan.capacity)
        if bad.any():
            b = int(bad.argmax())
            raise ValueError(f"cache_seqlens[{b}] = {int(lens[b])}: with {plan.seqlen_new} new "
                             f"tokens it must lie in [0, {plan.capacity - plan.seqlen_new}] (the "
                             f"cache holds {plan.capacity} positions)")
    if leftpad is not None:
        pad = _interop.to_numpy(leftpad)
        ends = (lens if lens is not None else plan.fixed_seqlen) + plan.seqlen_new
        bad = (pad < 0) | (pad > ends)
        if bad.any():
            b = int(bad.argmax())
            raise ValueError(f"cache_leftpad[{b}] = {int(pad[b])} lies outside [0, "
                             f"cache_seqlens[{b}] + seqlen_new]")
    if table is not None:
        check_page_ids(table, plan.num_pages)


# -- each entry point's arrays -------------------------------------------------------------

def check_dense(a, out):
    """flash_attn_func's arrays (a: an _arrays.Dense of views, its out the view of the
    caller's out=) -> whether q, k, v and the output are chunk_aligned."""
    q, k, v, alibi, sink, o = a.q, a.k, a.v, a.alibi_slopes, a.learnable_sink, a.out
    aligned = check_qkv(q, k, v, ("q", "k", "v"), "(batch, seqlen, nheads, headdim)",
                        batch_dim=0, seq_dim=1, head_dim=2, own_v_head_dim=True,
                        max_head_dim=_compile.WIDE_HEAD_DIM)
    batch, _, nheads, _ = q.shape
    check_alibi(alibi, q, batch, nheads)
    check_sink(sink, q, nheads)
    aligned = check_out(out, o, q, head_dim=_v_head_dim(q, v)) and aligned
    _aligned_for_own_v_head_dim(q, v, aligned)
    return aligned


def _v_head_dim(q, v):
    """out's head dim where v has one of its own, else None (q's)."""
    return v.shape[-1] if v.shape[-1] != q.shape[-1] else None


def _aligned_for_own_v_head_dim(q, v, aligned):
    if _v_head_dim(q, v) is not None and not aligned:
        raise NotImplementedError("with a head dim of v's own, q, k, v and out must be "
                                  "16-byte aligned rows (head dims and strides that are "
                                  "multiples of 8)")


def check_packed(a, out):
    """flash_attn_varlen_func's arrays (an _arrays.Packed of views) -> (batch,
    check_block_table's dict or None, whether q, k, v and the output are chunk_aligned)."""
    q, k, v, cu_q, cu_k, used = a.q, a.k, a.v, a.cu_seqlens_q, a.cu_seqlens_k, a.seqused_k
    alibi, table, sink, o = a.alibi_slopes, a.block_table, a.learnable_sink, a.out
    paged = None
    fp8 = _fp8_cache(q, k, v, ("k", "v"))
    if fp8:  # an e4m3 paged cache, checked as one of q's dtype would be
        if table is None:
            raise NotImplementedError(f"k and v in {FP8_CACHE} are taken as a paged KV cache "
                                      "(with block_table); pass contiguous k, v in q's dtype")
        k, v = _fp8_rows_as_q(q, k, v, ("k", "v"))
    if table is None:
        aligned = check_qkv(q, k, v, ("q", "k", "v"), "(total_rows, nheads, headdim)",
                            batch_dim=None, seq_dim=0, head_dim=1, own_v_head_dim=True,
                            max_head_dim=_compile.WIDE_HEAD_DIM)
    else:  # k, v: (pages, page_size, nheads_k, d); checked as one "batch" of pages
        if q.ndim != 3:
            raise ValueError(f"q must be 3-D (total_rows, nheads, headdim); got shape "
                             f"{q.shape}")
        aligned = check_qkv(with_leading_one(q), k, v, ("q", "k", "v"),
                            "(num_pages, page_size, nheads_k, headdim) with block_table",
                            batch_dim=None, seq_dim=1, head_dim=2,
                            max_head_dim=_compile.MAX_HEAD_DIM if fp8 else _compile.WIDE_HEAD_DIM)
    nheads = q.shape[1]
    batch = check_cu_seqlens_pair(cu_q, cu_k, q)
    if table is not None:
        paged = check_block_table(table, k, q, batch)
    if used is not None:
        check_int32_vector(used, "seqused_k", batch, q)
    check_alibi(alibi, q, batch, nheads)
    check_sink(sink, q, nheads)
    check_descales(a.k_descale, a.v_descale, a.k, q, batch, k.shape[-2], fp8, "k")
    if fp8:
        aligned = chunk_aligned(q.shape, q.strides, q.ptr)
    aligned = check_out(out, o, q, head_dim=_v_head_dim(q, v)) and aligned
    _aligned_for_own_v_head_dim(q, v, aligned)
    if fp8 and not aligned:
        raise NotImplementedError("with an fp8 cache, q and out must be 16-byte aligned rows "
                                  "(a head dim and strides that are multiples of 8)")
    return batch, paged, aligned


def check_sdpa(a, enable_gqa):
    """scaled_dot_product_attention's arrays (an _arrays.Sdpa of views) -> whether they and
    the (new, contiguous) output are chunk_aligned."""
    q, k, v, mask, sink = a.query, a.key, a.value, a.attn_mask, a.learnable_sink
    aligned = check_qkv(q, k, v, ("query", "key", "value"), "(batch, heads, L, E)",
                        batch_dim=0, seq_dim=2, head_dim=1)
    batch, nheads, seqlen_q, _ = q.shape
    nheads_k, seqlen_k = k.shape[1], k.shape[2]
    if nheads_k != nheads and not enable_gqa:
        raise ValueError(f"key has {nheads_k} heads but query has {nheads}; "
                         "pass enable_gqa=True for grouped-query attention")
    check_attn_mask(mask, q, (batch, nheads, seqlen_q, seqlen_k))
    check_sink(sink, q, nheads, "query")
    return aligned and q.shape[-1] % 8 == 0


def check_num_splits(num_splits):
    """num_splits as a Python int from 0 to _compile.MAX_SPLITS (any integer as_index
    takes)."""
    expected = f"an int from 0 to {_compile.MAX_SPLITS} (0 = chosen from the shapes)"
    num_splits = as_index(num_splits, "num_splits", 0, expected)
    if num_splits > _compile.MAX_SPLITS:
        raise ValueError(f"num_splits must be {expected}; got {num_splits}")
    return num_splits


def check_mla(a):
    """flash_attn_with_kvcache's MLA form (qv given, FlashAttention-3's): q and k_cache the
    rotary part (MLA_ROPE_DIM), qv and v_cache the latent one (MLA_LATENT_DIM), which is
    also the value; the caches 16-bit (q's dtype) or both e4m3 (k_descale scales k_pe,
    v_descale c_kv); what the MLA kernel does not take raises. -> v's head dim."""
    q, qv, kc, vc = a.q, a.qv, a.k_cache, a.v_cache
    rope, latent = _compile.MLA_ROPE_DIM, _compile.MLA_LATENT_DIM
    for x, n, d, what in ((q, "q", rope, "the rotary part of the queries"),
                          (kc, "k_cache", rope, "the rotary part of the keys, k_pe"),
                          (qv, "qv", latent, "the absorbed queries"),
                          (vc, "v_cache", latent, "the latent rows, c_kv")):
        if x.ndim != 4 or x.shape[-1] != d:
            raise ValueError(f"with qv (MLA decode), {n} ({what}) must be 4-D with head dim "
                             f"{d}; got shape {x.shape}")
    if qv.shape != q.shape[:-1] + (latent,):
        raise ValueError(f"qv must be (batch, seqlen_q, nheads, {latent}) = "
                         f"{q.shape[:-1] + (latent,)}, q's rows; got shape {qv.shape}")
    check_dtype_device(qv, "qv", q, "q")
    check_loadable(qv, "qv")
    if not chunk_aligned(qv.shape, qv.strides, qv.ptr):
        raise ValueError("qv needs rows that move in 16-byte chunks: strides that are "
                         "multiples of 8 elements and a 16-byte aligned start")
    for x, n in ((a.alibi_slopes, "alibi_slopes"), (a.learnable_sink, "learnable_sink")):
        if x is not None:
            raise NotImplementedError(f"{n} is not supported with qv (MLA decode)")
    return latent


def check_kvcache(a, out, fixed):
    """flash_attn_with_kvcache's arrays (a: an _arrays.KvCache of views; out: the caller's
    out=; fixed: the int form of cache_seqlens, or None) -> (paged dict or None, capacity,
    cache_rows, fixed: the whole capacity where no lengths were given, rotary_dim,
    seqlen_ro, whether q, the cache and the output are chunk_aligned)."""
    q, kc, vc, kn, vn, o = a.q, a.k_cache, a.v_cache, a.k, a.v, a.out
    seqlens, idx, leftpad, table = a.cache_seqlens, a.cache_batch_idx, a.cache_leftpad, a.block_table
    head_dim_v = check_mla(a) if a.qv is not None else None
    paged, capacity, cache_rows, aligned = check_cache(q, kc, vc, kn, vn, table, idx,
                                                       head_dim_v)
    batch, seqlen_q, nheads, d = q.shape
    nheads_k = kc.shape[2]
    seqlen_new = kn.shape[1] if kn is not None else 0
    for x, n in ((seqlens, "cache_seqlens"), (idx, "cache_batch_idx"),
                 (leftpad, "cache_leftpad")):
        if x is not None:
            check_int32_vector(x, n, batch, q)
    if seqlens is None and fixed is None:
        if kn is not None:
            raise ValueError("cache_seqlens is required with k and v: it says where the new "
                             "tokens go")
        fixed = capacity
    if fixed is not None and fixed + seqlen_new > capacity:
        raise ValueError(f"cache_seqlens = {fixed} plus {seqlen_new} new tokens exceeds the "
                         f"cache's {capacity} positions")
    rotary_dim, seqlen_ro = check_rotary(a.rotary_cos, a.rotary_sin, q, d, capacity)
    check_alibi(a.alibi_slopes, q, batch, nheads)
    check_sink(a.learnable_sink, q, nheads)
    aligned = check_out(out, o, q, head_dim=head_dim_v) and aligned
    if head_dim_v is not None and not aligned:
        raise ValueError("with qv (MLA decode), q, qv, k_cache, v_cache and out need rows "
                         "that move in 16-byte chunks: contiguous last dims, strides that "
                         "are multiples of 8 elements, 16-byte aligned starts")
    check_descales(a.k_descale, a.v_descale, kc, q, batch, nheads_k, kc.dtype == FP8_CACHE)
    if kc.dtype == FP8_CACHE and not aligned:
        raise NotImplementedError("with an fp8 cache, q and out must be 16-byte aligned rows "
                                  "(a head dim and strides that are multiples of 8)")
    if d > _compile.MAX_HEAD_DIM and not aligned:
        raise NotImplementedError(
            f"head dim {d} (over {_compile.MAX_HEAD_DIM}) needs a head dim that is a multiple "
            "of 8, and q, the caches and out in 16-byte aligned rows (strides that are "
            "multiples of 8 elements)")
    if batch > GRID_YZ_MAX or nheads_k > GRID_YZ_MAX:
        raise ValueError(f"batch and nheads_k up to {GRID_YZ_MAX} are supported; got "
                         f"{batch}, {nheads_k}")
    if max(batch * seqlen_q * nheads, batch * seqlen_new * nheads_k) * 4 > INT32_MAX:
        raise ValueError("problem too large: more than 2^29 query or new-key rows")
    return paged, capacity, cache_rows, fixed, rotary_dim, seqlen_ro, aligned


def check_merge(a, out):
    """merge_attention_states' arrays (an _arrays.Merge of views) -> (packed, batch, rows,
    nheads, lse_shape)."""
    oa, la, ob, lb, o = a.out_a, a.lse_a, a.out_b, a.lse_b, a.out
    for x, n in ((oa, "out_a"), (ob, "out_b")):
        if x.dtype not in MERGE_DTYPES:
            raise TypeError(f"{n} must be float16, bfloat16 or float32; got {x.dtype}")
        if x.ndim not in (3, 4):
            raise ValueError(f"{n} must be (batch, seqlen, nheads, headdim) or packed "
                             f"(total, nheads, headdim); got shape {x.shape}")
    if ob.shape != oa.shape or ob.dtype != oa.dtype:
        raise ValueError(f"out_b is {ob.shape} {ob.dtype} but out_a is {oa.shape} {oa.dtype}; "
                         "they must match")
    packed = oa.ndim == 3
    rows, nheads = (oa.shape[0], oa.shape[1]) if packed else (oa.shape[1], oa.shape[2])
    batch = 1 if packed else oa.shape[0]
    lse_shape = (nheads, rows) if packed else (batch, nheads, rows)
    for x, n in ((la, "lse_a"), (lb, "lse_b")):
        if x.dtype != "float32":
            raise TypeError(f"{n} must be float32; got {x.dtype}")
        if x.shape != lse_shape:
            raise ValueError(f"{n} must have shape {lse_shape} for outputs of shape "
                             f"{oa.shape}; got {x.shape}")
    for x, n in ((la, "lse_a"), (ob, "out_b"), (lb, "lse_b")):
        if x.device != oa.device:
            raise ValueError(f"{n} is on cuda:{x.device} but out_a is on cuda:{oa.device}")
        if x.framework != oa.framework:
            raise TypeError(f"{n} is a {x.framework} array but out_a is a {oa.framework} array")
    if o is not None:
        if _interop.is_jax(out):
            raise TypeError("out is a JAX array, and JAX arrays are immutable; call without out=")
        if o.shape != oa.shape or o.dtype != oa.dtype or o.device != oa.device:
            raise ValueError(f"out must have out_a's shape {oa.shape} and dtype {oa.dtype} on "
                             f"cuda:{oa.device}; got {o.shape} {o.dtype} on cuda:{o.device}")
    if batch * rows * nheads * 4 > INT32_MAX:
        raise ValueError("problem too large: more than 2^29 rows")
    return packed, batch, rows, nheads, lse_shape
